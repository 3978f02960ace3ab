"""The chat a Responses request renders, as vLLM's ``/tokenize`` is asked to count it.

vLLM 0.32's Responses route (``entrypoints/openai/responses/utils.py``
``construct_input_messages``, ``ResponsesRequest.build_chat_params`` and ``build_tok_params``)
renders a request as a chat through the model's chat template: ``instructions``, when not
empty, as a first system message; a string ``input`` as one user message; message items as the
chat messages they are; with the generation prompt, the request's ``chat_template_kwargs``, the
reasoning effort it puts beside them (and the ``enable_thinking`` it derives), the tools as
the chat's (``renderers/online_renderer.py`` ``render_responses``, ``construct_tool_dicts``
through ``tool_parsers/utils.py`` ``get_function_tools``: function tools, a namespace's
function tools renamed, a custom tool as a one-string function, built-in tools not shown; none
under ``tool_choice`` ``"none"`` where the upstream runs
``--exclude-tools-when-tool-choice-none``), and the tokenizer's special tokens added.
:func:`chat_ask` is that chat as vLLM's ``TokenizeChatRequest`` takes it, for the shapes whose
rendering is only that: a message item of ``type`` ``"message"`` (or none) whose content is a
string or ``input_text`` parts (an assistant's, a string); a ``function_call`` item, merged
into the assistant message before it as the chat's tool call, and its ``function_call_output``
of text, a tool message (an agent's loop: ``construct_chat_messages_with_tool_call``); tools
of the fields their types have. Anything else stays unknown, never a guess: a tool field of
any other name (vLLM's types may drop or keep it), a previous response, items of other kinds
(output messages, custom tool calls, reasoning, images, files), an item with more fields (a
``status`` may ask for a message to be continued). Like the chat route's, the count is
vLLM's own where vLLM renders the chat itself, not gpt-oss's Harmony.
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
#: A function tool's fields, each of which vLLM renders as it is.
_FUNCTION = frozenset(("type", "name", "description", "parameters", "strict", "defer_loading"))
_CUSTOM = frozenset(("type", "name", "description", "format"))
_NAMESPACE = frozenset(("type", "name", "description", "tools"))
#: The single string vLLM 0.32 asks of a custom tool (``tool_parsers/utils.py``
#: ``custom_tool_parameters``).
_CUSTOM_PARAMETERS = {"type": "object", "properties": {"input": {
    "type": "string", "description": "The freeform text payload for this tool."}},
    "required": ["input"], "additionalProperties": False}
#: Responses tool types vLLM 0.32 never shows a model it renders the chat for.
_BUILT_IN = frozenset(("apply_patch", "code_interpreter", "computer", "computer_use_preview", "file_search",
                       "image_generation", "local_shell", "mcp", "programmatic_tool_calling", "shell", "tool_search",
                       "web_search", "web_search_2025_08_26", "web_search_preview",
                       "web_search_preview_2025_03_11"))


def chat_ask(payload: dict[str, Any], exclude_tools: bool = False) -> dict[str, Any] | None:
    """What ``/tokenize`` is asked for the prompt of Responses body ``payload``, or ``None``.
    ``exclude_tools``: the upstream drops ``tools`` under ``tool_choice`` ``"none"``."""
    messages = input_messages(payload)
    known, tools = _tools(payload, exclude_tools)
    if messages is None or not known:
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
    if tools is not None:
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


def _tools(payload: dict[str, Any], exclude_tools: bool) -> tuple[bool, list[dict[str, Any]] | None]:
    """Whether the chat tools vLLM renders for the body's ``tools`` are known, and those tools
    (``construct_tool_dicts``, through ``get_function_tools``): a function tool as a chat
    function; a namespace's function tools the same, named ``<namespace>__<name>``; a custom
    tool as the single-string function shim; a built-in tool not at all (its list may be left
    empty: a template is handed ``[]``). ``None`` where the body has none or the upstream drops
    them; unknown for a tool or field of any other shape."""
    tools = payload.get("tools")
    if not tools or (exclude_tools and payload.get("tool_choice", "auto") == "none"):
        return True, None
    if not isinstance(tools, list):
        return False, None
    chat: list[dict[str, Any]] = []
    for tool in tools:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            function = _function(tool)
        elif kind == "custom":
            function = _custom(tool)
        elif kind == "namespace":
            functions = _namespace(tool)
            if functions is None:
                return False, None
            chat += functions
            continue
        elif kind in _BUILT_IN:
            continue
        else:
            return False, None
        if function is None:
            return False, None
        chat.append(function)
    return True, chat


def _function(tool: dict[str, Any], name: object = None) -> dict[str, Any] | None:
    """A function tool as a chat function (``convert_tool_responses_to_completions_format``),
    under ``name`` if given; ``None`` for one with fields of other shapes."""
    if not (tool.keys() <= _FUNCTION and isinstance(tool.get("name"), str)
            and isinstance(tool.get("description"), str | None) and isinstance(tool.get("parameters"), dict | None)
            and isinstance(tool.get("strict"), bool | None) and isinstance(tool.get("defer_loading"), bool | None)):
        return None
    function = {k: v for k, v in tool.items() if k != "type" and v is not None}
    if name is not None:
        function["name"] = name
    return {"type": "function", "function": function}


def _custom(tool: dict[str, Any]) -> dict[str, Any] | None:
    """A custom tool as the function vLLM shows the model in its place, whatever its
    ``format`` (``custom_tool_as_function_dict``; a grammar is refused, a 400)."""
    if not (tool.keys() <= _CUSTOM and isinstance(tool.get("name"), str)
            and isinstance(tool.get("description"), str | None)):
        return None
    shim = {"name": tool["name"], "parameters": _CUSTOM_PARAMETERS}
    if tool.get("description") is not None:
        shim["description"] = tool["description"]
    return {"type": "function", "function": shim}


def _namespace(tool: dict[str, Any]) -> list[dict[str, Any]] | None:
    """A namespace's function tools, each named ``<namespace>__<name>``; its other tools are
    not shown to the model."""
    name, tools = tool.get("name"), tool.get("tools")
    if not (tool.keys() <= _NAMESPACE and isinstance(name, str) and isinstance(tool.get("description"), str | None)
            and isinstance(tools, list)):
        return None
    functions = []
    for nested in tools:
        if not isinstance(nested, dict) or nested.get("type") not in ("function", "custom"):
            return None
        if nested["type"] == "function":
            if (function := _function(nested, f"{name}__{nested.get('name')}")) is None:
                return None
            functions.append(function)
    return functions


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
