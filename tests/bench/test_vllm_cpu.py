"""``python -m proxy.bench.vllm_cpu`` measures the middleware doing its whole job: every
request it times is patched and leaves one usage record with the engine's figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.servers import ROOT


def test_each_timed_request_is_patched_and_recorded_once(tmp_path: Path) -> None:
    env = {**os.environ, "CACHETALLY_USAGE_DIR": str(tmp_path), "CACHETALLY_TENANT_HEADER": "x-tenant",
           "CACHETALLY_TENANTS": "acme"}
    out = subprocess.run([sys.executable, "-m", "proxy.bench.vllm_cpu", "20", "1"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["middleware_cpu_us"] > 0 and figures["bare_cpu_us"] > 0
    # A stream's chunks each pass the patcher: more work than one JSON body, never none.
    assert figures["added_opcodes_sse"] > figures["added_opcodes_json"] > 0
    records = [json.loads(line) for path in tmp_path.iterdir() for line in path.read_text().splitlines()]
    assert len(records) == 100 + 2 + 20  # warm-up, the two opcode counts, one round: the middleware's only
    assert len({r["record_id"] for r in records}) == len(records)
    assert {(r["tenant"], r["prompt_tokens"], r["cached_tokens"]) for r in records} == {("acme", 36, 32)}
    assert sorted({r["stream"] for r in records}) == [False, True]
