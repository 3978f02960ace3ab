"""vLLM's ``Scheduler`` and ``AsyncScheduler`` (a CUDA GPU's default) driven through the same
request schedules without an engine, their outputs fed to a real ``OutputProcessor`` with
cachetally's :class:`~engine_adapter.vllm.prefill.PrefillTap` installed; prints, as JSON, what
the tap handed over per request and what the scheduler itself counted at its first prefill.

Run in a child process (``python -m tests.engine_adapter.vllm.scheduler_drive``) by
``test_async_scheduler.py``: importing vLLM changes the process's environment. The schedulers
are built as vLLM's own unit tests build them (``tests/v1/core/utils.py``: a ``VllmConfig``, a
one-group ``KVCacheConfig``, no model weights; the default model folder gives its config). The
engine core's loop is copied in its two shapes: ``step()`` hands each step's outputs back before
the next schedule; ``step_with_batch_queue()`` (async scheduling) schedules step ``k + 1``
before it hands back step ``k``'s, so aborts and preemptions can meet an output in flight.
A prefill chunk samples no token, as vLLM's model runner discards a partial prefill's.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from collections.abc import Callable
from copy import copy

os.environ["HF_HUB_OFFLINE"] = "1"  # the model folder is local: nothing may come from a hub

import torch  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.engine import EngineCoreRequest  # noqa: E402
from vllm.v1.engine.output_processor import OutputProcessor  # noqa: E402
from vllm.v1.engine.parallel_sampling import ParentRequest  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from engine_adapter.vllm.model_store import default_model_dir  # noqa: E402
from engine_adapter.vllm.prefill import PrefillTap  # noqa: E402

BLOCK = 16  # CUDA's default block size
_hash = get_hash_fn_by_name("sha256")
init_none_hash(_hash)
_hasher = get_request_block_hasher(BLOCK, _hash)


def _scheduler(cls: type[Scheduler], num_blocks: int, chunk: int) -> Scheduler:
    config = VllmConfig(
        model_config=ModelConfig(model=str(default_model_dir()), dtype="float32", skip_tokenizer_init=True),
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=chunk, max_model_len=2048,
                                         enable_chunked_prefill=True, is_encoder_decoder=False,
                                         async_scheduling=cls is AsyncScheduler),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
    )
    config.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    return cls(vllm_config=config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(config),
               block_size=BLOCK, log_stats=True)


class _EngineClient:
    """What the tap reads from ``AsyncLLM``: its output processor."""

    def __init__(self) -> None:
        self.output_processor = OutputProcessor(None, log_stats=True)


Action = Callable[["_Run"], None]


class _Run:
    """One schedule through one scheduler class."""

    def __init__(self, cls: type[Scheduler], num_blocks: int, chunk: int) -> None:
        self.cls = cls
        self.scheduler = _scheduler(cls, num_blocks, chunk)
        client = _EngineClient()
        self.processor = client.output_processor
        self.published: dict[str, list[list[int | None]]] = {}
        self.tap = PrefillTap(client, self._prefilled)
        assert self.tap.installed
        self.children: dict[str, list[Request]] = {}
        self.counted: dict[str, int] = {}  # engine request -> cached tokens at its first scheduled prefill

    def _prefilled(self, name: str, first, prompt_tokens: int) -> None:
        self.published.setdefault(name, []).append([first.cached_tokens, first.local_cached_tokens,
                                                    first.external_cached_tokens, first.cache_creation_tokens,
                                                    prompt_tokens])

    def add(self, name: str, prompt: list[int], n: int, max_tokens: int) -> None:
        """What ``AsyncLLM.add_request`` does: one engine request, or ``n`` children of a parent."""
        params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                                output_kind=RequestOutputKind.DELTA)
        request = EngineCoreRequest(request_id=f"{name}-internal", prompt_token_ids=prompt, mm_features=None,
                                    sampling_params=params, pooling_params=None, arrival_time=time.time(),
                                    lora_request=None, cache_salt=None, data_parallel_rank=None,
                                    external_req_id=name)
        self.tap.expect(request.request_id, name)
        parent, children = None, [request]
        if n > 1:
            parent, children = ParentRequest(request), []
            for index in range(n):
                child = request if index == n - 1 else copy(request)
                child.request_id, child.sampling_params = parent.get_child_info(index)
                children.append(child)
        for index, child in enumerate(children):
            self.processor.add_request(child, None, parent, index, None)
        self.children[name] = [Request.from_engine_core_request(child, _hasher) for child in children]
        for child in self.children[name]:
            self.scheduler.add_request(child)

    def abort(self, name: str) -> None:
        """What ``AsyncLLM.abort`` does when the client leaves."""
        ids = [child.request_id for child in self.children[name]]
        self.processor.abort_requests([f"{name}-internal"] if len(ids) > 1 else ids, internal=True)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        self.tap.forget(f"{name}-internal")

    def _model_runner_output(self, scheduled, chunks: dict[str, bool]) -> ModelRunnerOutput:
        ids = list(scheduled.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=[[] if chunks[r] else [7] for r in ids],
                                 logprobs=None, prompt_logprobs_dict={}, pooler_output=[])

    def _hand_back(self, scheduled, chunks: dict[str, bool]) -> None:
        outputs = self.scheduler.update_from_output(scheduled, self._model_runner_output(scheduled, chunks))
        for batch in outputs.values():
            self.processor.process_outputs(batch.outputs, batch.timestamp, None)

    def drive(self, script: dict[int, list[Action]], max_steps: int = 400) -> dict:
        in_flight: deque = deque()
        depth = 2 if self.cls is AsyncScheduler else 1  # step_with_batch_queue's queue, or step()
        for step in range(max_steps):
            for action in script.get(step, ()):
                action(self)
            scheduled = self.scheduler.schedule()
            for children in self.children.values():
                for child in children:
                    stats = child.prefill_stats
                    if stats is not None and stats.num_prompt_tokens and child.request_id not in self.counted:
                        self.counted[child.request_id] = stats.num_cached_tokens
            chunks = {r: self.scheduler.requests[r].is_prefill_chunk for r in scheduled.num_scheduled_tokens}
            if scheduled.total_num_scheduled_tokens:
                in_flight.append((scheduled, chunks))
            if len(in_flight) >= depth or (in_flight and not scheduled.total_num_scheduled_tokens):
                self._hand_back(*in_flight.popleft())
            if step >= max(script) and not in_flight and not self.scheduler.has_unfinished_requests():
                break
        return {
            "published": self.published,
            "counted": {name: [self.counted.get(child.request_id) for child in children]
                        for name, children in self.children.items()},
            "preemptions": {name: sum(child.num_preemptions for child in children)
                            for name, children in self.children.items()},
        }


def _add(name: str, prompt: list[int], n: int = 1, max_tokens: int = 4) -> Action:
    return lambda run: run.add(name, prompt, n, max_tokens)


def _abort(name: str) -> Action:
    return lambda run: run.abort(name)


def _tokens(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


PROMPT = _tokens(1000, 100)  # six whole blocks and 4 tokens
#: name -> (steps -> actions, KV blocks, token budget per step)
SCENARIOS: dict[str, tuple[dict[int, list[Action]], int, int]] = {
    "cold-then-repeat": ({0: [_add("cold", PROMPT)], 3: [_add("repeat", PROMPT)]}, 1000, 8192),
    "repeat-while-first-in-flight": ({0: [_add("first", PROMPT)], 1: [_add("second", PROMPT)]}, 1000, 8192),
    "n2-and-shared-prefix-same-step": ({0: [_add("n2", _tokens(2000, 150), n=2),
                                            _add("a", PROMPT[:50] + [5] * 40), _add("b", PROMPT[:50] + [6] * 40)]},
                                       1000, 8192),
    "abort-mid-chunked-prefill": ({0: [_add("cut", _tokens(3000, 300))], 2: [_abort("cut")],
                                   4: [_add("after", _tokens(3000, 300))]}, 1000, 64),
    "preemption": ({0: [_add("p1", _tokens(4000, 60), max_tokens=40), _add("p2", _tokens(5000, 60), max_tokens=40)],
                    1: [_add("p3", _tokens(4000, 60), max_tokens=40)]}, 10, 8192),
    "preemption-n3": ({0: [_add("m", _tokens(6000, 45), n=3, max_tokens=30)]}, 9, 8192),
    # b's first decode needs a fifth block: b is preempted in the schedule after its prefill,
    # which under async scheduling is before that prefill's output is handed back.
    "preempted-with-prefill-output-in-flight": ({0: [_add("a", _tokens(7000, 20), max_tokens=10)],
                                                 1: [_add("b", _tokens(8000, 32), max_tokens=5)]}, 5, 8192),
}


def main() -> None:
    results = {name: {cls.__name__: _Run(cls, blocks, chunk).drive(script) for cls in (Scheduler, AsyncScheduler)}
               for name, (script, blocks, chunk) in SCENARIOS.items()}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
