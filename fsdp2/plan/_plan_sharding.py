"""``plan_sharding``: validate the request, plan the groups, predict, build the plan."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp2._policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from fsdp2.plan._evaluate import Evaluation, Planner, Reshard
from fsdp2.plan._grouping import auto_groups, fit_reshard, smallest_peak_error
from fsdp2.plan._layout import MeshShape
from fsdp2.plan._model import ModelInfo, ignored_indices, read_model, resolve_groups
from fsdp2.plan._sharding_plan import GroupPlan, ShardingPlan, format_bytes


def plan_sharding(
    model: nn.Module,
    *,
    world_size: int | None = None,
    mesh: Any = None,
    groups: str | list[Any] = "auto",
    memory_budget: int | str | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    reshard_after_forward: bool | int | None = None,
    optimizer: Callable[..., torch.optim.Optimizer] | None = torch.optim.AdamW,
    example_inputs: Any = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    ignored_params: set[nn.Parameter] | None = None,
    grad_accumulation: int = 1,
    device_type: str | None = None,
    min_group_bytes: int | str | None = None,
) -> ShardingPlan:
    """Plan where the ``fully_shard`` calls go and predict per-rank memory and traffic.

    The model may be on the meta device or real; it is never modified, and no full
    parameter is allocated: layouts come from shapes, and activations from one forward
    and backward traced on fake tensors (``FakeTensorMode``). Any world size can be
    planned without its ranks. See docs/planning.md.

    Args:
        model: the model to shard (not yet sharded).
        world_size: ranks of a 1-D mesh. Default: ``mesh``'s, else the initialized
            process group's.
        mesh: a ``DeviceMesh`` (1-D, or 2-D for HSDP: replicate x shard), or its shape
            as a tuple, ``(shard,)`` or ``(replicate, shard)``, to plan without the ranks.
        groups: ``"auto"`` (see docs/planning.md), or the modules or FQNs to shard,
            bottom-up as they would be passed to ``fully_shard`` (a list inside the list
            is one call on several modules); the model is added last if missing.
        memory_budget: bytes per rank (an int or a string such as ``"40GiB"``). The plan
            picks groups and each group's ``reshard_after_forward`` to fit, or raises a
            ``ValueError`` giving the smallest peak it can reach and what dominates it.
        mp_policy, offload_policy, reshard_after_forward: as for ``fully_shard``, applied
            to every call (``reshard_after_forward=None`` lets the planner choose: the
            runtime's default, or with a budget the fastest choice that fits).
        optimizer: an optimizer class or ``fn(params) -> Optimizer`` (its state and step
            temporaries are measured on fake shards); ``None`` for no optimizer.
        example_inputs: one rank's microbatch (tensors, real or on the meta device): a
            tensor, a tuple of positional arguments, or a dict of keyword arguments.
            Without it, activations are not predicted (the report says so).
        loss_fn: ``fn(output) -> scalar tensor``; default: the sum of the output.
        ignored_params: parameters left unsharded, as ``fully_shard``'s.
        grad_accumulation: microbatches per optimizer step, all but the last without
            gradient sync (``set_requires_gradient_sync(False)``).
        device_type: where compute runs ("cuda", "cpu"...): default the mesh's, else the
            model's device (the CPU for a meta model).
        min_group_bytes: automatic grouping merges consecutive modules into one group
            while it stays below this all-gather size; default from the collective
            latency and bandwidth of ``device_type`` (docs/planning.md).
    """
    started = time.perf_counter()
    info = read_model(model)
    shape = _mesh_shape(world_size, mesh, device_type, info)
    budget = parse_bytes(memory_budget, "memory_budget")
    min_bytes = parse_bytes(min_group_bytes, "min_group_bytes")
    mp = _mp_policy(mp_policy)
    offload = _offload_policy(offload_policy)
    reshard = _reshard(reshard_after_forward, shape)
    if not isinstance(grad_accumulation, int) or grad_accumulation < 1:
        raise ValueError(
            f"plan_sharding(grad_accumulation={grad_accumulation!r}): give the number of "
            f"microbatches per optimizer step, at least 1."
        )
    ignored = ignored_indices(info, ignored_params)
    if optimizer is not None and not callable(optimizer):
        raise TypeError(
            f"plan_sharding(optimizer=...) expects an optimizer class or a callable taking the "
            f"parameters, got {optimizer!r}."
        )
    planner = Planner(
        info,
        shape,
        mp_policy=mp,
        offload=isinstance(offload, CPUOffloadPolicy),
        optimizer=optimizer,
        example_inputs=example_inputs,
        loss_fn=loss_fn,
        ignored=ignored,
        microbatches=grad_accumulation,
        device=torch.device(shape.device_type),
    )
    if isinstance(groups, str):
        if groups != "auto":
            raise ValueError(
                f"plan_sharding(groups={groups!r}): pass 'auto' or a list of submodules or "
                f"FQNs (bottom-up, the root last)."
            )
        best = auto_groups(planner, reshard=reshard, budget=budget, min_group_bytes=min_bytes)
    else:
        chosen = resolve_groups(info, groups)
        cast_at = tuple(m for g in chosen for m in g)
        _check_called(planner, chosen, cast_at)
        best = fit_reshard(planner, chosen, reshard, budget, cast_inputs=cast_at)
        if budget is not None and best.result.peak_bytes > budget:
            raise smallest_peak_error(info, budget, best)
    return _build_plan(info, planner, best, shape, mp, offload, optimizer, budget, started, ignored)


def _check_called(
    planner: Planner, groups: list[tuple[int, ...]], cast_at: tuple[int, ...]
) -> None:
    """A group whose module's forward never runs would never be gathered."""
    trace = planner.trace(groups, cast_at)
    if not trace.traced:
        return
    for group in groups:
        for m in group:
            if trace.forward_calls(m) == 0 and m != 0:
                info = planner.info
                raise ValueError(
                    f"plan_sharding: the forward of {info.describe(m)} does not run in the "
                    f"traced step (a container such as ModuleList, or a module the forward "
                    f"skips), so fully_shard's hooks would never gather its parameters. "
                    f"Shard the modules it holds instead."
                )


def _build_plan(
    info: ModelInfo,
    planner: Planner,
    best: Evaluation,
    shape: MeshShape,
    mp: MixedPrecisionPolicy,
    offload: OffloadPolicy,
    optimizer: Any,
    budget: int | None,
    started: float,
    ignored: set[int],
) -> ShardingPlan:
    result = best.result
    group_plans = []
    for group, params, layout, setting, comm in zip(
        best.groups, best.params, best.layouts, best.reshard, result.comm
    ):
        group_plans.append(
            GroupPlan(
                modules=tuple(info.names[m] for m in group),
                reshard_after_forward=setting,
                num_params=len(params),
                sharded_bytes=layout.shard_bytes,
                unsharded_bytes=layout.unsharded_bytes,
                all_gather_count=comm.all_gather.count,
                all_gather_bytes=comm.all_gather.bytes,
                reduce_scatter_count=comm.reduce_scatter.count,
                reduce_scatter_bytes=comm.reduce_scatter.bytes,
                all_reduce_count=comm.all_reduce.count,
                all_reduce_bytes=comm.all_reduce.bytes,
            )
        )
    mesh_shape = (shape.shard,) if shape.replicate == 1 else (shape.replicate, shape.shard)
    opt_name = getattr(optimizer, "__name__", None) or type(optimizer).__name__
    return ShardingPlan(
        model=info.label,
        group_plans=group_plans,
        peak_bytes=result.peak_bytes,
        breakdown=dict(result.breakdown),
        peak_phase=result.peak_phase,
        peak_at=_describe_moment(info, best, result.peak_at),
        world_size=shape.world_size,
        mesh_shape=mesh_shape,
        device_type=shape.device_type,
        mp_policy=mp,
        offload_policy=offload,
        optimizer=opt_name if optimizer is not None else "none",
        memory_budget=budget,
        assumptions=_assumptions(planner, shape),
        ignored_params=tuple(info.params[p].fqn for p in sorted(ignored)),
        planning_seconds=time.perf_counter() - started,
        host_peak_bytes=result.host_peak_bytes,
    )


def _describe_moment(info: ModelInfo, best: Evaluation, where: str) -> str:
    """``'bwd_pre of group 3'`` with the group's module names."""
    match = re.fullmatch(r"(\w+) of group (\d+)", where)
    if not match:
        return where
    kind = {
        "fwd_pre": "pre-forward",
        "fwd_post": "post-forward",
        "bwd_pre": "pre-backward",
        "bwd_post": "post-backward",
    }.get(match.group(1), match.group(1))
    group = best.groups[int(match.group(2))]
    return f"{kind} of {', '.join(info.names[m] or '<root>' for m in group)}"


def _assumptions(planner: Planner, shape: MeshShape) -> list[str]:
    out = []
    if planner.example_inputs is None:
        out.append(
            "no example_inputs: activations and temporaries are NOT included (pass one "
            "rank's microbatch to predict them)"
        )
    else:
        out.append(
            "activations and temporaries: one forward, loss and backward of the example "
            "inputs traced under FakeTensorMode (live tensor bytes, by storage)"
        )
        if planner.trace_device.type != shape.device_type:
            out.append(
                f"traced on fake {planner.trace_device.type} tensors: this torch build has no "
                f"{shape.device_type}, and kernels that pick their algorithm by device "
                f"(attention) may hold other temporaries there; the optimizer step is run "
                f"with foreach=True, the {shape.device_type} default"
            )
    out.append("rank 0 (every rank's padded shard has the same size)")
    if shape.device_type == "cpu":
        out.append(
            "CPU: the runtime prefetches the next group's all-gather in forward, "
            "and pools buffers of 8 MiB and more"
        )
    held = {
        "gloo": "gloo copies each reduce-scatter input when issued and keeps the copy",
        "fake": "the fake process group keeps no reduce-scatter input",
    }.get(shape.backend or "", f"{shape.backend or 'the backend'} reads each reduce-scatter input")
    out.append(f"one reduce-scatter in flight; {held} until the next group's reduction")
    if planner.microbatches > 1:
        out.append(f"{planner.microbatches} microbatches per step, gradient sync on the last only")
    out.append(
        "not counted: allocator fragmentation and caching, CUDA context and library "
        "workspaces, memory a backend allocates outside PyTorch"
    )
    return out


def _mesh_shape(
    world_size: int | None, mesh: Any, device_type: str | None, info: ModelInfo
) -> MeshShape:
    backend: str | None = None
    if mesh is not None:
        if isinstance(mesh, (tuple, list)):
            dims = tuple(mesh)
            if not dims or len(dims) > 2 or not all(isinstance(d, int) for d in dims):
                raise ValueError(
                    f"plan_sharding(mesh={mesh!r}): give a DeviceMesh, or its shape: (shard,) "
                    f"for FSDP or (replicate, shard) for HSDP."
                )
            mesh_device = None
        else:
            dims = tuple(mesh.shape)
            if len(dims) > 2:
                raise ValueError(
                    f"plan_sharding: a {len(dims)}-D mesh; plan the data-parallel mesh "
                    f"(1-D, or 2-D replicate x shard for HSDP)."
                )
            mesh_device = mesh.device_type
            try:
                backend = str(dist.get_backend(mesh.get_group(mesh.ndim - 1)))
            except (RuntimeError, ValueError):
                backend = None
        for d in dims:
            if d < 1:
                raise ValueError(
                    f"plan_sharding: mesh shape {dims} has a dimension below 1; every "
                    f"dimension needs at least one rank."
                )
        total = 1
        for d in dims:
            total *= d
        if world_size is not None and world_size != total:
            raise ValueError(
                f"plan_sharding: world_size={world_size} but the mesh holds {total} ranks; "
                f"pass one of them."
            )
        replicate, shard = (1, dims[0]) if len(dims) == 1 else dims
    else:
        if world_size is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError(
                    "plan_sharding: pass world_size=N (or mesh=...): no process group is "
                    "initialized to take it from."
                )
            world_size = dist.get_world_size()
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(
                f"plan_sharding(world_size={world_size!r}): the world size must be an int of "
                f"at least 1."
            )
        replicate, shard = 1, world_size
        mesh_device = None
    device = device_type or mesh_device
    if device is None:
        first = next(iter(info.model.parameters())).device
        device = "cpu" if first.type == "meta" else first.type
    if backend is None:  # the default backend of the device type
        backend = {"cpu": "gloo", "cuda": "nccl"}.get(device)
    return MeshShape(shard=shard, replicate=replicate, device_type=device, backend=backend)


def parse_bytes(value: int | str | None, what: str) -> int | None:
    """``40GiB``, ``512 MiB``, ``1.5GB``, ``123`` (bytes), or None."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"plan_sharding({what}=...) expects bytes, got {value!r}.")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"plan_sharding({what}={value!r}): must be positive.")
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?)[bB]?\s*", str(value))
    if not match:
        raise ValueError(
            f"plan_sharding({what}={value!r}): give bytes as an int or a string such as "
            f"'40GiB', '512MiB' or '80GB'."
        )
    number, prefix, binary = match.groups()
    exponent = "kmgt".index(prefix.lower()) + 1 if prefix else 0
    unit = (1024 if binary else 1000) ** exponent
    nbytes = int(float(number) * unit)
    if nbytes <= 0:
        raise ValueError(f"plan_sharding({what}={value!r}): must be positive.")
    return nbytes


def _mp_policy(policy: Any) -> MixedPrecisionPolicy:
    if policy is None:
        return MixedPrecisionPolicy()
    from fsdp2._policies import validate_mp_policy

    return validate_mp_policy(policy)


def _offload_policy(policy: Any) -> OffloadPolicy:
    if policy is None:
        return OffloadPolicy()
    from fsdp2._policies import validate_offload_policy

    return validate_offload_policy(policy)


def _reshard(value: Any, shape: MeshShape) -> Reshard | None:
    """``reshard_after_forward`` as ``fully_shard`` normalizes it for the shard size."""
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise TypeError(
            f"plan_sharding(reshard_after_forward=...) expects True, False, None or an int, "
            f"got {value!r}."
        )
    if value < 1 or shape.shard % value:
        raise ValueError(
            f"plan_sharding(reshard_after_forward={value}): an int must be a positive divisor "
            f"of the shard group size {shape.shard}."
        )
    if value == shape.shard:
        return True
    if value == 1:
        return False
    return value


__all__ = ["format_bytes", "parse_bytes", "plan_sharding"]
