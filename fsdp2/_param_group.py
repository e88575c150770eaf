"""A parameter group: the parameters one ``fully_shard`` call manages, communicated together.

A group owns three buffers (see [Note: flat shard buffer] and [Note: storage resize and
autograd] in ``_param``):

- ``flat_shard``: 1-D, ``S`` elements, every local padded shard; the all-gather input.
  ``uint8`` (``S`` bytes) when the parameters' dtypes differ: see [Note: mixed-dtype groups].
- ``unsharded_flat``: 1-D, ``world_size * S`` elements (plus alignment gaps), the
  unsharded parameters, param-major, each aligned (see [Note: aligned unsharded
  parameters]); storage freed (resized to 0) while sharded.
- a transient all-gather output (rank-major) that one fused ``split_with_sizes_copy``
  copies into ``unsharded_flat``. A group with a single parameter has identical rank-major
  and param-major layouts, so it gathers straight into ``unsharded_flat`` with no copy.

Per-step work here is per group: one collective per direction, one fused copy-out, one
fused reduce-scatter copy-in (``torch._chunk_cat``, or ``torch.cat`` when it must also
cast). The loops over parameters that remain touch only Python attributes (registering
tensors on modules, reading ``.grad``); the one per-parameter kernel left is padding an
uneven gradient that is also cast (mixed precision with a wider ``reduce_dtype``).

[Note: mixed-dtype groups]
torch's FSDP2 requires one original dtype per group; we accept any mix (e.g. an fp32
norm or router inside a bf16 block) and keep one collective per direction:

- Shards: the flat shard buffer is ``uint8``; parameter slots are byte ranges ordered by
  decreasing itemsize (stable), so every slot starts at a multiple of its dtype's itemsize
  with no gap bytes, and each local tensor is a ``.view(dtype)`` of its range.
- All-gather without ``param_dtype``: the byte buffer itself is the input (still no
  copy-in), the output and the unsharded buffer are bytes too, and copy-out is the same one
  ``split_with_sizes_copy``, on bytes; unsharded parameters are typed views. With
  ``param_dtype`` every parameter is gathered in that dtype: one ``torch.cat`` of the typed
  slots (inputs of several dtypes, one output dtype) is the single fused cast, and the rest
  is the one-dtype path.
- Reduce-scatter: ``reduce_dtype`` (else ``param_dtype``) when set; otherwise the
  promotion of the trainable parameters' dtypes (fp32 for bf16 + fp32), in one collective:
  a per-dtype reduce-scatter would cost one collective per dtype per group (latency, and
  the one-collective-per-group schedule), while reducing the narrower gradients in the wider
  dtype only makes their sum more accurate; its price is the wider bytes for those
  gradients. The copy-in ``torch.cat`` casts as it copies. Trainable parameters come first
  and are ordered by dtype within that, so the reduced output is converted back with one
  cast per run of equal dtypes (at most one per dtype and trainable/frozen class), not one
  per parameter.

[Note: aligned unsharded parameters]
Every unsharded parameter starts at a multiple of ``UNSHARDED_ALIGN_BYTES`` (256) of the
unsharded buffer (whose own start the allocator aligns). Packed back to back at
``world_size * offset``, a parameter would start wherever the sizes before it end, and
compute kernels pick their code path by the address: CPU matmuls (MKL) sum in a
different order for a weight that is not 16-byte aligned, so the same forward gave results
one ulp off torch's ``fully_shard`` (whose unsharded parameters are separate, aligned
allocations), and GPU matmul heuristics take the alignment (up to 256 bytes) into account
too. The gaps cost at most 255 bytes per parameter. They exist only in the unsharded
buffer: the flat shard (the all-gather input) and the all-gather output stay packed, and
the copy-out already writes each parameter's rows into its own slot. Where the all-gather
writes straight into the unsharded buffer (one parameter; one rank with aligned slots),
there are no gaps.

[Note: gradients some ranks lack]
Ranks may use different parameters of one group in a step (mixture-of-experts routing,
optional branches), so a rank can reach a group's reduce-scatter without some gradients.
Two things must then not depend on local gradients: the collective's size (else ranks
disagree and hang), and whether a rank stores its shard of the reduced gradient (else the
update that other ranks' gradients make to this rank's rows is lost). So the reduced
prefix is fixed by ``requires_grad`` (every parameter up to the last trainable one), a
missing gradient contributes zeros, and each rank's chunk of the reduce-scatter input ends
with one flag per parameter (1 if this rank had its gradient). After the sum, a rank stores
a gradient if any rank had it; a parameter no rank used keeps ``grad is None``, like in
non-sharded training. Only a rank that lacked some gradient itself reads them (a host sync
on accelerators). A group with no gradient on any rank still reduces (zeros): the schedule
of collectives must not depend on data.
The flags region of a chunk is padded with zeros to a multiple of
``REDUCE_FLAG_ALIGN_BYTES`` (64); see [Note: padded gradient flags]. The flags cost that
region per rank in each reduce-scatter input and once in the reduced gradients; nothing
is kept between steps, and the buffer pool's slack is sized for them.

[Note: padded gradient flags]
The flags lengthen each rank's chunk of the reduce-scatter input from torch's ``S``
elements (the padded shards) to ``S + F``, and how a backend sums a chunk can depend on
that length. Gloo's ring splits the whole input into ``k`` segments per rank of
``ceil(chunk / k)`` elements (``k = 2`` while a segment stays under 1 MiB, more beyond),
so rank ``r``'s first ``r * ((-chunk) % k)`` elements belong to the segment of rank
``r - 1``, which adds the ranks' terms in another order. With one flag per parameter
(``F = count``) that changed with the parity of ``count``: at 3 ranks gradients came out
one ulp off torch's. Padding ``F`` to 64 bytes (16 fp32 or 32 bf16 elements) keeps
``S + F = S (mod k)`` for every ``k`` dividing that, which covers ``k = 2`` (per-rank
chunks up to 2 MiB) and ``k = 4, 8, 16``, so every element is summed in torch's order
there; larger groups can still differ in the last bit at the first few elements of a
rank's chunk. At 2 ranks the order of a two-term sum does not matter. The cost is at most
64 bytes per rank per reduce-scatter.

[Note: stale unsharded parameters]
A group that stays unsharded after its forward (``reshard_after_forward=False``, the root
by default, or ``unshard()`` called by the user) is normally resharded by its
post-backward, before the optimizer runs. Without a backward (the loss was discarded, a
forward with grad enabled for logging, a step whose outputs needed no gradient) it stays
unsharded through ``optimizer.step()``, which writes only the shards; the next forward
would find the group unsharded and compute with the old weights (torch's ``fully_shard``
does). So every all-gather records the flat shard it read and the version counters of it and
of the sharded parameters (an optimizer's in-place update bumps the ``DTensor``'s own
counter, not its local tensor's: one integer read per parameter per step), and the
root's pre-forward reshards
any group whose shards changed since: its forward gathers the current values. Forwards
without an update in between (several forwards then one backward, eval loops) see the
same version and keep their unsharded parameters. The same holds for a kept post-forward
share of ``reshard_after_forward=k``, and for a user's ``unshard()`` followed by an
optimizer step: a forward always uses the current shards. Resharding keeps the unsharded
buffer's storage object (it is only emptied), so an older graph that saved the unsharded
parameters and still runs a backward sees the re-gathered values, as a non-sharded model's
graph would see its in-place updated parameters.

[Note: reduce-scatter input lifetime]
On an accelerator the reduce-scatter runs on its own stream and only we know when it is
done, so its input is kept until the event is waited on (see [Note: buffer lifetime across
streams]). A collective issued with a ``Work`` (the CPU backends) is different: c10d's
contract is that the work keeps alive every tensor the backend still reads, since a caller
may drop its own references right after the issue. So we drop ours at once. If the backend
still reads the input it stays alive through the work's reference, and nothing changes; if
it does not, the memory is freed while the collective runs. gloo's reduce-scatter is the
second case: it clones the whole input when issued, reduces the clone, and splits it in
``wait()`` (``benchmarks/gloo_collective_memory.py``). Holding our input across the overlap
with the next block's backward kept two copies of one block's gradients alive where torch's
synchronous CPU path has one (upstream's memory test: 156.5 MB vs 128.2 MB backward peak).
The input is never reused while a reference from the work may exist: it is freed, not
returned to the host buffer pool.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from enum import Enum, auto
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fsdp2._collectives import (
    PendingCollective,
    all_gather_flat,
    all_reduce_flat,
    reduce_scatter_flat,
    wait,
)
from fsdp2._host_buffers import HostBufferPool
from fsdp2._param import ShardedParam
from fsdp2._policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from fsdp2._stream_utils import (
    CommStreams,
    Event,
    Stream,
    record_event,
    use_stream,
    wait_event,
    wait_stream,
)


def _outside_functorch(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn`` with ``torch.func`` transforms (jvp, vmap, grad) switched off when one is
    active. Unsharding and resharding allocate and fill plain buffers that belong to no
    transform level, but a module's forward, and so its first all-gather and lazy init, can
    run inside one (``torch.func.jvp(lambda t: model(x), ...)``): tensors created there
    would be functorch wrappers, whose storage cannot be resized or aliased."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if torch._C._are_functorch_transforms_active():
            with torch._C._DisableFuncTorch():
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper


class ShardedState(Enum):
    SHARDED = auto()
    # reshard_after_forward=int: sharded over a smaller group until backward gathers it.
    SHARDED_POST_FORWARD = auto()
    UNSHARDED = auto()


class AllGatherInFlight(NamedTuple):
    input: torch.Tensor  # the flat shard, or its cast/device copy (kept alive until done)
    output: torch.Tensor  # 1-D, world_size * S, rank-major
    pending: PendingCollective
    from_post_forward: bool  # gathered within the post-forward group (int reshard)


class ReduceInFlight(NamedTuple):
    group: ParamGroup
    # Kept alive until the collective is done, where only we can keep it alive (a stream);
    # see [Note: reduce-scatter input lifetime].
    input: torch.Tensor | None
    output: torch.Tensor  # 1-D, the reduced flat gradient shard
    pending: PendingCollective
    has_grad: list[bool]  # per parameter of the reduced prefix: got a local gradient


class CommContext:
    """Communication state shared by every group of one FSDP tree.

    ``all_gather_release``: the event after which the all-gather stream may reuse the
    memory of buffers it allocated and we released (see [Note: buffer lifetime across
    streams]). ``reduces``: reduce-scatters not yet finished, at most
    ``max_reduces_in_flight`` (torch's ``set_reduce_scatter_max_input_buffers``, default 1:
    a group's gradient copy-in waits for the previous group's reduce-scatter, so one input
    buffer is alive at a time).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.streams = CommStreams(device)
        self.all_gather_release: Event = None
        self.reduces: list[ReduceInFlight] = []
        self.max_reduces_in_flight = 1
        self.host_buffers = HostBufferPool(device)  # see [Note: host buffer pool]

    def release_all_gather_memory(self) -> None:
        """Called after the compute stream's last use of all-gather-stream memory."""
        self.all_gather_release = record_event(self.streams.compute())

    def finish_reduces(self, keep: int = 0) -> None:
        """Finish reduce-scatters in issue order until at most ``keep`` remain in flight."""
        while len(self.reduces) > keep:
            in_flight = self.reduces.pop(0)
            in_flight.group.finish_reduce(in_flight)


class ParamGroup:
    """Parameters communicated together; see the module docstring for the buffers."""

    def __init__(
        self,
        params: list[ShardedParam],
        full_params: list[torch.nn.Parameter],
        mesh: DeviceMesh,
        device: torch.device,
        label: str,
        mp_policy: MixedPrecisionPolicy,
        offload_policy: OffloadPolicy,
    ) -> None:
        self.params = params
        self.mesh = mesh
        self.label = label  # e.g. "layers.0 (TransformerBlock)", for messages
        # HSDP (2-D mesh): shard over the last dim, replicate over the first.
        shard_dim = mesh.ndim - 1
        self.process_group = mesh.get_group(shard_dim)
        self.world_size = mesh.size(shard_dim)
        self.shard_rank = mesh.get_local_rank(shard_dim)
        self.replicate_group = mesh.get_group(0) if mesh.ndim == 2 else None
        self.replicate_size = mesh.size(0) if mesh.ndim == 2 else 1
        # HSDP with set_requires_all_reduce(False): reduce-scattered, not yet all-reduced.
        self._partial_reduce: tuple[torch.Tensor, int] | None = None
        self.mp_policy = mp_policy
        pairs = list(zip(params, full_params))  # _plan_layout may reorder ``params``
        self._plan_layout([p.dtype for p in full_params], [p.requires_grad for p in full_params])
        on_meta = any(p.device.type == "meta" for p in full_params)
        self.mesh_device = device
        self.device = torch.device("meta") if on_meta else device  # where compute runs
        # CPU offload: shards (the all-gather source) and gradients live in CPU memory.
        self.offload = isinstance(offload_policy, CPUOffloadPolicy)
        self.pin_memory = isinstance(offload_policy, CPUOffloadPolicy) and offload_policy.pin_memory
        self.shard_device = torch.device("cpu") if self.offload and not on_meta else self.device
        self.flat_shard = self._new_flat_shard(self.shard_device)
        for sp, full in pairs:
            source = full.to_local() if isinstance(full, DTensor) else full  # TP: local part
            sp.init_sharded_param(
                source.detach().to(self.shard_device), self.flat_shard, full.requires_grad
            )
            sp.register(sp.sharded_param)
        self.sharded_state = ShardedState.SHARDED
        self.comm: CommContext | None = None
        self.unsharded_flat: torch.Tensor | None = None
        self._copy_out_targets: list[torch.Tensor] = []
        # Parameters tied after sharding to another's DTensor: their slots are refreshed
        # before each all-gather (see [Note: weights tied after sharding] in ``_param``).
        self._tied: list[ShardedParam] = []
        # The flat shard (its id and version) the unsharded parameters were last gathered
        # from; see [Note: stale unsharded parameters].
        self._gathered_from: tuple[int, int] | None = None
        self._all_gather: AllGatherInFlight | None = None
        # reshard_after_forward=int (see ``set_post_forward_group``).
        self.post_forward_group: Any = None
        self.post_forward_size = 0
        self._post_forward_shard: torch.Tensor | None = None
        # Recorded on the compute stream once the cat that fills it is queued: the
        # backward all-gather, on its own stream, reads the shard only after that.
        self._post_forward_ready: Event = None
        self._post_forward_targets: list[torch.Tensor] = []
        # Runtime switches (FSDPModule setters).
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.gradient_divide_factor: float | None = None
        self.force_sum_reduction = False
        self.requires_all_reduce = True  # HSDP only; a 1-D mesh has no all-reduce
        # A backward without gradient sync left gradients here that no reduce-scatter has
        # taken yet: the next reduction (or ``FSDPState.reduce_unsynced_grads``) owes them.
        self.grads_unsynced = False
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self.all_reduce_hook_stream: Stream = None

    # -- set-up ----------------------------------------------------------------------------
    def _plan_layout(self, dtypes: list[torch.dtype], trainable: list[bool]) -> None:
        """Place every parameter (``dtypes``/``trainable`` follow ``self.params``) in the
        flat buffers and pick their dtypes. Sharded parameters keep their own dtype (the
        optimizer's master copy); compute and the all-gather use ``param_dtype``; gradients
        are reduced in ``reduce_dtype``. With several dtypes, see [Note: mixed-dtype groups].
        """
        self.mixed = len(set(dtypes)) > 1
        for p, dtype in zip(self.params, dtypes):
            p.dtype = dtype
        if self.mixed:
            # Reduce layout: trainable first (the reduced prefix), equal dtypes adjacent.
            rank = {
                id(p): (not t, -d.itemsize, str(d))
                for p, d, t in zip(self.params, dtypes, trainable)
            }
            self.params.sort(key=lambda p: rank[id(p)])
        offset = 0
        for p in self.params:
            p.offset = p.shard_offset = p.gather_offset = offset
            offset += p.padded_numel
        self._reduce_sizes = [p.padded_numel for p in self.params]
        # Shard layout: one dtype, or bytes by decreasing itemsize (aligned, no gaps).
        if self.mixed:
            self.shard_dtype = torch.uint8
            by_itemsize = sorted(self.params, key=lambda p: (-p.dtype.itemsize, str(p.dtype)))
            offset = 0
            for p in by_itemsize:
                p.shard_offset = p.gather_offset = offset
                offset += p.padded_numel * p.dtype.itemsize
            self.shard_numel = offset
        else:
            self.shard_dtype = dtypes[0]
            self.shard_numel = sum(self._reduce_sizes)
        # All-gather layout: typed (param_dtype, or the one dtype) in reduce order, or the
        # shard bytes themselves. ``param_dtype`` is None only for the byte case.
        policy_dtype = self.mp_policy.param_dtype
        if policy_dtype is not None or not self.mixed:
            self.param_dtype: torch.dtype | None = policy_dtype or dtypes[0]
            self.gather_dtype = self.param_dtype
            self._gather_params = list(self.params)
            self._gather_sizes = list(self._reduce_sizes)
            for p in self.params:
                p.gather_offset = p.offset
        else:
            self.param_dtype = None
            self.gather_dtype = torch.uint8
            self._gather_params = by_itemsize
            self._gather_sizes = [p.padded_numel * p.dtype.itemsize for p in by_itemsize]
        self.gather_numel = sum(self._gather_sizes)
        # None: the promotion of each step's gradient dtypes (mixed groups only).
        self.reduce_dtype: torch.dtype | None = self.mp_policy.reduce_dtype or self.param_dtype
        self._plan_unsharded()

    def _plan_unsharded(self) -> None:
        """Place every parameter in the unsharded buffer: param-major, each one starting
        at a multiple of ``UNSHARDED_ALIGN_BYTES``; see [Note: aligned unsharded parameters].
        """
        ws = self.world_size
        align = max(1, UNSHARDED_ALIGN_BYTES // self.gather_dtype.itemsize)
        starts = [ws * p.gather_offset for p in self._gather_params]
        # One parameter, or one rank with every slot already aligned: rank-major and
        # param-major layouts coincide, so the all-gather (or, for one rank, the cast or
        # copy that replaces it) writes straight into the unsharded buffer, no copy-out.
        self._gather_in_place = len(self.params) == 1 or (
            ws == 1 and all(start % align == 0 for start in starts)
        )
        if not self._gather_in_place:
            starts = []
            end = 0
            for size in self._gather_sizes:
                end = -(-end // align) * align
                starts.append(end)
                end += ws * size
        self._unsharded_starts = starts
        self.unsharded_numel = max(ws * self.gather_numel, starts[-1] + ws * self._gather_sizes[-1])

    def _new_flat_shard(self, device: torch.device) -> torch.Tensor:
        flat = torch.zeros(self.shard_numel, dtype=self.shard_dtype, device=device)
        if self.pin_memory and device.type == "cpu" and torch.cuda.is_available():
            flat = flat.pin_memory()  # lets host-to-device copies run asynchronously
        return flat

    @_outside_functorch
    def lazy_init(self, comm: CommContext) -> None:
        """Bind to the tree's communication context and build the unsharded buffer."""
        self.comm = comm
        # The unsharded buffer is its all-gather output plus the alignment gaps, and the
        # reduce-scatter input that plus the flags: one pooled buffer serves all three.
        gap_bytes = (self.unsharded_numel - self.world_size * self.gather_numel) * (
            self.gather_dtype.itemsize
        )
        comm.host_buffers.allow_slack(self.reduce_flag_bytes + gap_bytes)
        self.ensure_shards_bound()
        if self.flat_shard.device.type == "meta":
            raise RuntimeError(
                f"fully_shard: the parameters of {self.label} are still on the meta device at "
                f"the first forward. Materialize them first, e.g. "
                f"module.to_empty(device=...) then module.reset_parameters()."
            )
        self._init_unsharded()

    @property
    def reduce_flag_bytes(self) -> int:
        """The most the has-gradient flags add to a reduce-scatter input: the padded flags
        region of every parameter, per rank (see [Note: gradients some ranks lack]). Only
        trainable parameters are reduced, so only their dtypes count (a frozen one may have
        a dtype that promotes with nothing, float8); a mixed group's reduce dtype is chosen
        per step, and its widest candidate bounds it."""
        trainable = [p.dtype for p in self.params if p.sharded_param.requires_grad]
        if not trainable:
            return 0
        dtype = self.reduce_dtype or promote_dtypes(trainable)
        return self.world_size * self.flag_numel(len(self.params), dtype) * dtype.itemsize

    def flag_numel(self, count: int, dtype: torch.dtype) -> int:
        """Elements of the flags region at the end of each rank's reduce-scatter chunk:
        ``count`` flags, zero-padded to a multiple of ``REDUCE_FLAG_ALIGN_BYTES`` so the
        chunk keeps torch's length modulo the backend's segmenting (see
        [Note: padded gradient flags])."""
        per_region = max(1, REDUCE_FLAG_ALIGN_BYTES // dtype.itemsize)
        return -(-count // per_region) * per_region

    def set_post_forward_group(self, group: Any, size: int, index: int) -> None:
        """``reshard_after_forward=size``: after forward keep 1/size of each parameter,
        the share of rank ``index`` in ``group`` (size consecutive ranks of the shard
        group), so backward all-gathers within ``group`` only."""
        self.post_forward_group = group
        self.post_forward_size = size
        self._post_forward_index = index

    def _init_unsharded(self) -> None:
        n = self.unsharded_numel
        self.unsharded_flat = torch.empty(n, dtype=self.gather_dtype, device=self.device)
        # Views are made while the storage is allocated, then the storage is freed.
        self._copy_out_targets = [
            p.init_unsharded_param(self.unsharded_flat, self.param_dtype or p.dtype, start)
            for p, start in zip(self._gather_params, self._unsharded_starts)
        ]
        self._unsharded_write = self.unsharded_flat.data
        if self.post_forward_size:
            # Each parameter's slot split into post_forward_size equal chunks.
            size = self.post_forward_size
            self._post_forward_targets = [t.reshape(size, -1) for t in self._copy_out_targets]
        self._free_unsharded()

    def ensure_shards_bound(self) -> None:
        """Re-point local tensors that no longer view the flat buffer (after ``module.to()``,
        ``to_empty()`` or ``load_state_dict(assign=True)``), keeping their values."""
        if not self.is_unsharded:
            for p in self.params:
                p.adopt_assigned()
            self._tied = [p for p in self.params if p.tied_to is not None]
        if all(p.points_into(self.flat_shard) for p in self.params):
            return
        local = [p.local_tensor() for p in self.params]
        # ``module.to(dtype)`` may have changed dtypes (e.g. made a mixed group uniform).
        self._plan_layout([t.dtype for t in local], [p.requires_grad for p in self.params])
        first = local[0]
        if not self.offload or first.device.type != "cpu":
            self.device = first.device
        elif self.device.type == "meta":
            # Offloaded shards materialized on the CPU after a meta-device init: compute
            # runs on the mesh's device, as when the shards were offloaded at fully_shard.
            self.device = self.mesh_device
        self.shard_device = first.device
        flat = self._new_flat_shard(first.device)
        for p in self.params:
            p.repoint(flat)
        self.flat_shard = flat
        if self.unsharded_flat is not None:
            self._init_unsharded()

    # -- unshard / reshard -----------------------------------------------------------------
    @property
    def is_unsharded(self) -> bool:
        return self.sharded_state is ShardedState.UNSHARDED

    @property
    def unshard_pending(self) -> bool:
        return self._all_gather is not None

    @_outside_functorch
    def unshard(self, *, after_compute: bool = False) -> None:
        """Issue this group's all-gather on the all-gather stream (no-op if unsharded or
        already in flight). Call ``wait_for_unshard`` before using the parameters.

        ``after_compute``: order the all-gather after everything queued on the compute
        stream so far. The root's pre-forward does this once per step (the optimizer
        wrote the shards there); an ``unshard()`` called outside that window, e.g. right
        after ``optimizer.step()``, needs it too, or on an accelerator it could gather
        shards the optimizer has not finished writing.
        """
        if self.is_unsharded or self._all_gather is not None:
            return
        comm = self._require_comm()
        stream = comm.streams.all_gather
        post_forward = self.sharded_state is ShardedState.SHARDED_POST_FORWARD
        if after_compute:
            wait_stream(stream, comm.streams.compute())
        with use_stream(stream):
            # Memory released by the compute stream may be reused only after it is done.
            wait_event(stream, comm.all_gather_release)
            if self._gather_in_place:
                self._alloc_unsharded()
                output = self._unsharded_write
            else:
                output = comm.host_buffers.empty(
                    self.world_size * self.gather_numel, self.gather_dtype, self.device
                )
            if post_forward:
                ag_input, group = self._require_post_forward_shard(), self.post_forward_group
                wait_event(stream, self._post_forward_ready)  # written on the compute stream
                self._post_forward_shard = self._post_forward_ready = None
            else:
                for p in self._tied:
                    p.refresh_tied(self.flat_shard)
                self._gathered_from = self._shard_version()
                ag_input = self._all_gather_input(output)
                group = self.process_group
            if self.world_size == 1:
                # One rank holds whole parameters: no collective (torch issues none either).
                # It gathers in place, so at most the shard is copied into the output.
                if ag_input.data_ptr() != output.data_ptr():
                    output.copy_(ag_input, non_blocking=True)
                pending = PendingCollective(None, record_event(stream))
            else:
                pending = all_gather_flat(output, ag_input, group, stream)
        self._all_gather = AllGatherInFlight(ag_input, output, pending, post_forward)

    def _all_gather_input(self, output: torch.Tensor) -> torch.Tensor:
        """The flat shard itself when it is already in the gathered dtype and on the
        compute device (no copy-in). Otherwise one fused cast (mixed precision) or
        host-to-device copy (offload) written straight into this rank's slot of the
        all-gather ``output`` (an in-place all-gather), so no separate input buffer lives
        while the collective runs."""
        flat = self.flat_shard
        if flat.dtype == self.gather_dtype and flat.device == self.device:
            return flat
        n = self.gather_numel
        slot = output[self.shard_rank * n : (self.shard_rank + 1) * n]
        if not self.mixed or self.gather_dtype == torch.uint8:
            return slot.copy_(flat, non_blocking=True)
        # Mixed dtypes gathered in param_dtype: one cat casts every typed slot at once.
        source = flat.to(self.device, non_blocking=True)
        return torch.cat([p.shard_slot(source) for p in self.params], out=slot)

    def reshard_if_stale(self) -> bool:
        """Reshard (dropping a kept post-forward share too) when the shards were written
        since the unsharded parameters were gathered from them, so the next unshard
        gathers the current values; see [Note: stale unsharded parameters]. Returns
        whether it resharded."""
        gathered = self.is_unsharded or self.unshard_pending
        if not gathered and self.sharded_state is not ShardedState.SHARDED_POST_FORWARD:
            return False
        if self._gathered_from == self._shard_version():
            return False
        self.reshard()
        return True

    def _shard_version(self) -> tuple[int, int]:
        """Identifies the values of the shards: the flat shard's identity and the sum of the
        version counters of it and of every sharded parameter (each counter only grows, so
        the sum changes with any of them). The parameters' own counters are needed: an
        optimizer updates each ``DTensor`` in place, which bumps the wrapper's counter
        but not that of the local tensor (written below autograd) or of the flat shard."""
        flat = self.flat_shard
        return id(flat), flat._version + sum(p.sharded_param._version for p in self.params)

    @_outside_functorch
    def wait_for_unshard(self) -> None:
        """Wait for the in-flight all-gather, fill the unsharded parameters and register
        them on the modules."""
        in_flight = self._all_gather
        if in_flight is None:
            return
        self._all_gather = None
        comm = self._require_comm()
        compute = comm.streams.compute()
        wait(in_flight.pending, compute)
        if not self._gather_in_place:
            self._alloc_unsharded()
            if in_flight.from_post_forward:
                ranks, targets = self.post_forward_size, self._post_forward_targets
                sizes = [t.shape[1] for t in targets]
            else:
                ranks, targets, sizes = self.world_size, self._copy_out_targets, self._gather_sizes
            torch.split_with_sizes_copy(in_flight.output.view(ranks, -1), sizes, dim=1, out=targets)
            # The all-gather output (all-gather-stream memory) dies with ``in_flight``.
            comm.release_all_gather_memory()
            comm.host_buffers.release(in_flight.output)
        self.sharded_state = ShardedState.UNSHARDED
        for p in self.params:
            unsharded = p.require_unsharded_param()
            if unsharded.requires_grad != p.sharded_param.requires_grad:
                unsharded.requires_grad_(p.sharded_param.requires_grad)
            p.register(unsharded)

    @_outside_functorch
    def reshard(self, *, post_forward: bool = False) -> None:
        """Register the sharded parameters again and free the unsharded buffer. With
        ``post_forward`` and an int ``reshard_after_forward``, first keep this rank's
        share for the smaller backward all-gather (one fused copy)."""
        if self._all_gather is not None:
            self.wait_for_unshard()  # a collective cannot be cancelled: drain it
        if not self.is_unsharded:
            if not post_forward:
                self._post_forward_shard = self._post_forward_ready = None
                self.sharded_state = ShardedState.SHARDED
            return
        keep_partial = post_forward and self.post_forward_size > 0
        if keep_partial:
            index = self._post_forward_index
            chunks = [t[index] for t in self._post_forward_targets]
            self._post_forward_shard = torch.cat(chunks)
            self._post_forward_ready = record_event(self._require_comm().streams.compute())
        for p in self.params:
            p.register(p.sharded_param)
        if self._gather_in_place:
            self._require_comm().release_all_gather_memory()
        self._free_unsharded()
        self.sharded_state = (
            ShardedState.SHARDED_POST_FORWARD if keep_partial else ShardedState.SHARDED
        )

    def _alloc_unsharded(self) -> None:
        flat = self._require_unsharded_flat()
        storage = flat.untyped_storage()
        nbytes = flat.numel() * flat.element_size()
        if storage.size() < nbytes:
            self._require_comm().host_buffers.fill(storage, nbytes)

    def _free_unsharded(self) -> None:
        storage = self._require_unsharded_flat().untyped_storage()
        if self.comm is None:  # at lazy init, before any use
            storage.resize_(0)
        else:
            self.comm.host_buffers.drain(storage)

    # -- gradients -------------------------------------------------------------------------
    def has_unsharded_grads(self) -> bool:
        return any(
            p.unsharded_param is not None and p.unsharded_param.grad is not None
            for p in self.params
        )

    def reduce_grads(self) -> None:
        """Reduce-scatter the unsharded gradients (one fused copy-in, one collective) and
        drop them. The result is assigned to the sharded parameters by ``finish_reduce``,
        when the collective is waited on: later, so it overlaps the rest of backward."""
        # Which parameters a rank used can differ between ranks (data-dependent routing),
        # so nothing here may depend on the local gradients: the reduced prefix is every
        # parameter up to the last trainable one (frozen parameters sit at the end), and
        # a parameter without a local gradient contributes zeros. See
        # [Note: gradients some ranks lack].
        self.grads_unsynced = False
        trainable = [p.sharded_param.requires_grad for p in self.params]
        if not any(trainable):
            return
        count = len(trainable) - trainable[::-1].index(True)
        grads = [self._take_unsharded_grad(p) for p in self.params[:count]]
        ws = self.world_size
        reduce_dtype = self.reduce_dtype or promote_dtypes(p.dtype for p in self.params[:count])
        # ``rows``: each gradient with the sharded dim first (zeros where missing), cut
        # into ``ws`` chunks of its padded shard, one chunk per rank's input slice.
        rows: list[torch.Tensor] = []
        for p, grad in zip(self.params[:count], grads):
            unsharded = p.require_unsharded_param()
            unsharded.grad = None
            if grad is None:
                dtype = unsharded.dtype
                padded_rows = (ws * p.rows_per_rank, p.row_numel)
                rows.append(grad_zeros(padded_rows, dtype, self.device))
            else:
                rows.append(p.as_rows(grad))
        # One "had a gradient" flag per parameter, repeated in every rank's chunk: after
        # the sum each rank knows how many ranks had each gradient, for free. The region
        # is zero-padded to keep torch's summation order ([Note: padded gradient flags]).
        # The common case (every gradient present) fills on the device: no host-to-device
        # copy, and nothing kept between steps (the flags cost memory only inside the
        # collective's buffers).
        has_grad = [g is not None for g in grads]
        flag_numel = self.flag_numel(count, reduce_dtype)
        if all(has_grad):
            flags = torch.zeros(flag_numel, dtype=reduce_dtype, device=self.device)
            flags[:count].fill_(1)
        else:
            padded = has_grad + [False] * (flag_numel - count)
            flags = torch.tensor(padded, dtype=reduce_dtype, device=self.device)
        rows.append(flags.expand(ws, -1))
        numel = sum(self._reduce_sizes[:count]) + flag_numel
        comm = self._require_comm()
        compute = comm.streams.compute()
        # Bound memory before allocating: finish older reductions (freeing their inputs)
        # so that with this one at most ``max_reduces_in_flight`` are in flight.
        comm.finish_reduces(keep=comm.max_reduces_in_flight - 1)
        rs_input = comm.host_buffers.empty(ws * numel, reduce_dtype, self.device)
        self._copy_in_grads(rows, rs_input.view(ws, numel))
        del rows, grads  # the unsharded gradients die here, not when this returns
        predivide = self.predivide_factor(reduce_dtype)
        if predivide != 1.0:
            rs_input.div_(predivide)
        stream = comm.streams.reduce_scatter
        wait_stream(stream, compute)  # the gradients were produced on the compute stream
        if ws == 1:  # one rank: the input is the reduced shard (torch issues no collective)
            done = PendingCollective(None, record_event(stream))
            comm.reduces.append(ReduceInFlight(self, rs_input, rs_input, done, has_grad))
            return
        with use_stream(stream):
            rs_output = torch.empty(numel, dtype=reduce_dtype, device=self.device)
            pending = reduce_scatter_flat(rs_output, rs_input, self.process_group, stream)
        # [Note: reduce-scatter input lifetime]: a collective issued with a Work (CPU
        # backends) keeps alive every tensor its backend still reads, so ours can go now.
        kept_input = rs_input if pending.work is None else None
        del rs_input
        comm.reduces.append(ReduceInFlight(self, kept_input, rs_output, pending, has_grad))

    def accumulate_unsynced(self) -> None:
        """Backward without gradient sync: move low-precision unsharded gradients into
        per-parameter sums in the reduce dtype, so accumulating microbatches in bf16 does
        not round away small contributions (256 + 1 + 1 + 1 stays 259, as in torch)."""
        self.grads_unsynced = True
        dtype = self.reduce_dtype
        if dtype is None:
            return
        for p in self.params:
            unsharded = p.unsharded_param
            if unsharded is None:
                continue
            grad = unsharded.grad
            if grad is None or grad.dtype == dtype:
                continue
            if p.accumulated_grad is None:
                p.accumulated_grad = grad.to(dtype)
            else:
                p.accumulated_grad.add_(grad)
            unsharded.grad = None

    def _take_unsharded_grad(self, p: ShardedParam) -> torch.Tensor | None:
        """The parameter's unsharded gradient, with any unsynced sum added (and cleared)."""
        grad = p.require_unsharded_param().grad
        total = p.accumulated_grad
        if total is None:
            return grad
        p.accumulated_grad = None
        if grad is not None:
            total.add_(grad)
        return total

    def _copy_in_grads(self, rows: list[torch.Tensor], out: torch.Tensor) -> None:
        """Fill ``out`` (``ws`` rank rows of the reduce-scatter input) from ``rows`` (see
        ``reduce_grads``) in one kernel: chunk, pad and copy every gradient at once. When
        every gradient is already in ``out``'s dtype that kernel is ``torch._chunk_cat``,
        which pads uneven chunks itself; otherwise one ``torch.cat`` also casts, after
        padding uneven gradients (one extra copy each) to whole chunks."""
        ws = self.world_size
        if _chunk_cat is not None and all(t.dtype == out.dtype for t in rows):
            _chunk_cat(rows, dim=0, num_chunks=ws, out=out)
            return
        chunks: list[torch.Tensor] = []
        for p, t in zip(self.params, rows[:-1]):
            if t.shape[0] == ws * p.rows_per_rank:
                chunks.append(t.reshape(ws, -1))  # even: a view
            else:
                padding = (ws * p.rows_per_rank - t.shape[0]) * p.row_numel
                chunks.append(F.pad(t.reshape(-1), (0, padding)).view(ws, -1))
        chunks.append(rows[-1])
        torch.cat(chunks, dim=1, out=out)

    def finish_reduce(self, in_flight: ReduceInFlight) -> None:
        """Wait for a reduce-scatter, scale it, and store the gradient shards as DTensors
        on the sharded parameters (accumulating into existing gradients)."""
        comm = self._require_comm()
        wait(in_flight.pending, comm.streams.compute())
        output = in_flight.output
        predivide = self.predivide_factor(output.dtype)
        count = len(in_flight.has_grad)
        if self.replicate_group is not None:
            reduced = self._all_reduce_replicas(output, count, self.replicate_group)
            if reduced is None:
                return  # accumulated locally until the next step that all-reduces
            output, count = reduced
        # The flags: how many ranks (and replicas) had each gradient. Zero means no rank
        # used the parameter: its gradient stays None, as in non-sharded training.
        grads_numel = sum(self._reduce_sizes[:count])
        flags, output = output[grads_numel : grads_numel + count], output[:grads_numel]
        # A local gradient proves some rank had one; only a rank missing some gradient
        # (or holding sums of earlier microbatches) reads the flags (a host sync on
        # accelerators, so not on the common path).
        has_grad = in_flight.has_grad
        local_proof = len(has_grad) == count and all(has_grad)
        got_grad = has_grad if local_proof else (flags != 0).tolist()
        factor = self.divide_factor() / predivide
        # The all-reduce hook sees what torch's hook sees: the average when the division
        # counts as part of the collective (AVG for fp32/bf16), the undivided sum when
        # division is a separate step (force-sum, or fp16's split pre/post division).
        divide_first = not self.force_sum_reduction and predivide == 1.0
        if factor != 1.0 and divide_first:
            output.div_(factor)
        if self.all_reduce_hook is not None:
            hook_stream = self.all_reduce_hook_stream
            wait_stream(hook_stream, comm.streams.compute())
            with use_stream(hook_stream):
                self.all_reduce_hook(output)
            wait_stream(comm.streams.compute(), hook_stream)
        if factor != 1.0 and not divide_first:
            output.div_(factor)
        shards = self._gradient_shards(output, count)
        for p, used, local in zip(self.params, got_grad, shards):
            if not used:
                continue
            param = p.sharded_param
            existing = param.grad
            if existing is None:
                param.grad = p.sharded_grad(local)
            elif isinstance(existing, DTensor):
                with torch.no_grad():
                    existing.to_local().add_(local)
            else:  # torch lets a plain tensor be assigned as a DTensor parameter's .grad
                raise RuntimeError(
                    f"fully_shard: parameter '{p.fqn}' has a {type(existing).__name__} "
                    f"gradient; a sharded parameter's gradient must be None or a DTensor"
                )
            # Hooks registered with register_post_accumulate_grad_hook on the sharded
            # parameter (e.g. an optimizer stepping inside backward) see the reduced grad.
            hooks = getattr(param, "_post_accumulate_grad_hooks", None)
            if hooks:
                for hook in tuple(hooks.values()):
                    hook(param)

    def _gradient_shards(self, output: torch.Tensor, count: int) -> list[torch.Tensor]:
        """The first ``count`` parameters' local gradients from the reduced ``output``,
        stored like the sharded parameters: their dtype, their device. One cast for a
        one-dtype group; one per run of equal dtypes in a mixed one."""
        params = self.params[:count]
        if not self.mixed:
            output = output.to(self.shard_device, self.shard_dtype)
            return [p.reduced_view(output) for p in params]
        shards: list[torch.Tensor] = []
        start = 0
        while start < count:
            dtype = params[start].dtype
            stop = start + 1
            while stop < count and params[stop].dtype == dtype:
                stop += 1
            first, last = params[start], params[stop - 1]
            run = output[first.offset : last.offset + last.padded_numel]
            run = run.to(self.shard_device, dtype)
            shards += [p.reduced_view(run, first.offset) for p in params[start:stop]]
            start = stop
        return shards

    def _all_reduce_replicas(
        self, output: torch.Tensor, count: int, replicate_group: ProcessGroup
    ) -> tuple[torch.Tensor, int] | None:
        """HSDP: sum the reduce-scattered shard (``count`` parameters' gradients, then
        their flags) over replicas, or keep it for later when ``requires_all_reduce`` is
        off. Returns the summed output and how many parameters it covers; ``None`` means
        nothing to assign yet."""
        kept = self._partial_reduce
        self._partial_reduce = None
        if kept is not None:
            partial, partial_count = kept
            if partial_count != count or partial.dtype != output.dtype:
                # [Note: partial sums across changing layouts]: freezing or unfreezing a
                # group's last trainable parameter between microbatches changes where the
                # flags sit; both sums move to the whole group's layout before adding.
                dtype = torch.promote_types(partial.dtype, output.dtype)
                partial = self._whole_group_layout(partial, partial_count, dtype)
                output = self._whole_group_layout(output, count, dtype)
                count = len(self.params)
            output.add_(partial)
        if not self.requires_all_reduce:
            self._partial_reduce = (output, count)
            return None
        comm = self._require_comm()
        stream = comm.streams.all_reduce
        wait_stream(stream, comm.streams.compute())
        pending = all_reduce_flat(output, replicate_group, stream)
        wait(pending, comm.streams.compute())
        return output, count

    def _whole_group_layout(
        self, output: torch.Tensor, count: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """``output`` (the first ``count`` parameters' gradient shards, then their flags)
        laid out for every parameter of the group, zeros where it had none, in ``dtype``."""
        n = len(self.params)
        if count == n and output.dtype == dtype:
            return output
        grads_numel = sum(self._reduce_sizes[:count])
        whole_numel = sum(self._reduce_sizes)
        whole = torch.zeros(
            whole_numel + self.flag_numel(n, dtype), dtype=dtype, device=output.device
        )
        whole[:grads_numel].copy_(output[:grads_numel])
        whole[whole_numel : whole_numel + count].copy_(output[grads_numel : grads_numel + count])
        return whole

    def predivide_factor(self, reduce_dtype: torch.dtype | None = None) -> float:
        """Low-precision sums can overflow and per-rank quotients underflow: divide by a
        power of two near the square root of the factor before reducing and by the rest
        after (the split torch uses, so results agree bitwise)."""
        if (reduce_dtype or self.reduce_dtype) in (torch.float32, torch.bfloat16, torch.float64):
            return 1.0
        factor = self.divide_factor()
        pre = 1
        while factor % pre == 0 and factor / pre > pre:
            pre *= 2
        return float(pre)

    def divide_factor(self) -> float:
        """The total divisor of the summed gradients. ``force_sum_reduction`` changes only
        which collective op is used (always SUM here), never this divisor."""
        if self.gradient_divide_factor is not None:
            return self.gradient_divide_factor
        return float(self.world_size * self.replicate_size)

    def _require_comm(self) -> CommContext:
        if self.comm is None:
            raise AssertionError(f"{self.label}: used before lazy initialization")
        return self.comm

    def _require_unsharded_flat(self) -> torch.Tensor:
        if self.unsharded_flat is None:
            raise RuntimeError(
                f"{self.label}: no unsharded buffer (used before lazy initialization)"
            )
        return self.unsharded_flat

    def _require_post_forward_shard(self) -> torch.Tensor:
        if self._post_forward_shard is None:
            raise RuntimeError(
                f"{self.label}: resharded after forward (reshard_after_forward=int) but "
                f"holds no post-forward shard to all-gather"
            )
        return self._post_forward_shard


# See [Note: aligned unsharded parameters].
UNSHARDED_ALIGN_BYTES = 256

# See [Note: padded gradient flags].
REDUCE_FLAG_ALIGN_BYTES = 64

# One aten kernel that chunks, pads and concatenates (what the reduce-scatter copy-in needs);
# torch's own FSDP uses it. Private in name, so looked up with a fallback.
_chunk_cat: Callable[..., torch.Tensor] | None = getattr(torch, "_chunk_cat", None)


def promote_dtypes(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """The dtype every given dtype converts to without loss (fp32 for bf16 and fp32)."""
    return functools.reduce(torch.promote_types, dtypes)


def grad_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros standing in for a missing gradient; expanded from one element, so they
    allocate nothing (the copy-in reads them as zeros)."""
    return torch.zeros(1, dtype=dtype, device=device).expand(shape)
