"""The ``cachetally bench`` command: its parser and subcommands, loaded only when it runs.

``proxy.server.cli.main`` hands every argument after ``bench`` to :func:`main`, so neither
``cachetally serve`` nor the vLLM middleware ever imports the benchmark harness. Each
subcommand sets ``run`` (``args.run(args) -> exit code``) with ``set_defaults``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from proxy.server.plot_path import plot_path

_CACHE_EPILOG = """\
examples:
  cachetally bench cache --url http://127.0.0.1:8000
  cachetally bench cache --url http://127.0.0.1:8000 --prompt-tokens 4096 --repeats 5 --json
  cachetally bench cache --url http://127.0.0.1:8000 --plot ttft.png   (needs matplotlib)

Requests: one untimed warm-up, one cold prompt (unique, so nothing of it is cached), K
warm repeats of it, and K prompts sharing only its first half. TTFT is the time to the
first streamed content chunk. An API key, if the server wants one, comes from
OPENAI_API_KEY.
"""


_PROXY_EPILOG = """\
examples:
  cachetally bench proxy            the table (takes a few minutes)
  cachetally bench proxy --json     every figure as JSON (docs/PERFORMANCE.md holds one)
  cachetally bench proxy --quick    seconds; checks that everything runs
  cachetally bench proxy --baseline /tmp/bench-main
                                    this checkout's proxy against another checkout's, side by side
                                    (git worktree add --detach /tmp/bench-main main)

Starts its own servers on free ports and stops them when done. With two or more cores the
proxy is pinned to one core and the sim and load generator to the others.
"""


def main(argv: list[str]) -> int:
    """``cachetally bench ARGV...``: parse and run one subcommand; returns the exit code."""
    args = bench_parser().parse_args(argv)
    return args.run(args)


def bench_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cachetally bench",
        description="Measure a running OpenAI-compatible server (cache), or what the proxy itself costs (proxy).",
    )
    bsub = p.add_subparsers(dest="bench_command", required=True)
    cache = bsub.add_parser(
        "cache",
        help="cached tokens and TTFT: cold vs warm vs prefix-sharing prompts",
        description=(
            "Send a cold prompt, warm repeats and prefix-sharing prompts through the openai "
            "client; print per request prompt_tokens, cached_tokens and TTFT, then the token "
            "hit rate and warm/cold TTFT."
        ),
        epilog=_CACHE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cache.add_argument("--url", required=True, type=_server_url, help="server base URL, e.g. http://127.0.0.1:8000")
    cache.add_argument("--model", help="model id (default: the first one GET /v1/models lists)")
    cache.add_argument("--prompt-tokens", type=_positive, default=1024, metavar="N",
                       help="approximate prompt length in tokens (default: 1024)")
    cache.add_argument("--repeats", type=_positive, default=3, metavar="K",
                       help="warm repeats, and prefix-sharing prompts (default: 3 each)")
    cache.add_argument("--max-tokens", type=_positive, default=8, metavar="T",
                       help="tokens to generate per request (default: 8)")
    cache.add_argument("--json", action="store_true", help="print JSON instead of a table")
    cache.add_argument("--plot", type=plot_path, metavar="FILE.png",
                       help="draw TTFT against cached fraction (.png, .svg or .pdf; needs matplotlib)")
    cache.set_defaults(run=run_cache)
    proxy = bsub.add_parser(
        "proxy",
        help="what the proxy costs: cachetally in front of the sim vs the sim direct",
        description=(
            "Start the simulated engine and cachetally (upstream mode) in front of it on "
            "127.0.0.1, alternate direct and proxied rounds, and print added latency, "
            "throughput, SSE events/s, TTFT overhead, memory per open stream, the embedded "
            "middleware's cost and micro timings of the SSE patcher, with the targets they meet."
        ),
        epilog=_PROXY_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    proxy.add_argument("--json", action="store_true", help="print JSON instead of a table")
    proxy.add_argument("--quick", action="store_true", help="tiny counts: a smoke test, not a measurement")
    proxy.add_argument("--rounds", type=_positive, metavar="R", help="direct/proxied round pairs (default: 5)")
    proxy.add_argument(
        "--baseline",
        metavar="DIR",
        type=Path,
        help="instead: this checkout's proxy against the one in DIR (another checkout, e.g. a git "
        "worktree of main), both running at once, alternating rounds; req/s per proxy core and latency",
    )
    proxy.set_defaults(run=run_proxy)
    return p


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {value}")
    return value


def _server_url(text: str) -> str:
    # The client reads "localhost:8000" as a URL of scheme "localhost" and says only "Connection error."
    scheme, _, rest = text.partition("://")
    if scheme not in ("http", "https") or not rest.strip("/"):
        raise argparse.ArgumentTypeError(f"{text!r} is not an http:// or https:// URL (e.g. http://127.0.0.1:8000)")
    return text


def run_cache(args: argparse.Namespace) -> int:
    import openai  # the bench's own dependency: only loaded when it runs

    from proxy.bench import cache

    if args.plot and cache.matplotlib_missing():
        print("cachetally bench cache: --plot needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 2
    client = openai.OpenAI(
        base_url=cache.api_base(args.url),
        api_key=os.environ.get("OPENAI_API_KEY") or "unused",
        max_retries=0,
        timeout=600,
    )
    try:
        with client:
            model = args.model or cache.default_model(client)
            with cache.progress(1 + 2 * args.repeats) as bar:
                bench = cache.run(
                    client,
                    model,
                    url=args.url,
                    prompt_tokens=args.prompt_tokens,
                    repeats=args.repeats,
                    max_tokens=args.max_tokens,
                    on_request=lambda _: bar.update(),
                )
    except (openai.APIError, RuntimeError) as exc:
        print(f"cachetally bench cache: {args.url}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(bench.as_dict(), indent=2))
    else:
        print(cache.table(bench))
    if args.plot:
        try:
            cache.plot(bench, args.plot)
        except OSError as exc:  # the figures are printed above: say why the plot is not there
            print(f"cachetally bench cache: cannot write the plot {args.plot}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def run_proxy(args: argparse.Namespace) -> int:
    import dataclasses

    from proxy.bench import proxy, report

    counts = proxy.QUICK if args.quick else proxy.Counts()
    if args.rounds:
        counts = dataclasses.replace(counts, rounds=args.rounds)
    if args.baseline is not None:
        from proxy.bench import baseline

        try:
            ab = baseline.compare(args.baseline.resolve(), counts.rounds, counts.c64_per_conn, counts.c1_requests)
        except (RuntimeError, TimeoutError, OSError) as exc:
            print(f"cachetally bench proxy: {exc}", file=sys.stderr)
            return 1
        print(json.dumps(ab, indent=2) if args.json else baseline.table(ab))
        return 0
    try:
        figures = proxy.run(counts, progress=proxy.tqdm_progress)
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"cachetally bench proxy: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(figures, indent=2) if args.json else report.table(figures))
    return 0
