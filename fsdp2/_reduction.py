"""How a group's per-rank gradient chunks are summed under a ``ReducePolicy``: one
all-to-all in ``comm_dtype`` and a local sum in ``accumulate_dtype``, in rank order; and
HSDP's sum over replicas by the same rule. ``_grad_reduce`` decides per step which scheme
runs (``plan_reduction``), issues it and assigns the result; the chunks are
``_grad_pack``'s, the same for every scheme.

[Note: all-to-all reduction]
A reduce-scatter sums while the data travels, in the dtype on the wire: in bf16, every
partial sum along a ring is rounded to 8 bits, and the error grows with the number of
ranks (about like its square root; Megatron-LM#6199, pytorch#106395 at 48x8 GPUs). With
an ``accumulate_dtype`` wider than ``comm_dtype`` nothing is summed on the wire. The
input is built as for a reduce-scatter in ``comm_dtype`` (rank ``r``'s chunk: the padded
gradient shards of rank ``r``, then the padded has-gradient flags; [Note: gradients some
ranks lack]), and one ``all_to_all_single`` per group gives each rank the ``ws`` chunks
meant for it, unsummed, in group rank order. The rank adds them in ``accumulate_dtype``
(``accumulate_in_rank_order``) and the group divides once, as after a summed
reduce-scatter. Each contribution is rounded once, to ``comm_dtype``, so the error of an
element's mean is at most ``(u_comm / (1 + u_comm) + (ws - 1) * u_acc)`` times the mean
of that element's ``|contributions|``: for bf16 on the wire (``u = 2^-8``) and fp32 sums
(``2^-24``), 2^-8 up to 257 ranks, and 1.004 * 2^-8 at 1,024 if every rounding went the
same way; measured 0.95 * 2^-8 at 2 ranks, falling with the world size as independent
roundings average out (docs/reduction.md). Each rank sends ``ws - 1`` chunks and
receives as many, the bytes of a ``comm_dtype`` reduce-scatter. The price is memory: the
receive buffer holds ``ws`` chunks where a reduce-scatter's output holds one (the input's
size, which gloo's reduce-scatter also allocates, for its clone), and the
``accumulate_dtype`` sum, one chunk. The sum runs when the reduction is finished, on the
reduce-scatter stream, so the compute stream waits for it exactly where it waited for the
reduce-scatter, and the receive buffer is allocated, used and freed on that one stream
([Note: buffer lifetime across streams]; on the CPU it goes back to the host buffer pool
once the work is done).

[Note: deterministic reduction]
A backend's reduce-scatter may add the ranks' terms in any order: the ring's start differs
per chunk, NCCL picks algorithms by size and topology and changes them between versions,
and the order of arrival can depend on timing (pytorch#120383, #125190). After the
all-to-all, rank ``j``'s chunk is row ``j`` of the receive buffer however the messages
arrived, and the sum is a left fold over the rows, ``((c_0 + c_1) + c_2) + ...``, one
element-wise add per row (no reduction kernel whose blocking or threads could regroup
terms), then one division. ``deterministic=True`` takes this path even when the
accumulate dtype equals the wire's (an fp32 all-to-all and fp32 sums), so gradients are
bitwise equal from run to run for the same world size, whatever the algorithm, the
backend's version or the timing. HSDP adds a fold over replicas in replica order after the
fold over shard ranks ([Note: replicas under a reduce policy]).

[Note: replicas under a reduce policy]
HSDP sums each shard over replicas after the shard-dim reduction. An all-reduce in
``comm_dtype`` would round every partial sum along its ring again (pytorch#190627: torch's
``reduce_dtype`` is not even applied on that dim). Under a policy that exchanges, each
replica's partial sum (in ``accumulate_dtype``) is cast to ``comm_dtype`` and cut into
``R`` pieces; one all-to-all over the replicas gives each rank the ``R`` partial sums of
its piece, which it folds in replica order in ``accumulate_dtype``; one all-gather (in
``accumulate_dtype``) returns every piece to every replica. Every replica receives the same
values, so replicas stay bitwise in sync, and the result is never rounded to the wire
dtype. Per rank that sends ``(R - 1) / R`` of the shard in ``comm_dtype`` plus as much in
``accumulate_dtype``: 1.5x a bf16 ring all-reduce's bytes with bf16/fp32 (0.75x an fp32
one). Rejected: an all-gather of every replica's partial sum (one collective, but ``R / 2``
times the all-reduce's bytes on the dim that usually crosses nodes), an all-gather in
``comm_dtype`` (rounds the final gradient to the wire dtype), and sending the ranks'
contributions themselves across replicas (``ws`` times the bytes), and partial sums in
``accumulate_dtype`` (the 1-D error bound, for an fp32 all-reduce's bytes on the dim that
usually crosses nodes: the wire dtype is the policy's ``comm_dtype`` there too). Partial
sums are rounded once more, to ``comm_dtype``, so the bound becomes ``2 u_comm`` of the
mean contribution (every rank's term with the same sign, every rounding maximal);
measured 1.15 to 1.43 times 2^-8 on 2x4 and 2x2 meshes, below the bf16 reduce-scatter
and all-reduce's 1.9 to 2.8 (docs/reduction.md).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fsdp2._collectives import PendingCollective, all_gather_flat, all_to_all_flat, wait
from fsdp2._comm_context import CommContext
from fsdp2._comm_records import CollectiveRecord
from fsdp2._divergence import Issued, checks_enabled
from fsdp2._fingerprints import (
    ExchangedBlocks,
    FingerprintCheck,
    GatheredTails,
    block_numel,
    block_tensor,
    tail_numel,
    tailed_numel,
    write_tail,
)
from fsdp2._policies import ReducePolicy, check_accumulates
from fsdp2._stream_utils import Stream, record_event, use_stream


class ReductionPlan(NamedTuple):
    """How one step reduces a group: the dtype on the wire, and the dtype the ranks'
    contributions are summed in after an all-to-all (``None``: a reduce-scatter in
    ``comm_dtype`` sums them)."""

    comm_dtype: torch.dtype
    accumulate_dtype: torch.dtype | None


def plan_reduction(policy: ReducePolicy | None, default: torch.dtype, where: str) -> ReductionPlan:
    """The plan for a group whose reduce dtype without a policy is ``default``. Raises a
    ``ValueError`` naming the group when a field left at ``None`` resolves to a wire
    dtype wider than the explicit accumulate dtype."""
    if policy is None:
        return ReductionPlan(default, None)
    comm_dtype = policy.comm_dtype or default
    accumulate = policy.accumulate_dtype or torch.promote_types(default, comm_dtype)
    resolved = "" if policy.comm_dtype else f" (comm_dtype=None is the reduce dtype, {default})"
    check_accumulates(comm_dtype, accumulate, f"fully_shard: {where}: {policy}{resolved}")
    if accumulate == comm_dtype and not policy.deterministic:
        return ReductionPlan(comm_dtype, None)
    return ReductionPlan(comm_dtype, accumulate)


def accumulate_in_rank_order(contributions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The sum over rows of ``contributions`` (``(ranks, n)``, row ``j`` from rank ``j``)
    in ``dtype``, as the left fold ``((row_0 + row_1) + row_2) + ...``: one element-wise
    add per row, so the order never depends on kernels or timing ([Note: deterministic
    reduction]). A new tensor, even for one row."""
    total = contributions[0].to(dtype, copy=True)
    for row in contributions[1:]:
        total.add_(row)  # promotes ``row`` exactly, rounds once per add in ``dtype``
    return total


def exchange_chunks(
    chunks: torch.Tensor,
    group: dist.ProcessGroup,
    stream: Stream,
    comm: CommContext,
    custom: Any,
    what: str,
    record: CollectiveRecord | None = None,
    issued: Issued | None = None,
    block: int = 0,
) -> tuple[torch.Tensor, PendingCollective]:
    """Issue the all-to-all of ``chunks`` (the reduce input: one chunk per rank,
    rank-major). Returns the buffer that receives every rank's chunk for this rank (the
    same size, rank-major) and the collective. Call it with ``stream`` current, so the
    buffer belongs to that stream. ``custom``: the group's backend allocator
    (``set_allocate_memory_from_process_group_for_comm``), or None for pooled memory.
    ``record``/``issued``: from ``CommContext.before_collective``; with ``block``, each
    chunk ends with its sender's fingerprint block, checked per sender ([Note: in-band
    fingerprints] in ``_fingerprints``)."""
    numel = chunks.numel()
    if custom is not None:
        received = custom.allocate((numel,), dtype=chunks.dtype, device=chunks.device)
    else:
        received = comm.host_buffers.empty(numel, chunks.dtype, chunks.device)
    check = None
    if issued is not None and block:
        blocks = received.view(group.size(), -1)[:, -block:]
        check = ExchangedBlocks(issued, blocks, comm.groups)
    return received, _all_to_all(received, chunks, group, stream, what, record, check)


def sum_exchanged(
    received: torch.Tensor,
    pending: PendingCollective,
    world_size: int,
    dtype: torch.dtype,
    comm: CommContext,
    pooled: bool,
) -> tuple[torch.Tensor, PendingCollective]:
    """Finish an all-to-all from ``exchange_chunks``: sum the ranks' chunks in rank order
    in ``dtype`` on the reduce-scatter stream (after the collective: the CPU waits for its
    work, a stream is ordered already). Returns the sum (one chunk) and an event after
    it for the consumer; ``received`` goes back to the host buffer pool (``pooled``)."""
    stream = comm.streams.reduce_scatter
    wait(pending, stream)
    with use_stream(stream):
        summed = accumulate_in_rank_order(received.view(world_size, -1), dtype)
    if pooled:
        comm.host_buffers.release(received)
    # The consumer's wait is still this collective's (its descriptor goes on with it).
    return summed, PendingCollective(None, record_event(stream), pending.what, pending.record)


def sum_over_replicas(
    partial: torch.Tensor,
    group: dist.ProcessGroup,
    replicas: int,
    plan: ReductionPlan,
    stream: Stream,
    comm: CommContext,
    what: str,
    owner: object = None,
) -> tuple[torch.Tensor, PendingCollective]:
    """HSDP under a policy that exchanges: ``partial`` (this replica's sums, in the
    accumulate dtype) summed over the ``replicas`` ranks of ``group`` in replica order;
    see [Note: replicas under a reduce policy]. Runs on ``stream``, which must already be
    ordered after ``partial``. Returns the sums and an event after them, on ``stream``.
    With divergence checks on, each piece of the all-to-all ends with a fingerprint
    block and each rank's piece of the all-gather with a tail ([Note: in-band
    fingerprints] in ``_fingerprints``)."""
    dtype = plan.accumulate_dtype
    if dtype is None:
        raise AssertionError("sum_over_replicas needs a plan with an accumulate dtype")
    numel = partial.numel()
    piece = -(-numel // replicas)
    checked = checks_enabled()
    block = block_numel(plan.comm_dtype) if checked else 0
    named = f"all-to-all of {what}"
    with use_stream(stream):
        record, issued = comm.before_collective(named, replicas * (piece + block), group, owner)
        outgoing = torch.empty(
            replicas, piece + block, dtype=plan.comm_dtype, device=partial.device
        )
        if block:
            padded = F.pad(partial, (0, replicas * piece - numel))
            outgoing[:, :piece].copy_(padded.view(replicas, piece))
            fingerprint = None if issued is None else issued.fingerprint
            values = block_tensor(fingerprint, block, plan.comm_dtype, partial.device)
            outgoing[:, piece:].copy_(values)
        else:
            outgoing.view(-1)[:numel].copy_(partial)
            outgoing.view(-1)[numel:].zero_()
        check: FingerprintCheck | None = None
        incoming = torch.empty_like(outgoing)
        if issued is not None and block:
            check = ExchangedBlocks(issued, incoming[:, piece:], comm.groups)
        exchanged = _all_to_all(
            incoming.view(-1), outgoing.view(-1), group, stream, named, record, check
        )
    wait(exchanged, stream)
    with use_stream(stream):
        mine = accumulate_in_rank_order(incoming[:, :piece], dtype)
        del outgoing, incoming  # done with: the collective was waited for
        row = tailed_numel(piece, dtype) if checked else piece
        named = f"all-gather of {what}"
        record, issued = comm.before_collective(named, replicas * row, group, owner)
        if row != piece:
            sent = torch.empty(row, dtype=dtype, device=partial.device)
            sent[:piece].copy_(mine)
            mine = sent
        gathered = torch.empty(replicas, row, dtype=dtype, device=partial.device)
        check = None
        if issued is not None and row != piece:
            unit = tail_numel(dtype)
            write_tail(mine[row - unit :], issued.fingerprint)
            check = GatheredTails(
                issued, gathered[:, row - unit :].view(torch.float64), comm.groups
            )
        pending = all_gather_flat(
            gathered.view(-1), mine, group, stream, what=named, record=record, check=check
        )
    if row == piece:
        return gathered.view(-1)[:numel], pending
    wait(pending._replace(record=None), stream)  # the consumer's wait is recorded
    with use_stream(stream):  # every replica's piece, without the tails
        summed = gathered[:, :piece].reshape(-1)[:numel]
    return summed, PendingCollective(None, record_event(stream), named, pending.record)


def _all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    stream: Stream,
    what: str,
    record: CollectiveRecord | None = None,
    check: FingerprintCheck | None = None,
) -> PendingCollective:
    """``all_to_all_flat``, with a clear error where the backend has no all-to-all (every
    rank's backend refuses it at the issue, so all raise together and none hangs)."""
    try:
        return all_to_all_flat(output, input, group, stream, what, record, check)
    except (RuntimeError, NotImplementedError) as error:
        if not _lacks_all_to_all(error):
            raise
        backend = dist.get_backend(group)
        raise RuntimeError(
            f"fully_shard: the {what} cannot be issued: the process group's backend "
            f"{backend!r} has no all-to-all ({error}). A ReducePolicy whose accumulate_dtype "
            f"is wider than its comm_dtype, or with deterministic=True, exchanges gradients "
            f"with torch.distributed.all_to_all_single. Use a backend that implements it "
            f"(gloo and nccl do), or let the group reduce-scatter: "
            f"module.set_reduce_policy(None), or a ReducePolicy with accumulate_dtype equal "
            f"to comm_dtype and deterministic=False."
        ) from error


def _lacks_all_to_all(error: BaseException) -> bool:
    """Whether ``error`` says the backend does not implement the all-to-all (c10d's base
    ``Backend`` raises "Backend <name> does not support alltoall_base")."""
    if isinstance(error, NotImplementedError):
        return True
    message = str(error).lower()
    return "not support" in message and ("alltoall" in message or "all_to_all" in message)
