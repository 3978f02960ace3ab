"""The simulated engine: a prefix cache with vLLM's counting rules and no model (tests, benchmarks)."""

from engine_adapter.sim.engine import SimConfig, SimEngine

__all__ = ["SimConfig", "SimEngine"]
