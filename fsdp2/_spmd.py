"""torch's SPMD mode (``fully_shard(..., mesh=world, dp_mesh_dims=...)``): parameters are
``DTensor``s on the whole mesh, replicated over the data-parallel dims that
``DataParallelMeshDims`` names, laid out by the user (tensor, context or expert parallel)
over the others; the model's forward computes with ``DTensor``s.

fsdp2 shards such a parameter's local tensor (its part after the non-data-parallel dims)
over the data-parallel dims exactly as it shards a tensor-parallel parameter's local tensor
over a separate data-parallel mesh: one flat buffer, one all-gather, one reduce-scatter per
group. Only three things differ, all decided here:

- the group's mesh is a data-parallel mesh built from the named dims (several shard dims or
  several replicate dims are flattened into one; HSDP is ``(replicate, shard)``; replicate
  only is HSDP over a shard dim of size 1);
- the sharded ``DTensor`` lives on the SPMD mesh with each shard dim's ``Replicate()``
  replaced by the data-parallel placement (a ``_StridedShard`` where a later mesh dim
  shards the same tensor dim), and the unsharded parameter is the user's ``DTensor``
  layout again;
- a gradient keeps its placements on the data-parallel dims (``Partial`` contributions
  are summed by the reduce-scatter itself; redistributing them would all-reduce first)
  and is brought to the parameter's layout on the other dims.

[Note: SPMD gradients on data-parallel dims]
An input sharded over the data-parallel dims gives the weights ``Partial`` gradients there;
an input declared ``Replicate`` (each rank its own batch, as torch's own tests do) gives
``Replicate`` ones whose local values still differ per rank. Both are what a data-parallel
reduce expects: this rank's contribution. The reduce-scatter sums (and divides by the
shard group size, as for any fsdp2 gradient), so the result is the data-parallel mean of
the local gradients, as in torch. Any other placement there is redistributed to
``Replicate`` first.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any, cast

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from fsdp2._policies import dim_names


@dataclass(frozen=True)
class SpmdMesh:
    """The mesh parameters live on, the indices of its data-parallel dims, and the
    data-parallel mesh fsdp2 communicates over (1-D shard, or 2-D ``(replicate, shard)``)."""

    mesh: DeviceMesh
    shard_dims: tuple[int, ...]
    replicate_dims: tuple[int, ...]
    dp_mesh: DeviceMesh
    # Both kinds of data-parallel dim; read for every gradient, so built once.
    dp_dims: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dp_dims", frozenset(self.shard_dims + self.replicate_dims))

    def name(self, dim: int) -> str:
        return (self.mesh.mesh_dim_names or ())[dim]


def _private(name: str) -> Any:
    found = getattr(DeviceMesh, name, None)
    if found is None:
        raise NotImplementedError(
            f"fully_shard(dp_mesh_dims=...) with this layout needs DeviceMesh.{name}, which "
            f"this torch does not have; upgrade torch or pass the data-parallel submesh as "
            f"mesh= without dp_mesh_dims."
        )
    return found


def _one_dim(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """The named dims of ``mesh`` as one dim (flattened when there are several)."""
    if len(names) == 1:
        return mesh[names[0]]
    flatten = _private("_flatten")
    return cast(DeviceMesh, flatten(mesh[names], "_".join(names)))


def resolve_spmd_mesh(mesh: Any, dp_mesh_dims: Any) -> SpmdMesh:
    """Check ``dp_mesh_dims`` against ``mesh`` (torch's errors and messages) and build the
    data-parallel mesh fsdp2's groups communicate over."""
    if not hasattr(dp_mesh_dims, "shard") or not hasattr(dp_mesh_dims, "replicate"):
        raise TypeError(
            f"fully_shard(dp_mesh_dims=...) expects a DataParallelMeshDims(shard=..., "
            f"replicate=...), got {type(dp_mesh_dims).__name__}."
        )
    shard = dim_names(dp_mesh_dims.shard, "shard")
    replicate = dim_names(dp_mesh_dims.replicate, "replicate")
    if not shard and not replicate:
        raise ValueError("At least one of shard or replicate must be set in dp_mesh_dims")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"fully_shard(dp_mesh_dims=...) needs mesh= the DeviceMesh the parameters live "
            f"on, got {type(mesh).__name__}."
        )
    names = tuple(mesh.mesh_dim_names or ())
    if not names:
        raise ValueError(
            "fully_shard(dp_mesh_dims=...): mesh must have mesh_dim_names when dp_mesh_dims "
            "is provided; build it with init_device_mesh(..., mesh_dim_names=(...))."
        )
    for name in shard + replicate:
        if name not in names:
            raise ValueError(
                f"fully_shard(dp_mesh_dims=...): Mesh dim name '{name}' not found in "
                f"mesh.mesh_dim_names {names}."
            )
    if len(set(shard + replicate)) != len(shard + replicate):
        raise ValueError(
            f"fully_shard(dp_mesh_dims=...): a mesh dim is named twice in shard={shard}, "
            f"replicate={replicate}."
        )
    built = _built_for(mesh)
    dp_mesh = built.get((shard, replicate))
    if dp_mesh is None:
        dp_mesh = built[(shard, replicate)] = _dp_mesh(mesh, shard, replicate)
    return SpmdMesh(
        mesh=mesh,
        shard_dims=tuple(names.index(n) for n in shard),
        replicate_dims=tuple(names.index(n) for n in replicate),
        dp_mesh=dp_mesh,
    )


# id(SPMD mesh) -> the data-parallel meshes built for it, by (shard, replicate) names. One
# per mesh object and dims, not one per fully_shard call (DeviceMesh._unflatten makes new
# process groups for its size-1 dim at every call). By identity, not equality: an equal
# mesh built after the process groups were re-created must not get the old groups. Not
# stored on the mesh, which pickles its __dict__ (DTensors in torch.save'd state dicts).
_BUILT: dict[int, dict[tuple[tuple[str, ...], tuple[str, ...]], DeviceMesh]] = {}


def _built_for(mesh: DeviceMesh) -> dict[tuple[tuple[str, ...], tuple[str, ...]], DeviceMesh]:
    key = id(mesh)
    if key not in _BUILT:
        _BUILT[key] = {}
        weakref.finalize(mesh, _BUILT.pop, key, None)
    return _BUILT[key]


def _dp_mesh(mesh: DeviceMesh, shard: tuple[str, ...], replicate: tuple[str, ...]) -> DeviceMesh:
    """The 1-D (shard) or 2-D (replicate, shard) mesh fsdp2's groups communicate over."""
    names = tuple(mesh.mesh_dim_names or ())
    if shard and replicate:
        replicate_mesh, shard_mesh = _one_dim(mesh, replicate), _one_dim(mesh, shard)
        pair = (replicate[0], shard[0])
        in_order = names.index(pair[0]) < names.index(pair[1])
        if len(shard) == len(replicate) == 1 and in_order:
            dp_mesh = mesh[pair]
        else:
            dp_mesh = _private("_concatenate")([replicate_mesh, shard_mesh])
    elif shard:
        dp_mesh = _one_dim(mesh, shard)
    else:
        # Replication only (DDP): HSDP over a shard dim of one rank.
        replicate_mesh = _one_dim(mesh, replicate)
        unflatten = _private("_unflatten")
        flat = replicate_mesh.mesh_dim_names[0]  # type: ignore[index]
        dp_mesh = unflatten(
            replicate_mesh, 0, (replicate_mesh.size(), 1), (flat, f"{flat}_unsharded")
        )
    return dp_mesh


def check_spmd_param(param: Any, spmd: SpmdMesh, fqn: str) -> None:
    """torch's contract: every managed parameter is a ``DTensor`` on the SPMD mesh itself,
    replicated over the data-parallel dims; on a mesh of only data-parallel dims, plain
    parameters are accepted too."""
    if not isinstance(param, DTensor):
        if spmd.dp_dims == frozenset(range(spmd.mesh.ndim)):
            # A mesh of only data-parallel dims: a plain parameter is replicated there, so
            # it is sharded as without dp_mesh_dims and computes as a plain tensor (torch
            # 2.13 raises; later torch accepts plain parameters in this mode).
            return
        raise ValueError(
            f"fully_shard(dp_mesh_dims=...): all parameters must be DTensors on the full "
            f"SPMD mesh {spmd.mesh} (e.g. via distribute_module); got a plain tensor for "
            f"parameter '{fqn}'. Distribute it (Replicate() on the data-parallel dims), pass "
            f"it in ignored_params, or call fully_shard with mesh=<data-parallel mesh> and "
            f"no dp_mesh_dims."
        )
    # Equal, not identical: DTensor hands a tensor made on a mesh built again (the same
    # ranks, dims and names) the first such mesh, which torch then rejects.
    if param.device_mesh != spmd.mesh:
        raise ValueError(
            f"fully_shard(dp_mesh_dims=...): parameter '{fqn}' is a DTensor on "
            f"{param.device_mesh}; expected the same mesh as the one passed to fully_shard "
            f"({spmd.mesh}): the same ranks and dim names. Distribute parameters on it."
        )
    for dim in spmd.shard_dims + spmd.replicate_dims:
        placement = param.placements[dim]
        if not isinstance(placement, Replicate):
            kind = "shard" if dim in spmd.shard_dims else "replicate"
            raise ValueError(
                f"fully_shard(dp_mesh_dims=...): parameter '{fqn}': Expected Replicate() on "
                f"DP {kind} dim '{spmd.name(dim)}' (index {dim}) but got {placement}. "
                f"fsdp2 shards over the data-parallel dims itself."
            )


def _shards_dim(placement: Placement, dim: int) -> bool:
    return isinstance(placement, (Shard, _StridedShard)) and placement.dim == dim


def sharded_layout(
    spmd: SpmdMesh, placements: tuple[Placement, ...], shard_dim: int
) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """The mesh and placements of a sharded SPMD parameter whose unsharded layout is
    ``placements`` and which fsdp2 shards on tensor dim ``shard_dim``."""
    if not spmd.shard_dims:  # replication only: the layout does not change
        return spmd.mesh, placements
    first = spmd.shard_dims[0]
    # The data-parallel split applies within each chunk that later mesh dims cut the same
    # tensor dim into, so it is strided by their number (DTensor applies placements in
    # mesh-dim order).
    later = range(first + 1, spmd.mesh.ndim)
    split = math.prod([spmd.mesh.size(d) for d in later if _shards_dim(placements[d], shard_dim)])
    dp_placement: Placement = (
        _StridedShard(shard_dim, split_factor=split) if split > 1 else Shard(shard_dim)
    )
    if len(spmd.shard_dims) == 1:
        new = list(placements)
        new[first] = dp_placement
        return spmd.mesh, tuple(new)
    # Several shard dims: one flattened data-parallel dim (after the replicate dim for
    # HSDP) where the first of them was; the replicate dims move there with it.
    meshes: list[DeviceMesh] = []
    new = []
    for d in range(spmd.mesh.ndim):
        if d == first:
            meshes.append(spmd.dp_mesh)
            if spmd.dp_mesh.ndim == 2:
                new.append(Replicate())
            new.append(dp_placement)
        elif d not in spmd.dp_dims:
            meshes.append(spmd.mesh[spmd.name(d)])
            new.append(placements[d])
    mesh = _private("_concatenate")(meshes) if len(meshes) > 1 else meshes[0]
    return mesh, tuple(new)


def local_gradient_placements(
    spmd: SpmdMesh, grad: DTensor, placements: tuple[Placement, ...]
) -> tuple[Placement, ...]:
    """Placements to bring a gradient to before taking its local tensor: the parameter's on
    the non-data-parallel dims, the gradient's own on the data-parallel ones where those
    are already a per-rank contribution ([Note: SPMD gradients on data-parallel dims])."""
    dp_dims = spmd.dp_dims
    return tuple(
        current if d in dp_dims and isinstance(current, (Partial, Replicate)) else placements[d]
        for d, current in enumerate(grad.placements)
    )
