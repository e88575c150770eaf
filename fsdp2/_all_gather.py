"""One group's all-gather: the message each rank sends, the collective, and the copy-out.

``GroupAllGather`` is the half of ``ParamGroup`` (``_param_group``) that fills the
unsharded parameters, as ``GradientReduction`` (``_grad_reduce``) is the half that reduces
their gradients. ``unshard`` builds this rank's message (the flat shard itself with no
copy; a cast or host-to-device copy written into this rank's slot of the output; or, for
a group with extensions, the hooks' inputs) and issues the one all-gather on the
all-gather stream; ``wait_for_unshard`` waits for it and copies the rank-major output into
the param-major unsharded buffer with one fused ``split_with_sizes_copy`` (or nothing, for
a group that gathers in place). The group's layout (``_gather_sizes``, targets, dtypes)
and buffers are ``ParamGroup``'s; this module reads them.

[Note: groups with extensions]
A group whose parameters include all-gather extensions (see ``_extensions``) keeps one
all-gather, but its input can no longer be the flat shard as is: the hooks produce their
inputs at each unshard. The message is ``uint8``: each plain parameter's padded slot (cast
to ``param_dtype`` where set), then each extension's inputs, in parameter order, written
into this rank's slot of the output by one ``torch.cat`` (a copy-in, as torch makes for
every group). The copy-out is the same one ``split_with_sizes_copy`` into byte views of
the plain parameters' unsharded slots and of the extensions' persistent outputs, after
which each extension's ``fsdp_post_all_gather`` builds or refills its unsharded parameter.
Subclass parameters (``ShardedParam.apart``) have no slot in the flat shard; parameters
whose plain local tensor got hooks keep theirs. Groups without extensions are unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from fsdp2._collectives import PendingCollective, all_gather_flat, min_and_max, wait
from fsdp2._comm_context import CommContext
from fsdp2._comm_records import Phase
from fsdp2._divergence import checks_enabled
from fsdp2._extensions import shard_mesh
from fsdp2._fingerprints import (
    TAIL_BYTES,
    GatheredTails,
    allocate_with_room,
    custom_refused,
    tail_numel,
    tailed_numel,
    write_tail,
)
from fsdp2._param import ShardedParam
from fsdp2._policies import MixedPrecisionPolicy
from fsdp2._stream_utils import Event, record_event, use_stream, wait_event, wait_stream
from fsdp2._unsharded_upkeep import ShardedState, outside_transforms


class AllGatherInFlight(NamedTuple):
    input: torch.Tensor  # the flat shard, or its cast/device copy (kept alive until done)
    output: torch.Tensor  # 1-D, world_size * S, rank-major
    pending: PendingCollective
    from_post_forward: bool  # gathered within the post-forward group (int reshard)
    # Into the unsharded buffer itself (no copy-out); False with a custom all-gather,
    # whose own buffer is copied out, and with fingerprint tails.
    in_place: bool
    message: int  # elements of data per rank
    row: int  # elements per rank in ``output``: the data, then a padded tail if larger


class GroupAllGather:
    """The all-gather of a group's parameters (mixed into ``ParamGroup``).

    The attributes below are set by ``ParamGroup.__init__`` and its layout planning."""

    params: list[ShardedParam]
    extensions: list[ShardedParam]
    label: str
    mesh: DeviceMesh
    device: torch.device
    mp_policy: MixedPrecisionPolicy
    process_group: ProcessGroup
    world_size: int
    shard_rank: int
    mixed: bool
    flat_shard: torch.Tensor
    gather_dtype: torch.dtype
    gather_numel: int
    _gather_sizes: list[int]
    _gather_in_place: bool
    _strided_copy_out: bool
    _copy_out_targets: list[torch.Tensor]
    _byte_targets: dict[int, torch.Tensor]
    _unsharded_write: torch.Tensor
    _message_checked: bool
    custom_all_gather: Any
    sharded_state: ShardedState
    kept_for_graph: bool
    _tied: list[ShardedParam]
    _gathered_from: tuple[int, int] | None
    _unsharded_version: int | None
    _all_gather: AllGatherInFlight | None
    _extension_mesh: DeviceMesh | None
    post_forward_group: Any
    post_forward_size: int
    _post_forward_shard: torch.Tensor | None
    _post_forward_ready: Event
    _post_forward_targets: list[torch.Tensor]
    if TYPE_CHECKING:  # ``ParamGroup``'s, its other mixins' and ``GradientPacking``'s

        @property
        def is_unsharded(self) -> bool: ...

        @property
        def where(self) -> str: ...

        def reuse_kept(self) -> bool: ...

        def _require_comm(self) -> CommContext: ...

        def _shard_version(self) -> tuple[int, int]: ...

        def _alloc_unsharded(self) -> None: ...

        def _require_unsharded_flat(self) -> torch.Tensor: ...

    @outside_transforms
    def unshard(self, *, after_compute: bool = False, phase: Phase = Phase.FORWARD) -> None:
        """Issue this group's all-gather on the all-gather stream (no-op if unsharded or
        already in flight). Call ``wait_for_unshard`` before using the parameters.

        ``after_compute``: order the all-gather after everything queued on the compute
        stream so far. The root's pre-forward does this once per step (the optimizer
        wrote the shards there); an ``unshard()`` called outside that window, e.g. right
        after ``optimizer.step()``, needs it too, or on an accelerator it could gather
        shards the optimizer has not finished writing.

        With divergence checks on, each rank's slot ends with a fingerprint (a tail;
        [Note: in-band fingerprints] in ``_fingerprints``), checked when it is waited on.
        """
        if self.is_unsharded or self._all_gather is not None:
            return
        if self.kept_for_graph and self.reuse_kept():  # see [Note: backward that builds a graph]
            return
        comm = self._require_comm()
        stream = comm.streams.all_gather
        post_forward = self.sharded_state is ShardedState.SHARDED_POST_FORWARD
        if after_compute:
            wait_stream(stream, comm.streams.compute())
        with use_stream(stream):
            # Memory released by the compute stream may be reused only after it is done.
            wait_event(stream, comm.all_gathers_after)
            custom = self.custom_all_gather
            tails = self.world_size > 1 and checks_enabled()
            if custom is not None and tails:
                tails = not custom_refused(custom, self.where, _CUSTOM_API)
            in_place = self._gather_in_place and custom is None and not tails
            if post_forward:
                ranks = self.post_forward_size
                message = self.world_size // ranks * self.gather_numel
                output, row = self._all_gather_output(in_place, ranks, message, tails)
                kept = self._require_post_forward_shard()
                wait_event(stream, self._post_forward_ready)  # written on the compute stream
                ag_input, group = kept[:row], self.post_forward_group
                self._post_forward_shard = self._post_forward_ready = None
            else:
                for p in self._tied:
                    p.refresh_tied(self.flat_shard)
                self._gathered_from = self._shard_version()
                group, ranks = self.process_group, self.world_size
                if self.extensions:
                    output, ag_input, message = self._extension_all_gather_buffers(tails)
                    row = ag_input.numel()
                else:
                    message = self.gather_numel
                    output, row = self._all_gather_output(in_place, ranks, message, tails)
                    ag_input = self._all_gather_input(output, row)
            check = None
            if self.world_size == 1:
                # One rank holds whole parameters: no collective (torch issues none either).
                # It gathers in place, so at most the shard is copied into the output.
                if ag_input.data_ptr() != output.data_ptr():
                    output.copy_(ag_input, non_blocking=True)
                pending = PendingCollective(None, record_event(stream))
            else:
                what = f"all-gather of {self.where}"
                record, issued = comm.before_collective(what, output.numel(), group, self, phase)
                if issued is not None and row != message:
                    unit = tail_numel(ag_input.dtype)
                    write_tail(ag_input[row - unit :], issued.fingerprint)
                    region = output.view(ranks, row)[:, row - unit :].view(torch.float64)
                    check = GatheredTails(issued, region, comm.groups)
                pending = all_gather_flat(
                    output, ag_input, group, stream, custom, what, record, check
                )
        self._all_gather = AllGatherInFlight(
            ag_input, output, pending, post_forward, in_place, message, row
        )
        comm.all_gathers_in_flight[self] = pending

    def _all_gather_output(
        self, in_place: bool, ranks: int, message: int, tails: bool
    ) -> tuple[torch.Tensor, int]:
        """The rank-major all-gather output of ``ranks`` slots of ``message`` elements
        (each followed by a tail with ``tails``), and the elements per slot: the unsharded
        buffer itself (in place), a custom all-gather's buffer, or a pooled one."""
        if in_place:
            self._alloc_unsharded()
            return self._unsharded_write, message
        return self._gather_buffer(ranks, message, tails, self.gather_dtype)

    def _gather_buffer(
        self, ranks: int, message: int, tails: bool, dtype: torch.dtype
    ) -> tuple[torch.Tensor, int]:
        """A new all-gather output for ``ranks`` slots of ``message`` elements (and a tail
        each with ``tails``), and the elements per slot: a custom all-gather's buffer, or a
        pooled one. A custom one that cannot carry the tails gets them no more ([Note:
        in-band fingerprints] in ``_fingerprints``)."""
        row = tailed_numel(message, dtype) if tails else message
        custom = self.custom_all_gather
        if custom is None:
            return self._require_comm().host_buffers.empty(ranks * row, dtype, self.device), row
        if row != message:
            roomy = allocate_with_room(
                custom, ranks * row, dtype, self.device, self.where, _CUSTOM_API
            )
            if roomy is not None:
                return roomy, row
        return custom.allocate((ranks * message,), dtype=dtype, device=self.device), message

    @property
    def tail_bytes(self) -> int:
        """The most fingerprint tails add to an all-gather output (every rank's)."""
        return self.world_size * 2 * TAIL_BYTES

    def _extension_all_gather_buffers(self, tails: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The all-gather output and input of a group with extensions, and the bytes of
        data per rank: one ``uint8`` message per rank, each plain parameter's padded shard
        (cast to ``param_dtype``) then each extension's inputs, in parameter order, written
        into this rank's slot of the output (followed by room for a tail with ``tails``);
        see [Note: groups with extensions]."""
        if self._extension_mesh is None:
            self._extension_mesh = shard_mesh(self.mesh, self.process_group)
        pieces: list[torch.Tensor] = []
        for p in self.params:
            if p.extension is not None:
                pieces += p.gather_inputs(self._extension_mesh, self.mp_policy, self.device)
            else:
                slot = p.shard_slot(self.flat_shard)
                dtype = self.mp_policy.param_dtype or p.dtype
                pieces.append(slot.to(self.device, dtype, non_blocking=True))
        message = [piece.reshape(-1).view(torch.uint8) for piece in pieces]
        nbytes = sum(m.numel() for m in message)
        if not self._message_checked:
            self._check_message_size(nbytes)
        output, row = self._gather_buffer(self.world_size, nbytes, tails, torch.uint8)
        mine = output[self.shard_rank * row : (self.shard_rank + 1) * row]
        torch.cat(message, out=mine[:nbytes])
        return output, mine, nbytes

    def _check_message_size(self, nbytes: int) -> None:
        """At a layout's first all-gather, check that every rank sends as many bytes: the
        hooks decide the sizes, and a rank sending another size would hang the others in
        the collective. Later all-gathers must repeat the layout (``GatherExtension``)."""
        if self.world_size > 1:
            low, high = min_and_max(nbytes, self.process_group, self.device)
            if low != high:
                inputs = "; ".join(
                    f"'{p.fqn}': {[tuple(shape) for shape, _ in p.extension.input_layout]}"
                    for p in self.extensions
                    if p.extension is not None
                )
                raise RuntimeError(
                    f"fully_shard: {self.label}: ranks send all-gather messages of "
                    f"{low} to {high} bytes (this rank: {nbytes}); fsdp_pre_all_gather "
                    f"must return inputs of the same shapes and dtypes on every rank (for "
                    f"unevenly sharded parameters, the padded shard's shape). Inputs on "
                    f"this rank: {inputs}"
                )
        self._message_checked = True

    def _extension_targets(self) -> list[torch.Tensor]:
        """Copy-out targets of a group with extensions, as ``uint8`` views in message
        order: plain parameters' unsharded slots, extensions' persistent outputs."""
        targets: list[torch.Tensor] = []
        for p in self.params:
            if p.extension is not None:
                targets += p.extension.alloc_outputs(self.world_size, self.device)
            else:
                targets.append(self._byte_targets[id(p)])
        return targets

    def _all_gather_input(self, output: torch.Tensor, row: int) -> torch.Tensor:
        """This rank's message, ``row`` elements (its data, then room for a tail when
        ``row`` is larger): the flat shard itself when it is already in the gathered dtype
        and on the compute device (no copy-in; its storage has room for a tail,
        ``new_flat_shard``). Otherwise one fused cast (mixed precision) or host-to-device
        copy (offload) written straight into this rank's slot of the all-gather ``output``
        (an in-place all-gather), so no separate input buffer lives while the collective
        runs."""
        flat = self.flat_shard
        n = self.gather_numel
        if flat.dtype == self.gather_dtype and flat.device == self.device:
            if row == n:
                return flat
            # The storage's data and room as a tensor of its own, made once per flat
            # shard and size (a new alias per all-gather cost more than the rest of
            # the fingerprint).
            kept = self.__dict__.get("_roomy")
            if kept is not None and kept[0] is flat and kept[1].numel() == row:
                return kept[1]
            roomy = _with_room(flat, row)
            if roomy is not None:
                self.__dict__["_roomy"] = (flat, roomy)
                return roomy
        mine = output[self.shard_rank * row : (self.shard_rank + 1) * row]
        slot = mine[:n]
        if not self.mixed or self.gather_dtype == torch.uint8:
            slot.copy_(flat, non_blocking=True)
        else:  # mixed dtypes gathered in param_dtype: one cat casts every typed slot
            source = flat.to(self.device, non_blocking=True)
            torch.cat([p.shard_slot(source) for p in self.params], out=slot)
        return mine

    def sharded_params(self) -> list[torch.Tensor]:
        """The sharded ``DTensor`` parameters an optimizer steps (what an all-gather reads)."""
        return [p.sharded_param for p in self.params]

    @outside_transforms
    def wait_for_unshard(self) -> None:
        """Wait for the in-flight all-gather, fill the unsharded parameters and register
        them on the modules."""
        in_flight = self._all_gather
        if in_flight is None:
            return
        self._all_gather = None
        comm = self._require_comm()
        comm.all_gathers_in_flight.pop(self, None)
        compute = comm.streams.compute()
        wait(in_flight.pending, compute)
        if self._gather_in_place and not in_flight.in_place:
            # A custom all-gather's buffer, or one with tails, rank-major like the
            # unsharded buffer here (also for the post-forward group's gather): one copy.
            self._alloc_unsharded()
            rows = _data_rows(in_flight)
            self._unsharded_write.view(rows.shape).copy_(rows)
            comm.order_all_gathers_after_compute()
            if self.custom_all_gather is None:
                comm.host_buffers.release(in_flight.output)
        elif not in_flight.in_place:
            self._alloc_unsharded()
            if in_flight.from_post_forward:
                targets = self._post_forward_targets
                sizes = [t[0].numel() for t in targets]
            elif self.extensions:
                targets = self._extension_targets()
                sizes = [t[0].numel() for t in targets]
            else:
                targets, sizes = self._copy_out_targets, self._gather_sizes
            output = _data_rows(in_flight)
            if self._strided_copy_out:
                sources = torch.split(output, sizes, dim=1)
                torch._foreach_copy_(targets, [s.view(t.shape) for s, t in zip(sources, targets)])
            else:
                torch.split_with_sizes_copy(output, sizes, dim=1, out=targets)
            del output
            # The all-gather output (all-gather-stream memory) dies with ``in_flight``.
            comm.order_all_gathers_after_compute()
            if self.custom_all_gather is None:
                comm.host_buffers.release(in_flight.output)
        if self.extensions and not in_flight.from_post_forward:
            for p in self.extensions:
                p.finish_gather(self.mp_policy.param_dtype or p.dtype)
        record = in_flight.pending.record
        if record is not None:  # a schedule recorder: [Note: schedule records]
            record.recorder.consumed(record)
        self.sharded_state = ShardedState.UNSHARDED
        # Extension parameters are rebuilt by their hooks, not views of the buffer.
        watched = None if self.extensions else self._require_unsharded_flat()
        self._unsharded_version = None if watched is None else watched._version
        for p in self.params:
            p.register_unsharded()

    def _require_post_forward_shard(self) -> torch.Tensor:
        if self._post_forward_shard is None:
            raise RuntimeError(
                f"{self.label}: resharded after forward (reshard_after_forward=int) but "
                f"holds no post-forward shard to all-gather"
            )
        return self._post_forward_shard

    def _post_forward_message(self, chunks: list[torch.Tensor]) -> torch.Tensor:
        """This rank's share kept after forward (``reshard_after_forward=int``): one cat of
        ``chunks`` into a buffer with room for a fingerprint tail after it."""
        numel = sum(c.numel() for c in chunks)
        dtype = chunks[0].dtype if chunks else self.gather_dtype
        buffer = torch.empty(tailed_numel(numel, dtype), dtype=dtype, device=self.device)
        torch.cat(chunks, out=buffer[:numel])
        return buffer


_CUSTOM_API = "set_custom_all_gather"


def new_flat_shard(
    numel: int, dtype: torch.dtype, device: torch.device, *, pin: bool = False
) -> torch.Tensor:
    """A zeroed flat shard of ``numel`` elements whose storage has room for a fingerprint
    tail after them, so that it is the all-gather input as is, tail included, with the
    divergence checks on ([Note: in-band fingerprints] in ``_fingerprints``); ``pin``: in
    pinned host memory."""
    full = torch.zeros(tailed_numel(numel, dtype), dtype=dtype, device=device)
    return (full.pin_memory() if pin else full)[:numel]


def _with_room(flat: torch.Tensor, row: int) -> torch.Tensor | None:
    """``flat``'s first ``row`` elements of storage (its data and the room after it), as
    a tensor of its own: writing the tail there leaves ``flat``'s version counter alone,
    which the stale checks read ([Note: stale unsharded parameters]). None without room."""
    storage = flat.untyped_storage()
    offset = flat.storage_offset()
    if storage.nbytes() < (offset + row) * flat.element_size():
        return None
    return torch.empty(0, dtype=flat.dtype, device=flat.device).set_(storage, offset, (row,), (1,))


def _data_rows(in_flight: AllGatherInFlight) -> torch.Tensor:
    """The ``(ranks, message)`` data of an all-gather's output, without the tails."""
    rows = in_flight.output.view(-1, in_flight.row)
    return rows if in_flight.row == in_flight.message else rows[:, : in_flight.message]
