"""``python -m engine_adapter.sim``: the simulated engine alone, on its own port."""

from __future__ import annotations

import argparse
import asyncio

from engine_adapter.sim.engine import SimConfig, SimEngine


async def _serve(engine: SimEngine, host: str, port: int, log_level: str) -> None:
    import uvicorn

    app = await engine.start()
    server = uvicorn.Server(
        uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off")
    )
    try:
        await server.serve()
    finally:
        await engine.stop()


def _bounded(kind: type, low: float, high: float = float("inf")):
    """An argparse type: a ``kind`` in ``[low, high]``, else one usage line (not a traceback
    from the engine, nor a port above 65535 that the socket layer silently wraps)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not low <= value <= high:
            bounds = f"{low:g} to {high:g}" if high < float("inf") else f"at least {low:g}"
            raise argparse.ArgumentTypeError(f"{text} is not {bounds}")
        return value
    return parse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m engine_adapter.sim",
        description="Serve the simulated engine alone: an OpenAI-compatible server with a real "
        "block-hash prefix cache and no model, for tests and benchmarks (cachetally serve "
        "--upstream in front of it, or cachetally serve --engine sim for both in one process).",
        epilog="example: python -m engine_adapter.sim --port 8001 --token-delay-s 0.01 --report-cached-tokens",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    defaults = SimConfig()
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=_bounded(int, 0, 65535), default=8000, metavar="PORT", help="port to listen on")
    parser.add_argument("--model", default=defaults.model, help="model id it serves and lists on /v1/models")
    parser.add_argument("--block-size", type=_bounded(int, 1), default=defaults.block_size, metavar="TOKENS",
                        help="prefix-cache block, in tokens: cached_tokens is a multiple of it")
    parser.add_argument("--capacity-blocks", type=_bounded(int, 0), default=defaults.capacity_blocks, metavar="N",
                        help="blocks the prefix cache holds before it evicts the least recently used (0: no cache)")
    parser.add_argument("--token-delay-s", type=_bounded(float, 0), default=defaults.token_delay_s, metavar="SECONDS",
                        help="seconds per generated token (every choice of a request decodes together)")
    parser.add_argument("--prefill-delay-s", type=_bounded(float, 0), default=defaults.prefill_delay_s, metavar="SECONDS",
                        help="seconds from a request's arrival to its prefill's end")
    parser.add_argument("--max-tokens", type=_bounded(int, 1), default=defaults.default_max_tokens, metavar="N",
                        help="max_tokens for a request that sets none")
    parser.add_argument("--report-cached-tokens", action="store_true",
                        help="include usage.prompt_tokens_details.cached_tokens (and created_cache_tokens) in responses, "
                        "as vLLM does with --enable-prompt-tokens-details")
    parser.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                        help="uvicorn's log level")
    args = parser.parse_args(argv)
    config = SimConfig(
        model=args.model,
        block_size=args.block_size,
        capacity_blocks=args.capacity_blocks,
        token_delay_s=args.token_delay_s,
        prefill_delay_s=args.prefill_delay_s,
        default_max_tokens=args.max_tokens,
        report_cached_tokens=args.report_cached_tokens,
    )
    # uvloop when installed, as `uvicorn.run` (and so `cachetally serve`) would pick it:
    # a benchmark baseline must not run on a slower loop than the proxy in front of it.
    try:
        from uvloop import run
    except ImportError:
        run = asyncio.run
    run(_serve(SimEngine(config=config), args.host, args.port, args.log_level))


if __name__ == "__main__":
    main()
