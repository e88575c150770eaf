"""What ``fully_shard`` does before any hook runs: check the arguments, choose the mesh
and device, and find the parameters this call manages.

Discovery rule (bottom-up grouping): a call manages every parameter registered in its
module(s)' subtrees, except those inside a submodule that an earlier call already
sharded or that torch's composable ``replicate()`` manages, and except
``ignored_params``. A parameter registered in several places (tied weights) is managed
once, with every registration recorded so all of them are swapped.

[Note: optimizers created before fully_shard]
``fully_shard`` registers new parameter objects (``DTensor`` shards) in place of the
module's. An optimizer built before the call still holds the originals, which no forward
uses and no gradient reaches: its steps change nothing and training silently stalls, with
the originals' full memory kept alive (torch's ``fully_shard`` behaves the same). So the
originals are marked, and a global optimizer step pre-hook (installed by the first call)
looks once per optimizer, and again when its number of parameter groups changes, for
marked parameters; it raises instead of letting the step do nothing. The same hook first
finishes reductions that backwards under ``set_is_last_backward(False)`` left in flight
(``finish_all_reductions``): their gradients are assigned only when finished.

The same check catches an optimizer built from ``model.parameters()`` while a group was
gathered: a forward that leaves its parameters unsharded (an eval or ``no_grad`` forward
with ``reshard_after_forward=False``, the root's default; or ``unshard()``) keeps the
unsharded parameters registered on the modules, and fsdp2 frees and refills those, never
updates them from gradients. torch's ``fully_shard`` lets such an optimizer step without
effect on the root's parameters (often the embeddings and the output head); fsdp2 raises,
naming them and the two fixes.
"""

from __future__ import annotations

import importlib
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard

from fsdp2._comm_context import (
    finish_all_reductions,
    order_step_after_all_gathers,
    refuse_step_over_failed,
)
from fsdp2._fingerprints import settle as settle_fingerprints
from fsdp2._param import UNSHARDED_ATTR, UnevenShardError, Use
from fsdp2._spmd import SpmdMesh, resolve_spmd_mesh
from fsdp2._state import fsdp_state_of
from fsdp2._unsharded_upkeep import release_graph_holds

# Parameters already managed by some group -> that group's label; shared across groups is
# an error (their gradient would be reduced twice and their values diverge).
# The label of the fully_shard call that manages a parameter is stored as an attribute on the
# parameter itself rather than in a weak-keyed registry: nn.Module._apply swaps DTensor
# parameters with torch.utils.swap_tensors, which refuses tensors that have weak references.
# The attribute lives in the tensor's __dict__, which the swap carries over.
_OWNER_ATTR = "_fsdp2_managed_by"
# On the parameters a call replaced: "'fqn' (label)"; see [Note: optimizers created before
# fully_shard].
_REPLACED_ATTR = "_fsdp2_replaced"
_optimizer_hook: Any = None
_optimizers_checked: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def default_device_type() -> str:
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        current = accelerator.current_accelerator()
        if current is not None:
            return current.type
    return "cpu"


# The mesh of ``fully_shard(mesh=None)``: (default process group; device type; world
# size; the mesh), both weakly. See [Note: one default mesh].
_DefaultMesh = tuple["weakref.ref[dist.ProcessGroup]", str, int, "weakref.ref[DeviceMesh]"]
_DEFAULT_MESH: _DefaultMesh | None = None


def _default_mesh() -> DeviceMesh:
    """The 1-D mesh over the default process group, one object for every call.

    [Note: one default mesh]
    Every ``fully_shard(mesh=None)`` call of a model gets the same ``DeviceMesh`` object,
    not an equal new one per call, as a user passing ``mesh=`` would: a new mesh per
    module costs its construction at every call, and everything keyed by the mesh's
    identity (gradient clipping's layouts, ``fsdp2.clip_grad``) would see one layout per
    module. The cached mesh is rebuilt when the default group is another object
    (destroyed and initialized again), or the device type or world size differ. The
    cache holds both weakly and so extends no lifetime: the modules' parameters keep
    their mesh alive (torch's mesh registry does too, and a mesh its process group)."""
    global _DEFAULT_MESH
    group = dist.group.WORLD
    device_type = default_device_type()
    world_size = dist.get_world_size()
    cached = _DEFAULT_MESH
    if (
        cached is not None
        and group is not None
        and cached[0]() is group
        and cached[1] == device_type
        and cached[2] == world_size
    ):
        mesh = cached[3]()
        if mesh is not None:
            return mesh
    mesh = init_device_mesh(device_type, (world_size,))
    if group is not None:
        _DEFAULT_MESH = (weakref.ref(group), device_type, world_size, weakref.ref(mesh))
    return mesh


def resolve_mesh(mesh: DeviceMesh | None) -> DeviceMesh:
    if mesh is None:
        if not dist.is_available():
            raise RuntimeError(
                "fully_shard needs torch.distributed, which this build of torch lacks."
            )
        if not dist.is_initialized():
            # As torch: initialize the default process group from the environment
            # (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: torchrun sets them).
            try:
                dist.init_process_group()
            except (ValueError, RuntimeError) as error:
                raise RuntimeError(
                    f"fully_shard needs a process group to build its default mesh and could "
                    f"not initialize one from the environment ({error}). Call "
                    f"torch.distributed.init_process_group(...) first (torchrun sets the "
                    f"environment), or pass mesh=init_device_mesh(device_type, (world_size,))."
                ) from error
        return _default_mesh()
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard(mesh=...) expects a DeviceMesh, got {type(mesh).__name__}.")
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh!r}: a 1-D mesh (FSDP) "
            f"or a 2-D (replicate, shard) mesh (HSDP), not {mesh.ndim}-D. Slice the "
            f"data-parallel dims, e.g. world_mesh['dp']."
        )
    return mesh


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank's shards live on: the mesh's device type, current index."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = torch.get_device_module(mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


class AlreadyShardedError(ValueError, AssertionError):
    """``fully_shard`` applied a second time to the same module. A ``ValueError``, and an
    ``AssertionError`` as torch raises (from its composable-API registry), so code that
    catches either keeps working after switching by import."""


class InvalidShardDimError(ValueError, AssertionError):
    """``shard_placement_fn`` returned a dim the parameter does not have. A ``ValueError``,
    and an ``AssertionError`` as torch raises, so code that catches either keeps working."""


def validate_modules(module: nn.Module | list[nn.Module]) -> tuple[nn.Module, ...]:
    modules = tuple(module) if isinstance(module, (list, tuple)) else (module,)
    if not modules:
        raise ValueError("fully_shard got an empty list of modules; pass at least one module.")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(
                f"fully_shard expects an nn.Module or a list of them, got {type(m).__name__}."
            )
        if fsdp_state_of(m) is not None:
            raise AlreadyShardedError(
                f"Each distinct composable distributed API can only be applied to a module "
                f"once. fully_shard was already applied to this {type(m).__name__}. Apply it "
                f"once per module: to each block, then to the root."
            )
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            # Its forward never runs, so its hooks would never gather its parameters.
            raise ValueError(
                f"fully_shard does not support containers that do not implement forward: "
                f"{type(m).__name__} (its hooks would never run). Shard each of its modules, e.g. "
                f"`for block in model.layers: fully_shard(block)`, or pass them as one "
                f"group: fully_shard(list(model.layers))."
            )
    return modules


def check_reshard_after_forward_type(value: object) -> int | None:
    """``value`` itself (bool is an int), or a TypeError if it is no valid type."""
    if value is not None and not isinstance(value, int):  # bool is an int
        raise TypeError(
            f"fully_shard(reshard_after_forward=...) expects True, False, None or an int, "
            f"got {value!r}."
        )
    return value


def validate_reshard_after_forward(value: object, mesh: DeviceMesh) -> bool | int | None:
    """True/False/None as given; an int N is normalized: N == shard size -> True,
    N == 1 -> False, otherwise N (1 < N < shard size, dividing it)."""
    value = check_reshard_after_forward_type(value)
    if value is None or isinstance(value, bool):
        return value
    shard_size = mesh.size(mesh.ndim - 1)
    if value < 1 or shard_size % value != 0:
        raise ValueError(
            f"fully_shard(reshard_after_forward={value}): an int must be a positive divisor of "
            f"the shard group size {shard_size} (e.g. the GPUs per node), so that backward "
            f"all-gathers within groups of that many ranks."
        )
    if value == shard_size:
        return True
    if value == 1:
        return False
    return value


_POST_FORWARD_GROUPS: dict[tuple[Any, tuple[int, ...], int], Any] = {}


def post_forward_group(mesh: DeviceMesh, size: int) -> tuple[Any, int]:
    """The group of ``size`` ranks consecutive in the mesh's shard dim this rank belongs
    to, and its rank there. Created once per (mesh, size): every rank creates every subgroup, in
    the same order, because fully_shard runs the same calls on every rank."""
    ranks = mesh.mesh.reshape(-1, size)
    # Keyed by the shard group too: after destroy_process_group() and a new world, the
    # same ranks need subgroups of the new world.
    key = (mesh.get_group(mesh.ndim - 1), tuple(mesh.mesh.flatten().tolist()), size)
    if key not in _POST_FORWARD_GROUPS:
        _POST_FORWARD_GROUPS[key] = dist.new_subgroups_by_enumeration(ranks.tolist())[0]
    subgroup = _POST_FORWARD_GROUPS[key]
    # The rank's place in its subgroup (ranks sorted), which orders the backward
    # all-gather's output. Not its mesh coordinate modulo ``size``: a mesh whose order is
    # not the process group's (DeviceMesh("cpu", [0, 2, 1, 3])) puts 0 and 2 together.
    return subgroup, dist.get_rank(subgroup)


def validate_shard_placement_fn(fn: Callable[[nn.Parameter], Any] | None) -> None:
    if fn is not None and not callable(fn):
        raise TypeError(
            f"fully_shard(shard_placement_fn=...) must be callable or None, got {fn!r}."
        )


def placement_of(
    fn: Callable[[nn.Parameter], Any] | None,
    param: nn.Parameter,
    fqn: str,
    default_mesh: DeviceMesh,
    meshes: dict[int, tuple[DeviceMesh, SpmdMesh | None]],
    default_spmd: SpmdMesh | None = None,
) -> tuple[int, DeviceMesh, SpmdMesh | None]:
    """The tensor dim ``shard_placement_fn`` picks for ``param`` (0 by default), the mesh
    it is sharded over and, in torch's SPMD mode, the SPMD mesh it lives on:
    ``default_mesh`` / ``default_spmd``, unless the function returns a per-parameter mesh
    (torch's ``ShardPlacementResult(placement, mesh_info)``; see
    [Note: per-parameter meshes]). ``meshes`` caches what each mesh-info object resolves
    to, so every parameter returning the same one lands in the same group."""
    result = fn(param) if fn is not None else None
    mesh, spmd = default_mesh, default_spmd
    placement = result
    if result is not None and not isinstance(result, Shard):
        if not (hasattr(result, "placement") and hasattr(result, "mesh_info")):
            raise TypeError(
                f"fully_shard: shard_placement_fn returned {result!r} for '{fqn}'; return "
                f"Shard(dim), None (Shard(0)), or ShardPlacementResult(placement, mesh_info) "
                f"for a mesh of its own."
            )
        placement = result.placement
        info = result.mesh_info
        if id(info) not in meshes:
            meshes[id(info)] = mesh_of_info(info, fqn)
        mesh, spmd = meshes[id(info)]
        if placement is not None and not isinstance(placement, Shard):
            raise TypeError(
                f"fully_shard: shard_placement_fn returned placement {placement!r} for "
                f"'{fqn}'; use Shard(dim) or None (Shard(0))."
            )
    if placement is None:
        return 0, mesh, spmd
    shard_size = mesh.size(mesh.ndim - 1)
    dim = placement.dim + param.dim() if placement.dim < 0 else placement.dim
    if not 0 <= dim < param.dim():
        raise InvalidShardDimError(
            f"Shard dim {placement.dim} is invalid for {param.dim()}D tensor: {param.shape}. "
            f"fully_shard: shard_placement_fn returned Shard({placement.dim}) for '{fqn}'; "
            f"the dim must be in [-{param.dim()}, {param.dim()})."
        )
    if dim != 0 and param.shape[dim] % shard_size != 0:
        raise UnevenShardError(
            f"FSDP does not support uneven sharding on dim {dim}: fully_shard: Shard({dim}) "
            f"for '{fqn}' of shape {tuple(param.shape)} needs size {param.shape[dim]} of dim "
            f"{dim} to be divisible by the shard group size {shard_size}; shard another dim "
            f"or return None for Shard(0) (which pads)."
        )
    return dim, mesh, spmd


def mesh_of_info(info: Any, fqn: str) -> tuple[DeviceMesh, SpmdMesh | None]:
    """The 1-D (FSDP) or 2-D (replicate, shard: HSDP) mesh a per-parameter mesh info names:
    torch's ``FSDPMeshInfo(mesh, shard_mesh_dim)`` or ``HSDPMeshInfo(mesh, shard_mesh_dim,
    replicate_mesh_dim)`` (read by attribute: fsdp2 does not import torch's FSDP), or a
    ``DeviceMesh`` itself."""
    if isinstance(info, DeviceMesh):
        return resolve_mesh(info), None
    dp_mesh_dims = getattr(info, "dp_mesh_dims", None)
    if dp_mesh_dims is not None:
        # torch's _get_mesh_info(spmd_mesh, dp_mesh_dims): that parameter lives on an SPMD
        # mesh of its own (torchtitan's experts on (efsdp, ep) next to the dense mesh).
        spmd = resolve_spmd_mesh(getattr(info, "spmd_mesh", None), dp_mesh_dims)
        return resolve_mesh(spmd.dp_mesh), spmd
    mesh = getattr(info, "mesh", None)
    shard = getattr(info, "shard_mesh_dim", None)
    replicate = getattr(info, "replicate_mesh_dim", None)
    if not isinstance(mesh, DeviceMesh) or not isinstance(shard, int):
        raise TypeError(
            f"fully_shard: shard_placement_fn returned a mesh_info of type "
            f"{type(info).__name__} for '{fqn}'; expected torch's FSDPMeshInfo/HSDPMeshInfo "
            f"(a mesh and its shard_mesh_dim) or a DeviceMesh."
        )
    dims = (shard,) if replicate is None else (replicate, shard)
    if dims == tuple(range(mesh.ndim)):
        return resolve_mesh(mesh), None
    names = mesh.mesh_dim_names
    if not names or (replicate is not None and replicate > shard):
        raise NotImplementedError(
            f"fully_shard: the mesh_info for '{fqn}' selects dims {dims} of a {mesh.ndim}-D "
            f"mesh{'' if names else ' without dim names'}; pass the data-parallel submesh "
            f"itself (1-D, or 2-D (replicate, shard)) as its mesh."
        )
    picked = tuple(names[d] for d in dims)
    return resolve_mesh(mesh[picked] if len(picked) > 1 else mesh[picked[0]]), None


def _sharded_subtree_roots(modules: tuple[nn.Module, ...]) -> set[int]:
    return {id(m) for m in modules}


def collect_params(
    modules: tuple[nn.Module, ...], ignored_params: Iterable[nn.Parameter] | None
) -> tuple[list[tuple[nn.Parameter, list[Use], str]], list[tuple[str, str]]]:
    """The parameters one call manages, each with all its uses and a display name, and
    ``(name, label of the managing call)`` for each parameter left out because another
    call already manages it.

    A parameter shared with another group is an error, but torch reports it at the first
    forward (lazy init), not here: the caller records the descriptions on the new state
    and ``FSDPState.lazy_init`` raises. The parameter is not sharded a second time."""
    ignored = _validate_ignored(modules, ignored_params)
    shared: list[tuple[str, str]] = []
    tops = _sharded_subtree_roots(modules)
    found: dict[int, tuple[nn.Parameter, list[Use], str]] = {}
    for top, top_label in zip(modules, _display_prefixes(modules)):
        for prefix, module in _unsharded_modules(top, tops):
            for name, param in module._parameters.items():
                if param is None or param in ignored:
                    continue
                fqn = f"{top_label}{prefix}{name}"
                owner = getattr(param, _OWNER_ATTR, None)
                if owner is not None:
                    shared.append((fqn, owner))
                    continue
                if id(param) in found:
                    found[id(param)][1].append((module, name))
                else:
                    found[id(param)] = (param, [(module, name)], fqn)
    return list(found.values()), shared


def _display_prefixes(modules: tuple[nn.Module, ...]) -> list[str]:
    """Name prefixes that tell the modules of one call apart in messages: none for one
    module (names are its own FQNs), the class name for a list (``Embedding.weight``),
    with the position where a class appears twice (``Linear[2].weight``)."""
    if len(modules) == 1:
        return [""]
    names = [type(m).__name__ for m in modules]
    return [
        f"{name}." if names.count(name) == 1 else f"{name}[{i}]." for i, name in enumerate(names)
    ]


def _unsharded_modules(top: nn.Module, tops: set[int]) -> Iterable[tuple[str, nn.Module]]:
    """Modules under ``top`` (with FQN prefixes) not inside an already-sharded submodule."""
    stack: list[tuple[str, nn.Module]] = [("", top)]
    while stack:
        prefix, module = stack.pop()
        if _replicated(module):
            continue  # its parameters are replicate()'s (DDP): leave them plain
        yield prefix, module
        for name, child in reversed(list(module._modules.items())):
            if child is None:
                continue
            if fsdp_state_of(child) is not None and id(child) not in tops:
                continue  # managed by an earlier call
            stack.append((f"{prefix}{name}.", child))


def _replicated(module: nn.Module) -> bool:
    """Whether torch's composable ``replicate()`` was applied to ``module``. It registers
    itself in the composable registry; its subtree belongs to it (DDP all-reduces those
    parameters), so ``fully_shard`` on an ancestor must neither shard them nor move their
    buffers, or the user's choice to replicate that part would be silently undone."""
    contract = _composable_contract()
    if contract is None:
        return False
    registry = module.__dict__.get(contract.REGISTRY_KEY)
    return registry is not None and "replicate" in registry


def _validate_ignored(
    modules: tuple[nn.Module, ...], ignored_params: Iterable[nn.Parameter] | None
) -> set[nn.Parameter]:
    if ignored_params is None:
        return set()
    ignored = set(ignored_params)
    for p in ignored:
        if not isinstance(p, nn.Parameter):
            raise TypeError(
                f"fully_shard(ignored_params=...) must contain nn.Parameter objects, got "
                f"{type(p).__name__}."
            )
    # One set may be passed to every call (as torch allows): each call keeps its own.
    owned = {p for m in modules for p in m.parameters()}
    return ignored & owned


def mark_managed(params: Iterable[nn.Parameter], label: str) -> None:
    for p in params:
        setattr(p, _OWNER_ATTR, label)


def mark_replaced(originals: Iterable[tuple[nn.Parameter, str]], label: str) -> None:
    """Mark the parameters this call replaced, so that an optimizer still holding them
    raises at its first step; see [Note: optimizers created before fully_shard]."""
    global _optimizer_hook
    for param, fqn in originals:
        setattr(param, _REPLACED_ATTR, f"'{fqn}' ({label})")
    if _optimizer_hook is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _optimizer_hook = register_optimizer_step_pre_hook(_before_optimizer_step)


def _before_optimizer_step(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    finish_all_reductions()  # left in flight by set_is_last_backward(False)
    refuse_step_over_failed(optimizer.param_groups)  # a model whose step raised, not reset
    settle_fingerprints()  # accelerators: [Note: in-band fingerprints] in _fingerprints
    # An unshard(async_op=True) nothing consumed may still read the shards it steps.
    order_step_after_all_gathers(p for group in optimizer.param_groups for p in group["params"])
    release_graph_holds()  # see [Note: backward that builds a graph]
    groups = len(optimizer.param_groups)
    if _optimizers_checked.get(optimizer) == groups:
        return
    _optimizers_checked[optimizer] = groups
    params = [p for group in optimizer.param_groups for p in group["params"]]
    replaced = [getattr(p, _REPLACED_ATTR) for p in params if hasattr(p, _REPLACED_ATTR)]
    gathered = [f"'{getattr(p, UNSHARDED_ATTR)}'" for p in params if hasattr(p, UNSHARDED_ATTR)]
    if gathered:
        raise RuntimeError(
            f"fully_shard: {type(optimizer).__name__} holds {len(gathered)} unsharded "
            f"parameters of sharded modules ({_first_three(gathered)}). It was created from "
            f"model.parameters() while their groups were gathered: after a forward that "
            f"left them unsharded (an eval or no_grad forward with "
            f"reshard_after_forward=False, the root's default) or after unshard(). Those "
            f"copies are refilled by every all-gather and never updated, so its steps "
            f"would train nothing there. Create the optimizer before that forward, or call "
            f"model.reshard() first."
        )
    if replaced:
        raise RuntimeError(
            f"fully_shard: {type(optimizer).__name__} holds {len(replaced)} parameters that "
            f"fully_shard replaced by sharded DTensor parameters ({_first_three(replaced)}). "
            f"It was created "
            f"before fully_shard, or from a module that still shares them: its steps would "
            f"update tensors the model no longer uses. Create the optimizer after "
            f"fully_shard, from model.parameters()."
        )


def _first_three(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def mark_composable(modules: tuple[nn.Module, ...]) -> None:
    """Record ``fully_shard`` in the registry of torch's composable distributed APIs
    (``torch.distributed._composable``), as torch's own ``fully_shard`` does. torch's
    ``replicate()`` reads it to leave sharded submodules alone; without the entry it would
    turn our ``DTensor`` shards into plain local parameters and all-reduce their gradients.
    """
    contract = _composable_contract()
    if contract is None:
        return
    item = contract.RegistryItem()
    for module in modules:
        registry = module.__dict__.setdefault(contract.REGISTRY_KEY, {})
        registry.setdefault("fully_shard", item)


def mark_managed_modules(modules: tuple[nn.Module, ...]) -> None:
    """Flag the modules this call manages (``modules`` and their submodules, down to those
    a nested ``fully_shard`` call manages) as torch's ``fully_shard`` flags them.

    [Note: modules flagged as FSDP-managed]
    torch's ``fully_shard`` sets ``_is_fsdp_managed_module`` and ``_fsdp_use_orig_params``
    on every module it manages, and other libraries read them as the mark of FSDP. Dynamo
    traces such modules unspecialized (parameters as graph inputs, no guards on the
    module's parameters). transformers' ``generate`` turns ``synced_gpus`` on for them:
    a rank whose sequences have all finished keeps running forwards, and so keeps
    issuing the all-gathers its peers' forwards wait for, until every rank has finished.
    Without the flags, generation with per-rank prompts or sampling leaves the ranks
    still generating waiting on a rank that has returned. The modules are those whose
    parameters the call collects (``_unsharded_modules``: not a nested call's, not a
    ``replicate()`` subtree), the set torch flags."""
    tops = _sharded_subtree_roots(modules)
    for top in modules:
        for _, module in _unsharded_modules(top, tops):
            module._is_fsdp_managed_module = True  # type: ignore[assignment]
            module._fsdp_use_orig_params = True  # type: ignore[assignment]


def _composable_contract() -> Any:
    """torch's ``_composable.contract`` module, or None where it lacks the registry."""
    try:
        # The package re-exports the decorator under the module's name: import the module.
        contract = importlib.import_module("torch.distributed._composable.contract")
    except ImportError:
        return None
    if not hasattr(contract, "REGISTRY_KEY") or not hasattr(contract, "RegistryItem"):
        return None
    return contract


def move_states_to_device(modules: tuple[nn.Module, ...], device: torch.device) -> None:
    """Buffers stay replicated; move them to the mesh's device like the shards."""
    tops = _sharded_subtree_roots(modules)
    for top in modules:
        for _, module in _unsharded_modules(top, tops):
            for name, buf in module._buffers.items():
                if buf is not None and buf.device.type != "meta" and buf.device != device:
                    module._buffers[name] = buf.to(device)


def _label(modules: tuple[nn.Module, ...]) -> str:
    return ", ".join(type(m).__name__ for m in modules)


def check_param_device(param: torch.Tensor, fqn: str, device: torch.device) -> None:
    if param.device.type not in ("meta", "cpu", device.type):
        raise ValueError(
            f"fully_shard: parameter '{fqn}' is on {param.device}, but the mesh's device is "
            f"{device}. Move the module to {device.type} (or the CPU) before sharding."
        )
