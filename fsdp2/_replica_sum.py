"""HSDP: a group's reduced gradient shard summed over the replicas.

``ReplicaSum`` is the part of ``GradientReduction`` (``_grad_reduce``) that runs after the
shard-dim reduction on a 2-D mesh: the all-reduce over the replicate dim (or, under a
``ReducePolicy`` that exchanges, the all-to-all and all-gather of ``_reduction``), and the
partial sums that ``set_requires_all_reduce(False)`` keeps between microbatches instead.

[Note: partial sums across changing layouts]
HSDP with ``set_requires_all_reduce(False)`` keeps each microbatch's reduce-scattered
output and adds the next one to it before the all-reduce. The output covers the group's
trainable parameters, then their flags, so freezing or unfreezing a parameter between
microbatches changes where gradients and flags sit. Adding two such outputs
element by element would add flags into gradients (or drop a gradient); both are first
laid out for the whole group, zeros where a parameter had none, and the sum covers every
parameter. torch's ``fully_shard`` raises a size mismatch in the same case.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.distributed import ProcessGroup, ReduceOp

from fsdp2._collectives import PendingCollective, all_reduce_flat, wait
from fsdp2._comm_context import CommContext
from fsdp2._fingerprints import block_numel, block_tensor, summed_block_check
from fsdp2._param import ShardedParam
from fsdp2._reduction import ReductionPlan, sum_over_replicas
from fsdp2._stream_utils import use_stream, wait_event, wait_stream


class ReplicaSum:
    """The sum over replicas of a group's reduced shard (mixed into ``GradientReduction``).

    The attributes below are set by ``ParamGroup.__init__`` and its layout planning."""

    params: list[ShardedParam]
    world_size: int
    replicate_size: int
    requires_all_reduce: bool
    _reduce_sizes: list[int]
    # HSDP with set_requires_all_reduce(False): reduce-scattered, not yet all-reduced
    # (the sums, their positions, and what the reduce-scatter divided them by).
    _partial_reduce: tuple[torch.Tensor, tuple[int, ...], float] | None
    if TYPE_CHECKING:  # ``GradientPacking``'s and ``GradientReduction``'s

        @property
        def where(self) -> str: ...

        def _packed_offsets(self, positions: tuple[int, ...]) -> list[int]: ...

        def flag_numel(self, count: int, dtype: torch.dtype) -> int: ...

        def _require_comm(self) -> CommContext: ...

    def _all_reduce_replicas(
        self,
        output: torch.Tensor,
        positions: tuple[int, ...],
        replicate_group: ProcessGroup,
        reduce_scatter: PendingCollective,
        averaged: bool,
        predivide: float,
        plan: ReductionPlan,
        block: int = 0,
    ) -> tuple[torch.Tensor, tuple[int, ...]] | None:
        """HSDP: sum the reduce-scattered shard (the gradients of the parameters at
        ``positions``, then their flags, then ``block`` elements of room for a
        fingerprint) over replicas, or keep it for later when ``requires_all_reduce`` is
        off. Returns the summed output and the positions it covers; ``None`` means nothing
        to assign yet. The all-reduce writes its own fingerprint into the block first
        ([Note: in-band fingerprints] in ``_fingerprints``).

        On an accelerator the all-reduce waits only for ``reduce_scatter`` (the event of
        the collective that produced ``output``), not for the compute stream: by now that
        stream holds the next blocks' backward, and waiting for it would leave the
        all-reduce no compute to overlap. Only partial sums added here (on the compute
        stream) make it wait for the compute stream."""
        kept = self._partial_reduce
        self._partial_reduce = None
        written_on_compute = kept is not None
        # What the reduce-scatter divided by: its group's size (AVG), or the pre-division.
        divided_by = float(self.world_size) if averaged else predivide
        if kept is not None:
            partial, partial_positions, partial_divided_by = kept
            if partial_divided_by != divided_by:  # the divisor switches changed in between
                partial = partial * (partial_divided_by / divided_by)
            if partial_positions != positions or partial.dtype != output.dtype:
                # See [Note: partial sums across changing layouts].
                dtype = torch.promote_types(partial.dtype, output.dtype)
                partial = self._whole_group_layout(partial, partial_positions, dtype, block)
                output = self._whole_group_layout(output, positions, dtype, block)
                positions = tuple(range(len(self.params)))
                block = block_numel(dtype) if block else 0
            output.add_(partial)
        if not self.requires_all_reduce:
            self._partial_reduce = (output, positions, divided_by)
            return None
        comm = self._require_comm()
        stream = comm.streams.all_reduce
        if written_on_compute:
            wait_stream(stream, comm.streams.compute())
        else:  # waited for on the CPU already (``finish_reduce``): the event only
            wait_event(stream, reduce_scatter.event)
        if plan.accumulate_dtype is not None:  # see [Note: replicas under a reduce policy]
            what = f"the gradients of {self.where} over replicas"
            output, pending = sum_over_replicas(
                output, replicate_group, self.replicate_size, plan, stream, comm, what, self
            )
        else:
            what = f"all-reduce of the gradients of {self.where}"
            record, issued = comm.before_collective(what, output.numel(), replicate_group, self)
            check = None
            if issued is not None and block:
                with use_stream(stream):  # after the reduce-scatter, before the all-reduce
                    values = block_tensor(issued.fingerprint, block, output.dtype, output.device)
                    output[output.numel() - block :].copy_(values)
                    check = summed_block_check(issued, output, block, comm.groups)
            op = ReduceOp.AVG if averaged else ReduceOp.SUM
            pending = all_reduce_flat(output, replicate_group, stream, op, what, record, check)
        wait(pending, comm.streams.compute())
        return output, positions

    def _whole_group_layout(
        self, output: torch.Tensor, positions: tuple[int, ...], dtype: torch.dtype, block: int
    ) -> torch.Tensor:
        """``output`` (the gradient shards of the parameters at ``positions``, then their
        flags, then ``block`` elements for a fingerprint) laid out for every parameter of
        the group, zeros where it had none, in ``dtype`` (with room for a block of
        ``dtype`` when ``block``)."""
        n = len(self.params)
        if positions == tuple(range(n)) and output.dtype == dtype:
            return output
        offsets = self._packed_offsets(positions)
        whole_numel = sum(self._reduce_sizes)
        room = block_numel(dtype) if block else 0
        whole = torch.zeros(
            whole_numel + self.flag_numel(n, dtype) + room, dtype=dtype, device=output.device
        )
        for j, i in enumerate(positions):
            at, size = self.params[i].offset, self._reduce_sizes[i]
            whole[at : at + size].copy_(output[offsets[j] : offsets[j + 1]])
            whole[whole_numel + i] = output[offsets[-1] + j]
        return whole
