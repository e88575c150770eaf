"""Plots of framework overhead and peak memory, per implementation, from compare.py JSON.

    python benchmarks/plot.py                          # results/latest.json + results/sweep.json
    python benchmarks/plot.py some.json other.json --out-dir benchmarks/results

Writes, into --out-dir:

* ``compare_vs_world.png``  - overhead per step and peak live memory vs world size, one line per
  (implementation, config, layer count) that has at least two world sizes;
* ``compare_vs_layers.png`` - the same vs layer count, one line per (implementation, config,
  world size) with at least two layer counts;
* ``compare_configs.png``   - bars per config entry (always written): overhead and peak memory.

``python benchmarks/compare.py --sweep`` produces data for the first two.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
MiB = 1024 * 1024


def _points(paths: list[Path]) -> list[dict[str, Any]]:
    pts = []
    for path in paths:
        data = json.loads(path.read_text())
        for e in data.get("runs", []):
            for impl in e.get("impls", []):
                r = e.get("results", {}).get(impl, {})
                if r.get("status") != "ok":
                    continue
                pts.append(
                    {
                        "config": e["config"],
                        "world": e["world_size"],
                        "fake": e.get("fake", False),
                        "pg": "fake" if e.get("fake") else e.get("backend", "real"),
                        "layers": e["model"]["n_layers"],
                        "impl": impl,
                        "overhead_ms": (r.get("overhead", {}).get("step_s") or 0.0) * 1e3,
                        "fwd_bwd_overhead_ms": (r.get("overhead", {}).get("fwd_bwd_s") or 0.0)
                        * 1e3,
                        "peak_mib": (r.get("memory", {}).get("peak_bytes") or 0) / MiB,
                        "lower_bound_mib": (r.get("memory", {}).get("lower_bound_bytes") or 0)
                        / MiB,
                        "source": path.name,
                    }
                )
    return pts


def _line_plot(
    plt: Any, pts: list[dict], x: str, group: tuple[str, ...], title: str, out: Path
) -> bool:
    series: dict[tuple, list[dict]] = defaultdict(list)
    for p in pts:
        series[tuple(p[g] for g in group)].append(p)
    series = {
        k: sorted(v, key=lambda p: p[x]) for k, v in series.items() if len({p[x] for p in v}) >= 2
    }
    if not series:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    impls = sorted({k[0] for k in series})
    markers = "osd^v<>"
    # One colour per (config, ...) line, shared by the implementations; one style per impl.
    rests = sorted({k[1:] for k in series}, key=str)
    colors = [f"C{i % 10}" for i in range(len(rests))]
    for key, s in sorted(series.items(), key=lambda kv: str(kv[0])):
        impl = key[0]
        style = "-" if impls.index(impl) == 0 else "--"
        color = colors[rests.index(key[1:])]
        label = " ".join(f"{g}={v}" for g, v in zip(group, key))
        xs = [p[x] for p in s]
        mk = markers[impls.index(impl) % len(markers)]
        kw = {"marker": mk, "label": label, "color": color}
        axes[0].plot(xs, [p["overhead_ms"] for p in s], style, **kw)
        axes[1].plot(xs, [p["fwd_bwd_overhead_ms"] for p in s], style, **kw)
        axes[2].plot(xs, [p["peak_mib"] for p in s], style, **kw)
        if impls.index(impl) == 0:
            axes[2].plot(xs, [p["lower_bound_mib"] for p in s], ":", color=color, linewidth=1)
    for ax, ylabel in zip(
        axes,
        (
            "overhead vs non-sharded, ms/step",
            "fwd+bwd overhead, ms/step",
            "peak live memory, MiB (dotted: lower bound; solid/dashed: impls)",
        ),
    ):
        ax.set_xlabel(x)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if x == "world":
            ax.set_xscale("log", base=2)
    axes[0].legend(fontsize=6)
    for ax in axes[1:]:
        ax.set_yscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"[plot] wrote {out}")
    return True


def _bars(plt: Any, pts: list[dict], out: Path) -> None:
    keys = sorted({(p["config"], p["world"], p["layers"], p["fake"]) for p in pts})
    impls = sorted({p["impl"] for p in pts})
    if not keys:
        return
    idx = {p_key: i for i, p_key in enumerate(keys)}
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.2 * len(keys) + 4), 5))
    width = 0.8 / max(len(impls), 1)
    for j, impl in enumerate(impls):
        sel = [p for p in pts if p["impl"] == impl]
        xs = [idx[(p["config"], p["world"], p["layers"], p["fake"])] + j * width for p in sel]
        axes[0].bar(xs, [p["overhead_ms"] for p in sel], width, label=impl)
        axes[1].bar(xs, [p["peak_mib"] for p in sel], width, label=impl)
    labels = [f"{c}\nW={w}{'(fake)' if f else ''} L={L}" for c, w, L, f in keys]
    for ax, ylabel in zip(axes, ("overhead vs non-sharded, ms/step", "peak live memory, MiB")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(keys))])
        ax.set_xticklabels(labels, fontsize=7, rotation=30, ha="right")
        ax.set_ylabel(ylabel)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"[plot] wrote {out}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "json", nargs="*", help="compare.py JSON files (default latest.json, sweep.json)"
    )
    p.add_argument("--out-dir", default=str(RESULTS))
    args = p.parse_args(argv)
    paths = [Path(x) for x in args.json] or [
        x for x in (RESULTS / "latest.json", RESULTS / "sweep.json") if x.exists()
    ]
    if not paths:
        print("[plot] no results; run benchmarks/compare.py first", file=sys.stderr)
        return 1
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = _points(paths)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    w = _line_plot(
        plt,
        pts,
        "world",
        ("impl", "config", "layers", "pg"),
        "vs world size",
        out / "compare_vs_world.png",
    )
    L = _line_plot(
        plt,
        pts,
        "layers",
        ("impl", "config", "world", "pg"),
        "vs layer count",
        out / "compare_vs_layers.png",
    )
    if not (w or L):
        print("[plot] no world-size or layer sweep in the data (see compare.py --sweep)")
    _bars(plt, pts, out / "compare_configs.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
