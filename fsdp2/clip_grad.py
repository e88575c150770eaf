"""Gradient norms and clipping over sharded gradients, on their plain local shards.

``torch.nn.utils.clip_grad_norm_`` over ``DTensor`` gradients works, but dispatches every
per-gradient norm and multiplication through ``DTensor`` and leaves a partial norm to be
reduced later. Here each rank takes the norms of its local shards with the same kernels
torch uses (``torch._foreach_norm`` per device and dtype, or one norm per tensor), then
combines them across ranks with as few all-reduces as the layouts allow.

[Note: one all-reduce per set of sharded mesh dims]
A ``DTensor`` gradient's local norm covers the elements of its shard. The whole tensor's
elements are spread over the mesh dims it is sharded on (``Shard``, ``_StridedShard``), and
repeated over the dims it is replicated on, so the contributions (the norm to the power
``p``; the norm itself for ``inf``) are summed (``MAX`` for ``inf``, ``MIN`` for ``-inf``)
over the sharded dims only. The replicate dim of HSDP holds equal gradients and is not
summed again; the tensor-parallel dim of a TP-sharded weight is. Gradients sharded over
the same dims are summed locally first, so there is one all-reduce per distinct set
of sharded dims, and nested sets share theirs: with FSDP + TP, the (dp, tp) set is
reduced over tp and then folded into the (dp) set of the TP-replicated norms, which one
all-reduce over dp completes (two collectives, as two flattened groups would take).
Plain tensors contribute their local norm as torch's function does; the sets are built
in the order the gradients come, the same on every rank, so every rank issues the same
collectives. A ``Partial`` gradient (not fsdp2's) is first made replicated on those dims.

The result is a plain tensor, equal on every rank when the plain gradients are (fsdp2's
are all ``DTensor``s), that agrees with torch's function on the same ``DTensor``
gradients up to the order of the floating-point sums.
"""

from __future__ import annotations

import functools
import math
import struct
import types
import warnings
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

__all__ = ["clip_grad_norm_", "clip_grads_with_norm_", "get_total_norm"]

TensorOrTensors = torch.Tensor | Iterable[torch.Tensor]

# A set of sharded mesh dims, as the process groups of those dims in a fixed order.
SetKey = tuple[dist.ProcessGroup, ...]

_UNSEEN: Any = object()  # a layout not looked up yet


@torch.no_grad()
def get_total_norm(
    tensors: TensorOrTensors,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """The ``norm_type`` norm of all ``tensors`` together (``DTensor``s as the whole
    tensors they shard, plain tensors as they are), as a plain tensor on the first
    tensor's device: ``torch.nn.utils.get_total_norm``'s contract, computed on local
    shards (see [Note: one all-reduce per set of sharded mesh dims])."""
    listed = _as_list(tensors, "get_total_norm", "tensors")
    if not listed:
        return torch.tensor(0.0)
    return _total_norm(listed, _norm_type(norm_type), error_if_nonfinite, foreach, None)


def _total_norm(
    listed: list[torch.Tensor],
    norm_type: float,
    error_if_nonfinite: bool,
    foreach: bool | None,
    runs: list[torch.Tensor] | None,
) -> torch.Tensor:
    """``get_total_norm`` of the non-empty ``listed``. With ``runs``, also append to it
    the local tensors the norm read, coalesced ([Note: adjacent gradients are one
    tensor]), for scaling them afterwards; it is cleared if a ``Partial`` tensor's norm
    read a replicated copy instead of the tensor's own local part."""
    first_device = _local_part(listed[0]).device
    # Per set of sharded dims (first appearance order): its local tensors.
    by_set: dict[SetKey, list[torch.Tensor]] = {}
    order: dict[dist.ProcessGroup, int] = {}
    # (mesh, placements) by identity -> the set of a DTensor without Partial placements:
    # fsdp2's gradients share both objects per group, and identities cost no hashing of
    # placements (all alive during the call, so ids are not reused).
    keys: dict[tuple[int, int], SetKey | None] = {}
    copied = False
    last_mesh: Any = None
    last_placements: Any = None
    last_list: list[torch.Tensor] = []
    for tensor in listed:
        if type(tensor) is DTensor:
            spec = tensor._spec
            if spec.placements is last_placements and spec.mesh is last_mesh:
                last_list.append(tensor._local_tensor)  # the common case: as the last one
                continue
            layout = (id(spec.mesh), id(spec.placements))
            key = keys.get(layout, _UNSEEN)
            if key is _UNSEEN:
                is_partial = any(p.is_partial() for p in spec.placements)
                key = keys[layout] = None if is_partial else _local_of(tensor, order)[1]
            if key is not None:
                last_mesh, last_placements = spec.mesh, spec.placements
                last_list = by_set.setdefault(key, [])
                last_list.append(tensor._local_tensor)
                continue
            copied = True
        local, key = _local_of(tensor, order)
        last_mesh = last_placements = None
        by_set.setdefault(key, []).append(local)
    partial = {
        key: _local_norm(locals_, norm_type, foreach, first_device, runs)
        for key, locals_ in by_set.items()
    }
    if copied and runs is not None:
        runs.clear()
    total = _reduce_over_sets(partial, norm_type)
    if norm_type == 0.0:  # a count of fp32 flags: in the dtype torch's stacked norms have
        total = total.to(functools.reduce(torch.promote_types, {t.dtype for t in listed}))
    if error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):
        raise RuntimeError(
            f"fsdp2.get_total_norm: the total norm of order {norm_type} of the gradients is "
            f"non-finite ({total.item()}), so they cannot be clipped. Find the NaN or inf "
            f"(torch.autograd.set_detect_anomaly), or pass error_if_nonfinite=False to "
            f"scale them by it anyway."
        )
    return total


@torch.no_grad()
def clip_grads_with_norm_(
    parameters: TensorOrTensors,
    max_norm: float,
    total_norm: torch.Tensor,
    foreach: bool | None = None,
) -> None:
    """Scale the gradients of ``parameters`` by ``max_norm / (total_norm + 1e-6)`` where
    that is below 1: ``torch.nn.utils.clip_grads_with_norm_``'s contract, on the local
    shards of ``DTensor`` gradients (in place, so the ``DTensor``s see it)."""
    params = _as_list(parameters, "clip_grads_with_norm_", "parameters")
    max_norm = _max_norm(max_norm, "clip_grads_with_norm_")
    if not isinstance(total_norm, torch.Tensor):
        raise TypeError(
            f"fsdp2.clip_grads_with_norm_: total_norm must be a tensor (what "
            f"fsdp2.get_total_norm returns), got {type(total_norm).__name__}."
        )
    if isinstance(total_norm, DTensor):
        total_norm = total_norm.full_tensor()
    # Scaling is linear: the local part of any layout (a Partial one too) is scaled as is.
    _scale_(
        [_local_part(g) for p in params if (g := p.grad) is not None], max_norm, total_norm, foreach
    )


def _scale_(
    grads: list[torch.Tensor],
    max_norm: float,
    total_norm: torch.Tensor,
    foreach: bool | None,
    coalesced: bool = False,
) -> None:
    """Scale the local gradients ``grads`` by ``max_norm / (total_norm + 1e-6)``, at most
    1 (``coalesced``: their adjacent runs are joined already)."""
    if not grads:
        return
    # A host-side coefficient of 1 leaves every gradient as it is (x * 1.0 == x, NaN
    # included): skip the pass over them, as Megatron's clipping does. On an
    # accelerator reading it would synchronize, so the product runs as in torch.
    on_host = total_norm.device.type == "cpu"
    coefficient: torch.Tensor | float | None = None
    if on_host and total_norm.dtype in (torch.float32, torch.float64):
        coefficient = _host_coefficient(total_norm.item(), max_norm, total_norm.dtype)
    if coefficient is None:
        coefficient = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    if on_host and bool(coefficient == 1.0):
        return
    for (device, _), group in _by_device_and_dtype(grads).items():
        scale = coefficient if isinstance(coefficient, float) else coefficient.to(device)
        if not coalesced:  # a product per element: the same bits either way
            group = coalesce_adjacent(group)
        if _use_foreach(group, device, foreach):
            torch._foreach_mul_(group, scale)
        else:
            for grad in group:
                grad.mul_(scale)


def _host_coefficient(total: float, max_norm: float, dtype: torch.dtype) -> float | None:
    """``clamp(max_norm / (total + 1e-6), max=1.0)`` exactly as torch computes it on a
    0-dim CPU tensor of ``dtype`` holding ``total``, as a Python float: for fp32 and fp64
    only, else None (the caller computes it with tensors).

    [Note: the clip coefficient on the host]
    torch evaluates ``max_norm / t`` as ``t.reciprocal() * max_norm``, each step rounded
    to ``t``'s dtype. Python floats are IEEE doubles, and one addition, division or
    product of fp32 values computed in double and then rounded to fp32 is the correctly
    rounded fp32 result (a double has more than twice fp32's precision), so repeating
    torch's steps with a rounding to fp32 after each gives its bits. That spares five
    tiny tensor ops per clip, each as costly as a whole norm kernel of a small model
    when caches are cold. A product with the float scales every element as the product
    with the 0-dim fp32 tensor does (both multiply in float, by the same value).
    Magnitudes that could overflow fp32 (|max_norm| > 1e30) take the tensor path."""
    rounded: Callable[[float], float]
    if dtype == torch.float64:
        rounded = float
    elif dtype == torch.float32 and abs(max_norm) <= 1e30:
        rounded = _to_fp32
    else:
        return None
    shifted = rounded(total + rounded(1e-6))
    if shifted == 0.0:
        return None
    coefficient = rounded(rounded(1.0 / shifted) * rounded(max_norm))
    return coefficient if math.isnan(coefficient) else min(coefficient, 1.0)


def _to_fp32(value: float) -> float:
    """``value`` rounded to the nearest fp32 value (ties to even), as a Python float."""
    return cast(float, struct.unpack("f", struct.pack("f", value))[0])


@torch.no_grad()
def clip_grad_norm_(
    parameters: TensorOrTensors,
    max_norm: float,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip the gradients of ``parameters`` (fsdp2's ``DTensor`` parameters, other
    ``DTensor``s and plain ones, mixed) to a total ``norm_type`` norm of ``max_norm``, and
    return that total norm before clipping, a plain tensor equal on every rank:
    ``torch.nn.utils.clip_grad_norm_``'s contract, with one all-reduce per set of sharded
    mesh dims and no ``DTensor`` dispatch."""
    if isinstance(parameters, torch.Tensor):
        params = [parameters]
    else:
        generator = isinstance(parameters, types.GeneratorType)
        params = _as_list(parameters, "clip_grad_norm_", "parameters")
        if generator and not params:
            warnings.warn(
                "fsdp2.clip_grad_norm_: `parameters` is an empty generator (was it used "
                "up already?), so no gradient is clipped.",
                stacklevel=3,
            )
    max_norm = _max_norm(max_norm, "clip_grad_norm_")
    grads = [g for p in params if (g := p.grad) is not None]
    if not grads:
        return torch.tensor(0.0)
    # The norm's coalesced local tensors are the ones to scale, unless a Partial
    # gradient's norm read a replicated copy: then its own local part is scaled, as in
    # clip_grads_with_norm_.
    runs: list[torch.Tensor] = []
    total = _total_norm(grads, _norm_type(norm_type), error_if_nonfinite, foreach, runs)
    if runs:
        _scale_(runs, max_norm, total, foreach, coalesced=True)
    else:
        _scale_([_local_part(g) for g in grads], max_norm, total, foreach)
    return total


def _as_list(tensors: TensorOrTensors, api: str, name: str) -> list[torch.Tensor]:
    listed = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    if all(issubclass(kind, torch.Tensor) for kind in set(map(type, listed))):
        return listed  # one pass in C over the list, then the few distinct types
    for i, tensor in enumerate(listed):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"fsdp2.{api}: {name}[{i}] is a {type(tensor).__name__}, not a tensor; pass "
                f"tensors, e.g. model.parameters()."
            )
    return listed


def _norm_type(norm_type: float | str) -> float:
    try:
        return float(norm_type)
    except (TypeError, ValueError):
        raise ValueError(
            f"fsdp2 gradient norm: norm_type={norm_type!r} is not a number; use a float "
            f"such as 2.0, or 'inf' / float('inf') for the largest absolute value."
        ) from None


def _max_norm(max_norm: float, api: str) -> float:
    if isinstance(max_norm, torch.Tensor) and max_norm.numel() == 1:
        return float(max_norm)
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
        raise TypeError(
            f"fsdp2.{api}: max_norm must be a number, got {type(max_norm).__name__} ({max_norm!r})."
        )
    return float(max_norm)


def _local_part(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _local_of(
    tensor: torch.Tensor, order: dict[dist.ProcessGroup, int] | None = None
) -> tuple[torch.Tensor, SetKey]:
    """``tensor``'s local part and the set of mesh dims its elements are spread over."""
    if not isinstance(tensor, DTensor):
        return tensor, ()
    placements = tensor.placements
    if any(p.is_partial() for p in placements):
        tensor = tensor.redistribute(
            placements=[Replicate() if p.is_partial() else p for p in placements]
        )
        placements = tensor.placements
    mesh = tensor.device_mesh
    # Sharded: neither replicated nor partial (``Shard``, and ``_StridedShard``, which
    # is not a ``Shard`` subclass in every torch).
    dims = sorted({d for d, p in enumerate(placements) if not p.is_replicate()})
    groups = [mesh.get_group(d) for d in dims]
    if order is not None:
        for group in groups:
            order.setdefault(group, len(order))
        groups.sort(key=order.__getitem__)
    return tensor._local_tensor, tuple(groups)


def _by_device_and_dtype(
    tensors: list[torch.Tensor],
) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """``tensors`` by device and dtype, in order (torch's grouping, in C++)."""
    from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

    grouped = _group_tensors_by_device_and_dtype([tensors])  # type: ignore[list-item]
    return {key: cast(list[torch.Tensor], lists[0]) for key, (lists, _) in grouped.items()}


def _use_foreach(tensors: list[torch.Tensor], device: torch.device, foreach: bool | None) -> bool:
    """torch's choice: foreach kernels where the device has them (the CPU included) and
    every tensor is a plain tensor, unless ``foreach`` says otherwise."""
    from torch.utils._foreach_utils import _device_has_foreach_support, _has_foreach_support

    if foreach is None:
        return _has_foreach_support(tensors, device)
    if foreach and not _device_has_foreach_support(device):
        raise RuntimeError(
            f"fsdp2 gradient norm: foreach=True was passed, but {device.type} tensors have "
            f"no foreach kernels; pass foreach=None or False."
        )
    return foreach


def _local_norm(
    tensors: list[torch.Tensor],
    norm_type: float,
    foreach: bool | None,
    device: torch.device,
    runs: list[torch.Tensor] | None,
) -> torch.Tensor:
    """The norm of one set's local tensors, as torch's ``get_total_norm`` takes it
    (``runs``: see ``_total_norm``). Empty shards (a rank past the last row of an
    unevenly sharded tensor) contribute nothing; the max norm of an empty tensor is an
    error in torch, on one rank only. The 0-"norm" returns per-tensor flags instead
    ([Note: the 0-"norm" counts whole tensors])."""
    # Coalesced first, then grouped: a run has one base, hence one device, and one dtype,
    # so grouping the runs groups their members (in the same order, torch's grouping).
    grouped = _by_device_and_dtype(coalesce_adjacent(tensors))
    if runs is not None:  # what scaling multiplies, for every order
        for group in grouped.values():
            runs.extend(group)
    if norm_type == 0.0:
        return _nonzero_flags(tensors, foreach, device)
    norms: list[torch.Tensor] = []
    for (tensor_device, tensor_dtype), group in grouped.items():
        if tensor_dtype not in _COALESCED_NORM_DTYPES:  # torch's per-tensor norms
            group = [t for t in tensors if t.dtype == tensor_dtype and t.device == tensor_device]
        group = [t for t in group if t.numel() > 0]
        if not group:
            continue
        if _use_foreach(group, tensor_device, foreach):
            found = list(torch._foreach_norm(group, norm_type))
        else:
            found = [torch.linalg.vector_norm(t, norm_type) for t in group]
        norms += found if tensor_device == device else [n.to(device) for n in found]
    if not norms:
        identity = math.inf if norm_type == -math.inf else 0.0
        return torch.tensor(identity, dtype=tensors[0].dtype, device=device)
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def _nonzero_flags(
    tensors: list[torch.Tensor], foreach: bool | None, device: torch.device
) -> torch.Tensor:
    """One fp32 flag per tensor of ``tensors``, in an order every rank shares: 1 where
    its local part holds a nonzero element. Empty parts are flagged 0, not dropped, so
    the flag vectors of all ranks line up for the all-reduce.

    [Note: the 0-"norm" counts whole tensors]
    torch's ``get_total_norm`` takes the norm of the per-tensor norms, so for
    ``norm_type=0`` it returns the number of *tensors* with a nonzero element, not the
    number of nonzero elements. That count does not compose from per-rank or per-run
    scalars the way ``sum |x|**p`` does for every other order: a tensor nonzero on two
    ranks is one tensor, and a coalesced run holds several. So the 0-"norm" keeps one
    flag per tensor, not coalesced, takes the ``MAX`` of each flag over the tensor's
    sharded dims (nonzero anywhere), and counts the flags."""
    flags: list[torch.Tensor] = []
    for (tensor_device, _), group in _by_device_and_dtype(tensors).items():
        if _use_foreach(group, tensor_device, foreach):
            counts = list(torch._foreach_norm(group, 0.0))
        else:
            counts = [torch.linalg.vector_norm(t, 0.0) for t in group]
        flags += [c.to(device=device, dtype=torch.float32) for c in counts]
    return torch.stack(flags).clamp_(max=1.0)


# Norms over coalesced runs accumulate in float like torch's per-tensor norms but round
# once; half-precision norms keep torch's per-tensor rounding (see
# [Note: adjacent gradients are one tensor]).
_COALESCED_NORM_DTYPES = (torch.float32, torch.float64)


def coalesce_adjacent(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` with every run of contiguous views that lie back to back in one base
    replaced by a single flat view of that run (see [Note: adjacent gradients are one
    tensor]). Order, memory and values are unchanged; nothing is copied.

    [Note: adjacent gradients are one tensor]
    fsdp2 stores a group's reduced gradients as views of the one tensor the
    reduce-scatter wrote, in the order of the group's parameters, so on a rank they lie
    back to back in memory (with gaps only where a parameter's shard is padded). A norm
    or a scaling over those views is then one kernel over one view of the run instead
    of one per parameter: on the CPU each small kernel's fixed cost is most of the work,
    so 64 blocks of 9 parameters cost 64 kernels instead of 576. A tensor joins the run
    before it only if both are contiguous views of the same base (``_base``: the same
    storage), of the same dtype, and it starts exactly where the run ends, so a run
    covers exactly its tensors' elements, each once: gaps, padding, repeated or
    overlapping tensors and tensors of other storages all start a new run. Scaling gives
    the same bits per element either way (one rounded product); an fp32 or fp64 norm
    differs from torch's per-tensor norms only in the order of its float sums, within
    the 1e-6 relative agreement the functions promise; bf16 and fp16 norms, which torch
    rounds per tensor, are taken per tensor as torch takes them.
    """
    if len(tensors) < 2:
        return tensors
    out: list[torch.Tensor] = []
    run: list[torch.Tensor] = []
    base: torch.Tensor | None = None
    dtype: torch.dtype | None = None
    end: int | torch.SymInt = -1
    plain = torch.Tensor
    for tensor in tensors:
        # Joinable: a plain, contiguous view without a lazy negation (and, checked when a
        # run starts, real), so a flat view of its storage range reads exactly its values
        # (a subclass may hold its data elsewhere; a conjugate or negative view's bit would
        # not carry over to the other members). Inline: this runs once per gradient.
        tensor_base = tensor._base
        joinable = (
            tensor_base is not None
            and type(tensor) is plain
            and tensor.is_contiguous()
            and not tensor.is_neg()
        )
        if joinable and tensor_base is base and tensor.dtype is dtype:
            offset = tensor.storage_offset()
            if offset == end:
                run.append(tensor)
                end = offset + tensor.numel()
                continue
        _flush(run, end, out)
        run = [tensor]
        if joinable and not tensor.is_complex():
            base, dtype = tensor_base, tensor.dtype
            end = tensor.storage_offset() + tensor.numel()
        else:
            base, dtype, end = None, None, -1
    _flush(run, end, out)
    return out


def _flush(run: list[torch.Tensor], end: int | torch.SymInt, out: list[torch.Tensor]) -> None:
    if len(run) == 1:
        out.append(run[0])
    elif run:
        first = run[0]
        start = first.storage_offset()
        out.append(first.as_strided((end - start,), (1,), start))


def _reduce_over_sets(partial: dict[SetKey, torch.Tensor], norm_type: float) -> torch.Tensor:
    """Combine the per-set local norms into the total norm, with one all-reduce per set
    (nested sets folded together); see [Note: one all-reduce per set of sharded mesh
    dims]. The 0-"norm" reduces per-tensor flags instead ([Note: the 0-"norm" counts
    whole tensors])."""
    if norm_type == 0.0:
        return _count_flags_over_sets(partial)
    if norm_type == math.inf:
        op, combine = dist.ReduceOp.MAX, torch.maximum
    elif norm_type == -math.inf:
        op, combine = dist.ReduceOp.MIN, torch.minimum
    else:
        op, combine = dist.ReduceOp.SUM, torch.add
    power = norm_type not in (1.0, math.inf, -math.inf)
    # The contributions to reduce: norm ** p.
    pending: dict[SetKey, torch.Tensor] = {
        key: norm.pow(norm_type) if power else norm for key, norm in partial.items()
    }
    while len(pending) > 1 or () not in pending:
        key = max((k for k in pending if k), key=len)  # the first of the largest sets
        value = pending.pop(key)
        drop = len(key) - 1
        for i in reversed(range(len(key))):
            if key[:i] + key[i + 1 :] in pending:
                drop = i
                break
        rest = key[:drop] + key[drop + 1 :]
        reduced = _all_reduce(value, op, key[drop])
        pending[rest] = combine(pending[rest], reduced) if rest in pending else reduced
    total = pending[()]
    return total.pow(1.0 / norm_type) if power else total


def _count_flags_over_sets(flags: dict[SetKey, torch.Tensor]) -> torch.Tensor:
    """The number of tensors flagged nonzero on some rank: each set's flags take the
    ``MAX`` over each of its sharded dims (sets in the order the gradients first showed
    them, the same on every rank), then all flags are counted."""
    total: torch.Tensor | None = None
    for key, set_flags in flags.items():
        for group in key:
            set_flags = _all_reduce(set_flags, dist.ReduceOp.MAX, group)
        count = set_flags.sum()
        total = count if total is None else total + count
    assert total is not None  # one set at least: the caller has a gradient
    return total


def _all_reduce(value: torch.Tensor, op: Any, group: dist.ProcessGroup) -> torch.Tensor:
    """``value`` all-reduced over ``group``, on the group's device and back."""
    backend_device = _group_device(group, value.device)
    moved = value.to(backend_device)  # ``value`` itself when on that device: reduced in place
    dist.all_reduce(moved, op=op, group=group)
    return moved.to(value.device)


def _group_device(group: dist.ProcessGroup, device: torch.device) -> torch.device:
    """Where ``group``'s collectives take tensors: ``device`` unless only an accelerator
    backend serves it (CPU-offloaded gradients with NCCL)."""
    if device.type != "cpu":
        return device
    try:
        backend = str(dist.get_backend(group))
    except (RuntimeError, ValueError):
        return device
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device
