"""Tables for benchmarks/compare.py results, and the dated markdown report.

python benchmarks/report.py                      # latest.json -> results/<its date>.md
python benchmarks/report.py --json X.json --out benchmarks/results/custom.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.memory import CATEGORIES  # noqa: E402
from benchmarks.targets import _get, noise_summary, summary_table, targets_table  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"

MiB = 1024 * 1024


def _fmt(x: Any, unit: str) -> str:
    if x is None:
        return "-"
    if unit == "ms":
        return f"{x * 1e3:.2f}"
    if unit == "MiB":
        return f"{x / MiB:.2f}"
    if unit == "x":
        return f"{x:.2f}"
    if unit == "n":
        return f"{x:g}" if isinstance(x, float) else str(x)
    return str(x)


def _ratio(a: Any, b: Any) -> str:
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return "-"
    if b == 0:
        return "-" if a == 0 else "inf"
    if b < 0 or a < 0:
        return "n/a"  # negative overheads (sharded optimizer cheaper than the plain one)
    return f"{a / b:.2f}"


def _comm(res: dict, kind: str, what: str) -> Any:
    return _get(res, "comm", "by_kind", kind, what) or (0 if "comm" in res else None)


def rows_for(entry: dict) -> list[tuple[str, str, Any]]:
    """(label, unit, getter) rows; the getter maps a per-impl result dict to a number."""
    rows: list[tuple[str, str, Any]] = [
        ("step time, median (ms)", "ms", lambda r: _get(r, "time", "step_s")),
        ("  forward (ms)", "ms", lambda r: _get(r, "time", "fwd_s")),
        ("  backward (ms)", "ms", lambda r: _get(r, "time", "bwd_s")),
        ("  optimizer (ms)", "ms", lambda r: _get(r, "time", "opt_s")),
        ("  step IQR (ms)", "ms", lambda r: _get(r, "time", "step_s_iqr")),
        ("step time, min (ms)", "ms", lambda r: _get(r, "time", "step_s_min")),
        ("overhead vs non-sharded (ms)", "ms", lambda r: _get(r, "overhead", "step_s")),
        ("  fwd+bwd overhead (ms)", "ms", lambda r: _get(r, "overhead", "fwd_bwd_s")),
        ("collective calls (ms)", "ms", lambda r: _get(r, "collective_time", "call_s")),
        (
            "  overhead net of them (ms, fake pg)",
            "ms",
            lambda r: _get(r, "overhead", "step_net_of_collective_calls_s"),
        ),
        (
            "  fwd+bwd net of them (ms, fake pg)",
            "ms",
            lambda r: _get(r, "overhead", "fwd_bwd_net_of_collective_calls_s"),
        ),
        ("all-gather count", "n", lambda r: _comm(r, "all_gather", "count")),
        ("all-gather payload (MiB)", "MiB", lambda r: _comm(r, "all_gather", "payload_bytes")),
        ("reduce-scatter count", "n", lambda r: _comm(r, "reduce_scatter", "count")),
        (
            "reduce-scatter payload (MiB)",
            "MiB",
            lambda r: _comm(r, "reduce_scatter", "payload_bytes"),
        ),
        ("all-reduce count", "n", lambda r: _comm(r, "all_reduce", "count")),
        ("other collectives", "n", lambda r: _comm(r, "other", "count")),
        ("c10d ops at dispatcher", "n", lambda r: _get(r, "probe", "c10d_calls_total")),
        ("copy bytes (MiB)", "MiB", lambda r: r.get("copy_bytes")),
        ("  beyond non-sharded (MiB)", "MiB", lambda r: r.get("copy_bytes_excess")),
        (
            "  all-gather copy-in (MiB)",
            "MiB",
            lambda r: _get(r, "copy_roles", "all_gather_copy_in"),
        ),
        (
            "  all-gather copy-out (MiB)",
            "MiB",
            lambda r: _get(r, "copy_roles", "all_gather_copy_out"),
        ),
        (
            "  reduce-scatter copy-in (MiB)",
            "MiB",
            lambda r: _get(r, "copy_roles", "reduce_scatter_copy_in"),
        ),
        ("  other copies (MiB)", "MiB", lambda r: _get(r, "copy_roles", "other")),
        ("peak live memory (MiB)", "MiB", lambda r: _get(r, "memory", "peak_bytes")),
    ]
    for cat in CATEGORIES:
        rows.append((f"  {cat} (MiB)", "MiB", lambda r, c=cat: _get(r, "memory", "breakdown", c)))
    rows += [
        ("peak / lower bound", "x", lambda r: _get(r, "memory", "peak_over_lower_bound")),
        ("time to first step (ms)", "ms", lambda r: _get(r, "ttfs", "time_to_first_step_s")),
        ("  fully_shard calls (ms)", "ms", lambda r: _get(r, "ttfs", "shard_s")),
        ("  first fwd+bwd (ms)", "ms", lambda r: _get(r, "ttfs", "first_fwd_bwd_s")),
        ("  lazy init = 1st - 2nd (ms)", "ms", lambda r: _get(r, "ttfs", "lazy_init_s")),
    ]
    return rows


def entry_title(entry: dict) -> str:
    m = entry.get("model", {})
    world = entry.get("world_size")
    kind = "fake pg" if entry.get("fake") else entry.get("backend", "?")
    return (
        f"{entry.get('config')} | world {world} ({kind}, {entry.get('device', 'cpu')}) | "
        f"{m.get('n_layers')} layers, dim {m.get('dim')}, vocab {m.get('vocab_size')}, "
        f"{m.get('params', 0) / 1e6:.2f}M params | batch {entry.get('batch_per_rank')}"
        f"x{entry.get('seq')} per rank"
        + (f" x{m.get('grad_accum')} microbatches" if m.get("grad_accum", 1) > 1 else "")
        + f" | {entry.get('steps')} steps"
    )


def table(entry: dict, markdown: bool = False) -> str:
    """Rows of metrics; columns: first impl, second impl, first/second, non-sharded."""
    impls = entry.get("impls", [])
    results = entry.get("results", {})
    a = impls[0] if impls else None
    b = impls[1] if len(impls) > 1 else None
    cols = [x for x in (a, b) if x]
    header = ["metric", *cols]
    if a and b:
        header.append(f"{a}/{b}")
    header.append("non-sharded")
    lines: list[list[str]] = []
    plain = results.get("plain", {})
    for label, unit, get in rows_for(entry):
        vals = [get(results.get(c, {})) for c in cols]
        row = [label] + [_fmt(x, unit) for x in vals]
        if a and b:
            row.append(_ratio(vals[0], vals[1]))
        pv = (
            get(plain)
            if not label.strip().startswith(
                ("overhead", "fwd+bwd", "time to", "fully", "first", "lazy", "peak /", "beyond")
            )
            else None
        )
        row.append(_fmt(pv, unit))
        lines.append(row)
    lb = entry.get("lower_bound", {})
    if lb:
        row = ["lower bound (MiB)"] + [_fmt(lb.get("bytes"), "MiB") for _ in cols]
        if a and b:
            row.append("1.00")
        row.append("-")
        lines.append(row)
    if markdown:
        out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        out += ["| " + " | ".join(r) + " |" for r in lines]
        return "\n".join(out)
    widths = [max(len(r[i]) for r in [header, *lines]) for i in range(len(header))]
    fmt = lambda r: "  ".join(  # noqa: E731
        (c.ljust(widths[i]) if i == 0 else c.rjust(widths[i])) for i, c in enumerate(r)
    )
    return "\n".join(
        [fmt(header), "-" * (sum(widths) + 2 * (len(widths) - 1))] + [fmt(r) for r in lines]
    )


def errors_of(entry: dict) -> list[str]:
    out = []
    if "fatal" in entry:
        out.append(f"config failed: {entry['fatal']['error']}")
    for label, res in entry.get("results", {}).items():
        if res.get("status") == "error":
            e = res["error"]
            out.append(f"{label} [{e.get('stage')}]: {e.get('error')}")
    return out


def format_entry(entry: dict) -> str:
    head = f"== {entry_title(entry)} =="
    if "results" not in entry:
        return head + "\n" + "\n".join(errors_of(entry))
    body = table(entry)
    errs = errors_of(entry)
    traced = [_trace_line(label, res) for label, res in entry["results"].items() if "trace" in res]
    return "\n".join([head, body, *traced, *(f"! {e}" for e in errs)])


def _trace_line(label: str, res: dict) -> str:
    t = res["trace"]
    cost = _get(res, "trace_cost", "step_ratio_median")
    return (
        f"{label}: exposed communication {_fmt(t['total']['exposed_us'] / 1e6, 'ms')} ms of "
        f"{_fmt(t['step_us'] / 1e6, 'ms')} ms per step, communication "
        f"{_fmt(t['total']['comm_us'] / 1e6, 'ms')} ms; tracing cost (paired step ratio) "
        f"{_fmt(cost, 'x')}"
    )


def exposed_table(runs: list[dict]) -> str:
    """One row per run with a traced variant: its exposed communication per step (fsdp2
    only: torch's fully_shard records no schedule) and what tracing cost."""
    header = (
        "| config | world | step (ms) | communication (ms) | exposed (ms) | exposed / step "
        "| overlap | collectives | tracing cost (traced / untraced step) |"
    )
    lines = [header, "|" + "---|" * 9]
    pngs = []
    for entry in runs:
        for res in entry.get("results", {}).values():
            t = res.get("trace")
            if not t:
                continue
            total, step_us = t["total"], t["step_us"]
            overlap = total.get("overlap")
            world = f"{entry.get('world_size')}{' (fake)' if entry.get('fake') else ''}"
            lines.append(
                f"| {entry.get('config')} | {world} | {_fmt(step_us / 1e6, 'ms')} | "
                f"{_fmt(total['comm_us'] / 1e6, 'ms')} | {_fmt(total['exposed_us'] / 1e6, 'ms')} | "
                f"{100 * total['exposed_us'] / step_us if step_us else 0:.1f}% | "
                f"{'-' if overlap is None else f'{100 * overlap:.0f}%'} | {total['count']:g} | "
                f"{_fmt(_get(res, 'trace_cost', 'step_ratio_median'), 'x')} |"
            )
            if res.get("trace_png"):
                pngs.append(
                    f"`{Path(res['trace_png']).name}` ({entry.get('config')}, world {world})"
                )
    if len(lines) == 2:
        return ""
    notes = [
        "",
        "Per step, mean over the traced steps after the first, rank 0 "
        "(`fsdp2.trace_schedule`, docs/trace.md). torch's `fully_shard` has no equivalent: "
        "its collectives are not attributed to groups and phases, so only fsdp2 is shown. "
        "Tracing cost: the median per-round ratio of the traced variant's step time to "
        "the untraced one's, stepped in the same rounds.",
    ]
    if pngs:
        notes.append("Timelines of one step: " + ", ".join(pngs) + ".")
    return "\n".join(lines + notes)


def markdown(data: dict, notes: str = "") -> str:
    meta = data.get("meta", {})
    host = meta.get("host", {})
    out = [
        f"# fsdp2 vs torch fully_shard: {meta.get('date', '')[:10]}",
        "",
        f"Command: `{meta.get('command', '')}`",
        "",
        f"- torch {host.get('torch')}, Python {host.get('python')}, {host.get('platform')}",
        f"- host: {host.get('hostname')}, CPU: {host.get('cpu')} x{host.get('cpu_count')}, "
        f"memory {((host.get('mem_bytes') or 0) / 2**30):.1f} GiB, CUDA: {host.get('cuda')}",
        f"- threads per rank: {meta.get('threads_per_rank')}, barrier before each step: "
        f"{meta.get('barrier_before_step')}, wall time {meta.get('wall_s', 0):.0f} s",
        "",
        "Ratios are first/second implementation; see docs/benchmarks.md for definitions. "
        "Time is per optimizer step (slowest rank per step, median over steps). "
        "Memory is rank 0's peak of live tensor storage during one instrumented step.",
        "",
        f"Sources: `{meta.get('sources', {})}`; steps {meta.get('steps')}, warm-up "
        f"{meta.get('warmup')}, time-to-first-step repeats {meta.get('ttfs_repeats')}.",
        "",
        f"Noise: {noise_summary(data.get('runs', []))} (IQR = interquartile range of the "
        "per-step times; the noise column below is first/second impl).",
        "",
        "## Targets",
        "",
        targets_table(data.get("runs", [])),
        "",
        *([notes.rstrip(), ""] if notes else []),
        *(
            ["## Exposed communication (fsdp2 only)", "", exposed_table(data["runs"]), ""]
            if exposed_table(data.get("runs", []))
            else []
        ),
        "## Ratios (first / second implementation)",
        "",
        "step/fwd/bwd/opt: median times; overhead: step time minus the non-sharded step time; "
        "paired step: median of per-round ratios (same round, same noise); collectives: count "
        "per step, first/second; AG copy-in: bytes copied into all-gather inputs, first/second; "
        "peak/LB: first impl's peak over the analytic lower bound; TTFS: time to first step.",
        "",
        summary_table(data.get("runs", [])),
        "",
        "## Per run",
        "",
    ]
    if meta.get("failures"):
        out += ["**Launch failures:** " + "; ".join(meta["failures"]), ""]
    for entry in data.get("runs", []):
        out += [f"### {entry_title(entry)}", ""]
        if entry.get("description"):
            out += [f"_{entry['description']}_", ""]
        if "results" in entry:
            out += [table(entry, markdown=True), ""]
        errs = errors_of(entry)
        if errs:
            out += ["Errors (verbatim):", ""]
            for label, res in entry.get("results", {}).items():
                if res.get("status") == "error":
                    out += [f"- `{label}` at {res['error'].get('stage')}:", "", "```"]
                    out += [res["error"].get("traceback") or res["error"].get("error"), "```", ""]
            if "fatal" in entry:
                out += ["```", entry["fatal"].get("traceback", ""), "```", ""]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json", default=str(RESULTS / "latest.json"))
    p.add_argument("--out", default=None, help="default results/<yyyy-mm-dd of the run>.md")
    p.add_argument(
        "--notes", default=None, help="markdown file inserted after the targets (analysis)"
    )
    p.add_argument("--also", nargs="*", default=[], help="more JSON files whose runs are appended")
    args = p.parse_args(argv)
    data = json.loads(Path(args.json).read_text())
    for extra in args.also:
        more = json.loads(Path(extra).read_text())
        command = more.get("meta", {}).get("command", extra)
        for entry in more.get("runs", []):
            entry["description"] = f"{entry.get('description', '')} (from `{command}`)"
            data.setdefault("runs", []).append(entry)
    notes = Path(args.notes).read_text() if args.notes else ""
    stamp = (data.get("meta", {}).get("date") or _dt.date.today().isoformat())[:10]
    out = Path(args.out) if args.out else RESULTS / f"{stamp}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(data, notes))
    print(f"[report] wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
