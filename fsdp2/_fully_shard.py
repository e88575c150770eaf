"""The public API: ``fully_shard``, ``FSDPModule`` and ``register_fsdp_forward_method``.

``fully_shard`` does not wrap the module. It replaces parameters in place with DTensor
shards, registers hooks, and changes ``type(module)`` to a subclass ``FSDP<Name>`` of both
the original class and ``FSDPModule``, so the module keeps its methods, FQNs and
``state_dict()`` keys and gains the FSDP control methods.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any, cast, overload

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp2._collectives import (
    BackendAllocatedAllGather,
    BackendAllocatedReduceScatter,
    backend_allocates,
)
from fsdp2._comm_context import CommContext
from fsdp2._comm_records import Phase
from fsdp2._init import (
    check_param_device,
    check_reshard_after_forward_type,
    collect_params,
    mark_composable,
    mark_managed,
    mark_managed_modules,
    mark_replaced,
    mesh_device,
    move_states_to_device,
    placement_of,
    post_forward_group,
    resolve_mesh,
    validate_modules,
    validate_reshard_after_forward,
    validate_shard_placement_fn,
)
from fsdp2._param import ShardedParam
from fsdp2._param_group import ParamGroup
from fsdp2._policies import (
    MixedPrecisionPolicy,
    OffloadPolicy,
    ReducePolicy,
    validate_mp_policy,
    validate_offload_policy,
    validate_reduce_policy,
)
from fsdp2._reduction import plan_reduction
from fsdp2._spmd import SpmdMesh, check_spmd_param, resolve_spmd_mesh
from fsdp2._state import FSDPState, TrainingState, explain_sharded_call, fsdp_state_of

_FSDP_CLASSES: dict[type, type] = {}


@overload
def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: Any | None = ...,
    reduce_policy: ReducePolicy | None = ...,
) -> FSDPModule: ...
@overload
def fully_shard(
    module: list[nn.Module],
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: Any | None = ...,
    reduce_policy: ReducePolicy | None = ...,
) -> list[FSDPModule]: ...


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 (frozen)
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: Any | None = None,
    reduce_policy: ReducePolicy | None = None,
) -> FSDPModule | list[FSDPModule]:
    """Shard ``module``'s parameters over ``mesh`` and make it an ``FSDPModule``.

    Apply bottom-up: each transformer block, then the root. Each call forms one
    communication group from the parameters not already managed by a call on a submodule:
    one all-gather before forward (and before backward if resharded), one reduce-scatter
    of its gradients after backward. A list of modules forms one group for all of them.

    Args:
        module: the module, or a list of modules sharing one group.
        mesh: a 1-D ``DeviceMesh``; defaults to all ranks on the default device type.
        reshard_after_forward: free the unsharded parameters after forward (``True``) and
            all-gather again in backward, or keep them (``False``). ``None``: ``True``
            except for the root, whose parameters backward needs first. An int ``N``
            (dividing the shard group size) keeps 1/N of each parameter after forward,
            so backward all-gathers within groups of N ranks (e.g. one node).
        shard_placement_fn: ``fn(param) -> Shard(dim) | None`` picks each parameter's
            sharded dim (``None``: dim 0). Dims other than 0 need sizes divisible by the
            shard group size. Shards, gradients and unsharded parameters are contiguous,
            as in torch. Returning torch's ``ShardPlacementResult(placement, mesh_info)``
            shards that parameter over a mesh of its own (e.g. MoE experts); the call then
            makes one group per mesh (see docs/meshes.md).
        mp_policy: all-gather, compute and reduce dtypes; see ``MixedPrecisionPolicy``.
        offload_policy: ``CPUOffloadPolicy()`` keeps shards and gradients in CPU memory.
        ignored_params: parameters to leave unsharded and unmanaged.
        dp_mesh_dims: torch >= 2.12's ``DataParallelMeshDims(shard=..., replicate=...)``
            naming the data-parallel dims of ``mesh`` (torch's SPMD mode): the parameters
            are ``DTensor``s on ``mesh``, replicated over those dims and laid out by the
            user over the others (TP), and the forward computes with ``DTensor``s.
            Several shard (or replicate) dims are flattened; replicate only is DDP. See
            docs/spmd.md.
        reduce_policy: fsdp2 only: how gradients are summed over ranks, e.g.
            ``ReducePolicy(comm_dtype=torch.bfloat16, accumulate_dtype=torch.float32)``
            (bf16 on the wire, fp32 sums) or ``ReducePolicy(deterministic=True)``; see
            ``ReducePolicy`` and docs/reduction.md. ``None``: a reduce-scatter in the
            reduce dtype, as torch.

    Returns:
        The same module object(s), now also instances of ``FSDPModule``.
    """
    modules = validate_modules(module)
    check_reshard_after_forward_type(reshard_after_forward)
    validate_shard_placement_fn(shard_placement_fn)
    mp_policy = validate_mp_policy(mp_policy)
    offload_policy = validate_offload_policy(offload_policy)
    policy = validate_reduce_policy(reduce_policy, "fully_shard(reduce_policy=...)")
    spmd = None
    if dp_mesh_dims is not None:
        spmd = resolve_spmd_mesh(mesh, dp_mesh_dims)
        if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
            raise NotImplementedError(
                "fully_shard: reshard_after_forward as int is not supported with an SPMD "
                "mesh (dp_mesh_dims), as in torch; pass True or False."
            )
        mesh = spmd.dp_mesh
    mesh = resolve_mesh(mesh)
    reshard_after_forward = validate_reshard_after_forward(reshard_after_forward, mesh)
    device = mesh_device(mesh)
    label = ", ".join(type(m).__name__ for m in modules)
    found, shared_with_other_call = collect_params(modules, ignored_params)
    groups = _build_groups(
        found,
        mesh,
        device,
        label,
        shard_placement_fn,
        reshard_after_forward,
        mp_policy,
        offload_policy,
        spmd,
    )
    _set_reduce_policy(groups, policy)
    move_states_to_device(modules, device)
    state = FSDPState(
        modules, groups, mesh, device, reshard_after_forward, mp_policy, offload_policy
    )
    state.shared_with_other_call = shared_with_other_call
    for m in modules:
        m._fsdp_state = state  # type: ignore[assignment]
        m.__class__ = _fsdp_class(type(m))
    mark_composable(modules)
    mark_managed_modules(modules)
    # Each module's class is now an FSDPModule subclass (assigned just above).
    fsdp_modules = [cast(FSDPModule, m) for m in modules]
    return fsdp_modules if isinstance(module, (list, tuple)) else fsdp_modules[0]


def _composable_state(module: nn.Module) -> FSDPState | None:
    """``fully_shard.state(module)``: the state the ``fully_shard`` call on ``module`` made
    (one per call, shared by a list of modules), or None, as torch's composable-API
    accessor returns. Its attributes are fsdp2's own, not torch's private ones."""
    return fsdp_state_of(module)


fully_shard.state = _composable_state  # type: ignore[attr-defined]


def _build_groups(
    found: list[tuple[nn.Parameter, list[Any], str]],
    mesh: DeviceMesh,
    device: torch.device,
    label: str,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None,
    reshard_after_forward: bool | int | None,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
    spmd: SpmdMesh | None = None,
) -> list[ParamGroup]:
    """One ``ParamGroup`` per mesh the parameters are sharded over: ``mesh``, plus any
    per-parameter mesh ``shard_placement_fn`` returns ([Note: per-parameter meshes] in
    ``_state``), in the order of their first parameter."""
    for param, _, fqn in found:
        check_param_device(param, fqn, device)
    by_mesh: dict[tuple[Any, ...], tuple[DeviceMesh, list[tuple[Any, ...]]]] = {}
    resolved: dict[int, tuple[DeviceMesh, SpmdMesh | None]] = {}
    for param, uses, fqn in found:
        dim, param_mesh, param_spmd = placement_of(
            shard_placement_fn, param, fqn, mesh, resolved, spmd
        )
        if param_spmd is not None:
            check_spmd_param(param, param_spmd, fqn)
        key = _mesh_key(param_mesh)
        if key not in by_mesh:
            by_mesh[key] = (param_mesh, [])
        by_mesh[key][1].append((param, uses, fqn, dim, param_spmd))
    groups = []
    for index, (group_mesh, members) in enumerate(by_mesh.values()):
        if group_mesh.device_type != mesh.device_type:
            raise ValueError(
                f"fully_shard on {label}: a per-parameter mesh is on {group_mesh.device_type}, "
                f"the module's mesh on {mesh.device_type}; use one device type."
            )
        # Trainable parameters first: the reduce-scatter then covers a prefix.
        members.sort(key=lambda item: not item[0].requires_grad)
        sharded: list[ShardedParam] = []
        offset = 0
        for param, uses, fqn, dim, param_spmd in members:
            sp = ShardedParam(param, uses, fqn, group_mesh, offset, dim, param_spmd)
            offset += sp.padded_numel
            sharded.append(sp)
        group_label = label
        if len(by_mesh) > 1:
            names = ", ".join(group_mesh.mesh_dim_names or ()) or f"group {index}"
            group_label = f"{label} [{names}]"
        group = ParamGroup(
            sharded,
            [item[0] for item in members],
            group_mesh,
            device,
            group_label,
            mp_policy,
            offload_policy,
        )
        # Mark the replaced originals too: another module may still hold one (a weight tied
        # across groups), and sharding it again would silently untie the weights.
        mark_managed([sp.sharded_param for sp in sharded] + [item[0] for item in members], label)
        mark_replaced([(item[0], item[2]) for item in members], label)
        if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
            size = reshard_after_forward
            if group_mesh is not mesh:
                normalized = validate_reshard_after_forward(size, group_mesh)
                size = 0 if normalized is True else int(normalized or 0)
            if size > 1:
                subgroup, rank_in_subgroup = post_forward_group(group_mesh, size)
                group.set_post_forward_group(subgroup, size, rank_in_subgroup)
        groups.append(group)
    return groups


def _mesh_key(mesh: DeviceMesh) -> tuple[Any, ...]:
    """Parameters sharded over the same process groups share one group."""
    shard = mesh.get_group(mesh.ndim - 1)
    replicate = mesh.get_group(0) if mesh.ndim == 2 else None
    return (id(shard), id(replicate))


def _fsdp_class(cls: type[nn.Module]) -> type:
    """``FSDP<Name>``: subclass of ``FSDPModule`` and ``cls``, created once per class."""
    cached = _FSDP_CLASSES.get(cls)
    if cached is not None:
        return cached

    @functools.wraps(cls.forward)
    def forward(self: FSDPModule, *args: Any, **kwargs: Any) -> Any:
        # ``self`` is an FSDP<Name> instance: installed on that class only.
        original_forward = _original(self, "forward")
        state = self._fsdp_state
        if state.training_state is TrainingState.IDLE and any(
            not group.is_unsharded for group in state.groups
        ):
            raise RuntimeError(
                f"{type(self).__name__}.forward() was called directly, bypassing fully_shard's "
                f"hooks, while its parameters are sharded. Call the module, module(...), "
                f"instead; or call module.unshard() first; or register the method with "
                f"fsdp2.register_fsdp_forward_method(module, 'forward')."
            )
        if torch.compiler.is_compiling():
            return original_forward(*args, **kwargs)
        try:
            return original_forward(*args, **kwargs)
        except RuntimeError as error:
            explained = explain_sharded_call(cast(nn.Module, self), error)
            if explained is None:
                raise
            raise explained from error

    namespace: dict[str, Any] = {"forward": forward, "_fsdp_original_cls": cls}
    for name, method in _public_methods(cls).items():
        namespace[name] = _explain_sharded_errors(name, method)
    metaclass: type[type] = type(cls)  # usually ``type``; a custom metaclass is kept
    fsdp_cls = metaclass(f"FSDP{cls.__name__}", (FSDPModule, cls), namespace)
    _FSDP_CLASSES[cls] = fsdp_cls
    return fsdp_cls


def _original(module: Any, name: str) -> Any:
    """``module.name`` as the module's original class resolves it, bound to ``module``.

    [Note: methods looked up at call time]
    ``FSDP<Name>`` defines ``forward`` and wrappers of the class's public methods (to
    explain calls on sharded parameters), and torch's only adds ``FSDPModule`` to the
    class's bases, so a library that patches the original class (Liger-Kernel's
    ``LlamaForCausalLM.forward = ...``, unsloth, test fixtures) reaches modules sharded
    with torch whenever it patches. So the wrappers look the method up on each call,
    past ``FSDPModule`` in the instance's MRO (``super(FSDPModule, module)``: the
    original class and its bases, with the descriptor protocol, so a static or class
    method patched in is bound as Python would bind it), never holding the function
    they found when the class was made."""
    return getattr(super(FSDPModule, module), name)


def _public_methods(cls: type) -> dict[str, Callable[..., Any]]:
    """Plain public methods a user class defines (not nn.Module's or FSDPModule's own,
    not forward: ``FSDPModule``'s come first in ``FSDP<Name>``'s MRO, as in torch)."""
    methods: dict[str, Callable[..., Any]] = {}
    for klass in reversed(cls.__mro__):
        if klass in (object, nn.Module) or issubclass(nn.Module, klass):
            continue
        for name, value in vars(klass).items():
            if (
                name.startswith("_")
                or name == "forward"
                or hasattr(nn.Module, name)
                or hasattr(FSDPModule, name)
            ):
                continue
            if inspect.isfunction(value):
                methods[name] = value
            else:
                methods.pop(name, None)  # overridden by a non-function
    return methods


def _explain_sharded_errors(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """Turn DTensor's "mixed torch.Tensor and DTensor" error, raised when a method that
    fully_shard's hooks do not cover computes on sharded parameters, into advice. The
    method is looked up on each call ([Note: methods looked up at call time])."""

    @functools.wraps(method)
    def wrapper(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        try:
            return _original(self, name)(*args, **kwargs)
        except RuntimeError as error:
            state = fsdp_state_of(self)
            groups = state.groups if state is not None else ()
            if all(g.is_unsharded for g in groups) or "DTensor" not in str(error):
                raise
            raise RuntimeError(
                f"{type(self).__name__}.{name}() computed on sharded parameters: "
                f"fully_shard only all-gathers around forward. Register the method with "
                f"fsdp2.register_fsdp_forward_method(module, {name!r}), or, for "
                f"read-only use, call module.unshard() before it and module.reshard() after "
                f"(writes to unsharded parameters are not copied back to the shards)."
            ) from error

    return wrapper


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` completes the unshard."""

    def __init__(self, groups: tuple[ParamGroup, ...]) -> None:
        self._groups = groups

    def wait(self) -> None:
        for group in self._groups:
            group.wait_for_unshard()
        self._groups = ()


class DeepcopyUnsupportedError(RuntimeError, AssertionError):
    """``copy.deepcopy`` of a sharded module. A ``RuntimeError``, and an ``AssertionError``
    as torch raises, so code that catches either keeps working after switching by import."""


class CustomCommConflictError(RuntimeError, AssertionError):
    """``set_allocate_memory_from_process_group_for_comm`` on a module with a custom
    all-gather or reduce-scatter. A ``RuntimeError``, and an ``AssertionError`` as torch
    raises, so code that catches either keeps working after switching by import."""


class FSDPModule:
    """Methods every sharded module gains. Instances are made only by ``fully_shard``."""

    _fsdp_state: FSDPState

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """Constructing an ``FSDP<Name>`` class directly builds a plain ``<Name>``, as in
        torch: ``nn.Sequential`` slicing (``model[:2]``) calls ``type(self)(...)``, and
        the slice is a new module that ``fully_shard`` never saw (no state, no hooks).
        Without arguments (``copy.copy`` and unpickling create the object first, then
        fill its ``__dict__``) the class is kept, so shallow copies stay sharded modules."""
        original = cls.__dict__.get("_fsdp_original_cls")
        if original is None or not (args or kwargs):
            return super().__new__(cls)
        module = original.__new__(original, *args, **kwargs)
        # Python runs __init__ only for instances of ``cls``: run the original's here.
        module.__init__(*args, **kwargs)
        return module

    # -- parameters ------------------------------------------------------------------------
    def reshard(self) -> None:
        """Free the unsharded parameters and register the sharded ones again. In-place
        changes made to the unsharded parameters since they were gathered are first
        written back to the shards (torch drops them; see docs/control.md)."""
        for group in self._fsdp_state.groups:
            group.reshard()

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather the parameters. With ``async_op=True`` return a handle whose
        ``wait()`` finishes the unshard; the next forward waits for it otherwise."""
        state = self._fsdp_state
        state.lazy_init()
        # Called by the user, possibly right after the optimizer step: gather only after
        # the compute stream's writes to the shards (a no-op on the CPU).
        for group in state.groups:
            group.unshard(after_compute=True, phase=Phase.UNSHARD)
        if async_op:
            return UnshardHandle(state.groups)
        for group in state.groups:
            group.wait_for_unshard()
        return None

    # -- scheduling switches ---------------------------------------------------------------
    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                f"set_reshard_after_forward expects a bool, got {reshard_after_forward!r}."
            )
        for state in self._states(recurse):
            state.reshard_after_forward_setting = reshard_after_forward
            state.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        for state in self._states(recurse):
            for group in state.groups:
                group.reshard_after_backward = reshard_after_backward

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        for state in self._states(recurse):
            for group in state.groups:
                group.requires_gradient_sync = requires_gradient_sync

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this module's reduced gradients by ``factor`` instead of the number of
        data-parallel ranks (this module's own group only, not its FSDP submodules)."""
        if not isinstance(factor, (int, float)) or factor <= 0:
            raise ValueError(
                f"set_gradient_divide_factor expects a positive number, got {factor!r}."
            )
        for group in self._fsdp_state.groups:
            group.gradient_divide_factor = float(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce with a plain SUM collective (no AVG / pre-multiplied sum), for backends
        that support only SUM; gradients are still divided afterwards. This module's group
        only, like ``set_gradient_divide_factor``."""
        for group in self._fsdp_state.groups:
            group.force_sum_reduction = enable

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        self._fsdp_state.forward_prefetch = [
            _state_of(m, "set_modules_to_forward_prefetch") for m in modules
        ]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        self._fsdp_state.backward_prefetch = [
            _state_of(m, "set_modules_to_backward_prefetch") for m in modules
        ]

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """``False`` for modules whose parameters backward does not use (e.g. an embedding
        whose input needs no grad): skip their backward prefetch."""
        self._fsdp_state.unshard_in_backward = unshard_in_backward

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Older name of ``set_gradient_divide_factor``."""
        self.set_gradient_divide_factor(factor)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: whether to all-reduce across replicas (no effect on a 1-D mesh)."""
        for state in self._states(recurse):
            for group in state.groups:
                group.requires_all_reduce = requires_all_reduce

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """``False`` leaves reductions in flight at the end of backward (microbatches that
        do not sync anyway); the last backward of a step must be ``True``, the default.
        A root-level setting: call it on the root module."""
        self._fsdp_state.is_last_backward = is_last_backward

    def set_post_optim_event(self, event: Any) -> None:
        """Make the next forward's all-gathers wait for ``event`` (recorded after the
        optimizer step) instead of for the whole compute stream. Call it on the root."""
        self._fsdp_state.post_optim_event = event

    def set_all_reduce_hook(
        self, hook: Callable[[torch.Tensor], None], *, stream: Any | None = None
    ) -> None:
        """Call ``hook(flat_grad_shard)`` on each group's reduced (and divided) gradient
        shard, in place, before it is stored, e.g. for a custom reduction over another
        mesh dimension. This module's own group only. ``stream``: run it there (accelerators only)."""
        if not callable(hook):
            raise ValueError(f"set_all_reduce_hook expects a callable, got {hook!r}.")
        for group in self._fsdp_state.groups:
            group.all_reduce_hook = hook
            group.all_reduce_hook_stream = stream

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """How many reduce-scatters (and their input buffers) may be in flight at once;
        default 1, like torch: more lets a group's gradient copy-in skip waiting for the
        previous reduce-scatter when communication is slower than backward compute, at
        the price of one more input buffer each. The limit belongs to the communication
        context the whole tree shares: as in torch, it is the largest value set on any of
        the tree's modules (``recurse=False`` on one block raises it for all)."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(
                f"set_reduce_scatter_max_input_buffers expects an int >= 1, "
                f"got {type(max_input_buffers).__name__} {max_input_buffers!r}."
            )
        if max_input_buffers < 1:
            raise ValueError(
                f"set_reduce_scatter_max_input_buffers expects an int >= 1, "
                f"got {max_input_buffers!r}."
            )
        for state in self._states(recurse):
            state.max_reduces_in_flight = max_input_buffers
            tree = state.tree
            if tree is not None:  # after lazy init: resolve the shared limit again
                tree.comm.max_reduces_in_flight = max(s.max_reduces_in_flight for s in tree.states)

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """``True``: every trainable parameter of a group that reduces gets a gradient,
        zeros where no rank used it (as torch). ``False`` (the default): a parameter no
        rank used keeps ``grad is None``. fsdp2 always includes parameters without a local
        gradient (as zeros) in their group's reduce-scatter, because which parameters a
        rank used can differ between ranks and a rank-dependent collective size would
        hang; this switch only decides whether the unused ones store the result."""
        if not isinstance(reduce_scatter_unused_params, bool):
            raise ValueError(
                f"set_reduce_scatter_unused_params expects a bool, got "
                f"{reduce_scatter_unused_params!r}."
            )
        for state in self._states(recurse):
            for group in state.groups:
                group.reduce_scatter_unused = reduce_scatter_unused_params

    def set_custom_all_gather(self, comm: Any) -> None:
        """Issue this module's all-gathers with ``comm``, torch's ``AllGather``:
        ``comm.allocate(size, dtype=, device=)`` makes the output buffer and
        ``comm(output, input, group=, async_op=)`` runs the collective (e.g. on symmetric
        memory). fsdp2 then copies the output into the unsharded parameters, also where
        it would otherwise gather into them in place. This module's groups only."""
        _check_comm(comm, "set_custom_all_gather", self)
        for group in self._fsdp_state.groups:
            group.custom_all_gather = comm

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Issue this module's gradient reduce-scatters with ``comm``, torch's
        ``ReduceScatter``: ``comm.allocate`` makes the input and output buffers and
        ``comm(output, input, group=, op=, async_op=)`` runs the collective. This
        module's groups only."""
        _check_comm(comm, "set_custom_reduce_scatter", self)
        for group in self._fsdp_state.groups:
            if group.reduce_policy is not None:
                raise ValueError(
                    f"{type(self).__name__}.set_custom_reduce_scatter: {group.label} has a "
                    f"ReducePolicy ({group.reduce_policy}), which decides how fsdp2 sums "
                    f"its gradients, while a custom reduce-scatter replaces that sum: use "
                    f"one or the other (set_reduce_policy(None) first to use the custom one)."
                )
        for group in self._fsdp_state.groups:
            group.custom_reduce_scatter = comm

    def set_reduce_policy(self, policy: ReducePolicy | None, *, recurse: bool = True) -> None:
        """How gradients are summed over ranks from the next reduction on: e.g.
        ``ReducePolicy(comm_dtype=torch.bfloat16, accumulate_dtype=torch.float32)`` (bf16
        on the wire, fp32 sums) or ``ReducePolicy(deterministic=True)`` (sums in rank
        order, bitwise reproducible); ``None``: a reduce-scatter in the reduce dtype (the
        default). fsdp2 only; see docs/reduction.md. Refused on a module with a custom
        reduce-scatter (``set_custom_reduce_scatter``), which would replace the sum."""
        policy = validate_reduce_policy(policy, f"{type(self).__name__}.set_reduce_policy")
        _set_reduce_policy([g for s in self._states(recurse) for g in s.groups], policy)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Allocate this module's all-gather outputs and reduce-scatter buffers with the
        process group backend's own allocator where it has one (NCCL: zero-copy transfers
        over NVLink SHARP / InfiniBand), through the same path as
        ``set_custom_all_gather`` / ``set_custom_reduce_scatter``. Backends without one
        (gloo) keep the default buffers, as torch falls back to ``torch.empty``: the
        call is then accepted and changes nothing. Not combinable with a custom
        all-gather or reduce-scatter. This module's groups only."""
        if not isinstance(enable, bool):
            raise TypeError(
                f"{type(self).__name__}.set_allocate_memory_from_process_group_for_comm "
                f"expects a bool, got {enable!r}."
            )
        ours = (BackendAllocatedAllGather, BackendAllocatedReduceScatter)
        for group in self._fsdp_state.groups:
            custom = [group.custom_all_gather, group.custom_reduce_scatter]
            if any(c is not None and not isinstance(c, ours) for c in custom):
                raise CustomCommConflictError(
                    f"{type(self).__name__}.set_allocate_memory_from_process_group_for_comm: "
                    f"this module has a custom all-gather or reduce-scatter "
                    f"(set_custom_all_gather / set_custom_reduce_scatter), which allocates "
                    f"its own buffers; use one or the other."
                )
            if enable and backend_allocates(group.process_group, group.device):
                group.custom_all_gather = BackendAllocatedAllGather(group.process_group)
                group.custom_reduce_scatter = BackendAllocatedReduceScatter(group.process_group)
            elif not enable:
                group.custom_all_gather = group.custom_reduce_scatter = None

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> None:
        """Give the gradient reduce-scatters a process group of their own (the same
        ranks as the shard group), so a reduce-scatter can progress while the next
        all-gather does, on backends that run one collective at a time per group (NCCL's
        communicator, gloo's context). ``False`` goes back to the shared group. Creating
        a group is collective among its ranks: call it on every rank, like
        ``fully_shard``. Groups over the same ranks share one new group."""
        if not isinstance(enable, bool):
            raise ValueError(f"set_separate_reduce_scatter_group expects a bool, got {enable!r}.")
        created: dict[tuple[int, ...], Any] = {}
        for state in self._states(recurse):
            for group in state.groups:
                if not enable:
                    group.reduce_scatter_group = None
                    continue
                ranks = tuple(dist.get_process_group_ranks(group.process_group))
                if ranks not in created:
                    created[ranks] = group.reduce_scatter_group or dist.new_group(
                        list(ranks), use_local_synchronization=True
                    )
                group.reduce_scatter_group = created[ranks]

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """torch's private switch, called by some training recipes: issue the pre-forward and
        pre-backward all-gathers with ``async_op=True``. fsdp2 always issues them
        asynchronously (on a side stream, or on gloo's threads on the CPU), so either value
        keeps that behaviour."""
        if not isinstance(async_op, bool):
            raise TypeError(
                f"{type(self).__name__}._set_unshard_async_op expects a bool, got {async_op!r}."
            )

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        raise NotImplementedError(
            f"{type(self).__name__}.set_symm_mem_for_comm: symmetric-memory collectives are "
            f"not supported by fsdp2 yet (backend={backend!r}). Drop the call to keep the "
            f"default collectives, or allocate the communication buffers from symmetric "
            f"memory yourself with set_custom_all_gather / set_custom_reduce_scatter."
        )

    def reset_iter_state(self) -> None:
        """Recover after an exception in the middle of a step: reshard everything, drop
        partial gradients and per-iteration bookkeeping."""
        self._fsdp_state.reset_iter_state()

    def _states(self, recurse: bool) -> Iterable[FSDPState]:
        if not recurse:
            return [self._fsdp_state]
        seen: dict[int, FSDPState] = {}
        for module in self.modules():  # type: ignore[attr-defined]
            state = fsdp_state_of(module)
            if state is not None:
                seen.setdefault(id(state), state)
        return list(seen.values())

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """``module.to()``, ``to_empty()``, ``half()``... replace the local tensors; point
        the shards back into (new) flat buffers so the all-gather input stays one buffer.
        Reshards first, as torch does: the conversion applies to the sharded parameters (an
        unsharded parameter left registered by ``reshard_after_forward=False`` would be
        converted instead, and the change lost at the next reshard)."""
        states = self._states(recurse)
        _check_no_pending_grads_converted(states, fn)
        for state in states:
            for group in state.groups:
                group.reshard()
        result = super()._apply(fn, recurse)  # type: ignore[misc]
        for state in states:
            for group in state.groups:
                group.ensure_shards_bound()
        return result

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise DeepcopyUnsupportedError(
            f"FSDP does not support deepcopy: copy.deepcopy of a sharded {type(self).__name__} "
            f"would share process groups and hooks with the original. Deep-copy the module "
            f"before fully_shard, then shard the copy (or use the state dict to serialize)."
        )


def _check_no_pending_grads_converted(
    states: Iterable[FSDPState], fn: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """Refuse a ``module.to()`` / ``half()`` that would change the dtype or device of a
    parameter holding gradients summed by backwards without gradient sync and not reduced
    yet: they live outside the registered parameters, so the conversion cannot carry them
    and they would be dropped (torch raises here too). Checked before anything changes;
    a conversion that leaves every such parameter as it is (``float()`` on fp32) passes."""
    for state in states:
        for group in state.groups:
            if not group.grads_unsynced:
                continue
            for p in group.params:
                unsharded = p.unsharded_param
                has_pending = p.accumulated_grad is not None or (
                    unsharded is not None and unsharded.grad is not None
                )
                if not has_pending:
                    continue
                local = p.local_tensor()
                probe = fn(torch.empty(0, dtype=local.dtype, device=local.device))
                if probe.dtype == local.dtype and probe.device == local.device:
                    continue
                raise RuntimeError(
                    f"fully_shard: cannot convert parameter '{p.fqn}' from {local.dtype} on "
                    f"{local.device} to {probe.dtype} on {probe.device}: it holds gradients "
                    f"accumulated without gradient sync that are not reduced yet. Finish the "
                    f"step (a backward with gradient sync, then zero_grad(set_to_none=True)) "
                    f"or drop them with reset_iter_state() before converting the module."
                )


def _set_reduce_policy(groups: list[ParamGroup], policy: ReducePolicy | None) -> None:
    """Give ``groups`` the reduce policy, after checking all of them (nothing changes if
    one refuses it): no custom reduce-scatter, and dtypes that resolve (a field left at
    ``None`` must not put a wider dtype on the wire than the explicit accumulate one)."""
    for group in groups if policy is not None else ():
        name = group.where if group.path else group.label  # paths are known at lazy init
        custom = group.custom_reduce_scatter
        if custom is not None and not isinstance(custom, BackendAllocatedReduceScatter):
            raise ValueError(
                f"set_reduce_policy: {name} has a custom reduce-scatter "
                f"(set_custom_reduce_scatter), which replaces the sum of the gradients that "
                f"a ReducePolicy configures: use one or the other, e.g. "
                f"set_reduce_policy(policy, recurse=False) on the modules without one."
            )
        positions = group.reduced_positions() or tuple(range(len(group.params)))
        if positions:
            plan_reduction(policy, group.default_reduce_dtype(positions), name)
    for group in groups:
        group.reduce_policy = policy


def _check_comm(comm: Any, api: str, module: object) -> None:
    if not callable(comm) or not callable(getattr(comm, "allocate", None)):
        raise TypeError(
            f"{type(module).__name__}.{api} expects a communication object with an "
            f"allocate(size, *, dtype, device) method and a __call__ that issues the "
            f"collective (torch's AllGather / ReduceScatter), got {type(comm).__name__}."
        )


def _state_of(module: object, api: str) -> FSDPState:
    if not isinstance(module, FSDPModule):
        raise ValueError(
            f"{api} expects modules that fully_shard was applied to, got {type(module).__name__}."
        )
    return module._fsdp_state


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Let several separately-rooted sharded modules (e.g. a model and its EMA copy, or
    pipeline stages in one process) share communication streams and buffers. Call before
    their first forward. An empty list does nothing, as in torch."""
    if not modules:
        return
    states = [_state_of(m, "share_comm_ctx") for m in modules]
    for state in states:
        if state.tree is not None:
            raise RuntimeError(
                f"share_comm_ctx: {state.label} already ran its first forward; call "
                f"share_comm_ctx before any forward."
            )
    comm = CommContext(states[0].device)
    for state in states:
        state.shared_comm = comm


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>(...)`` run the same pre/post-forward logic as a call,
    e.g. for ``generate`` methods that do not go through ``forward``."""
    if not isinstance(module, FSDPModule):
        raise ValueError(
            f"register_fsdp_forward_method expects a module fully_shard was applied to, got "
            f"{type(module).__name__}."
        )
    method = getattr(module, method_name, None)
    if not callable(method):
        raise ValueError(
            f"{type(module).__name__} has no method named {method_name!r} to register."
        )
    state = module._fsdp_state

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if state.training_state is not TrainingState.IDLE:
            return method(*args, **kwargs)  # already inside this module's forward
        args, kwargs = state.pre_forward(args, kwargs)
        output = method(*args, **kwargs)
        return state.post_forward(output)

    setattr(module, method_name, wrapped)
