"""``optimizer.step()`` and gradient clipping, fsdp2 side by side with torch's ``fully_shard``.

The step's cost does not depend on the other ranks (no collective in an elementwise step;
one all-reduce in a clip), so every variant runs in one process on torch's fake process
group of ``--world-size`` ranks: each holds that rank's shards, as on a real run. Variants
are built from one template (``examples/llama.py``, the configs of ``benchmarks/configs.py``),
get their gradients from one real backward and then fixed random values (the same for
every variant, so no denormals and no dependence on the fake collectives' output), and are
timed in alternation, rotating which goes first:

* ``fsdp2``: fsdp2's parameters, the optimizer fast path on (the default);
* ``fsdp2-dtensor``: the same with ``fsdp2.set_optimizer_fast_path(False)``: the step on
  ``DTensor``s, as torch's (the fast path's own effect, on the same runtime);
* ``torch``: ``torch.distributed.fsdp.fully_shard``;
* ``plain``: the same optimizer (or torch's ``clip_grad_norm_``) on plain tensors holding
  fsdp2's local shards and gradients: no ``DTensor``, no fsdp2, no communication. No
  implementation on those shards goes below it (the floor);
* ``flat`` (steps only, in a round of its own against ``torch`` again, so that the main
  round's variants find the caches as before): the same optimizer on one plain tensor per
  fsdp2 group, holding that group's local shards back to back (and its gradients alike):
  the fewest, largest kernels torch's optimizers can be given. It is not bitwise what the
  step on the parameters computes (``benchmarks/flat_step.py``), so the fast path does not
  do it; it is here as a bound: a target below ``flat / torch`` is out of reach of any
  step that uses torch's optimizer kernels on this machine, bitwise or not.

``step`` times ``optimizer.step()`` (AdamW, lr 1e-3); ``clip`` times
``clip_grad_norm_(model.parameters(), max_norm)`` followed by reading the total norm as
a plain tensor (``fsdp2.clip_grad_norm_`` returns one; torch's returns a partial
``DTensor``, made whole with ``full_tensor()`` as torchtitan does). In ``clip``,
``max_norm`` is large, so gradients keep their values (torch still multiplies them by 1;
fsdp2 skips that when the total is on the CPU); in ``clip, scaling`` every call halves
them (``max_norm`` is half the norm the previous call left), so every implementation
scales. Times are this thread's CPU time by default (``--clock thread``: one thread, no
real communication, so it is the step's cost, and other processes on a shared machine do
not stretch it); with ``--device cuda``, wall time between synchronizations. Ratios are
medians, fsdp2 over torch. Examples::

    python benchmarks/optimizer.py                                # small-many, large-few
    python benchmarks/optimizer.py --config small-many --world-size 256 --repeats 30
    python benchmarks/optimizer.py --device cuda --world-size 8   # on a GPU (CUDA tensors)
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import fsdp2  # noqa: E402
from benchmarks.configs import CONFIGS, BenchConfig  # noqa: E402
from benchmarks.meta import host_info, sources  # noqa: E402
from examples.llama import ModelArgs, Transformer, loss_fn, parallelize  # noqa: E402

VARIANTS = ("fsdp2", "fsdp2-dtensor", "torch", "plain")
CLIP_VARIANTS = ("fsdp2", "torch", "plain")
# The flat bound is timed in a round of its own, against torch's step again: one more
# variant in the main round would change what the others find in the caches.
BOUND_VARIANTS = ("torch", "flat")
IMPLEMENTATIONS = {"for-loop": False, "foreach": True}


def _model(variant: str, template: nn.Module) -> nn.Module:
    model = copy.deepcopy(template)
    if variant == "plain":
        return model  # its parameters become plain copies of the shards in _plain_shards
    if variant == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        fully_shard = fsdp2.fully_shard
    parallelize(model, fully_shard)  # type: ignore[arg-type]
    return model


def _gradients(model: nn.Module, tokens: torch.Tensor, seed: int) -> None:
    """A real backward (the implementation's own gradient objects), then the same random
    values for every variant."""
    loss_fn(model(tokens), tokens).backward()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            local = param.grad.to_local()
            local.copy_(torch.randn(local.shape, generator=generator, dtype=local.dtype))


def _plain_shards(model: nn.Module, template: nn.Module, tokens: torch.Tensor) -> nn.Module:
    """``template``'s parameters replaced by plain tensors holding an fsdp2 model's local
    shards and gradients (the floor: the same kernels, no ``DTensor`` and no fsdp2)."""
    sharded = _variant("fsdp2", template, tokens)
    for (name, _), param in zip(list(model.named_parameters()), sharded.parameters()):
        module_name, _, attribute = name.rpartition(".")
        plain = nn.Parameter(param.to_local().clone())
        plain.grad = param.grad.to_local().clone()
        setattr(model.get_submodule(module_name), attribute, plain)
    return model


def _flat_shards(template: nn.Module, tokens: torch.Tensor) -> nn.Module:
    """One plain parameter per fsdp2 group holding the group's local shards back to back
    (the parameters each ``fully_shard`` module manages), with its gradients alike."""
    sharded = _variant("fsdp2", template, tokens)
    seen: set[int] = set()
    flat = nn.ParameterList()
    sharded_modules = [m for m in sharded.modules() if isinstance(m, fsdp2.FSDPModule)]
    for module in reversed(sharded_modules):  # inner modules first: the root takes the rest
        params = [p for p in module.parameters() if id(p) not in seen]
        seen.update(map(id, params))
        if not params:
            continue
        plain = nn.Parameter(torch.cat([p.to_local().detach().reshape(-1) for p in params]))
        plain.grad = torch.cat([p.grad.to_local().reshape(-1) for p in params])
        flat.append(plain)
    return flat


def _step_timer(model: nn.Module, foreach: bool, fast: bool) -> Any:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)

    def step() -> None:
        # The model too must stay alive: the parameters of a collected fsdp2 model are
        # no longer fsdp2's, and step on DTensors.
        assert model is not None
        fsdp2.set_optimizer_fast_path(fast)
        optimizer.step()

    return step


def _clip_timer(model: nn.Module, variant: str, scaling: bool) -> Any:
    params = list(model.parameters())
    # With ``scaling``, each call clips to half the norm the previous one left.
    max_norm = [float(fsdp2.get_total_norm([p.grad for p in params])) if scaling else 1e9]

    def clip() -> None:
        assert model is not None  # alive, as in _step_timer
        if scaling:
            max_norm[0] *= 0.5
        if variant in ("torch", "plain"):
            total = torch.nn.utils.clip_grad_norm_(params, max_norm[0])
            if hasattr(total, "full_tensor"):
                total.full_tensor()
        else:
            fsdp2.clip_grad_norm_(params, max_norm[0])

    return clip


# thread: this thread's CPU time (the default: on a shared machine, other processes'
# load stretches wall time, not the CPU time a single-threaded step takes); wall: elapsed.
CLOCKS = {"thread": time.thread_time, "wall": time.perf_counter}
_synchronize: Any = lambda: None  # noqa: E731  (torch.cuda.synchronize with --device cuda)


def _time(
    calls: dict[str, Any], repeats: int, warmup: int, clock: str = "thread"
) -> dict[str, list[float]]:
    """Median-ready wall times per variant, in alternation (rotating the first)."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for r in range(warmup + repeats):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            gc.collect()
            _synchronize()
            start = CLOCKS[clock]()
            calls[name]()
            _synchronize()
            elapsed = CLOCKS[clock]() - start
            if r >= warmup:
                times[name].append(elapsed)
    return times


def _variant(variant: str, template: nn.Module, tokens: torch.Tensor) -> nn.Module:
    if variant == "flat":
        return _flat_shards(template, tokens)
    model = _model(variant, template)
    if variant == "plain":
        return _plain_shards(model, template, tokens)
    _gradients(model, tokens, seed=1)
    return model


def run_config(
    cfg: BenchConfig,
    repeats: int,
    warmup: int,
    batch: int,
    seq: int,
    clock: str = "thread",
    device: torch.device | None = None,
) -> dict:
    args = ModelArgs(
        vocab_size=cfg.vocab_size, dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads
    )
    torch.manual_seed(0)
    template = Transformer(args)
    template.init_weights(0)
    tokens = torch.randint(0, cfg.vocab_size, (cfg.batch or batch, cfg.seq or seq))
    if device is not None:
        template, tokens = template.to(device), tokens.to(device)
    result: dict[str, Any] = {
        "config": cfg.name,
        "parameters": sum(p.numel() for p in template.parameters()),
        "tensors": len(list(template.parameters())),
    }
    for impl, foreach in IMPLEMENTATIONS.items():
        steps = {}
        for variant in VARIANTS:
            model = _variant(variant, template, tokens)
            steps[variant] = _step_timer(model, foreach, fast=variant == "fsdp2")
        times = _time(steps, repeats, warmup, clock)
        fsdp2.set_optimizer_fast_path(True)
        result[f"step {impl}"] = {v: statistics.median(t) for v, t in times.items()}
        bound = {}
        for variant in BOUND_VARIANTS:
            model = _variant(variant, template, tokens)
            bound[variant] = _step_timer(model, foreach, fast=False)
        times = _time(bound, repeats, warmup, clock)
        fsdp2.set_optimizer_fast_path(True)
        result[f"step {impl}, flat bound"] = {v: statistics.median(t) for v, t in times.items()}
    for what, scaling in (("clip", False), ("clip, scaling", True)):
        clips = {}
        for variant in CLIP_VARIANTS:
            clips[variant] = _clip_timer(_variant(variant, template, tokens), variant, scaling)
        times = _time(clips, repeats, warmup, clock)
        result[what] = {v: statistics.median(t) for v, t in times.items()}
    return result


def _table(results: list[dict], world_size: int, clock: str, device: str = "cpu") -> str:
    lines = [
        f"fake process group, {world_size} ranks, {device} tensors; median ms per call "
        f"({clock} clock); "
        f"ratios over torch's (the flat bound over torch's of its own round)",
        "",
        "| config | what | fsdp2 | fsdp2, fast path off | torch | plain shards | flat | "
        "**fsdp2 / torch** | off / torch | plain / torch (floor) | flat / torch (bound) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for res in results:
        for what in ("step for-loop", "step foreach", "clip", "clip, scaling"):
            t = {v: seconds * 1e3 for v, seconds in res[what].items()}
            theirs = t["torch"]
            cells = [f"{t[v]:.2f}" if v in t else "-" for v in VARIANTS]
            ratios = [f"{t[v] / theirs:.2f}" if v in t else "-" for v in VARIANTS if v != "torch"]
            ratios[0] = f"**{ratios[0]}**"
            bound = {v: seconds * 1e3 for v, seconds in res.get(f"{what}, flat bound", {}).items()}
            if bound:
                cells.append(f"{bound['flat']:.2f}")
                ratios.append(f"{bound['flat'] / bound['torch']:.2f}")
            else:
                cells.append("-")
                ratios.append("-")
            lines.append(f"| {res['config']} | {what} | {' | '.join(cells + ratios)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="small-many,large-few")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--layers", type=int, default=None, help="override n_layers")
    parser.add_argument("--dim", type=int, default=None, help="override the model dim")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="thread")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is visible to torch")
        global _synchronize
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
        args.clock, _synchronize = "wall", torch.cuda.synchronize  # kernels run async
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    try:
        results = [
            run_config(
                CONFIGS[name].with_overrides(n_layers=args.layers, dim=args.dim),
                args.repeats,
                args.warmup,
                args.batch,
                args.seq,
                args.clock,
                device,
            )
            for name in args.config.split(",")
        ]
    finally:
        dist.destroy_process_group()
    print(_table(results, args.world_size, args.clock, str(device)))
    out = {
        "device": str(device),
        "world_size": args.world_size,
        "threads": args.threads,
        "clock": args.clock,
        "repeats": args.repeats,
        "results": results,
        "meta": {"host": host_info(), "sources": sources(["fsdp2", "torch"])},
    }
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
