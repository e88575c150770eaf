"""Would one flat tensor per group make ``optimizer.step()`` cheaper, and equal?

fsdp2's local shards of a group lie back to back in one flat buffer, so an elementwise
optimizer could step each group as one tensor instead of one per parameter: fewer, larger
kernels. ``fsdp2.clip_grad_norm_`` does this for the norm and the scaling, where torch
promises agreement to a tolerance ([Note: adjacent gradients are one tensor]). The
optimizer fast path promises more: the same bits as the step on ``DTensor``s. This script
measures both sides of that choice on the plain tensors of the benchmark configs' shards:

* the time of AdamW (for-loop and ``foreach``) over one flat tensor per fsdp2 group, and
  over those flat tensors cut into cache-sized tiles, against the same optimizer over the
  per-parameter shards (the fast path's floor; here the ratio is to that plain step, and
  ``benchmarks/optimizer.py`` reports the flat step over torch's ``DTensor`` step as its
  bound);
* whether the flat step gives the same bits, for every optimizer the fast path covers,
  each implementation, fp32 and bf16: a vectorized CPU kernel computes the last elements
  of each tensor on its scalar path, so moving a tensor's end changes which elements take
  which path, and fused kernels and bf16 arithmetic do not round alike on both.

Example::

    python benchmarks/flat_step.py --config small-many
"""

from __future__ import annotations

import argparse
import gc
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

import fsdp2  # noqa: E402
from benchmarks.configs import CONFIGS  # noqa: E402
from examples.llama import ModelArgs, Transformer  # noqa: E402

# The fast path's optimizers, with flags that exercise their state.
OPTIMIZERS: dict[str, dict[str, Any]] = {
    "SGD": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01, "nesterov": True},
    "Adam": {"lr": 1e-2, "weight_decay": 0.01, "amsgrad": True},
    "AdamW": {"lr": 1e-2, "weight_decay": 0.01},
    "Adagrad": {"lr": 1e-2, "weight_decay": 0.01},
    "RMSprop": {"lr": 1e-2, "momentum": 0.9, "centered": True, "weight_decay": 0.01},
    "NAdam": {"lr": 1e-2, "weight_decay": 0.01, "decoupled_weight_decay": True},
    "RAdam": {"lr": 1e-2, "weight_decay": 0.01},
    "Adamax": {"lr": 1e-2, "weight_decay": 0.01},
    "Adadelta": {"lr": 1.0, "weight_decay": 0.01},
    "ASGD": {"lr": 1e-2, "weight_decay": 0.01},
    "Rprop": {"lr": 1e-2},
}
FUSED = ("SGD", "Adam", "AdamW", "Adagrad")  # fused=True on the CPU


def group_sizes(config: str, layers: int | None = None) -> list[list[int]]:
    """Per fsdp2 group of the config's model, the local shard sizes of its parameters."""
    cfg = CONFIGS[config].with_overrides(n_layers=layers)
    model = Transformer(ModelArgs(vocab_size=cfg.vocab_size, dim=cfg.dim, n_layers=cfg.n_layers))
    modules = [*model.layers, model]
    for module in modules:
        fsdp2.fully_shard(module)
    seen: set[int] = set()
    groups = []
    for module in modules:
        sizes = []
        for param in module.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                sizes.append(param.to_local().numel())
        groups.append(sizes)
    return groups


def _step_time(params: list[torch.Tensor], foreach: bool, repeats: int) -> float:
    optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=foreach)
    times = []
    for r in range(repeats + 2):
        gc.collect()
        start = time.thread_time()
        optimizer.step()
        if r >= 2:
            times.append(time.thread_time() - start)
    return statistics.median(times)


def _with_grads(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    params = [torch.nn.Parameter(t.clone()) for t in tensors]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


# Elements per tile of the tiled layout: with AdamW's four fp32 tensors (parameter,
# gradient, two moments) one tile is 1 MiB, so all of a tile's ops run from the L2 cache.
TILE = 65536


def timing(groups: list[list[int]], repeats: int) -> dict[str, float]:
    """Median step times of AdamW over three layouts of the same elements: one tensor per
    parameter (what the fast path steps), one per group (flat), and the groups' flat
    tensors cut into tiles of ``TILE`` elements (a cache-blocked flat step)."""
    torch.manual_seed(0)
    per_param = _with_grads([torch.randn(n) for sizes in groups for n in sizes])
    flat = _with_grads([torch.randn(sum(sizes)) for sizes in groups])
    tiled = _with_grads([tile for t in flat for tile in t.detach().split(TILE)])
    out = {}
    for name, foreach in (("for-loop", False), ("foreach", True)):
        out[f"{name} per parameter"] = _step_time(per_param, foreach, repeats)
        out[f"{name} flat per group"] = _step_time(flat, foreach, repeats)
        out[f"{name} flat in tiles"] = _step_time(tiled, foreach, repeats)
    return out


def bitwise(sizes: list[int], steps: int = 5) -> list[tuple[str, str, str, float]]:
    """(dtype, optimizer, implementation, largest difference) where the flat step's
    result differs from the per-parameter step's."""
    differ = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, kwargs in OPTIMIZERS.items():
            for impl in ("for-loop", "foreach", "fused"):
                if impl == "fused" and name not in FUSED:
                    continue
                option = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
                cls = getattr(torch.optim, name)
                start = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(0))
                start = start.to(dtype)
                separate = [torch.nn.Parameter(v.clone()) for v in start.split(sizes)]
                flat = torch.nn.Parameter(start.clone())
                by_param = cls(separate, **kwargs, **option)
                by_group = cls([flat], **kwargs, **option)
                generator = torch.Generator().manual_seed(1)
                for _ in range(steps):
                    grad = torch.randn(sum(sizes), generator=generator).to(dtype)
                    for p, g in zip(separate, grad.split(sizes)):
                        p.grad = g.clone()
                    flat.grad = grad.clone()
                    by_param.step()
                    by_group.step()
                ours = torch.cat([p.detach() for p in separate])
                if not torch.equal(ours, flat.detach()):
                    gap = (ours.float() - flat.detach().float()).abs().max().item()
                    differ.append((str(dtype).removeprefix("torch."), name, impl, gap))
    return differ


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="small-many")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--layers", type=int, default=None, help="override n_layers")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    try:
        groups = group_sizes(args.config, args.layers)
    finally:
        dist.destroy_process_group()
    times = timing(groups, args.repeats)
    # A group's sizes as they come, then odd ones (ends off the vector width).
    differ = bitwise([n for n in groups[1] if n] + [37, 64, 129, 7, 1000, 3, 17])
    print(
        f"{args.config}, {args.world_size} fake ranks: {sum(map(len, groups))} shards in "
        f"{len(groups)} groups; AdamW median ms (thread clock)"
    )
    for impl in ("for-loop", "foreach"):
        per, flat = times[f"{impl} per parameter"], times[f"{impl} flat per group"]
        tiles = times[f"{impl} flat in tiles"]
        print(f"  {impl}: per parameter {per * 1e3:.2f}, flat per group {flat * 1e3:.2f} "
              f"({flat / per:.2f}x), flat in tiles of {TILE} {tiles * 1e3:.2f} "
              f"({tiles / per:.2f}x)")  # fmt: skip
    print(f"flat step differs from the per-parameter step in {len(differ)} cases:")
    for dtype, name, impl, gap in differ:
        print(f"  {dtype} {name} {impl}: largest difference {gap:.3g}")
    return {"times": times, "differ": differ}


if __name__ == "__main__":
    main()
