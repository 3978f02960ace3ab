"""A request that reaches vLLM's server while vLLM stops (docs/RELIABILITY.md §14).

vLLM's stop closes its engine client first and, with one API server, then drains the
engine for ``--shutdown-timeout`` while its HTTP server still accepts. A request sent in
that window can no longer run: vLLM 0.32 fails it with a ``RuntimeError`` (its tokenizer
pool is shut), which reached the client as a 500 "Internal server error", with a usage
record. The middleware answers it as the stop's: a 503 saying to retry, and no record.

A fake vLLM app, as in tests/patching/test_routes.py: the engine client the middleware taps,
and a chat route that fails as vLLM's does once its client is closed.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import orjson
import pytest

from proxy.asgi.errors import STOPPED
from tests.vllm_preloaded import Script


_STOPPING_VLLM = """
import argparse, sys
import openai
from starlette.applications import Starlette
from starlette.routing import Route
from proxy.vllm_middleware import CachetallyMiddleware
from tests.servers import serving_in_thread

class Client:  # vLLM's engine client, as far as the tap needs one
    errored = False
    model_config = argparse.Namespace(served_model_name="m", model="m", dtype="float32", runner_type="generate")
    closed = False
    def shutdown(self, timeout=None):
        self.closed = True
    async def generate(self, *args, **kwargs):
        yield None

async def chat(request):  # vLLM's chat route once its stop closed the client
    raise RuntimeError("cannot schedule new futures after shutdown")

app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
app.state.args = argparse.Namespace(api_key=None, host="127.0.0.1", port=0, api_server_count=1)
app.state.engine_client = Client()
app.add_middleware(CachetallyMiddleware)
with serving_in_thread(app, start_timeout_s=240) as url:  # the lifespan taps vLLM: its imports take a while
    app.state.engine_client.shutdown(timeout=10)  # vLLM's stop begins, as its launcher calls it
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        try:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                           extra_headers={"x-request-id": sys.argv[1]})
        except openai.APIStatusError as exc:
            print(exc.status_code, exc.response.text)
"""


def test_a_request_sent_while_vllm_stops_gets_the_stops_503_and_no_record(vllm_script: Script, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CACHETALLY_", "VLLM_API_KEY"))}
    env["CACHETALLY_USAGE_DIR"] = str(tmp_path / "usage")
    rid = uuid.uuid4().hex
    run = vllm_script(_STOPPING_VLLM, rid, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    status, body = run.stdout.strip().splitlines()[-1].split(" ", 1)
    assert (status, orjson.loads(body)["error"]["message"]) == ("503", STOPPED)
    records = [line for path in (tmp_path / "usage").glob("*.jsonl") for line in path.read_text().splitlines()]
    assert not [line for line in records if rid in line]  # it never ran


def test_the_stop_check_takes_a_request_that_finished_before_the_stop_as_whole(tmp_path: Path) -> None:
    """tests/in_flight.py, which the shared vLLM server's stop runs: a request whose answer was
    whole before the stop (a fast engine) has a ``completed`` record, one the stop ended an
    ``error`` record; the check must pass both and fail a record that says otherwise."""
    from tests.in_flight import RequestsInFlight

    def check(outcomes: dict[str, str]) -> None:
        (tmp_path / "usage.jsonl").write_bytes(b"".join(
            orjson.dumps({"request_id": f"{rid}.p1", "outcome": outcome}) + b"\n" for rid, outcome in outcomes.items()))
        in_flight = RequestsInFlight("http://127.0.0.1:1", timeout_s=1)
        in_flight.got = {"json": "whole", "stream": "error"}
        in_flight.check(tmp_path)

    check({"json": "completed", "stream": "error"})
    with pytest.raises(AssertionError):
        check({"json": "error", "stream": "error"})
