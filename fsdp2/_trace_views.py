"""The outputs of a schedule trace, from its per-rank data (``ScheduleTrace.to_dict()``'s
``ranks``): the summary table, the Chrome trace-event JSON and the PNG timeline.

Pure functions of plain data: nothing here touches the runtime. Times are microseconds
from each rank's trace start (``origin_unix_us`` places it in Unix time, so ranks line up
on one host, and across hosts as far as their clocks agree).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

_KIND_ORDER = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")
_PHASE_ORDER = (
    "forward",
    "forward, prefetched",
    "backward",
    "backward, prefetched",
    "unshard",
    "reduction",
)


def kind_name(kind: str) -> str:
    """``all_gather`` -> ``all-gather``."""
    return kind.replace("_", "-")


def _sort_key(kind: str, phase: str) -> tuple[int, str, int]:
    k = _KIND_ORDER.index(kind) if kind in _KIND_ORDER else len(_KIND_ORDER)
    p = _PHASE_ORDER.index(phase) if phase in _PHASE_ORDER else len(_PHASE_ORDER)
    return (k, kind, p)


def _comm_us(c: dict[str, Any]) -> float:
    begin, end = c["comm_begin_us"], c["comm_end_us"]
    return max(0.0, end - begin) if begin is not None and end is not None else 0.0


def summary_steps(rank: dict[str, Any], step: int | None = None) -> list[int]:
    """The steps a summary averages: ``step`` alone, or the complete ones (not failed)
    after the first, which pays for one-time set-up (all of them if only one)."""
    indices = sorted({s["step"] for s in rank["steps"]})
    if step is not None:
        if step not in indices:
            raise ValueError(
                f"ScheduleTrace: no step {step} recorded on rank {rank['rank']} (recorded: "
                f"{_ranges(indices)})."
            )
        return [step]
    failed = {s["step"] for s in rank["steps"] if s["aborted"]}
    complete = [i for i in indices if i not in failed]
    return complete[1:] if len(complete) > 1 else complete


def summarize_rank(rank: dict[str, Any], step: int | None = None) -> dict[str, Any]:
    """Means per step over ``summary_steps``: one row per (group, collective, phase),
    the final waits, the totals and the compute times."""
    chosen = summary_steps(rank, step) if rank["steps"] else []
    steps = [s for s in rank["steps"] if s["step"] in chosen]
    n = max(len(chosen), 1)
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    final = {"count": 0, "window_us": 0.0, "exposed_us": 0.0}
    compute = {"forward_us": 0.0, "backward_us": 0.0, "optimizer_us": 0.0}
    step_us = 0.0
    for s in steps:
        step_us += s["end_us"] - s["begin_us"]
        for c in s["collectives"]:
            row = rows.setdefault(
                (c["group"], c["kind"], c["phase"]),
                {"group": c["group"], "kind": c["kind"], "phase": c["phase"], "count": 0,
                 "comm_us": 0.0, "exposed_us": 0.0, "bytes": 0},
            )  # fmt: skip
            row["count"] += 1
            row["comm_us"] += _comm_us(c)
            row["exposed_us"] += c["exposed_us"]
            row["bytes"] += c["bytes"]
            if c["in_final_wait"]:
                final["exposed_us"] += c["exposed_us"]
        for w in s["windows"]:
            duration = w["end_us"] - w["begin_us"]
            if w["kind"].startswith("final wait"):
                final["count"] += 1
                final["window_us"] += duration
            elif w["kind"] == "optimizer":
                compute["optimizer_us"] += duration
            elif w["root"] and w["kind"] in ("forward", "backward"):
                compute[f"{w['kind']}_us"] += duration
    order: dict[str, int] = {}
    for s in steps:  # groups in the order their first collective was issued
        for c in s["collectives"]:
            order.setdefault(c["group"], len(order))
    listed = sorted(
        rows.values(), key=lambda r: (order[r["group"]], *_sort_key(r["kind"], r["phase"]))
    )
    for row in listed:
        for key in ("count", "comm_us", "exposed_us", "bytes"):
            row[key] /= n
        row["overlap"] = _overlap(row["comm_us"], row["exposed_us"])
    total_comm = sum(r["comm_us"] for r in listed)
    total_exposed = sum(r["exposed_us"] for r in listed)
    return {
        "steps": chosen,
        "rows": listed,
        "final_wait": {k: v / n for k, v in final.items()},
        "total": {
            "count": sum(r["count"] for r in listed),
            "comm_us": total_comm,
            "exposed_us": total_exposed,
            "overlap": _overlap(total_comm, total_exposed),
        },
        "step_us": step_us / n,
        "compute": {k: v / n for k, v in compute.items()},
    }


def _overlap(comm: float, exposed: float) -> float | None:
    """The share of the communication hidden behind compute."""
    return None if comm <= 0 else max(0.0, 1.0 - exposed / comm)


def _ranges(indices: Iterable[int]) -> str:
    values = sorted(indices)
    if not values:
        return "none"
    if values == list(range(values[0], values[-1] + 1)) and len(values) > 2:
        return f"{values[0]}-{values[-1]}"
    return ", ".join(map(str, values))


def _ms(us: float | None) -> str:
    return "-" if us is None else f"{us / 1e3:.2f}"


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.0f}"


def summary_text(mine: dict[str, Any], every: dict[int, dict[str, Any]], step: int | None) -> str:
    """The table ``ScheduleTrace.summary()`` prints: assumptions first, then the headline
    (exposed communication per step), then one row per group and phase."""
    stats = summarize_rank(mine, step)
    recorded = sorted({s["step"] for s in mine["steps"]})
    failed = sorted({s["step"] for s in mine["steps"] if s["aborted"]})
    if step is not None:
        which = f"step {step}"
    else:
        which = f"mean per step over steps {_ranges(stats['steps'])}"
        if len(stats["steps"]) == 1:
            which = f"step {stats['steps'][0]}"
        if len(stats["steps"]) < len(recorded) - len(failed):
            which += f" (step {recorded[0]} left out: it pays one-time set-up)"
    lines = [
        f"fsdp2 schedule trace, rank {mine['rank']} of {mine['world_size']} ({mine['device']}, "
        f"{mine['backend']}, {mine['timing']}): steps {_ranges(recorded)} recorded"
        + (f", {_ranges(failed)} failed (reset_iter_state)" if failed else "")
        + f"; {which}.",
        "communication: issue to completion of the collective; exposed: time compute "
        "waited for it; overlap: the share of the communication hidden behind compute "
        "(docs/trace.md).",
        "",
    ]
    total = stats["total"]
    step_us = stats["step_us"]
    share = (
        f", {100 * total['exposed_us'] / step_us:.1f}% of the {_ms(step_us)} ms step"
        if step_us > 0
        else ""
    )
    lines.append(
        f"exposed communication: {_ms(total['exposed_us'])} ms per step{share}; "
        f"{_ms(total['comm_us'] - total['exposed_us'])} of {_ms(total['comm_us'])} ms of "
        f"communication hidden ({_pct(total['overlap'])}% overlap)"
    )
    if len(every) > 1:
        per_rank = []
        for r in sorted(every):
            try:
                theirs = summarize_rank(every[r], step)["total"]["exposed_us"]
            except ValueError:  # that rank did not record this step
                continue
            per_rank.append(f"rank {r} {_ms(theirs)}")
        lines.append(f"exposed communication per rank (ms per step): {', '.join(per_rank)}")
    lines.append("")
    header = ["group", "collective", "phase", "count", "comm (ms)", "exposed (ms)", "overlap (%)"]
    table = [
        [r["group"], kind_name(r["kind"]), r["phase"], f"{r['count']:g}", _ms(r["comm_us"]),
         _ms(r["exposed_us"]), _pct(r["overlap"])]
        for r in stats["rows"]
    ]  # fmt: skip
    final = stats["final_wait"]
    if final["count"]:
        table.append(
            ["(root)", "final wait", "end of backward", f"{final['count']:g}", "-",
             _ms(final["exposed_us"]) + "*", "-"]
        )  # fmt: skip
    table.append(
        ["step total", "", "", f"{total['count']:g}", _ms(total["comm_us"]),
         _ms(total["exposed_us"]), _pct(total["overlap"])]
    )  # fmt: skip
    widths = [max(len(row[i]) for row in [header, *table]) for i in range(len(header))]

    def fmt(row: list[str]) -> str:
        return "  ".join(
            cell.ljust(widths[i]) if i < 3 else cell.rjust(widths[i]) for i, cell in enumerate(row)
        ).rstrip()

    lines += [fmt(header), "-" * len(fmt(header))]
    lines += [fmt(row) for row in table[:-1]]
    lines += ["-" * len(fmt(header)), fmt(table[-1])]
    if final["count"]:
        lines.append(
            "* the waits for reductions still in flight at the end of backward (or before "
            "the optimizer step), counted in their own rows and the total"
        )
    c = stats["compute"]
    lines.append(
        f"compute per step: forward {_ms(c['forward_us'])} ms, backward "
        f"{_ms(c['backward_us'])} ms, optimizer {_ms(c['optimizer_us'])} ms"
    )
    return "\n".join(lines)


# -- Chrome trace ------------------------------------------------------------------------------
def _lanes(spans: list[tuple[float, float, Any]]) -> list[tuple[int, float, float, Any]]:
    """Place overlapping spans on separate lanes (first lane whose last span ended)."""
    ends: list[float] = []
    placed = []
    for begin, end, item in sorted(spans, key=lambda s: (s[0], s[1])):
        lane = next((i for i, e in enumerate(ends) if e <= begin), len(ends))
        if lane == len(ends):
            ends.append(end)
        else:
            ends[lane] = end
        placed.append((lane, begin, end, item))
    return placed


def _comm_label(c: dict[str, Any]) -> str:
    return f"{kind_name(c['kind'])} {c['group']} ({c['phase']})"


def chrome_trace(every: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Chrome trace-event JSON: one process per rank, threads ``compute`` (windows,
    exposed waits, copy-outs) and one per collective kind (communication windows; a
    second lane where they overlap), in microseconds from the earliest rank's start."""
    origin = min(d["origin_unix_us"] for d in every.values())
    events: list[dict[str, Any]] = []
    for rank in sorted(every):
        events += _rank_events(rank, every[rank], every[rank]["origin_unix_us"] - origin)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"producer": "fsdp2"}}


class _RankTracks:
    """The trace events of one rank, with its tracks (threads) named as they appear."""

    def __init__(self, rank: int, shift: float) -> None:
        self.rank, self.shift = rank, shift
        self.tids: dict[str, int] = {}
        self.events: list[dict[str, Any]] = [
            {"ph": "M", "pid": rank, "name": "process_name", "args": {"name": f"rank {rank}"}},
            {"ph": "M", "pid": rank, "name": "process_sort_index", "args": {"sort_index": rank}},
        ]

    def tid(self, track: str) -> int:
        if track not in self.tids:
            tid = self.tids[track] = len(self.tids) + 1
            self.events += [
                {"ph": "M", "pid": self.rank, "tid": tid, "name": "thread_name",
                 "args": {"name": track}},
                {"ph": "M", "pid": self.rank, "tid": tid, "name": "thread_sort_index",
                 "args": {"sort_index": tid}},
            ]  # fmt: skip
        return self.tids[track]

    def span(self, track: str, name: str, cat: str, begin: float, end: float, **args: Any) -> None:
        self.events.append(
            {"ph": "X", "pid": self.rank, "tid": self.tid(track), "name": name, "cat": cat,
             "ts": begin + self.shift, "dur": max(0.0, end - begin), "args": args}
        )  # fmt: skip

    def instant(self, name: str, at: float) -> None:
        self.events.append(
            {"ph": "i", "s": "p", "pid": self.rank, "tid": self.tid("compute"), "name": name,
             "ts": at + self.shift}
        )  # fmt: skip


def _rank_events(rank: int, data: dict[str, Any], shift: float) -> list[dict[str, Any]]:
    out = _RankTracks(rank, shift)
    out.tid("compute")
    for step in data["steps"]:
        index = step["step"]
        out.instant(f"step {index}" + (" (failed)" if step["aborted"] else ""), step["begin_us"])
        for w in step["windows"]:
            label = w["kind"] if w["kind"] == "optimizer" else f"{w['kind']} {w['name']}"
            out.span("compute", label, w["kind"], w["begin_us"], w["end_us"], step=index)
        by_kind: dict[str, list[tuple[float, float, Any]]] = {}
        for c in step["collectives"]:
            for begin, end in c["waits_us"]:
                name = f"wait {_comm_label(c)}"
                out.span("compute", name, "exposed", begin, end, seq=c["seq"], step=index)
            if c["waits_us"] and c["consumed_us"] is not None:
                name = f"copy-out {kind_name(c['kind'])} {c['group']}"
                out.span("compute", name, "copy-out", c["waits_us"][-1][1], c["consumed_us"])
            if c["comm_begin_us"] is not None and c["comm_end_us"] is not None:
                by_kind.setdefault(c["kind"], []).append((c["comm_begin_us"], c["comm_end_us"], c))
        for kind in sorted(by_kind, key=lambda k: _sort_key(k, "")):
            for lane, begin, end, c in _lanes(by_kind[kind]):
                track = kind_name(kind) + (f" ({lane + 1})" if lane else "")
                out.span(track, _comm_label(c), c["phase"], begin, end, seq=c["seq"], step=index,
                         bytes=c["bytes"], issue_us=c["issue_us"] + shift,
                         exposed_us=c["exposed_us"], completion=c["completion"])  # fmt: skip
    return out.events


# -- PNG timeline ------------------------------------------------------------------------------
_COLORS = {
    "forward": "#cfe2f3",
    "backward": "#d9ead3",
    "optimizer": "#d9d9d9",
    "final wait": "#fce5cd",
    ("all_gather", "forward"): "#3c78d8",
    ("all_gather", "forward, prefetched"): "#6fa8dc",
    ("all_gather", "backward"): "#38761d",
    ("all_gather", "backward, prefetched"): "#93c47d",
    ("all_gather", "unshard"): "#8e7cc3",
    ("all_gather", "reduction"): "#a61c00",  # HSDP's sum over replicas under a reduce policy
    "reduce_scatter": "#e69138",
    "all_reduce": "#a61c00",
    "all_to_all": "#b45f06",
    "other": "#c27ba0",
    "exposed": "#cc0000",
}


def _comm_color(c: dict[str, Any]) -> str:
    if c["kind"] == "all_gather":
        return _COLORS.get(("all_gather", c["phase"]), _COLORS["other"])
    return _COLORS.get(c["kind"], _COLORS["other"])


def _short(group: str) -> str:
    return group.rsplit(".", 1)[-1] if group.count(".") and group[-1].isdigit() else group


def pick_step(every: dict[int, dict[str, Any]], step: int | None) -> int:
    """``step``, or the last step every rank recorded completely."""
    per_rank = [
        {s["step"] for s in d["steps"] if step is not None or not s["aborted"]}
        for d in every.values()
    ]
    common = set.intersection(*per_rank) if per_rank else set()
    if step is not None:
        if step not in common:
            raise ValueError(
                f"ScheduleTrace.plot: step {step} was not recorded on every rank (common "
                f"steps: {_ranges(common)})."
            )
        return step
    if not common:
        raise ValueError(
            "ScheduleTrace.plot: no step completed on every rank; pass step=... to plot a "
            "failed one."
        )
    return max(common)


def plot_step(every: dict[int, dict[str, Any]], step: int | None, path: Path) -> None:
    """Draw one step across ranks into a PNG (matplotlib's Agg canvas; no pyplot state)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as error:
        raise ModuleNotFoundError(
            "ScheduleTrace.plot needs matplotlib, which is not installed: "
            "pip install 'fsdp2[plot]' (or pip install matplotlib). summary(), to_dict() and "
            "save_chrome_trace() work without it."
        ) from error
    index = pick_step(every, step)
    origin = min(d["origin_unix_us"] for d in every.values())
    chosen = {r: [s for s in d["steps"] if s["step"] == index] for r, d in sorted(every.items())}
    shifts = {r: every[r]["origin_unix_us"] - origin for r in chosen}
    start = min(s["begin_us"] + shifts[r] for r, steps in chosen.items() for s in steps)
    kinds = sorted(
        {c["kind"] for steps in chosen.values() for s in steps for c in s["collectives"]},
        key=lambda k: _sort_key(k, ""),
    )
    tracks = ["compute", *kinds]
    rows_per_rank = len(tracks) + 0.5
    height = 1.6 + 0.45 * rows_per_rank * len(chosen)
    figure = Figure(figsize=(14, height))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    yticks, ylabels = [], []
    longest = 0.0
    exposed_by_rank = {}
    labels: list[tuple[float, float, float, str]] = []  # left, width, y, group
    for i, (rank, steps) in enumerate(chosen.items()):
        base = i * rows_per_rank
        shift = shifts[rank] - start

        def y(track: str) -> float:
            return base + tracks.index(track)  # noqa: B023

        for track in tracks:
            yticks.append(y(track) + 0.4)
            ylabels.append(f"rank {rank} {kind_name(track)}")
        exposed = 0.0
        for s in steps:
            longest = max(longest, s["end_us"] + shift)
            windows = sorted(s["windows"], key=lambda w: (not w["root"], w["begin_us"]))
            for w in windows:
                color = _COLORS.get(w["kind"], _COLORS["final wait"])
                begin, width = (w["begin_us"] + shift) / 1e3, (w["end_us"] - w["begin_us"]) / 1e3
                inset = 0.0 if w["root"] else 0.12
                axes.broken_barh([(begin, width)], (y("compute") + inset, 0.8 - 2 * inset),
                                 facecolors=color, edgecolors="#999999", linewidth=0.3)  # fmt: skip
            for c in s["collectives"]:
                exposed += c["exposed_us"]
                for wb, we in c["waits_us"]:
                    axes.broken_barh([((wb + shift) / 1e3, max((we - wb) / 1e3, 0.0))],
                                     (y("compute"), 0.8), facecolors=_COLORS["exposed"])  # fmt: skip
            by_kind: dict[str, list[tuple[float, float, Any]]] = {}
            for c in s["collectives"]:
                if c["comm_begin_us"] is not None and c["comm_end_us"] is not None:
                    by_kind.setdefault(c["kind"], []).append(
                        (c["comm_begin_us"], c["comm_end_us"], c)
                    )
            for kind, spans in by_kind.items():
                placed = _lanes(spans)
                lanes = max(lane for lane, *_ in placed) + 1
                for lane, begin, end, c in placed:
                    top = y(kind) + 0.8 * lane / lanes
                    left, width = (begin + shift) / 1e3, (end - begin) / 1e3
                    axes.broken_barh([(left, width)], (top, 0.8 / lanes),
                                     facecolors=_comm_color(c), edgecolors="#333333",
                                     linewidth=0.3, hatch="///" if c["prefetch"] else None)  # fmt: skip
                    labels.append((left, width, top + 0.4 / lanes, c["group"]))
        exposed_by_rank[rank] = exposed
    span_ms = max(longest / 1e3, 1e-3)
    for left, width, middle, group in labels:
        if width > 0.035 * span_ms:  # label the bars wide enough to hold one
            axes.text(left + width / 2, middle, _short(group), ha="center", va="center",
                      fontsize=6, clip_on=True, bbox={"facecolor": "white", "alpha": 0.7,
                      "pad": 0.4, "linewidth": 0})  # fmt: skip
    axes.set_yticks(yticks)
    axes.set_yticklabels(ylabels, fontsize=7)
    axes.set_ylim(len(chosen) * rows_per_rank - 0.3, -0.3)
    axes.set_xlim(0, span_ms * 1.01)
    axes.set_xlabel("ms from the step's start (earliest rank)")
    worst = max(exposed_by_rank, key=lambda r: exposed_by_rank[r])
    axes.set_title(
        f"fsdp2 schedule, step {index}: exposed communication {exposed_by_rank[worst] / 1e3:.2f} "
        f"ms on rank {worst} (red), {span_ms:.2f} ms step",
        fontsize=10,
    )
    legend = [
        Patch(facecolor=_COLORS["forward"], edgecolor="#999999", label="forward compute"),
        Patch(facecolor=_COLORS["backward"], edgecolor="#999999", label="backward compute"),
        Patch(facecolor=_COLORS["optimizer"], edgecolor="#999999", label="optimizer step"),
        Patch(facecolor=_COLORS["exposed"], label="exposed wait"),
        Patch(facecolor=_COLORS[("all_gather", "forward")], label="all-gather, forward"),
        Patch(facecolor=_COLORS[("all_gather", "backward")], label="all-gather, backward"),
        Patch(facecolor="#ffffff", edgecolor="#666666", hatch="///", label="prefetched"),
        Patch(facecolor=_COLORS["reduce_scatter"], label="reduce-scatter"),
    ]
    if "all_to_all" in kinds:
        legend.append(Patch(facecolor=_COLORS["all_to_all"], label="all-to-all (reduce policy)"))
    if "all_reduce" in kinds:
        legend.append(Patch(facecolor=_COLORS["all_reduce"], label="all-reduce (HSDP)"))
    axes.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.1 - 0.4 / height),
                ncol=5, fontsize=7, frameon=False)  # fmt: skip
    axes.grid(axis="x", linewidth=0.3, alpha=0.5)
    figure.tight_layout()
    figure.savefig(path, dpi=130)
