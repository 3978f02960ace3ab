"""The chat a Responses request renders, as vLLM's ``/tokenize`` is asked to count it.

vLLM 0.32's Responses route (``entrypoints/openai/responses/utils.py``
``construct_input_messages``, ``ResponsesRequest.build_chat_params`` and ``build_tok_params``)
renders a request as a chat through the model's chat template: the messages it makes of the
``instructions`` and ``input`` (:mod:`proxy.upstream.responses_items`); with the generation
prompt, the request's ``chat_template_kwargs``, the reasoning effort it puts beside them (and
the ``enable_thinking`` it derives), the tools as the chat's (``renderers/online_renderer.py``
``render_responses``, ``construct_tool_dicts`` through ``tool_parsers/utils.py``
``get_function_tools``: function tools, a namespace's function tools renamed, a custom tool
as a one-string function, built-in tools not shown; none under ``tool_choice`` ``"none"``
where the upstream runs ``--exclude-tools-when-tool-choice-none``), and the tokenizer's
special tokens added. :func:`chat_ask` is that chat as vLLM's ``TokenizeChatRequest`` takes
it, for the messages that module knows and tools of the fields their types have. Anything
else stays unknown, never a guess: a tool field of any other name (vLLM's types may drop or
keep it), and the inputs that module leaves unknown. Like the chat route's, the count is
vLLM's own where vLLM renders the chat itself, not gpt-oss's Harmony.
"""

from __future__ import annotations

from typing import Any

from proxy.upstream.responses_items import input_messages, namespaced

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
            if (function := _function(nested, namespaced(name, nested.get('name')))) is None:
                return None
            functions.append(function)
    return functions


def limits(payload: dict[str, Any]) -> dict[str, Any]:
    """The body's truncation as :func:`proxy.upstream.prompt_count.truncated` reads it:
    ``truncation`` other than ``"disabled"`` (its default) cuts the prompt to what the model's
    length allows (vLLM's ``truncate_prompt_tokens`` -1), ``null`` included."""
    return {} if payload.get("truncation", "disabled") == "disabled" else {"truncate_prompt_tokens": -1}


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
