"""Side-by-side benchmark of ``fsdp2.fully_shard`` against ``torch.distributed.fsdp.fully_shard``.

Both implementations (and a non-sharded copy of the same model) live in the same process(es),
are built from the same initial weights, and are stepped in alternation so that machine noise
hits all of them equally. See docs/benchmarks.md for how every figure is computed.

Examples::

    python benchmarks/compare.py --quick                       # smoke run, < 1 minute
    python benchmarks/compare.py --all-configs --world-size 2  # full run, ~10 minutes on 2 cores
    python benchmarks/compare.py --config small-many --fake-world-size 64,256,1024 --plot
    python benchmarks/compare.py --impls torch,torch#2         # instrument self-check
    python benchmarks/compare.py --config small-many --trace    # + fsdp2 under its schedule trace
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import gc
import json
import os
import shlex
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.analysis import PLAIN, sum_local, summarize  # noqa: E402
from benchmarks.comm import CollectiveCounter  # noqa: E402
from benchmarks.configs import (  # noqa: E402
    CONFIGS,
    BenchConfig,
    default_config_names,
    load_impl,
    quick_version,
    shard_kwargs,
)
from benchmarks.memory import StepProbe, reachable_tensors  # noqa: E402
from benchmarks.meta import host_info, sources  # noqa: E402
from examples.llama import ModelArgs, Transformer, loss_fn, parallelize  # noqa: E402

DEFAULT_JSON = REPO / "benchmarks" / "results" / "latest.json"


# --------------------------------------------------------------------------- run spec
@dataclass
class RunSpec:
    """Everything a rank needs; pickled to the spawned workers."""

    configs: list[dict[str, Any]]
    impls: list[str]
    world_size: int
    fake: bool
    device: str
    batch: int
    seq: int
    steps: int
    warmup: int
    ttfs_repeats: int
    threads: int
    seed: int
    barrier: bool
    init_file: str
    out_file: str
    pg_timeout_s: int
    memory: bool = True
    gc_collect: bool = True
    foreach: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Variant:
    label: str
    sharded: bool
    model: nn.Module | None = None
    opt: torch.optim.Optimizer | None = None
    error: dict[str, str] | None = None
    trace: Any = None  # a "+trace" variant's open (trace_schedule context, ScheduleTrace)
    steps: list[dict[str, float]] = field(default_factory=list)
    warmup: list[dict[str, float]] = field(default_factory=list)
    result: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None


# --------------------------------------------------------------------------- timing
class Clock:
    """perf_counter on CPU; CUDA events (resolved at the end of the step) on GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def seconds(self, a: Any, b: Any) -> float:
        if self.cuda:
            return a.elapsed_time(b) / 1e3
        return b - a

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def train_step(
    v: Variant,
    microbatches: list[torch.Tensor],
    clock: Clock,
    probe: StepProbe | None = None,
    before_zero_grad: Any = None,
) -> dict[str, float]:
    """One optimizer step (forward+backward per microbatch, then step + zero_grad)."""
    model, opt = v.model, v.opt
    assert model is not None and opt is not None
    n = len(microbatches)
    marks: list[tuple[str, Any, Any]] = []
    for i, tokens in enumerate(microbatches):
        if v.sharded and n > 1:
            model.set_requires_gradient_sync(i == n - 1)  # type: ignore[operator]
        if probe is not None:
            probe.phase = "fwd"
        t0 = clock.mark()
        loss = loss_fn(model(tokens), tokens)
        if n > 1:
            loss = loss / n
        t1 = clock.mark()
        if probe is not None:
            probe.phase = "bwd"
        loss.backward()
        t2 = clock.mark()
        marks += [("fwd", t0, t1), ("bwd", t1, t2)]
        del loss
    if probe is not None:
        probe.phase = "opt"
    t3 = clock.mark()
    opt.step()
    if before_zero_grad is not None:
        before_zero_grad()
    opt.zero_grad(set_to_none=True)
    t4 = clock.mark()
    marks.append(("opt", t3, t4))
    clock.sync()
    out = {"fwd": 0.0, "bwd": 0.0, "opt": 0.0}
    for name, a, b in marks:
        out[name] += clock.seconds(a, b)
    out["step"] = out["fwd"] + out["bwd"] + out["opt"]
    return out


# --------------------------------------------------------------------------- helpers
def _err(exc: BaseException, stage: str) -> dict[str, str]:
    return {
        "stage": stage,
        "error": f"{type(exc).__name__}: {exc}",
        "traceback": traceback.format_exc(limit=12),
    }


def _agree(ok: bool, spec: RunSpec) -> bool:
    """All real ranks agree on success (one failing rank fails the variant everywhere)."""
    if spec.fake or spec.world_size == 1:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    if spec.device == "cuda":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _barrier(spec: RunSpec) -> None:
    if spec.barrier and not spec.fake and spec.world_size > 1:
        dist.barrier()


def _persistent_tensors(v: Variant) -> dict[str, list[torch.Tensor]]:
    assert v.model is not None and v.opt is not None
    params = list(v.model.parameters())
    state: list[torch.Tensor] = []
    for st in v.opt.state.values():
        state += [t for t in st.values() if isinstance(t, torch.Tensor)]
    return {
        "params": params,
        "grads": [p.grad for p in params if p.grad is not None],
        "optim_state": state,
        "buffers": list(v.model.buffers()),
    }


# --------------------------------------------------------------------------- per config
class ConfigRun:
    def __init__(self, cfg: BenchConfig, spec: RunSpec, rank: int, device: torch.device) -> None:
        self.cfg, self.spec, self.rank, self.device = cfg, spec, rank, device
        self.clock = Clock(device)
        self.world = spec.world_size
        self.batch = cfg.batch or spec.batch
        self.seq = cfg.seq or spec.seq
        args = ModelArgs(
            vocab_size=cfg.vocab_size,
            dim=cfg.dim,
            n_layers=cfg.n_layers,
            n_heads=cfg.n_heads,
            max_seq_len=max(self.seq, 16),
        )
        torch.manual_seed(spec.seed)
        self.template = Transformer(args)
        self.template.init_weights(spec.seed)
        gen = torch.Generator().manual_seed(spec.seed * 7919 + rank)
        self.batches = [
            [
                torch.randint(0, cfg.vocab_size, (self.batch, self.seq), generator=gen).to(device)
                for _ in range(cfg.grad_accum)
            ]
            for _ in range(4)
        ]
        self.variants = [Variant(PLAIN, sharded=False)] + [
            Variant(label, sharded=True) for label in spec.impls
        ]
        self.variant_labels = [v.label for v in self.variants]
        self.impls: dict[str, Any] = {}
        self.phase_wall: dict[str, float] = {}

    # ---------------------------------------------------------------- building
    def build_plain(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = copy.deepcopy(self.template).to(self.device)
        if self.cfg.mixed_precision:  # compute dtype matches the sharded runs (see README)
            model = model.to(torch.bfloat16)
        return model, self.optimizer(model)

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        # foreach=None: torch's default (single-tensor kernels on CPU, foreach on CUDA).
        return torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=self.spec.foreach)

    def build_sharded(self, label: str) -> tuple[nn.Module, torch.optim.Optimizer, float]:
        impl = self.impls[label]
        model = copy.deepcopy(self.template).to(self.device)
        t0 = time.perf_counter()
        parallelize(model, impl.fully_shard, **shard_kwargs(self.cfg, impl, self.device))
        shard_s = time.perf_counter() - t0
        return model, self.optimizer(model), shard_s

    def guarded(self, v: Variant, stage: str, fn: Any) -> Any:
        """Run ``fn`` for a variant; on error record it. All ranks agree on the outcome."""
        out, ok = None, True
        if v.ok:
            try:
                out = fn()
            except Exception as exc:  # any failure is a result
                v.error, ok = _err(exc, stage), False
        if not _agree(ok and v.ok, self.spec) and v.error is None:
            v.error = {"stage": stage, "error": "failed on another rank", "traceback": ""}
        return out

    def setup(self) -> None:
        for v in self.variants:
            if v.sharded:
                try:
                    self.impls[v.label] = load_impl(v.label)
                except Exception as exc:
                    v.error = _err(exc, "import")

            def build(v: Variant = v) -> None:
                if v.sharded:
                    v.model, v.opt, shard_s = self.build_sharded(v.label)
                    v.result["shard_s"] = shard_s
                    trace_schedule = self.impls[v.label].trace_schedule
                    if trace_schedule is not None:  # every step of it runs traced
                        context = trace_schedule(v.model)
                        v.trace = (context, context.__enter__())
                else:
                    v.model, v.opt = self.build_plain()

            self.guarded(v, "build", build)

    # ---------------------------------------------------------------- phases
    def order(self, r: int) -> list[Variant]:
        k = r % len(self.variants)
        return self.variants[k:] + self.variants[:k]

    def warmup_and_time(self) -> None:
        spec = self.spec
        for r in range(spec.warmup + spec.steps):
            for v in self.order(r):
                batch = self.batches[r % len(self.batches)]
                if spec.gc_collect:
                    gc.collect()  # every variant starts from the same GC state
                _barrier(spec)
                times = self.guarded(v, "step", lambda v=v, b=batch: train_step(v, b, self.clock))
                if times is not None:
                    (v.warmup if r < spec.warmup else v.steps).append(times)

    def _traced(self, v: Variant) -> bool:
        impl = self.impls.get(v.label)
        return impl is not None and impl.trace_schedule is not None

    def end_traces(self) -> None:
        """End the "+trace" variants' traces (every rank together: their records are
        gathered onto rank 0) and keep the exposed communication per step, and on rank 0
        the PNG of the last step when asked (``--trace-png``)."""
        for v in self.variants:
            if v.trace is None:
                continue
            (context, trace), v.trace = v.trace, None

            def end(context: Any = context, trace: Any = trace, v: Variant = v) -> None:
                context.__exit__(None, None, None)
                data = trace.to_dict()
                v.result["trace"] = data["summary"]
                if self.rank == 0:
                    text = trace.summary()
                    v.result["trace"]["text"] = text
                    print(
                        f"[compare] {self.cfg.name} W={self.world} {v.label}:\n{text}", flush=True
                    )
                png = self.spec.extra.get("trace_png")
                first = BenchConfig(**self.spec.configs[0]) == self.cfg
                if png and first and self.rank == 0:
                    Path(png).parent.mkdir(parents=True, exist_ok=True)
                    trace.plot(png)
                    v.result["trace_png"] = png

            self.guarded(v, "trace", end)

    def instrumented_step(self) -> None:
        """One step per variant under the collective counter and the dispatch probe (the
        sharded ones first run one step that times their collective calls alone; a traced
        variant is left out: it is the same implementation)."""
        for r, v in enumerate(self.order(0)):
            if self._traced(v):
                continue
            batch = self.batches[r % len(self.batches)]

            def run(v: Variant = v, batch: list = batch) -> dict[str, Any]:
                assert v.model is not None and v.opt is not None
                if not v.sharded:  # preallocated grads, so activations are measured alone
                    for p in v.model.parameters():
                        p.grad = torch.zeros_like(p)
                result: dict[str, Any] = {}
                if v.sharded:
                    # Time inside the collective calls, in a step of its own: the dispatch
                    # probe below slows the fake process group's collectives down.
                    gc.collect()
                    _barrier(self.spec)
                    with CollectiveCounter() as timer:
                        train_step(v, batch, self.clock)
                    result["collective_time"] = timer.timing()
                pers = _persistent_tensors(v)
                probe = StepProbe(track_memory=self.spec.memory)
                probe.register(pers["params"] + pers["optim_state"] + pers["grads"])
                probe.register(pers["buffers"], persistent=True)
                # Internal buffers the implementation keeps across steps (see README).
                probe.register(reachable_tensors(v.model, v.opt), persistent=True)

                def categorize() -> None:
                    now = _persistent_tensors(v)
                    result["breakdown"] = probe.categorize(
                        now["params"], now["grads"], now["optim_state"]
                    )
                    result["params_bytes"] = sum_local(now["params"])
                    result["grads_bytes"] = sum_local(now["grads"])
                    result["optim_state_bytes"] = sum_local(now["optim_state"])

                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    cuda_start = torch.cuda.memory_allocated()
                gc.collect()
                _barrier(self.spec)
                gc.disable()  # cyclic garbage stays until the step ends: deterministic peaks
                try:
                    with CollectiveCounter() as cc, probe:
                        times = train_step(v, batch, self.clock, probe, before_zero_grad=categorize)
                finally:
                    gc.enable()
                if self.device.type == "cuda":
                    result["cuda_step_growth_bytes"] = (
                        torch.cuda.max_memory_allocated() - cuda_start
                    )
                    result["cuda_peak_bytes"] = result["cuda_step_growth_bytes"] + probe.start_bytes
                probe.close()
                result["instrumented_step_s"] = times["step"]
                result["comm"] = cc.summary()
                result["probe"] = probe.summary()
                return result

            out = self.guarded(v, "instrumented step", run)
            if out is not None:
                v.result["instrumented"] = out

    def time_to_first_step(self) -> None:
        """Fresh model each time: shard, first fwd+bwd (lazy init), second fwd+bwd."""
        spec = self.spec
        for r in range(max(spec.ttfs_repeats, 0)):
            sharded = [v for v in self.order(r) if v.sharded and not self._traced(v)]
            batch = self.batches[0][0]
            for v in sharded:

                def run(v: Variant = v, batch: torch.Tensor = batch) -> dict[str, float]:
                    model = copy.deepcopy(self.template).to(self.device)
                    impl = self.impls[v.label]
                    kw = shard_kwargs(self.cfg, impl, self.device)
                    _barrier(spec)
                    t0 = time.perf_counter()
                    parallelize(model, impl.fully_shard, **kw)
                    t1 = time.perf_counter()
                    out = {"shard_s": t1 - t0}
                    for key in ("first_fwd_bwd_s", "second_fwd_bwd_s"):
                        a = self.clock.mark()
                        loss_fn(model(batch), batch).backward()
                        b = self.clock.mark()
                        self.clock.sync()
                        out[key] = self.clock.seconds(a, b)
                    del model
                    gc.collect()
                    return out

                res = self.guarded(v, "time to first step", run)
                if res is not None:
                    v.result.setdefault("ttfs_runs", []).append(res)

    def raw(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "variants": {
                v.label: {
                    "error": v.error,
                    "steps": v.steps,
                    "warmup": v.warmup,
                    "result": v.result,
                }
                for v in self.variants
            },
        }

    def run(self) -> dict[str, Any] | None:
        for name, fn in (
            ("build", self.setup),
            ("warmup+timed", self.warmup_and_time),
            ("traces", self.end_traces),
            ("instrumented", self.instrumented_step),
            ("time_to_first_step", self.time_to_first_step),
        ):
            t0 = time.perf_counter()
            fn()
            self.phase_wall[name] = time.perf_counter() - t0
        raw = self.raw()
        if self.spec.fake or self.world == 1:
            gathered = [raw]
        else:
            gathered = [None] * self.world  # type: ignore[list-item]
            dist.all_gather_object(gathered, raw)
        for v in self.variants:
            v.model = v.opt = None
        if self.rank != 0:
            return None
        return summarize(
            self.cfg, self.spec, self.template, gathered, self.phase_wall, self.variant_labels
        )


# --------------------------------------------------------------------------- worker
def worker(rank: int, spec: RunSpec) -> None:
    impl_path = spec.extra.get("impl_path")
    if impl_path and sys.path[0] != impl_path:
        sys.path.insert(0, impl_path)  # ahead of this checkout (see --impl-path)
    torch.set_num_threads(spec.threads)
    if spec.fake:
        torch.set_flush_denormal(True)  # fake all-gathers leave garbage in unsharded params
    device = torch.device("cpu")
    if spec.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    timeout = _dt.timedelta(seconds=spec.pg_timeout_s)
    if spec.fake:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group(
            "fake", store=FakeStore(), rank=0, world_size=spec.world_size, timeout=timeout
        )
    else:
        backend = "nccl" if spec.device == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=f"file://{spec.init_file}",
            rank=rank,
            world_size=spec.world_size,
            timeout=timeout,
        )
    try:
        for cdict in spec.configs:
            cfg = BenchConfig(**cdict)
            t0 = time.perf_counter()
            try:
                entry = ConfigRun(cfg, spec, rank, device).run()
            except Exception as exc:  # keep going with the next config
                entry = {"config": cfg.name, "world_size": spec.world_size, "fake": spec.fake}
                entry["fatal"] = _err(exc, "config")
            gc.collect()
            if rank == 0 and entry is not None:
                entry["wall_s"] = time.perf_counter() - t0
                with open(spec.out_file, "a") as f:
                    f.write(json.dumps(entry) + "\n")
                print(
                    f"[compare] {cfg.name} W={spec.world_size} done in {entry['wall_s']:.1f}s",
                    flush=True,
                )
    finally:
        dist.destroy_process_group()


def launch(spec: RunSpec, timeout_s: float) -> tuple[list[dict[str, Any]], str | None]:
    """Spawn the ranks (one process for the fake process group) and collect rank 0's output."""
    import torch.multiprocessing as mp

    nprocs = 1 if spec.fake else spec.world_size
    ctx = mp.start_processes(worker, args=(spec,), nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    failure = None
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                failure = f"timed out after {timeout_s:.0f}s"
                break
    except Exception as exc:  # a crashed rank
        failure = f"{type(exc).__name__}: {exc}"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
                p.join(5)
    entries = []
    if os.path.exists(spec.out_file):
        with open(spec.out_file) as f:
            entries = [json.loads(line) for line in f if line.strip()]
    return entries, failure


# --------------------------------------------------------------------------- CLI
def _ints(s: str | None) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()] if s else []


# The --full plan (the dated report): every config on real ranks and on the fake process group,
# plus a layer-count sweep of the many-small-params model at one fake world size.
FULL_REAL_WORLDS = (2, 4)
FULL_FAKE_WORLDS = (64, 256, 1024)
FULL_LAYER_SWEEP = (4, 16)  # small-many's own 64 layers is the third point
FULL_LAYER_SWEEP_WORLD = 256
FULL_FAKE_SHAPES = ("small-many", "large-few")  # the only configs at the other fake sizes
FULL_STEPS = (5, 2, 2)  # (steps, warmup, time-to-first-step repeats): ~20 min on 2 cores


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--world-size",
        default=None,
        help="real gloo (cpu) / nccl (cuda) ranks, comma list sweeps (default 2; 1 with cuda)",
    )
    p.add_argument(
        "--fake-world-size", default=None, help="fake process group size(s), e.g. 64,256,1024"
    )
    p.add_argument("--config", default=None, help=f"comma list of {', '.join(CONFIGS)}")
    p.add_argument("--all-configs", action="store_true")
    p.add_argument("--impls", default="fsdp2,torch", help="comma list; ratio = first / second")
    p.add_argument("--steps", type=int, default=None, help="measured steps per variant (10)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per variant (3)")
    p.add_argument("--ttfs-repeats", type=int, default=None, help="time-to-first-step repeats (3)")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per microbatch")
    p.add_argument("--seq", type=int, default=None, help="sequence length (64; 32 with --quick)")
    p.add_argument("--layers", default=None, help="override n_layers (comma list sweeps)")
    p.add_argument("--dim", type=int, default=None, help="override model dim")
    p.add_argument("--vocab", type=int, default=None, help="override vocab size")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-barrier", action="store_true", help="no dist.barrier() before each step")
    p.add_argument("--no-memory", action="store_true", help="skip live-memory tracking")
    p.add_argument("--no-gc", action="store_true", help="no gc.collect() before each timed step")
    p.add_argument(
        "--foreach",
        action="store_true",
        help="AdamW(foreach=True) for every variant (default: torch's choice, which is "
        "single-tensor on CPU: one DTensor dispatch per parameter per op)",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: tiny shapes, few steps")
    p.add_argument(
        "--full",
        action="store_true",
        help="the whole comparison: all configs on real ranks "
        f"{','.join(map(str, FULL_REAL_WORLDS))} and on fake {FULL_LAYER_SWEEP_WORLD} (with a "
        f"layer sweep {','.join(map(str, FULL_LAYER_SWEEP))} of small-many), "
        f"{' and '.join(FULL_FAKE_SHAPES)} on fake {','.join(map(str, FULL_FAKE_WORLDS))}; "
        "then --plot and --report",
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="fake-pg sweep for the plots: world sizes (--fake-world-size, default 8,64,256,1024) "
        "at the middle --layers value, and --layers (default 4,16,64) at the second world size",
    )
    p.add_argument(
        "--inprocess",
        action="store_true",
        help="run fake-process-group jobs in this process (no spawn; used by the tests)",
    )
    p.add_argument(
        "--impl-path",
        default=None,
        help="directory put first on sys.path in every rank, e.g. an exported commit "
        "(git archive HEAD fsdp2 | tar -x -C DIR) to benchmark it instead of this checkout",
    )
    p.add_argument("--timeout", type=float, default=3600, help="seconds per world-size launch")
    p.add_argument(
        "--json", default=None, help=f"output JSON (default {DEFAULT_JSON}; sweep.json for --sweep)"
    )
    p.add_argument("--plot", action="store_true", help="also write PNGs (benchmarks/plot.py)")
    p.add_argument(
        "--trace",
        action="store_true",
        help="also step the first implementation under its schedule trace (label "
        "'<impl>+trace', fsdp2 only): its exposed communication per config, the tracing "
        "cost (paired with the untraced steps), and one PNG per world size, "
        "trace_ws<N>.png next to the JSON",
    )
    p.add_argument("--report", action="store_true", help="also write benchmarks/results/<date>.md")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """Fail early, with the reason, on combinations that cannot run here."""
    exclusive = [n for n in ("full", "sweep", "quick") if getattr(args, n)]
    if len(exclusive) > 1:
        raise SystemExit(f"--{' and --'.join(exclusive)} are mutually exclusive")
    if args.inprocess and args.world_size:
        raise SystemExit("--inprocess runs only fake-process-group jobs (--fake-world-size)")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(
                "--device cuda: no CUDA device is visible to torch "
                f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); "
                "run on a GPU machine or use --device cpu"
            )
        if not dist.is_nccl_available():
            raise SystemExit("--device cuda needs NCCL, which this torch build lacks")
        n = torch.cuda.device_count()
        too_big = [w for w in _ints(args.world_size) if w > n]
        if too_big:
            raise SystemExit(f"--world-size {too_big} exceeds the {n} visible CUDA device(s)")
    elif not dist.is_gloo_available() and not args.fake_world_size:
        raise SystemExit("real CPU ranks need the gloo backend, which this torch build lacks")


def plan(args: argparse.Namespace, names: list[str]) -> list[tuple[int, bool, list[dict]]]:
    """Jobs as (world size, fake?, configs); one launch (set of processes) per job."""

    def cfgs(layer_list: list[int | None], which: list[str] = names) -> list[dict[str, Any]]:
        out = []
        for n in which:
            base = quick_version(CONFIGS[n]) if args.quick else CONFIGS[n]
            for nl in layer_list:
                cfg = base.with_overrides(n_layers=nl, dim=args.dim, vocab_size=args.vocab)
                out.append(asdict(cfg))
        return out

    layers: list[int | None] = list(_ints(args.layers)) or [None]
    if args.full:
        jobs = [(w, False, cfgs(layers)) for w in _ints(args.world_size) or FULL_REAL_WORLDS]
        for w in _ints(args.fake_world_size) or FULL_FAKE_WORLDS:
            if w == FULL_LAYER_SWEEP_WORLD:  # every config, and the layer sweep
                configs = cfgs(layers)
                if "small-many" in names:
                    configs = cfgs(list(FULL_LAYER_SWEEP), ["small-many"]) + configs
            else:
                configs = cfgs(layers, [n for n in names if n in FULL_FAKE_SHAPES])
            jobs.append((w, True, configs))
        return jobs
    if args.sweep:
        worlds = _ints(args.fake_world_size) or [8, 64, 256, 1024]
        sweep = _ints(args.layers) or [4, 16, 64]
        mid_l = sweep[len(sweep) // 2]
        mid_w = worlds[min(1, len(worlds) - 1)]
        jobs = []
        for w in worlds:  # world-size sweep at the middle layer count ...
            ls = [mid_l] + ([x for x in sweep if x != mid_l] if w == mid_w else [])
            jobs.append((w, True, cfgs(sorted(ls))))  # ... and a layer sweep at one world size
        return jobs
    jobs = [(w, False, cfgs(layers)) for w in _ints(args.world_size)]
    jobs += [(w, True, cfgs(layers)) for w in _ints(args.fake_world_size)]
    if not jobs:
        jobs = [(1 if args.device == "cuda" else 2, False, cfgs(layers))]
    return jobs


def run_inprocess(spec: RunSpec) -> tuple[list[dict[str, Any]], str | None]:
    """A fake-process-group job in this process (no spawn); torch's global settings restored."""
    threads = torch.get_num_threads()
    try:
        worker(0, spec)
    finally:
        torch.set_num_threads(threads)
        torch.set_flush_denormal(False)
    with open(spec.out_file) as f:
        return [json.loads(line) for line in f if line.strip()], None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_args(args)
    from benchmarks.report import format_entry

    names = (
        default_config_names(args.device)
        if args.all_configs or args.full
        else (args.config or "small-many").split(",")
    )
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown config(s) {unknown}; choose from {list(CONFIGS)}")
    impls = [s.strip() for s in args.impls.split(",") if s.strip()]
    if (args.trace or args.full) and impls and not any(i.endswith("+trace") for i in impls):
        impls.append(impls[0] + "+trace")
    defaults = (3, 1, 1) if args.quick else (FULL_STEPS if args.full else (10, 3, 3))
    steps = args.steps if args.steps is not None else defaults[0]
    warmup = args.warmup if args.warmup is not None else defaults[1]
    ttfs = args.ttfs_repeats if args.ttfs_repeats is not None else defaults[2]
    seq = args.seq or (32 if args.quick else 64)
    jobs = plan(args, names)
    impl_path = str(Path(args.impl_path).resolve()) if args.impl_path else None
    if impl_path and sys.path[0] != impl_path:
        sys.path.insert(0, impl_path)

    meta = {
        "command": "python "
        + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])]),
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "host": host_info(),
        "impls": impls,
        "threads_per_rank": args.threads,
        "barrier_before_step": not args.no_barrier,
        "gc_collect_before_step": not args.no_gc,
        "adamw_foreach": True if args.foreach else None,
        "sources": sources(impls),
        "steps": steps,
        "warmup": warmup,
        "ttfs_repeats": ttfs,
    }
    runs: list[dict[str, Any]] = []
    failures: list[str] = []
    t_all = time.perf_counter()
    out = Path(args.json or (DEFAULT_JSON.with_name("sweep.json") if args.sweep else DEFAULT_JSON))
    for world, fake, configs in jobs:
        extra: dict[str, Any] = {"impl_path": impl_path} if impl_path else {}
        if any(i.endswith("+trace") for i in impls):  # one PNG per world size: its first config
            kind = "fake" if fake else "ws"
            extra["trace_png"] = str(out.with_name(f"trace_{kind}{world}.png"))
        with tempfile.TemporaryDirectory(prefix="fsdp2_bench_") as tmp:
            spec = RunSpec(
                configs=configs,
                impls=impls,
                world_size=world,
                fake=fake,
                device=args.device,
                batch=args.batch,
                seq=seq,
                steps=steps,
                warmup=warmup,
                ttfs_repeats=ttfs,
                threads=args.threads,
                seed=args.seed,
                barrier=not args.no_barrier,
                init_file=os.path.join(tmp, "rdzv"),
                out_file=os.path.join(tmp, "results.jsonl"),
                pg_timeout_s=int(min(args.timeout, 600)),
                memory=not args.no_memory,
                gc_collect=not args.no_gc,
                foreach=True if args.foreach else None,
                extra=extra,
            )
            if args.inprocess and fake:
                entries, failure = run_inprocess(spec)
            else:
                entries, failure = launch(spec, args.timeout)
        kind = "fake" if fake else "real"
        if failure:
            failures.append(f"{kind} world {world}: {failure}")
            print(f"[compare] {kind} world {world}: {failure}", file=sys.stderr)
        for e in entries:
            print(format_entry(e))
            print()
        runs += entries
    meta["wall_s"] = time.perf_counter() - t_all
    if failures:
        meta["failures"] = failures
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    print(f"[compare] wrote {out} ({meta['wall_s']:.0f}s)")
    if args.plot or args.full:
        from benchmarks import plot

        plot.main([str(out)])
    if args.report or args.full:
        from benchmarks import report

        report.main(["--json", str(out)])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
