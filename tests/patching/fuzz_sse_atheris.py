"""Coverage-guided fuzzing of ``proxy.patching.sse`` with atheris (run by ``test_fuzz``).

``python tests/patching/fuzz_sse_atheris.py -runs=100000``. The input's first byte picks the
event cap, the next few the chunk cuts; the rest is the stream. Any exception, or an
output that differs from the input by more than usage patches, is a finding.
"""

from __future__ import annotations

import sys
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

with atheris.instrument_imports():
    from proxy.patching.sse import SSEPatcher

from tests.patching.test_fuzz import assert_only_usage_patches, chunked  # noqa: E402
from tests.patching.test_sse import set_seven  # noqa: E402


def one_input(data: bytes) -> None:
    if len(data) < 4:
        return
    cap = (8, 32, 256, 1 << 20)[data[0] % 4]
    cuts = [b * (i + 1) for i, b in enumerate(data[1:4])]
    stream = data[4:]
    patcher = SSEPatcher(set_seven, max_event_bytes=cap)
    output = b"".join(patcher.feed(chunk) for chunk in chunked(stream, cuts)) + patcher.flush()
    assert_only_usage_patches(stream, output)


if __name__ == "__main__":
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
