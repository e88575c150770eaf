"""Predicted against measured: ``fsdp2.plan.plan_sharding`` on the benchmark configs.

For each case (a benchmark config, a world size, and variations: ``reshard_after_forward``
True/False/int, activation checkpointing, HSDP), the same Llama model is sharded with
fsdp2 and stepped (two warm-up steps, then one measured step) exactly as
``benchmarks/compare.py``'s instrumented step measures it: peak live tensor bytes by
storage (``benchmarks.memory.StepProbe``, rank 0) and the collectives of the step
(``benchmarks.comm.CollectiveCounter``). The planner predicts the same step from the
unsharded model on the meta device, given the mesh. Each row gives predicted / measured.

    python benchmarks/plan_accuracy.py --quick                   # a few cases, < 1 minute
    python benchmarks/plan_accuracy.py --full --plot             # every case, the PNG for docs
    python benchmarks/plan_accuracy.py --case bf16 --world 4 --fake

Real worlds run on gloo ranks spawned with ``torch.multiprocessing``; fake worlds (64 to
1024 ranks) in this process on torch's fake process group.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.comm import CollectiveCounter  # noqa: E402
from benchmarks.configs import CONFIGS, BenchConfig  # noqa: E402
from benchmarks.memory import StepProbe, reachable_tensors  # noqa: E402
from examples.llama import ModelArgs, Transformer  # noqa: E402
from examples.llama import loss_fn as llama_loss  # noqa: E402

DEFAULT_JSON = REPO / "benchmarks" / "results" / "plan_accuracy.json"


@dataclass(frozen=True)
class Case:
    """One measured-against-predicted comparison."""

    config: str  # a benchmarks/configs.py name
    world: int
    fake: bool  # torch's fake process group (one process) instead of gloo ranks
    reshard: bool | int | None = None  # None: the config's
    checkpoint: bool = False  # activation checkpointing of every block
    replicate: int = 1  # HSDP: replicas (world = replicate x shard)
    n_layers: int | None = None  # overrides, to keep a case small
    dim: int | None = None
    vocab: int | None = None
    batch: int = 2
    seq: int = 64

    @property
    def label(self) -> str:
        bits = [self.config, f"{'fake' if self.fake else 'gloo'} {self.world}"]
        if self.reshard is not None:
            bits.append(f"reshard={self.reshard}")
        if self.checkpoint:
            bits.append("AC")
        if self.replicate > 1:
            bits.append(f"HSDP {self.replicate}x{self.world // self.replicate}")
        return ", ".join(bits)

    def bench_config(self) -> BenchConfig:
        return CONFIGS[self.config].with_overrides(
            n_layers=self.n_layers, dim=self.dim, vocab_size=self.vocab
        )


def _model_args(case: Case) -> tuple[ModelArgs, int, int]:
    cfg = case.bench_config()
    batch, seq = cfg.batch or case.batch, cfg.seq or case.seq
    args = ModelArgs(
        vocab_size=cfg.vocab_size,
        dim=cfg.dim,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        max_seq_len=max(seq, 16),
    )
    return args, batch, seq


def build_model(case: Case, device: str = "cpu") -> nn.Module:
    """The case's Llama, blocks wrapped for activation checkpointing if asked."""
    args, _, _ = _model_args(case)
    with torch.device(device):
        model = Transformer(args)
    if case.checkpoint:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper,
        )

        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(block)
    return model


def shard_kwargs(case: Case) -> dict[str, Any]:
    import fsdp2

    cfg = case.bench_config()
    kw: dict[str, Any] = {}
    if cfg.mixed_precision:
        kw["mp_policy"] = fsdp2.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    reshard = case.reshard if case.reshard is not None else cfg.reshard_after_forward
    if reshard is not True:
        kw["reshard_after_forward"] = reshard
    if cfg.cpu_offload:
        kw["offload_policy"] = fsdp2.CPUOffloadPolicy(pin_memory=False)
    return kw


def make_mesh(case: Case) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    if case.replicate > 1:
        return init_device_mesh(
            "cpu", (case.replicate, case.world // case.replicate), mesh_dim_names=("r", "s")
        )
    return init_device_mesh("cpu", (case.world,))


def batches(case: Case, rank: int) -> list[torch.Tensor]:
    args, batch, seq = _model_args(case)
    gen = torch.Generator().manual_seed(1000 + rank)
    accum = case.bench_config().grad_accum
    return [torch.randint(0, args.vocab_size, (batch, seq), generator=gen) for _ in range(accum)]


def _step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    micro: list[torch.Tensor],
    probe: StepProbe | None = None,
    cpu_seconds: dict[str, float] | None = None,
) -> None:
    """One optimizer step; ``cpu_seconds`` accumulates this process's CPU time per phase
    (forward, backward, optimizer)."""
    clock = time.process_time
    for i, tokens in enumerate(micro):
        if len(micro) > 1:
            model.set_requires_gradient_sync(i == len(micro) - 1)  # type: ignore[operator]
        if probe is not None:
            probe.phase = "forward"
        t0 = clock()
        loss = llama_loss(model(tokens), tokens)
        if len(micro) > 1:
            loss = loss / len(micro)
        if probe is not None:
            probe.phase = "backward"
        t1 = clock()
        loss.backward()
        del loss
        if cpu_seconds is not None:
            cpu_seconds["forward"] = cpu_seconds.get("forward", 0.0) + t1 - t0
            cpu_seconds["backward"] = cpu_seconds.get("backward", 0.0) + clock() - t1
    if probe is not None:
        probe.phase = "optimizer"
    t2 = clock()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if cpu_seconds is not None:
        cpu_seconds["optimizer"] = cpu_seconds.get("optimizer", 0.0) + clock() - t2


def measure(case: Case, rank: int, mesh: Any = None) -> dict[str, Any]:
    """Shard and step the case's model in the initialized process group; rank's peak.
    ``mesh``: the case's (``make_mesh``, which every rank must call), made if None."""
    import fsdp2

    torch.manual_seed(0)
    model = build_model(case)
    mesh = make_mesh(case) if mesh is None else mesh
    for block in model.layers:
        fsdp2.fully_shard(block, mesh=mesh, **shard_kwargs(case))
    fsdp2.fully_shard(model, mesh=mesh, **shard_kwargs(case))
    return measure_step(model, batches(case, rank))


def measure_step(model: nn.Module, micro: list[torch.Tensor]) -> dict[str, Any]:
    """Two warm-up steps of the sharded ``model`` (AdamW, the Llama loss, ``micro`` as the
    microbatches), then one measured as ``benchmarks/compare.py`` measures it."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        _step(model, opt, micro)
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    probe = StepProbe()
    probe.register(list(model.parameters()) + state)
    probe.register(list(model.buffers()), persistent=True)
    probe.register(reachable_tensors(model, opt), persistent=True)
    gc.collect()
    gc.disable()  # cyclic garbage stays until the step ends: deterministic peaks
    try:
        with CollectiveCounter() as counter, probe:
            _step(model, opt, micro, probe)
    finally:
        gc.enable()
    probe.close()
    comm = counter.summary()["by_kind"]
    return {
        "peak_bytes": probe.peak,
        "start_bytes": probe.start_bytes,
        "peak_phase": probe.summary()["peak_phase"],
        "collectives": {
            k: {"count": v["count"], "bytes": v["payload_bytes"]} for k, v in comm.items()
        },
    }


def predict(case: Case, mesh: Any = None) -> Any:
    """``plan_sharding`` of the case, from the model on the meta device. Every call gets
    the benchmark's arguments (the root too, as ``parallelize`` does); without an explicit
    ``reshard_after_forward`` the root keeps the runtime's default (False)."""
    from fsdp2.plan import plan_sharding

    model = build_model(case, device="meta")
    args, batch, seq = _model_args(case)
    tokens = torch.randint(0, args.vocab_size, (batch, seq))
    kw = shard_kwargs(case)
    if mesh is None:
        shard = case.world // case.replicate
        mesh = (case.replicate, shard) if case.replicate > 1 else (case.world,)
    return plan_sharding(
        model,
        mesh=mesh,
        groups=[*model.layers, model],
        mp_policy=kw.get("mp_policy"),
        offload_policy=kw.get("offload_policy"),
        reshard_after_forward=kw.get("reshard_after_forward"),
        example_inputs=tokens,
        loss_fn=lambda logits: llama_loss(logits, tokens),
        grad_accumulation=case.bench_config().grad_accum,
        device_type="cpu",
    )


def compare(case: Case, measured: dict[str, Any], plan: Any) -> dict[str, Any]:
    totals = plan.totals()
    predicted_comm = {k: {"count": c, "bytes": b} for k, (c, b) in totals.items() if c}
    return {
        "case": asdict(case),
        "label": case.label,
        "measured_peak": measured["peak_bytes"],
        "predicted_peak": plan.peak_bytes,
        "ratio": plan.peak_bytes / measured["peak_bytes"],
        "measured_phase": measured["peak_phase"],
        "predicted_phase": plan.peak_phase,
        "breakdown": plan.breakdown,
        "measured_collectives": measured["collectives"],
        "predicted_collectives": predicted_comm,
        "collectives_exact": measured["collectives"] == predicted_comm,
        "planning_seconds": plan.planning_seconds,
    }


# --------------------------------------------------------------------------- running cases
def run_fake(case: Case) -> dict[str, Any]:
    """Measure and predict a fake-process-group case in this process."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=case.world)
    try:
        mesh = make_mesh(case)
        measured = measure(case, 0, mesh)
        plan = predict(case, mesh=mesh)
    finally:
        dist.destroy_process_group()
    return compare(case, measured, plan)


def _gloo_worker(rank: int, case: Case, init_file: str, out_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=case.world
    )
    try:
        mesh = make_mesh(case)  # on every rank: a 2-D mesh makes process groups
        measured = measure(case, rank, mesh)
        if rank == 0:
            plan = predict(case, mesh=mesh)
            with open(out_file, "w") as f:
                json.dump(compare(case, measured, plan), f)
    finally:
        dist.destroy_process_group()


def run_gloo(case: Case) -> dict[str, Any]:
    """Measure on ``case.world`` gloo ranks (spawned) and predict on rank 0."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="fsdp2_plan_") as tmp:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(
            _gloo_worker,
            args=(case, os.path.join(tmp, "rdzv"), out),
            nprocs=case.world,
            start_method="spawn",
        )
        with open(out) as f:
            return json.load(f)


def run(case: Case) -> dict[str, Any]:
    return run_fake(case) if case.fake else run_gloo(case)


# --------------------------------------------------------------------------- case lists
def full_cases() -> list[Case]:
    """Every config at gloo 2 and 4 and fake 64 and 1024, plus the variations."""
    names = [n for n, c in CONFIGS.items() if not c.accelerator_only]
    cases = [Case(n, w, False) for n in names for w in (2, 4)]
    cases += [Case(n, w, True) for n in names for w in (64, 1024)]
    for fake, world in ((False, 2), (True, 64)):
        cases += [
            Case("small-many", world, fake, n_layers=16, reshard=False),
            Case("bf16", world, fake, checkpoint=True),
            Case("small-many", world, fake, n_layers=16, checkpoint=True),
        ]
    # An int reshard_after_forward needs 1 < n < shard size: 4 ranks at least.
    cases += [Case("bf16", 4, False, reshard=2), Case("bf16", 64, True, reshard=8)]
    cases += [
        Case("bf16", 4, False, replicate=2),
        Case("small-many", 4, False, n_layers=16, replicate=2),
        Case("bf16", 256, True, replicate=4),
        Case("cpu-offload", 256, True, reshard=False, checkpoint=True),
    ]
    return cases


def quick_cases() -> list[Case]:
    return [
        Case("bf16", 64, True, n_layers=2),
        Case("large-few", 64, True, n_layers=2, dim=256),
        Case("no-reshard", 256, True, n_layers=2),
        Case("bf16", 64, True, n_layers=2, checkpoint=True),
    ]


# --------------------------------------------------------------------------- output
def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| case | measured peak (MiB) | predicted (MiB) | predicted / measured | "
        "collectives exact |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['label']} | {r['measured_peak'] / 2**20:.2f} | "
            f"{r['predicted_peak'] / 2**20:.2f} | {r['ratio']:.3f} | "
            f"{'yes' if r['collectives_exact'] else 'NO'} |"
        )
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Predicted against measured (log-log, the +-10% band), and each case's error."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, err) = plt.subplots(1, 2, figsize=(12, 6), gridspec_kw={"width_ratios": [1, 1.1]})
    measured = [r["measured_peak"] / 2**20 for r in rows]
    predicted = [r["predicted_peak"] / 2**20 for r in rows]
    colors = ["tab:blue" if r["case"]["fake"] else "tab:orange" for r in rows]
    ax.scatter(measured, predicted, c=colors, s=22, zorder=3)
    low, high = min(measured + predicted) * 0.8, max(measured + predicted) * 1.25
    xs = [low, high]
    ax.plot(xs, xs, color="black", lw=1, label="predicted = measured")
    ax.fill_between(
        xs, [x * 0.9 for x in xs], [x * 1.1 for x in xs], color="gray", alpha=0.2, label="+-10%"
    )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(low, high)
    ax.set_ylim(low, high)
    ax.set_xlabel("measured peak per rank (MiB, live tensor bytes)")
    ax.set_ylabel("predicted peak per rank (MiB)")
    ax.scatter([], [], c="tab:orange", label="gloo ranks")
    ax.scatter([], [], c="tab:blue", label="fake process group")
    ax.legend(loc="upper left", fontsize=8)
    errors = [100 * (r["ratio"] - 1) for r in rows]
    ys = range(len(rows))
    err.barh(list(ys), errors, color=colors)
    err.set_yticks(list(ys), [r["label"] for r in rows], fontsize=6)
    err.invert_yaxis()
    err.axvline(0, color="black", lw=0.8)
    err.set_xlabel("predicted / measured - 1 (%)")
    worst = max(rows, key=lambda r: abs(r["ratio"] - 1))
    bound = max(0.02, 1.2 * max(abs(e) for e in errors))
    err.set_xlim(-bound, bound)
    fig.suptitle(
        f"plan_sharding, predicted against measured peak per rank: {len(rows)} cases, largest "
        f"error {100 * (worst['ratio'] - 1):+.3f}% ({worst['label']}), collectives exact in "
        f"{sum(r['collectives_exact'] for r in rows)}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def merge_rows(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``old`` with the rows of ``new`` replacing those of the same case, new ones last."""
    labels = {r["label"] for r in new}
    return [r for r in old if r["label"] not in labels] + new


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--full", action="store_true")
    p.add_argument("--case", default=None, help="one config name")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--fake", action="store_true")
    p.add_argument("--reshard", type=int, default=None, help="with --case: an int reshard")
    p.add_argument("--json", default=str(DEFAULT_JSON))
    p.add_argument("--plot", action="store_true", help="write docs/planning_accuracy.png")
    p.add_argument(
        "--merge", action="store_true", help="merge the rows into --json's (same case: replaced)"
    )
    p.add_argument(
        "--drop", default=None, help="with --merge: case labels to remove, ';'-separated"
    )
    p.add_argument("--replot", action="store_true", help="only draw the PNG from --json")
    args = p.parse_args(argv)
    if args.replot:
        plot(
            json.loads(Path(args.json).read_text())["rows"], REPO / "docs" / "planning_accuracy.png"
        )
        return 0
    if args.case:
        cases = [Case(args.case, args.world, args.fake, reshard=args.reshard)]
    elif args.full:
        cases = full_cases()
    else:
        cases = quick_cases()
    rows = []
    started = time.perf_counter()
    for case in cases:
        t0 = time.perf_counter()
        row = run(case)
        rows.append(row)
        print(
            f"[plan_accuracy] {case.label}: measured {row['measured_peak'] / 2**20:.2f} MiB, "
            f"predicted {row['predicted_peak'] / 2**20:.2f} MiB, ratio {row['ratio']:.3f}, "
            f"collectives {'exact' if row['collectives_exact'] else 'DIFFER'} "
            f"({time.perf_counter() - t0:.1f}s)",
            flush=True,
        )
    print(table(rows))
    worst = max(abs(r["ratio"] - 1) for r in rows)
    print(
        f"worst |predicted / measured - 1| = {worst:.3f} over {len(rows)} cases, "
        f"{time.perf_counter() - started:.0f}s"
    )
    if args.merge and Path(args.json).exists():
        dropped = set((args.drop or "").split(";"))
        old = [
            r for r in json.loads(Path(args.json).read_text())["rows"] if r["label"] not in dropped
        ]
        rows = merge_rows(old, rows)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"rows": rows, "torch": torch.__version__}, indent=1))
    if args.plot:
        plot(rows, REPO / "docs" / "planning_accuracy.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
