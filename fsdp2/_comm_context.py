"""State shared by every parameter group of one FSDP tree: streams, in-flight reductions.

One ``CommContext`` per root (built at its lazy init) lets groups see each other's
reduce-scatters: a group's gradient copy-in first finishes the older reductions, which is
what bounds the reduce-scatter input memory to ``max_reduces_in_flight`` buffers.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from fsdp2._collectives import PendingCollective
from fsdp2._host_buffers import HostBufferPool
from fsdp2._stream_utils import CommStreams, Event, record_event


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
