"""The prompt of a chat or Responses body whose ``kv_transfer_params`` carry ``prompt_token_ids``.

Disaggregated serving hands the prefill stage's token ids to the decode stage in
``kv_transfer_params``, so that it need not render the chat again. vLLM 0.32 runs those ids as
the prompt, as they are, with no truncation (``renderers/online_renderer.py``
``_reused_prompt_token_ids``). It renders the messages instead in two cases: a chat that asks
to ``echo``, and a message that has a non-text content part (``has_non_text_content``, checked
on the raw body by ``ChatCompletionRequest.drop_prompt_token_ids_with_media``). Ids that are
not a non-empty list of non-negative integers in its vocabulary get a 400, so there is no
stream to cut. With ``pd_legs`` on, a client's own ``kv_transfer_params`` reach vLLM, so ids
that a client sends beside a short message are its prompt. A stream cut before its usage chunk
is billed their number (:func:`reused`), not the messages that ``/tokenize`` would count.
"""

from __future__ import annotations

from typing import Any

from proxy.patching.request_body import lax_bool
from proxy.upstream.responses_items import input_messages

#: vLLM 0.32's content part types that carry no media (``renderers/chat_utils.py``
#: ``_TEXT_CONTENT_PART_TYPES``), and the keys that mark a part as media whatever its type
#: (``_MEDIA_CONTENT_PART_KEYS``: its media parsers' names).
_TEXT_TYPES = frozenset(("text", "input_text", "output_text", "refusal", "thinking", "tool_reference"))
_MEDIA_KEYS = ("audio_embeds", "audio_url", "image_embeds", "image_pil", "image_url", "input_audio",
               "input_image", "prompt_embeds", "video_embeds", "video_url")


def reused(route: str, payload: dict[str, Any]) -> tuple[bool, int | None]:
    """Whether vLLM runs ``payload``'s ``kv_transfer_params.prompt_token_ids`` as the prompt of a
    ``route`` (``chat`` or ``responses``) body and not its messages, and if so their number
    (``None`` where it is not known: never the messages' count)."""
    transfer = payload.get("kv_transfer_params")
    ids = transfer.get("prompt_token_ids") if isinstance(transfer, dict) else None
    if ids is None:
        return False, None
    if route == "chat":
        try:
            echo = lax_bool(payload.get("echo", False))
        except ValueError:
            return True, None  # refused: no stream
        if echo or _non_text(payload.get("messages")):
            return False, None
    elif input_messages(payload) is None:  # text only where known; else it may render them
        return True, None
    # vLLM refuses (400: no stream to cut) ids other than a list of its token ids.
    return True, len(ids) if isinstance(ids, list) else None


def _non_text(messages: object) -> bool:
    """vLLM 0.32's ``has_non_text_content``: a message's list content has a part that is a
    media part, or whose ``type`` (``"text"`` when absent) is not a text type."""
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, dict) and (
                    any(key in part for key in _MEDIA_KEYS)
                    or not isinstance(kind := part.get("type", "text"), str) or kind not in _TEXT_TYPES):
                return True
    return False
