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

The all-gather and its copy-out are ``_all_gather``'s (``GroupAllGather``); gradients go
the other way in ``_grad_reduce`` (``GradientReduction``); ``ParamGroup`` mixes in both
and owns the layout and buffers. Per-step work in both is per group: one collective per
direction, one fused copy-out, one fused reduce-scatter copy-in (``torch._chunk_cat``, or
``torch.cat`` when it must also cast). The loops over parameters that remain touch only Python attributes (registering
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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fsdp2._all_gather import AllGatherInFlight, GroupAllGather, new_flat_shard
from fsdp2._comm_context import CommContext
from fsdp2._extensions import has_gather_extension
from fsdp2._grad_reduce import GradientReduction
from fsdp2._param import ShardedParam
from fsdp2._policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from fsdp2._stream_utils import Event, Stream, record_event
from fsdp2._unsharded_upkeep import (
    GraphHoldOwner,
    ShardedState,
    UnshardedUpkeep,
    outside_transforms,
)


class ParamGroup(GroupAllGather, GradientReduction, UnshardedUpkeep):
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
        self._module_names: Mapping[int, str] = {}  # module id -> name under the root
        self.mesh = mesh
        self.label = label  # the sharded module classes, e.g. "TransformerBlock"
        self.path = ""  # their names under the root, set at lazy init ("": the root)
        # HSDP (2-D mesh): shard over the last dim, replicate over the first.
        shard_dim = mesh.ndim - 1
        self.process_group = mesh.get_group(shard_dim)
        self.reduce_scatter_group: Any = None  # set_separate_reduce_scatter_group
        # set_custom_all_gather / set_custom_reduce_scatter: torch's Comm objects, which
        # allocate the collective's buffers and issue it. Their buffers may be special
        # memory (symmetric, registered): never pooled nor resized by us, so an in-place
        # all-gather becomes a gather into the custom buffer plus one copy.
        self.custom_all_gather: Any = None
        self.custom_reduce_scatter: Any = None
        self.world_size = mesh.size(shard_dim)
        self.shard_rank = mesh.get_local_rank(shard_dim)
        self.replicate_group = mesh.get_group(0) if mesh.ndim == 2 else None
        self.replicate_size = mesh.size(0) if mesh.ndim == 2 else 1
        # HSDP with set_requires_all_reduce(False): reduce-scattered, not yet all-reduced
        # (the sums, their positions, and what the reduce-scatter divided them by).
        self._partial_reduce: tuple[torch.Tensor, tuple[int, ...], float] | None = None
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
        # from; see [Note: stale unsharded parameters] in ``_unsharded_upkeep``.
        self._gathered_from: tuple[int, int] | None = None
        # The unsharded buffer's version counter once filled, to see in-place changes; see
        # [Note: in-place changes to unsharded parameters] in ``_param``. None: not
        # watched.
        self._unsharded_version: int | None = None
        # Gathered by a backward that built a graph: see [Note: backward that builds a
        # graph] in ``_unsharded_upkeep``.
        self.held_by_graph = False
        self.kept_for_graph = False
        self.hold_owner: GraphHoldOwner | None = None
        self._hold_hooks: list[Any] = []
        self._all_gather: AllGatherInFlight | None = None
        self._extension_mesh: DeviceMesh | None = None  # the shard mesh the hooks see
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
        self.reduce_scatter_unused = False  # set_reduce_scatter_unused_params
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
            # Reduce layout: trainable first (packed as planned), equal dtypes adjacent.
            rank = {
                id(p): (not t, -d.itemsize, str(d))
                for p, d, t in zip(self.params, dtypes, trainable)
            }
            self.params.sort(key=lambda p: rank[id(p)])
        offset = 0
        for p in self.params:
            p.offset = offset
            offset += p.padded_numel
        self._reduce_sizes = [p.padded_numel for p in self.params]
        # Shard layout: one dtype, or bytes by decreasing itemsize (aligned, no gaps).
        # Tensor subclasses with all-gather extensions keep their own storage.
        stored = [p for p in self.params if not p.apart]
        by_itemsize = sorted(stored, key=lambda p: (-p.dtype.itemsize, str(p.dtype)))
        offset = 0
        if self.mixed:
            self.shard_dtype = torch.uint8
            for p in by_itemsize:
                p.shard_offset = offset
                offset += p.padded_numel * p.dtype.itemsize
        else:
            self.shard_dtype = dtypes[0]
            for p in stored:
                p.shard_offset = offset
                offset += p.padded_numel
        self.shard_numel = offset
        # All-gather layout of the parameters gathered from the flat shard (not through
        # extensions): typed (param_dtype, or the one dtype) in reduce order, or the shard
        # bytes themselves. ``param_dtype`` is None only for the byte case.
        self.extensions = [p for p in self.params if p.extension is not None]
        self._message_checked = False  # see _check_message_size
        policy_dtype = self.mp_policy.param_dtype
        if policy_dtype is not None or not self.mixed:
            self.param_dtype: torch.dtype | None = policy_dtype or dtypes[0]
            self.gather_dtype = self.param_dtype
            self._gather_params = [p for p in self.params if p.extension is None]
            self._gather_sizes = [p.padded_numel for p in self._gather_params]
        else:
            self.param_dtype = None
            self.gather_dtype = torch.uint8
            self._gather_params = [p for p in by_itemsize if p.extension is None]
            self._gather_sizes = [p.padded_numel * p.dtype.itemsize for p in self._gather_params]
        offset = 0
        for p, size in zip(self._gather_params, self._gather_sizes):
            p.gather_offset = offset
            offset += size
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
        self._gather_in_place = not self.extensions and (
            (len(self.params) == 1 and not self.params[0].shard_dim)
            or (ws == 1 and all(start % align == 0 for start in starts))
        )
        if not self._gather_in_place:
            starts = []
            end = 0
            for size in self._gather_sizes:
                end = -(-end // align) * align
                starts.append(end)
                end += ws * size
        self._unsharded_starts = starts
        last = starts[-1] + ws * self._gather_sizes[-1] if starts else 0
        self.unsharded_numel = max(ws * self.gather_numel, last)

    def _new_flat_shard(self, device: torch.device) -> torch.Tensor:
        # Pinned: lets host-to-device copies run asynchronously.
        pin = self.pin_memory and device.type == "cpu" and torch.cuda.is_available()
        return new_flat_shard(self.shard_numel, self.shard_dtype, device, pin=pin)

    @outside_transforms
    def lazy_init(self, comm: CommContext, module_names: Mapping[int, str] | None = None) -> None:
        """Bind to the tree's communication context and build the unsharded buffer.
        ``module_names``: module id -> name under the root, for error messages."""
        self.comm = comm
        self._module_names = module_names or {}
        self.ensure_shards_bound(complete=True)
        # The unsharded buffer is its all-gather output plus the alignment gaps (minus
        # fingerprint tails), and the reduce-scatter input that plus the flags and a
        # fingerprint block: one pooled buffer serves all three.
        gap_bytes = (self.unsharded_numel - self.world_size * self.gather_numel) * (
            self.gather_dtype.itemsize
        )
        comm.host_buffers.allow_slack(self.reduce_flag_bytes + gap_bytes + self.tail_bytes)
        if self.flat_shard.device.type == "meta":
            raise self._meta_error([self._root_fqn(p) for p in self.params], [])
        self._check_offloaded_shards_on_cpu()
        self._init_unsharded()

    def _check_offloaded_shards_on_cpu(self) -> None:
        """CPU offload keeps the shards in CPU memory; shards moved to an accelerator
        (``module.to(device)``, a state dict of accelerator tensors loaded with
        ``assign=True``) would silently stop offloading, so the first forward after such a
        move raises, with torch's wording first."""
        if not self.offload:
            return
        elsewhere = [
            (self._root_fqn(p), p.local_tensor().device)
            for p in self.params
            if p.local_tensor().device.type not in ("cpu", "meta")
        ]
        if elsewhere:
            raise RuntimeError(
                f"FSDP parameters should be materialized on CPU when enabling CPU offloading. "
                f'For example, load a CPU state dict or call module.to_empty(device="cpu"). '
                f"Found following parameters on non-CPU device: {elsewhere}\n"
                f"fully_shard: {self.label} was sharded with CPUOffloadPolicy, so its shards "
                f"must stay in CPU memory (compute still runs on the mesh's device); do not "
                f"move the sharded module to the accelerator."
            )

    def _root_fqn(self, param: Any) -> str:
        """``param``'s name under the root module (its own name when the root is unknown)."""
        module, attr = param.uses[0]
        prefix = self._module_names.get(id(module))
        if prefix is None:
            return str(param.fqn)
        return f"{prefix}.{attr}" if prefix else attr

    def _meta_error(self, on_meta: list[str], loaded: list[str]) -> RuntimeError:
        """Parameters still on the meta device at the first forward: torch's wording first
        (its list of names under the root), then what to do."""
        beside = f" (next to materialized ones: {', '.join(loaded)})" if loaded else ""
        return RuntimeError(
            f"FSDP parameters should be materialized from meta device before training, but "
            f"the following were still on meta device: {on_meta}\n"
            f"fully_shard: {self.label} has them on the meta device at the first forward"
            f"{beside}. Materialize or load all of them first, e.g. module.to_empty(device) "
            f"then module.reset_parameters() on each module, or a state dict with every key."
        )

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
            self._post_forward_targets = [
                t.reshape(size, -1) if t.dim() == 2 else _strided_chunks(t, size)
                for t in self._copy_out_targets
            ]
        # Shard(d > 0) targets are strided: [Note: sharding a dim other than 0] in _param.
        self._strided_copy_out = any(t.dim() != 2 for t in self._copy_out_targets)
        # With extensions every target is written as bytes: [Note: groups with extensions].
        self._byte_targets = (
            {
                id(p): t.view(torch.uint8)
                for p, t in zip(self._gather_params, self._copy_out_targets)
            }
            if self.extensions
            else {}
        )
        self._free_unsharded()

    def ensure_shards_bound(self, *, complete: bool = False) -> None:
        """Re-point local tensors that no longer view the flat buffer (after ``module.to()``,
        ``to_empty()`` or ``load_state_dict(assign=True)``), keeping their values.

        A group whose parameters are partly still on the meta device is left as it is until
        the rest arrive ([Note: partly materialized groups]); ``complete`` (the first
        forward) makes that an error instead."""
        if not self.is_unsharded:
            for p in self.params:
                p.adopt_assigned()
            self._tied = [p for p in self.params if p.tied_to is not None]
        relaid = self._find_extensions()
        # A parameter kept apart has no slot in the flat buffer, but lives on its device:
        # a group made only of such parameters moves with them (``to_empty()`` after a
        # meta-device init, ``module.to()``).
        current = self.flat_shard

        def is_bound(p: ShardedParam) -> bool:
            if not p.apart:
                return p.points_into(current)
            local = p.local_tensor()
            return local.dtype == p.dtype and local.device == current.device

        bound = (is_bound(p) for p in self.params)
        if all(bound):
            if relaid:  # same shard layout, new all-gather layout
                self._plan_layout(
                    [p.dtype for p in self.params], [p.requires_grad for p in self.params]
                )
                if self.unsharded_flat is not None:
                    self._init_unsharded()
            return
        local = [p.local_tensor() for p in self.params]
        on_meta = [p.fqn for p, t in zip(self.params, local) if t.device.type == "meta"]
        if on_meta and len(on_meta) < len(local):
            # [Note: partly materialized groups]
            # ``load_state_dict(assign=True)`` runs each module's load post-hook as soon as
            # that module is loaded, so a group of several modules (``fully_shard([norm,
            # embed, head])``) built on the meta device is re-bound once per module, while
            # the modules loaded later still hold meta tensors. A flat buffer laid out then
            # would be on the meta device (the first parameter's) and the loaded values
            # would be dropped into it. The loaded parameters keep their own tensors until
            # the last module's hook sees every parameter materialized.
            if complete:
                meta = [t.device.type == "meta" for t in local]
                raise self._meta_error(
                    [self._root_fqn(p) for p, m in zip(self.params, meta) if m],
                    [self._root_fqn(p) for p, m in zip(self.params, meta) if not m],
                )
            return
        if self.comm is not None:  # after lazy init; before it, lazy init checks
            self._check_offloaded_shards_on_cpu()
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
            if not p.apart:
                p.repoint(flat)
        self.flat_shard = flat
        if self.unsharded_flat is not None:
            self._init_unsharded()

    def _find_extensions(self) -> bool:
        """Note which local tensors now define all-gather extensions (a subclass swapped in
        by ``to_empty()`` or a load, hooks patched onto a local tensor after sharding) and
        which of them live outside the flat buffer; return whether that changed. Read
        while sharded: at lazy init and whenever the shards are re-bound."""
        if self.is_unsharded or self.unshard_pending:
            return False
        changed = False
        for p in self.params:
            local = p.local_tensor()
            has = has_gather_extension(local, p.fqn)
            apart = has and (p.apart or not p.points_into(self.flat_shard))
            if has != (p.extension is not None) or apart != p.apart:
                changed = True
                p.apart = apart
                p.extension = p.new_extension() if has else None
                p.unsharded_param = None  # rebuilt by the new all-gather path
        return changed

    # -- reshard (unshard: ``GroupAllGather``) -----------------------------------------------
    @outside_transforms
    def reshard(self, *, post_forward: bool = False, in_hook: bool = False) -> None:
        """Register the sharded parameters again and free the unsharded buffer. With
        ``post_forward`` and an int ``reshard_after_forward``, first keep this rank's
        share for the smaller backward all-gather (one fused copy). ``in_hook``: called
        by the forward or backward hooks, whose step began with the root's pre-forward
        syncing ``requires_grad`` ([Note: requires_grad changed while gathered]), so the
        per-parameter sync is skipped."""
        self.release_from_graph()
        if self._all_gather is not None:
            self.wait_for_unshard()  # a collective cannot be cancelled: drain it
        if not self.is_unsharded:
            if self.kept_for_graph:  # parked: its storage outlived the graph's hold
                self.kept_for_graph = False
                self._free_unsharded()
            if not post_forward:
                self._post_forward_shard = self._post_forward_ready = None
                self.sharded_state = ShardedState.SHARDED
            return
        self.write_back_unsharded()
        # Extensions rebuild whole parameters: their groups reshard fully after forward.
        keep_partial = post_forward and self.post_forward_size > 0 and not self.extensions
        if keep_partial:
            index = self._post_forward_index
            chunks = [t[index].reshape(-1) for t in self._post_forward_targets]
            self._post_forward_shard = self._post_forward_message(chunks)
            self._post_forward_ready = record_event(self._require_comm().streams.compute())
        for p in self.params:
            if not in_hook:
                p.sync_requires_grad()  # a change made through the module while gathered
            p.register(p.sharded_param)
        for p in self.extensions:
            if p.extension is not None:
                p.extension.free()
        if self._gather_in_place:
            self._require_comm().order_all_gathers_after_compute()
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

    def _require_unsharded_flat(self) -> torch.Tensor:
        if self.unsharded_flat is None:
            raise RuntimeError(
                f"{self.label}: no unsharded buffer (used before lazy initialization)"
            )
        return self.unsharded_flat


# See [Note: aligned unsharded parameters].
UNSHARDED_ALIGN_BYTES = 256


def _strided_chunks(target: torch.Tensor, size: int) -> torch.Tensor:
    """A Shard(d > 0) copy-out target ``(world_size, outer, span)`` regrouped into
    ``size`` chunks of consecutive ranks, ``(size, outer, world_size / size * span)``: the
    post-forward layout of ``reshard_after_forward=size``. Still a view of the buffer."""
    natural = target.transpose(0, 1)  # (outer, world_size, span), contiguous
    return natural.reshape(natural.shape[0], size, -1).transpose(0, 1)
