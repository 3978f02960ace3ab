"""``--plot FILE``, as ``cachetally report`` and ``cachetally bench cache`` take it.

matplotlib picks the format from the name's ending and refuses one it does not know with a
traceback, after the work the plot draws (a whole bench run): the ending is checked as the
flag is read instead. Only formats every matplotlib writes without extra packages.
"""

from __future__ import annotations

import argparse
from pathlib import Path

PLOT_FORMATS = (".png", ".svg", ".pdf")


def plot_path(text: str) -> Path:
    path = Path(text)
    if path.suffix.lower() not in PLOT_FORMATS:
        raise argparse.ArgumentTypeError(f"{text!r} does not end in {', '.join(PLOT_FORMATS)}: the format is taken from it")
    return path
