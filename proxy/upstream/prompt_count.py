"""The prompt of a stream cut before its usage chunk, counted by the upstream's ``/tokenize``.

In upstream mode an upstream reports a streamed request's prompt in its final usage chunk
only, so a client that hangs up just before it would have its completion tokens billed
(counted from the stream) and its prompt not (docs/ACCOUNTING.md, "Billed with its cache
unknown"). For such a stream, and only then, the upstream's own tokenizer endpoint (vLLM's
``POST /tokenize``) is asked how many tokens the prompt of the body it was sent makes: the
same messages or prompt and the fields that shape it, as vLLM 0.32's ``TokenizeChatRequest``
and ``TokenizeCompletionRequest`` take them (:func:`tokenize_body`). Its ``count`` is the
``prompt_tokens`` vLLM's usage reports for that body, where vLLM renders the chat itself
(its chat template; not gpt-oss's Harmony, whose chat rendering ``/tokenize`` does not run).
What cannot be counted so stays unknown, never a guess: several prompts, ``prompt_embeds``,
a completions ``suffix`` (rendered for fill-in-the-middle), ``tools`` with ``tool_choice``
``"none"`` (vLLM drops them under ``--exclude-tools-when-tool-choice-none``), and a
truncation that may have cut the prompt (:func:`truncated`).

Bounded: one ask at a time per :data:`MAX_ASKING` (past it, unknown, counted ``busy``),
each within :data:`TIMEOUT_S` and an answer of :data:`MAX_ANSWER_BYTES`. The credentials
go as the request's own were forwarded; nothing here logs. What each ask came to is
counted in ``cachetally_upstream_prompt_counts_total{result}``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import orjson

from proxy.asgi.headers import Headers
from proxy.upstream.client import UpstreamClient, UpstreamFailure

TOKENIZE = b"/tokenize"
#: How long one ask may take, the answer read whole: the request's record waits for it.
TIMEOUT_S = 5.0
#: Asks in flight at once in one process: a flood of hang-ups asks no more of the upstream.
MAX_ASKING = 16
#: vLLM's answer lists every token id too (``tokens``): about 8 bytes a token.
MAX_ANSWER_BYTES = 16 << 20
RESULTS = ("counted", "busy", "failed", "uncountable")

#: What vLLM 0.32's TokenizeChatRequest takes of a chat body, as the chat route reads it.
_CHAT = ("model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
         "chat_template", "media_io_kwargs", "mm_processor_kwargs", "tools")
#: The chat route's own fields it puts in the template's kwargs (ChatCompletionRequest.build_chat_params).
_TEMPLATE = ("documents", "reasoning_effort")
_CREDENTIALS = frozenset((b"authorization", b"x-api-key"))
_MAX_COUNT = (1 << 63) - 1


def tokenize_body(route: str, payload: dict[str, Any]) -> dict[str, Any] | int | None:
    """What ``/tokenize`` is asked for ``payload`` (the body the upstream got), the count
    itself for a prompt of token ids, or ``None`` when no ask counts it exactly."""
    if route == "chat":
        return _chat(payload)
    if payload.get("prompt_embeds") is not None or payload.get("suffix") is not None:
        return None
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt in a list
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)  # token ids (``true`` is one to vLLM too)
    if not isinstance(prompt, str):
        return None
    return {key: payload[key] for key in ("model", "add_special_tokens") if key in payload} | {"prompt": prompt}


def _chat(payload: dict[str, Any]) -> dict[str, Any] | None:
    tools = payload.get("tools")
    # vLLM's default: "auto" beside tools, else "none"; under "none" its flag drops even [].
    choice = payload["tool_choice"] if "tool_choice" in payload else "auto" if tools else "none"
    if tools is not None and choice == "none":
        return None
    asked = {key: payload[key] for key in _CHAT if key in payload}
    kwargs = payload.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        return None
    kwargs = dict(kwargs or {})
    # The chat route's own template kwargs over the client's, as vLLM's merge_kwargs does (null
    # and "auto" left out); /tokenize then adds add_generation_prompt and continue_final_message.
    extra = {key: payload.get(key) for key in _TEMPLATE}
    if payload.get("reasoning_effort") is not None and "enable_thinking" not in kwargs:
        extra["enable_thinking"] = payload["reasoning_effort"] != "none"
    kwargs |= {key: value for key, value in extra.items() if value is not None and value != "auto"}
    if kwargs:
        asked["chat_template_kwargs"] = kwargs
    return asked


def truncated(count: int, payload: dict[str, Any], max_model_len: object) -> int | None:
    """The prompt's length after vLLM's ``truncate_prompt_tokens`` (``k`` >= 0 keeps ``k``
    tokens; -1 keeps what the model's length allows), or ``None`` when not known."""
    keep = payload.get("truncate_prompt_tokens")
    if keep is None:
        return count
    if isinstance(keep, bool) or not isinstance(keep, int):
        return None
    if keep >= 0:
        return min(count, keep)
    # -1: up to max_model_len, less one when output is asked: cut or not, it is below that.
    if keep == -1 and isinstance(max_model_len, int) and count < max_model_len - 1:
        return count
    return None


def _read(body: bytes) -> dict[str, Any] | None:
    """The body as vLLM reads it: orjson, else the standard library's ``json`` (``NaN``,
    integers past 64 bits, lone surrogates)."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        try:
            payload = json.loads(body)
        except (ValueError, RecursionError):
            return None
    return payload if isinstance(payload, dict) else None


class PromptCounter:
    """Asks the upstream's ``/tokenize`` for cut streams' prompts, bounded (module docstring)."""

    def __init__(self, max_asking: int = MAX_ASKING, timeout_s: float = TIMEOUT_S) -> None:
        self.max_asking, self.timeout_s = max_asking, timeout_s
        self.asking = 0
        self.results = dict.fromkeys(RESULTS, 0)

    async def count(self, client: UpstreamClient | None, route: str, body: bytes, headers: Headers) -> int | None:
        """The prompt tokens of ``body`` (sent to ``route``, with ``headers`` as forwarded), or ``None``."""
        payload = _read(body)
        asked = None if payload is None else tokenize_body(route, payload)
        if asked is None or payload is None:
            return self._done(None)
        if isinstance(asked, int):
            return self._done(truncated(asked, payload, None))
        if client is None or self.asking >= self.max_asking:
            self.results["busy" if client is not None else "failed"] += 1
            return None
        self.asking += 1
        try:
            answer = await self._ask(client, asked, headers)
        finally:
            self.asking -= 1
        count = answer.get("count") if isinstance(answer, dict) else None
        if isinstance(count, bool) or not isinstance(count, int) or not 0 < count <= _MAX_COUNT:
            self.results["failed"] += 1
            return None
        return self._done(truncated(count, payload, answer.get("max_model_len")))

    async def _ask(self, client: UpstreamClient, asked: dict[str, Any], headers: Headers) -> Any:
        credentials = [(name, value) for name, value in headers if name.lower() in _CREDENTIALS]
        sent = [(b"content-type", b"application/json"), *credentials]
        try:
            async with asyncio.timeout(self.timeout_s):
                response = await client.send("POST", TOKENIZE, sent, json.dumps(asked).encode())
                try:
                    if response.status != 200:
                        return None
                    chunks, size = [], 0
                    while chunk := await response.read():
                        size += len(chunk)
                        if size > MAX_ANSWER_BYTES:
                            return None
                        chunks.append(chunk)
                finally:
                    response.close()
            return orjson.loads(b"".join(chunks))
        except (UpstreamFailure, TimeoutError, orjson.JSONDecodeError):
            return None

    def _done(self, count: int | None) -> int | None:
        self.results["counted" if count is not None else "uncountable"] += 1
        return count

    def metrics_text(self) -> str:
        name = "cachetally_upstream_prompt_counts_total"
        lines = [f"# HELP {name} Streams cut before their usage chunk, by what asking the upstream's "
                 "/tokenize for their prompt came to.", f"# TYPE {name} counter"]
        lines += [f'{name}{{result="{result}"}} {n}' for result, n in self.results.items()]
        return "\n".join(lines) + "\n"
