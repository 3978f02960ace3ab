"""One explicit settings object, loaded file -> environment -> flags (later wins).

Shaped like uvicorn's ``Config``: plain keyword fields with defaults and no I/O in the
constructor; :func:`load_settings` does the reading. Environment variables are the field
names upper-cased with the prefix ``CACHETALLY_`` (``CACHETALLY_PORT=9000``). A
``CACHETALLY_*`` variable that names no setting is logged as ignored (by name, never its
value), so a misspelt one (``CACHETALLY_API_KEYS`` for ``CACHETALLY_API_KEYS_FILE``) does
not go unseen; ``CACHETALLY_MODEL_DIR`` is the model store's own.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints
from urllib.parse import urlsplit

from proxy.accounting.tenants import check_tenant_header
from proxy.patching.routes import check_forwarded_route
from proxy.server.config_file import config_table
from proxy.server.logs import redacted
from proxy.server.setting_values import coerce
from proxy.upstream.client import Origin

ENV_PREFIX = "CACHETALLY_"
#: ``CACHETALLY_*`` variables that are not settings: the model store's folder
#: (:mod:`engine_adapter.vllm.model_store`).
NOT_SETTINGS = frozenset(("CACHETALLY_MODEL_DIR",))

logger = logging.getLogger("cachetally.settings")
DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "config" / "default.toml"


class SettingsError(ValueError):
    pass


@dataclass(slots=True)
class Settings:
    # where to listen
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"
    workers: int = 1  # processes on the listening socket (upstream and sim engines; proxy.server.workers)
    # which engine: the embedded vLLM, the simulator, or a running server (upstream)
    engine: str = "vllm"
    upstream: str | None = None
    model: str | None = None  # None: the default model, materialized on first use
    engine_args: list[str] = field(default_factory=list)
    # the proxy's own API key (None: open), and the paths open without it
    api_key: str | None = field(default=None, repr=False)  # never printed
    auth_exempt_paths: list[str] = field(default_factory=list)
    # tenants (proxy.accounting.tenants): API keys file (TOML "key" = "tenant"), then a trusted header
    api_keys_file: str | None = None
    tenant_header: str | None = None
    tenants: list[str] = field(default_factory=list)  # header values with a label of their own
    # usage records (proxy.accounting.records): JSONL files in a directory, and/or OTLP spans
    usage_dir: str | None = None
    usage_flush_interval_s: float = 1.0
    usage_max_file_bytes: int = 64 << 20
    usage_queue_size: int = 10_000
    otlp_endpoint: str | None = None
    otlp_timeout_s: float = 10.0
    # usage policy
    missing: str = "zero"
    # disaggregated prefill/decode: recognize the legs (proxy.patching.pd_leg); on every P/D instance
    pd_legs: bool = False
    # limits
    max_request_bytes: int = 32 << 20
    max_response_bytes: int = 64 << 20
    max_event_bytes: int = 1 << 20
    # Bodies still arriving, one process (proxy.patching.body_budget); 0: the larger of 1 GiB and
    # max_request_bytes, so a configuration with bodies above 1 GiB starts as it did before the budget.
    max_request_bytes_held: int = 0
    # Responses held to be patched, one process (proxy.patching.response_budget); 0: the larger of
    # 1 GiB and max_response_bytes. Past it a response goes on unpatched, still billed.
    max_response_bytes_held: int = 0
    ledger_ttl_s: float = 900.0
    ledger_max_slots: int = 100_000
    # upstream mode
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0
    write_timeout_s: float = 60.0
    upstream_ca: str | None = None  # a PEM file of CAs trusted for an https:// upstream
    # the upstream's own paths that run no engine, forwarded while billing refuses what is no
    # route of vLLM's table (proxy.patching.routes.check_forwarded_route)
    forward_routes: list[str] = field(default_factory=list)
    # as the upstream vLLM's --exclude-tools-when-tool-choice-none: the prompt of a stream cut before
    # its usage chunk is counted without the tools tool_choice "none" leaves (proxy.upstream.prompt_count)
    exclude_tools_when_tool_choice_none: bool = False
    # the upstream's own key, sent as "Authorization: Bearer KEY" in place of any credential a
    # client sent (None: the client's Authorization goes on as sent)
    upstream_api_key: str | None = field(default=None, repr=False)  # never printed
    # every mode (vLLM: set in its server by the middleware): a client that takes no response bytes this long is gone
    client_send_timeout_s: float = 60.0
    # ... or that sends no whole request header, or none of its body between two reads, this long
    client_receive_timeout_s: float = 60.0
    # sim and upstream modes: how long a SIGTERM waits for requests in flight (vLLM: its --shutdown-timeout)
    shutdown_timeout_s: float = 10.0
    # simulator
    sim_block_size: int = 16
    sim_token_delay_s: float = 0.0
    sim_prefill_delay_s: float = 0.0

    def validate(self) -> Settings:
        if self.engine not in ("vllm", "sim", "upstream"):
            raise SettingsError(f"engine must be vllm, sim or upstream, not {self.engine!r}")
        if self.upstream and self.engine != "upstream":
            self.engine = "upstream"
        if self.engine == "upstream" and not self.upstream:
            raise SettingsError("engine 'upstream' needs an upstream URL (--upstream http://HOST:PORT)")
        if self.upstream:
            try:
                origin = Origin.parse(self.upstream)
            except ValueError:
                raise SettingsError("upstream must be http://HOST:PORT[/PATH] or https://HOST:PORT[/PATH], "
                                    f"not {redacted(self.upstream)!r}") from None
            if origin.base_path.endswith(b"/v1"):  # a client's base_url: every route would go to /v1/v1/...
                raise SettingsError("upstream is the server's root URL: drop its /v1, which each route's path carries")
            if origin.port == self.port and origin.host in {self.host} | (_LOOPBACK if self.host in _WILD else set()):
                raise SettingsError(f"upstream {redacted(self.upstream)} is this server: serve on another --port")
            if self.upstream_ca and not origin.tls:
                raise SettingsError("upstream_ca applies to an https:// upstream only")
        if self.upstream_api_key is not None:
            if self.engine != "upstream":
                raise SettingsError("upstream_api_key applies to an upstream (--upstream URL)")
            if not all("!" <= c <= "~" for c in self.upstream_api_key):  # it goes into a header line
                raise SettingsError("upstream_api_key must be printable ASCII without spaces, as a Bearer token is")
        if self.exclude_tools_when_tool_choice_none and self.engine != "upstream":
            raise SettingsError("exclude_tools_when_tool_choice_none applies to an upstream (--upstream URL): "
                                "vLLM's own server counts its prompts itself")
        if self.forward_routes and self.engine != "upstream":
            raise SettingsError("forward_routes applies to an upstream (--upstream URL): vLLM's own routes are known")
        for path in self.forward_routes:
            try:
                check_forwarded_route(path)
            except ValueError as exc:
                raise SettingsError(f"forward_routes: {exc}") from None
        if self.upstream_ca and not Path(self.upstream_ca).is_file():
            raise SettingsError(f"upstream_ca: no such file: {self.upstream_ca}")
        if self.upstream_ca:
            try:  # as the pool and the model list load it, so that a bad file is said here
                ssl.create_default_context(cafile=self.upstream_ca)
            except (ssl.SSLError, OSError) as exc:
                raise SettingsError(f"upstream_ca: cannot load CA certificates from {self.upstream_ca}: "
                                    f"{getattr(exc, 'reason', None) or exc}") from None
        for name in ("connect_timeout_s", "read_timeout_s", "write_timeout_s", "shutdown_timeout_s",
                     "client_send_timeout_s", "client_receive_timeout_s"):
            if not getattr(self, name) > 0:
                raise SettingsError(f"{name} must be a positive number of seconds")
        if self.workers < 1:
            raise SettingsError(f"workers must be >= 1, not {self.workers}")
        if self.workers > 1 and self.engine == "vllm":
            raise SettingsError("workers > 1 applies to the upstream and sim engines; with vLLM, pass vLLM's own "
                                "--api-server-count N after \"--\"")
        if self.engine_args and self.engine != "vllm":  # else flags meant for an engine would do nothing, in silence
            raise SettingsError(f"engine_args (the flags after \"--\") are vLLM's; the {self.engine} engine takes none")
        self.log_level = str(self.log_level).lower()  # INFO as info, as logging and uvicorn take it
        if self.log_level not in LOG_LEVELS:
            raise SettingsError(f"log_level must be one of {', '.join(LOG_LEVELS)}, not {self.log_level!r}")
        for name in ("max_request_bytes", "max_response_bytes", "max_event_bytes"):
            if getattr(self, name) < 1:
                raise SettingsError(f"{name} must be >= 1")
        if self.max_request_bytes_held < 0 or 0 < self.max_request_bytes_held < self.max_request_bytes:
            raise SettingsError("max_request_bytes_held must be 0 or >= max_request_bytes: no body of that size could be read")
        if self.max_response_bytes_held < 0 or 0 < self.max_response_bytes_held < self.max_response_bytes:
            raise SettingsError("max_response_bytes_held must be 0 or >= max_response_bytes: "
                                "no response of that size could be held")
        if not self.ledger_ttl_s > 0:
            raise SettingsError("ledger_ttl_s must be > 0")
        for name in ("sim_token_delay_s", "sim_prefill_delay_s"):
            if not getattr(self, name) >= 0:
                raise SettingsError(f"{name} must be >= 0")
        if self.missing not in ("zero", "omit"):
            raise SettingsError(f"missing must be 'zero' or 'omit', not {self.missing!r}")
        self._validate_accounting()
        if not 0 < self.port < 65536:
            raise SettingsError(f"port out of range: {self.port}")
        return self


    def _validate_accounting(self) -> None:
        if bad := [path for path in self.auth_exempt_paths if not path.startswith("/")]:  # else exempt nothing
            raise SettingsError(f"auth_exempt_paths are paths from the root, e.g. /v1/models, not {bad[0]!r}")
        if self.tenant_header is not None and (self.api_key is not None or self.api_keys_file):
            # A key's holder could otherwise name any tenant in the header (proxy.accounting.tenants).
            raise SettingsError(
                "tenant_header cannot be combined with api_key or api_keys_file: with keys, a request's "
                "tenant is its key's (name tenants in the API keys file); the header is for a trusted "
                "gateway in front of a cachetally that checks no key"
            )
        try:
            check_tenant_header(self.tenant_header, self.tenants)
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
        if self.otlp_endpoint:
            parts = urlsplit(self.otlp_endpoint)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise SettingsError(f"otlp_endpoint must be an http(s) URL, not {redacted(self.otlp_endpoint)!r}")
        if not self.usage_flush_interval_s > 0:
            raise SettingsError("usage_flush_interval_s must be > 0")
        if self.usage_max_file_bytes < 4096:
            raise SettingsError("usage_max_file_bytes must be >= 4096")
        if self.usage_queue_size < 1:
            raise SettingsError("usage_queue_size must be >= 1")
        if not self.otlp_timeout_s > 0:
            raise SettingsError("otlp_timeout_s must be > 0")


_LOOPBACK, _WILD = {"localhost", "127.0.0.1", "::1"}, {"localhost", "127.0.0.1", "::1", "0.0.0.0", "::"}
_HINTS = get_type_hints(Settings)
#: The levels ``--log-level`` offers; any other is refused here, not by ``logging`` at start.
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


#: Settings whose empty value is refused, not read as "none": an empty key would open the server.
_KEYS = frozenset({"api_key", "api_keys_file", "upstream_api_key"})


def _apply(settings: Settings, values: Mapping[str, Any], origin: str) -> None:
    names = {f.name for f in dataclasses.fields(Settings)}
    for name, value in values.items():
        if name not in names:
            raise SettingsError(f"{origin}: unknown setting {name!r}")
        try:
            setattr(settings, name, coerce(name, _HINTS[name], value, secret=name in _KEYS))
        except ValueError as exc:
            raise SettingsError(f"{origin}: bad value for {name}: {exc}") from None


def load_settings(
    config_file: Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Defaults, then the TOML file, then ``CACHETALLY_*`` variables, then ``overrides``."""
    settings = Settings()
    path = config_file or DEFAULT_CONFIG
    if config_file is not None or path.exists():
        try:
            table = config_table(path, _HINTS)
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
        _apply(settings, table, str(path))
    environ = os.environ if env is None else env
    ours = {key: key[len(ENV_PREFIX) :].lower() for key in environ
            if key.startswith(ENV_PREFIX) and key not in NOT_SETTINGS}
    from_env = {name: environ[key] for key, name in ours.items() if name in _HINTS}
    if ignored := sorted(key for key, name in ours.items() if name not in _HINTS):
        logger.warning("ignored: %s %s no setting (cachetally serve --help lists them)",
                       ", ".join(ignored), "names" if len(ignored) == 1 else "name")
    _apply(settings, from_env, "environment")
    flags = {k: v for k, v in (overrides or {}).items() if v is not None}
    if flags.get("engine", "upstream") != "upstream" and "upstream" not in flags:
        settings.upstream = None  # --engine sim (or vllm) wins over an upstream from the file or the environment
    _apply(settings, flags, "flags")
    return settings.validate()


def settings_environment(settings: Settings) -> dict[str, str]:
    """``settings`` as ``CACHETALLY_*`` variables that :func:`load_settings` reads back equal.

    For processes this one starts (vLLM's API servers): the environment is what reaches
    them all. ``engine_args`` stay out: they are vLLM's flags, already on its command line.
    """
    env = {}
    for f in dataclasses.fields(Settings):
        if f.name == "engine_args":
            continue
        value = getattr(settings, f.name)
        if value is None and f.name in _KEYS:
            continue  # unset here, so unset in the environment too ("" is refused)
        text = "" if value is None else " ".join(value) if isinstance(value, list) else str(value)
        env[ENV_PREFIX + f.name.upper()] = text
    return env
