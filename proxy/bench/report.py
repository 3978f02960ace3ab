"""The targets of ``cachetally bench proxy`` and its table.

A target is checked against the figure a run measured; ``None`` (not measurable here,
e.g. no ``/proc``) counts as not holding.
"""

from __future__ import annotations

from typing import Any

#: (label, section, key, comparison, bound)
TARGETS: tuple[tuple[str, str, str, str, float], ...] = (
    ("SSE events/s proxied/direct, 1 stream", "sse_1", "ratio_events_per_s", ">=", 0.90),
    ("SSE events/s proxied/direct, 100 streams", "sse_100", "ratio_events_per_s", ">=", 0.90),
    ("added p50 ms, c=1", "latency_c1", "added_p50_ms", "<=", 0.5),
    ("added p99 ms, c=1", "latency_c1", "added_p99_ms", "<=", 2.0),
    ("added p99 ms, c=64", "latency_c64", "added_p99_ms", "<=", 10.0),
    ("proxied req/s per proxy core", "throughput", "rps_per_proxy_core", ">=", 2000.0),
    ("TTFT overhead p50 ms (paced)", "ttft_paced", "added_p50_ms", "<=", 0.7),
    ("KiB per in-flight stream", "memory", "kib_per_stream", "<=", 32.0),
    ("embedded with/without middleware req/s", "embedded", "ratio_rps", ">=", 0.97),
)


def check(figures: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target, the proxy's value, and the bare relay's value of the same figure
    (``floor``: what any extra hop gets on this machine; ``None`` where it has none)."""
    out = []
    for label, section, key, op, bound in TARGETS:
        value = figures[section].get(key)
        holds = value is not None and (value >= bound if op == ">=" else value <= bound)
        floor = figures[section].get(f"relay_{key}")
        out.append({"target": label, "value": value, "bound": f"{op} {bound:g}", "holds": holds, "floor": floor})
    return out


def _num(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, int) or abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"


def table(f: dict[str, Any]) -> str:
    rows: list[tuple[str, Any, Any, Any, Any, Any]] = [("figure", "direct", "relay", "proxied", "added", "ratio")]

    def ab(label: str, section: str, key: str, a: str = "direct", b: str = "proxied") -> None:
        s = f[section]
        relay = s.get(f"relay_{key}")
        rows.append((label, s[f"{a}_{key}"], relay, s[f"{b}_{key}"], s[f"added_{key}"], s[f"ratio_{key}"]))

    ab("latency p50 ms, c=1", "latency_c1", "p50_ms")
    ab("latency p99 ms, c=1", "latency_c1", "p99_ms")
    ab("latency p50 ms, c=64", "latency_c64", "p50_ms")
    ab("latency p99 ms, c=64", "latency_c64", "p99_ms")
    t = f["throughput"]
    rows.append(("req/s, c=64", t["direct_rps"], t["relay_rps"], t["proxied_rps"], None,
                 t["proxied_rps"] / t["direct_rps"]))
    ab("SSE events/s, 1 stream", "sse_1", "events_per_s")
    ab("SSE events/s, 100 streams", "sse_100", "events_per_s")
    ab("TTFT p50 ms, paced", "ttft_paced", "p50_ms")
    ab("TTFT p99 ms, paced", "ttft_paced", "p99_ms")
    rows.append(("embedded: without / with middleware", None, None, None, None, None))
    ab("  req/s, c=64", "embedded", "rps", a="without", b="with")
    ab("  server CPU us/req", "embedded", "cpu_us_per_req", a="without", b="with")
    widths = [max(len(r[0]) for r in rows), 10, 10, 10, 10, 7]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [
            (c if isinstance(c, str) else _num(c)).rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
    m, mi, fl = f["memory"], f["micro"], f["embedded_floor"]
    lines += [
        "",
        f"proxy CPU per request: {_num(t['proxy_cpu_us_per_req'])} us -> {_num(t['rps_per_proxy_core'])} req/s per proxy core"
        f" (bare relay: {_num(t['relay_rps_per_proxy_core'])})",
        f"load generator headroom (direct/proxied req/s): {_num(t['loadgen_headroom'])}, proxy core busy "
        f"{_num(t['proxy_busy'])} at c=64 ("
        + ("ok: the proxy was the limit" if t["loadgen_ok"] else
           "the proxy was NOT the limit at c=64: the sim and load generator's core was")
        + ")",
        f"memory: {_num(m['kib_per_stream'])} KiB per open stream "
        f"(RSS {_num(m['rss_before_kib'])} -> {_num(m['rss_held_kib'])} KiB with {m['streams']} streams, "
        f"{_num(m['rss_after_kib'])} KiB after)",
        f"embedded floor, in process (us per request): sim {_num(fl['sim_us'])}, behind a pass-through "
        f"middleware {_num(fl['passthrough_us'])} (ratio {_num(fl['ratio_passthrough'])}), behind cachetally "
        f"{_num(fl['cachetally_us'])} (ratio {_num(fl['ratio_cachetally'])}); the patch's least work alone "
        f"{_num(fl['least_work_us'])} us",
        f"micro: pass-through event {_num(mi['passthrough_event_us'])} us "
        f"(split in two: {_num(mi['passthrough_split_event_us'])} us), usage event {_num(mi['usage_event_us'])} us",
        "",
    ]
    width = max(len(t["target"]) for t in f["targets"])
    for target in f["targets"]:
        lines.append(
            f"{'holds' if target['holds'] else 'MISSES'}  {target['target'].ljust(width)}  "
            f"{_num(target['value']).rjust(9)}  (target {target['bound']}"
            + (f"; bare relay {_num(target['floor'])})" if target["floor"] is not None else ")")
        )
    mach = f["machine"]
    lines.append(
        f"\n{mach['cpus']} CPUs, proxy pinned to core {mach['proxy_cores']}" if mach["pinned"] else
        f"\n{mach['cpus']} CPU(s), not pinned"
    )
    return "\n".join(lines)
