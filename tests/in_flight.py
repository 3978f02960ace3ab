"""A JSON request and a stream in flight when a real vLLM server is stopped (docs/RELIABILITY.md §14).

The shared vLLM server's fixture (tests/conftest.py) starts them just before its SIGTERM
and checks them after the exit: each client has its whole answer, or the OpenAI error of
a stopped request (a 503 in error JSON, or one SSE ``error`` event that ends the stream),
and each request has exactly one usage record. A server that waits on them until it is
killed cuts both off and writes neither record.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import httpx
import openai
import orjson

from proxy.asgi.errors import STOPPED
from tests.load import report
from tests.servers import metric_value

#: Long enough to be decoding still at the signal on any engine; short enough that the
#: engine, which goes on with them after the API servers stop, is done well within its
#: own --shutdown-timeout.
MAX_TOKENS = 256


class RequestsInFlight:
    """One chat stream and one JSON completions request, each in a thread of its own."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self.url, self.timeout_s = url, timeout_s
        self.got: dict[str, str] = {}
        self._streaming = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Send both; return once the stream's first chunk arrived and the server holds both."""
        model = httpx.get(f"{self.url}/v1/models").json()["data"][0]["id"]
        slots = metric_value(httpx.get(f"{self.url}/metrics").text, "cachetally_ledger_open_slots")
        for stream in (False, True):
            self._threads.append(threading.Thread(target=self._ask, args=(model, stream, uuid.uuid4().hex)))
            self._threads[-1].start()
        deadline = time.monotonic() + self.timeout_s
        while not (self._streaming.is_set() and metric_value(
                httpx.get(f"{self.url}/metrics").text, "cachetally_ledger_open_slots") >= slots + 2):
            assert time.monotonic() < deadline and all(t.is_alive() for t in self._threads), self.got
            time.sleep(0.05)

    def check(self, usage: Path) -> None:
        """After the server exited: each request's answer, or the stop's error, and one record."""
        for thread in self._threads:
            thread.join(self.timeout_s)
        report("vllm-stop-in-flight", outcomes=sorted(self.got.values()))
        assert len(self.got) == 2 and set(self.got.values()) <= {"error", "whole"}, self.got
        records = [orjson.loads(line) for path in sorted(usage.glob("*.jsonl"))
                   for line in path.read_bytes().splitlines()]
        for rid, outcome in self.got.items():
            # A record's id is the client's, then the API server's tag (.p<pid>).
            mine = [record for record in records if record["request_id"].split(".")[0] == rid]
            assert len(mine) == 1, (rid, mine)
            assert mine[0]["outcome"] == ("completed" if outcome == "whole" else "error"), mine[0]

    def _ask(self, model: str, stream: bool, rid: str) -> None:
        try:
            self.got[rid] = self._answer(model, stream, rid)
        except openai.APIStatusError as exc:  # before the answer began
            body = orjson.loads(exc.response.content)
            stopped = exc.status_code == 503 and body["error"]["message"] == STOPPED
            self.got[rid] = "error" if stopped else f"wrong: {exc!r}"
        except openai.APIError as exc:  # the SSE error event of a started stream
            self.got[rid] = "error" if exc.message == STOPPED else f"wrong: {exc!r}"
        except Exception as exc:  # noqa: BLE001 - a cut connection, reported by check()
            self.got[rid] = f"wrong: {exc!r}"

    def _answer(self, model: str, stream: bool, rid: str) -> str:
        options = {"max_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True},
                   "extra_headers": {"x-request-id": rid}}
        with openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0,
                           timeout=self.timeout_s) as client:
            if not stream:
                answer = client.completions.create(model=model, prompt="Tell a long story.", **options)
                finished = [choice.finish_reason for choice in answer.choices]
            else:
                finished = []
                messages = [{"role": "user", "content": "Tell a long story."}]
                for chunk in client.chat.completions.create(model=model, messages=messages, stream=True, **options):
                    self._streaming.set()
                    finished += [choice.finish_reason for choice in chunk.choices]
        return "whole" if finished[-1] == "length" else f"wrong: finished {finished[-1]}"
