"""The chat messages vLLM makes of a Responses body's ``instructions`` and ``input``.

vLLM 0.32's Responses route (``entrypoints/openai/responses/utils.py``
``construct_input_messages`` and ``_construct_message_from_response_item``) makes a chat of a
request before it renders it: ``instructions``, when not empty, as a first system message; a
string ``input`` as one user message; each input item as a message, or merged into the
assistant message before it. :func:`input_messages` is that chat, for the items whose
message is only that: a message item of ``type`` ``"message"`` (or none) whose content is a
string or ``input_text`` parts (an assistant's, a string); a ``function_call``, the chat's
tool call, and its ``function_call_output`` of text, a tool message (an agent's loop).
Anything else is left unknown (``None``): a previous response, items of other kinds (output
messages, custom tool calls, reasoning, images, files), an item with more fields (a
``status`` may ask for a message to be continued).
"""

from __future__ import annotations

from typing import Any

_ROLES = frozenset(("user", "system", "developer", "assistant"))
_ITEM = frozenset(("type", "role", "content"))
_PART = frozenset(("type", "text"))
#: A function call's and its output's fields, as input items.
_CALL = frozenset(("type", "call_id", "name", "arguments", "id", "status"))
_OUTPUT = frozenset(("type", "call_id", "output", "id", "status"))
_STATUSES = frozenset((None, "in_progress", "completed", "incomplete"))


def input_messages(payload: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The chat messages vLLM makes of the body's ``instructions`` and ``input``
    (``construct_input_messages``), text only; ``None`` for an earlier response's history or
    an input of any other shape."""
    if any(payload.get(key) is not None for key in ("previous_response_id", "previous_input_messages")):
        return None
    instructions = payload.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        return None
    messages = [{"role": "system", "content": instructions}] if instructions else []
    given = payload.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list) and given:
        items: list[dict[str, Any]] = []  # merged among themselves only, as vLLM merges them
        for item in given:
            if not _add(items, item):
                return None
        messages += items
    else:
        return None
    return messages


def _add(messages: list[dict[str, Any]], item: object) -> bool:
    """Adds the chat message vLLM makes of one input item to ``messages``, or merges it into
    the assistant message before it (``_construct_message_from_response_item``): a function
    call into that message's ``tool_calls``, an assistant's text into a message without
    content; ``False`` for an item of any other shape."""
    last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
    kind = item.get("type") if isinstance(item, dict) else None
    if kind == "function_call":
        call = _tool_call(item)
        if call is None:
            return False
        if last is None:
            messages.append({"role": "assistant", "tool_calls": [call]})
        else:
            last.setdefault("tool_calls", []).append(call)
        return True
    if kind == "function_call_output":
        output = _tool_output(item)
        if output is not None:
            messages.append(output)
        return output is not None
    message = _message(item)
    if message is None:
        return False
    if message["role"] == "assistant" and last is not None and last.get("content") is None:
        last["content"] = message["content"]
    else:
        messages.append(message)
    return True


def _tool_call(item: dict[str, Any]) -> dict[str, Any] | None:
    """A ``function_call`` item as the chat's tool call, for the fields vLLM's
    ``ResponseFunctionToolCall`` reads as they are (a ``namespace`` renames it: unknown)."""
    if not (item.keys() <= _CALL and all(isinstance(item.get(key), str) for key in ("call_id", "name", "arguments"))
            and _id_and_status(item)):
        return None
    return {"id": item["call_id"], "function": {"name": item["name"], "arguments": item["arguments"]},
            "type": "function"}


def _id_and_status(item: dict[str, Any]) -> bool:
    status = item.get("status")
    return isinstance(item.get("id"), str | None) and isinstance(status, str | None) and status in _STATUSES


def _tool_output(item: dict[str, Any]) -> dict[str, Any] | None:
    """A ``function_call_output`` item of text as the chat's tool message."""
    if not (item.keys() <= _OUTPUT and isinstance(item.get("call_id"), str) and isinstance(item.get("output"), str)
            and _id_and_status(item)):
        return None
    return {"role": "tool", "content": item["output"], "tool_call_id": item["call_id"]}


def _message(item: object) -> dict[str, Any] | None:
    """The chat message vLLM makes of one input item, where it is that item as it is."""
    if not isinstance(item, dict) or not item.keys() <= _ITEM or item.get("type", "message") != "message":
        return None
    role, content = item.get("role"), item.get("content")
    if not isinstance(role, str) or role not in _ROLES:
        return None
    if isinstance(content, str):
        return {"role": role, "content": content}
    # An assistant's list is read for its first part only; input_text is text to the chat parser.
    if role == "assistant" or not isinstance(content, list) or not content:
        return None
    parts = []
    for part in content:
        if not (isinstance(part, dict) and part.keys() == _PART and part["type"] == "input_text"
                and isinstance(part["text"], str)):
            return None
        parts.append({"type": "text", "text": part["text"]})
    return {"role": role, "content": parts}
