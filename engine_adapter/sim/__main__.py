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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m engine_adapter.sim", description="Serve the simulated engine alone."
    )
    defaults = SimConfig()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default=defaults.model)
    parser.add_argument("--block-size", type=int, default=defaults.block_size)
    parser.add_argument("--capacity-blocks", type=int, default=defaults.capacity_blocks)
    parser.add_argument("--token-delay-s", type=float, default=defaults.token_delay_s)
    parser.add_argument("--prefill-delay-s", type=float, default=defaults.prefill_delay_s,
                        help="delay from a request's arrival to its prefill's end")
    parser.add_argument("--max-tokens", type=int, default=defaults.default_max_tokens,
                        help="default max_tokens when a request sets none")
    parser.add_argument("--report-cached-tokens", action="store_true",
                        help="include usage.prompt_tokens_details.cached_tokens (and created_cache_tokens) in responses")
    parser.add_argument("--log-level", default="warning")
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
