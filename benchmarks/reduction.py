"""``ReducePolicy`` side by side: error, bytes, time and memory of three reduction schemes,
and training curves. See docs/reduction.md for what each figure means.

Schemes: an fp32 reduce-scatter (today's default with fp32 gradients), a bf16
reduce-scatter (``ReducePolicy(comm_dtype=bf16, accumulate_dtype=bf16)``, the same as
``MixedPrecisionPolicy(reduce_dtype=bf16)``), and bf16 on the wire with fp32 sums
(``ReducePolicy(comm_dtype=bf16, accumulate_dtype=fp32)``: one all-to-all per group and
a local rank-order sum). torch's ``fully_shard`` with fp32 and bf16 reduction runs in the
same processes, in alternation, as the reference for step time and memory.

    python benchmarks/reduction.py                     # every part, ~10 min on 2 cores
    python benchmarks/reduction.py --part precision    # error vs world size (1 min)
    python benchmarks/reduction.py --part step --world-size 2,4
    python benchmarks/reduction.py --part training --steps 300

Writes ``benchmarks/results/reduction.json`` (ignored by git), the plots
``benchmarks/results/reduction_error.png`` and ``reduction_training.png``, and the
report ``benchmarks/results/reduction_cpu_<yyyymm>.md``.
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import gc
import json
import os
import pickle
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

import fsdp2  # noqa: E402
from benchmarks.comm import CollectiveCounter  # noqa: E402
from benchmarks.memory import StepProbe, reachable_tensors  # noqa: E402
from benchmarks.meta import host_info  # noqa: E402
from examples.llama import ModelArgs, Transformer, loss_fn, parallelize  # noqa: E402
from fsdp2._collectives import PendingCollective  # noqa: E402
from fsdp2._comm_context import CommContext  # noqa: E402
from fsdp2._reduction import accumulate_in_rank_order, sum_exchanged  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
BF16, FP32, FP64 = torch.bfloat16, torch.float32, torch.float64
FP32_RS, BF16_RS, BF16_WIRE = "fp32 reduce-scatter", "bf16 reduce-scatter", "bf16 wire, fp32 sums"
POLICIES: dict[str, fsdp2.ReducePolicy | None] = {
    FP32_RS: None,
    BF16_RS: fsdp2.ReducePolicy(comm_dtype=BF16, accumulate_dtype=BF16),
    BF16_WIRE: fsdp2.ReducePolicy(comm_dtype=BF16, accumulate_dtype=FP32),
}
BOUND = 2.0**-8
COLORS = {FP32_RS: "tab:blue", BF16_RS: "tab:orange", BF16_WIRE: "tab:green"}


# --------------------------------------------------------------------------- errors
def contributions(world_size: int, numel: int, seed: int = 0) -> torch.Tensor:
    """``(world_size, numel)`` fp32 per-rank gradients of realistic spread: each element
    has its own scale (log-normal, about eight decades), a mean shared by the ranks (the
    signal) and per-rank noise twice its size, as minibatch gradients have."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp(2.0 * torch.randn(numel, generator=gen, dtype=FP64))
    signal = 0.5 * torch.randn(numel, generator=gen, dtype=FP64)
    noise = torch.randn(world_size, numel, generator=gen, dtype=FP64)
    return (scale * (signal + noise)).to(FP32)


def relative_error(reduced: torch.Tensor, contribs: torch.Tensor) -> float:
    """Max over elements of ``|reduced - mean| / mean |contribution|``, the mean in fp64
    over the ranks' fp32 contributions."""
    exact = contribs.to(FP64)
    error = (reduced.to(FP64).flatten() - exact.mean(0)).abs() / exact.abs().mean(0)
    return error.max().item()


def simulated(contribs: torch.Tensor, scheme: str) -> torch.Tensor:
    """What ``scheme`` gives for ``contribs`` (stacked per-rank contributions) without a
    process group. bf16 wire: the code a rank runs after the all-to-all
    (``sum_exchanged``), then the one division. bf16 reduce-scatter: a ring's rounding,
    each hop adding one rank's term to a bf16 partial sum, then the division in bf16.
    fp32: the same fold in fp32."""
    ws = contribs.shape[0]
    if scheme == BF16_WIRE:
        comm = CommContext(torch.device("cpu"))
        received = contribs.to(BF16).reshape(-1)
        summed, _ = sum_exchanged(received, PendingCollective(None, None), ws, FP32, comm, False)
        return summed.div_(float(ws))
    if scheme == BF16_RS:
        return accumulate_in_rank_order(contribs.to(BF16), BF16).div_(float(ws)).float()
    return accumulate_in_rank_order(contribs, FP32).div_(float(ws))


class Probe(torch.nn.Module):
    """One parameter whose gradient is the input."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(numel // 8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight * x.view_as(self.weight)).sum()


def _gloo_errors(numel: int, shape: tuple[int, ...] | None = None) -> dict[str, float]:
    """Rank function: each scheme's error for the same contributions on gloo; ``shape``:
    an HSDP mesh (replicas, shard ranks) instead of all ranks sharding."""
    from torch.distributed.device_mesh import init_device_mesh

    ws, rank = dist.get_world_size(), dist.get_rank()
    contribs = contributions(ws, numel, 0)
    mesh = init_device_mesh("cpu", shape or (ws,))
    out = {}
    for name, policy in POLICIES.items():
        probe = Probe(numel)
        fsdp2.fully_shard(probe, mesh=mesh, reduce_policy=policy)
        probe(contribs[rank]).backward()
        out[name] = relative_error(probe.weight.grad.full_tensor(), contribs)
    return out


def precision(gloo_sizes: list[int], numel: int) -> dict[str, Any]:
    simulation: dict[str, dict[int, float]] = {name: {} for name in POLICIES}
    for exponent in range(1, 11):
        ws = 2**exponent
        contribs = contributions(ws, numel, exponent)
        for name in POLICIES:
            simulation[name][ws] = relative_error(simulated(contribs, name), contribs)
    gloo = {ws: spawn(_gloo_errors, ws, numel)[0] for ws in gloo_sizes}
    hsdp = {f"{r}x{s}": spawn(_gloo_errors, r * s, numel, (r, s))[0] for r, s in ((2, 2), (2, 4))}
    return {"numel": numel, "simulation": simulation, "gloo": gloo, "hsdp": hsdp}


# --------------------------------------------------------------------------- launching
def _rank_main(rank: int, ws: int, store: str, out: str, fn: Any, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=ws,
        timeout=_dt.timedelta(seconds=600),
    )  # fmt: skip
    try:
        result = fn(*args)
        with open(f"{out}.{rank}", "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def spawn(fn: Any, ws: int, *args: Any) -> list[Any]:
    """Run ``fn(*args)`` on ``ws`` gloo ranks; the per-rank results in rank order."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "out")
        mp.spawn(_rank_main, args=(ws, store, out, fn, args), nprocs=ws, join=True)
        results = []
        for rank in range(ws):
            with open(f"{out}.{rank}", "rb") as f:
                results.append(pickle.load(f))
    return results


# --------------------------------------------------------------------------- step
def _variants() -> dict[str, tuple[Any, dict[str, Any]]]:
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    out: dict[str, tuple[Any, dict[str, Any]]] = {
        f"fsdp2 {name}": (fsdp2.fully_shard, {"reduce_policy": policy})
        for name, policy in POLICIES.items()
    }
    out[f"torch {FP32_RS}"] = (torch_fully_shard, {})
    out[f"torch {BF16_RS}"] = (torch_fully_shard, {"mp_policy": TorchPolicy(reduce_dtype=BF16)})
    return out


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=FP64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _train_step(model: Any, optim: Any, tokens: torch.Tensor) -> tuple[float, float]:
    t0 = time.perf_counter()
    loss = loss_fn(model(tokens), tokens)
    t1 = time.perf_counter()
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    t2 = time.perf_counter()
    return t2 - t0, t2 - t1


def _reduction_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for c in calls if c["kind"] == "reduce_scatter" or c["api"] == "all_to_all_single"]


def _time_reductions(sizes: list[int], repeats: int) -> dict[str, float]:
    """Median over ``repeats`` of one step's reductions run alone and waited for at once:
    per group of ``sizes`` (the fp32 reduce-scatter inputs' elements), the fp32 and bf16
    reduce-scatters, and the bf16 all-to-all with the fp32 rank-order sum and division."""
    ws = dist.get_world_size()
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    inputs = {dtype: [torch.randn(n).to(dtype) for n in sizes] for dtype in (FP32, BF16)}
    totals: dict[str, list[float]] = {FP32_RS: [], BF16_RS: [], BF16_WIRE: []}
    for _ in range(repeats):
        for name in totals:
            dist.barrier()
            start = time.perf_counter()
            for n, fp32_in, bf16_in in zip(sizes, inputs[FP32], inputs[BF16]):
                if name == BF16_WIRE:
                    received = torch.empty_like(bf16_in)
                    dist.all_to_all_single(received, bf16_in, async_op=True).wait()
                    accumulate_in_rank_order(received.view(ws, -1), FP32).div_(float(ws))
                else:
                    source = fp32_in if name == FP32_RS else bf16_in
                    output = torch.empty(n // ws, dtype=source.dtype)
                    rs(output, source, op=dist.ReduceOp.AVG, async_op=True).wait()
            totals[name].append(_slowest(time.perf_counter() - start))
    return {name: statistics.median(values) for name, values in totals.items()}


def _step_rank(cfg: dict[str, Any], steps: int, warmup: int, repeats: int) -> dict[str, Any]:
    rank = dist.get_rank()
    args = ModelArgs(
        vocab_size=cfg["vocab"], dim=cfg["dim"], n_layers=cfg["layers"],
        n_heads=cfg["heads"], max_seq_len=cfg["seq"],
    )  # fmt: skip
    torch.manual_seed(0)
    template = Transformer(args)
    template.init_weights(0)
    gen = torch.Generator().manual_seed(rank)
    batches = [
        torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=gen) for _ in range(4)
    ]
    variants = {}
    for name, (shard, kw) in _variants().items():
        model = parallelize(
            copy.deepcopy(template), shard, **{k: v for k, v in kw.items() if v is not None}
        )
        variants[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    times: dict[str, list[float]] = {name: [] for name in variants}
    backward: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(warmup + steps):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            gc.collect()
            dist.barrier()
            step_s, backward_s = _train_step(*variants[name], batches[r % len(batches)])
            if r >= warmup:
                times[name].append(_slowest(step_s))
                backward[name].append(_slowest(backward_s))
    result: dict[str, Any] = {"variants": {}}
    sizes: list[int] = []
    for name, (model, optim) in variants.items():
        with CollectiveCounter() as counter:
            _train_step(model, optim, batches[0])
        calls = _reduction_calls(counter.calls)
        if name == f"fsdp2 {FP32_RS}":
            sizes = [c["in_bytes"] // 4 for c in calls]
        probe = StepProbe(track_memory=True)
        probe.register(
            [
                *model.parameters(),
                *[
                    t
                    for s in optim.state.values()
                    for t in s.values()
                    if isinstance(t, torch.Tensor)
                ],
            ]
        )
        probe.register(reachable_tensors(model, optim), persistent=True)
        gc.collect()
        dist.barrier()
        gc.disable()
        try:
            with probe:
                _train_step(model, optim, batches[1])
        finally:
            gc.enable()
        probe.close()
        result["variants"][name] = {
            "step_s": statistics.median(times[name]),
            "backward_s": statistics.median(backward[name]),
            "reductions": len(calls),
            "reduction_apis": sorted({c["api"] for c in calls}),
            "reduction_bytes": sum(c["in_bytes"] for c in calls),
            "peak_bytes": probe.summary()["peak_bytes"],
        }
    result["communication_s"] = _time_reductions(sizes, repeats)
    result["group_sizes"] = sizes
    return result


STEP_CONFIG = {"vocab": 1024, "dim": 512, "layers": 4, "heads": 8, "seq": 64, "batch": 2}


def step(world_sizes: list[int], steps: int, warmup: int, repeats: int) -> dict[str, Any]:
    return {
        "config": STEP_CONFIG,
        "runs": {
            ws: spawn(_step_rank, ws, STEP_CONFIG, steps, warmup, repeats)[0] for ws in world_sizes
        },
    }


# --------------------------------------------------------------------------- training
TRAIN_CONFIG = {"vocab": 256, "dim": 64, "layers": 2, "heads": 4, "seq": 32, "batch": 4}


def markov_batch(step: int, rank: int, cfg: dict[str, Any]) -> torch.Tensor:
    """Sequences of a fixed random Markov chain (each token has 4 likely successors), so
    the loss falls from log(vocab) towards log(4)."""
    vocab, batch, seq = cfg["vocab"], cfg["batch"], cfg["seq"]
    successors = torch.randint(0, vocab, (vocab, 4), generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1_000_003 * step + rank)
    tokens = torch.empty(batch, seq, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
    choice = torch.randint(0, 4, (batch, seq), generator=gen)
    for t in range(1, seq):
        tokens[:, t] = successors[tokens[:, t - 1], choice[:, t]]
    return tokens


def _training_rank(steps: int) -> dict[str, list[float]]:
    """Rank function: the tiny Llama trained ``steps`` AdamW steps with bf16 compute
    (``param_dtype=bf16``, fp32 masters) under each scheme; the mean loss per step."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    cfg = TRAIN_CONFIG
    args = ModelArgs(
        vocab_size=cfg["vocab"], dim=cfg["dim"], n_layers=cfg["layers"],
        n_heads=cfg["heads"], max_seq_len=cfg["seq"],
    )  # fmt: skip
    torch.manual_seed(0)
    template = Transformer(args)
    template.init_weights(0)
    schemes = {
        FP32_RS: {"mp_policy": fsdp2.MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)},
        BF16_RS: {"mp_policy": fsdp2.MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=BF16)},
        BF16_WIRE: {
            "mp_policy": fsdp2.MixedPrecisionPolicy(param_dtype=BF16),
            "reduce_policy": POLICIES[BF16_WIRE],
        },
    }
    curves: dict[str, list[float]] = {}
    for name, kw in schemes.items():
        model = parallelize(copy.deepcopy(template), fsdp2.fully_shard, **kw)
        optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for s in range(steps):
            tokens = markov_batch(s, rank, cfg)
            loss = loss_fn(model(tokens).float(), tokens)  # an fp32 loss: a smooth curve
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            mean = loss.detach().float().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / ws)
        curves[name] = losses
    return curves


def training(world_size: int, steps: int) -> dict[str, Any]:
    curves = spawn(_training_rank, world_size, steps)[0]
    reference = torch.tensor(curves[FP32_RS])
    deviation = {}
    for name in (BF16_RS, BF16_WIRE):
        diff = (torch.tensor(curves[name]) - reference).abs()
        deviation[name] = {"mean": diff.mean().item(), "max": diff.max().item()}
    return {
        "world_size": world_size,
        "steps": steps,
        "config": TRAIN_CONFIG,
        "curves": curves,
        "deviation_from_fp32": deviation,
    }


# --------------------------------------------------------------------------- output
def plot(results: dict[str, Any]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    if "precision" in results:
        p = results["precision"]
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for name, marker in zip(POLICIES, "osD"):
            series = {int(k): v for k, v in p["simulation"][name].items()}
            xs = sorted(series)
            ys = [series[x] for x in xs]
            ax.plot(xs, ys, marker=marker, color=COLORS[name], label=f"{name} (simulated)")
            gloo = {int(ws): e[name] for ws, e in p["gloo"].items()}
            if gloo:
                gx = sorted(gloo)
                ax.scatter(gx, [gloo[x] for x in gx], marker="x", color="black", zorder=3)
        ax.axhline(BOUND, color="grey", linestyle="--", label="2^-8")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("world size (ranks)")
        ax.set_ylabel("max error / mean |contribution|")
        ax.set_title("Gradient reduction error vs fp64 (x: measured on gloo)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = RESULTS / "reduction_error.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    if "training" in results:
        t = results["training"]
        curves = t["curves"]
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.4, 6.4), sharex=True)
        for name, style in zip(POLICIES, ("-", "-", "--")):
            top.plot(curves[name], style, color=COLORS[name], label=name, linewidth=1)
        top.set_ylabel("loss (mean over ranks)")
        top.set_title(f"Tiny Llama, bf16 compute, {t['world_size']} gloo ranks")
        top.legend(fontsize=8)
        reference = torch.tensor(curves[FP32_RS])
        for name in (BF16_RS, BF16_WIRE):
            diff = (torch.tensor(curves[name]) - reference).abs()
            label = name if diff.max() > 0 else f"{name}: 0 at every step (drawn at 1e-9)"
            bottom.plot(diff.clamp_min(1e-9).tolist(), color=COLORS[name], label=label, linewidth=1)
        bottom.set_yscale("log")
        bottom.set_xlabel("step")
        bottom.set_ylabel("|loss - fp32-reduce loss|")
        bottom.legend(fontsize=8)
        fig.tight_layout()
        path = RESULTS / "reduction_training.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def report(results: dict[str, Any], command: str) -> str:
    lines = [f"# ReducePolicy benchmark ({results['date']})", "", command, ""]
    host = results["host"]
    lines += [f"torch {host['torch']}, {host['cpu']}, {host['cpu_count']} CPUs.", ""]
    if "precision" in results:
        p = results["precision"]
        lines += [
            "## Error vs world size",
            "",
            f"Max over {p['numel']} elements of |reduced - fp64 mean| / mean |contribution|.",
            "",
            "| ranks | " + " | ".join(POLICIES) + " |",
            "| ---: |" + " ---: |" * len(POLICIES),
        ]
        for ws in sorted(int(k) for k in p["simulation"][FP32_RS]):
            cells = [f"{p['simulation'][name][ws]:.2e}" for name in POLICIES]
            lines.append(f"| {ws} (simulated) | " + " | ".join(cells) + " |")
        for ws, errors in sorted((int(k), v) for k, v in p["gloo"].items()):
            cells = [f"{errors[name]:.2e}" for name in POLICIES]
            lines.append(f"| {ws} (gloo) | " + " | ".join(cells) + " |")
        for mesh, errors in p.get("hsdp", {}).items():
            cells = [f"{errors[name]:.2e}" for name in POLICIES]
            lines.append(f"| HSDP {mesh} (gloo) | " + " | ".join(cells) + " |")
        lines.append("")
    if "step" in results:
        s = results["step"]
        lines += [
            "## Step time, bytes, communication time, memory",
            "",
            f"Config: {s['config']}",
            "",
        ]
        for ws, run in sorted((int(k), v) for k, v in s["runs"].items()):
            comm = run["communication_s"]
            lines += [
                f"### {ws} gloo ranks",
                "",
                "| variant | step ms | backward ms | reductions | bytes per step | peak MiB |",
                "| --- | ---: | ---: | ---: | ---: | ---: |",
            ]
            for name, v in run["variants"].items():
                lines.append(
                    f"| {name} | {1e3 * v['step_s']:.1f} | {1e3 * v['backward_s']:.1f} | "
                    f"{v['reductions']} x {'/'.join(v['reduction_apis'])} | "
                    f"{v['reduction_bytes']:,} | {v['peak_bytes'] / 2**20:.2f} |"
                )
            base = comm[FP32_RS]
            lines += [
                "",
                "Reductions of one step run alone (median of repeats, slowest rank): "
                + ", ".join(f"{k} {1e3 * v:.2f} ms ({v / base:.2f}x)" for k, v in comm.items()),
                "",
            ]
            wire = run["variants"][f"fsdp2 {BF16_WIRE}"]
            rs16 = run["variants"][f"fsdp2 {BF16_RS}"]
            lines += [
                f"Targets: communication {comm[BF16_WIRE] / base:.2f}x fp32 (<= 0.8x); peak "
                f"memory {wire['peak_bytes'] / rs16['peak_bytes']:.3f}x bf16 reduce-scatter "
                f"(<= 1.05x).",
                "",
            ]
    if "training" in results:
        t = results["training"]
        lines += [
            "## Training",
            "",
            f"{t['steps']} steps, {t['world_size']} gloo ranks, {t['config']}; "
            "|loss - fp32-reduce loss|:",
            "",
        ]
        for name, d in t["deviation_from_fp32"].items():
            lines.append(f"- {name}: mean {d['mean']:.2e}, max {d['max']:.2e}")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["all", "precision", "step", "training"], default="all")
    parser.add_argument("--world-size", default="2,4", help="gloo world sizes for --part step")
    parser.add_argument("--gloo-precision-sizes", default="2,4,8")
    parser.add_argument("--numel", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=300, help="training steps")
    parser.add_argument("--train-world-size", type=int, default=4)
    parser.add_argument("--timed-steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS / "reduction.json")
    opts = parser.parse_args()
    sizes = [int(x) for x in opts.world_size.split(",") if x]
    # A run of some parts keeps the other parts of the last run (one report for all).
    results: dict[str, Any] = json.loads(opts.out.read_text()) if opts.out.exists() else {}
    results.update(date=_dt.date.today().isoformat(), host=host_info())
    commands = results.setdefault("commands", {})
    command = " ".join(["python benchmarks/reduction.py", *sys.argv[1:]])
    if opts.part in ("all", "precision"):
        gloo = [int(x) for x in opts.gloo_precision_sizes.split(",") if x]
        results["precision"] = precision(gloo, opts.numel)
        commands["precision"] = command
    if opts.part in ("all", "step"):
        results["step"] = step(sizes, opts.timed_steps, opts.warmup, opts.repeats)
        commands["step"] = command
    if opts.part in ("all", "training"):
        results["training"] = training(opts.train_world_size, opts.steps)
        commands["training"] = command
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(results, indent=1))
    plot(results)
    text = report(results, "; ".join(f"{k}: `{v}`" for k, v in commands.items()))
    stamp = _dt.date.today().strftime("%Y%m")
    (RESULTS / f"reduction_cpu_{stamp}.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
