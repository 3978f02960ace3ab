"""Request parsing and response shapes of the simulated engine.

Shapes follow vLLM 0.32's OpenAI server (``chat_completion/serving.py``,
``completion/serving.py``): field order in ``usage`` (``prompt_tokens``, ``total_tokens``,
``completion_tokens``), ``stream_options`` only with ``stream=true``,
``continuous_usage_stats`` only together with ``include_usage``, and errors as
``{"error": {"message", "type", "param", "code"}}``. Plain dicts and orjson, no pydantic:
this is a benchmark hot path. Unlike vLLM, non-stream bodies leave out ``null`` fields
that carry nothing for accounting, and ``usage`` carries no ``prompt_tokens_details``
unless asked to (``cached`` given), like an engine that drops the number. As vLLM's, the
reported figures are the engine's for chat (reads and writes), and one prompt's reads alone
for completions (:func:`reported_figures`); ``system_fingerprint`` is on the JSON body and,
in a stream, on the usage chunk, or on each finishing chunk when there is none.

``stream`` and the ``stream_options`` flags are read as vLLM's pydantic models read them
in lax mode (``"true"``, ``1``, ``"on"`` are true; ``null`` is false; anything else is a
400). :mod:`proxy.patching.request_body` reads them the same way, repeated here on purpose (the
engine adapter does not import the proxy); tests/patching/test_request_body.py holds both against
pydantic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import orjson

from engine_adapter.sim.tokenizer import render_chat, tokenize

Kind = Literal["chat", "completion"]


class RequestError(Exception):
    """A request the engine refuses, with vLLM's error shape for the route."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        err_type: str = "BadRequestError",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.err_type, self.param = message, status, err_type, param

    def body(self, messages: bool = False) -> bytes:
        """OpenAI's error JSON; on the Messages API (``messages``) Anthropic's envelope, as
        vLLM's route translates its errors (``translate_error_response``: the OpenAI type
        name kept, the status as it was)."""
        if messages:
            return orjson.dumps({"type": "error", "error": {"type": self.err_type, "message": self.message}})
        info = {"message": self.message, "type": self.err_type, "param": self.param}
        return orjson.dumps({"error": {**info, "code": self.status}})


_TRUE = frozenset(("1", "on", "t", "true", "y", "yes"))
_FALSE = frozenset(("0", "off", "f", "false", "n", "no"))


def lax_bool(value: Any, name: str) -> bool:
    """An ``Optional[bool]`` field as pydantic's lax mode reads it; a 400 where it refuses."""
    if value is None or value is False or value is True:
        return value is True
    if isinstance(value, (int, float)) and value in (0, 1):
        return value == 1
    if isinstance(value, str) and value.isascii():
        if value.lower() in _TRUE:
            return True
        if value.lower() in _FALSE:
            return False
    raise RequestError(f"`{name}` must be a boolean", param=name)


@dataclass(slots=True)
class SimRequest:
    """A parsed chat or completions request: one token-id list per engine request."""

    kind: Kind
    model: str
    prompts: list[list[int]]
    n: int
    max_tokens: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    #: A disaggregated prefill leg (``kv_transfer_params.do_remote_decode``): its response
    #: carries ``kv_transfer_params`` for the decode leg, as vLLM's with a KV connector does.
    remote_decode: bool = False


def _int_field(body: dict[str, Any], name: str, default: int, minimum: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise RequestError(f"`{name}` must be an integer >= {minimum}", param=name)
    return value


def _completion_prompts(prompt: Any) -> list[list[int]]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        prompts = [tokenize(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = [tokenize(p) for p in prompt]
    elif isinstance(prompt, list) and prompt and all(_is_token_ids(p) for p in prompt):
        prompts = [list(p) for p in prompt]
    elif _is_token_ids(prompt):
        prompts = [list(prompt)]
    else:
        raise RequestError(
            "`prompt` must be a string, a list of strings or a list of token ids", param="prompt"
        )
    if any(not p for p in prompts):
        raise RequestError("Prompt cannot be empty", param="prompt")
    return prompts


def _is_token_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    )


def request_object(raw: bytes, model: str) -> dict[str, Any]:
    """The body as a JSON object for ``model``; :class:`RequestError` with vLLM's status and
    wording when it is not JSON, not an object, or names another model."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"Invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError("Request body must be a JSON object")
    requested = body.get("model")
    if requested is not None and requested != model:
        raise RequestError(
            f"The model `{requested}` does not exist.", 404, "NotFoundError", "model"
        )
    return body


def parse_request(raw: bytes, kind: Kind, model: str, default_max_tokens: int) -> SimRequest:
    """Validate a request body; raise :class:`RequestError` with vLLM's status and wording."""
    body = request_object(raw, model)
    if kind == "chat":
        if "messages" not in body:
            raise RequestError("Field required: `messages`", param="messages")
        try:
            prompts = [tokenize(render_chat(body["messages"]))]
        except ValueError as exc:
            raise RequestError(str(exc), param="messages") from None
        max_tokens = _int_field(body, "max_completion_tokens", 0, 1) or _int_field(
            body, "max_tokens", default_max_tokens, 1
        )
    else:
        if "prompt" not in body:
            raise RequestError("Field required: `prompt`", param="prompt")
        prompts = _completion_prompts(body["prompt"])
        max_tokens = _int_field(body, "max_tokens", default_max_tokens, 1)
    options = body.get("stream_options")
    if options and not body.get("stream"):  # vLLM checks the raw body first
        raise RequestError(
            "Stream options can only be defined when `stream=True`.", param="stream_options"
        )
    stream = lax_bool(body.get("stream"), "stream")
    if options is not None and not isinstance(options, dict):
        raise RequestError("`stream_options` must be an object", param="stream_options")
    options = options or {}
    include_usage = lax_bool(options.get("include_usage"), "stream_options.include_usage")
    continuous_usage = lax_bool(options.get("continuous_usage_stats"), "stream_options.continuous_usage_stats")
    return SimRequest(
        kind=kind,
        model=model,
        prompts=prompts,
        n=_int_field(body, "n", 1, 1),
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=include_usage and continuous_usage,
        remote_decode=isinstance(params := body.get("kv_transfer_params"), dict)
        and params.get("do_remote_decode") is True,
    )


def generated_token(k: int) -> str:
    """The text of the ``k``-th generated token."""
    return f" tok{k}"


#: vLLM's is ``vllm-<version>-<hash>``; the sim's only needs to be there, where vLLM puts it.
SYSTEM_FINGERPRINT = "vllm-sim"

#: Reads and writes as a response reports them (``None``: not reported).
Reported = tuple[int, int | None] | None


def reported_figures(req: SimRequest, figures: list[tuple[int, int]]) -> tuple[int, int | None]:
    """What vLLM 0.32 reports of its prompts' (reads, writes) with
    ``--enable-prompt-tokens-details``: chat, its one prompt's; completions, no writes and
    one prompt's reads, not their sum: in a stream the first prompt to yield output (the
    sim's prompt 0), in JSON the last prompt (``completion/serving.py``)."""
    if req.kind == "chat":
        return figures[0]
    return figures[-1 if not req.stream else 0][0], None


def usage(prompt_tokens: int, completion_tokens: int, cached: Reported = None) -> dict[str, Any]:
    """``cached``: :func:`reported_figures`, as vLLM writes them with ``--enable-prompt-tokens-details``."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if cached is not None:
        reads, writes = cached
        out["prompt_tokens_details"] = {"cached_tokens": reads} if writes is None else {
            "cached_tokens": reads, "created_cache_tokens": writes}
    return out


def full_response(req: SimRequest, response_id: str, created: int, cached: Reported) -> dict[str, Any]:
    """The non-stream body: every choice generated ``max_tokens`` tokens (``length``)."""
    text = "".join(generated_token(k) for k in range(req.max_tokens))
    choices: list[dict[str, Any]] = []
    for index in range(len(req.prompts) * req.n):
        if req.kind == "chat":
            choice: dict[str, Any] = {
                "index": index,
                "message": {"role": "assistant", "content": text, "refusal": None},
            }
        else:
            choice = {"index": index, "text": text}
        choice.update(logprobs=None, finish_reason="length", stop_reason=None)
        choices.append(choice)
    body = {
        "id": response_id,
        "object": "chat.completion" if req.kind == "chat" else "text_completion",
        "created": created,
        "model": req.model,
        "choices": choices,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": usage(
            sum(map(len, req.prompts)), len(choices) * req.max_tokens, cached
        ),
    }
    if req.remote_decode:  # where the decode pulls the KV from (NixlConnector's fields, made up)
        body["kv_transfer_params"] = {"do_remote_prefill": True, "do_remote_decode": False,
                                      "remote_block_ids": [1], "remote_engine_id": "sim"}
    return body


def stream_choice(kind: Kind, index: int, text: str, last: bool) -> dict[str, Any]:
    """One streamed choice delta; the last one carries ``finish_reason: length``."""
    if kind == "chat":
        choice: dict[str, Any] = {"index": index, "delta": {"content": text}}
    else:
        choice = {"index": index, "text": text}
    choice["logprobs"] = None
    choice["finish_reason"] = "length" if last else None
    if last or kind == "completion":
        choice["stop_reason"] = None
    return choice


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"
