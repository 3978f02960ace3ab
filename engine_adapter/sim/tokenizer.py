"""The simulated engine's tokenizer and chat template.

Deterministic and model-free: words, single punctuation marks and ChatML special tokens
are tokens, each mapped to a stable id (CRC-32 of its UTF-8 text). Whitespace is dropped.
Chat messages are rendered through a fixed ChatML template first, so requests sharing a
system prompt and their first messages share a token prefix, as with a real model.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

_TOKEN_RE = re.compile(r"<\|[a-z_]+\|>|\w+|[^\w\s]")


@lru_cache(maxsize=65536)
def token_id(token: str) -> int:
    """The stable id of one token string."""
    return zlib.crc32(token.encode("utf-8"))


def tokenize(text: str) -> list[int]:
    """Token ids of ``text``."""
    return [token_id(tok) for tok in _TOKEN_RE.findall(text)]


def _content_text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (
                isinstance(part, dict)
                and part.get("type") in ("text", "input_text")  # the same text to vLLM's chat parser
                and isinstance(part.get("text"), str)
            ):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "\n".join(parts)
    raise ValueError("message content must be a string, a list of text parts, or null")


def render_chat(messages: Sequence[Any], add_generation_prompt: bool = True) -> str:
    """Render chat messages with the ChatML template; raise ``ValueError`` on bad shapes."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("`messages` must be a non-empty list")
    out = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError("each message must be an object with a string `role`")
        text = _content_text(message.get("content"))
        out.append(f"<|im_start|>{message['role']}\n{text}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)
