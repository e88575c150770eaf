"""The bytes of one planned group's buffers, from parameter shapes alone.

``fully_shard`` lays a group out in ``ParamGroup._plan_layout`` (``_param_group``) and
reduces it in ``GradientReduction.reduce_grads`` (``_grad_reduce``); this module repeats
those size rules without building a group, so any world size can be planned without the
ranks or the memory: per rank ``ceil(rows / W)`` rows of each parameter (the padded
shard), unsharded parameters each starting at ``UNSHARDED_ALIGN_BYTES`` unless the
all-gather writes in place, the reduce-scatter input holding the trainable parameters'
padded shards plus the "had a gradient" flags padded to ``REDUCE_FLAG_ALIGN_BYTES`` per
rank, and, with the divergence checks on (``fsdp2.set_divergence_checks``, read when the
plan is made), the fingerprints: a tail after each rank's all-gather data (padded to 16
bytes), a 64-byte block after each reduction chunk's flags, and no all-gather straight
into the unsharded buffer where there is more than one rank. The constants are the
runtime's own, imported, so a change there changes the plan; ``tests/test_plan.py``
checks every figure against a sharded model's buffers.

Not modelled (the planner refuses them or says so in the report): parameters that are
already ``DTensor``s (tensor parallelism), ``shard_placement_fn``, all-gather extensions.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from fsdp2._divergence import checks_enabled
from fsdp2._fingerprints import BLOCK_BYTES, TAIL_BYTES, block_numel, tailed_numel
from fsdp2._grad_pack import REDUCE_FLAG_ALIGN_BYTES, promote_dtypes
from fsdp2._param_group import UNSHARDED_ALIGN_BYTES
from fsdp2._policies import MixedPrecisionPolicy


@dataclass(frozen=True)
class ParamInfo:
    """One parameter of the model, as the planner sees it (no data)."""

    index: int  # position among the model's distinct parameters
    fqn: str  # its first name under the model
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class MeshShape:
    """The data-parallel mesh planned for: ``replicate`` x ``shard`` ranks (1-D FSDP:
    ``replicate == 1``), on ``device_type``. ``backend`` (the process group's, else the
    device type's default) decides how long a reduce-scatter input lives: gloo copies
    it, NCCL reads it until the wait, torch's fake process group neither."""

    shard: int
    replicate: int = 1
    device_type: str = "cpu"
    backend: str | None = None

    @property
    def world_size(self) -> int:
        return self.shard * self.replicate


def flag_numel(count: int, dtype: torch.dtype) -> int:
    """``GradientReduction.flag_numel``: ``count`` flags padded to the flag alignment."""
    per_region = max(1, REDUCE_FLAG_ALIGN_BYTES // dtype.itemsize)
    return -(-count // per_region) * per_region


@dataclass(frozen=True)
class GroupLayout:
    """Sizes in bytes of one group's buffers on one rank (rank 0: every rank's padded
    shard is the same size, and rank 0 holds real rows in all of it)."""

    params: tuple[ParamInfo, ...]  # in the group's order: trainable first
    world_size: int  # of the shard dim
    shard_bytes: int  # the flat shard: sharded parameters
    gather_numel: int  # elements per rank in the all-gather
    gather_itemsize: int
    all_gather_bytes: int  # the all-gather output, world_size * per rank
    gather_in_place: bool  # the all-gather writes the unsharded buffer (no copy-out)
    unsharded_bytes: int  # the unsharded buffer, alignment gaps included
    gap_bytes: int  # of which alignment gaps
    compute_itemsize: dict[int, int]  # parameter index -> bytes per unsharded element
    reduce_numel: int  # elements per rank reduce-scattered (0: nothing trainable)
    reduce_itemsize: int
    reduce_flag_slack: int  # ``GradientReduction.reduce_flag_bytes``
    flags_bytes: int  # the flags tensor built at each reduction (world_size rows)
    grad_copy_bytes: int  # sharded gradients copied out of the reduced output (dtype change)
    grads_view_reduced: bool  # some sharded gradient is a view of the reduced output
    # The divergence checks' fingerprints ride in the collectives (docs/divergence.md).
    fingerprints: bool = False
    tail_slack: int = 0  # ``GroupAllGather.tail_bytes``: the buffer pool's slack for tails

    @property
    def gathers_in_place(self) -> bool:
        """Whether the all-gather writes the unsharded buffer (no tails between rows)."""
        return self.gather_in_place and not (self.fingerprints and self.world_size > 1)

    def gather_bytes(self, ranks: int, message: int) -> int:
        """An all-gather's output: ``ranks`` slots of ``message`` elements, each followed
        by its tail with the checks on."""
        row = (
            tailed_numel(message, _ITEMSIZE_DTYPE[self.gather_itemsize])
            if self.fingerprints
            else message
        )
        return ranks * row * self.gather_itemsize

    @property
    def reduce_input_bytes(self) -> int:
        return self.world_size * self.reduce_numel * self.reduce_itemsize

    @property
    def reduce_output_bytes(self) -> int:
        return self.reduce_numel * self.reduce_itemsize

    @property
    def trainable(self) -> tuple[ParamInfo, ...]:
        return tuple(p for p in self.params if p.requires_grad)

    def unsharded_grad_bytes(self, param: ParamInfo) -> int:
        """The unsharded gradient autograd produces for ``param`` (compute dtype)."""
        return param.numel * self.compute_itemsize[param.index]

    def post_forward_bytes(self, size: int) -> int:
        """``reshard_after_forward=size``: the share kept after forward (with room for a
        tail, whether or not the checks are on)."""
        if size <= 1:
            return 0
        message = self.world_size // size * self.gather_numel
        return tailed_numel(message, _ITEMSIZE_DTYPE[self.gather_itemsize]) * self.gather_itemsize

    def post_forward_gather_bytes(self, size: int) -> int:
        """The backward all-gather's output within the post-forward group of ``size``."""
        return self.gather_bytes(size, self.world_size // size * self.gather_numel)


def padded_rows(param: ParamInfo, world_size: int) -> tuple[int, int]:
    """``(rows per rank, elements per row)`` of ``param``'s padded dim-0 shard."""
    if not param.shape:
        raise ValueError(
            f"plan_sharding: parameter '{param.fqn}' is 0-dimensional; fully_shard shards "
            f"dim 0 and would refuse it. Give it shape (1,), or pass it in ignored_params."
        )
    rows = param.shape[0]
    return -(-rows // world_size), math.prod(param.shape[1:])


def group_layout(
    params: list[ParamInfo],
    mesh: MeshShape,
    mp_policy: MixedPrecisionPolicy,
    *,
    offload_to_host: bool = False,
) -> GroupLayout:
    """The buffers ``fully_shard`` would build for ``params`` (in discovery order), as
    ``ParamGroup._plan_layout`` and ``_plan_unsharded`` and ``reduce_grads`` size them.
    ``offload_to_host``: the shards and sharded gradients live in host memory while
    compute runs on an accelerator (so the reduced output is copied to the host)."""
    ws = mesh.shard
    if not params:  # a call whose modules' parameters all belong to other calls
        return GroupLayout((), ws, 0, 0, 1, 0, True, 0, 0, {}, 0, 1, 0, 0, 0, False)
    fingerprints = checks_enabled()
    ordered = sorted(params, key=lambda p: not p.requires_grad)  # trainable first, stable
    dtypes = [p.dtype for p in ordered]
    mixed = len(set(dtypes)) > 1
    padded = {p.index: math.prod(padded_rows(p, ws)) for p in ordered}
    shard_bytes = sum(padded[p.index] * p.dtype.itemsize for p in ordered)
    policy_dtype = mp_policy.param_dtype
    if policy_dtype is not None or not mixed:
        gather_dtype = policy_dtype or dtypes[0]
        gather_params = ordered
        gather_sizes = [padded[p.index] for p in ordered]
    else:  # [Note: mixed-dtype groups]: the shard's bytes, by decreasing itemsize
        gather_dtype = torch.uint8
        gather_params = sorted(ordered, key=lambda p: (-p.dtype.itemsize, str(p.dtype)))
        gather_sizes = [padded[p.index] * p.dtype.itemsize for p in gather_params]
    gather_numel = sum(gather_sizes)
    itemsize = gather_dtype.itemsize
    align = max(1, UNSHARDED_ALIGN_BYTES // itemsize)
    offsets = [sum(gather_sizes[:i]) for i in range(len(gather_sizes))]
    in_place = len(ordered) == 1 or (ws == 1 and all((ws * o) % align == 0 for o in offsets))
    if in_place:
        end = ws * gather_numel
    else:
        end = 0
        for size in gather_sizes:
            end = -(-end // align) * align + ws * size
    unsharded_numel = max(ws * gather_numel, end)
    compute = {p.index: (policy_dtype or p.dtype).itemsize for p in ordered}
    # Reduction: the trainable parameters, in the group's order, then the flags.
    trainable = [p for p in ordered if p.requires_grad]
    param_dtype = policy_dtype or (None if mixed else dtypes[0])
    reduce_dtype = mp_policy.reduce_dtype or param_dtype
    if trainable:
        step_dtype = reduce_dtype or promote_dtypes(p.dtype for p in trainable)
        flags = flag_numel(len(trainable), step_dtype)
        # ``GradientPacking.fingerprint_block_numel``: after the flags, a block, where a
        # collective runs (or HSDP's all-reduce will).
        block = block_numel(step_dtype) if fingerprints and (ws > 1 or mesh.replicate > 1) else 0
        reduce_numel = sum(padded[p.index] for p in trainable) + flags + block
        flag_region = flag_numel(len(ordered), step_dtype) * step_dtype.itemsize
        slack = ws * (flag_region + BLOCK_BYTES)
        grad_dtypes = {policy_dtype or p.dtype for p in trainable}
        flag_dtype = grad_dtypes.pop() if len(grad_dtypes) == 1 else step_dtype
        flags_bytes = ws * (flags + block) * flag_dtype.itemsize
        copied = [p for p in trainable if p.dtype != step_dtype or offload_to_host]
        grad_copy = sum(padded[p.index] * p.dtype.itemsize for p in copied)
        views = len(copied) < len(trainable)
        reduce_itemsize = step_dtype.itemsize
    else:
        reduce_numel = slack = flags_bytes = grad_copy = 0
        views = False
        reduce_itemsize = (reduce_dtype or dtypes[0]).itemsize
    return GroupLayout(
        params=tuple(ordered),
        world_size=ws,
        shard_bytes=shard_bytes,
        gather_numel=gather_numel,
        gather_itemsize=itemsize,
        all_gather_bytes=ws
        * (tailed_numel(gather_numel, gather_dtype) if fingerprints and ws > 1 else gather_numel)
        * itemsize,
        gather_in_place=in_place,
        unsharded_bytes=unsharded_numel * itemsize,
        gap_bytes=(unsharded_numel - ws * gather_numel) * itemsize,
        compute_itemsize=compute,
        reduce_numel=reduce_numel,
        reduce_itemsize=reduce_itemsize,
        reduce_flag_slack=slack,
        flags_bytes=flags_bytes,
        grad_copy_bytes=grad_copy,
        grads_view_reduced=views,
        fingerprints=fingerprints and ws > 1,
        tail_slack=ws * 2 * TAIL_BYTES,
    )


# A dtype of each itemsize (the tail's padding depends on the itemsize only).
_ITEMSIZE_DTYPE = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


@functools.cache
def shard_shape(shape: tuple[int, ...], world_size: int) -> tuple[int, ...]:
    """Rank 0's local shard of a parameter of ``shape`` (the padded rows: rank 0 holds
    ``ceil(rows / W)`` real rows whenever the parameter has any)."""
    return (-(-shape[0] // world_size), *shape[1:])
