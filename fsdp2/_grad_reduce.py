"""Gradient reduction of a parameter group: reduce-scatter, HSDP all-reduce, assignment.

``GradientReduction`` is the half of ``ParamGroup`` (``_param_group``) that runs after
backward: one fused copy-in of the unsharded gradients into the reduce-scatter input (laid
out by ``GradientPacking``, ``_grad_pack``), one collective (under a ``ReducePolicy``
that asks for wider sums or determinism, an all-to-all whose chunks are summed locally:
``_reduction``), and, when that is waited on (later, so it overlaps the rest of
backward), the scaling and the gradient shards assigned to the sharded parameters. The
group's layout (``params``, ``_reduce_sizes``, dtypes) and runtime switches are
``ParamGroup``'s; this module only reads them.

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

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed import ProcessGroup, ReduceOp
from torch.distributed.tensor import DTensor

from fsdp2._collectives import PendingCollective, reduce_scatter_flat, wait
from fsdp2._comm_context import CommContext, ReduceInFlight
from fsdp2._fingerprints import summed_block_check
from fsdp2._grad_pack import GradientPacking, promote_dtypes
from fsdp2._param import ShardedParam
from fsdp2._policies import ReducePolicy
from fsdp2._reduction import ReductionPlan, exchange_chunks, plan_reduction, sum_exchanged
from fsdp2._replica_sum import ReplicaSum
from fsdp2._stream_utils import Stream, record_event, use_stream, wait_stream


class GradientReduction(ReplicaSum, GradientPacking):
    """Reduce-scatter and assignment of a group's gradients (mixed into ``ParamGroup``).

    The attributes below are set by ``ParamGroup.__init__`` and its layout planning."""

    shard_device: torch.device
    shard_dtype: torch.dtype
    mixed: bool
    process_group: ProcessGroup
    # set_separate_reduce_scatter_group: a process group of the same ranks for the
    # reduce-scatters alone, so they can progress while the next all-gather does.
    reduce_scatter_group: ProcessGroup | None
    custom_reduce_scatter: Any  # set_custom_reduce_scatter: torch's ReduceScatter
    replicate_group: ProcessGroup | None
    replicate_size: int
    _partial_reduce: tuple[torch.Tensor, tuple[int, ...], float] | None
    comm: CommContext | None
    requires_gradient_sync: bool
    gradient_divide_factor: float | None
    force_sum_reduction: bool
    reduce_scatter_unused: bool
    requires_all_reduce: bool
    all_reduce_hook: Callable[[torch.Tensor], None] | None
    all_reduce_hook_stream: Stream
    # fully_shard(reduce_policy=) / set_reduce_policy: see ``_reduction``. None: reduce
    # in the reduce dtype with a reduce-scatter, as torch does.
    reduce_policy: ReducePolicy | None = None

    def owes_reduction(self) -> bool:
        """Whether sums kept from earlier backwards (unsynced gradients, or HSDP's partial
        sums without the all-reduce) are due now that the switches ask for them."""
        if not self.requires_gradient_sync:
            return False
        partial_due = self._partial_reduce is not None and self.requires_all_reduce
        return self.grads_unsynced or partial_due

    def default_reduce_dtype(self, positions: tuple[int, ...]) -> torch.dtype:
        """The reduce dtype without a ``ReducePolicy``: ``reduce_dtype`` (the mixed
        precision policy's, else ``param_dtype``), else the promotion of the dtypes of the
        parameters at ``positions`` (a mixed group)."""
        return self.reduce_dtype or promote_dtypes(self.params[i].dtype for i in positions)

    def reduce_grads(self) -> None:
        """Reduce-scatter the unsharded gradients (one fused copy-in, one collective) and
        drop them; under a ``ReducePolicy`` that exchanges, the collective is an
        all-to-all instead ([Note: all-to-all reduction] in ``_reduction``). The result is
        assigned to the sharded parameters by ``finish_reduce``, when the collective is
        waited on: later, so it overlaps the rest of backward."""
        # Which parameters a rank used can differ between ranks (data-dependent routing),
        # so nothing here may depend on the local gradients: the trainable parameters are
        # reduced, and one without a local gradient contributes zeros. See
        # [Note: gradients some ranks lack].
        self.grads_unsynced = False
        positions = self.reduced_positions()
        if not positions:
            return
        reduced = [self.params[i] for i in positions]
        ws = self.world_size
        plan = plan_reduction(self.reduce_policy, self.default_reduce_dtype(positions), self.where)
        reduce_dtype, accumulate_dtype = plan
        rows, has_grad, numel = self.gradient_rows(positions, reduce_dtype)
        comm = self._require_comm()
        compute = comm.streams.compute()
        # Bound memory before allocating: finish older reductions (freeing their inputs)
        # so that with this one at most ``max_reduces_in_flight`` are in flight.
        comm.finish_reduces(keep=comm.max_reduces_in_flight - 1)
        custom = self.custom_reduce_scatter
        group = self.reduce_scatter_group or self.process_group
        kind = "all-to-all" if accumulate_dtype is not None else "reduce-scatter"
        what = f"{kind} of the gradients of {self.where}"
        # Each rank's chunk ends with a fingerprint block when checks are on: [Note:
        # in-band fingerprints] in ``_fingerprints``.
        block = self.fingerprint_block_numel(reduce_dtype, custom)
        record, issued = None, None
        if ws > 1:
            record, issued = comm.before_collective(what, ws * (numel + block), group, self)
        if block:
            numel += self.append_fingerprint_block(rows, issued, block)
        # A custom reduce-scatter allocates the buffers (without the block if it must).
        rs_input, numel, block = self.reduce_input(
            custom, rows, numel, block, reduce_dtype, comm.host_buffers
        )
        self.copy_in_grads(reduced, rows, rs_input.view(ws, numel))
        del rows  # the unsharded gradients die here, not when this returns
        predivide = self.predivide_factor(reduce_dtype)
        if predivide != 1.0:
            rs_input.div_(predivide)
        averaged = accumulate_dtype is None and self.averages_in_collectives(reduce_dtype)
        stream = comm.streams.reduce_scatter
        wait_stream(stream, compute)  # the gradients were produced on the compute stream
        if ws == 1:  # one rank: the input is the reduced shard (torch issues no collective)
            done = PendingCollective(None, record_event(stream))
            in_flight = ReduceInFlight(
                self,
                rs_input,
                rs_input,
                done,
                has_grad,
                positions,
                averaged,
                accumulate_dtype,
                block,
            )
            comm.reduces.append(in_flight)
            return
        with use_stream(stream):
            if accumulate_dtype is not None:  # see [Note: all-to-all reduction]
                rs_output, pending = exchange_chunks(
                    rs_input, group, stream, comm, custom, what, record, issued, block
                )
            else:
                if custom is not None:
                    rs_output = custom.allocate((numel,), dtype=reduce_dtype, device=self.device)
                else:
                    rs_output = torch.empty(numel, dtype=reduce_dtype, device=self.device)
                check = summed_block_check(issued, rs_output, block, comm.groups)
                op = ReduceOp.AVG if averaged else ReduceOp.SUM
                pending = reduce_scatter_flat(
                    rs_output, rs_input, group, stream, op, custom, what, record, check
                )
        # [Note: reduce-scatter input lifetime]: a collective issued with a Work (CPU
        # backends) keeps alive every tensor its backend still reads, so ours can go now.
        kept_input = rs_input if pending.work is None else None
        del rs_input
        in_flight = ReduceInFlight(
            self,
            kept_input,
            rs_output,
            pending,
            has_grad,
            positions,
            averaged,
            accumulate_dtype,
            block,
        )
        comm.reduces.append(in_flight)

    def finish_reduce(self, in_flight: ReduceInFlight) -> None:
        """Wait for a reduce-scatter, scale it, and store the gradient shards as DTensors
        on the sharded parameters (accumulating into existing gradients)."""
        comm = self._require_comm()
        output, pending = in_flight.output, in_flight.pending
        plan = ReductionPlan(output.dtype, in_flight.accumulate_dtype)
        predivide = self.predivide_factor(output.dtype)  # what the wire's input was divided by
        if plan.accumulate_dtype is not None:  # exchanged: sum the ranks' chunks first
            pooled = self.custom_reduce_scatter is None
            output, pending = sum_exchanged(
                output, pending, self.world_size, plan.accumulate_dtype, comm, pooled
            )
        wait(pending, comm.streams.compute())
        positions = in_flight.positions
        if self.replicate_group is not None:
            summed = self._all_reduce_replicas(
                output,
                positions,
                self.replicate_group,
                pending,
                in_flight.averaged,
                predivide,
                plan,
                in_flight.block,
            )
            if summed is None:
                return  # accumulated locally until the next step that all-reduces
            output, positions = summed
        count = len(positions)
        reduced = [self.params[i] for i in positions]
        # The flags: the sum (or average) over ranks and replicas of "had the gradient".
        # Zero means no rank used the parameter: its gradient stays None, as in
        # non-sharded training.
        offsets = self._packed_offsets(positions)
        grads_numel = offsets[-1]
        flags, output = output[grads_numel : grads_numel + count], output[:grads_numel]
        # A local gradient proves some rank had one; only a rank missing some gradient
        # (or holding sums of earlier microbatches) reads the flags (a host sync on
        # accelerators, so not on the common path).
        has_grad = in_flight.has_grad
        local_proof = len(has_grad) == count and all(has_grad)
        if self.reduce_scatter_unused:
            # set_reduce_scatter_unused_params(True): as torch, every trainable parameter
            # of a group that reduced gets its reduced gradient, zeros where no rank used
            # it (no flags read).
            got_grad = [p.sharded_param.requires_grad for p in reduced]
        else:
            got_grad = has_grad if local_proof else (flags != 0).tolist()
        factor = 1.0 if in_flight.averaged else self.divide_factor() / predivide
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
        shards = self._gradient_shards(output, reduced, offsets)
        for p, used, local in zip(reduced, got_grad, shards, strict=True):
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

    def _gradient_shards(
        self, output: torch.Tensor, reduced: list[ShardedParam], offsets: list[int]
    ) -> list[torch.Tensor]:
        """The ``reduced`` parameters' local gradients from the reduced ``output`` (packed:
        parameter ``i`` starts at ``offsets[i]``), stored like the sharded parameters:
        their dtype, their device. One cast for a one-dtype group; one per run of equal
        dtypes in a mixed one."""
        count = len(reduced)
        if not self.mixed:
            output = output.to(self.shard_device, self.shard_dtype)
            return [p.reduced_view(output, p.offset - at) for p, at in zip(reduced, offsets)]
        shards: list[torch.Tensor] = []
        start = 0
        while start < count:
            dtype = reduced[start].dtype
            stop = start + 1
            while stop < count and reduced[stop].dtype == dtype:
                stop += 1
            run = output[offsets[start] : offsets[stop]].to(self.shard_device, dtype)
            shards += [
                p.reduced_view(run, p.offset - (offsets[i] - offsets[start]))
                for i, p in enumerate(reduced[start:stop], start)
            ]
            start = stop
        return shards

    def averages_in_collectives(self, reduce_dtype: torch.dtype) -> bool:
        """Whether the reduce-scatter (and HSDP's all-reduce) average (``ReduceOp.AVG``),
        as torch's ``fully_shard`` does for fp32 and bf16 reductions with the default
        divisor: no division kernel afterwards, and on NCCL, which averages floats by
        scaling each rank's input before the sum, torch's rounding (gloo divides the
        sum, as the division after a SUM would). Otherwise the collectives sum and
        ``finish_reduce`` divides once. Backends without AVG:
        ``set_force_sum_reduction_for_comms(True)``."""
        return (
            reduce_dtype in (torch.float32, torch.bfloat16)
            and self.gradient_divide_factor is None
            and not self.force_sum_reduction
            # torch: NCCL's AVG may be wrong on one rank; nothing to divide there anyway.
            and self.world_size * self.replicate_size > 1
        )

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
