"""One managed parameter: where its shard lives in the group's flat shard buffer, where its
unsharded value lives in the group's unsharded buffer, and the ``nn.Parameter`` objects the
module sees in each state.

[Note: flat shard buffer]
Each rank keeps all of a group's local shards in one 1-D buffer. Parameter ``i`` owns the
slot ``[offset_i, offset_i + rows_per_rank_i * row_numel_i)``: its *padded* shard, as if
dim 0 were rounded up to a multiple of the world size. The first ``local_rows_i`` rows of
the slot are the real shard, exactly the rows ``torch.chunk`` / ``distribute_tensor`` give
this rank; the rest is padding (zeros, never read as data). Because every rank's slots have
the same sizes, the buffer is the all-gather input as is, and the all-gather output is
rank-major: ``output.view(world_size, S)[r, offset_i:...]`` is rank ``r``'s padded shard of
parameter ``i``. The sharded ``DTensor`` parameter's local tensor aliases its slot of the
buffer, so optimizer steps and ``load_state_dict`` (both in place) update the all-gather
input directly. The alias starts at storage offset 0; see [Note: shard aliases at offset 0].

A group whose parameters have different dtypes (and no ``param_dtype`` to unify them)
keeps a ``uint8`` flat buffer instead: slots are byte ranges, ordered by decreasing
itemsize so each starts at a multiple of its dtype's itemsize with no gap bytes, and each
local tensor is a ``.view(dtype)`` of its byte range. The all-gather then moves bytes, once
per group; see [Note: mixed-dtype groups] in ``_param_group``. ``shard_offset`` (the slot
in the flat shard buffer) and ``gather_offset`` (the slot in an all-gather row) count in the
buffer's elements (bytes for a ``uint8`` buffer); ``offset`` always counts elements of the
reduce-scatter layout.

[Note: sharding a dim other than 0]
``shard_placement_fn`` may return ``Shard(d)`` with ``d > 0`` (only for sizes the shard
group divides, so there is no padding). Each rank's slot then holds its shard in its own
natural layout, ``(*shape[:d], shape[d] / world_size, *shape[d + 1:])``, and the unsharded
parameter is the natural layout of the whole tensor: both contiguous, as in torch, so code
that calls ``.view()`` on a parameter, and kernels that want dense strides (grouped GEMMs
of experts sharded on dim 1), see what they would see without sharding. Rank ``r``'s shard
is not one contiguous span of the unsharded parameter but ``outer`` spans (one per index of
the dims before ``d``), so such a parameter's copy-out target and reduce-scatter source
are strided ``(world_size, outer, span)`` views, and a group holding one copies out with
``torch._foreach_copy_`` instead of the fused ``split_with_sizes_copy`` (the same bytes
moved, one kernel per parameter on the CPU).

[Note: storage resize and autograd]
Every parameter's unsharded tensor is created once, as a view into the group's unsharded
buffer, and reused every step. Resharding frees memory by resizing that buffer's storage to
zero bytes; unsharding resizes it back and fills it. The tensor objects never change, so
tensors autograd saved in forward (e.g. a ``Linear`` weight) point at valid data again once
the pre-backward all-gather has refilled the storage. The refill must not look like an
in-place edit to autograd, which would reject the saved tensors; it therefore writes
through an alias made with ``.data``, which shares the storage but has its own version
counter.

[Note: in-place changes to unsharded parameters]
A module may change its unsharded parameters in place: ``Embedding(max_norm=...)``
renormalizes the rows it looks up during forward, and a user may ``unshard()``, edit the
weights under ``no_grad`` and ``reshard()``. The shards are the parameters' only lasting
copy, so resharding would silently drop such a change (torch's ``fully_shard`` does: with
``max_norm`` its training drifts from the non-sharded model's). The unsharded parameters
are views of the unsharded buffer and share its version counter, which our own refills
(through the ``.data`` alias, see [Note: storage resize and autograd]) do not bump. So the
group notes that counter once filled, and when it has moved by the time the group reshards,
or at the end of a backward that leaves the group unsharded, each parameter copies its own
rows back into its shard: the whole chunk when the dtypes match, else only the elements
that differ from the shard cast to the compute dtype, so a bf16 compute copy does not
round the fp32 parameters it did not change. Each rank writes back the rows it owns: a
change every rank makes alike (an edit after ``unshard()``) is kept exactly; one that
depends on a rank's data (``max_norm`` renormalizes the rows its own batch looks up) is
kept where the owning rank made it, one consistent model without more communication
(DDP's replicas drift apart there). Changes made through ``.data`` bypass version
counters and are not seen; extension parameters (rebuilt by their hooks) are not
watched. If the shards were also updated since the gather (an optimizer step while the
group was still unsharded with changes), one of the two would be lost: that is an error.

[Note: shard aliases at offset 0]
A ``DTensor`` wrapper copies its local tensor's storage offset, so a local tensor that is a
plain view into the flat buffer at a nonzero offset gives the wrapper (and every ``DTensor``
derived from it: ``detach()``, ``state_dict()`` entries) a nonzero ``data_ptr()``. torch's
``Tensor.__deepcopy__`` and ``torch.save`` tell wrapper subclasses apart by a zero
``data_ptr()``; they would otherwise try to read the wrapper's (nonexistent) storage and
fail. ``copy.deepcopy(model.state_dict())`` and ``torch.save(model.state_dict())`` must work,
so each local tensor is an alias of its slot made from a slice of the flat buffer's untyped
storage: the same memory, a storage of its own that starts at the slot (offset 0) and keeps
the flat buffer's storage alive. (A DLPack round trip does the same on the CPU, but refuses
CUDA tensors of a device that is not the current one.) The flat shard buffer is
never resized or swapped, so the alias stays valid for the buffer's lifetime; tensors on the
meta device have no memory and stay plain views.

[Note: weights tied after sharding]
torchtitan ties weights after sharding: ``model.output.weight = model.tok_embeddings.weight``,
where both are already sharded ``DTensor`` parameters, possibly of different groups. The
parameter whose registration was replaced (the *tied* one) adopts the other's ``DTensor`` at
the next ``ensure_shards_bound`` (lazy init) but keeps its own slot in its own group's flat
buffer, because the ``DTensor``'s local tensor can alias only one slot: that of the
parameter it came from (the *owner*), which the optimizer updates. Before each all-gather
of its group the tied parameter's slot is refreshed from the owner's local tensor (one
copy per tied parameter; groups without one skip it). Each use is unsharded and
reduce-scattered by its own group, and both reductions accumulate into the one ``DTensor``
gradient, as in non-sharded training. Tying before sharding needs none of this: the
parameter is managed once, with every use recorded.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Mapping
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from fsdp2._extensions import (
    GatherExtension,
    contiguous_stride,
    has_gather_extension,
    is_plain,
)
from fsdp2._spmd import SpmdMesh, local_gradient_placements, sharded_layout

# Set on every unsharded parameter (to its fqn): an optimizer built while a group was
# gathered holds these, and its first step raises (see ``_init._before_optimizer_step``).
UNSHARDED_ATTR = "_fsdp2_unsharded"

# (module, attribute name): one place a parameter is registered. Tied weights have several.
Use = tuple[nn.Module, str]


class UnevenShardError(ValueError, NotImplementedError):
    """``Shard(dim)`` with ``dim != 0`` whose size the shard group does not divide. A
    ``ValueError``, and a ``NotImplementedError`` as torch raises."""


# id of each live sharded parameter -> the ShardedParam whose slot its local tensor aliases;
# read when a module attribute is set to another parameter's DTensor (see
# [Note: weights tied after sharding]). Keyed by id, not weakly by tensor: weak references
# to parameters would break ``torch.utils.swap_tensors`` in ``module._apply``.
_SHARD_OWNERS: weakref.WeakValueDictionary[int, ShardedParam] = weakref.WeakValueDictionary()


def owner_of(param: torch.Tensor) -> ShardedParam | None:
    """The ShardedParam whose slot ``param`` (a sharded DTensor parameter) aliases."""
    owner = _SHARD_OWNERS.get(id(param))
    return owner if owner is not None and owner.sharded_param is param else None


def shard_binding(owner: ShardedParam) -> object:
    """A token that changes whenever fsdp2 binds the parameter's local tensor to memory
    (creation, lazy init, ``module.to()``, a load with ``assign=True``): a local tensor
    whose memory changed while the token did not was replaced outside fsdp2, and no longer
    views the all-gather input (the optimizer fast path, ``fsdp2.optim``, checks it)."""
    return owner._local_layout


def typed_slice(flat: torch.Tensor, start: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``numel`` elements of ``dtype`` starting at ``start`` (counted in ``flat``'s elements).

    A plain slice when the dtypes agree; otherwise ``flat`` is a byte buffer and the slice
    is reinterpreted with ``.view(dtype)``, a view, so writes reach ``flat`` (``start`` must
    be a multiple of the itemsize, which the group's layout guarantees)."""
    if flat.dtype == dtype:
        return flat[start : start + numel]
    return flat[start : start + numel * dtype.itemsize // flat.element_size()].view(dtype)


def alias_at_offset_zero(view: torch.Tensor) -> torch.Tensor:
    """The memory of ``view`` as a tensor whose storage starts at its first element (same
    shape and strides); see [Note: shard aliases at offset 0]."""
    if view.storage_offset() == 0 or view.device.type == "meta":
        return view
    if view.numel() == 0:  # no memory to share: an empty tensor of the same layout
        return torch.empty_strided(view.shape, view.stride(), dtype=view.dtype, device=view.device)
    itemsize = view.element_size()
    first = view.storage_offset() * itemsize
    extent = 1 + sum((size - 1) * stride for size, stride in zip(view.shape, view.stride()))
    # A slice of an untyped storage is a storage of its own over those bytes that holds a
    # reference to the whole one: valid for every device (and pinned host memory), unlike
    # a DLPack round trip, which refuses CUDA tensors of a device that is not current.
    piece = view.untyped_storage()[first : first + extent * itemsize]
    alias = torch.empty(0, dtype=view.dtype, device=view.device)
    return alias.set_(piece, 0, view.shape, view.stride())


def _spmd_mesh(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh, fqn: str) -> DeviceMesh:
    """The mesh of a TP (or EP) parameter's sharded DTensor: the data-parallel dims, then
    the parameter's own. Both must be slices of one mesh (``world['dp']``,
    ``world['tp']``), disjoint; other dims of that mesh (pipeline stages) may exist.

    torch's ``DeviceMesh._concatenate`` builds it from any such pair. Where it is missing,
    the data-parallel mesh's parent must be exactly the data-parallel dims, then one TP
    dim. Compared by ranks, not by the TP mesh's own parent: torch caches sub-meshes, so a
    mesh built again in the same process (a new model, a test repeated with another
    shape) can hand back a TP mesh whose recorded parent is an earlier, equal-ranked
    mesh."""
    if tp_mesh.device_type != dp_mesh.device_type:
        raise ValueError(
            f"Requires DTensor to have mesh of the same type as the FSDP mesh but got "
            f"{tp_mesh.device_type} for DTensor and {dp_mesh.device_type} for FSDP: "
            f"fully_shard: parameter '{fqn}' is a DTensor on {tp_mesh}. Build both meshes "
            f"for one device type, sliced from one mesh (world['tp'], world['dp'])."
        )
    how = (
        "Slice both from one mesh with named dims: world = init_device_mesh(type, (dp, tp), "
        "mesh_dim_names=('dp', 'tp')); parallelize_module(..., world['tp'], ...); "
        "fully_shard(..., mesh=world['dp']) (HSDP: mesh=world['replicate', 'shard'])."
    )
    concatenate = getattr(DeviceMesh, "_concatenate", None)
    if concatenate is not None:
        if not dp_mesh.mesh_dim_names or not tp_mesh.mesh_dim_names:
            raise ValueError(
                f"fully_shard: parameter '{fqn}' is a DTensor on {tp_mesh}; combining it "
                f"with the data-parallel mesh {dp_mesh} needs both to be named slices of "
                f"one mesh. {how}"
            )
        try:
            return cast(DeviceMesh, concatenate([dp_mesh, tp_mesh]))
        except (RuntimeError, AssertionError, TypeError, ValueError) as error:
            raise ValueError(
                f"fully_shard: parameter '{fqn}' is a DTensor on {tp_mesh}, which does not "
                f"combine with the data-parallel mesh {dp_mesh} ({error}). {how}"
            ) from error
    root = dp_mesh._get_root_mesh()
    names = tuple(root.mesh_dim_names or ())
    if root.ndim != dp_mesh.ndim + tp_mesh.ndim or root is dp_mesh or not names:
        raise ValueError(
            f"fully_shard: parameter '{fqn}' is a DTensor on {tp_mesh}, which is not the "
            f"last dimension of the data-parallel mesh's parent ({root}). {how}"
        )
    if names[: dp_mesh.ndim] != tuple(dp_mesh.mesh_dim_names or ()):
        raise NotImplementedError(
            f"fully_shard: parameter '{fqn}': with this torch, the data-parallel dims must "
            f"be the outer dims of the mesh, in order, and TP the last one, e.g. "
            f"mesh_dim_names=('dp', 'tp') or ('replicate', 'shard', 'tp'); got {names}."
        )
    tp_names = names[dp_mesh.ndim :]
    tp_ranks = root[tp_names if len(tp_names) > 1 else tp_names[0]].mesh.tolist()
    if tp_mesh.mesh.tolist() != tp_ranks or tp_mesh.device_type != root.device_type:
        raise ValueError(
            f"fully_shard: parameter '{fqn}' is a DTensor on {tp_mesh} (ranks "
            f"{tp_mesh.mesh.tolist()}), but the last dims of the data-parallel mesh's "
            f"parent {root} hold ranks {tp_ranks} here. Use those dims for TP: "
            f"parallelize_module(..., world[{tp_names!r}], ...)."
        )
    return root


class ShardedParam:
    """Layout and tensors of one parameter managed by a ``ParamGroup``."""

    fqn: str  # name of the first use, for messages
    uses: list[Use]
    shape: torch.Size  # the unsharded (global) shape
    rows_per_rank: int  # ceil(shape[0] / world_size): the padded shard's dim 0
    row_numel: int  # elements per dim-0 row
    local_rows: int  # real rows on this rank, 0 <= local_rows <= rows_per_rank
    dtype: torch.dtype  # the sharded parameter's (original) dtype
    offset: int  # start of the slot in the reduce-scatter layout (elements)
    shard_offset: int  # start of the slot in the flat shard buffer (its elements)
    gather_offset: int  # start of the slot in one all-gather row (that buffer's elements)
    sharded_param: nn.Parameter  # DTensor, Shard(d); local tensor views the flat buffer
    unsharded_param: nn.Parameter | None  # ND view into the group's unsharded buffer
    # ``requires_grad`` as set on both when the unsharded parameter was last registered;
    # see [Note: requires_grad changed while gathered] in ``_unsharded_upkeep``.
    registered_requires_grad: bool
    # Unsynced gradients summed in the reduce dtype (see ParamGroup.accumulate_unsynced).
    accumulated_grad: torch.Tensor | None

    def __init__(
        self,
        param: nn.Parameter,
        uses: list[Use],
        fqn: str,
        mesh: DeviceMesh,
        offset: int,
        shard_dim: int = 0,
        spmd: SpmdMesh | None = None,
    ) -> None:
        if param.dim() == 0:
            raise ValueError(
                f"fully_shard doesn't support scalar parameters. Change {fqn} to a 1D tensor "
                f"with numel equal to 1 (sharding splits dim 0), or pass it in ignored_params "
                f"to keep it replicated."
            )
        for module, name in uses:
            if getattr(module, "sparse", False) is True and name == "weight":
                # nn.Embedding / nn.EmbeddingBag(sparse=True): a sparse gradient cannot be
                # cut into dim-0 shards by one reduce-scatter; it would fail in backward.
                raise ValueError(
                    f"fully_shard: parameter '{fqn}' belongs to {type(module).__name__}"
                    f"(sparse=True), whose sparse gradients fully_shard cannot "
                    f"reduce-scatter. Build it with sparse=False (and a dense optimizer "
                    f"instead of SparseAdam), or pass it in ignored_params and reduce its "
                    f"gradient yourself."
                )
        self.fqn = fqn
        self.uses = uses
        # Tensor parallelism: ``param`` is already a DTensor on a TP mesh. We shard its
        # TP-local tensor over the data-parallel mesh; the sharded parameter is a 2-D
        # DTensor on their common parent mesh, the unsharded one the original TP DTensor.
        self.tp_mesh: DeviceMesh | None = None
        self.tp_placements: tuple[Any, ...] = ()
        # torch's SPMD mode (dp_mesh_dims): the DTensor is on the whole mesh; see ``_spmd``.
        self.spmd: SpmdMesh | None = None
        self.global_shape = param.shape
        self.dtensor_mesh = mesh
        # All-gather extensions: a tensor subclass with the hooks keeps its own storage
        # (``apart``), outside the flat shard buffer; see ``_extensions``. ``extension``
        # is set for it here and, by the group, for any local tensor that has the hooks.
        source = param.to_local() if isinstance(param, DTensor) else param
        self.apart = has_gather_extension(source, fqn) and not is_plain(source)
        self.extension: GatherExtension | None = None
        if isinstance(param, DTensor) and spmd is not None:
            self.tp_mesh, self.tp_placements, self.spmd = spmd.mesh, tuple(param.placements), spmd
            self.dtensor_mesh, self.placements = sharded_layout(spmd, self.tp_placements, shard_dim)
        elif isinstance(param, DTensor):
            self._init_tensor_parallel(param, mesh, fqn, shard_dim)
        if isinstance(param, DTensor):
            self.shape = param.to_local().shape  # all layout below is TP-local
            dp_size = mesh.size(mesh.ndim - 1)
            if shard_dim and self.shape[shard_dim] % dp_size:
                raise UnevenShardError(
                    f"FSDP does not support uneven sharding on dim {shard_dim}: "
                    f"fully_shard: Shard({shard_dim}) for '{fqn}' needs size "
                    f"{self.shape[shard_dim]} of dim {shard_dim} of its tensor-parallel "
                    f"local shard (global shape {tuple(param.shape)}) to be divisible by "
                    f"the shard group size {dp_size}; shard another dim or return None "
                    f"for Shard(0) (which pads)."
                )
        else:
            self.shape = param.shape
        self.dtype = param.dtype
        self.mesh = mesh
        # Shard(d) for d > 0: see [Note: sharding a dim other than 0].
        self.shard_dim = shard_dim
        self.outer_numel = math.prod(self.shape[:shard_dim])  # elements before dim d
        self.rows_shape = (
            self.shape[shard_dim],
            *self.shape[:shard_dim],
            *self.shape[shard_dim + 1 :],
        )
        # 1-D mesh: shard over it. 2-D (HSDP): replicate over dim 0, shard over dim 1.
        shard_dim = mesh.ndim - 1
        world_size, rank = mesh.size(shard_dim), mesh.get_local_rank(shard_dim)
        if self.tp_mesh is None:
            self.placements = (*(Replicate() for _ in range(shard_dim)), Shard(self.shard_dim))
        self.world_size = world_size
        # Everything below works on ``rows``: dim ``shard_dim`` moved to the front.
        rows = self.rows_shape[0]
        self.rows_per_rank = math.ceil(rows / world_size)
        self.row_numel = math.prod(self.rows_shape[1:])
        first_row = min(rank * self.rows_per_rank, rows)
        self.local_rows = min(self.rows_per_rank, rows - first_row)
        self.first_row = first_row
        self.shard_rank = rank
        if self.apart:
            self.extension = self.new_extension()
        # The group overrides the three offsets when it plans its layout.
        self.offset = self.shard_offset = self.gather_offset = offset
        self.unsharded_param = None
        self.registered_requires_grad = param.requires_grad
        self.accumulated_grad = None
        # The parameter whose DTensor this one adopted ([Note: weights tied after sharding]).
        self.tied_to: ShardedParam | None = None

    def _init_tensor_parallel(
        self, param: DTensor, dp_mesh: DeviceMesh, fqn: str, shard_dim: int
    ) -> None:
        tp_mesh = param.device_mesh
        if tp_mesh.ndim > 2:
            raise NotImplementedError(
                f"fully_shard: parameter '{fqn}' is a DTensor on a {tp_mesh.ndim}-D mesh; "
                f"composing with tensor/expert parallelism supports 1-D (TP or EP) and 2-D "
                f"(EP x TP) meshes."
            )
        spmd_mesh = _spmd_mesh(dp_mesh, tp_mesh, fqn)
        # dp splits each TP chunk of the dim again when TP shards that dim too: a strided
        # shard in DTensor's terms, with one split per TP chunk of the dim.
        split = math.prod(
            tp_mesh.size(i)
            for i, placement in enumerate(param.placements)
            if isinstance(placement, Shard) and placement.dim == shard_dim
        )
        dp_placement: Any = (
            _StridedShard(shard_dim, split_factor=split) if split > 1 else Shard(shard_dim)
        )
        self.tp_mesh = tp_mesh
        self.tp_placements = tuple(param.placements)
        self.dtensor_mesh = spmd_mesh
        # HSDP + TP: replicated over the outer dim, sharded over the next one.
        replicated = tuple(Replicate() for _ in range(dp_mesh.ndim - 1))
        self.placements = (*replicated, dp_placement, *self.tp_placements)

    # -- sizes ---------------------------------------------------------------------------
    @property
    def padded_numel(self) -> int:
        """Elements of this parameter's slot in the flat shard buffer (one rank)."""
        return self.rows_per_rank * self.row_numel

    @property
    def local_numel(self) -> int:
        return self.local_rows * self.row_numel

    @property
    def requires_grad(self) -> bool:
        return self.sharded_param.requires_grad

    # -- the sharded side ----------------------------------------------------------------
    def local_view(self, flat_shard: torch.Tensor) -> torch.Tensor:
        """This rank's real shard as an ND view (of ``self.dtype``) into ``flat_shard``."""
        flat = typed_slice(flat_shard, self.shard_offset, self.local_numel, self.dtype)
        return self._shaped(flat)

    def local_alias(self, flat_shard: torch.Tensor) -> torch.Tensor:
        """``local_view`` at storage offset 0: the sharded ``DTensor``'s local tensor."""
        return alias_at_offset_zero(self.local_view(flat_shard))

    def shard_slot(self, flat_shard: torch.Tensor) -> torch.Tensor:
        """The whole padded slot (real rows and padding) as a 1-D ``self.dtype`` view."""
        return typed_slice(flat_shard, self.shard_offset, self.padded_numel, self.dtype)

    def reduced_view(self, reduced: torch.Tensor, base: int = 0) -> torch.Tensor:
        """This rank's real rows of a reduce-scatter output (reduce layout, ``offset``),
        where ``reduced`` starts at element ``base`` of that layout."""
        start = self.offset - base
        return self._shaped(reduced[start : start + self.local_numel])

    def _shaped(self, flat: torch.Tensor) -> torch.Tensor:
        d = self.shard_dim
        return flat.view(*self.shape[:d], self.local_rows, *self.shape[d + 1 :])

    def as_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """An unsharded-shaped tensor (e.g. a gradient; TP-local for a TP DTensor) laid
        out so that cutting its dim 0 into ``world_size`` chunks gives each rank's shard in
        the layout of its slot: the tensor itself for Shard(0) (the chunks are padded when
        uneven); for Shard(d), ``(world_size, elements before d, the rest)``, a strided
        view (see [Note: sharding a dim other than 0])."""
        if isinstance(tensor, DTensor):
            if tuple(tensor.placements) != self.tp_placements:
                # DTensor's backward may lay a gradient out differently from its parameter
                # (a row-sharded embedding gets a replicated one): its local part would not
                # be this rank's TP shard. Bring it to the parameter's TP placements.
                target = self.tp_placements
                if self.spmd is not None:
                    target = local_gradient_placements(self.spmd, tensor, target)
                if target != tuple(tensor.placements):
                    tensor = tensor.redistribute(placements=target)
            tensor = tensor.to_local()
        if not self.shard_dim:
            return tensor
        return tensor.reshape(self.outer_numel, self.world_size, -1).transpose(0, 1)

    def init_sharded_param(
        self, full: torch.Tensor, flat_shard: torch.Tensor, requires_grad: bool
    ) -> None:
        """Copy this rank's rows of ``full`` into the flat buffer (or, for a parameter
        kept apart, into a padded tensor of its own class) and create the DTensor."""
        if self.apart:
            local = self._own_shard(full)
        else:
            local = self.local_alias(flat_shard)
            if full.device.type != "meta" and self.local_rows > 0:
                with torch.no_grad():
                    local.copy_(full.narrow(self.shard_dim, self.first_row, self.local_rows))
        self._local_layout = (local.shape, local.stride())
        dtensor = self._global(local, self.dtensor_mesh, self.placements)
        self.sharded_param = nn.Parameter(dtensor, requires_grad=requires_grad)
        # [Note: the parameter keeps its own mesh] ``nn.Parameter`` detaches a DTensor
        # through DTensor's dispatch, whose sharding-propagation cache compares meshes by
        # layout and dim names, not process groups: after an earlier parameter of the same
        # shape on another mesh over the same ranks (a process group with another timeout,
        # one since destroyed), the new parameter would come back on that mesh, and its
        # ``full_tensor()``, gradient clipping and checkpoints would use the other process
        # group. Put back the spec built here, on the mesh the caller gave.
        self.sharded_param._spec = dtensor._spec  # type: ignore[attr-defined]
        _SHARD_OWNERS[id(self.sharded_param)] = self
        # Gradients share the parameter's spec (mesh, placements, global shape). Building
        # it once here and wrapping each step's gradient with the DTensor constructor
        # costs ~5 us per parameter; ``from_local`` recomputes it (~0.4 ms at 256 ranks).
        self._spec = dtensor._spec

    def _own_shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a tensor subclass, in a padded tensor of the same class made
        with the ops torch's ``fully_shard`` uses (``chunk``, ``new_zeros``, ``narrow``,
        ``copy_``), which such subclasses implement for it: the real rows, a view of it."""
        with torch.no_grad():
            chunks = torch.chunk(full, self.world_size, dim=0)
            padded = full.new_zeros((self.rows_per_rank, *self.shape[1:]))
            if self.local_rows > 0 and full.device.type != "meta":
                padded.narrow(0, 0, self.local_rows).copy_(chunks[self.shard_rank])
            return padded.narrow(0, 0, self.local_rows)

    def new_extension(self) -> GatherExtension:
        """The all-gather extension state for this parameter's local tensor."""
        if self.shard_dim:
            raise NotImplementedError(
                f"fully_shard: parameter '{self.fqn}' has all-gather extensions "
                f"(fsdp_pre_all_gather) and is sharded on dim {self.shard_dim}; extensions "
                f"are gathered on dim 0, so return None (Shard(0)) from shard_placement_fn."
            )
        rest = tuple(self.shape[1:])
        return GatherExtension(
            self.fqn,
            self.uses[0][0],
            self.shape,
            (self.rows_per_rank, *rest),
            (self.local_rows, *rest),
            uneven=self.rows_per_rank * self.world_size != self.shape[0],
        )

    def gather_inputs(
        self, mesh: DeviceMesh, mp_policy: Any, device: torch.device
    ) -> list[torch.Tensor]:
        """The all-gather inputs ``fsdp_pre_all_gather`` makes of the local shard."""
        return self._require_extension().inputs(self.local_tensor(), mesh, mp_policy, device)

    def finish_gather(self, param_dtype: torch.dtype) -> None:
        """Build (first gather) or refill the unsharded parameter from the extension's
        gathered outputs with ``fsdp_post_all_gather``."""
        value = self._require_extension().post_all_gather(
            self.local_tensor(), param_dtype, self.unsharded_param
        )
        if value is None:
            return
        value = self._with_tp_layout(value)
        self.unsharded_param = nn.Parameter(value, requires_grad=self.sharded_param.requires_grad)
        setattr(self.unsharded_param, UNSHARDED_ATTR, self.fqn)

    def _require_extension(self) -> GatherExtension:
        if self.extension is None:
            raise RuntimeError(f"fully_shard: parameter '{self.fqn}' has no all-gather extension")
        return self.extension

    def local_tensor(self) -> torch.Tensor:
        """The sharded parameter's local tensor, whatever storage it currently uses. Read
        without dispatching an op, so it also works under ``torch.func`` transforms (a
        first forward inside ``jvp``), which would wrap the result."""
        return self.sharded_dtensor()._local_tensor

    def sharded_dtensor(self) -> DTensor:
        """``sharded_param`` typed as what it is: ``nn.Parameter(dtensor)`` is an instance
        of ``DTensor`` (Parameter subclasses the wrapped tensor's class)."""
        # cast, not isinstance: free on the hot path, and every assignment wraps a DTensor.
        return cast(DTensor, self.sharded_param)

    def points_into(self, flat_shard: torch.Tensor) -> bool:
        """Whether the local tensor is still our view (``.to()``/``assign=True`` replace it)."""
        local = self.local_tensor()
        if self.tied_to is not None:  # the owner's view: our slot only mirrors it
            return local.device == flat_shard.device and local.dtype == self.dtype
        if self.local_rows == 0:
            return local.device == flat_shard.device and local.dtype == self.dtype
        # Addresses and metadata only, no view: this also runs under torch.func transforms.
        start = flat_shard.data_ptr() + self.shard_offset * flat_shard.element_size()
        return (
            local.data_ptr() == start
            and local.device == flat_shard.device
            and local.dtype == self.dtype
            and local.shape == self._local_layout[0]
            and local.stride() == self._local_layout[1]
        )

    def repoint(self, flat_shard: torch.Tensor) -> None:
        """Copy the current local values into ``flat_shard`` and make it the local tensor.

        The parameter object is kept, so optimizers holding it stay valid. DTensor has no
        public setter for its local tensor; assigning ``_local_tensor`` (here) and reusing
        the parameter's ``_spec`` (``sharded_grad``) are the two places we touch DTensor
        internals.
        """
        local = self.local_tensor()
        view = self.local_alias(flat_shard)
        self._local_layout = (view.shape, view.stride())
        if local.device.type != "meta" and self.local_rows > 0:
            with torch.no_grad():
                view.copy_(local)
        if self.tied_to is not None:
            return  # the DTensor stays the owner's view
        dtensor = self.sharded_dtensor()
        dtensor._local_tensor = view
        self._spec = dtensor._spec  # module.to(dtype) may have changed it

    def adopt_assigned(self) -> None:
        """Make the parameter now registered on the module our sharded parameter, if
        ``load_state_dict(assign=True)`` (or a plain ``setattr``) replaced ours: its values
        become the shard (``repoint`` then moves them into the flat buffer)."""
        module, name = self.uses[0]
        current = module._parameters.get(name)
        if current is None or current is self.sharded_param or current is self.unsharded_param:
            return
        if not isinstance(current, DTensor):
            raise ValueError(
                f"fully_shard: parameter '{self.fqn}' was replaced by a {type(current).__name__} "
                f"of shape {tuple(current.shape)}; a sharded module needs DTensor shards there. "
                f"Load a sharded state dict (e.g. another sharded model's state_dict(), or "
                f"distribute_tensor(full, mesh, placements)), or load without assign=True. "
                f"torch.func.functional_call swaps in such tensors too: call it on a "
                f"non-sharded copy of the module."
            )
        if (
            current.shape != self.global_shape
            or tuple(current.placements) != tuple(self.placements)
            or current.device_mesh != self.dtensor_mesh
        ):
            raise ValueError(
                f"fully_shard: parameter '{self.fqn}' was replaced by a DTensor of shape "
                f"{tuple(current.shape)} with placements {tuple(current.placements)} on "
                f"{current.device_mesh}; it must match the sharded parameter: shape "
                f"{tuple(self.global_shape)}, placements {tuple(self.placements)} on "
                f"{self.dtensor_mesh}."
            )
        owner = owner_of(current)
        if owner is not None and owner is not self:
            # Another parameter's shard: tie to it ([Note: weights tied after sharding]).
            self.tied_to = owner
            self.sharded_param = current
            self.register(current)
            return
        if not isinstance(current, nn.Parameter):
            current = nn.Parameter(current, requires_grad=self.sharded_param.requires_grad)
        self.tied_to = None
        self.sharded_param = current
        _SHARD_OWNERS[id(current)] = self
        self.register(current)

    def refresh_tied(self, flat_shard: torch.Tensor) -> None:
        """Copy the owner's current shard into our slot of ``flat_shard`` (a tied
        parameter, before its group's all-gather)."""
        if self.local_rows > 0:
            with torch.no_grad():
                self.local_view(flat_shard).copy_(self.local_tensor())

    def register(self, param: nn.Parameter) -> None:
        """Make ``param`` the module attribute at every use (a dict write, no hooks)."""
        for module, name in self.uses:
            module._parameters[name] = param

    def register_unsharded(self) -> None:
        """Register the unsharded parameter, with the sharded one's ``requires_grad``."""
        unsharded = self.require_unsharded_param()
        requires_grad = self.sharded_param.requires_grad
        if unsharded.requires_grad != requires_grad:
            unsharded.requires_grad_(requires_grad)
        self.registered_requires_grad = requires_grad
        self.register(unsharded)

    def sync_requires_grad(self) -> None:
        """Give the sharded and unsharded parameters the same ``requires_grad``: the one
        changed since the unsharded parameter was registered wins (the module's, when
        both were); see [Note: requires_grad changed while gathered]."""
        unsharded, sharded = self.unsharded_param, self.sharded_param
        if unsharded is None:
            return
        wanted = unsharded.requires_grad
        if wanted == self.registered_requires_grad:  # not changed through the module
            wanted = sharded.requires_grad
        if sharded.requires_grad != wanted:
            sharded.requires_grad_(wanted)
        if unsharded.requires_grad != wanted:
            unsharded.requires_grad_(wanted)
        self.registered_requires_grad = wanted

    # -- the unsharded side --------------------------------------------------------------
    def init_unsharded_param(
        self, unsharded_flat: torch.Tensor, dtype: torch.dtype, start: int
    ) -> torch.Tensor:
        """Create the persistent unsharded parameter (of ``dtype``) as a view into the
        group's unsharded buffer at element ``start`` (of that buffer); return the copy-out
        target, a ``(world_size, slot)`` view of the same slot in the buffer's own dtype
        (bytes for a byte buffer), through the write alias (see [Note: storage resize and
        autograd])."""
        ws = self.world_size
        slot = typed_slice(unsharded_flat, start, ws * self.padded_numel, dtype)
        stop = start + slot.numel() * dtype.itemsize // unsharded_flat.element_size()
        if self.shard_dim:  # even by construction: no padding, the natural layout
            unsharded = slot.view(self.shape)
        else:
            unsharded = slot.view(ws * self.rows_per_rank, *self.shape[1:])[: self.shape[0]]
        unsharded = self._with_tp_layout(unsharded)
        self.unsharded_param = nn.Parameter(
            unsharded, requires_grad=self.sharded_param.requires_grad
        )
        setattr(self.unsharded_param, UNSHARDED_ATTR, self.fqn)
        write = unsharded_flat.data[start:stop]
        if self.shard_dim:
            # Rank r's shard is the r-th of ws equal spans within each outer index.
            return write.view(self.outer_numel, ws, -1).transpose(0, 1)
        return write.view(ws, (stop - start) // ws)

    def _with_tp_layout(self, unsharded: torch.Tensor) -> torch.Tensor:
        """A TP parameter's unsharded value (TP-local) wrapped as the DTensor TP modules
        compute with; any other parameter's as it is."""
        if self.tp_mesh is None:
            return unsharded
        return self._global(unsharded, self.tp_mesh, self.tp_placements)

    def write_back(self, chunk: torch.Tensor) -> None:
        """Copy this rank's ``chunk`` of the unsharded parameter (its copy-out target for
        this rank: the padded slot in the unsharded buffer, in the buffer's dtype) into the
        sharded parameter, where the two differ; see [Note: in-place changes to unsharded
        parameters] (this module)."""
        local = self.local_tensor()
        n = local.numel()
        if n == 0:
            return
        dtype = self.require_unsharded_param().dtype
        if chunk.dtype != dtype:  # a byte buffer (mixed dtypes)
            chunk = chunk.view(dtype)
        source = chunk.reshape(-1)[:n].view(local.shape)
        with torch.no_grad():
            if source.dtype == local.dtype:
                local.copy_(source)
                return
            # Mixed precision: only the elements changed since the gather (which cast the
            # shard) are taken, so the others keep their full precision.
            source = source.to(local.device)
            changed = source != local.to(source.dtype)
            local.copy_(torch.where(changed, source.to(local.dtype), local))

    def require_unsharded_param(self) -> nn.Parameter:
        """``unsharded_param``, which exists once the group's lazy init made it."""
        if self.unsharded_param is None:
            raise RuntimeError(
                f"fully_shard: parameter '{self.fqn}' has no unsharded parameter "
                f"(used before lazy initialization)"
            )
        return self.unsharded_param

    def sharded_grad(self, local_grad: torch.Tensor) -> DTensor:
        """Wrap a reduced local gradient shard as a DTensor shaped like the parameter."""
        meta = self._spec.tensor_meta  # set: the spec was built with shape and stride
        if meta is not None and local_grad.dtype == meta.dtype:
            return DTensor(local_grad, self._spec, requires_grad=False)
        # A dtype the cached spec does not describe.
        return self._global(local_grad, self.dtensor_mesh, self.placements)

    def _global(self, local: torch.Tensor, mesh: DeviceMesh, placements: Any) -> DTensor:
        """``local`` as this rank's part of a DTensor of the parameter's global shape, kept
        where it is. ``DTensor.from_local`` would copy a local tensor on another device type
        than the mesh's to the mesh's device: with CPU offload on an accelerator mesh the
        sharded parameters would leave the (pinned) flat shard for device copies."""
        meta = TensorMeta(self.global_shape, contiguous_stride(self.global_shape), local.dtype)
        spec = DTensorSpec(mesh, shared_placements(placements), meta)
        return DTensor(local, spec, requires_grad=False)


# One tuple per distinct placements: the specs of all parameters (and gradients) laid out
# alike share it, so code that groups tensors by layout (gradient clipping) can compare by
# identity instead of hashing each ``Placement`` in Python.
_PLACEMENTS: dict[tuple[Placement, ...], tuple[Placement, ...]] = {}


def shared_placements(placements: Iterable[Placement]) -> tuple[Placement, ...]:
    """``placements`` as a tuple, the same object for equal placements."""
    key = tuple(placements)
    return _PLACEMENTS.setdefault(key, key)


def refuse_plain_values(
    names: tuple[str, ...],
    module: nn.Module,
    state_dict: Mapping[str, Any],
    prefix: str,
    local_metadata: Mapping[str, Any],
    *_: Any,
) -> None:
    """``load_state_dict`` pre-hook of a module whose parameters ``names`` are sharded: a
    plain tensor for one of them (typically a full state dict) raises an error that says
    how to load it, instead of DTensor's "got mixed torch.Tensor and DTensor" for every
    entry. With ``assign=True`` the adoption check (``ensure_shards_bound``) explains it."""
    if local_metadata.get("assign_to_params_buffers", False):
        return
    for name in names:
        value = state_dict.get(prefix + name)
        current = module._parameters.get(name)
        if (
            isinstance(value, torch.Tensor)
            and not isinstance(value, DTensor)
            and isinstance(current, DTensor)
        ):
            local_shape = tuple(current.to_local().shape)
            raise RuntimeError(
                f"load_state_dict: '{prefix}{name}' is a plain tensor of shape "
                f"{tuple(value.shape)}, but fully_shard made that parameter a DTensor (global "
                f"shape {tuple(current.shape)}, this rank's shard {local_shape}). Load full "
                f"weights with fsdp2.load_full_state_dict(model, state_dict) (rank 0's dict, "
                f"broadcast) or torch's set_model_state_dict(model, state_dict, "
                f"options=StateDictOptions(full_state_dict=True)); or pass DTensor values "
                f"(another sharded model's state_dict(), or distribute_tensor(full, mesh, "
                f"placements))."
            )
