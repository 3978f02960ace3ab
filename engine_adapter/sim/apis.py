"""The simulated engine's OpenAI Responses and Anthropic Messages routes.

Shapes follow vLLM 0.32 (``entrypoints/openai/responses/``, ``entrypoints/anthropic/``),
reduced to what accounting and the official SDKs need:

- Responses: the prompt is the chat vLLM renders: ``instructions`` (when not empty) as a
  system message, then a string ``input`` as a user message or its message items as they are
  (``input_text`` parts read as text). ``usage.input_tokens`` is the whole prompt and, as vLLM always writes it,
  ``input_tokens_details.cached_tokens`` and ``cache_write_tokens`` (unless the engine is
  told to drop the number, ``reported=None``). A stream is ``event:``/``data:`` pairs,
  ``"usage": null`` until the terminal event: ``response.completed`` when the sim stopped
  at its own default length, ``response.incomplete`` when it hit ``max_output_tokens``.
- Messages: ``input_tokens`` excludes reads and writes only when they are reported (vLLM
  with ``--enable-prompt-tokens-details``); otherwise it is the whole prompt and the cache
  fields are absent. A stream: ``message_start`` (the whole prompt as ``input_tokens``, no
  cache fields even when reported: vLLM's first chunk has no details yet), one content
  block, ``message_delta`` with the final usage, ``message_stop``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from engine_adapter.sim.protocol import RequestError, generated_token, lax_bool, request_object
from engine_adapter.sim.tokenizer import render_chat, tokenize

#: (reads, writes) as the engine reports them, or ``None`` when it drops them.
Reported = tuple[int, int] | None


@dataclass(slots=True)
class ApiRequest:
    api: str  # responses | messages
    model: str
    prompt: list[int]
    max_tokens: int
    hit_limit: bool  # max tokens came from the request (Responses: incomplete)
    stream: bool


def _max(body: dict[str, Any], name: str, default: int | None) -> tuple[int, bool]:
    value = body.get(name)
    if value is None:
        if default is None:
            raise RequestError(f"Field required: `{name}`", param=name)
        return default, False
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RequestError(f"`{name}` must be an integer >= 1", param=name)
    return value, True


def parse(raw: bytes, api: str, model: str, default_max_tokens: int) -> ApiRequest:
    body = request_object(raw, model)
    try:
        if api == "responses":
            # As vLLM renders it: instructions (when not empty) first, as a system message.
            given, instructions = body.get("input"), body.get("instructions")
            system = [{"role": "system", "content": instructions}] if instructions else []
            messages = system + ([{"role": "user", "content": given}] if isinstance(given, str) else given)
            max_tokens, limit = _max(body, "max_output_tokens", default_max_tokens)
        else:
            system = body.get("system")
            messages = ([{"role": "system", "content": system}] if system else []) + list(body.get("messages") or [])
            max_tokens, limit = _max(body, "max_tokens", None)
        prompt = tokenize(render_chat(messages))
    except (TypeError, ValueError) as exc:
        raise RequestError(str(exc)) from None
    return ApiRequest(api, model, prompt, max_tokens, limit, lax_bool(body.get("stream"), "stream"))


def _event(kind: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **payload}) + b"\n\n"


# -- Responses -------------------------------------------------------------------------------


def responses_usage(prompt: int, output: int, reported: Reported) -> dict[str, Any]:
    out: dict[str, Any] = {"input_tokens": prompt}
    if reported is not None:
        out["input_tokens_details"] = {"cached_tokens": reported[0], "cache_write_tokens": reported[1]}
    out |= {"output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + output}
    return out


def response_object(req: ApiRequest, rid: str, text: str, usage: dict[str, Any] | None, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}] if usage is not None else []
    output = [{"type": "message", "id": f"msg_{rid}", "role": "assistant", "status": "completed",
               "content": content}] if usage is not None else []
    return {
        "id": f"resp_{rid}", "object": "response", "created_at": int(time.time()), "model": req.model,
        "status": status, "output": output, "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "usage": usage,
    }


def _status(req: ApiRequest) -> str:
    return "incomplete" if req.hit_limit else "completed"


def responses_json(req: ApiRequest, rid: str, reported: Reported) -> dict[str, Any]:
    text = "".join(generated_token(k) for k in range(req.max_tokens))
    usage = responses_usage(len(req.prompt), req.max_tokens, reported)
    return response_object(req, rid, text, usage, _status(req))


async def responses_stream(req: ApiRequest, rid: str, reported: Reported,
                           step: Callable[[], Any]) -> AsyncIterator[bytes]:
    seq = iter(range(1 << 30))
    head = response_object(req, rid, "", None, "in_progress")
    yield _event("response.created", {"response": head, "sequence_number": next(seq)})
    item = {"type": "message", "id": f"msg_{rid}", "role": "assistant", "status": "in_progress", "content": []}
    yield _event("response.output_item.added", {"item": item, "output_index": 0, "sequence_number": next(seq)})
    part = {"type": "output_text", "text": "", "annotations": []}
    where = {"item_id": f"msg_{rid}", "output_index": 0, "content_index": 0}
    yield _event("response.content_part.added", {**where, "part": part, "sequence_number": next(seq)})
    text = ""
    for k in range(req.max_tokens):
        await step()
        text += generated_token(k)
        yield _event("response.output_text.delta", {**where, "delta": generated_token(k), "logprobs": [],
                                                     "sequence_number": next(seq)})
    yield _event("response.output_text.done", {**where, "text": text, "logprobs": [], "sequence_number": next(seq)})
    yield _event("response.content_part.done", {**where, "part": {**part, "text": text},
                                                 "sequence_number": next(seq)})
    done = {**item, "status": "completed", "content": [{**part, "text": text}]}
    yield _event("response.output_item.done", {"item": done, "output_index": 0, "sequence_number": next(seq)})
    final = responses_json(req, rid, reported)
    yield _event(f"response.{final['status']}", {"response": final, "sequence_number": next(seq)})


# -- Messages --------------------------------------------------------------------------------


def messages_usage(prompt: int, output: int, reported: Reported) -> dict[str, Any]:
    if reported is None:
        return {"input_tokens": prompt, "output_tokens": output}
    reads, writes = reported
    return {"input_tokens": prompt - reads - writes, "output_tokens": output,
            "cache_creation_input_tokens": writes, "cache_read_input_tokens": reads}


def message_object(req: ApiRequest, rid: str, text: str | None, usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": f"msg_{rid}", "type": "message", "role": "assistant",
        "content": [] if text is None else [{"type": "text", "text": text}],
        "model": req.model, "stop_reason": None if text is None else "max_tokens", "stop_sequence": None,
        "usage": usage,
    }


def messages_json(req: ApiRequest, rid: str, reported: Reported) -> dict[str, Any]:
    text = "".join(generated_token(k) for k in range(req.max_tokens))
    return message_object(req, rid, text, messages_usage(len(req.prompt), req.max_tokens, reported))


async def messages_stream(req: ApiRequest, rid: str, reported: Reported,
                          step: Callable[[], Any]) -> AsyncIterator[bytes]:
    prompt = len(req.prompt)
    yield _event("message_start", {"message": message_object(req, rid, None, messages_usage(prompt, 0, None))})
    yield _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
    for k in range(req.max_tokens):
        await step()
        yield _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": generated_token(k)}})
    yield _event("content_block_stop", {"index": 0})
    yield _event("message_delta", {"delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                                   "usage": messages_usage(prompt, req.max_tokens, reported)})
    yield _event("message_stop", {})


def new_id() -> str:
    return uuid.uuid4().hex
