"""The model of a record whose response named none, inside vLLM's server.

vLLM answers a request it refuses (a prompt past ``--max-model-len``, a bad parameter) with
an error object that names no model, so the record's ``model`` falls back to the instance's
default. That default was ``--model``, else ``unknown``: `cachetally serve` on the default
model leaves ``--model`` unset, and such records were ``unknown``, a row of their own in
``cachetally report``, though the server serves one model and the client asked for it; with
``--model ./folder -- --served-model-name NAME`` they were the folder, a name vLLM never
answers with. The fallback is the model vLLM serves under its first served name, as vLLM
names it in every response.

A fake vLLM app, as in tests/engine_adapter/vllm/test_vllm_stop.py: the engine client the
middleware taps, and a chat route that refuses as vLLM's does.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import orjson
import pytest

from tests.vllm_preloaded import Script


_REFUSING_VLLM = """
import argparse, sys
import openai
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from proxy.vllm_middleware import CachetallyMiddleware
from tests.servers import serving_in_thread

class Client:  # vLLM's engine client, as far as the tap needs one
    errored = False
    model_config = argparse.Namespace(served_model_name=["served-name", "alias"], model="/models/folder",
                                      dtype="float32", runner_type="generate")
    async def generate(self, *args, **kwargs):
        yield None

async def chat(request):  # vLLM's refusal of a prompt past --max-model-len: no "model" in it
    return JSONResponse({"error": {"message": "too long", "type": "BadRequestError", "param": None,
                                   "code": 400}}, status_code=400)

app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
app.state.args = argparse.Namespace(api_key=None, host="127.0.0.1", port=0, api_server_count=1)
app.state.engine_client = Client()
app.add_middleware(CachetallyMiddleware)
with serving_in_thread(app, start_timeout_s=240) as url:  # the lifespan taps vLLM: its imports take a while
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        try:
            client.chat.completions.create(model="served-name", messages=[{"role": "user", "content": "hi"}],
                                           extra_headers={"x-request-id": sys.argv[1]})
        except openai.BadRequestError as exc:
            print(exc.status_code)
"""


@pytest.mark.parametrize("configured", [None, "/models/folder"], ids=["default-model", "model-folder"])
def test_a_refused_request_is_recorded_under_the_model_vllm_serves(
        vllm_script: Script, tmp_path: Path, configured: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CACHETALLY_", "VLLM_API_KEY"))}
    env["CACHETALLY_USAGE_DIR"] = str(tmp_path / "usage")
    env["CACHETALLY_USAGE_FLUSH_INTERVAL_S"] = "0.1"
    if configured is not None:  # `cachetally serve --model /models/folder -- --served-model-name served-name`
        env["CACHETALLY_MODEL"] = configured
    rid = uuid.uuid4().hex
    run = vllm_script(_REFUSING_VLLM, rid, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "400"
    records = [orjson.loads(line) for path in (tmp_path / "usage").glob("*.jsonl")
               for line in path.read_text().splitlines()]
    mine = [r for r in records if r["request_id"] == rid]
    assert [(r["status"], r["outcome"], r["model"]) for r in mine] == [(400, "error", "served-name")]
