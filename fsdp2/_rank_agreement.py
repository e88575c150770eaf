"""The ranks of a process group agree on what they shard: checked once, at lazy init.

[Note: ranks that built different models]
Every collective of a parameter group assumes that each rank of its process group holds
the same parameters in the same groups: the same global shapes, dtypes, shard dims and
trainable set (the reduce-scatter packs the trainable parameters).
A rank that built its model from other values (a vocabulary size read per rank, a layer
count from a per-node setting, a freeze applied on rank 0 only) sends collectives of
another size. gloo then aborts the whole process from one of its threads ("Received data
size doesn't match expected size", no Python traceback), and NCCL hangs or reads past
the end of a buffer. torch's ``fully_shard`` does not check.

So at lazy init each rank reduces a fingerprint of the layouts of its groups, one small
all-reduce per process group (the shard groups, and HSDP's replicate groups), and compares
the smallest and largest values. The all-reduce goes to the backend directly
(``min_and_max``): torch issues none here, and tools that count FSDP's collectives
(``CommDebugMode``, patched ``torch.distributed`` functions, torch's own tests of the
first step) must see torch's counts. Only when they differ does it gather every rank's
description (one ``all_gather_object``, on the error path only) and raise a
``RuntimeError`` naming the first group that differs, what this rank holds and what the
other rank holds. Every rank sees the same minimum and maximum, so all raise together:
no rank is left waiting in a collective. Parameter names are not part of the
fingerprint (collectives do not depend on them); they appear in the message.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from fsdp2._collectives import min_and_max, text_digest

if TYPE_CHECKING:
    from fsdp2._param_group import ParamGroup


def check_ranks_agree(groups: Sequence[ParamGroup]) -> None:
    """Raise a ``RuntimeError`` on every rank if the ranks of any process group used by
    the groups hold different parameter layouts there (see
    [Note: ranks that built different models])."""
    by_process_group: dict[int, tuple[Any, list[ParamGroup]]] = {}
    for group in groups:
        for pg, size in ((group.process_group, group.world_size),
                         (group.replicate_group, group.replicate_size)):  # fmt: skip
            if pg is not None and size > 1:
                by_process_group.setdefault(id(pg), (pg, []))[1].append(group)
    for pg, members in by_process_group.values():
        layouts = [_layout(group) for group in members]
        low, high = min_and_max(text_digest(repr(layouts)), pg, members[0].device)
        if low != high:
            labels = [group.where for group in members]
            raise RuntimeError(_mismatch_message(pg, members, layouts, labels))


def _layout(group: ParamGroup) -> tuple[Any, ...]:
    """What a group's collectives depend on, for one rank."""
    params = tuple(
        (tuple(p.global_shape), str(p.dtype), p.shard_dim, bool(p.sharded_param.requires_grad))
        for p in group.params
    )
    return (group.gather_numel, str(group.gather_dtype), params)


def _describe(layout: tuple[Any, ...], names: list[str]) -> str:
    _, _, params = layout
    parts = []
    for (shape, dtype, shard_dim, trainable), name in zip(params, names, strict=True):
        dim = f", Shard({shard_dim})" if shard_dim else ""
        frozen = "" if trainable else ", frozen"
        parts.append(f"'{name}' {list(shape)} {dtype.removeprefix('torch.')}{dim}{frozen}")
    return "; ".join(parts) or "no parameters"


def _mismatch_message(
    pg: Any, members: list[ParamGroup], layouts: list[tuple[Any, ...]], labels: list[str]
) -> str:
    """Gather every rank's layouts (the error path only) and describe the first difference."""
    size = dist.get_world_size(pg)
    names = [[p.fqn for p in group.params] for group in members]
    everyone: list[Any] = [None] * size
    dist.all_gather_object(everyone, (layouts, names), group=pg)
    me = dist.get_rank(pg)
    other = next(r for r in range(size) if everyone[r][0] != layouts)
    theirs, their_names = everyone[other]
    me_global, other_global = dist.get_global_rank(pg, me), dist.get_global_rank(pg, other)
    advice = (
        "Every rank of a mesh must build the same model (sizes, dtypes, frozen parameters) "
        "and call fully_shard on the same modules before the first forward; a value read "
        "per rank (a vocabulary size, a layer count, a freeze on one rank) is the usual cause."
    )
    if len(theirs) != len(layouts):
        return (
            f"fully_shard: the ranks of one process group shard different models: rank "
            f"{me_global} has {len(layouts)} fully_shard groups on it, rank {other_global} "
            f"has {len(theirs)} (this rank's: {', '.join(labels)}). {advice}"
        )
    index = next(i for i, (a, b) in enumerate(zip(layouts, theirs)) if a != b)
    return (
        f"fully_shard: the ranks of one process group shard different parameters in "
        f"{labels[index]} (group {index + 1} of {len(layouts)} on it): rank "
        f"{me_global} has {_describe(layouts[index], names[index])}; rank {other_global} "
        f"has {_describe(theirs[index], their_names[index])}. {advice}"
    )
