"""Configuration types passed to ``fully_shard``: same names, fields and defaults as
``torch.distributed.fsdp``, so user code switches by import."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Precision of the all-gathered parameters, the gradient reduction and the outputs.

    - ``param_dtype``: dtype the unsharded parameters are all-gathered in and used by
      forward/backward. ``None``: the sharded parameters' own dtype.
    - ``reduce_dtype``: dtype of the gradient reduce-scatter. ``None``: ``param_dtype``.
    - ``output_dtype``: if set, floating-point forward outputs are cast to it.
    - ``cast_forward_inputs``: cast floating-point forward inputs to ``param_dtype``.
    The sharded parameters (the optimizer's master copy) and their gradients keep the
    original dtype.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


# The dtypes gradients can be exchanged and summed in.
REDUCIBLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class ReducePolicy:
    """How the ranks' gradients are summed (fsdp2 only; see docs/reduction.md).

    - ``comm_dtype``: the dtype gradients travel in. ``None``: the reduce dtype as without
      a policy (``MixedPrecisionPolicy.reduce_dtype``, else ``param_dtype``, else the
      parameters' dtype).
    - ``accumulate_dtype``: the dtype the ranks' contributions are summed in. ``None``:
      that same default, or ``comm_dtype`` where that is wider.
    - ``deterministic``: sum in rank order, so gradients are bitwise reproducible
      whatever the collective algorithm or the order in which contributions arrive.

    When ``accumulate_dtype`` is wider than ``comm_dtype``, or with ``deterministic``,
    each group's gradients are cast once to ``comm_dtype`` and exchanged with one
    all-to-all (the bytes of a ``comm_dtype`` reduce-scatter), and each rank sums the
    contributions to its shard in ``accumulate_dtype``. Otherwise the group
    reduce-scatters in ``comm_dtype``. HSDP's sum over replicas follows the same rule.
    """

    comm_dtype: torch.dtype | None = None
    accumulate_dtype: torch.dtype | None = None
    deterministic: bool = False

    def __post_init__(self) -> None:
        for field in ("comm_dtype", "accumulate_dtype"):
            dtype = getattr(self, field)
            if dtype is not None and dtype not in REDUCIBLE_DTYPES:
                raise ValueError(
                    f"ReducePolicy.{field} must be torch.bfloat16, torch.float16, "
                    f"torch.float32, torch.float64 or None, got {dtype!r}: gradients are "
                    f"summed in floating point (integer, complex and float8 sums are not "
                    f"supported)."
                )
        if not isinstance(self.deterministic, bool):
            raise TypeError(
                f"ReducePolicy.deterministic must be a bool, got {self.deterministic!r}."
            )
        comm, accumulate = self.comm_dtype, self.accumulate_dtype
        if comm is not None and accumulate is not None:
            check_accumulates(comm, accumulate, "ReducePolicy")


def check_accumulates(comm: torch.dtype, accumulate: torch.dtype, where: str) -> None:
    """Raise unless every ``comm`` value converts to ``accumulate`` without loss: summing
    in a narrower dtype than the wire carries throws away what was paid for."""
    if torch.promote_types(comm, accumulate) != accumulate:
        raise ValueError(
            f"{where}: comm_dtype {comm} does not fit in accumulate_dtype {accumulate} "
            f"(the sum would round away bits the wire carried). Use an accumulate_dtype at "
            f"least as wide as comm_dtype, e.g. ReducePolicy(comm_dtype={comm}, "
            f"accumulate_dtype={torch.promote_types(comm, accumulate)})."
        )


@dataclass
class OffloadPolicy:
    """The default: no offloading. Sharded parameters and gradients stay on the device."""


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and gradients in CPU memory; the optimizer steps on the CPU.

    ``pin_memory``: pin the CPU shards so host<->device copies can run asynchronously.
    """

    pin_memory: bool = True


@dataclass
class DataParallelMeshDims:
    """The data-parallel dims of the mesh passed to ``fully_shard(..., dp_mesh_dims=...)``
    (torch 2.12's SPMD mode; see docs/spmd.md).

    - ``shard``: the dim name(s) parameters are sharded over; several are flattened into
      one shard dim.
    - ``replicate``: the dim name(s) parameters are replicated over (HSDP, or DDP without
      ``shard``); several are flattened into one.
    At least one must be set. torch's class of the same name is accepted too.
    """

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError(
                "At least one of shard or replicate must be set in DataParallelMeshDims "
                "(e.g. DataParallelMeshDims(shard='dp'))."
            )
        # Reject names that are neither a string nor a tuple of strings here, not later.
        dim_names(self.shard, "shard")
        dim_names(self.replicate, "replicate")

    @property
    def shard_names(self) -> tuple[str, ...]:
        return dim_names(self.shard, "shard")

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return dim_names(self.replicate, "replicate")


def dim_names(value: object, what: str) -> tuple[str, ...]:
    """A ``DataParallelMeshDims`` field (fsdp2's or torch's) as a tuple of dim names."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise TypeError(
        f"fully_shard(dp_mesh_dims=...): {what} must be a mesh dim name or a tuple of names, "
        f"got {value!r}."
    )


_MP_FIELDS = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")


def _is_torch_policy(policy: object, name: str) -> bool:
    """torch.distributed.fsdp's policy classes (matched by name: fsdp2 never imports
    torch.distributed.fsdp). Users who switch by import may still build policies there."""
    cls = type(policy)
    return cls.__module__.startswith("torch.distributed.fsdp") and cls.__name__ == name


def validate_mp_policy(policy: object) -> MixedPrecisionPolicy:
    if _is_torch_policy(policy, "MixedPrecisionPolicy"):
        policy = MixedPrecisionPolicy(**{f: getattr(policy, f) for f in _MP_FIELDS})
    if not isinstance(policy, MixedPrecisionPolicy):
        raise TypeError(
            f"fully_shard(mp_policy=...) expects a fsdp2.MixedPrecisionPolicy, got "
            f"{type(policy).__name__}. Pass e.g. MixedPrecisionPolicy(param_dtype=torch.bfloat16)."
        )
    for field in ("param_dtype", "reduce_dtype", "output_dtype"):
        dtype = getattr(policy, field)
        if dtype is not None and (
            not isinstance(dtype, torch.dtype) or not dtype.is_floating_point
        ):
            raise ValueError(
                f"MixedPrecisionPolicy.{field} must be a floating-point torch.dtype or None, "
                f"got {dtype!r}."
            )
    return policy


def validate_offload_policy(policy: object) -> OffloadPolicy:
    if _is_torch_policy(policy, "CPUOffloadPolicy"):
        policy = CPUOffloadPolicy(pin_memory=bool(getattr(policy, "pin_memory", True)))
    elif _is_torch_policy(policy, "OffloadPolicy"):
        policy = OffloadPolicy()
    if not isinstance(policy, OffloadPolicy):
        raise TypeError(
            f"fully_shard(offload_policy=...) expects fsdp2.OffloadPolicy() or "
            f"fsdp2.CPUOffloadPolicy(), got {type(policy).__name__}."
        )
    return policy


def validate_reduce_policy(policy: object, api: str) -> ReducePolicy | None:
    """``policy`` as stored on groups: ``None`` for no policy and for ``ReducePolicy()``
    (today's reduction, which a custom reduce-scatter may still replace)."""
    if policy is None:
        return None
    if not isinstance(policy, ReducePolicy):
        raise TypeError(
            f"{api} expects a fsdp2.ReducePolicy or None, got {type(policy).__name__}. "
            f"Pass e.g. ReducePolicy(comm_dtype=torch.bfloat16, accumulate_dtype=torch.float32)."
        )
    return None if policy == ReducePolicy() else policy
