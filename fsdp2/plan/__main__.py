"""``python -m fsdp2.plan MODULE:FACTORY --world-size N --batch B --seq S``: print a plan.

The factory is called without arguments under ``torch.device("meta")``, so a model whose
constructor allocates through the default device is built without memory. The inputs are
token ids of shape ``(B, S)`` for a model whose first parameterized module is an
``nn.Embedding``; other models name a function with ``--inputs MODULE:FN`` (called as
``FN(batch, seq)``, returning what the forward takes).

Examples::

    python -m fsdp2.plan examples.llama_factories:llama_70b --world-size 1024 --batch 1 \\
        --seq 4096 --mp bf16 --device cuda --loss cross-entropy
    python -m fsdp2.plan mypkg.models:build --world-size 64 --batch 4 --seq 2048 --budget 40GiB
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fsdp2._policies import CPUOffloadPolicy, MixedPrecisionPolicy
from fsdp2.plan._plan_sharding import plan_sharding

_MP = {
    "fp32": None,
    "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    "fp16": MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32),
}
_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer] | None] = {
    "adamw": torch.optim.AdamW,
    "adam": torch.optim.Adam,
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "none": None,
}


def _load(spec: str, what: str) -> Any:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise SystemExit(f"{what} must be MODULE:NAME (e.g. mypkg.models:build), got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise SystemExit(f"{what}: cannot import {module_name!r}: {exc}") from exc
    found = getattr(module, attr, None)
    if found is None or not callable(found):
        raise SystemExit(f"{what}: {module_name!r} has no callable {attr!r}")
    return found


def _token_inputs(model: nn.Module, batch: int, seq: int) -> torch.Tensor:
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            return torch.zeros(batch, seq, dtype=torch.long)
        if any(True for _ in module.parameters(recurse=False)):
            break
    raise SystemExit(
        f"{type(model).__name__} does not start with an nn.Embedding, so token ids of shape "
        f"(batch, seq) are not its input; pass --inputs MODULE:FN with FN(batch, seq) "
        f"returning its example inputs."
    )


def _checkpoint_blocks(model: nn.Module) -> None:
    """Wrap each repeated block (as automatic grouping finds them) for activation
    checkpointing, as a training script would before ``fully_shard``."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from fsdp2.plan._grouping import repeated_blocks
    from fsdp2.plan._model import read_model

    info = read_model(model)
    for b in repeated_blocks(info):
        parent = info.modules[info.parent[b]]
        name = info.names[b].rsplit(".", 1)[-1]
        setattr(parent, name, checkpoint_wrapper(info.modules[b]))


def _cross_entropy(output: Any) -> torch.Tensor:
    logits = output[0] if isinstance(output, (tuple, list)) else output
    flat = logits.flatten(0, -2)
    targets = torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device)
    return F.cross_entropy(flat.float(), targets)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m fsdp2.plan",
        description="Plan fully_shard groups and predict per-rank memory and communication.",
    )
    p.add_argument("factory", help="MODULE:FACTORY, called with no arguments on the meta device")
    p.add_argument("--world-size", type=int, default=None, help="ranks of a 1-D mesh")
    p.add_argument("--mesh", default=None, help="HSDP mesh shape REPLICATE,SHARD (e.g. 8,128)")
    p.add_argument("--batch", type=int, required=True, help="sequences per rank")
    p.add_argument("--seq", type=int, required=True, help="sequence length")
    p.add_argument("--budget", default=None, help="memory budget per rank, e.g. 40GiB")
    p.add_argument("--mp", choices=sorted(_MP), default="fp32", help="mixed precision")
    p.add_argument("--groups", default="auto", help="'auto' or comma-separated FQNs, bottom-up")
    p.add_argument("--reshard", default=None, help="reshard_after_forward: true, false or an int")
    p.add_argument("--offload", action="store_true", help="CPUOffloadPolicy()")
    p.add_argument("--optimizer", choices=sorted(_OPTIMIZERS), default="adamw")
    p.add_argument("--loss", choices=("sum", "cross-entropy"), default="sum")
    p.add_argument("--inputs", default=None, help="MODULE:FN, FN(batch, seq) -> inputs")
    p.add_argument("--device", default=None, help="device type compute runs on (cuda, cpu)")
    p.add_argument("--grad-accumulation", type=int, default=1)
    p.add_argument("--min-group-bytes", default=None, help="auto grouping's merge size")
    p.add_argument(
        "--checkpoint-blocks",
        action="store_true",
        help="wrap every repeated block in torch's checkpoint_wrapper (activation checkpointing)",
    )
    p.add_argument("--json", action="store_true", help="print to_dict() as JSON instead")
    args = p.parse_args(argv)

    factory = _load(args.factory, "FACTORY")
    with torch.device("meta"):
        try:
            model = factory()
        except TypeError as exc:
            raise SystemExit(
                f"{args.factory} must build the model with no arguments: {exc}"
            ) from exc
    if not isinstance(model, nn.Module):
        raise SystemExit(f"{args.factory} returned {type(model).__name__}, not an nn.Module")
    if args.checkpoint_blocks:
        _checkpoint_blocks(model)
    if args.inputs:
        inputs = _load(args.inputs, "--inputs")(args.batch, args.seq)
    else:
        inputs = _token_inputs(model, args.batch, args.seq)
    reshard: bool | int | None = None
    if args.reshard is not None:
        lowered = args.reshard.lower()
        reshard = {"true": True, "false": False}.get(lowered)
        if reshard is None:
            try:
                reshard = int(lowered)
            except ValueError:
                raise SystemExit(
                    f"--reshard must be true, false or an int, got {args.reshard!r}"
                ) from None
    mesh = None
    if args.mesh:
        try:
            mesh = tuple(int(x) for x in args.mesh.split(","))
        except ValueError:
            raise SystemExit(
                f"--mesh must be REPLICATE,SHARD (e.g. 8,128), got {args.mesh!r}"
            ) from None
    groups: Any = "auto" if args.groups == "auto" else args.groups.split(",")
    try:
        plan = _plan(args, model, inputs, reshard, mesh, groups)
    except (ValueError, TypeError) as exc:  # bad input: the message says what to change
        print(f"python -m fsdp2.plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict(), indent=1) if args.json else plan.report())
    print(f"(planned in {plan.planning_seconds:.1f} s)", file=sys.stderr)
    return 0


def _plan(
    args: argparse.Namespace,
    model: nn.Module,
    inputs: Any,
    reshard: bool | int | None,
    mesh: tuple[int, ...] | None,
    groups: Any,
) -> Any:
    return plan_sharding(
        model,
        world_size=args.world_size,
        mesh=mesh,
        groups=groups,
        memory_budget=args.budget,
        mp_policy=_MP[args.mp],
        offload_policy=CPUOffloadPolicy(pin_memory=False) if args.offload else None,
        reshard_after_forward=reshard,
        optimizer=_OPTIMIZERS[args.optimizer],
        example_inputs=inputs,
        loss_fn=_cross_entropy if args.loss == "cross-entropy" else None,
        grad_accumulation=args.grad_accumulation,
        device_type=args.device,
        min_group_bytes=args.min_group_bytes,
    )


if __name__ == "__main__":
    sys.exit(main())
