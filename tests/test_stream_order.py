"""Stream ordering on accelerators, checked on the CPU.

On the CPU every stream is ``None`` and ordering comes from waiting on gloo's ``Work``, so a
missing stream wait cannot show up as a wrong number here. These tests therefore give the
tree named stand-in streams and record every stream call fsdp2 makes, then check the order:
an all-gather that reads memory written on the compute stream must be preceded by a wait on
the compute stream (or on an event recorded there after the write).

If one fails, look at the recorded log in the assertion message: it lists the stream calls
in issue order, with the groups' all-gathers among them.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from _launcher import run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
from fsdp2 import _all_gather, _comm_context, _grad_reduce, _param_group, _state


class _Stream:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


class _Event:
    def __init__(self, stream: _Stream, index: int) -> None:
        self.stream, self.index = stream, index

    def __repr__(self) -> str:
        return f"event{self.index}@{self.stream}"


class _Streams:
    """Stands in for ``CommStreams``: named streams instead of ``None``."""

    def __init__(self) -> None:
        self.all_gather = _Stream("all_gather")
        self.reduce_scatter = _Stream("reduce_scatter")
        self.all_reduce = _Stream("all_reduce")
        self._compute = _Stream("compute")

    def compute(self) -> _Stream:
        return self._compute


@contextlib.contextmanager
def _recording(log: list[tuple]) -> Any:
    """Patch the stream helpers and collectives ``_param_group``, ``_all_gather``,
    ``_grad_reduce``, ``_comm_context`` and ``_state`` call so they log what they are asked
    and run the real collectives stream-free."""
    events = [0]

    def record_event(stream: Any) -> Any:
        if stream is None:
            return None
        events[0] += 1
        event = _Event(stream, events[0])
        log.append(("record", stream.name, event.index))
        return event

    def wait_event(stream: Any, event: Any) -> None:
        if stream is not None and event is not None:
            log.append(("wait_event", stream.name, event.stream.name, event.index))

    def wait_stream(waiter: Any, producer: Any) -> None:
        if waiter is not None and producer is not None and waiter is not producer:
            log.append(("wait_stream", waiter.name, producer.name))

    real_ag, real_rs = _all_gather.all_gather_flat, _grad_reduce.reduce_scatter_flat

    def all_gather_flat(
        output, input, group, stream, custom=None, what="all-gather", record=None, check=None
    ):
        log.append(("all_gather", stream.name, dist.get_world_size(group)))
        return real_ag(output, input, group, None, custom, what, record, check)

    def reduce_scatter_flat(
        output,
        input,
        group,
        stream,
        op=dist.ReduceOp.SUM,
        custom=None,
        what="reduce-scatter",
        record=None,
        check=None,
    ):
        return real_rs(output, input, group, None, op, custom, what, record, check)

    real_unshard, real_reshard = _param_group.ParamGroup.unshard, _param_group.ParamGroup.reshard

    def unshard(self, **kwargs: Any) -> None:
        log.append(("unshard", id(self)))
        real_unshard(self, **kwargs)

    def reshard(self, **kwargs: Any) -> None:
        log.append(("reshard", id(self), kwargs.get("post_forward", False)))
        real_reshard(self, **kwargs)

    patches = {
        (_param_group.ParamGroup, "unshard"): unshard,
        (_param_group.ParamGroup, "reshard"): reshard,
        (_param_group, "record_event"): record_event,
        (_all_gather, "record_event"): record_event,
        (_all_gather, "wait_event"): wait_event,
        (_all_gather, "wait_stream"): wait_stream,
        (_all_gather, "use_stream"): lambda stream: contextlib.nullcontext(),
        (_all_gather, "all_gather_flat"): all_gather_flat,
        (_grad_reduce, "record_event"): record_event,
        (_grad_reduce, "wait_stream"): wait_stream,
        (_grad_reduce, "use_stream"): lambda stream: contextlib.nullcontext(),
        (_grad_reduce, "reduce_scatter_flat"): reduce_scatter_flat,
        (_comm_context, "record_event"): record_event,
        (_comm_context, "wait_stream"): wait_stream,
        (_state, "wait_event"): wait_event,
        (_state, "wait_stream"): wait_stream,
    }
    saved = {key: getattr(*key) for key in patches}
    try:
        for (module, name), value in patches.items():
            setattr(module, name, value)
        yield
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)


def _model(reshard_after_forward: bool | int) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for index in (0, 2, 4):
        fsdp2.fully_shard(model[index], mesh=mesh, reshard_after_forward=reshard_after_forward)
    fsdp2.fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


def _use_named_streams(model: nn.Module) -> None:
    model._fsdp_state.tree.comm.streams = _Streams()


def _explicit_unshard_after_step() -> list[tuple]:
    model = _model(True)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    model(x).sum().backward()  # lazy init
    _use_named_streams(model)
    log: list[tuple] = []
    with _recording(log):
        optim.step()  # writes the shards (on the compute stream, on an accelerator)
        log.append(("user", "unshard"))
        model[2].unshard()
    return log


def test_explicit_unshard_waits_for_the_optimizer() -> None:
    for log in run_ranks(_explicit_unshard_after_step, 2):
        start = log.index(("user", "unshard"))
        gather = log.index(("all_gather", "all_gather", 2), start)
        assert ("wait_stream", "all_gather", "compute") in log[start:gather], log


def _int_reshard_backward() -> list[tuple]:
    model = _model(2)  # after forward, keep shards over 2 of the 4 ranks
    x = torch.randn(4, 8)
    model(x).sum().backward()  # lazy init
    _use_named_streams(model)
    log: list[tuple] = []
    with _recording(log):
        model(x).sum().backward()
    return log


def test_int_reshard_backward_all_gather_waits_for_the_post_forward_copy() -> None:
    for log in run_ranks(_int_reshard_backward, 4):
        # A backward all-gather within the 2-rank post-forward group reads the shard that
        # the compute stream copied at the group's post-forward reshard: before it, the
        # all-gather stream must wait for an event recorded on the compute stream since.
        checked = 0
        for i, entry in enumerate(log):
            if entry != ("all_gather", "all_gather", 2):
                continue
            group = next(e[1] for e in reversed(log[:i]) if e[0] == "unshard")
            start = max(j for j, e in enumerate(log[:i]) if e == ("reshard", group, True))
            since = {e[2] for e in log[start:i] if e[:2] == ("record", "compute")}
            waited = {
                e[3] for e in log[start:i] if e[:3] == ("wait_event", "all_gather", "compute")
            }
            assert waited & since, (group, log)
            checked += 1
        assert checked == 3, log
