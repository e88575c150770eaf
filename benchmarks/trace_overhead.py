"""What ``fsdp2.trace_schedule`` costs, on and off, measured so that CPU noise cannot hide it.

Two measurements, on real gloo ranks running one of compare.py's configs:

* **on**: one model, one trace; rounds of two steps, one with the trace's recorder attached
  and one without (the runtime's off path: ``comm.recorder is None``), in alternating
  order, so both see the same noise. Reported: the median per-round ratio of the two step
  times, and the time spent inside the recorder's methods per traced step (timed around
  each call) over the untraced step time: the cost itself, which noise does not inflate.
* **off**: Python function calls per untraced step (``sys.setprofile``; deterministic),
  for this checkout and, with ``--impl-path``, for another (e.g. the commit before the
  trace: ``git archive <commit> fsdp2 | tar -x -C DIR``). Equal counts mean the off path
  adds no calls, only attribute checks.

    python benchmarks/trace_overhead.py --config small-many --rounds 30
    python benchmarks/trace_overhead.py --config small-many --calls-only --impl-path /tmp/base
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

RECORDER_CALLS = (
    "issuing",
    "issued",
    "waiting",
    "waited",
    "consumed",
    "compute_begins",
    "compute_ends",
    "root_forward_begins",
    "final_wait_begins",
    "final_wait_ends",
    "optimizer_begins",
    "optimizer_ends",
)


def _model(args: argparse.Namespace) -> tuple[Any, Any, list[Any]]:
    import torch

    from benchmarks.configs import CONFIGS, load_impl, shard_kwargs
    from examples.llama import ModelArgs, Transformer, parallelize

    cfg = CONFIGS[args.config]
    impl = load_impl("fsdp2")
    torch.manual_seed(0)
    model = Transformer(
        ModelArgs(
            vocab_size=cfg.vocab_size,
            dim=cfg.dim,
            n_layers=cfg.n_layers,
            n_heads=cfg.n_heads,
            max_seq_len=args.seq,
        )
    )
    parallelize(model, impl.fully_shard, **shard_kwargs(cfg, impl, torch.device("cpu")))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    batch = cfg.batch or args.batch
    tokens = [torch.randint(0, cfg.vocab_size, (batch, args.seq), generator=gen) for _ in range(2)]
    return model, optim, tokens


def _step(model: Any, optim: Any, tokens: Any) -> float:
    import torch.distributed as dist

    from examples.llama import loss_fn

    dist.barrier()
    start = time.perf_counter()
    loss_fn(model(tokens), tokens).backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def _calls_per_step(model: Any, optim: Any, tokens: Any) -> dict[str, int]:
    """Calls in one step on this thread: of fsdp2's own Python functions, and of all."""
    import fsdp2

    package = str(Path(fsdp2.__file__).parent)
    counts = {"fsdp2": 0, "all": 0}

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            counts["all"] += 1
            if event == "call" and frame.f_code.co_filename.startswith(package):
                counts["fsdp2"] += 1

    sys.setprofile(profile)
    try:
        _step(model, optim, tokens)
    finally:
        sys.setprofile(None)
    return counts


def _timed(recorder: Any, spent: list[float]) -> None:
    """Time every recorder call (the wrapper's own cost counts too: conservative)."""
    for name in RECORDER_CALLS:
        method = getattr(recorder, name)

        def timed(*a: Any, _method: Any = method) -> Any:
            start = time.perf_counter()
            try:
                return _method(*a)
            finally:
                spent[0] += time.perf_counter() - start

        setattr(recorder, name, timed)


def worker(rank: int, args: argparse.Namespace, init: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    if args.impl_path:
        sys.path.insert(0, args.impl_path)
    sys.path.insert(1, str(REPO))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank,
                            world_size=args.world_size)  # fmt: skip
    import fsdp2

    model, optim, tokens = _model(args)
    result: dict[str, Any] = {"fsdp2": fsdp2.__file__}
    for i in range(3):  # warm-up (lazy init, allocator, first gathers)
        _step(model, optim, tokens[i % 2])
    result["calls_per_untraced_step"] = _calls_per_step(model, optim, tokens[0])
    if not args.calls_only and hasattr(fsdp2, "trace_schedule"):
        spent = [0.0]
        with fsdp2.trace_schedule(model):
            comm = model._fsdp_state.tree.comm
            recorder = comm.recorder
            _timed(recorder, spent)
            on, off, inside = [], [], []
            for r in range(args.rounds):
                order = (True, False) if r % 2 == 0 else (False, True)
                for traced in order:
                    comm.recorder = recorder if traced else None
                    spent[0] = 0.0
                    seconds = _step(model, optim, tokens[r % 2])
                    (on if traced else off).append(seconds)
                    if traced:
                        inside.append(spent[0])
            comm.recorder = recorder
        ratios = [a / b for a, b in zip(on, off)]
        result.update(
            rounds=args.rounds,
            traced_step_s=statistics.median(on),
            untraced_step_s=statistics.median(off),
            paired_ratio_median=statistics.median(ratios),
            paired_ratio_quartiles=statistics.quantiles(ratios, n=4),
            recorder_s_per_step=statistics.median(inside),
            recorder_share_of_step=statistics.median(inside) / statistics.median(off),
        )
    gathered: list[Any] = [None] * args.world_size
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="small-many")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--calls-only", action="store_true", help="only count calls per step")
    p.add_argument("--impl-path", default=None, help="directory with another fsdp2 to measure")
    args = p.parse_args(argv)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(worker, args=(args, os.path.join(tmp, "init"), out), nprocs=args.world_size)
        results = json.loads(Path(out).read_text())
    print(json.dumps({"config": args.config, "world_size": args.world_size, "ranks": results},
                     indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
