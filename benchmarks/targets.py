"""The summary ratio table and the issue-6 targets, computed from compare.py JSON.

Targets are reported, never asserted: each row says the measured value, the threshold, and
whether it is met. Ratios are first implementation / second (fsdp2 / torch by default).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

MiB = 1024 * 1024

Getter = Callable[[dict[str, Any]], Any]


def _get(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _overhead_floor(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    """The least overhead ratio an implementation with these collectives could reach:
    the optimizer's overhead plus the time inside the collective calls, each the smaller
    of the two measured, over the second implementation's whole overhead. Neither part is
    hook bookkeeping. Since fsdp2's optimizer fast path (docs/optimizer.md) the smaller
    optimizer overhead is fsdp2's, on plain local shards, so the floor no longer carries
    ``DTensor``'s dispatch cost; a part below zero (a sharded step cheaper than the
    non-sharded one) lowers it, down to zero."""
    parts = []
    for key in ("opt_s", "calls"):
        values = []
        for impl in (a, b):
            over = _get(impl, "overhead") or {}
            if key == "calls":
                step, net = over.get("step_s"), over.get("step_net_of_collective_calls_s")
                value = step - net if step is not None and net is not None else None
            else:
                value = over.get(key)
            if not isinstance(value, (int, float)):
                return None
            values.append(value)
        parts.append(min(values))
    return _div(max(0.0, sum(parts)), _get(b, "overhead", "step_s"))


def _div(a: Any, b: Any) -> float | None:
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or b <= 0 or a < 0:
        return None
    return a / b


def _f(x: Any, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def pair(entry: dict) -> tuple[dict, dict, str, str]:
    impls = entry.get("impls", [])
    a, b = (impls + [None, None])[:2]
    res = entry.get("results", {})
    return res.get(a, {}) if a else {}, res.get(b, {}) if b else {}, str(a), str(b)


def where(entry: dict) -> str:
    pg = "fake" if entry.get("fake") else entry.get("backend", "?")
    layers = _get(entry, "model", "n_layers")
    name = entry.get("config", "?")
    default_layers = {"small-many": 64, "large-few": 4}.get(name, 8)
    suffix = f" L={layers}" if layers != default_layers else ""
    foreach = " (AdamW foreach)" if entry.get("adamw_foreach") else ""
    return f"{name}{suffix}{foreach} @ {pg} {entry.get('world_size')}"


def noise(r: dict) -> float | None:
    """Interquartile range of the per-step times over their median."""
    return _div(_get(r, "time", "step_s_iqr"), _get(r, "time", "step_s"))


COLUMNS: list[tuple[str, Callable[[dict, dict, dict], Any]]] = [
    ("step", lambda a, b, e: _div(_get(a, "time", "step_s"), _get(b, "time", "step_s"))),
    ("fwd", lambda a, b, e: _div(_get(a, "time", "fwd_s"), _get(b, "time", "fwd_s"))),
    ("bwd", lambda a, b, e: _div(_get(a, "time", "bwd_s"), _get(b, "time", "bwd_s"))),
    ("opt", lambda a, b, e: _div(_get(a, "time", "opt_s"), _get(b, "time", "opt_s"))),
    (
        "overhead",
        lambda a, b, e: _div(_get(a, "overhead", "step_s"), _get(b, "overhead", "step_s")),
    ),
    ("paired step", lambda a, b, e: _get(e, "paired", "step_ratio_median")),
    (
        "collectives",
        lambda a, b, e: f"{_get(a, 'comm', 'total_count')}/{_get(b, 'comm', 'total_count')}",
    ),
    (
        "AG copy-in KiB",
        lambda a, b, e: (
            f"{_kib(_get(a, 'copy_roles', 'all_gather_copy_in'))}/"
            f"{_kib(_get(b, 'copy_roles', 'all_gather_copy_in'))}"
        ),
    ),
    ("copy bytes", lambda a, b, e: _div(a.get("copy_bytes"), b.get("copy_bytes"))),
    (
        "peak mem",
        lambda a, b, e: _div(_get(a, "memory", "peak_bytes"), _get(b, "memory", "peak_bytes")),
    ),
    ("peak/LB", lambda a, b, e: _get(a, "memory", "peak_over_lower_bound")),
    ("torch peak/LB", lambda a, b, e: _get(b, "memory", "peak_over_lower_bound")),
    (
        "TTFS",
        lambda a, b, e: _div(
            _get(a, "ttfs", "time_to_first_step_s"), _get(b, "ttfs", "time_to_first_step_s")
        ),
    ),
    ("noise", lambda a, b, e: _noise_pair(a, b)),
]


def _kib(x: Any) -> str:
    return "-" if x is None else f"{x / 1024:.0f}"


def _noise_pair(a: dict, b: dict) -> str:
    na, nb = noise(a), noise(b)
    return f"{_f(na)}/{_f(nb)}"


def summary_table(runs: list[dict]) -> str:
    """One row per (config, world size): ratios first/second, markdown."""
    header = ["config @ pg world", *[c for c, _ in COLUMNS]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for e in runs:
        a, b, _, _ = pair(e)
        if not a or not b:
            lines.append("| " + where(e) + " | " + " | ".join("-" for _ in COLUMNS) + " |")
            continue
        lines.append("| " + " | ".join([where(e), *[_f(fn(a, b, e)) for _, fn in COLUMNS]]) + " |")
    return "\n".join(lines)


def _target(name: str, value: Any, threshold: str, met: bool | None, note: str = "") -> dict:
    return {"target": name, "value": value, "threshold": threshold, "met": met, "note": note}


def targets(runs: list[dict]) -> list[dict[str, Any]]:
    """Evaluate the issue-6 targets on whatever runs are present."""
    out: list[dict[str, Any]] = []
    ok = [e for e in runs if "results" in e and not e.get("adamw_foreach")]

    def find(config: str, world: int, fake: bool, layers: int | None = None) -> dict | None:
        for e in ok:
            if (
                e.get("config") == config
                and e.get("world_size") == world
                and bool(e.get("fake")) == fake
                and (layers is None or _get(e, "model", "n_layers") == layers)
            ):
                return e
        return None

    e = find("small-many", 256, True, 64)
    if e:
        a, b, _, _ = pair(e)
        r = _div(_get(a, "overhead", "step_s"), _get(b, "overhead", "step_s"))
        net = _div(
            _get(a, "overhead", "step_net_of_collective_calls_s"),
            _get(b, "overhead", "step_net_of_collective_calls_s"),
        )
        net_fb = _div(
            _get(a, "overhead", "fwd_bwd_net_of_collective_calls_s"),
            _get(b, "overhead", "fwd_bwd_net_of_collective_calls_s"),
        )
        note = ""
        if net is not None:
            note = f"net of the fake collectives' calls: {_f(net)} (fwd+bwd alone: {_f(net_fb)})"
        floor = _overhead_floor(a, b)
        if floor is not None:
            note += f"; floor {_f(floor)}: the optimizer's overhead and the collective calls"
        out.append(
            _target(
                "overhead, fake ws 256, small-many",
                r,
                "<= 0.30",
                None if r is None else r <= 0.3,
                note,
            )
        )
    for e in ok:
        if e.get("fake") or e.get("world_size") not in (2, 4):
            continue
        if _get(e, "model", "n_layers") != {"small-many": 64, "large-few": 4}.get(
            e.get("config", ""), 8
        ):
            continue
        a, b, _, _ = pair(e)
        r = _div(_get(a, "time", "step_s"), _get(b, "time", "step_s"))
        p = _get(e, "paired", "step_ratio_median")
        out.append(
            _target(
                f"median step time, {where(e)}",
                r,
                "<= 0.90",
                None if r is None else r <= 0.9,
                f"paired per-round ratio {_f(p)}; noise (IQR/median) {_noise_pair(a, b)}",
            )
        )
    copy_in = []
    for e in ok:
        if _get(e, "model", "mixed_precision"):
            continue
        a, _, _, _ = pair(e)
        v = _get(a, "copy_roles", "all_gather_copy_in")
        if v is not None:
            copy_in.append((where(e), v))
    if copy_in:
        worst = max(copy_in, key=lambda t: t[1])
        out.append(
            _target(
                "all-gather copy-in bytes without a cast (every non-bf16 run)",
                worst[1],
                "== 0",
                worst[1] == 0,
                f"max over {len(copy_in)} runs, at {worst[0]}",
            )
        )
    for e in ok:
        a, b, _, _ = pair(e)
        peak_a, peak_b = _get(a, "memory", "peak_bytes"), _get(b, "memory", "peak_bytes")
        r = _div(peak_a, peak_b)
        lb = _get(a, "memory", "peak_over_lower_bound")
        if r is None or lb is None:
            continue
        # A ratio that rounds to 1.00 hides whether the excess is a few bytes or a buffer.
        excess = f"; peak - torch's: {peak_a - peak_b:+,} B" if round(r, 2) == 1.0 else ""
        out.append(
            _target(
                f"peak memory, {where(e)}",
                r,
                "<= 1.00 and peak/LB <= 1.10",
                r <= 1.0 and lb <= 1.10,
                f"peak/LB {lb:.2f} (torch {_f(_get(b, 'memory', 'peak_over_lower_bound'))})"
                + excess,
            )
        )
    for e in ok:  # the GPU target: one NCCL rank, a model that fills the card
        if e.get("fake") or e.get("backend") != "nccl" or e.get("world_size") != 1:
            continue
        a, b, _, _ = pair(e)
        r = _div(_get(a, "time", "step_s"), _get(b, "time", "step_s"))
        m = _div(_get(a, "memory", "cuda_peak_bytes"), _get(b, "memory", "cuda_peak_bytes"))
        out.append(
            _target(
                f"GPU step time and peak (max_memory_allocated), {where(e)}",
                None if r is None or m is None else max(r, m),
                "<= 1.00 (both)",
                None if r is None or m is None else r <= 1.0 and m <= 1.0,
                f"step {_f(r)}, peak {_f(m)}",
            )
        )
    for e in ok:
        if not (e.get("fake") and e.get("world_size") == 1024):
            continue
        a, b, _, _ = pair(e)
        ta = _get(a, "ttfs", "time_to_first_step_s")
        tb = _get(b, "ttfs", "time_to_first_step_s")
        r = _div(ta, tb)
        lazy = _div(_get(a, "ttfs", "lazy_init_s"), tb)
        out.append(
            _target(
                f"time to first step, {where(e)}",
                r,
                "<= 0.50",
                None if r is None else r <= 0.5,
                f"fsdp2 lazy init alone / torch time to first step: {_f(lazy)}",
            )
        )
    return out


def targets_table(runs: list[dict]) -> str:
    rows = targets(runs)
    lines = ["| target | value | threshold | met | note |", "|---|---|---|---|---|"]
    for t in rows:
        met = {True: "yes", False: "**no**", None: "-"}[t["met"]]
        lines.append(
            f"| {t['target']} | {_f(t['value'])} | {t['threshold']} | {met} | {t['note']} |"
        )
    met = [t["met"] for t in rows if t["met"] is not None]
    lines.append("")
    lines.append(f"{sum(met)} of {len(met)} target checks met.")
    return "\n".join(lines)


def noise_summary(runs: list[dict]) -> str:
    """Median and max IQR/median of the step time over every timed variant."""
    vals = []
    for e in runs:
        for r in e.get("results", {}).values():
            n = noise(r)
            if n is not None:
                vals.append(n)
    if not vals:
        return "no timed runs"
    return (
        f"step-time IQR/median over {len(vals)} timed variants: median {statistics.median(vals):.2f},"
        f" max {max(vals):.2f}"
    )
