"""``cachetally bench cache``: cached tokens and TTFT, cold vs warm vs prefix-sharing.

Through the official ``openai`` client, streaming chat with ``include_usage``:

1. one untimed warm-up request (a short unique prompt), so engine start-up costs do not
   land on the cold measurement;
2. a **cold** prompt of about N tokens, unique from its first token, so nothing of it is
   cached;
3. K **warm** repeats of exactly that prompt;
4. K **prefix** prompts sharing only its first half, each with a different tail.

Per request it records ``prompt_tokens``, ``usage.prompt_tokens_details.cached_tokens``
and TTFT: the time from sending the request to the first chunk with content. The summary
is the token hit rate over all timed requests and the warm (and prefix) TTFT median over
the cold TTFT.

Prompts are common English words, about one token each for real tokenizers; the reported
``prompt_tokens`` is the truth.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import openai

_WORDS = (
    "the of and to in is was for on are with as at be this have from or one had by word but "
    "not what all were we when your can said there use an each which she do how their if will "
    "up other about out many then them these so some her would make like him into time has look "
    "two more write go see number no way could people my than first water been call who oil its "
    "now find long down day did get come made may part over new sound take only little work know "
    "place year live me back give most very after thing our just name good sentence man think "
    "say great where help through much before line right too mean old any same tell boy follow "
    "came want show also around form three small set put end does another well large must big "
    "even such because turn here why ask went men read need land different home us move try kind"
).split()


@dataclass(frozen=True, slots=True)
class Sample:
    kind: str  # cold | warm | prefix
    prompt_tokens: int | None
    cached_tokens: int | None
    ttft_ms: float | None

    @property
    def cached_fraction(self) -> float | None:
        if self.cached_tokens is None or not self.prompt_tokens:
            return None
        return self.cached_tokens / self.prompt_tokens


@dataclass(slots=True)
class CacheBench:
    url: str
    model: str
    prompt_tokens: int
    repeats: int
    samples: list[Sample] = field(default_factory=list)

    def of(self, kind: str) -> list[Sample]:
        return [s for s in self.samples if s.kind == kind]

    def summary(self) -> dict[str, Any]:
        known = [s for s in self.samples if s.cached_tokens is not None and s.prompt_tokens]
        prompt = sum(s.prompt_tokens or 0 for s in known)
        cached = sum(s.cached_tokens or 0 for s in known)
        cold, warm, prefix = (_median_ttft(self.of(kind)) for kind in ("cold", "warm", "prefix"))
        return {
            "requests": len(self.samples),
            "total_prompt_tokens": prompt,
            "total_cached_tokens": cached,
            "token_hit_rate": round(cached / prompt, 4) if prompt else None,
            "ttft_cold_ms": _round(cold),
            "ttft_warm_ms": _round(warm),
            "ttft_prefix_ms": _round(prefix),
            "ttft_warm_over_cold": _ratio(warm, cold),
            "ttft_prefix_over_cold": _ratio(prefix, cold),
        }

    def as_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "model": self.model,
            "prompt_tokens_target": self.prompt_tokens,
            "repeats": self.repeats,
            "requests": [
                {**asdict(s), "ttft_ms": _round(s.ttft_ms), "cached_fraction": _round(s.cached_fraction, 4)}
                for s in self.samples
            ],
            "summary": self.summary(),
        }


def _median_ttft(samples: list[Sample]) -> float | None:
    values = [s.ttft_ms for s in samples if s.ttft_ms is not None]
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def _round(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(count))


def api_base(url: str) -> str:
    """``http://host:port``, ``…/`` or ``…/v1``: the client's base URL ends in ``/v1``."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"


def default_model(client: openai.OpenAI) -> str:
    models = client.models.list().data
    if not models:
        raise RuntimeError("the server lists no models (GET /v1/models); pass --model")
    return models[0].id


def measure(client: openai.OpenAI, model: str, kind: str, prompt: str, max_tokens: int) -> Sample:
    """One streamed chat request: TTFT to the first content chunk, and its usage."""
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    ttft: float | None = None
    usage = None
    for chunk in stream:
        if ttft is None and any(c.delta.content for c in chunk.choices):
            ttft = (time.perf_counter() - start) * 1000
        if chunk.usage is not None:
            usage = chunk.usage
    details = usage.prompt_tokens_details if usage is not None else None
    return Sample(
        kind=kind,
        prompt_tokens=usage.prompt_tokens if usage is not None else None,
        cached_tokens=details.cached_tokens if details is not None else None,
        ttft_ms=ttft,
    )


def run(
    client: openai.OpenAI,
    model: str,
    *,
    url: str,
    prompt_tokens: int = 1024,
    repeats: int = 3,
    max_tokens: int = 8,
    on_request: Callable[[Sample], None] = lambda sample: None,
) -> CacheBench:
    """Warm-up, cold, ``repeats`` warm, ``repeats`` prefix-sharing; ``on_request`` after each."""
    run_id = uuid.uuid4().hex
    rng = random.Random(run_id)
    half = max(1, prompt_tokens // 2)
    # The run id first, so no block of this run's prompts is cached before the cold one.
    shared = f"Run {run_id}. {_words(rng, half)}"
    tails = [f"Variant {i} {uuid.uuid4().hex}. {_words(rng, prompt_tokens - half)}" for i in range(repeats + 1)]
    measure(client, model, "warmup", f"Warm-up {uuid.uuid4().hex}.", 1)
    bench = CacheBench(url=url, model=model, prompt_tokens=prompt_tokens, repeats=repeats)
    plan = [("cold", tails[0])] + [("warm", tails[0])] * repeats + [("prefix", t) for t in tails[1:]]
    for kind, tail in plan:
        sample = measure(client, model, kind, f"{shared}\n{tail}", max_tokens)
        bench.samples.append(sample)
        on_request(sample)
    return bench


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(bench: CacheBench) -> str:
    lines = [f"cachetally bench cache: {bench.url} model={bench.model}", ""]
    lines.append(f"{'kind':<8}{'prompt_tokens':>15}{'cached_tokens':>15}{'cached %':>10}{'TTFT ms':>10}")
    for s in bench.samples:
        pct = None if s.cached_fraction is None else 100 * s.cached_fraction
        lines.append(
            f"{s.kind:<8}{_fmt(s.prompt_tokens, 'd'):>15}{_fmt(s.cached_tokens, 'd'):>15}"
            f"{_fmt(pct, '.1f'):>10}{_fmt(s.ttft_ms, '.1f'):>10}"
        )
    summary = bench.summary()
    lines += [
        "",
        f"token hit rate: {_fmt(summary['token_hit_rate'], '.4f')} "
        f"({summary['total_cached_tokens']} of {summary['total_prompt_tokens']} prompt tokens cached)",
        f"TTFT cold: {_fmt(summary['ttft_cold_ms'], '.1f')} ms   "
        f"warm (median of {bench.repeats}): {_fmt(summary['ttft_warm_ms'], '.1f')} ms   "
        f"warm/cold: {_fmt(summary['ttft_warm_over_cold'], '.3f')}",
        f"TTFT prefix-sharing (median of {bench.repeats}): {_fmt(summary['ttft_prefix_ms'], '.1f')} ms   "
        f"prefix/cold: {_fmt(summary['ttft_prefix_over_cold'], '.3f')}",
    ]
    if any(s.cached_tokens is None for s in bench.samples):
        lines.append("note: some responses carried no cached_tokens (is the server behind cachetally?)")
    return "\n".join(lines)


def plot(bench: CacheBench, path: Path) -> None:
    """TTFT against cached fraction, one colour per kind. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for kind, marker in (("cold", "o"), ("warm", "s"), ("prefix", "^")):
        points = [(s.cached_fraction, s.ttft_ms) for s in bench.of(kind)
                  if s.cached_fraction is not None and s.ttft_ms is not None]
        if points:
            ax.scatter(*zip(*points, strict=True), label=kind, marker=marker)
    ax.set_xlabel("cached fraction of prompt tokens")
    ax.set_ylabel("TTFT (ms)")
    ax.set_xlim(-0.05, 1.05)
    ax.set_ylim(bottom=0)
    ax.set_title(f"prefix cache: {bench.model} (~{bench.prompt_tokens} prompt tokens)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def matplotlib_missing() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return True
    return False


def progress(total: int) -> Any:
    """A tqdm bar on stderr (hidden when stderr is not a terminal)."""
    from tqdm import tqdm

    return tqdm(total=total, desc="bench cache", unit="req", file=sys.stderr, disable=None, leave=False)
