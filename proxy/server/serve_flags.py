"""``cachetally serve``'s flags, and the settings they make: file, then environment, then flags.

Every flag's ``--help`` says what it changes and its default; the epilog gives examples
and where each setting comes from.
"""

from __future__ import annotations

import argparse
import dataclasses
import textwrap
from pathlib import Path

from proxy.server.settings import Settings, load_settings

_SERVE_EPILOG = """\
examples:
  cachetally serve                                  vLLM + SmolLM2-135M-Instruct on :8000
  cachetally serve --model ./my-hf-folder -- --max-model-len 4096 --api-server-count 2
                                                    any `vllm serve` flag goes after "--"
  cachetally serve --engine sim --port 9000         simulated engine (tests, benchmarks)
  cachetally serve --upstream http://127.0.0.1:8001 in front of a running OpenAI-compatible server
  cachetally serve --upstream https://llm.internal:8443 --upstream-ca ca.pem
                                                    an https upstream whose certificate a private CA signed
  cachetally serve --upstream http://127.0.0.1:8001 --workers 4
                                                    4 proxy processes on one port, metrics summed

Settings come from the TOML file (--config; default config/default.toml), then
CACHETALLY_* environment variables (e.g. CACHETALLY_PORT=9000), then these flags.
Accounting: every request belongs to a tenant: its API key's (--api-keys; "default" for
--api-key), else, without keys, the --tenant-header value, else "default". With
--usage-dir or --otlp-endpoint, each leaves one usage record; `cachetally report` totals them.

Engine vllm: this runs vLLM's own `vllm serve` with --middleware
proxy.vllm_middleware.CachetallyMiddleware (the same flag works on stock `vllm serve`);
settings reach each of vLLM's API server processes as CACHETALLY_* variables.

Routes: chat (/v1/chat/completions), completions (/v1/completions), OpenAI Responses
(/v1/responses), Anthropic Messages (/v1/messages) and SageMaker's /invocations are
metered, and their usage is made exact in JSON and SSE, each in its own shape (cache
reads, and writes where the API has a field for them). While billing is on (--api-key,
--api-keys, --tenant-header, --usage-dir or --otlp-endpoint), the engine's other generating routes
(embeddings, pooling, batch, ...) are refused with 403 rather than run unmetered.
/stats is cachetally's own; /health and /metrics (Prometheus, cachetally_* included) are
cachetally's with the sim and upstream engines and vLLM's with vLLM; every other route
is the engine's.
"""


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve with exact cached_tokens (vLLM's own server by default)",
        description="Serve an engine's OpenAI-compatible and Anthropic APIs with exact prompt-cache usage.",
        epilog=_SERVE_EPILOG + _settings_by_name(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--engine", choices=["vllm", "sim"], help="engine to serve (default: vllm)")
    p.add_argument("--upstream", metavar="URL", help="front a running server instead of embedding one: its root URL, e.g. "
                   "http://127.0.0.1:8001 (not .../v1); an upstream that wants a key of its own gets "
                   "CACHETALLY_UPSTREAM_API_KEY in place of the credentials of a client cachetally's keys (or "
                   "the gateway a tenant header needs) authenticated, and on cachetally's model list")
    p.add_argument(
        "--upstream-ca",
        metavar="FILE",
        help="PEM file of CAs to verify an https:// upstream with (default: the system's CAs; "
        "certificates are always verified)",
    )
    p.add_argument(
        "--forward-route",
        action="append",
        metavar="PATH",
        help="while billing is on, every path outside vLLM's route table is refused (403): forward this path of "
        "the upstream's own anyway, by every method, as you vouch it runs no engine (llama.cpp's /props, Ollama's "
        "/api/tags). Exact match; a metered route is refused at start (repeatable; default: none)",
    )
    p.add_argument("--model", help="local Hugging Face folder or hub name (default: SmolLM2-135M-Instruct)")
    p.add_argument("--host", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to listen on (default: 8000)")
    p.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="serve with N processes sharing the port (upstream and sim engines; default: 1). "
        "/metrics and /stats sum every worker through prometheus_client's multiprocess mode, in "
        "a temporary directory of this instance's own (or $PROMETHEUS_MULTIPROC_DIR, whose *.db "
        "files are wiped at start). With vLLM use its --api-server-count N after \"--\"",
    )
    p.add_argument("--config", type=Path, metavar="FILE",
                   help="TOML settings file, every key under a [cachetally] table, as in config/default.toml "
                   "(default: that file)")
    p.add_argument(
        "--log-level",
        choices=["critical", "error", "warning", "info", "debug"],
        help="cachetally's log level (default: info); debug adds one cumulative prefix-cache stats "
        "line per request. vLLM logs at WARNING, or INFO with debug, unless VLLM_LOGGING_LEVEL is set",
    )
    p.add_argument(
        "--missing",
        choices=["zero", "omit"],
        help="what to write when no source knows cached_tokens (default: zero)",
    )
    p.add_argument(
        "--api-key",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' under /v1 (as vLLM's --api-key: /health, /metrics, /stats "
        "stay open) and on SageMaker's /invocations, which is billed; tenant 'default'. Prefer "
        "CACHETALLY_API_KEY: flags show in the process list",
    )
    p.add_argument(
        "--auth-exempt-path",
        action="append",
        metavar="PATH",
        help="a path under /v1 (or /v2, ...), or /invocations, open without the API key, exact match; its "
        "requests are tenant 'default' (repeatable; default: none)",
    )
    p.add_argument(
        "--client-send-timeout",
        type=float,
        metavar="SECONDS",
        help="a client that takes no bytes of its response for this long is treated as gone: its "
        "connection is reset and its request ends as a disconnect (vLLM aborts it) (default: 60.0)",
    )
    p.add_argument(
        "--client-receive-timeout",
        type=float,
        metavar="SECONDS",
        help="a connection that sends no whole request header in this long (from its start), or none "
        "of a request's body for this long, is closed; a request on it ends as a disconnect "
        "(default: 60.0)",
    )
    _accounting_flags(p)
    p.add_argument("engine_args", nargs=argparse.REMAINDER, help='`vllm serve` flags, after "--"')


def _accounting_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tenants and usage records")
    g.add_argument(
        "--api-keys",
        metavar="FILE",
        help='TOML file of "key" = "tenant" lines: each key is accepted (with --api-key, if set) '
        "and its requests belong to that tenant. Keys are held as SHA-256 digests, never logged",
    )
    g.add_argument(
        "--tenant-header",
        metavar="NAME",
        help="take the tenant from this request header, whose values --tenants names (required with "
        "it); refused beside --api-key/--api-keys. Clients can send any value: use it only behind a "
        "trusted gateway that sets the header itself",
    )
    g.add_argument(
        "--tenants",
        metavar="A,B,C",
        help="the --tenant-header values that are tenants, each with its records and metrics label; "
        "any other value counts as 'other' (required with --tenant-header, refused without it)",
    )
    g.add_argument(
        "--usage-dir",
        metavar="DIR",
        help="write one JSON line per request to a metered route (chat, completions, responses, "
        "messages, invocations: Routes below) to append-only files in DIR (never prompt or completion text)",
    )
    g.add_argument(
        "--usage-flush-interval",
        type=float,
        metavar="SECONDS",
        help="how often queued records are written and fsync'd; a crash loses at most this much "
        "(default: 1.0; a graceful stop loses nothing)",
    )
    g.add_argument(
        "--usage-max-file-bytes",
        type=int,
        metavar="BYTES",
        help="start a new usage file before one would pass this size (default: 67108864)",
    )
    g.add_argument(
        "--usage-queue-size",
        type=int,
        metavar="N",
        help="records waiting per sink before new ones are dropped and counted in "
        "cachetally_usage_records_dropped_total (default: 10000)",
    )
    g.add_argument(
        "--otlp-endpoint",
        metavar="URL",
        help="also export one OpenTelemetry span per request over OTLP/HTTP, e.g. "
        "http://collector:4318/v1/traces (needs the 'otlp' extra)",
    )
    g.add_argument(
        "--otlp-timeout",
        type=float,
        metavar="SECONDS",
        help="give up on one export (retries included) after this long (default: 10.0)",
    )
    g.add_argument(
        "--pd-legs",
        action="store_true",
        default=None,
        help="this instance is one role of disaggregated prefill/decode behind a P/D router: a "
        "prefill leg is counted as a leg only, the decode leg bills (default: off; set it on "
        "every P/D instance, and only there: elsewhere such a body is an ordinary request)",
    )


#: The setting each flag sets, by the flag's ``dest``.
_FLAGS = {
    "engine": "engine", "upstream": "upstream", "upstream_ca": "upstream_ca", "model": "model", "host": "host",
    "port": "port", "workers": "workers", "log_level": "log_level", "missing": "missing", "api_key": "api_key",
    "auth_exempt_paths": "auth_exempt_path", "api_keys_file": "api_keys", "tenant_header": "tenant_header",
    "tenants": "tenants", "usage_dir": "usage_dir", "usage_flush_interval_s": "usage_flush_interval",
    "usage_max_file_bytes": "usage_max_file_bytes", "usage_queue_size": "usage_queue_size",
    "otlp_endpoint": "otlp_endpoint", "otlp_timeout_s": "otlp_timeout", "pd_legs": "pd_legs",
    "client_send_timeout_s": "client_send_timeout", "client_receive_timeout_s": "client_receive_timeout",
    "forward_routes": "forward_route",
}


def _settings_by_name() -> str:
    """Each setting's own name where no flag above says it: a misspelt ``CACHETALLY_*``
    variable (``CACHETALLY_API_KEYS`` for ``CACHETALLY_API_KEYS_FILE``) is logged as naming
    no setting, and that line points here."""
    renamed = [f"{name} (--{dest.replace('_', '-')})" for name, dest in _FLAGS.items() if name != dest]
    unflagged = [f"{f.name} ({f.default})" for f in dataclasses.fields(Settings)
                 if f.name not in _FLAGS and f.name != "engine_args"]
    return ("\nSettings by name, as the file and CACHETALLY_<NAME> (CACHETALLY_READ_TIMEOUT_S=30) say them;\n"
            "config/default.toml says what each does. Named otherwise than their flag:\n"
            + textwrap.fill(", ".join(renamed), 88, break_on_hyphens=False) + "\nWithout a flag, with their defaults:\n"
            + textwrap.fill(", ".join(unflagged), 88, break_on_hyphens=False) + "\n")


def serve_settings(args: argparse.Namespace) -> Settings:
    """The settings ``serve`` runs with: file, then environment, then these flags."""
    engine_args = list(args.engine_args or [])
    if engine_args[:1] == ["--"]:
        engine_args = engine_args[1:]
    overrides = {setting: getattr(args, dest) for setting, dest in _FLAGS.items()}
    return load_settings(args.config, overrides={**overrides, "engine_args": engine_args or None})
