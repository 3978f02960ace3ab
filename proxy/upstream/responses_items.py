"""The chat messages vLLM makes of a Responses body's ``instructions`` and ``input``.

vLLM 0.32's Responses route (``entrypoints/openai/responses/utils.py``
``construct_input_messages`` and ``_construct_message_from_response_item``) makes a chat of a
request before it renders it: ``instructions``, when not empty, as a first system message; a
string ``input`` as one user message; each input item as a message, or merged into the
assistant message before it. :func:`input_messages` is that chat, for the items whose
message is only that, which are the items a client sends back of a conversation (an
agent's loop, or ``input`` plus the last response's ``output``): a user's, system's or
developer's message item whose content is a string or ``input_text`` parts; an assistant's
message, as written or as an output item, read for its text (its first part's); a
``function_call``, the chat's tool call; its ``function_call_output`` of text, a tool
message; a ``reasoning`` item, the assistant's reasoning. A call in a ``namespace`` is named
as the namespace's tools are (``<namespace>__<name>``); a ``custom_tool_call`` is the call of
the function shown in the custom tool's place, its ``input`` in the one-string arguments
vLLM writes; an output of ``input_text`` parts, or a custom call's output of text, a tool
message too. Anything else is left unknown (``None``): a previous response, items of other
kinds (images, files), a custom call's output of parts (vLLM hands the template a one-pass
iterator), an item with more fields, and a last message or reasoning item that vLLM
continues (its ``status`` ``in_progress`` or ``incomplete``), rendered without the
generation prompt.
"""

from __future__ import annotations

import json
from typing import Any

_ROLES = frozenset(("user", "system", "developer"))
_ITEM = frozenset(("type", "role", "content"))
_PART = frozenset(("type", "text"))
#: An assistant's message as a response's output item writes it, and the parts vLLM reads its text from.
_ASSISTANT = frozenset(("type", "role", "content", "id", "status"))
_TEXTS = frozenset(("output_text", "input_text"))
_OUTPUT_ONLY = frozenset(("id", "status"))
_REASONING = frozenset(("type", "id", "summary", "content", "encrypted_content", "status"))
#: A function call's and its output's fields, as input items, and a custom tool's call's and its output's.
_CALL = frozenset(("type", "call_id", "name", "arguments", "id", "status", "namespace"))
_OUTPUT = frozenset(("type", "call_id", "output", "id", "status"))
_CUSTOM_CALL = frozenset(("type", "call_id", "name", "input", "id", "namespace"))
_CUSTOM_OUTPUT = frozenset(("type", "call_id", "output", "id"))
_STATUSES = frozenset((None, "in_progress", "completed", "incomplete"))


def namespaced(namespace: str, name: object) -> str:
    """A tool's name in a ``namespace``, as vLLM shows it to the model (``flat_namespace_tool_name``)."""
    return f"{namespace}__{name}"


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
    elif isinstance(given, list) and given and not _continued(given[-1]):
        items: list[dict[str, Any]] = []  # merged among themselves only, as vLLM merges them
        for item in given:
            if not _add(items, item):
                return None
        messages += items
    else:
        return None
    return messages


def _continued(item: object) -> bool:
    """Whether vLLM continues the last item's message rather than start the reply
    (``should_continue_final_message``: rendered without the generation prompt)."""
    return isinstance(item, dict) and item.get("type", "message") in ("message", "reasoning") \
        and item.get("status") in ("in_progress", "incomplete")


def _add(messages: list[dict[str, Any]], item: object) -> bool:
    """Adds the chat message vLLM makes of one input item to ``messages``, or merges it into
    the assistant message before it (``_construct_message_from_response_item``): a function
    call into that message's ``tool_calls``, an assistant's text into a message without
    content, reasoning into one without reasoning; ``False`` for an item of any other shape."""
    if not isinstance(item, dict):
        return False
    last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
    kind = item.get("type", "message")
    if kind in ("function_call", "custom_tool_call"):
        call = _tool_call(item) if kind == "function_call" else _custom_call(item)
        if call is not None and last is not None:
            last.setdefault("tool_calls", []).append(call)
        elif call is not None:
            messages.append({"role": "assistant", "tool_calls": [call]})
        return call is not None
    if kind in ("function_call_output", "custom_tool_call_output"):
        message = _tool_output(item, custom=kind == "custom_tool_call_output")
    elif kind == "reasoning":
        message = _reasoning(item)
    elif kind == "message" and item.get("role") == "assistant":
        message = _assistant(item)
    else:
        message = _message(item)
    if message is None:
        return False
    field = "reasoning" if "reasoning" in message else "content"
    if message["role"] == "assistant" and last is not None and last.get(field) is None:
        last[field] = message[field]
    else:
        messages.append(message)
    return True


def _tool_call(item: dict[str, Any]) -> dict[str, Any] | None:
    """A ``function_call`` item as the chat's tool call, for the fields vLLM's
    ``ResponseFunctionToolCall`` reads as they are; one in a ``namespace`` named as that
    namespace's tools are."""
    namespace = item.get("namespace")
    if not (item.keys() <= _CALL and all(isinstance(item.get(key), str) for key in ("call_id", "name", "arguments"))
            and isinstance(namespace, str | None) and _id_and_status(item)):
        return None
    name = namespaced(namespace, item["name"]) if namespace else item["name"]
    return {"id": item["call_id"], "function": {"name": name, "arguments": item["arguments"]}, "type": "function"}


def _custom_call(item: dict[str, Any]) -> dict[str, Any] | None:
    """A ``custom_tool_call`` item as the call of the function shown in the custom tool's
    place: under the tool's own name (a ``namespace`` is not read), its ``input`` as vLLM
    writes the shim's arguments (``encode_custom_tool_input``: ``json.dumps``, not ASCII)."""
    if not (item.keys() <= _CUSTOM_CALL and all(isinstance(item.get(key), str) for key in ("call_id", "name", "input"))
            and all(isinstance(item.get(key, ""), str) for key in ("id", "namespace"))):
        return None
    arguments = json.dumps({"input": item["input"]}, ensure_ascii=False)
    return {"id": item["call_id"], "function": {"name": item["name"], "arguments": arguments}, "type": "function"}


def _id_and_status(item: dict[str, Any]) -> bool:
    status = item.get("status")
    return isinstance(item.get("id"), str | None) and isinstance(status, str | None) and status in _STATUSES


def _tool_output(item: dict[str, Any], custom: bool) -> dict[str, Any] | None:
    """A call's output item as the chat's tool message: its text, or (a function call's, not
    a ``custom`` one's) its ``input_text`` parts."""
    output = item.get("output")
    if isinstance(output, list):  # a custom call's parts: a one-pass iterator to vLLM's template
        output = None if custom else _text_parts(output)
    if not (isinstance(output, str | list) and item.keys() <= (_CUSTOM_OUTPUT if custom else _OUTPUT)
            and isinstance(item.get("call_id"), str) and _id_and_status(item)):
        return None
    return {"role": "tool", "content": output, "tool_call_id": item["call_id"]}


def _assistant(item: dict[str, Any]) -> dict[str, Any] | None:
    """An assistant's message, as the client wrote it or as a response's output item (its
    ``id`` and ``status``): its text, of its first part alone where it has parts, as vLLM
    reads it (a refusal there fails vLLM's read: unknown)."""
    content = item.get("content")
    if isinstance(content, str) and item.keys() & _OUTPUT_ONLY:
        return None  # read as an output item, whose content is parts: vLLM reads no text of it
    if isinstance(content, list) and content and isinstance(first := content[0], dict) \
            and first.get("type") in _TEXTS and isinstance(first.get("text"), str):
        content = first["text"]
    if not (item.keys() <= _ASSISTANT and isinstance(content, str) and _id_and_status(item)):
        return None
    return {"role": "assistant", "content": content}


def _reasoning(item: dict[str, Any]) -> dict[str, Any] | None:
    """A ``reasoning`` item as the assistant's reasoning: its first content part's text, else
    its first summary part's, else empty (encrypted content is refused: no stream)."""
    summary, content, encrypted = item.get("summary"), item.get("content") or [], item.get("encrypted_content")
    if not (item.keys() <= _REASONING and isinstance(summary, list) and isinstance(content, list)
            and isinstance(encrypted, str | None) and not encrypted
            and all(_part_of(part, kind) for parts, kind in ((summary, "summary_text"), (content, "reasoning_text"))
                    for part in parts) and _id_and_status(item)):
        return None
    first = (content or summary or [{"text": ""}])[0]
    return {"role": "assistant", "reasoning": first["text"]}


def _part_of(part: object, kind: str) -> bool:
    return isinstance(part, dict) and part.keys() == _PART and part["type"] == kind and isinstance(part["text"], str)


def _message(item: dict[str, Any]) -> dict[str, Any] | None:
    """The chat message vLLM makes of a user's, system's or developer's message item, where
    it is that item as it is."""
    if not item.keys() <= _ITEM or item.get("type", "message") != "message":
        return None
    role, content = item.get("role"), item.get("content")
    if not isinstance(role, str) or role not in _ROLES:
        return None
    if isinstance(content, list):
        content = _text_parts(content)
    return {"role": role, "content": content} if isinstance(content, str | list) else None


def _text_parts(parts: list[Any]) -> list[dict[str, str]] | None:
    """``input_text`` parts as the chat parser's text parts; ``None`` for none, or for any
    other part."""
    if not parts or not all(_part_of(part, "input_text") for part in parts):
        return None
    return [{"type": "text", "text": part["text"]} for part in parts]
