"""``cachetally report FILE...``: usage-record totals per tenant x model, as a table,
JSON (``--json``) or a bar chart (``--plot FILE.png``). A directory stands for the
``*.jsonl`` files in it (a folder below it with such files is said, not read). Inputs over
:data:`PROGRESS_BYTES` get a progress bar on stderr.
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson

from proxy.accounting.records.prices import EXACT, PriceList
from proxy.accounting.records.report import Report, Totals, read
from proxy.server.plot_path import plot_path

PROGRESS_BYTES = 16 << 20

_EPILOG = """\
prices file (TOML, per million tokens; per-model tables override [default]):
  [default]
  input = 0.50          # uncached input
  cached_input = 0.05
  cache_write_input = 0.625   # optional, else as input: uncached tokens written to the cache
  output = 1.50
  [models."sim-model"]
  input = 0.20

examples:
  cachetally report /var/lib/cachetally/usage
  cachetally report usage/*.jsonl --prices prices.toml --json
  cachetally report usage --prices prices.toml --plot usage.png
  cachetally report usage --since 2026-11-01 --until 2026-12-01 --json   one month (UTC)
"""


def add_report_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="total usage records per tenant and model (tokens, hit ratio, cost)",
        description="Total the usage records written with --usage-dir, per tenant x model: "
        "requests, prompt, cached and completion tokens, hit ratio and, with --prices, cost. "
        "A record read twice (same record_id, e.g. a file given twice) counts once.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("files", nargs="+", type=Path, metavar="FILE", help="usage JSONL files, or directories of them")
    p.add_argument("--prices", type=Path, metavar="FILE", help="TOML prices per million tokens (see below)")
    p.add_argument("--since", type=_utc, metavar="TIME",
                   help="only requests that started at or after TIME (ISO 8601, UTC unless it says, e.g. 2026-11-01)")
    p.add_argument("--until", type=_utc, metavar="TIME", help="only requests that started before TIME")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", type=plot_path, metavar="FILE.png",
                   help="draw cached vs uncached input tokens (and cost) per tenant (.png, .svg or .pdf)")
    p.set_defaults(run=run)


def _utc(text: str) -> datetime:
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time: {text!r} (e.g. 2026-11-01)") from None
    return when.replace(tzinfo=UTC) if when.tzinfo is None else when


def _expand(paths: list[Path]) -> list[Path]:
    """Each file once, however often it is named (a directory and a file in it, a link): a
    record without ``record_id`` (schema 1) cannot be told from itself read twice."""
    out: list[Path] = []
    seen: set[tuple[int, int]] = set()
    folders: list[Path] = []  # below a directory named: read only if named too
    for path in paths:
        # iterdir, not glob: glob reads an unreadable directory as an empty one, a zero bill.
        files = sorted(p for p in path.iterdir() if p.name.endswith(".jsonl")) if path.is_dir() else [path]
        if not files:  # a typo, or files one level down (one folder per host): not a zero bill
            print(f"cachetally report: {path} holds no *.jsonl file (subdirectories are not read)", file=sys.stderr)
        elif path.is_dir():
            folders += sorted(sub for sub in path.iterdir() if sub.is_dir() and not sub.name.endswith(".jsonl"))
        for file in files:
            if (identity := _identity(file)) not in seen:
                seen.add(identity)
                out.append(file)
    for folder in folders:  # beside this host's files, a folder of another host's was billed as if not there
        if any(_unread(file, seen) for file in folder.rglob("*.jsonl")):  # an unreadable folder: not known
            print(f"cachetally report: {folder} holds *.jsonl files that are not read (name it to bill them)",
                  file=sys.stderr)
    return out


def _identity(file: Path) -> tuple[int, int]:
    return (stat := file.stat()).st_dev, stat.st_ino


def _unread(file: Path, seen: set[tuple[int, int]]) -> bool:
    try:
        return _identity(file) not in seen
    except OSError:  # a dangling link: unread, and no reason to refuse the bill of the files named
        return True


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    if args.since is not None and args.until is not None and args.since >= args.until:
        # Swapped or equal bounds select nothing (--until is excluded): a zero bill that looks like an idle period.
        print(f"cachetally report: --since {args.since.isoformat()} is not before --until {args.until.isoformat()}",
              file=sys.stderr)
        return 2
    try:
        prices = PriceList.load(args.prices) if args.prices else None
        paths = _expand(args.files)
        size = sum(p.stat().st_size for p in paths)
    except (OSError, ValueError) as exc:
        print(f"cachetally report: {exc}", file=sys.stderr)
        return 2
    try:  # a file unreadable to this user, gone, or a directory: no bill rather than part of one
        with tqdm(total=size, unit="B", unit_scale=True, desc="reading", disable=size < PROGRESS_BYTES or None) as bar:
            report = read(paths, bar.update, since=args.since, until=args.until)
    except OSError as exc:
        print(f"cachetally report: cannot read {exc.filename}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    if prices is not None:
        report.price(prices)
    for count, said in (
        (report.skipped_lines, "skipped {} line(s) that are not records"),
        (report.duplicates, "counted once {} record(s) read twice (same record_id)"),
        (report.conflicting, "{} of them differ from the first read of their record_id; "
                             "the first read is counted: check where those files came from"),
        (report.invalid_records, "{} record(s) with a token figure that is not a count "
                                 "(negative, fractional, text): not counted in any total"),
        (report.undated, "{} record(s) with no readable start_time: outside every --since/--until period, "
                         "not counted"),
        (report.clamped, "{} record(s) report more cached tokens than their prompt; "
                         "counted as the whole prompt cached"),
        (report.unknown_prompts, "{} record(s) generated tokens with no prompt_tokens (in upstream mode, a "
                                 "stream cut before its usage chunk): their prompts are in no total"),
        (report.unknown_completions, "{} record(s) went out with their completion tokens unknown (a response "
                                     "passed on unread): their output is in no total"),
    ):
        if count:
            print("cachetally report: " + said.format(count), file=sys.stderr)
    if prices is not None and (unpriced := report.unpriced()):
        print(f"cachetally report: no price for model(s) {', '.join(unpriced)}: "
              "the totals over them have no cost", file=sys.stderr)
    if args.json:
        sys.stdout.write(orjson.dumps(_exact(report.as_json()), option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        sys.stdout.write(table(report))
    if args.plot:
        try:
            plot(report, args.plot)
        except ImportError as exc:
            print(f"cachetally report: --plot needs matplotlib (the 'bench' extra): {exc}", file=sys.stderr)
            return 2
        except OSError as exc:
            print(f"cachetally report: cannot write the plot {args.plot}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        print(f"cachetally report: plot written to {args.plot}", file=sys.stderr)  # as bench says it
    return 0


def _exact(value: Any) -> Any:
    """``value`` with each cost, and each total past int64, as JSON numbers written digit for
    digit: a float would round the money, and orjson refuses integers past 64 bits."""
    if isinstance(value, dict):
        return {k: _exact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_exact(v) for v in value]
    if isinstance(value, Decimal) or (isinstance(value, int) and not isinstance(value, bool) and value >= 1 << 63):
        return orjson.Fragment(format(value, "f" if isinstance(value, Decimal) else "d"))
    return value


def table(report: Report) -> str:
    priced = any(t.cost is not None for t in report.rows.values())
    head = ["tenant", "model", "requests", "disconnected", "prompt", "cached", "completion", "hit_ratio"]
    head += ["cost"] if priced else []

    def cells(tenant: str, model: str, t: Totals) -> list[str]:
        row = [tenant, model, str(t.requests), str(t.disconnected), str(t.prompt_tokens), str(t.cached_tokens),
               str(t.completion_tokens), f"{t.hit_ratio:.4f}"]
        return row + ([format(t.cost.normalize(EXACT), "f") if t.cost is not None else "-"] if priced else [])

    rows = [cells(tenant, model, t) for (tenant, model), t in sorted(report.rows.items())]
    rows.append(cells("TOTAL", "", report.total()))
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in [head, *rows]]
    return "\n".join(line.rstrip() for line in lines) + f"\n{report.records} records in {report.files} file(s)\n"


def plot(report: Report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    tenants = report.by_tenant()
    names = list(tenants)
    cached = [tenants[n].cached_tokens for n in names]
    uncached = [tenants[n].uncached_tokens for n in names]
    costs = [None if tenants[n].cost is None else float(tenants[n].cost) for n in names]
    priced = any(c is not None for c in costs)
    fig, axes = plt.subplots(1, 2 if priced else 1, figsize=(12 if priced else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    ax.bar(names, cached, label="cached input", color="#2a9d8f")
    ax.bar(names, uncached, bottom=cached, label="uncached input", color="#e9c46a")
    for x, (c, u) in enumerate(zip(cached, uncached, strict=True)):
        if c + u:
            ax.annotate(f"{c / (c + u):.0%} cached", (x, c + u), ha="center", va="bottom", fontsize=8)
    ax.set_title("Input tokens per tenant")
    ax.set_ylabel("tokens")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.legend()
    if priced:
        cost_ax = axes[0][1]
        bars = cost_ax.bar(names, [c or 0.0 for c in costs], color="#264653")
        cost_ax.bar_label(bars, fmt="%.4g", fontsize=8)
        cost_ax.set_title("Cost per tenant")
        cost_ax.set_ylabel("cost (price units)")
    fig.suptitle(f"cachetally usage: {report.records} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
