"""The prompt of a stream cut before its usage chunk, counted by the upstream's ``/tokenize``.

In upstream mode an upstream reports a streamed request's prompt in its final usage chunk
only, so a client that hangs up just before it would have its completion tokens billed
(counted from the stream) and its prompt not (docs/ACCOUNTING.md, "Billed with its cache
unknown"). For such a stream, and only then, the upstream's own tokenizer endpoint (vLLM's
``POST /tokenize``) is asked how many tokens the prompt of the body it was sent makes: the
same messages or prompt and the fields that shape it, as vLLM 0.32's ``TokenizeChatRequest``
and ``TokenizeCompletionRequest`` take them (:func:`tokenize_body`); a Responses body as the
chat its route renders (:mod:`proxy.upstream.responses_prompt`, its ``truncation`` read as
:func:`truncated` reads a chat's). Its ``count`` is the prompt vLLM's usage reports for that
body (the Responses usage's ``input_tokens``), where vLLM renders the chat itself
(its chat template; not gpt-oss's Harmony, whose chat rendering ``/tokenize`` does not run).
Several prompts are asked one by one and summed, as vLLM's usage sums them, each distinct
prompt once (a prompt sent many times is not asked many times over); ``tools`` are
asked with the messages (a Responses body's function tools as the chat's), or without them
under ``tool_choice`` ``"none"`` where the upstream runs
``--exclude-tools-when-tool-choice-none`` (``exclude_tools_when_tool_choice_none``: set it as
the upstream has it). SageMaker's ``/invocations`` is counted as the chat or completions body
it runs (:func:`_invoked`). What cannot be counted so stays unknown, never a guess:
``prompt_embeds``, a completions ``suffix`` (rendered for fill-in-the-middle), and a
truncation that may have cut the prompt (:func:`truncated`). A chat or Responses body's
``kv_transfer_params.prompt_token_ids`` (with ``pd_legs`` on they reach vLLM, which runs them
as the prompt, not the messages) are counted as they are, unasked
(:mod:`proxy.upstream.reused_prompt`).

Bounded: :data:`MAX_ASKING` requests' asks at once (past it, unknown, counted ``busy``), the
asks of one request (one per prompt) within :data:`TIMEOUT_S`, each answer within
:data:`MAX_ANSWER_BYTES`. The credentials
go as the request's own were forwarded; nothing here logs. What each ask came to is
counted in ``cachetally_upstream_prompt_counts_total{result}``.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable
from typing import Any

import orjson

from proxy.asgi.headers import Headers
from proxy.patching.json_exact import loads, standard_dumps
from proxy.upstream.client import UpstreamClient, UpstreamFailure
from proxy.upstream.responses_prompt import chat_ask, limits
from proxy.upstream.reused_prompt import reused

TOKENIZE = b"/tokenize"
#: How long one request's asks may take, the answers read whole: its record waits for them.
TIMEOUT_S = 5.0
#: Requests asking at once in one process: a flood of hang-ups asks no more of the upstream.
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
#: A string vLLM's pydantic reads as an integer (among others it reads so: those stay unknown).
_DIGITS = re.compile(r"[+-]?[0-9]+")


def tokenize_body(route: str, payload: dict[str, Any],
                  exclude_tools: bool = False) -> list[dict[str, Any] | int] | None:
    """What ``/tokenize`` is asked for each prompt of ``payload`` (the body the upstream got,
    sent to ``route``: chat, completions or responses), or the count itself for a prompt of
    token ids; ``None`` when no ask counts it exactly. A body whose ``kv_transfer_params`` ids
    vLLM runs as its prompt is counted before (:func:`~proxy.upstream.reused_prompt.reused`).
    ``exclude_tools``: the upstream drops ``tools`` under ``tool_choice`` ``"none"``."""
    if route in ("chat", "responses"):
        asked = _chat(payload, exclude_tools) if route == "chat" else chat_ask(payload, exclude_tools)
        return None if asked is None else [asked]
    if payload.get("prompt_embeds") is not None or payload.get("suffix") is not None:
        return None
    prompt = payload.get("prompt")
    if isinstance(prompt, str) or _token_ids(prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        return None
    shared = {key: payload[key] for key in ("model", "add_special_tokens") if key in payload}
    parts: list[dict[str, Any] | int] = []
    for one in prompt:  # vLLM's usage sums its prompts
        if isinstance(one, str):
            parts.append(shared | {"prompt": one})
        elif _token_ids(one):
            parts.append(len(one))  # token ids (``true`` is one to vLLM too)
        else:
            return None
    return parts


def _invoked(payload: dict[str, Any]) -> str | None:
    """The route SageMaker's ``/invocations`` runs ``payload`` as: vLLM tries a chat body
    first (it needs ``messages``), then a completions body (it needs a prompt). A body with
    both may be either (a field the chat model refuses and the completions model takes)."""
    prompted = payload.get("prompt") is not None or payload.get("prompt_embeds") is not None
    if "messages" in payload:
        return None if prompted else "chat"
    return "completions"


def _token_ids(prompt: object) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(t, int) for t in prompt)


def _chat(payload: dict[str, Any], exclude_tools: bool) -> dict[str, Any] | None:
    asked = {key: payload[key] for key in _CHAT if key in payload}
    # Beside tools vLLM's default is "auto"; only under "none" does its flag drop them.
    if exclude_tools and payload.get("tool_choice", "auto") == "none":
        asked.pop("tools", None)
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
    keep = _lax_int(payload.get("truncate_prompt_tokens"))
    if keep is None:
        return count if payload.get("truncate_prompt_tokens") is None else None
    if keep >= 0:
        return min(count, keep)
    # -1: up to max_model_len, less one when output is asked: cut or not, it is below that.
    if keep == -1 and isinstance(max_model_len, int) and count < max_model_len - 1:
        return count
    return None


def _lax_int(value: object) -> int | None:
    """``value`` as vLLM's pydantic reads an integer field (lax: ``true`` is 1, ``4000.0`` and
    ``"4000"`` are 4000), where it is one of these forms; ``None`` otherwise."""
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    if isinstance(value, str) and _DIGITS.fullmatch(value):
        return int(value)
    return None


def _read(body: bytes) -> dict[str, Any] | None:
    """The body as vLLM reads it (:func:`proxy.patching.json_exact.loads`: ``NaN``, integers
    past 64 bits, lone surrogates, any depth), or ``None``."""
    try:
        payload, _ = loads(body)
    except ValueError:
        return None
    return payload if isinstance(payload, dict) else None


async def _ask(client: UpstreamClient, asked: bytes, sent: list[tuple[bytes, bytes]]) -> Any:
    """The upstream's answer to one ``/tokenize`` ask, read whole, or ``None``."""
    try:
        response = await client.send("POST", TOKENIZE, sent, asked)
    except UpstreamFailure:
        return None
    try:
        if response.status != 200:
            return None
        chunks, size = [], 0
        while chunk := await response.read():
            size += len(chunk)
            if size > MAX_ANSWER_BYTES:
                return None
            chunks.append(chunk)
        return orjson.loads(b"".join(chunks))
    except (UpstreamFailure, orjson.JSONDecodeError):
        return None
    finally:
        response.close()


def _sum(counts: Iterable[int | None]) -> int | None:
    """The prompts' total, as vLLM's usage sums them; ``None`` if one is unknown or it is past int64."""
    total = 0
    for count in counts:
        if count is None:
            return None
        total += count
    return total if total <= _MAX_COUNT else None


class PromptCounter:
    """Asks the upstream's ``/tokenize`` for cut streams' prompts, bounded (module docstring)."""

    def __init__(self, max_asking: int = MAX_ASKING, timeout_s: float = TIMEOUT_S,
                 exclude_tools: bool = False) -> None:
        """``exclude_tools``: the upstream runs ``--exclude-tools-when-tool-choice-none``."""
        self.max_asking, self.timeout_s, self.exclude_tools = max_asking, timeout_s, exclude_tools
        self.asking = 0
        self.results = dict.fromkeys(RESULTS, 0)

    async def count(self, client: UpstreamClient | None, route: str, body: bytes, headers: Headers) -> int | None:
        """The prompt tokens of ``body`` (sent to ``route``, with ``headers`` as forwarded), or ``None``."""
        payload = _read(body)
        runs = _invoked(payload) if payload is not None and route == "invocations" else route
        if payload is None or runs is None:
            return self._done(None)
        if runs in ("chat", "responses") and (ids := reused(runs, payload))[0]:
            return self._done(ids[1])  # their number, untruncated, as vLLM runs them
        parts = tokenize_body(runs, payload, self.exclude_tools)
        if parts is None:
            return self._done(None)
        # A Responses body's truncation, as truncated() reads a chat's truncate_prompt_tokens.
        kept = limits(payload) if runs == "responses" else payload
        if all(isinstance(part, int) for part in parts):
            return self._done(_sum(truncated(part, kept, None) for part in parts))
        if client is None or self.asking >= self.max_asking:
            self.results["busy" if client is not None else "failed"] += 1
            return None
        self.asking += 1
        try:
            counts = await self._ask_each(client, parts, kept, headers)
        finally:
            self.asking -= 1
        if counts is None:
            self.results["failed"] += 1
            return None
        return self._done(_sum(counts))

    async def _ask_each(self, client: UpstreamClient, parts: list[dict[str, Any] | int], payload: dict[str, Any],
                        headers: Headers) -> list[int | None] | None:
        """Each prompt's count (``None``: truncation may have cut it), or ``None`` where an ask
        failed; every ask within one :attr:`timeout_s`, each distinct ask once."""
        credentials = [(name, value) for name, value in headers if name.lower() in _CREDENTIALS]
        sent = [(b"content-type", b"application/json"), *credentials]
        counts: list[int | None] = []
        known: dict[bytes, int | None] = {}  # an ask's body: its prompt's count
        try:
            async with asyncio.timeout(self.timeout_s):
                for part in parts:
                    if isinstance(part, int):
                        counts.append(truncated(part, payload, None))
                        continue
                    asked = standard_dumps(part)
                    if asked not in known:
                        answer = await _ask(client, asked, sent)
                        count = answer.get("count") if isinstance(answer, dict) else None
                        if isinstance(count, bool) or not isinstance(count, int) or not 0 < count <= _MAX_COUNT:
                            return None
                        known[asked] = truncated(count, payload, answer.get("max_model_len"))
                    counts.append(known[asked])
        except TimeoutError:
            return None
        return counts

    def _done(self, count: int | None) -> int | None:
        self.results["counted" if count is not None else "uncountable"] += 1
        return count

    def metrics_text(self) -> str:
        name = "cachetally_upstream_prompt_counts_total"
        lines = [f"# HELP {name} Streams cut before their usage chunk, by what asking the upstream's "
                 "/tokenize for their prompt came to.", f"# TYPE {name} counter"]
        lines += [f'{name}{{result="{result}"}} {n}' for result, n in self.results.items()]
        return "\n".join(lines) + "\n"
