"""Turning raw per-rank measurements into one JSON entry per (config, world size).

Also the analytic per-rank memory lower bound (see docs/benchmarks.md, "Lower bound").
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from benchmarks.configs import BenchConfig
from benchmarks.memory import distinct_nbytes

PLAIN = "plain"


def sum_local(ts: list[torch.Tensor]) -> int:
    return distinct_nbytes(ts)


def lower_bound(cfg: BenchConfig, template: nn.Module, world: int, act_bytes: int) -> dict:
    """Analytic per-rank lower bound on peak live bytes (docs/benchmarks.md, "Lower bound").

    ``persistent + max(optimizer phase, start of backward)`` where

    * persistent = sharded fp32 parameters + AdamW state (2 x sharded), both dim-0 shards
      padded to ``ceil(rows / world)`` rows, as every FSDP layout needs;
    * optimizer phase = every sharded fp32 gradient (activations are gone by then);
    * start of backward = the non-sharded model's measured fwd/bwd transient peak (saved
      activations and autograd temporaries) + the parameters that must be unsharded then
      (the root group, which backward needs first, and the largest block; every block
      when ``reshard_after_forward=False``) + with gradient accumulation, the unsharded
      gradients of every group kept across the no-sync microbatches.
    """
    esize = torch.finfo(cfg.param_dtype).bits // 8

    def shard_numel(p: torch.Tensor) -> int:  # one rank's padded dim-0 shard
        if p.dim() == 0:
            return 1
        return math.ceil(p.shape[0] / world) * (p.numel() // max(p.shape[0], 1))

    params = list(template.parameters())
    sharded = sum(shard_numel(p) for p in params) * 4
    layers = list(getattr(template, "layers", []))
    block_ids = {id(p) for blk in layers for p in blk.parameters()}
    groups = [sum(p.numel() for p in blk.parameters()) for blk in layers]
    root = sum(p.numel() for p in params if id(p) not in block_ids)
    total = root + sum(groups)
    unsharded = total if not cfg.reshard_after_forward else root + max(groups, default=0)
    accum_grads = total if cfg.grad_accum > 1 else 0
    parts = {
        "sharded_params": sharded,
        "optim_state": 2 * sharded,
        "optimizer_phase_sharded_grads": sharded,
        "backward_activations": act_bytes,
        "backward_unsharded_params": unsharded * esize,
        "backward_accumulated_grads": accum_grads * esize,
    }
    opt_phase = parts["optimizer_phase_sharded_grads"]
    bwd_phase = act_bytes + parts["backward_unsharded_params"] + parts["backward_accumulated_grads"]
    return {
        "bytes": parts["sharded_params"] + parts["optim_state"] + max(opt_phase, bwd_phase),
        "binding_phase": "optimizer" if opt_phase >= bwd_phase else "backward",
        "parts": parts,
        "param_bytes_per_elem": esize,
    }


def summarize(
    cfg: BenchConfig,
    spec: Any,
    template: nn.Module,
    gathered: list[dict[str, Any]],
    phase_wall: dict[str, float],
    labels: list[str],
) -> dict[str, Any]:
    """Merge every rank's raw numbers (rank 0 only) into one JSON entry."""
    per_rank = {g["rank"]: g for g in gathered}
    results: dict[str, Any] = {}
    for label in labels:
        ranks = [per_rank[r]["variants"][label] for r in sorted(per_rank)]
        errors = [x["error"] for x in ranks if x["error"]]
        res: dict[str, Any] = {"status": "error" if errors else "ok"}
        if errors:
            real = [e for e in errors if e["error"] != "failed on another rank"]
            res["error"] = (real or errors)[0]
        # Time: per step, the slowest rank; then the median over steps.
        n_steps = min((len(x["steps"]) for x in ranks), default=0)
        if n_steps:
            time_res: dict[str, float] = {}
            for key in ("step", "fwd", "bwd", "opt"):
                per_step = [max(x["steps"][i][key] for x in ranks) for i in range(n_steps)]
                time_res[f"{key}_s"] = statistics.median(per_step)
                time_res[f"{key}_s_series"] = per_step
                if key == "step":
                    time_res["step_s_min"] = min(per_step)
                    time_res["step_s_max"] = max(per_step)
                    qs = statistics.quantiles(per_step, n=4) if n_steps >= 2 else [0, 0, 0]
                    time_res["step_s_iqr"] = qs[2] - qs[0]
            time_res["n_steps"] = n_steps
            first = [x["warmup"][0]["step"] for x in ranks if x["warmup"]]
            if first:
                time_res["first_warmup_step_s"] = max(first)
            res["time"] = time_res
        r0 = ranks[0]["result"]
        if "instrumented" in r0:
            inst = r0["instrumented"]
            res["comm"] = inst["comm"]
            if "collective_time" in inst:
                res["collective_time"] = inst["collective_time"]
            res["probe"] = inst["probe"]
            # --no-memory: the probe counted copies and collectives only; no memory rows.
            tracked = inst["probe"].get("memory_tracked", True)
            mem = {
                "peak_bytes": inst["probe"]["peak_bytes"],
                "peak_bytes_max_rank": max(
                    x["result"].get("instrumented", {}).get("probe", {}).get("peak_bytes", 0)
                    for x in ranks
                ),
                "start_bytes": inst["probe"]["start_bytes"],
                "peak_phase": inst["probe"]["peak_phase"],
                "breakdown": inst.get("breakdown", {}),
                "breakdown_total": sum(inst.get("breakdown", {}).values()),
                "params_bytes": inst.get("params_bytes"),
                "grads_bytes": inst.get("grads_bytes"),
                "optim_state_bytes": inst.get("optim_state_bytes"),
            }
            for k in ("cuda_peak_bytes", "cuda_step_growth_bytes"):
                if k in inst:
                    mem[k] = inst[k]
            if tracked:
                res["memory"] = mem
            res["copy_bytes"] = inst["probe"]["copy_bytes_total"]
            res["copy_roles"] = inst["probe"]["copy_roles"]
        if "trace" in r0:  # a "+trace" variant: its schedule summary (rank 0's)
            res["trace"] = r0["trace"]
            if "trace_png" in r0:
                res["trace_png"] = r0["trace_png"]
        if "shard_s" in r0:
            res["shard_s"] = max(x["result"].get("shard_s", 0.0) for x in ranks)
        runs = [x["result"].get("ttfs_runs", []) for x in ranks]
        if runs and all(runs):
            k = min(len(rr) for rr in runs)
            ttfs = {}
            for key in ("shard_s", "first_fwd_bwd_s", "second_fwd_bwd_s"):
                ttfs[key] = statistics.median(max(rr[i][key] for rr in runs) for i in range(k))
            ttfs["lazy_init_s"] = ttfs["first_fwd_bwd_s"] - ttfs["second_fwd_bwd_s"]
            ttfs["time_to_first_step_s"] = ttfs["shard_s"] + ttfs["first_fwd_bwd_s"]
            ttfs["repeats"] = k
            res["ttfs"] = ttfs
        results[label] = res

    # Derived figures relative to the non-sharded run.
    plain = results.get(PLAIN, {})
    paired_res = paired(spec.impls, results)
    for label in results:
        base = label.removesuffix("+trace")
        if base != label and base in results:
            cost = paired([label, base], results)  # traced / untraced, round by round
            if cost:
                results[label]["trace_cost"] = cost
    act = 0
    if "probe" in plain:
        tp = plain["probe"]["transient_peak_by_phase"]
        act = max(tp.get("fwd", 0), tp.get("bwd", 0))
    lb = lower_bound(cfg, template, spec.world_size, act)
    for label, res in results.items():
        if label == PLAIN:
            continue
        if "time" in res and "time" in plain:
            t, p = res["time"], plain["time"]
            res["overhead"] = {
                "step_s": t["step_s"] - p["step_s"],
                "fwd_bwd_s": (t["fwd_s"] + t["bwd_s"]) - (p["fwd_s"] + p["bwd_s"]),
                "fwd_s": t["fwd_s"] - p["fwd_s"],
                "bwd_s": t["bwd_s"] - p["bwd_s"],
                "opt_s": t["opt_s"] - p["opt_s"],
            }
            # The fake process group runs each collective inside its call (synchronously):
            # what the calls took is its simulated transport, not the implementation's own
            # work (docs/benchmarks.md, "Framework overhead").
            calls = res.get("collective_time", {}).get("call_s")
            if spec.fake and calls is not None:
                res["overhead"]["step_net_of_collective_calls_s"] = (
                    res["overhead"]["step_s"] - calls
                )
                res["overhead"]["fwd_bwd_net_of_collective_calls_s"] = (
                    res["overhead"]["fwd_bwd_s"] - calls
                )
        if "copy_bytes" in res and "copy_bytes" in plain:
            res["copy_bytes_excess"] = res["copy_bytes"] - plain["copy_bytes"]
        if "memory" in res:
            res["memory"]["lower_bound_bytes"] = lb["bytes"]
            res["memory"]["peak_over_lower_bound"] = res["memory"]["peak_bytes"] / max(
                lb["bytes"], 1
            )
    model_numel = sum(p.numel() for p in template.parameters())
    return {
        "config": cfg.name,
        "description": cfg.description,
        "model": asdict(cfg) | {"params": model_numel},
        "world_size": spec.world_size,
        "fake": spec.fake,
        "backend": "fake" if spec.fake else ("nccl" if spec.device == "cuda" else "gloo"),
        "device": spec.device,
        "batch_per_rank": cfg.batch or spec.batch,
        "seq": cfg.seq or spec.seq,
        "steps": spec.steps,
        "warmup": spec.warmup,
        "ttfs_repeats": spec.ttfs_repeats,
        "adamw_foreach": getattr(spec, "foreach", None),
        "impls": spec.impls,
        "lower_bound": lb,
        "paired": paired_res,
        "phase_wall_s": phase_wall,
        "results": results,
    }


def paired(impls: list[str], results: dict[str, Any]) -> dict[str, Any]:
    """Round-by-round comparison of the first two implementations (same round = same noise)."""
    labels = [lb for lb in impls[:2] if "time" in results.get(lb, {})]
    if len(labels) < 2 or "time" not in results.get(PLAIN, {}):
        return {}
    a, b, p = (results[x]["time"] for x in (*labels, PLAIN))
    n = min(len(a["step_s_series"]), len(b["step_s_series"]), len(p["step_s_series"]))
    if n == 0:
        return {}

    def fb(t: dict, i: int) -> float:
        return t["fwd_s_series"][i] + t["bwd_s_series"][i]

    ratios = [a["step_s_series"][i] / b["step_s_series"][i] for i in range(n)]
    diffs = [a["step_s_series"][i] - b["step_s_series"][i] for i in range(n)]
    fb_diffs = [fb(a, i) - fb(b, i) for i in range(n)]
    wins = sum(1 for d in diffs if d < 0)
    return {
        "of": labels,
        "step_ratio_median": statistics.median(ratios),
        "step_diff_s_median": statistics.median(diffs),
        "fwd_bwd_diff_s_median": statistics.median(fb_diffs),
        "rounds": n,
        "rounds_first_faster": wins,
    }
