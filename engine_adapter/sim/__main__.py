"""``python -m engine_adapter.sim``: the simulated engine alone, on its own port."""

from engine_adapter.sim.engine import main

main()
