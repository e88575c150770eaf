"""What the runtime tells a schedule recorder: one descriptor per collective, and the calls.

[Note: schedule records]
fsdp2 issues every collective itself, so it can say what each one is in FSDP's own terms:
which group, which phase asked for it, whether it was a prefetch. A tool above the runtime
(``fsdp2.trace``, and any later one) learns this through
one seam: an optional recorder on each tree's ``CommContext`` (``recorder``; None unless a
tool attached one). With none attached, each hook pays one attribute check and each
collective one ``is None``; nothing is created. With one attached:

- just before a group issues a collective, ``CommContext.before_collective`` (which
  also runs the cross-rank check of [Note: ranks that run different paths]) makes its
  ``CollectiveRecord``: the group, the phase (forward, backward, an explicit
  ``unshard()``; prefetched or not; ``REDUCE`` for every collective of a gradient
  reduction), the context's step and sequence number (counted always, since the
  divergence checks' fingerprints carry them too; one context per tree, or per set of
  trees joined by ``share_comm_ctx``; the trace numbers steps from the first it sees). The collectives layer stamps the kind (the torch collective it
  calls: ``all_gather``, ``reduce_scatter``, ``all_reduce``, ``all_to_all``) and the
  bytes, and calls the recorder right before and after issuing it (with its stream and,
  on the CPU, its ``Work``) and before and after every wait on it (with the waiting
  stream). The runtime calls ``consumed`` once the result has been used (an all-gather's
  copy-out done, a reduction's gradients assigned).
- the hooks call it where compute windows of a state begin and end (forward: after its
  pre-forward, before its post-forward; backward: after its pre-backward, before it
  reduces), where a root starts a forward (``root_forward_begins``, with the step, which
  advances at the first root forward after a step whose gradients were reduced), around
  the final wait for reductions in flight (the end of the last backward, or before an
  optimizer step), and when ``reset_iter_state`` drops a failed step.
- ``tree_observers`` (in ``_backward_hooks``) are called with every tree at the end of its
  lazy init, so a tool active before the first forward can attach to the tree built then.

The recorder decides what to measure (host clocks, device events on the given streams);
the runtime never reads anything back from it.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Protocol

Stream = Any  # a device stream, or None on the CPU (see ``_stream_utils``)


class Phase(Enum):
    """Why a collective was issued (an all-gather for its own group's forward or
    backward, or ahead of it, or for ``unshard()``), or which compute a window holds."""

    FORWARD = "forward"
    FORWARD_PREFETCH = "forward, prefetched"
    BACKWARD = "backward"
    BACKWARD_PREFETCH = "backward, prefetched"
    UNSHARD = "unshard"  # ``FSDPModule.unshard()``, called by the user
    # Every collective of a gradient reduction (reduce-scatter, all-to-all, HSDP's
    # all-reduce or all-to-all + all-gather), in backward or before an optimizer step.
    REDUCE = "reduction"

    @property
    def prefetch(self) -> bool:
        return self in (Phase.FORWARD_PREFETCH, Phase.BACKWARD_PREFETCH)

    @property
    def stage(self) -> Phase:
        """FORWARD, BACKWARD or UNSHARD: the phase without the prefetch."""
        if self is Phase.FORWARD_PREFETCH:
            return Phase.FORWARD
        if self is Phase.BACKWARD_PREFETCH:
            return Phase.BACKWARD
        return self


class CollectiveRecord:
    """One collective fsdp2 issued for a group while a recorder was attached.

    ``kind`` and ``nbytes`` are stamped by ``_collectives`` at issue (the payload: an
    all-gather's output, a reduce-scatter's input, an all-reduce's tensor); ``data`` is
    the recorder's own (timestamps, events)."""

    __slots__ = ("data", "group", "kind", "nbytes", "phase", "recorder", "seq", "step")

    def __init__(
        self, recorder: ScheduleRecorder, group: Any, phase: Phase, seq: int, step: int
    ) -> None:
        self.recorder = recorder
        self.group = group  # the ParamGroup: ``path``, ``label``, ``where``
        self.phase = phase
        self.seq = seq
        self.step = step
        self.kind = ""
        self.nbytes = 0
        self.data: Any = None

    @property
    def prefetch(self) -> bool:
        return self.phase.prefetch

    def __repr__(self) -> str:
        return (
            f"CollectiveRecord(#{self.seq} step {self.step}: {self.kind or '?'} of "
            f"{getattr(self.group, 'where', self.group)}, {self.phase.value})"
        )


class ScheduleRecorder(Protocol):
    """What the runtime calls on an attached recorder; see [Note: schedule records]."""

    def issuing(self, record: CollectiveRecord, stream: Stream) -> None: ...

    def issued(self, record: CollectiveRecord, stream: Stream, work: Any) -> None: ...

    def waiting(self, record: CollectiveRecord, consumer: Stream) -> None: ...

    def waited(self, record: CollectiveRecord, consumer: Stream) -> None: ...

    def consumed(self, record: CollectiveRecord) -> None: ...

    def compute_begins(self, state: Any, phase: Phase) -> None: ...

    def compute_ends(self, state: Any, phase: Phase) -> None: ...

    def root_forward_begins(self, root: Any, step: int) -> None: ...

    def final_wait_begins(self) -> None: ...

    def final_wait_ends(self) -> None: ...

    def reset(self) -> None: ...


def stamp(record: CollectiveRecord, kind: str, nbytes: int) -> None:
    """Set the kind and payload of ``record`` (the collectives layer, at issue)."""
    record.kind = kind
    record.nbytes = nbytes
