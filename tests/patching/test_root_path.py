"""Behind vLLM's ``--root-path``, a route under the prefix is the same route to cachetally.

vLLM builds its FastAPI app with ``root_path`` set, and Starlette's router then serves
``/api/v1/chat/completions`` as ``/v1/chat/completions`` (the bare path as well): a reverse
proxy that keeps the prefix reaches the engine that way. The app below is built the same
way, with the middleware added as vLLM adds ``--middleware`` classes, and served by a real
uvicorn; the clients are the official ``openai`` client and httpx. What a user checks:
the ``cached_tokens`` each client is told, the requests counted, the refusals.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families
from starlette.responses import JSONResponse

from engine_adapter.events import Scheduled, current_request_key
from proxy.accounting.metrics import Metrics
from proxy.patching.context import PatchConfig
from proxy.patching.ledger import UsageLedger
from proxy.patching.middleware import UsagePatchMiddleware
from tests.servers import serving_in_thread

pytestmark = pytest.mark.loopback

PROMPT, CACHED = 40, 32


class Served:
    def __init__(self, base: str, metrics: Metrics, engine_runs: list[str]) -> None:
        self.base, self.metrics, self.engine_runs = base, metrics, engine_runs

    def requests(self) -> float:
        """``cachetally_requests_total`` of hits, as ``/metrics`` shows it."""
        text = self.metrics.exposition().decode()
        return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                   if sample.name == "cachetally_requests_total" and sample.labels.get("cache") == "hit")


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    ledger = UsageLedger()
    metrics = Metrics(ledger)
    engine_runs: list[str] = []
    app = FastAPI(root_path="/api")  # vLLM: app.root_path = args.root_path

    @app.post("/v1/chat/completions")
    async def chat() -> Any:
        engine_runs.append("chat")
        if (key := current_request_key.get()) is not None:  # as the engine tap publishes
            ledger.publish(Scheduled(key, PROMPT, CACHED))
        return JSONResponse({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": PROMPT, "completion_tokens": 1, "total_tokens": PROMPT + 1,
                      "prompt_tokens_details": None},
        })

    @app.post("/v1/embeddings")
    async def embeddings() -> Any:
        engine_runs.append("embeddings")
        return JSONResponse({"object": "list", "data": []})

    app.add_middleware(UsagePatchMiddleware, ledger=ledger, metrics=metrics,
                       config=PatchConfig(refuse_unmetered=True))
    with serving_in_thread(app) as base:
        yield Served(base, metrics, engine_runs)


@pytest.mark.parametrize("prefix", ["/api", ""])
def test_a_chat_under_the_root_path_is_patched_and_counted_as_the_bare_one(served: Served, prefix: str) -> None:
    before = served.requests()
    with openai.OpenAI(base_url=f"{served.base}{prefix}/v1", api_key="unused", max_retries=0) as client:
        answer = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    assert (answer.usage.prompt_tokens, answer.usage.prompt_tokens_details.cached_tokens) == (PROMPT, CACHED)
    assert served.requests() == before + 1


@pytest.mark.parametrize("prefix", ["/api", ""])
def test_an_unmetered_route_under_the_root_path_is_refused_as_the_bare_one(served: Served, prefix: str) -> None:
    runs = len(served.engine_runs)
    answer = httpx.post(f"{served.base}{prefix}/v1/embeddings", json={"model": "m", "input": "hi"})
    assert answer.status_code == 403
    assert answer.json()["error"]["code"] == 403
    assert len(served.engine_runs) == runs  # the engine never ran it
