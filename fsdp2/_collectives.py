"""Collectives on flat buffers: tensors, process groups and streams in; nothing about
parameters or modules.

Each function issues one collective and returns a ``PendingCollective`` that the caller
waits on when it needs the result. The ``torch.distributed`` function is looked up at call
time (``dist.all_gather_single`` rather than a reference bound at import), so tests and
tools that patch ``torch.distributed`` see every collective we issue.

Device handling: on an accelerator the collective is issued synchronously under a side
stream, so that the side stream (not the CPU) waits for it, and an event recorded there
orders the consumer. On the CPU the collective is issued with ``async_op=True`` so gloo
runs it on its own threads while Python goes on, and the consumer waits on the ``Work``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fsdp2._comm_records import CollectiveRecord, stamp
from fsdp2._divergence import DivergenceError, report_failure, wait_watching_peers
from fsdp2._fingerprints import FingerprintCheck, pending_checks, poll
from fsdp2._stream_utils import Event, Stream, record_event, use_stream, wait_event


class PendingCollective(NamedTuple):
    """A collective in flight: wait on ``work`` (CPU) or ``event`` (accelerator)."""

    work: Any  # dist.Work or None
    event: Event
    what: str = ""  # e.g. "all-gather of blocks.0 (Block)": named if the collective fails
    # Its descriptor while a schedule recorder is attached ([Note: schedule records]).
    record: CollectiveRecord | None = None
    # The check of its fingerprints, with divergence checks on ([Note: in-band
    # fingerprints] in ``_fingerprints``): verified right after the wait on the CPU; on an
    # accelerator registered at issue and verified by a later ``poll``/``settle``.
    check: FingerprintCheck | None = None


def wait(pending: PendingCollective | None, consumer: Stream) -> None:
    """Order ``consumer`` (or, on the CPU, the calling thread) after ``pending``; check its
    fingerprints (CPU), or those of earlier collectives that have arrived (accelerator)."""
    if pending is None:
        return
    record = pending.record
    if record is not None:
        record.recorder.waiting(record, consumer)
    check = pending.check
    if pending.work is not None:
        try:
            if check is None:
                pending.work.wait()
            else:  # see [Note: named timeouts] in ``_divergence``
                wait_watching_peers(pending.work, check.issued)
        except DivergenceError:
            raise
        except RuntimeError as error:
            name_failed_collective(error, pending.what, check)
            raise
        if check is not None:
            check.verify()
    elif pending_checks:
        poll()
    wait_event(consumer, pending.event)
    if record is not None:
        record.recorder.waited(record, consumer)


def name_failed_collective(
    error: BaseException, what: str, check: FingerprintCheck | None = None
) -> None:
    """Add to a backend's error (a timeout, a peer gone, a size mismatch: messages that
    name no module) which of fsdp2's collectives this rank was in, and the usual cause. A
    note rather than a new exception keeps the backend's class (``DistBackendError``),
    which launchers and user code may catch. With divergence checks on (``check``), the
    note is every rank's report, exchanged through the store ([Note: named timeouts] in
    ``_divergence``). Python 3.10 has no notes: nothing added, or with the checks on a
    ``DivergenceError`` raised from ``error``."""
    if check is not None:
        report_failure(error, check.issued)
        return
    add_note = getattr(error, "add_note", None)
    if add_note is None or not what:
        return
    add_note(
        f"fsdp2: this rank was in the {what} when the collective failed. A peer that "
        "stopped, or that issued another collective, is the usual cause: read the other "
        "ranks' errors first. If ranks may run different paths through the sharded "
        "modules (a block skipped on some ranks), TORCH_DISTRIBUTED_DEBUG=DETAIL makes "
        "fsdp2 name the first difference instead."
    )


def _issue(
    stream: Stream,
    what: str,
    record: CollectiveRecord | None,
    check: FingerprintCheck | None,
    call: Any,
    *args: Any,
    **kwargs: Any,
) -> PendingCollective:
    if record is not None and not record.kind:  # a collective without its own ``stamp``
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        nbytes = 0 if first is None else first.numel() * first.element_size()
        stamp(record, getattr(call, "__name__", "collective").removesuffix("_single"), nbytes)
    try:
        if stream is None:
            if record is not None:
                record.recorder.issuing(record, stream)
            work = call(*args, async_op=True, **kwargs)
            if record is not None:
                record.recorder.issued(record, stream, work)
            return PendingCollective(work, None, what, record, check)
        with use_stream(stream):
            if record is not None:
                record.recorder.issuing(record, stream)
            call(*args, async_op=False, **kwargs)
            if record is not None:
                record.recorder.issued(record, stream, None)
            if check is not None:  # the fingerprints go to host memory behind it
                check.read_back(stream)
            return PendingCollective(None, record_event(stream), what, record, check)
    except DivergenceError:
        raise
    except RuntimeError as error:
        name_failed_collective(error, what, check)
        raise


def all_gather_flat(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    stream: Stream,
    custom: Any = None,
    what: str = "all-gather",
    record: CollectiveRecord | None = None,
    check: FingerprintCheck | None = None,
) -> PendingCollective:
    """Gather every rank's equal-sized 1-D ``input`` into ``output``, rank-major.
    ``custom``: a callable ``(output, input, group, async_op)`` to use instead (torch's
    ``AllGather``). ``what``: the collective's name in errors. ``record``: its descriptor
    for a schedule recorder ([Note: schedule records] in ``_comm_records``)."""
    call = custom or getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    if record is not None:
        stamp(record, "all_gather", output.numel() * output.element_size())
    return _issue(stream, what, record, check, call, output, input, group=group)


def reduce_scatter_flat(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    stream: Stream,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    custom: Any = None,
    what: str = "reduce-scatter",
    record: CollectiveRecord | None = None,
    check: FingerprintCheck | None = None,
) -> PendingCollective:
    """Sum ``input`` (rank-major, ``world_size * output.numel()``) over ranks, scattering
    chunk ``rank`` into ``output``. ``custom``: a callable ``(output, input, group, op,
    async_op)`` to use instead (torch's ``ReduceScatter``). ``what``: its name in errors;
    ``record``: its descriptor for a schedule recorder."""
    call = custom or getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    if record is not None:
        stamp(record, "reduce_scatter", input.numel() * input.element_size())
    return _issue(stream, what, record, check, call, output, input, op=op, group=group)


def all_to_all_flat(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    stream: Stream,
    what: str = "all-to-all",
    record: CollectiveRecord | None = None,
    check: FingerprintCheck | None = None,
) -> PendingCollective:
    """Send chunk ``r`` of ``input`` (rank-major, ``world_size`` equal chunks) to rank
    ``r``, receiving every rank's chunk for this rank into ``output`` in group rank order
    (the exchange a reduce-scatter does before it sums; see ``_reduction``). ``what``:
    its name in errors; ``record``: its descriptor for a schedule recorder."""
    if record is not None:
        stamp(record, "all_to_all", input.numel() * input.element_size())
    return _issue(stream, what, record, check, dist.all_to_all_single, output, input, group=group)


def all_reduce_flat(
    tensor: torch.Tensor,
    group: dist.ProcessGroup,
    stream: Stream,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    what: str = "all-reduce",
    record: CollectiveRecord | None = None,
    check: FingerprintCheck | None = None,
) -> PendingCollective:
    """Sum ``tensor`` in place over ``group`` (HSDP's cross-replica reduction). ``record``:
    its descriptor for a schedule recorder."""
    if record is not None:
        stamp(record, "all_reduce", tensor.numel() * tensor.element_size())
    return _issue(stream, what, record, check, dist.all_reduce, tensor, op=op, group=group)


def min_and_max(value: int, group: dist.ProcessGroup, device: torch.device) -> tuple[int, int]:
    """The smallest and largest of every rank's ``value`` (blocking: one small all-reduce,
    for checks that turn a mismatch, which would hang a collective, into an error).

    The all-reduce is a consistency check, not part of FSDP's communication, so it is
    issued on the group's backend directly, as torch's own collective checks
    (``TORCH_DISTRIBUTED_DEBUG=DETAIL``) are: it bypasses the dispatcher and
    ``torch.distributed``'s functions, so ``CommDebugMode`` and patched collectives count
    what torch's ``fully_shard`` issues. A group without such a backend (a threaded test
    group) falls back to ``dist.all_reduce``."""
    if torch._C._are_functorch_transforms_active():
        # Lazy init inside ``torch.func.jvp``: the backend needs a plain tensor.
        with torch._C._DisableFuncTorch():
            return _min_and_max(value, group, device)
    return _min_and_max(value, group, device)


def _min_and_max(value: int, group: dist.ProcessGroup, device: torch.device) -> tuple[int, int]:
    both = torch.tensor([value, -value], dtype=torch.int64, device=device)
    try:
        backend: Any = group._get_backend(device)
        options: Any = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        work = backend.allreduce([both], options)
    except (RuntimeError, ValueError, AttributeError, TypeError, NotImplementedError):
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    else:
        work.wait()
    high, neg_low = both.tolist()
    return -neg_low, high


def text_digest(text: str) -> int:
    """A 62-bit digest of ``text``: fits an int64 with room for its negation, as
    ``min_and_max`` needs."""
    raw = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little") >> 2


def descriptions_if_different(
    description: str, group: dist.ProcessGroup, device: torch.device
) -> list[str] | None:
    """``None`` when every rank of ``group`` passed the same ``description``; otherwise
    every rank's, in group rank order. Blocking: one ``min_and_max`` of a digest, and the
    descriptions gathered only when the digests differ. Every rank gets the same answer,
    so all can raise together and none is left waiting in a collective."""
    digest = text_digest(description)
    low, high = min_and_max(digest, group, device)
    if low == high:
        return None
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, description, group=group)
    return everyone


def backend_allocates(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether ``group``'s backend on ``device`` offers its own allocator for communication
    buffers (NCCL's, which can then use zero-copy transfers over NVLink SHARP or
    InfiniBand); gloo does not."""
    try:
        backend = group._get_backend(device)
    except (RuntimeError, ValueError, AttributeError):
        return False
    supports = getattr(backend, "supports_tensor_alloc", None)
    return bool(supports is not None and supports(device))


def backend_tensor(
    group: dist.ProcessGroup, size: Sequence[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A 1-D buffer of ``prod(size)`` elements from ``group``'s backend allocator."""
    backend = group._get_backend(device)
    return backend.allocate_tensor(math.prod(size), dtype=dtype, device=device)


class _BackendAllocated:
    """torch's ``allocate`` half of its ``AllGather`` / ``ReduceScatter`` protocol, with
    buffers from the process group's backend
    (``set_allocate_memory_from_process_group_for_comm``)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return backend_tensor(self.group, size, dtype, device)


class BackendAllocatedAllGather(_BackendAllocated):
    """An all-gather whose output buffer comes from the backend."""

    def __call__(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> Any:
        call = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return call(output, input, group=group, async_op=async_op)


class BackendAllocatedReduceScatter(_BackendAllocated):
    """A reduce-scatter whose input and output buffers come from the backend."""

    def __call__(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        call = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return call(output, input, op=op, group=group, async_op=async_op)
