"""cachetally's own log output, independent of the root logger.

Every cachetally logger lives under the ``cachetally`` namespace (``cachetally.app``,
``cachetally.stats``, ``cachetally.engine.vllm``, ...). :func:`configure_logging` gives
that namespace its own stderr handler and level and stops it propagating, so what other
code does to the root logger cannot silence it. This is not hypothetical: while vLLM
0.32 builds its OpenAI app it imports ``model_hosting_container_standards``, which sets
the root logger's level to ``$LOG_LEVEL`` (default ``ERROR``) and leaves it there; with
``logging.basicConfig`` alone that dropped the debug stats line and the ready line.
"""

from __future__ import annotations

import logging
import sys

NAMESPACE = "cachetally"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str) -> logging.Logger:
    """Send ``cachetally.*`` records at ``level`` and above to stderr, whatever root says."""
    root = logging.getLogger(NAMESPACE)
    root.setLevel(level.upper())
    root.propagate = False
    if not any(getattr(h, "_cachetally", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT))
        handler._cachetally = True  # type: ignore[attr-defined]  # idempotent re-configuration
        root.addHandler(handler)
    return root
