"""State shared by every parameter group of one FSDP tree: streams, in-flight reductions.

One ``CommContext`` per root (built at its lazy init) lets groups see each other's
reduce-scatters: a group's gradient copy-in first finishes the older reductions, which is
what bounds the reduce-scatter input memory to ``max_reduces_in_flight`` buffers.

[Note: ranks that run different paths]
The collectives of a process group pair up by issue order: a rank's n-th collective
meets the n-th of every other rank. A rank whose forward skips a sharded module (an
expert that got no tokens, a layer dropped by a per-rank random draw), or whose loss
leaves a module out of backward, issues a different sequence from there on. Each
collective then meets another module's: messages of the same size silently mix two
modules' parameters or gradients, others make gloo abort and NCCL hang, and at the end
of the step one rank waits for a collective no other rank issues. torch's
``fully_shard`` behaves the same.

Under torch's debug switch ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (read when the context is
built: at the root's first forward, or by ``share_comm_ctx``), every rank describes each all-gather, reduce-scatter and all-reduce just
before issuing it ("all-gather of layers.2 (TransformerBlock), 4096 elements") and
reduces a digest of the description (``descriptions_if_different``: one blocking
all-reduce on the backend). The checks pair up with each other up to the first
difference, which is where they catch it: every rank raises a ``RuntimeError`` that names
what each rank was about to do, before the mismatched collective is issued. The check
costs a blocking round trip per collective and ends the overlap of communication with
compute, so it is off by default: the divergence checks, on by default, find the same
differences in the collectives' own messages ([Note: in-band fingerprints] in
``_fingerprints``), at the collective that paired up wrongly; this check is their strict
variant, which names the difference before anything is issued.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable
from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist

from fsdp2._collectives import PendingCollective, descriptions_if_different, wait
from fsdp2._comm_records import CollectiveRecord, Phase, ScheduleRecorder
from fsdp2._divergence import (
    Fingerprint,
    Issued,
    any_failed,
    checks_enabled,
    failure_of,
    forget_failure,
    remember,
    stage_of,
)
from fsdp2._fingerprints import discard_pending, poll
from fsdp2._host_buffers import HostBufferPool
from fsdp2._stream_utils import CommStreams, Event, record_event, wait_stream

# Every context alive, for ``finish_all_reductions`` (an optimizer step must see them all).
_LIVE: weakref.WeakSet[CommContext] = weakref.WeakSet()


class FinishesReduce(Protocol):
    """What a reduction in flight needs of its group: a way to finish it."""

    def finish_reduce(self, in_flight: ReduceInFlight) -> None: ...


class ReduceInFlight(NamedTuple):
    group: FinishesReduce
    # Kept alive until the collective is done, where only we can keep it alive (a stream);
    # see [Note: reduce-scatter input lifetime] in ``_grad_reduce``.
    input: torch.Tensor | None
    output: torch.Tensor  # 1-D, the reduced flat gradient shard
    pending: PendingCollective
    has_grad: list[bool]  # per reduced parameter: got a local gradient
    positions: tuple[int, ...]  # where the reduced parameters sit in the group's params
    averaged: bool  # reduced with ReduceOp.AVG (else summed, divided when finished)
    # Set when the ranks' chunks were exchanged by an all-to-all (``output`` holds all of
    # them) and are still to be summed in this dtype; None: ``output`` is reduced.
    accumulate_dtype: torch.dtype | None = None
    # Elements of the fingerprint block at the end of each chunk (0: none); see [Note:
    # in-band fingerprints] in ``_fingerprints``.
    block: int = 0


class Stamp(NamedTuple):
    """What ``CommContext.before_collective`` gives a collective about to be issued."""

    record: CollectiveRecord | None  # its descriptor for a schedule recorder, if attached
    # What it is, with its fingerprint, while divergence checks are on ([Note: in-band
    # fingerprints] in ``_fingerprints``); also in this rank's ring buffer.
    issued: Issued | None


class GatheringGroup(Protocol):
    """What ``order_step_after_all_gathers`` needs of a group (``ParamGroup``)."""

    def sharded_params(self) -> Iterable[torch.Tensor]: ...


class CommContext:
    """Communication state shared by every group of one FSDP tree.

    ``all_gathers_after``: the event every all-gather waits for when issued (see
    ``order_all_gathers_after_compute``). ``reduces``: reduce-scatters not yet finished, at most
    ``max_reduces_in_flight`` (torch's ``set_reduce_scatter_max_input_buffers``, default 1:
    a group's gradient copy-in waits for the previous group's reduce-scatter, so one input
    buffer is alive at a time).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.streams = CommStreams(device)
        self.all_gathers_after: Event = None
        self.reduces: list[ReduceInFlight] = []
        # Groups whose all-gather was issued and not yet waited for, with it; see
        # ``order_step_after_all_gathers``.
        self.all_gathers_in_flight: dict[GatheringGroup, PendingCollective] = {}
        self.max_reduces_in_flight = 1
        self.host_buffers = HostBufferPool(device)  # see [Note: host buffer pool]
        # See [Note: ranks that run different paths].
        self.check_collectives = collective_checks_requested()
        # A schedule recorder (``fsdp2.trace``); see [Note: schedule records] in
        # ``_comm_records``. The step and the sequence number of the next collective are
        # counted always: the records and the divergence checks' fingerprints use them.
        self.recorder: ScheduleRecorder | None = None
        self.step = 0
        self.sequence = 0
        self._step_reduced = False
        # The groups of the trees on this context, by index: a fingerprint names its
        # group by its index ([Note: in-band fingerprints] in ``_fingerprints``).
        self.groups: list[object] = []
        self._group_index: dict[int, int] = {}
        _LIVE.add(self)

    def register_groups(self, groups: Iterable[object]) -> None:
        """Number ``groups`` (a tree's, in its states' order, at its lazy init: the same
        on every rank, which built the same model)."""
        for group in groups:
            if id(group) not in self._group_index:
                self._group_index[id(group)] = len(self.groups)
                self.groups.append(group)

    def before_collective(
        self,
        what: str,
        numel: int,
        process_group: dist.ProcessGroup,
        group: object,
        phase: Phase = Phase.REDUCE,
    ) -> Stamp:
        """Called by ``group`` right before it issues a collective (``what``, of ``numel``
        elements, on ``process_group``): check that every rank issues the same one, when
        asked to ([Note: ranks that run different paths]); return its descriptor for a
        recorder ([Note: schedule records] in ``_comm_records``) and, with divergence
        checks on, what it is and its fingerprint (remembered in the ring buffer, [Note:
        named timeouts] in ``_divergence``)."""
        if self.check_collectives:
            self.check_same_collective(what, numel, process_group)
        seq = self.sequence
        self.sequence = seq + 1
        recorder = self.recorder
        record = (
            None if recorder is None else CollectiveRecord(recorder, group, phase, seq, self.step)
        )
        if not checks_enabled():
            return Stamp(record, None)
        fingerprint = Fingerprint(self._group_index.get(id(group), -1), stage_of(phase), seq)
        issued = Issued(fingerprint, what, self.step, time.time(), process_group, self)
        remember(issued)
        return Stamp(record, issued)

    def root_forward_begins(self, root: object) -> None:
        """A root of this context starts a forward: the first one after a step whose
        gradients were reduced starts the next step."""
        if self._step_reduced:
            self.step += 1
            self._step_reduced = False
        if self.recorder is not None:
            self.recorder.root_forward_begins(root, self.step)

    @property
    def upcoming_step(self) -> int:
        """The step the next root forward belongs to: this one, or the next once this
        one's gradients were reduced."""
        return self.step + int(self._step_reduced)

    def abandon_step(self) -> None:
        """``reset_iter_state`` dropped a failed step: the next root forward starts a new
        one, and the fingerprints still on their way are not checked."""
        self._step_reduced = True
        discard_pending()
        forget_failure(self)
        if self.recorder is not None:
            self.recorder.reset()

    def drop_if_failed(self) -> str | None:
        """If a report marked this context failed, forget the collectives it has in flight
        instead of waiting for them, and return the report's headline; see [Note: a failed
        step's collectives in flight] in ``_divergence``."""
        headline = failure_of(self)
        if headline is not None:
            self.reduces.clear()
            self.all_gathers_in_flight.clear()
        return headline

    def order_all_gathers_after_compute(self) -> None:
        """Make every later all-gather wait for the work queued on the compute stream so
        far. Called after the compute stream's last use of memory the all-gather stream
        allocated and we released, which that stream may then reuse (see [Note: buffer
        lifetime across streams]), and after a write-back of in-place changes into the
        shards, which the next all-gather reads."""
        self.all_gathers_after = record_event(self.streams.compute())

    def check_same_collective(self, what: str, numel: int, group: dist.ProcessGroup) -> None:
        """With ``check_collectives``, raise a ``RuntimeError`` on every rank of ``group``
        unless all of them are about to issue the same collective (``what``, of ``numel``
        elements); see [Note: ranks that run different paths]."""
        if not self.check_collectives:
            return
        separator = ", "
        description = f"{what}{separator}{numel} elements"
        everyone = descriptions_if_different(description, group, self.device)
        if everyone is None:
            return
        by_description: dict[str, list[int]] = {}
        for rank, theirs in enumerate(everyone):
            by_description.setdefault(theirs, []).append(dist.get_global_rank(group, rank))
        listed = "; ".join(
            f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {theirs}"
            for theirs, ranks in by_description.items()
        )
        if len({theirs.rpartition(separator)[0] for theirs in everyone}) == 1:
            cause = (
                "The same group's message differs in size: its parameters' requires_grad "
                "was changed on some ranks only (a reduce-scatter carries the trainable "
                "parameters). Freeze and unfreeze on every rank."
            )
        else:
            cause = (
                "They ran different paths through the sharded modules (a module skipped, or "
                "its output left out of the loss, on some ranks only). Run every sharded "
                "module's forward and backward on every rank (e.g. an expert on an empty "
                "batch, or with its output times zero added to the loss), or shard a module "
                "that some ranks skip together with a parent that always runs."
            )
        raise RuntimeError(
            f"fully_shard: the ranks of a process group are about to issue different "
            f"collectives ({listed}). Without this check (TORCH_DISTRIBUTED_DEBUG=DETAIL) "
            f"the collectives would pair up wrongly, mixing data or hanging. {cause}"
        )

    def finish_reduces(self, keep: int = 0) -> None:
        """Finish reduce-scatters in issue order until at most ``keep`` remain in flight
        (none to finish after a failed step's report: [Note: a failed step's collectives in
        flight] in ``_divergence``)."""
        if any_failed() and self.drop_if_failed() is not None:
            return
        while len(self.reduces) > keep:
            in_flight = self.reduces.pop(0)
            in_flight.group.finish_reduce(in_flight)
            record = in_flight.pending.record
            if record is not None:
                record.recorder.consumed(record)

    def finish_all(self) -> None:
        """Finish every reduction in flight and order the compute stream after them: the
        end of the last backward, and before an optimizer step."""
        recorder = self.recorder
        self._step_reduced = self._step_reduced or bool(self.reduces)
        if recorder is not None:
            recorder.final_wait_begins()
        self.finish_reduces(keep=0)
        streams = self.streams
        wait_stream(streams.compute(), streams.reduce_scatter)
        poll()  # fingerprints that have arrived (accelerators): [Note: in-band fingerprints]
        if recorder is not None:
            recorder.final_wait_ends()


def finish_all_reductions() -> None:
    """Before an optimizer step: finish the reductions that backwards under
    ``set_is_last_backward(False)`` left in flight, whose gradients are assigned only
    when finished (the step would otherwise see ``grad None`` or last step's gradients)."""
    for context in list(_LIVE):
        if context.reduces:
            context.finish_all()


def order_step_after_all_gathers(params: Iterable[torch.Tensor]) -> None:
    """Before an optimizer step over ``params``: an all-gather still in flight that reads
    some of their shards (an ``unshard(async_op=True)`` that no forward or ``wait()``
    consumed, e.g. of a module the step's forward skipped) must be done reading before
    the step writes them. Wait for it: the compute stream waits for its event, or on the
    CPU for the backend's work. What it gathered is stale after the step and is gathered
    again before use ([Note: stale unsharded parameters]). Nothing to do, and no
    per-parameter work, when no all-gather is in flight (the usual step, and an
    optimizer stepping inside backward while prefetches of other groups run)."""
    if any_failed():  # [Note: a failed step's collectives in flight] in ``_divergence``
        for context in list(_LIVE):
            context.drop_if_failed()
    contexts = [context for context in list(_LIVE) if context.all_gathers_in_flight]
    if not contexts:
        return
    stepped = {id(p) for p in params}
    for context in contexts:
        for group, pending in list(context.all_gathers_in_flight.items()):
            if any(id(shard) in stepped for shard in group.sharded_params()):
                wait(pending, context.streams.compute())


def refuse_step_over_failed(param_groups: list[dict]) -> None:
    """Before an optimizer step over ``param_groups``: raise if some of its parameters
    belong to a context whose step failed and was not reset, since the reductions that
    context dropped left their gradients missing or partial; see [Note: a failed step's
    collectives in flight] in ``_divergence``. Free unless some context failed."""
    if not any_failed():
        return
    stepped = {id(p) for group in param_groups for p in group["params"]}
    for context in list(_LIVE):
        headline = failure_of(context)
        if headline is None:
            continue
        hit = [
            str(getattr(group, "where", group))
            for group in context.groups
            if any(id(shard) in stepped for shard in group.sharded_params())  # type: ignore[attr-defined]
        ]
        if hit:
            raise RuntimeError(
                f"fully_shard: this optimizer step would update parameters of "
                f"{', '.join(hit[:3])}{' and others' if len(hit) > 3 else ''} after their "
                f"model's step failed ({headline.splitlines()[0]}). The collectives that "
                f"step left in flight were dropped, so their gradients are missing or "
                f"partial. Call reset_iter_state() on the model's root and zero_grad() "
                f"before the next step, on a healthy process group (after a divergence, "
                f"end the job or recreate the process groups: their collectives are out of "
                f"step)."
            )


def collective_checks_requested() -> bool:
    """Whether torch's distributed debug level is ``DETAIL``
    (``TORCH_DISTRIBUTED_DEBUG=DETAIL``, or ``dist.set_debug_level``)."""
    if not dist.is_available():
        return False
    return dist.get_debug_level() == dist.DebugLevel.DETAIL
