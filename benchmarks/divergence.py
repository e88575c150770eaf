"""What fsdp2's divergence checks cost: step time and bytes, checks on and off, side by side
with torch's ``fully_shard`` in the same run.

Three models built from the same weights on the same ranks (real gloo ranks, or one
process on torch's fake process group, or NCCL on GPUs): fsdp2 with its divergence checks
(the default), the same fsdp2 code with ``fsdp2.set_divergence_checks(False)`` around its
steps, and torch's ``fully_shard``. Rounds of one step of each, in rotating order, so all
three see the same machine noise. Reported, per rank:

* the median over rounds of the per-round step-time ratios on/off, on/torch and off/torch
  (with quartiles): the checks' cost is on/off; and of the CPU time this process spent
  per step (all its threads), on/off, which other processes' load disturbs less;
* every collective of one step of each fsdp2 variant, intercepted at ``torch.distributed``:
  the per-rank message (an all-gather's input, a reduce-scatter's output chunk, an
  all-reduce's tensor, an all-to-all's chunk per peer) on and off, paired in issue order
  (the checks issue the same collectives), and the largest and mean difference in bytes,
  which the issue bounds at 64 per collective;
* the CPU time spent in the checks' own code per checked step (every function that
  builds, writes or reads a fingerprint, timed around each call with the thread's CPU
  clock; the wrappers' own cost counts too, so this bounds the cost from above), over the
  unchecked step's CPU time: the cost itself, which other processes' load does not
  inflate;
* the host's waits for the device in the optimizer step's pre-hook (accelerators only:
  ``fsdp2._fingerprints.host_waits``).

    python benchmarks/divergence.py --config small-many --world-size 2 --rounds 30
    python benchmarks/divergence.py --config large-few --world-size 2 --rounds 10
    python benchmarks/divergence.py --device cuda --config gpu-1b --fake-world-size 8
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

COLLECTIVES = {
    "all_gather_single": "all-gather",
    "all_gather_into_tensor": "all-gather",
    "reduce_scatter_single": "reduce-scatter",
    "reduce_scatter_tensor": "reduce-scatter",
    "all_reduce": "all-reduce",
    "all_to_all_single": "all-to-all",
}


@contextlib.contextmanager
def _messages(log: list[tuple[str, int]]) -> Iterator[None]:
    """Record (kind, per-rank message bytes) of every collective issued in the block."""
    import torch
    import torch.distributed as dist

    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def wrap(name: str, fn: Any) -> Any:
        kind = COLLECTIVES[name]

        def recorded(*args: Any, **kwargs: Any) -> Any:
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            group = kwargs.get("group")
            ranks = dist.get_world_size(group)
            if kind == "all-reduce":
                nbytes = tensors[0].numel() * tensors[0].element_size()
            elif kind == "all-gather":  # (output, input): the input is one rank's message
                nbytes = tensors[1].numel() * tensors[1].element_size()
            elif kind == "reduce-scatter":  # (output, input): the output is one rank's chunk
                nbytes = tensors[0].numel() * tensors[0].element_size()
            else:  # all-to-all (output, input): one chunk per peer
                nbytes = tensors[1].numel() * tensors[1].element_size() // ranks
            log.append((kind, nbytes))
            return fn(*args, **kwargs)

        return recorded

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


# The checks' own code, as the runtime calls it (module, attribute): what ``--inside``
# times. The waits are not in it: a collective takes as long with or without the checks.
CHECK_CODE = [
    ("fsdp2._all_gather", "write_tail"),
    ("fsdp2._all_gather", "GatheredTails"),
    ("fsdp2._all_gather", "_with_room"),
    ("fsdp2._grad_pack", "block_tensor"),
    ("fsdp2._grad_reduce", "summed_block_check"),
    ("fsdp2._replica_sum", "block_tensor"),
    ("fsdp2._replica_sum", "summed_block_check"),
    ("fsdp2._reduction", "ExchangedBlocks"),
    ("fsdp2._reduction", "block_tensor"),
    ("fsdp2._reduction", "write_tail"),
    ("fsdp2._reduction", "GatheredTails"),
    ("fsdp2._comm_context", "Fingerprint"),
    ("fsdp2._comm_context", "Issued"),
    ("fsdp2._comm_context", "remember"),
    ("fsdp2._fingerprints.GatheredTails", "verify"),
    ("fsdp2._fingerprints.SummedBlock", "verify"),
    ("fsdp2._fingerprints.ExchangedBlocks", "verify"),
]


@contextlib.contextmanager
def _timing_checks(spent: list[float]) -> Iterator[None]:
    """Add the time of every call of ``CHECK_CODE`` to ``spent[0]`` in the block."""
    import importlib

    saved = []
    for where, name in CHECK_CODE:
        path = where.split(".")
        owner: Any = importlib.import_module(".".join(path[:2]))
        for part in path[2:]:
            owner = getattr(owner, part)
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)

        def timed(*a: Any, _f: Any = original, **k: Any) -> Any:
            start = time.thread_time()
            try:
                return _f(*a, **k)
            finally:
                spent[0] += time.thread_time() - start

        saved.append((owner, name, original))
        setattr(owner, name, timed)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def _models(args: argparse.Namespace, device: Any) -> tuple[dict[str, Any], list[Any]]:
    import torch
    import torch.distributed as dist

    from benchmarks.configs import CONFIGS, load_impl, shard_kwargs
    from examples.llama import ModelArgs, Transformer, parallelize

    cfg = CONFIGS[args.config].with_overrides(n_layers=args.layers, dim=args.dim)
    seq = cfg.seq or args.seq
    torch.manual_seed(0)
    with torch.device(device):
        template = Transformer(
            ModelArgs(
                vocab_size=cfg.vocab_size,
                dim=cfg.dim,
                n_layers=cfg.n_layers,
                n_heads=cfg.n_heads,
                max_seq_len=seq,
            )
        )
    models = {}
    for label, impl_name in (("on", "fsdp2"), ("off", "fsdp2"), ("torch", "torch")):
        impl = load_impl(impl_name)
        model = copy.deepcopy(template)
        parallelize(model, impl.fully_shard, **shard_kwargs(cfg, impl, device))
        models[label] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    del template
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    batch = cfg.batch or args.batch
    tokens = [
        torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen).to(device) for _ in range(2)
    ]
    return models, tokens


def _step(label: str, model: Any, optim: Any, tokens: Any, device: Any) -> tuple[float, float]:
    import torch
    import torch.distributed as dist

    import fsdp2
    from examples.llama import loss_fn

    if label != "torch":
        fsdp2.set_divergence_checks(label == "on")
    if dist.get_world_size() > 1 and dist.get_backend() != "fake":
        dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start, cpu_start = time.perf_counter(), time.process_time()
    loss_fn(model(tokens), tokens).backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    fsdp2.set_divergence_checks(True)
    return seconds, cpu


def _bytes(on: list[tuple[str, int]], off: list[tuple[str, int]]) -> dict[str, Any]:
    """Per kind: collectives, message bytes off and on, and the differences, paired."""
    if [k for k, _ in on] != [k for k, _ in off]:
        return {"error": "the checks changed the collectives issued", "on": on, "off": off}
    by_kind: dict[str, dict[str, Any]] = collections.defaultdict(
        lambda: {"count": 0, "bytes_off": 0, "bytes_on": 0, "max_added": 0}
    )
    for (kind, b_on), (_, b_off) in zip(on, off, strict=True):
        entry = by_kind[kind]
        entry["count"] += 1
        entry["bytes_off"] += b_off
        entry["bytes_on"] += b_on
        entry["max_added"] = max(entry["max_added"], b_on - b_off)
    added = [b_on - b_off for (_, b_on), (_, b_off) in zip(on, off, strict=True)]
    return {
        "by_kind": dict(by_kind),
        "collectives": len(on),
        "max_added_per_collective": max(added, default=0),
        "mean_added_per_collective": statistics.mean(added) if added else 0,
        "total_off": sum(b for _, b in off),
        "total_on": sum(b for _, b in on),
    }


def measure(args: argparse.Namespace, device: Any) -> dict[str, Any]:
    import torch.distributed as dist

    import fsdp2._fingerprints as fingerprints

    models, tokens = _models(args, device)
    for r in range(args.warmup):  # lazy init, allocator, first gathers
        for label, (model, optim) in models.items():
            _step(label, model, optim, tokens[r % 2], device)
    logs: dict[str, list[tuple[str, int]]] = {}
    for label in ("on", "off"):
        model, optim = models[label]
        logs[label] = []
        with _messages(logs[label]):
            _step(label, model, optim, tokens[0], device)
    times: dict[str, list[float]] = {label: [] for label in models}
    cpu: dict[str, list[float]] = {label: [] for label in models}  # this process's CPU time
    waits_before = fingerprints.host_waits
    labels = list(models)
    for r in range(args.rounds):
        for label in labels[r % 3 :] + labels[: r % 3]:
            model, optim = models[label]
            seconds, cpu_seconds = _step(label, model, optim, tokens[r % 2], device)
            times[label].append(seconds)
            cpu[label].append(cpu_seconds)
    inside = []
    for r in range(args.inside_steps):  # the checks' own code, timed call by call
        spent = [0.0]
        model, optim = models["on"]
        with _timing_checks(spent):
            _step("on", model, optim, tokens[r % 2], device)
        inside.append(spent[0])

    def ratio(a: str, b: str, of: dict[str, list[float]] = times) -> dict[str, Any]:
        ratios = [x / y for x, y in zip(of[a], of[b], strict=True)]
        return {"median": statistics.median(ratios), "quartiles": statistics.quantiles(ratios, n=4)}

    return {
        "rank": dist.get_rank(),
        "step_s": {label: statistics.median(t) for label, t in times.items()},
        "on/off": ratio("on", "off"),
        "cpu_s": {label: statistics.median(t) for label, t in cpu.items()},
        "cpu on/off": ratio("on", "off", cpu),
        "on/torch": ratio("on", "torch"),
        "off/torch": ratio("off", "torch"),
        "bytes": _bytes(logs["on"], logs["off"]),
        "checks_s_per_step": statistics.median(inside) if inside else None,
        "checks_share_of_step": (
            statistics.median(inside) / statistics.median(cpu["off"]) if inside else None
        ),
        "host_waits_per_checked_step": (fingerprints.host_waits - waits_before) / args.rounds,
    }


def worker(rank: int, args: argparse.Namespace, init: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO))
    torch.set_num_threads(args.threads)
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, init_method=f"file://{init}", rank=rank,
                            world_size=args.world_size)  # fmt: skip
    result = measure(args, device)
    gathered: list[Any] = [None] * args.world_size
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def fake(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One process as rank 0 of ``--fake-world-size`` ranks (torch's fake process group:
    collectives do not communicate, every rank's part of a result is this rank's)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    sys.path.insert(0, str(REPO))
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.fake_world_size)
    try:
        return [measure(args, device)]
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="small-many")
    p.add_argument("--layers", type=int, default=None, help="override the config's layers")
    p.add_argument("--dim", type=int, default=None, help="override the config's width")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--fake-world-size", type=int, default=0, help="one process, fake group")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--inside-steps", type=int, default=5, help="steps with the checks timed")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is visible to torch")
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    if args.fake_world_size:
        results = fake(args)
        ranks = args.fake_world_size
    else:
        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "out.json")
            mp.spawn(worker, args=(args, os.path.join(tmp, "init"), out), nprocs=args.world_size)
            results = json.loads(Path(out).read_text())
        ranks = args.world_size
    report = {"config": args.config, "world_size": ranks, "device": args.device,
              "fake": bool(args.fake_world_size), "rounds": args.rounds, "ranks": results}  # fmt: skip
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
