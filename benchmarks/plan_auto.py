"""Automatic grouping against one group per block, side by side in one run.

For each config, every rank builds the same Llama twice (same weights): one sharded
the usual way (``fully_shard`` on every block, then the root) and one by
``plan_sharding(groups="auto")``'s plan (``ShardingPlan.apply``). Both step with AdamW in
alternation (the order rotates every round, a barrier before every step, as
``benchmarks/compare.py`` does), then each runs one measured step for its peak of live
tensor bytes. Ratios are auto / per-block. Targets (issue 27): small-many step time <=
0.8x at peak <= 1.1x; large-few no worse.

    python benchmarks/plan_auto.py                        # small-many and large-few, 2 ranks
    python benchmarks/plan_auto.py --config small-many --world-size 4 --steps 20
    python benchmarks/plan_auto.py --fake-world-size 64      # one process, no transport
    python benchmarks/plan_auto.py --calibrate            # gloo latency and bandwidth

``--calibrate`` times ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` on the
gloo ranks over sizes from 4 KiB to 64 MiB and fits ``time = latency + bytes /
bandwidth`` (see ``_fit``): the figures behind ``COLLECTIVE_COSTS["cpu"]`` in
``fsdp2/plan/_grouping.py``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.plan_accuracy import (  # noqa: E402
    Case,
    _model_args,
    _step,
    batches,
    make_mesh,
    measure_step,
)
from examples.llama import Transformer, parallelize  # noqa: E402
from examples.llama import loss_fn as llama_loss  # noqa: E402

DEFAULT_JSON = REPO / "benchmarks" / "results" / "plan_auto.json"


def _build(case: Case) -> Transformer:
    args, _, _ = _model_args(case)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights(0)
    return model


def _plan(case: Case, mesh: Any, per_block: bool = False) -> Any:
    """``plan_sharding`` of the case's model on meta: its automatic grouping, or with
    ``per_block`` the prediction for one group per block (the baseline it is compared to)."""
    from fsdp2 import plan_sharding

    args, batch, seq = _model_args(case)
    with torch.device("meta"):
        model = Transformer(args)
    tokens = torch.zeros(batch, seq, dtype=torch.long)
    return plan_sharding(
        model,
        mesh=mesh,
        groups=[*model.layers, model] if per_block else "auto",
        example_inputs=tokens,
        loss_fn=lambda logits: llama_loss(logits, tokens),
    )


def _compare_worker(
    rank: int, cases: list[Case], steps: int, warmup: int, init: str, out: str
) -> None:
    import fsdp2

    torch.set_num_threads(1)
    if cases[0].fake:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cases[0].world)
    else:
        dist.init_process_group(
            "gloo", init_method=f"file://{init}", rank=rank, world_size=cases[0].world
        )
    rows = []
    try:
        for case in cases:
            mesh = make_mesh(case)
            t0 = time.perf_counter()
            plan = _plan(case, mesh)
            planning = time.perf_counter() - t0
            per_block = parallelize(_build(case), fsdp2.fully_shard, mesh=mesh)
            auto = plan.apply(_build(case), mesh=mesh)
            micro = batches(case, rank)
            variants = {"per-block": per_block, "auto": auto}
            opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in variants.items()}
            times: dict[str, list[float]] = {k: [] for k in variants}
            cpu: dict[str, list[float]] = {k: [] for k in variants}
            phases: dict[str, dict[str, float]] = {k: {} for k in variants}
            names = list(variants)
            for r in range(warmup + steps):
                order = names[r % 2 :] + names[: r % 2]
                for name in order:
                    gc.collect()
                    if not case.fake:
                        dist.barrier()
                    start, start_cpu = time.perf_counter(), time.process_time()
                    _step(variants[name], opts[name], micro, cpu_seconds=phases[name])
                    # Wall time, and this process's CPU time (every thread: compute and
                    # gloo's), which the other processes of a shared machine disturb less.
                    elapsed = torch.tensor(
                        [time.perf_counter() - start, time.process_time() - start_cpu]
                    )
                    if not case.fake:
                        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank
                    if r < warmup:
                        phases[name].clear()
                    else:
                        times[name].append(float(elapsed[0]))
                        cpu[name].append(float(elapsed[1]))
            peaks = {}
            for name in names:
                fresh = (
                    plan.apply(_build(case), mesh=mesh)
                    if name == "auto"
                    else parallelize(_build(case), fsdp2.fully_shard, mesh=mesh)
                )
                peaks[name] = measure_step(fresh, micro)["peak_bytes"]
            per_block_plan = _plan(case, mesh, per_block=True)
            rows.append(
                {
                    "case": case.label,
                    "auto_groups": [g if isinstance(g, str) else list(g) for g in plan.groups],
                    "group_count": {
                        "per-block": len(case_blocks(case)) + 1,
                        "auto": len(plan.groups),
                    },
                    "step_s": {k: statistics.median(v) for k, v in times.items()},
                    "step_min_s": {k: min(v) for k, v in times.items()},
                    "peak_bytes": peaks,
                    "predicted_peak_bytes": {
                        "per-block": per_block_plan.peak_bytes,
                        "auto": plan.peak_bytes,
                    },
                    "step_cpu_s": {k: statistics.median(v) for k, v in cpu.items()},
                    # Rank 0's CPU time per phase, per step (mean over the timed steps).
                    "phase_cpu_s": {
                        k: {ph: t / steps for ph, t in v.items()} for k, v in phases.items()
                    },
                    "step_ratio": statistics.median(times["auto"])
                    / statistics.median(times["per-block"]),
                    "cpu_ratio": statistics.median(cpu["auto"])
                    / statistics.median(cpu["per-block"]),
                    "paired_ratio": statistics.median(
                        a / b for a, b in zip(times["auto"], times["per-block"])
                    ),
                    "peak_ratio": peaks["auto"] / peaks["per-block"],
                    "planning_s": planning,
                }
            )
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def case_blocks(case: Case) -> list[int]:
    args, _, _ = _model_args(case)
    return list(range(args.n_layers))


def _calibrate_worker(rank: int, world: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    rows = []
    try:
        for exponent in range(12, 27, 2):  # 4 KiB .. 64 MiB gathered
            nbytes = 2**exponent
            shard = torch.zeros(nbytes // 4 // world)
            full = torch.empty(shard.numel() * world)
            timings = {"all_gather": [], "reduce_scatter": []}
            for _ in range(12):
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_gather_into_tensor(full, shard)
                t1 = time.perf_counter()
                dist.reduce_scatter_tensor(shard, full)
                t2 = time.perf_counter()
                timings["all_gather"].append(t1 - t0)
                timings["reduce_scatter"].append(t2 - t1)
            rows.append(
                {"bytes": nbytes, **{k: statistics.median(v[2:]) for k, v in timings.items()}}
            )
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def _spawn(fn: Any, world: int, *args: Any) -> Any:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="fsdp2_plan_auto_") as tmp:
        out = os.path.join(tmp, "out.json")
        mp.start_processes(
            fn, args=(*args, os.path.join(tmp, "rdzv"), out), nprocs=world, start_method="spawn"
        )
        return json.loads(Path(out).read_text())


def _fit(rows: list[dict[str, Any]], kind: str) -> tuple[float, float]:
    """``time = latency + bytes / bandwidth``: the latency is the median time of the
    messages up to 16 KiB, the bandwidth the slope from 64 KiB to 4 MiB (the sizes a
    merge decision is about; larger messages on the CPU also pay page faults)."""
    small = [r[kind] for r in rows if r["bytes"] <= 16 << 10]
    low = next(r for r in rows if r["bytes"] >= 64 << 10)
    high = max((r for r in rows if r["bytes"] <= 4 << 20), key=lambda r: r["bytes"])
    bandwidth = (high["bytes"] - low["bytes"]) / (high[kind] - low[kind])
    return statistics.median(small), bandwidth


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="small-many,large-few")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument(
        "--fake-world-size", type=int, default=None, help="torch's fake process group instead"
    )
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--calibrate", action="store_true")
    p.add_argument("--json", default=str(DEFAULT_JSON))
    args = p.parse_args(argv)
    if args.calibrate:
        rows = _spawn(_calibrate_worker, args.world_size, args.world_size)
        print("| gathered bytes | all-gather (ms) | reduce-scatter (ms) |\n|---|---|---|")
        for r in rows:
            print(
                f"| {r['bytes']} | {r['all_gather'] * 1e3:.3f} | {r['reduce_scatter'] * 1e3:.3f} |"
            )
        for kind in ("all_gather", "reduce_scatter"):
            latency, bandwidth = _fit(rows, kind)
            print(
                f"{kind}: latency {latency * 1e6:.0f} us, bandwidth {bandwidth / 1e9:.2f} GB/s, "
                f"latency x bandwidth {latency * bandwidth / 2**10:.0f} KiB"
            )
        return 0
    fake = args.fake_world_size is not None
    world = args.fake_world_size if fake else args.world_size
    cases = [Case(name, world, fake) for name in args.config.split(",")]
    if fake:  # one process, in this one
        with tempfile.TemporaryDirectory(prefix="fsdp2_plan_auto_") as tmp:
            out = os.path.join(tmp, "out.json")
            _compare_worker(0, cases, args.steps, args.warmup, "", out)
            rows = json.loads(Path(out).read_text())
    else:
        rows = _spawn(_compare_worker, args.world_size, cases, args.steps, args.warmup)
    print(
        "| config @ pg world | groups per-block / auto | step per-block (ms) | step auto (ms) | "
        "step ratio | paired | CPU time ratio | peak per-block (MiB) | peak auto (MiB) | "
        "peak ratio | predicted peak ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        pred = r["predicted_peak_bytes"]
        print(
            f"| {r['case']} | {r['group_count']['per-block']} / {r['group_count']['auto']} | "
            f"{r['step_s']['per-block'] * 1e3:.1f} | {r['step_s']['auto'] * 1e3:.1f} | "
            f"{r['step_ratio']:.2f} | {r['paired_ratio']:.2f} | {r['cpu_ratio']:.2f} | "
            f"{r['peak_bytes']['per-block'] / 2**20:.2f} | {r['peak_bytes']['auto'] / 2**20:.2f} | "
            f"{r['peak_ratio']:.3f} | {pred['auto'] / pred['per-block']:.3f} |"
        )
    print("\nCPU time per step by phase, rank 0 (ms): forward / backward / optimizer")
    for r in rows:
        parts = {
            k: " / ".join(
                f"{v.get(ph, 0.0) * 1e3:.1f}" for ph in ("forward", "backward", "optimizer")
            )
            for k, v in r["phase_cpu_s"].items()
        }
        print(f"- {r['case']}: per-block {parts['per-block']}; auto {parts['auto']}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
