"""The chat a Responses request renders, as vLLM's ``/tokenize`` is asked to count it.

vLLM 0.32's Responses route (``entrypoints/openai/responses/utils.py``
``construct_input_messages``, ``ResponsesRequest.build_chat_params`` and ``build_tok_params``)
renders a request as a chat through the model's chat template: ``instructions``, when not
empty, as a first system message; a string ``input`` as one user message; message items as the
chat messages they are; with the generation prompt, the request's ``chat_template_kwargs``, the
reasoning effort it puts beside them (and the ``enable_thinking`` it derives), the function
tools as the chat's (``renderers/online_renderer.py`` ``render_responses``,
``construct_tool_dicts``: none under ``tool_choice`` ``"none"`` where the upstream runs
``--exclude-tools-when-tool-choice-none``), and the tokenizer's special tokens added.
:func:`chat_ask` is that chat as vLLM's ``TokenizeChatRequest`` takes it, for the shapes whose
rendering is only that: a message item of ``type`` ``"message"`` (or none) whose content is a
string or ``input_text`` parts (an assistant's, a string); a function tool of a name, a
description, parameters and ``strict``. Anything else stays unknown, never a guess: other
tools (namespaces, custom and built-in tools) or tool fields, a previous response, items of
other kinds (output messages, tool calls and their outputs, reasoning, images, files), an item
with more fields (a ``status`` may ask for it to be continued). Like the chat route's, the
count is vLLM's own where vLLM renders the chat itself, not gpt-oss's Harmony.
"""

from __future__ import annotations

from typing import Any

_ROLES = frozenset(("user", "system", "developer", "assistant"))
_ITEM = frozenset(("type", "role", "content"))
_PART = frozenset(("type", "text"))
#: A function tool's fields that vLLM renders (FunctionDefinition's, ``defer_loading`` aside).
_FUNCTION = frozenset(("type", "name", "description", "parameters", "strict"))


def chat_ask(payload: dict[str, Any], exclude_tools: bool = False) -> dict[str, Any] | None:
    """What ``/tokenize`` is asked for the prompt of Responses body ``payload``, or ``None``.
    ``exclude_tools``: the upstream drops ``tools`` under ``tool_choice`` ``"none"``."""
    messages = input_messages(payload)
    tools = _tools(payload, exclude_tools)
    if messages is None or tools is None:
        return None
    kwargs = _template_kwargs(payload)
    if kwargs is None:
        return None
    # TokenizeParams adds the special tokens unless told not to; /tokenize's chat form does not.
    asked: dict[str, Any] = {"messages": messages, "add_special_tokens": True}
    if "model" in payload:
        asked["model"] = payload["model"]
    if kwargs:
        asked["chat_template_kwargs"] = kwargs
    if tools:
        asked["tools"] = tools
    return asked


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
        for item in given:
            message = _message(item)
            if message is None:
                return None
            messages.append(message)
    else:
        return None
    return messages


def _tools(payload: dict[str, Any], exclude_tools: bool) -> list[dict[str, Any]] | None:
    """The chat tools vLLM renders for the body's ``tools``: each function tool as a chat
    function (``convert_tool_responses_to_completions_format``), none where it has none or drops
    them, ``None`` for any other tool or field."""
    tools = payload.get("tools")
    if not tools or (exclude_tools and payload.get("tool_choice", "auto") == "none"):
        return []
    if not isinstance(tools, list):
        return None
    chat = []
    for tool in tools:
        if not (isinstance(tool, dict) and tool.keys() <= _FUNCTION and tool.get("type") == "function"
                and isinstance(tool.get("name"), str) and isinstance(tool.get("description"), str | None)
                and isinstance(tool.get("parameters"), dict | None) and isinstance(tool.get("strict"), bool | None)):
            return None
        chat.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type" and v is not None}})
    return chat


def limits(payload: dict[str, Any]) -> dict[str, Any]:
    """The body's truncation as :func:`proxy.upstream.prompt_count.truncated` reads it:
    ``truncation`` other than ``"disabled"`` (its default) cuts the prompt to what the model's
    length allows (vLLM's ``truncate_prompt_tokens`` -1), ``null`` included."""
    return {} if payload.get("truncation", "disabled") == "disabled" else {"truncate_prompt_tokens": -1}


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


def _template_kwargs(payload: dict[str, Any]) -> dict[str, Any] | None:
    """The client's template kwargs with the reasoning effort's over them, as
    ``build_chat_params`` merges them (null and ``"auto"`` left out), or ``None``."""
    kwargs = payload.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        return None
    kwargs = dict(kwargs or {})
    reasoning = payload.get("reasoning")
    if reasoning is None:
        return kwargs
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else False
    if effort is None:
        return kwargs
    if not isinstance(effort, str):
        return None
    if "enable_thinking" not in kwargs:
        kwargs["enable_thinking"] = effort != "none"
    if effort != "auto":
        kwargs["reasoning_effort"] = effort
    return kwargs
