"""The engine tap (engine_adapter/vllm/tap.py, prefill.py) on a fake ``AsyncLLM``: what each
request's ``Scheduled`` puts in a real :class:`UsageLedger`, without an engine.

The fake does what vLLM 0.32's ``AsyncLLM.generate`` does that the tap relies on:
``add_request()`` on the same instance mints the internal request id (the external one plus a
random suffix), registers the request's state with the output processor (``request_states``,
its children's with ``n > 1``) and returns a queue named by it; the output processor sees the request's first
prefill (``_update_stats_from_output``, with the scheduler's ``PrefillStats``); then the
outputs come, with the request's totals as vLLM computes them (``num_cached_tokens`` is
``remote_prefill_cached_tokens`` when the request carries one). A non-streaming request
(``FINAL_ONLY``) has one output, at its end.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from types import SimpleNamespace as NS
from typing import Any

import pytest

from engine_adapter.events import current_request_key
from engine_adapter.vllm import compat
from engine_adapter.vllm.tap import EngineTap
from proxy.patching.ledger import EngineUsage, UsageLedger


@pytest.fixture(autouse=True)
def _no_startup_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tap checks the installed vLLM once per process at startup; these tests need none of it."""
    monkeypatch.setattr(compat, "check_version_once", lambda logger: True)
    monkeypatch.setattr(compat, "log_missing_once", lambda logger: [])


class _Processor:
    def __init__(self) -> None:
        self.request_states: dict[str, Any] = {}
        self.parent_requests: dict[str, Any] = {}

    def _update_stats_from_output(self, req_state, engine_core_output, timestamp, iteration_stats):
        pass


def _stats(prompt: int, cached: int, written: int) -> NS:
    return NS(num_prompt_tokens=prompt, num_cached_tokens=cached, num_local_cached_tokens=cached,
              num_external_cached_tokens=0, num_cache_creation_tokens=written)


class _Request:
    """One request's script: the scheduler's figures, and when it prefills and finishes."""

    def __init__(self, stats: NS) -> None:
        self.stats = stats
        self.prefill = asyncio.Event()
        self.finish = asyncio.Event()
        self.prefill.set()
        self.finish.set()


class _AsyncLLM:
    def __init__(self, make_state: Callable[[str, str, Any], Any] | None = None) -> None:
        self.output_processor = _Processor()
        self._suffixes = itertools.count()
        self._make_state = make_state or (lambda internal, external, prompt: NS(
            is_prefilling=True, parent_req=None, request_id=internal, external_req_id=external,
            prompt_token_ids=list(range(prompt.stats.num_prompt_tokens)), prompt_len=prompt.stats.num_prompt_tokens,
            remote_prefill_cached_tokens=None))

    async def add_request(self, request_id: str, prompt: Any, params: Any, **kwargs: Any) -> NS:
        internal = f"{request_id}-{next(self._suffixes):08x}"
        self.output_processor.request_states[internal] = self._make_state(internal, request_id, prompt)
        return NS(request_id=internal)

    async def generate(self, prompt: _Request, sampling_params: Any, request_id: str, **kwargs: Any):
        queue = await self.add_request(request_id, prompt, sampling_params)
        try:  # vLLM drops the state when the request finishes or is aborted
            state = self.output_processor.request_states[queue.request_id]
            await prompt.prefill.wait()
            self.output_processor._update_stats_from_output(state, NS(prefill_stats=prompt.stats), 0.0, None)
            remote = state.remote_prefill_cached_tokens
            await prompt.finish.wait()  # FINAL_ONLY: nothing reaches generate() before this
            yield NS(request_id=request_id, prompt_token_ids=list(range(prompt.stats.num_prompt_tokens)),
                     num_cached_tokens=prompt.stats.num_cached_tokens if remote is None else remote,
                     num_cache_creation_tokens=prompt.stats.num_cache_creation_tokens, finished=True)
        finally:
            self.output_processor.request_states.pop(queue.request_id, None)


async def _serve(client: _AsyncLLM, ledger: UsageLedger, key: str, request: _Request,
                 engine_id: str = "chatcmpl-k", params: Any = None) -> tuple[int, EngineUsage | None]:
    """One HTTP request as the middleware and vLLM's handler run it: (outputs seen, usage)."""
    ledger.open(key)
    token = current_request_key.set(key)
    seen = 0
    try:
        async for _ in client.generate(request, params, engine_id):
            seen += 1
    finally:
        current_request_key.reset(token)
        usage = ledger.close(key)
    return seen, usage


def test_a_request_is_billed_at_its_prefill_before_any_output() -> None:
    """A non-streaming request has no output before it ends: a client that leaves while it
    decodes (vLLM then aborts it) must find its prefill in the slot already."""
    async def main() -> tuple[tuple | None, tuple | None, bool]:
        client, ledger = _AsyncLLM(), UsageLedger()
        EngineTap(client, ledger)
        request = _Request(_stats(2000, 1920, 0))
        request.finish.clear()  # decoding until the client leaves
        served = asyncio.create_task(_serve(client, ledger, "k", request))
        await asyncio.sleep(0.01)
        during = _figures(ledger.usage("k"))
        served.cancel()  # the client left: vLLM's handler is cancelled
        await asyncio.gather(served, return_exceptions=True)
        return during, _figures(ledger.usage("k")), "k" in ledger

    during, after, still_open = asyncio.run(asyncio.wait_for(main(), 30))
    assert during == (2000, 1920, 1920, 0)
    assert (after, still_open) == (None, False)  # the slot closed with its request


async def _cut(client: _AsyncLLM, ledger: UsageLedger, requests: dict[str, _Request]) -> EngineUsage | None:
    """One HTTP request running one engine request per ``requests`` item (its engine id: its
    script), cut once each was added: the handler is cancelled and the slot closed at once,
    as vLLM's ``with_cancellation`` does for a JSON request (it does not wait for the
    cancelled handler) and vLLM's ``merge_async_iterators`` for a request over several prompts."""
    async def handler(engine_id: str, request: _Request) -> None:
        async for _ in client.generate(request, None, engine_id):
            pass

    ledger.open("k")
    token = current_request_key.set("k")
    handlers = [asyncio.create_task(handler(engine_id, r)) for engine_id, r in requests.items()]
    current_request_key.reset(token)
    await asyncio.sleep(0.01)
    for task in handlers:
        task.cancel()  # the client left
    usage = ledger.close("k")
    await asyncio.gather(*handlers, return_exceptions=True)
    return usage


@pytest.mark.parametrize("copies", [1, 3], ids=["n=1", "n=3"])
def test_a_request_cut_before_its_prefill_ended_is_billed_its_prompt_with_its_cache_unknown(copies: int) -> None:
    """vLLM reports nothing for a request aborted before its prefill ended (no prefill figures,
    no output), though it may have cached part of the prompt for nothing: the prompt vLLM
    counted stands, once however many copies it runs, and its cached tokens are unknown, never 0."""
    async def main() -> EngineUsage | None:
        client = _AsyncLLM() if copies == 1 else _FanOut([_stats(2000, 1920, 0)] * copies)
        ledger = UsageLedger()
        EngineTap(client, ledger)
        request = _Request(_stats(2000, 1920, 0))
        request.prefill.clear()  # queued, or prefilling in several engine steps
        return await _cut(client, ledger, {"chatcmpl-k": request})

    assert _billed(asyncio.run(asyncio.wait_for(main(), 30))) == (2000, None)


@pytest.mark.parametrize(("second_prefilled", "billed"), [(False, (2500, None)), (True, (2500, 2020))])
def test_a_request_over_two_prompts_cut_is_billed_each_prompt_once(second_prefilled: bool, billed: tuple) -> None:
    """A completions request over two prompts, cut while the first decodes: the first was
    billed at its prefill and is not billed again; the second is billed its prompt, its
    cache known only if its prefill ended."""
    async def main() -> EngineUsage | None:
        client, ledger = _AsyncLLM(), UsageLedger()
        EngineTap(client, ledger)
        first, second = _Request(_stats(2000, 1920, 0)), _Request(_stats(500, 100, 0))
        for request in (first, second):
            request.finish.clear()
        if not second_prefilled:
            second.prefill.clear()
        return await _cut(client, ledger, {"cmpl-k-0": first, "cmpl-k-1": second})

    assert _billed(asyncio.run(asyncio.wait_for(main(), 30))) == billed


class _EngineDead(Exception):
    """vLLM's ``EngineDeadError``."""


class _Stopping(_AsyncLLM):
    """What vLLM 0.32's stop does to a request in flight, at worst: ``shutdown()`` closes the
    client, and its output handler, reading the closed socket before it is cancelled, fails
    every request with ``EngineDeadError`` (vllm-project/vllm#48745)."""

    def __init__(self) -> None:
        super().__init__()
        self.closed = asyncio.Event()

    def shutdown(self, timeout: float | None = None) -> None:
        self.closed.set()

    async def generate(self, prompt: _Request, sampling_params: Any, request_id: str, **kwargs: Any):
        await self.add_request(request_id, prompt, sampling_params)
        await self.closed.wait()
        raise _EngineDead("EngineCore encountered an issue")
        yield  # an async generator, as vLLM's


@pytest.mark.parametrize("stopped", [True, False])
def test_a_request_failed_by_vllms_stop_ends_by_the_stops_cancellation(stopped: bool) -> None:
    """During vLLM's stop, a request the client fails waits, as those it leaves waiting, for
    the server to cancel it, which answers it as a stopped request (503 or SSE error), not a
    500 saying the engine failed. Without a stop, the engine's failure is the request's."""
    async def main() -> str:
        client, ledger = _Stopping(), UsageLedger()
        EngineTap(client, ledger)
        served = asyncio.create_task(_serve(client, ledger, "k", _Request(_stats(10, 0, 0))))
        await asyncio.sleep(0)  # the request reaches the engine
        if stopped:
            client.shutdown()  # as vLLM's stop calls it
        else:
            client.closed.set()  # the engine died on its own
        for _ in range(20):  # loop turns enough for the failure to reach the handler
            await asyncio.sleep(0)
        served.cancel()  # the server's stop: uvicorn cancels what is left
        (ended,) = await asyncio.gather(served, return_exceptions=True)
        return type(ended).__name__

    assert asyncio.run(asyncio.wait_for(main(), 30)) == ("CancelledError" if stopped else "_EngineDead")


def test_a_sink_that_fails_at_the_prefill_never_reaches_vllms_output_handler(caplog) -> None:
    """The hook runs in vLLM's output handler, which serves every request: an exception there
    would stop the engine for all. It is logged once, and the first output publishes instead."""
    class FailsOnce(UsageLedger):
        failed = False

        def publish(self, event: Any) -> None:
            if not self.failed:
                self.failed = True
                raise RuntimeError("a sink bug")
            super().publish(event)

    async def main() -> list[tuple[int, EngineUsage | None]]:
        client, ledger = _AsyncLLM(), FailsOnce()
        EngineTap(client, ledger)
        return [await _serve(client, ledger, key, _Request(_stats(2000, 1920, 0))) for key in "ab"]

    with caplog.at_level(logging.ERROR, logger="cachetally.engine.vllm"):
        served = asyncio.run(asyncio.wait_for(main(), 30))
    assert [(seen, _figures(usage)) for seen, usage in served] == [(1, (2000, 1920, None, 0)),
                                                                   (1, (2000, 1920, 1920, 0))]
    assert ["logged once" in r.getMessage() for r in caplog.records] == [True]


def test_thousands_of_requests_queued_before_their_prefill_are_each_billed_at_it() -> None:
    """vLLM does not bound its queue (``max_num_queued_reqs`` is None by default): 5,000
    requests added before any prefills are each billed at their prefill, and so at a cut."""
    assert asyncio.run(asyncio.wait_for(_queued_then_prefilled(5000, pause_s=0.2), 60)) == (5000, 5000)


async def _queued_then_prefilled(n: int, pause_s: float) -> tuple[int, int]:
    """``n`` requests added before any prefills, then all prefilled, then all finished: how
    many were billed at their prefill, and how many in the end."""
    client, ledger = _AsyncLLM(), UsageLedger()
    EngineTap(client, ledger)
    requests = [_Request(_stats(2000, 1920, 0)) for _ in range(n)]
    for request in requests:
        request.prefill.clear()
        request.finish.clear()
    served = [asyncio.create_task(_serve(client, ledger, f"k{i}", r)) for i, r in enumerate(requests)]
    await asyncio.sleep(pause_s)  # all added, none prefilled
    for request in requests:
        request.prefill.set()
    await asyncio.sleep(pause_s)
    at_prefill = sum(ledger.usage(f"k{i}") is not None for i in range(n))
    for request in requests:
        request.finish.set()
    return at_prefill, sum(usage is not None for _, usage in await asyncio.gather(*served))


def _figures(usage: EngineUsage | None) -> tuple | None:
    if usage is None:
        return None
    return (usage.prompt_tokens, usage.cached_tokens, usage.local_cached_tokens,
            usage.cache_creation_tokens)


def _billed(usage: EngineUsage | None) -> tuple[int, int | None] | None:
    """What a closed slot bills (proxy.patching.metering): every engine request's prompt, and
    the cached tokens unless one of them never had its figures published (then unknown)."""
    if usage is None:
        return None
    return usage.prompt_tokens + usage.unscheduled_tokens, None if usage.unscheduled else usage.cached_tokens


def _claiming_params(claim: int, transfer: dict[str, Any] | None = None) -> Any:
    """vLLM's own SamplingParams for a chat body carrying a decode leg's ``kv_transfer_params``
    (or ``transfer``)."""
    protocol = pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "kv_transfer_params": transfer or {"do_remote_prefill": True, "remote_prefill_cached_tokens": claim}}
    return protocol.ChatCompletionRequest(**body).to_sampling_params(16, {})


def _vllm_request_state(claim: int, transfer: dict[str, Any] | None = None) -> Callable[[str, str, Any], Any]:
    """vLLM's own RequestState for a chat body carrying a decode leg's ``kv_transfer_params``
    (or ``transfer``)."""
    pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.output_processor import RequestState

    params = _claiming_params(claim, transfer)

    def make(internal: str, external: str, _: Any) -> Any:
        request = EngineCoreRequest(
            request_id=internal, prompt_token_ids=list(range(1000)), mm_features=None,
            sampling_params=params, pooling_params=None, arrival_time=time.time(), lora_request=None,
            cache_salt=None, data_parallel_rank=None, external_req_id=external)
        return RequestState.from_new_request(None, request, None, None, 0, None, False, 1)

    return make


@pytest.mark.parametrize("pd_legs, claim, billed", [
    (False, 1000, (1000, 0, 0, 896)),   # a client's claim: the scheduler's figures stand
    (False, 5000, (1000, 0, 0, 896)),   # more than the prompt: still billed, the request goes on
    (True, 256, (1000, 256, None, None)),  # behind a P/D router: the prefill instance's hits
])
def test_a_clients_remote_prefill_claim_is_billed_only_behind_a_pd_router(pd_legs, claim, billed) -> None:
    async def main() -> tuple[int, EngineUsage | None]:
        client, ledger = _AsyncLLM(_vllm_request_state(claim)), UsageLedger()
        EngineTap(client, ledger, pd_legs=pd_legs)
        return await _serve(client, ledger, "k", _Request(_stats(1000, 0, 896)))

    seen, usage = asyncio.run(asyncio.wait_for(main(), 30))
    assert seen == 1
    assert _figures(usage) == billed


@pytest.mark.parametrize("hooked", [True, False])
def test_a_clients_remote_prefill_claim_is_never_billed_from_the_first_output(monkeypatch, hooked: bool) -> None:
    """Where a request's figures come from its first output instead of its prefill (it was
    the oldest of more than the cap waiting for their prefill, which a hundred completions
    bodies of 1,024 prompts at once make; or the running vLLM has no prefill hook), the output's
    ``num_cached_tokens`` is the body's ``remote_prefill_cached_tokens`` (vLLM's
    OutputProcessor puts it there). Billed from it, a client's claim made its prompt cached;
    off a P/D fleet the prompt is billed with its cache unknown. (The cap is made small here.)"""
    from engine_adapter.vllm import prefill

    monkeypatch.setattr(prefill, "_MAX_ENTRIES", 2)

    async def main() -> list[tuple | None]:
        client, ledger = _AsyncLLM(_vllm_request_state(1000)), UsageLedger()
        if not hooked:  # a vLLM whose output processor takes other parameters: no prefill hook
            client.output_processor._update_stats_from_output = lambda *args: None
        EngineTap(client, ledger)
        requests = [_Request(_stats(1000, 0, 896)) for _ in range(3)]
        for request in requests:
            request.prefill.clear()
        served = [asyncio.create_task(_serve(client, ledger, f"k{i}", r, params=_claiming_params(1000)))
                  for i, r in enumerate(requests)]
        await asyncio.sleep(0.05)  # all three added: the first no longer waits for its prefill
        for request in requests:
            request.prefill.set()
        return [_billed(usage) for _, usage in await asyncio.gather(*served)]

    billed = asyncio.run(asyncio.wait_for(main(), 30))
    assert billed == ([(1000, None), (1000, 0), (1000, 0)] if hooked else [(1000, None)] * 3)


def test_figures_that_fail_validation_are_not_published_and_the_request_goes_on(caplog) -> None:
    """A P/D decode whose router claims more prefill hits than the prompt has."""
    async def main() -> list[tuple[int, EngineUsage | None]]:
        state = lambda internal, external, _: NS(  # noqa: E731
            is_prefilling=True, parent_req=None, request_id=internal, external_req_id=external,
            prompt_token_ids=list(range(1000)), prompt_len=1000, remote_prefill_cached_tokens=5000)
        client, ledger = _AsyncLLM(state), UsageLedger()
        EngineTap(client, ledger, pd_legs=True)
        return [await _serve(client, ledger, key, _Request(_stats(1000, 0, 896))) for key in "ab"]

    with caplog.at_level(logging.WARNING, logger="cachetally.engine.vllm"):
        served = asyncio.run(asyncio.wait_for(main(), 30))
    # every output reached the client; the prompt vLLM counted stands, its cache unknown
    assert [(seen, _billed(usage)) for seen, usage in served] == [(1, (1000, None)), (1, (1000, None))]
    assert [r.getMessage() for r in caplog.records if "not published" in r.getMessage()] == [
        "engine figures not published (this is logged once): "
        "cached_tokens (5000) exceeds prompt_tokens (1000)"]


@pytest.mark.parametrize("b_prompt", [3000, 500])
def test_two_requests_sharing_an_engine_request_id_are_each_billed_their_own_figures(b_prompt) -> None:
    """vLLM's Responses API names engine requests after the body's ``request_id``: two
    concurrent non-streaming requests share one external id. Order: A prefills (warm), B
    prefills (cold), B finishes, A finishes."""
    async def main() -> tuple[tuple, tuple]:
        client, ledger = _AsyncLLM(), UsageLedger()
        EngineTap(client, ledger)
        a, b = _Request(_stats(2000, 1920, 0)), _Request(_stats(b_prompt, 0, b_prompt // 128 * 128))
        for request in (a, b):
            request.prefill.clear()
            request.finish.clear()
        served = [asyncio.create_task(_serve(client, ledger, key, request, "resp_same_0"))
                  for key, request in (("key-A", a), ("key-B", b))]
        await asyncio.sleep(0.01)
        for event in (a.prefill, b.prefill, b.finish, a.finish):
            event.set()
            await asyncio.sleep(0.01)
        return tuple(await asyncio.gather(*served))

    (seen_a, usage_a), (seen_b, usage_b) = asyncio.run(asyncio.wait_for(main(), 30))
    assert (seen_a, seen_b) == (1, 1)
    assert _figures(usage_a) == (2000, 1920, 1920, 0)
    assert _figures(usage_b) == (b_prompt, 0, 0, b_prompt // 128 * 128)


def test_requests_cut_before_their_prefill_never_crowd_out_one_still_waiting(monkeypatch, caplog) -> None:
    """Clients that leave while their request is queued (vLLM aborts it: no prefill comes) leave
    nothing waiting for one. However many do, a request queued before them is still billed at
    its prefill, so a client that then leaves while it decodes is billed the prompt, and no
    warning claims that requests pile up. (The cap is made small here; it is 100,000.)"""
    from engine_adapter.vllm import prefill

    monkeypatch.setattr(prefill, "_MAX_ENTRIES", 8)

    async def main() -> tuple | None:
        client, ledger = _AsyncLLM(), UsageLedger()
        EngineTap(client, ledger)
        waiting = _Request(_stats(2000, 1920, 0))
        waiting.prefill.clear()
        waiting.finish.clear()
        served = asyncio.create_task(_serve(client, ledger, "kept", waiting))
        for i in range(3 * 8):
            queued = _Request(_stats(100, 0, 0))
            queued.prefill.clear()
            cut = asyncio.create_task(_serve(client, ledger, f"cut{i}", queued, engine_id=f"chatcmpl-cut{i}"))
            await asyncio.sleep(0)  # added, not prefilled
            await asyncio.sleep(0)
            cut.cancel()  # the client left: vLLM's handler is cancelled
            await asyncio.gather(cut, return_exceptions=True)
        waiting.prefill.set()
        await asyncio.sleep(0.01)
        at_prefill = _figures(ledger.usage("kept"))
        served.cancel()  # that client leaves too, while it decodes
        await asyncio.gather(served, return_exceptions=True)
        return at_prefill

    with caplog.at_level(logging.WARNING, logger="cachetally.engine.vllm"):
        assert asyncio.run(asyncio.wait_for(main(), 30)) == (2000, 1920, 1920, 0)
    assert [r.getMessage() for r in caplog.records if "wait for their prefill" in r.getMessage()] == []


@pytest.mark.parametrize(("queued", "at_prefill", "warned"), [(8, 8, False), (9, 8, True)])
def test_as_many_requests_as_the_cap_wait_for_their_prefill_and_one_more_evicts_the_oldest(
        monkeypatch, caplog, queued: int, at_prefill: int, warned: bool) -> None:
    """The cap is how many requests may wait for their prefill (the ledger's slots): that many
    are each billed at it, with no warning; one more, and the oldest is billed from its first
    output instead, which is logged. (The cap is made small here; it is 100,000.)"""
    from engine_adapter.vllm import prefill

    monkeypatch.setattr(prefill, "_MAX_ENTRIES", 8)

    with caplog.at_level(logging.WARNING, logger="cachetally.engine.vllm"):
        assert asyncio.run(asyncio.wait_for(_queued_then_prefilled(queued, pause_s=0.05), 30)) == (at_prefill, queued)
    assert any("wait for their prefill" in r.getMessage() for r in caplog.records) == warned


class _FanOut(_AsyncLLM):
    """``n`` copies of one prompt, as vLLM's ``ParentRequest`` runs them: child requests
    ``{i}_{parent}``, prefilled in order; without streaming, the one output carries the figures
    of the copy that finished last. ``embeds``: the prompt is ``prompt_embeds``, which vLLM's
    request state holds with no token ids (its outputs: one placeholder id per row)."""

    def __init__(self, copies: list[NS], embeds: bool = False) -> None:
        super().__init__()
        self.copies = copies
        self.embeds = embeds

    async def add_request(self, request_id: str, prompt: Any, params: Any, **kwargs: Any) -> NS:
        internal = f"{request_id}-{next(self._suffixes):08x}"
        parent = NS(request_id=internal, child_requests={f"{i}_{internal}" for i in range(len(self.copies))})
        processor = self.output_processor
        processor.parent_requests[internal] = parent
        for i, stats in enumerate(self.copies):
            processor.request_states[f"{i}_{internal}"] = NS(
                is_prefilling=True, parent_req=parent, request_id=f"{i}_{internal}", external_req_id=request_id,
                prompt_len=stats.num_prompt_tokens, remote_prefill_cached_tokens=None,
                prompt_token_ids=None if self.embeds else list(range(stats.num_prompt_tokens)))
        return NS(request_id=internal)

    async def generate(self, prompt: _Request, sampling_params: Any, request_id: str, **kwargs: Any):
        queue = await self.add_request(request_id, prompt, sampling_params)
        states = self.output_processor.request_states
        await prompt.prefill.wait()
        for i, stats in enumerate(self.copies):
            state = states[f"{i}_{queue.request_id}"]
            self.output_processor._update_stats_from_output(state, NS(prefill_stats=stats), 0.0, None)
        await prompt.finish.wait()
        last = self.copies[-1]
        yield NS(request_id=request_id, prompt_token_ids=list(range(last.num_prompt_tokens)),
                 num_cached_tokens=last.num_cached_tokens, num_cache_creation_tokens=last.num_cache_creation_tokens,
                 finished=True)


@pytest.mark.parametrize("embeds", [False, True], ids=["token-ids", "prompt-embeds"])
def test_n_copies_of_a_prompt_are_billed_once_with_what_the_first_copy_found(embeds: bool) -> None:
    """The policy for ``n > 1``: the prompt once, with its first copy's figures (cold: 0 read,
    its blocks written), at the prefill, not the second copy's hit on the first's blocks that
    vLLM's non-streaming output reports; for ``prompt_embeds`` as for token ids."""
    async def main() -> tuple[tuple | None, tuple | None, int]:
        client = _FanOut([_stats(2000, 0, 1920), _stats(2000, 1920, 0), _stats(2000, 1920, 0)], embeds)
        ledger = UsageLedger()
        EngineTap(client, ledger)
        request = _Request(_stats(2000, 0, 1920))
        request.finish.clear()
        served = asyncio.create_task(_serve(client, ledger, "k", request))
        await asyncio.sleep(0.01)
        at_prefill = _figures(ledger.usage("k"))
        request.finish.set()
        _, usage = await served
        return at_prefill, _figures(usage), usage.events if usage else 0

    at_prefill, billed, events = asyncio.run(asyncio.wait_for(main(), 30))
    assert at_prefill == billed == (2000, 0, 0, 1920)
    assert events == 1


@pytest.mark.parametrize(("local", "external", "tiers"), [
    (1024, 896, (1024, 896)),  # they add up to the cached total: reported
    (1024, 0, (None, None)),   # they do not: neither is reported, the total stands
    (1024, 1024, (None, None)),
])
def test_cache_tiers_are_reported_only_when_they_add_up_to_the_cached_total(local, external, tiers) -> None:
    async def main() -> EngineUsage | None:
        client, ledger = _AsyncLLM(), UsageLedger()
        EngineTap(client, ledger)
        stats = NS(num_prompt_tokens=2000, num_cached_tokens=1920, num_local_cached_tokens=local,
                   num_external_cached_tokens=external, num_cache_creation_tokens=0)
        return (await _serve(client, ledger, "k", _Request(stats)))[1]

    usage = asyncio.run(asyncio.wait_for(main(), 30))
    assert usage is not None
    assert (usage.cached_tokens, usage.local_cached_tokens, usage.external_cached_tokens) == (1920, *tiers)


class _Stream(_AsyncLLM):
    """A streamed request as vLLM runs it: the engine puts each step's output into vLLM's own
    ``RequestOutputCollector``, which merges the ``DELTA`` outputs the serving layer has not
    taken yet (a client that reads slowly holds the serving layer in its ``send``)."""

    def __init__(self, steps: list[list[int]], taken: asyncio.Event) -> None:
        super().__init__()
        self.steps, self.taken = steps, taken

    async def generate(self, prompt: _Request, sampling_params: Any, request_id: str, **kwargs: Any):
        # importorskip keeps the warnings torch raises on import out of this process's filter
        outputs = pytest.importorskip("vllm.outputs")
        collector_class = pytest.importorskip("vllm.v1.engine.output_processor").RequestOutputCollector
        queue = await self.add_request(request_id, prompt, sampling_params)
        state = self.output_processor.request_states[queue.request_id]
        self.output_processor._update_stats_from_output(state, NS(prefill_stats=prompt.stats), 0.0, None)
        collector = collector_class(sampling_params.output_kind, queue.request_id)

        async def engine() -> None:
            for i, tokens in enumerate(self.steps):
                choice = outputs.CompletionOutput(index=0, text="", token_ids=tokens, cumulative_logprob=None,
                                                  logprobs=None)
                collector.put(outputs.RequestOutput(request_id, None, list(range(prompt.stats.num_prompt_tokens)), None,
                                            [choice], finished=i == len(self.steps) - 1))
                await asyncio.sleep(0)

        steps = asyncio.create_task(engine())
        finished = False
        while not finished:
            output = await collector.get()
            finished = output.finished
            yield output
            await self.taken.wait()
        await steps


def test_a_stream_whose_outputs_vllm_merged_is_counted_in_tokens_not_events() -> None:
    """Ten steps of one token each, while the serving layer is held after the first event: vLLM
    merges the other nine into one output, one event. The ledger holds the ten tokens."""
    sampling = pytest.importorskip("vllm.sampling_params")

    async def main() -> tuple[int, EngineUsage | None]:
        taken = asyncio.Event()
        client, ledger = _Stream([[i] for i in range(10)], taken), UsageLedger()
        EngineTap(client, ledger)
        params = sampling.SamplingParams(max_tokens=10, output_kind=sampling.RequestOutputKind.DELTA)
        ledger.open("k")
        token = current_request_key.set("k")
        events = 0
        try:
            async for _ in client.generate(_Request(_stats(100, 0, 0)), params, "chatcmpl-k"):
                events += 1
                if events == 1:  # the client reads nothing for a while
                    await asyncio.sleep(0.05)
                    taken.set()
        finally:
            current_request_key.reset(token)
        return events, ledger.close("k")

    events, usage = asyncio.run(asyncio.wait_for(main(), 30))
    assert usage is not None
    assert (events, usage.generated_tokens) == (2, 10)


def test_cumulative_outputs_are_counted_once_per_token() -> None:
    """A non-streamed request's outputs are ``CUMULATIVE`` (or final only): every output holds
    each choice's tokens so far, so only what it adds is counted."""
    sampling = pytest.importorskip("vllm.sampling_params")

    async def main() -> EngineUsage | None:
        taken = asyncio.Event()
        taken.set()
        client, ledger = _Stream([[1], [1, 2], [1, 2, 3]], taken), UsageLedger()
        EngineTap(client, ledger)
        params = sampling.SamplingParams(max_tokens=3, output_kind=sampling.RequestOutputKind.CUMULATIVE)
        ledger.open("k")
        token = current_request_key.set("k")
        try:
            async for _ in client.generate(_Request(_stats(100, 0, 0)), params, "chatcmpl-k"):
                pass
        finally:
            current_request_key.reset(token)
        return ledger.close("k")

    usage = asyncio.run(asyncio.wait_for(main(), 30))
    assert usage is not None and usage.generated_tokens == 3


@pytest.mark.parametrize(("engine_id", "n", "choices"), [
    ("cmpl-k-1", 2, (2, 2)), ("cmpl-k-0", 1, (0, 1)), ("cmpl-k-3", 3, (9, 3)),
    ("chatcmpl-k", 2, (None, 2)), ("cmpl-k-x", 1, (None, 1)), ("cmpl-kk-1", 1, (None, 1)), ("cmpl-k-\u00b2", 1, (None, 1)),
])
def test_an_engine_request_says_which_choices_of_its_response_it_makes(
        engine_id: str, n: int, choices: tuple[int | None, int]) -> None:
    """vLLM's completions run prompt i of key k as ``cmpl-k-i``, whose n choices come i*n
    first in the response: the event says so, so a per-prompt usage chunk finds its prompt."""
    async def main() -> list[tuple[int, int, int | None, int]]:
        client, ledger = _AsyncLLM(), UsageLedger()
        EngineTap(client, ledger)
        _, usage = await _serve(client, ledger, "k", _Request(_stats(300, 256, 0)), engine_id, NS(n=n))
        assert usage is not None
        return usage.per_request

    assert asyncio.run(asyncio.wait_for(main(), 30)) == [(300, 256, *choices)]


@pytest.mark.parametrize("transfer", [
    {"do_remote_prefill": False, "remote_prefill_cached_tokens": 1000},
    {"do_remote_prefill": True, "remote_prefill_cached_tokens": "1000"},
    {"do_remote_prefill": True},
], ids=["not-remote", "not-an-int", "no-claim"])
def test_kv_transfer_params_vllm_does_not_report_leave_the_first_outputs_figures_billed(transfer) -> None:
    """vLLM reports a ``remote_prefill_cached_tokens`` as the output's cached tokens only with
    ``do_remote_prefill`` and as an integer: otherwise the output's figures are the
    scheduler's, and a request whose figures come from it (no prefill hook) bills them."""
    async def main() -> tuple[int, int | None] | None:
        client, ledger = _AsyncLLM(_vllm_request_state(0, transfer)), UsageLedger()
        client.output_processor._update_stats_from_output = lambda *args: None
        EngineTap(client, ledger)
        request = _Request(_stats(1000, 512, 488))
        _, usage = await _serve(client, ledger, "k", request, params=_claiming_params(0, transfer))
        return _billed(usage)

    assert asyncio.run(asyncio.wait_for(main(), 30)) == (1000, 512)


def test_behind_a_pd_router_a_decodes_claim_is_billed_from_the_first_output_too() -> None:
    """Behind a P/D router the claim is the prefill instance's hits, as its router sent them:
    where the figures come from the first output (no prefill hook), it is billed there too."""
    async def main() -> tuple[int, int | None] | None:
        client, ledger = _AsyncLLM(_vllm_request_state(256)), UsageLedger()
        client.output_processor._update_stats_from_output = lambda *args: None
        EngineTap(client, ledger, pd_legs=True)
        _, usage = await _serve(client, ledger, "k", _Request(_stats(1000, 0, 896)), params=_claiming_params(256))
        return _billed(usage)

    assert asyncio.run(asyncio.wait_for(main(), 30)) == (1000, 256)
