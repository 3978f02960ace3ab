"""The served process's heap, settled once the engine has started.

Everything alive after startup (modules, the engine, the app) lives as long as the
process, so ``gc.freeze`` moves it out of the collector's sight, as vLLM's own server
does after startup. A request allocates hundreds of containers, so with many in flight
CPython's young-generation threshold (700) runs a collection every few requests; a
higher one runs them far less often, and a cycle still waits at most that many
allocations to be freed. Measured effect: docs/PERFORMANCE.md.
"""

from __future__ import annotations

import gc

#: Container allocations (net) between young-generation collections; CPython's is 700.
GC_GEN0_THRESHOLD = 5000


def settle_heap() -> None:
    """Freeze the heap startup left and collect the young generation less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])
