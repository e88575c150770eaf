"""See the schedule: a per-step, per-group trace of fsdp2's communication and compute.

::

    with fsdp2.trace_schedule(model) as trace:
        for batch in batches:
            model(batch).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    print(trace.summary())                     # table per group and phase; headline first
    trace.save_chrome_trace("schedule.json")   # Perfetto / chrome://tracing, every rank
    trace.plot("schedule.png")                 # one step across ranks (fsdp2[plot])

The trace sits above the runtime: it attaches a recorder to each traced tree's
``CommContext`` ([Note: schedule records] in ``_comm_records``) and reads nothing else
while steps run. See docs/trace.md for how to read its outputs.

[Note: what the trace measures]
For every collective fsdp2 issues for a group (all-gathers in forward and backward,
prefetched or not, and for ``unshard()``; reduce-scatters; HSDP all-reduces; any other
kind a reduction issues through ``_collectives``):

- issue: when fsdp2 called the collective (host clock);
- communication: when it ran. On an accelerator, between two timing events recorded on
  the collective's own stream right before and after it (the stream reaches the first
  once the collective's inputs are ready; the second completes with the collective). On
  the CPU, from the issue to the completion of the backend's work: gloo completes works
  on its own thread, and the trace reads the time in a callback of the work's future;
  a work that offers no future (gloo's reduce-scatter) counts as complete when fsdp2 sees
  it complete (``is_completed()`` when its wait begins) or else at the end of its wait,
  so its communication time is an upper bound. Both include time spent queued behind
  earlier collectives of the same process group.
- exposed: how long compute waited for it: on an accelerator, how long the waiting
  stream stalled (events on it before and after its wait for the collective's event);
  on the CPU, how long the training thread blocked in ``Work.wait()``.
- copy-out: from the end of the wait until the result was used (an all-gather's copy
  into the unsharded parameters; a reduction's division and assignment to ``.grad``).

Compute windows per state: forward from the end of its pre-forward to the start of its
post-forward; backward from the end of its pre-backward to the start of its reduction.
The root's windows hold the others'. Optimizer steps are timed around
``optimizer.step()`` (after fsdp2's own pre-hook, which finishes the reductions still in
flight: that wait is recorded as a final wait). The final wait is the end of the last
backward (or the start of an optimizer step) waiting for every reduction in flight; the
waits inside it are those reductions' exposed times, and are counted there.

A step starts at a root forward and ends with the next step's first root forward; a root
forward starts a new step once the previous one reduced gradients, so the microbatches
of gradient accumulation and the optimizer step are one step. Collectives issued between
the optimizer step and the next forward (an ``unshard()`` ahead of it) count in the
earlier step.

On an accelerator nothing is read back while steps run: the events are read when a later
step starts if the device has passed them (``Event.query()``), or when the trace ends or
an output is asked for (then synchronized). The only synchronization on the way is one
event when the recorder attaches (at trace start, or at the tree's lazy init), which ties
the device's clock to the host's. With no trace active, the runtime pays one attribute
check per hook and per collective.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from fsdp2 import _stream_utils
from fsdp2._backward_hooks import TreeContext, tree_observers
from fsdp2._comm_records import CollectiveRecord, Phase
from fsdp2._state import fsdp_state_of
from fsdp2._trace_views import chrome_trace, plot_step, summarize_rank, summary_text

_ACTIVE: list[ScheduleTrace] = []  # traces whose context is open


# -- clocks ----------------------------------------------------------------------------------
class _HostClock:
    """CPU trees: host timestamps (``time.perf_counter_ns``), read at once."""

    timing = "host clock"

    def stamp(self, stream: Any) -> int:
        return time.perf_counter_ns()

    def resolve(self, token: Any, block: bool) -> Any:
        return token


class _DeviceClock:
    """Accelerator trees: timing events recorded on the given streams, read later.

    One event is synchronized when the clock is made, to tie the device's time to the
    host's; every other event is read once the device has passed it (``query()``), or,
    with ``block``, after ``synchronize()``."""

    timing = "device events"

    def __init__(self, device: torch.device, stream: Any) -> None:
        module = _stream_utils.device_module(device)
        if module is None:
            raise AssertionError(f"no device module for {device}")
        self._new_event = module.Event
        self.anchor = self._new_event(enable_timing=True)
        self.anchor.record(stream)
        self.anchor.synchronize()
        self.anchor_ns = time.perf_counter_ns()

    def stamp(self, stream: Any) -> Any:
        event = self._new_event(enable_timing=True)
        event.record(stream)
        return event

    def resolve(self, token: Any, block: bool) -> Any:
        """Nanoseconds on the host clock, or the event itself while the device has not
        reached it (and ``block`` is off)."""
        if token is None or isinstance(token, (int, float)):
            return token
        if block:
            token.synchronize()
        elif not token.query():
            return token
        return self.anchor_ns + self.anchor.elapsed_time(token) * 1e6


# -- what is recorded ------------------------------------------------------------------------
@dataclass(eq=False, slots=True)
class _Collective:
    seq: int
    kind: str
    group: str
    phase: Phase
    nbytes: int
    issue_ns: int
    order: int  # among this recorder's issues and window ends: the host-side sequence
    comm_begin: Any = None  # token: host ns, or an event
    comm_end: Any = None
    completion: str = ""  # how the end of the communication was learned
    work: Any = None  # the CPU backend's work, until waited for
    callback_ns: int | None = None  # set on the backend's thread
    polled_ns: int | None = None
    waits: list[list[Any]] = field(default_factory=list)  # [begin, end] tokens
    in_final_wait: bool = False
    side_waited: bool = False  # a side stream waited for it (not compute)
    consumed: Any = None


@dataclass(eq=False, slots=True)
class _Window:
    kind: str  # "forward", "backward", "optimizer", "final wait"
    name: str
    begin: Any
    begin_order: int
    root: bool = False
    end: Any = None
    end_order: int = -1
    aborted: bool = False  # closed by reset_iter_state, or left open by the step


@dataclass(eq=False, slots=True)
class _Step:
    index: int
    begin: Any
    collectives: list[_Collective] = field(default_factory=list)
    windows: list[_Window] = field(default_factory=list)
    aborted: bool = False
    resolved: bool = False


def _completed(data: _Collective, _future: Any) -> None:
    """Future callback, on the backend's thread: the work is complete."""
    data.callback_ns = time.perf_counter_ns()


class _Recorder:
    """The recorder on one ``CommContext``: records the collectives and windows of the
    traced trees that communicate through it (``ScheduleRecorder``)."""

    def __init__(self, trace: ScheduleTrace, comm: Any) -> None:
        self.trace = trace
        self.comm = comm
        self.device = comm.device.type
        streams = comm.streams
        # A CPU tree keeps host clocks even with side streams: those are the stream
        # checker's stand-ins, and a tree made under it may outlive it (tests).
        if streams.all_gather is None or _stream_utils.device_module(comm.device) is None:
            self.clock: _HostClock | _DeviceClock = _HostClock()
        else:
            self.clock = _DeviceClock(comm.device, streams.compute())
        self.trees: list[TreeContext] = []
        self.group_names: dict[int, str] = {}  # id -> suffix after the group's path
        self.states: set[int] = set()  # ids of the traced trees' states
        self.steps: dict[int, _Step] = {}
        self.open: dict[tuple[int, Phase], _Window] = {}
        self.final: _Window | None = None
        self.optimizer: list[_Window] = []
        self.order = 0  # see ``_Collective.order``
        # The context counts steps from its first forward; the trace from its own first.
        self.first_step = comm.upcoming_step

    # -- set-up --------------------------------------------------------------------------
    def add_tree(self, tree: TreeContext) -> None:
        if any(t is tree for t in self.trees):
            return
        self.trees.append(tree)
        for state in tree.states:
            self.states.add(id(state))
            for i, group in enumerate(state.groups):
                self.group_names[id(group)] = f" [mesh {i}]" if len(state.groups) > 1 else ""

    def tree_params(self) -> set[int]:
        return {
            id(p.sharded_param)
            for tree in self.trees
            for state in tree.states
            for group in state.groups
            for p in group.params
        }

    def _now(self) -> Any:
        return self.clock.stamp(self.comm.streams.compute())

    def _next(self) -> int:
        self.order += 1
        return self.order

    def _window(self, kind: str, name: str, root: bool = False) -> _Window:
        return _Window(kind, name, self._now(), self._next(), root=root)

    def _end(self, window: _Window, aborted: bool = False) -> None:
        window.end, window.end_order, window.aborted = self._now(), self._next(), aborted
        self._step(self._index(self.comm.step)).windows.append(window)

    def _index(self, step: int) -> int:
        """The trace's number of the context's ``step`` (counted from the first step the
        trace sees, which is 0)."""
        return max(0, step - self.first_step)

    def _step(self, index: int, begin: Any = None) -> _Step:
        step = self.steps.get(index)
        if step is None:
            step = _Step(index, begin if begin is not None else self._now())
            self.steps[index] = step
        return step

    # -- ScheduleRecorder: collectives ---------------------------------------------------
    def issuing(self, record: CollectiveRecord, stream: Any) -> None:
        suffix = self.group_names.get(id(record.group))
        if suffix is None:  # another tree sharing this context, not traced
            return
        # Its path under the root now: a tree that ``unshard()`` built on a submodule
        # names it "" until the outermost root's first forward takes it over.
        name = (getattr(record.group, "path", "") or "(root)") + suffix
        data = _Collective(
            record.seq,
            record.kind,
            name,
            record.phase,
            record.nbytes,
            time.perf_counter_ns(),
            self._next(),
        )
        data.comm_begin = data.issue_ns if stream is None else self.clock.stamp(stream)
        record.data = data
        self._step(self._index(record.step)).collectives.append(data)

    def issued(self, record: CollectiveRecord, stream: Any, work: Any) -> None:
        data = record.data
        if data is None:
            return
        if stream is not None:
            data.comm_end, data.completion = self.clock.stamp(stream), "event"
            return
        data.work = work
        try:
            future = work.get_future()
        except (AttributeError, RuntimeError):  # gloo's reduce-scatter has none
            return
        future.then(functools.partial(_completed, data))

    def waiting(self, record: CollectiveRecord, consumer: Any) -> None:
        data = record.data
        if data is None:
            return
        if consumer is not None and consumer != self.comm.streams.compute():
            # One side stream waiting for another (a reduce policy's all-to-all, summed on
            # the reduce-scatter stream): no compute waits; the compute stream's own wait
            # for the result comes later, with the same record.
            data.side_waited = True
            return
        begin = self.clock.stamp(consumer)
        work = data.work
        if work is not None and data.polled_ns is None and data.callback_ns is None:
            with contextlib.suppress(AttributeError, RuntimeError):
                if work.is_completed():
                    data.polled_ns = begin
        data.waits.append([begin, None])
        data.in_final_wait = data.in_final_wait or self.final is not None

    def waited(self, record: CollectiveRecord, consumer: Any) -> None:
        data = record.data
        if data is None or not data.waits or data.waits[-1][1] is not None:
            return  # not a wait of the compute stream (see ``waiting``)
        data.waits[-1][1] = self.clock.stamp(consumer)
        data.work = None  # what fsdp2 holds until now; dropped with its pending collective

    def consumed(self, record: CollectiveRecord) -> None:
        data = record.data
        if data is not None:
            data.consumed = self._now()

    # -- ScheduleRecorder: windows -------------------------------------------------------
    def compute_begins(self, state: Any, phase: Phase) -> None:
        key = (id(state), phase)
        if id(state) not in self.states or key in self.open:
            return
        name = getattr(state, "fqn", "") or "(root)"
        self.open[key] = self._window(phase.value, name, root=getattr(state, "is_root", False))
        self._step(self._index(self.comm.step))

    def compute_ends(self, state: Any, phase: Phase) -> None:
        window = self.open.pop((id(state), phase), None)
        if window is not None:
            self._end(window)

    def _close_open(self, phase: Phase | None, aborted: bool) -> None:
        for key in [k for k in self.open if phase is None or k[1] is phase]:
            self._end(self.open.pop(key), aborted)

    def root_forward_begins(self, root: Any, step: int) -> None:
        if id(root) not in self.states:
            return
        self._close_open(None, aborted=True)  # a forward that never finished (no reset)
        step = self._index(step)
        fresh = step not in self.steps
        self._step(step)
        if fresh:
            for index, older in self.steps.items():
                if index < step and not older.resolved:
                    self.resolve(older, block=False)

    def final_wait_begins(self) -> None:
        self._close_open(Phase.BACKWARD, aborted=False)
        in_backward = any(tree.in_backward for tree in self.trees)
        kind = "final wait" if in_backward else "final wait (before the optimizer step)"
        self.final = self._window(kind, "(root)")

    def final_wait_ends(self) -> None:
        window, self.final = self.final, None
        if window is not None:
            self._end(window)

    def reset(self) -> None:
        self._close_open(None, aborted=True)
        self.final_wait_ends()
        self._step(self._index(self.comm.step)).aborted = True

    # -- optimizer steps (the trace's optimizer hooks) ------------------------------------
    def optimizer_begins(self, name: str) -> None:
        self.optimizer.append(self._window("optimizer", name))

    def optimizer_ends(self) -> None:
        if self.optimizer:
            self._end(self.optimizer.pop())

    def close(self) -> None:
        """The trace ends: close what is still open, as unfinished."""
        self.final_wait_ends()
        self._close_open(None, aborted=True)
        while self.optimizer:
            self._end(self.optimizer.pop(), aborted=True)
        for step in self.steps.values():  # works still in flight: fsdp2 keeps its own
            for collective in step.collectives:
                collective.work = None

    # -- reading ---------------------------------------------------------------------------
    def resolve(self, step: _Step, block: bool) -> bool:
        """Turn the step's tokens into host nanoseconds where the device has passed them;
        whether all were."""
        clock = self.clock
        done = True

        def read(token: Any) -> Any:
            nonlocal done
            value = clock.resolve(token, block)
            if value is not None and not isinstance(value, (int, float)):
                done = False
            return value

        step.begin = read(step.begin)
        for c in step.collectives:
            c.comm_begin, c.comm_end, c.consumed = (
                read(c.comm_begin),
                read(c.comm_end),
                read(c.consumed),
            )
            c.waits = [[read(b), read(e)] for b, e in c.waits]
        for w in step.windows:
            w.begin, w.end = read(w.begin), read(w.end)
        step.resolved = done
        return done

    def step_dicts(self, origin_ns: int) -> list[dict[str, Any]]:
        label = ", ".join(tree.root.label for tree in self.trees)
        out = []
        for index in sorted(self.steps):
            step = self.steps[index]
            self.resolve(step, block=True)
            out.append(_step_dict(step, label, origin_ns))
        return out


def _us(ns: Any, origin_ns: int) -> float | None:
    return None if ns is None else (ns - origin_ns) / 1e3


def _collective_dict(c: _Collective, origin_ns: int) -> dict[str, Any]:
    waits = [[b, e] for b, e in c.waits if b is not None and e is not None]
    end, completion = c.comm_end, c.completion
    if completion != "event":
        # The earliest moment the work was known complete; a wait's end proves it.
        known = [t for t in (c.callback_ns, c.polled_ns) if t is not None]
        if waits:
            known.append(waits[0][1])
        end = min(known) if known else None
        completion = (
            "callback"
            if end is not None and end == c.callback_ns
            else "is_completed"
            if end is not None and end == c.polled_ns
            else "wait"
            if end is not None
            else "unknown"
        )
    exposed = sum(e - b for b, e in waits)
    return {
        "seq": c.seq,
        "order": c.order,
        "kind": c.kind,
        "group": c.group,
        "phase": c.phase.value,
        "stage": c.phase.stage.value,
        "prefetch": c.phase.prefetch,
        "bytes": c.nbytes,
        "issue_us": _us(c.issue_ns, origin_ns),
        "comm_begin_us": _us(c.comm_begin, origin_ns),
        "comm_end_us": _us(end, origin_ns),
        "completion": completion,
        "waits_us": [[_us(b, origin_ns), _us(e, origin_ns)] for b, e in waits],
        "exposed_us": exposed / 1e3,
        "waited": bool(waits) or c.side_waited,
        "in_final_wait": c.in_final_wait,
        "consumed_us": _us(c.consumed, origin_ns),
    }


def _step_dict(step: _Step, tree: str, origin_ns: int) -> dict[str, Any]:
    windows = [
        {
            "kind": w.kind,
            "name": w.name,
            "root": w.root,
            "begin_us": _us(w.begin, origin_ns),
            "end_us": _us(w.end, origin_ns),
            "begin_order": w.begin_order,
            "end_order": w.end_order,
            "aborted": w.aborted,
        }
        for w in step.windows
        if w.begin is not None and w.end is not None
    ]
    collectives = [_collective_dict(c, origin_ns) for c in step.collectives]
    begin = _us(step.begin, origin_ns)
    ends = [w["end_us"] for w in windows] + [
        t
        for c in collectives
        for t in (c["comm_end_us"], c["consumed_us"], *(e for _, e in c["waits_us"]))
        if t is not None
    ]
    return {
        "step": step.index,
        "tree": tree,
        "aborted": step.aborted,
        "begin_us": begin,
        "end_us": max(ends, default=begin),
        "collectives": collectives,
        "windows": sorted(windows, key=lambda w: (w["begin_us"], -w["end_us"])),
    }


# -- the trace -------------------------------------------------------------------------------
class ScheduleTrace:
    """What ``trace_schedule`` recorded: per rank, per step, every collective fsdp2 issued
    for the traced trees and every compute window. See [Note: what the trace measures].

    While the context is open, the outputs cover this rank's steps so far; once it has
    ended, rank 0's cover every rank (gathered when the context ended)."""

    def __init__(self, module: nn.Module | None) -> None:
        self.module = module
        self._recorders: list[_Recorder] = []
        self._active = False
        self._origin_ns = time.perf_counter_ns()
        self._origin_unix_ns = time.time_ns()
        self._ranks: dict[int, dict[str, Any]] | None = None  # every rank's, once ended
        self._optimizer_trees: weakref.WeakKeyDictionary[Any, tuple[int, list[_Recorder]]] = (
            weakref.WeakKeyDictionary()
        )
        self._hooks: list[Any] = []

    # -- attaching -------------------------------------------------------------------------
    def _traces(self, tree: TreeContext) -> bool:
        """Whether ``tree`` is (part of) the traced tree: it holds the module's state, or,
        built by ``unshard()`` on a submodule before the first forward, a state below it."""
        if self.module is None:
            return True
        state = fsdp_state_of(self.module)
        if state is not None and any(s is state for s in tree.states):
            return True
        inside = {id(m) for m in self.module.modules()}
        return any(id(m) in inside for s in tree.states for m in getattr(s, "modules", ()))

    def _attach(self, tree: TreeContext) -> None:
        if not self._traces(tree):
            return
        comm = tree.comm
        recorder = comm.recorder
        if recorder is None:
            recorder = _Recorder(self, comm)
            comm.recorder = recorder
            self._recorders.append(recorder)
        elif not isinstance(recorder, _Recorder) or recorder.trace is not self:
            raise RuntimeError(
                f"fsdp2.trace_schedule: the FSDP tree rooted at {tree.root.label} is already "
                f"traced (another trace_schedule, or another recorder, is attached to its "
                f"communication context). A tree records into one trace at a time: use the "
                f"enclosing trace, or end it first."
            )
        recorder.add_tree(tree)
        self._optimizer_trees = weakref.WeakKeyDictionary()

    def _start(self) -> None:
        for other in _ACTIVE:
            conflict = _overlapping(self.module, other.module)
            if conflict is not None:
                raise RuntimeError(
                    f"fsdp2.trace_schedule: {conflict} is already traced by an enclosing "
                    f"trace_schedule({_describe(other.module)}). A tree records into one "
                    f"trace at a time: use the enclosing trace, or end it before starting "
                    f"this one."
                )
        trees: list[TreeContext] = []
        if self.module is not None:
            state = fsdp_state_of(self.module)
            if state is not None and state.tree is not None:
                trees.append(state.tree)
        else:
            trees = _live_trees()
        for tree in trees:  # before anything is attached: a conflict leaves nothing behind
            if tree.comm.recorder is not None:
                raise RuntimeError(
                    f"fsdp2.trace_schedule: the FSDP tree rooted at {tree.root.label} is "
                    f"already traced by another recorder attached to its communication "
                    f"context. A tree records into one trace at a time."
                )
        for tree in trees:
            self._attach(tree)
        tree_observers.append(self._attach)
        self._hooks = [
            register_optimizer_step_pre_hook(self._optimizer_begins),
            register_optimizer_step_post_hook(self._optimizer_ends),
        ]
        self._active = True
        _ACTIVE.append(self)

    def _stop(self, gather: bool) -> None:
        self._active = False
        with contextlib.suppress(ValueError):
            _ACTIVE.remove(self)
        with contextlib.suppress(ValueError):
            tree_observers.remove(self._attach)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for recorder in self._recorders:
            recorder.close()
            if recorder.comm.recorder is recorder:
                recorder.comm.recorder = None
        mine = self._rank_dict()
        ranks = {mine["rank"]: mine}
        if gather and _gathers():
            everyone: list[Any] | None = (
                [None] * dist.get_world_size() if mine["rank"] == 0 else None
            )
            dist.gather_object(mine, everyone, dst=0)
            if everyone is not None:
                ranks = {d["rank"]: d for d in everyone}
        self._ranks = ranks

    # -- optimizer hooks -------------------------------------------------------------------
    def _recorders_of(self, optimizer: Any) -> list[_Recorder]:
        count = len(optimizer.param_groups)
        cached = self._optimizer_trees.get(optimizer)
        if cached is not None and cached[0] == count:
            return cached[1]
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        found = [r for r in self._recorders if r.tree_params() & params]
        self._optimizer_trees[optimizer] = (count, found)
        return found

    def _optimizer_begins(self, optimizer: Any, *_: Any) -> None:
        for recorder in self._recorders_of(optimizer):
            recorder.optimizer_begins(f"{type(optimizer).__name__}.step")

    def _optimizer_ends(self, optimizer: Any, *_: Any) -> None:
        for recorder in self._recorders_of(optimizer):
            recorder.optimizer_ends()

    # -- data ------------------------------------------------------------------------------
    def _rank_dict(self) -> dict[str, Any]:
        initialized = dist.is_available() and dist.is_initialized()
        steps = [s for r in self._recorders for s in r.step_dicts(self._origin_ns)]
        steps.sort(key=lambda s: (s["step"], s["begin_us"]))
        return {
            "rank": dist.get_rank() if initialized else 0,
            "world_size": dist.get_world_size() if initialized else 1,
            "backend": str(dist.get_backend()) if initialized else "none",
            "device": self._recorders[0].device if self._recorders else "cpu",
            "timing": self._recorders[0].clock.timing if self._recorders else "host clock",
            "origin_unix_us": self._origin_unix_ns / 1e3,
            "trees": [t.root.label for r in self._recorders for t in r.trees],
            "steps": steps,
        }

    def _every_rank(self) -> dict[int, dict[str, Any]]:
        if self._ranks is not None:
            return self._ranks
        mine = self._rank_dict()
        return {mine["rank"]: mine}

    @property
    def ranks(self) -> list[int]:
        """The ranks whose steps the outputs cover."""
        return sorted(self._every_rank())

    @property
    def steps(self) -> list[int]:
        """The step numbers recorded on this rank."""
        mine = self._mine()
        return sorted({s["step"] for s in mine["steps"]})

    def _mine(self) -> dict[str, Any]:
        every = self._every_rank()
        initialized = dist.is_available() and dist.is_initialized()
        rank = dist.get_rank() if initialized else 0
        return every.get(rank, next(iter(every.values())))

    def to_dict(self) -> dict[str, Any]:
        """Everything recorded, as JSON-ready data: ``ranks`` (per rank: its steps, each
        with its collectives and windows, times in microseconds from the rank's trace
        start, whose Unix time is ``origin_unix_us``) and ``summary`` (this rank's means
        per step, as ``summary()`` prints them)."""
        every = self._every_rank()
        return {
            "version": 1,
            "ranks": {str(r): every[r] for r in sorted(every)},
            "summary": summarize_rank(self._mine()),
        }

    def summary(self, step: int | None = None) -> str:
        """A table per group and phase (count, communication, exposed time, overlap),
        with the step's exposed communication first: the mean per step over the steps
        after the first (which pays for one-time set-up), or ``step`` alone."""
        mine = self._mine()
        self._require_steps("summary", mine)
        return summary_text(mine, self._every_rank(), step)

    def save_chrome_trace(self, path: str | Path) -> None:
        """Write Chrome trace-event JSON (Perfetto, ``chrome://tracing``): one process per
        rank, one track per stream or thread (compute, all-gather, reduce-scatter, ...)."""
        every = self._every_rank()
        self._require_steps("save_chrome_trace", self._mine())
        Path(path).write_text(json.dumps(chrome_trace(every)))

    def plot(self, path: str | Path, step: int | None = None) -> None:
        """Write a PNG timeline of one step (default: the last complete one) across the
        ranks: compute and each collective's stream per rank, coloured by phase, groups
        labelled, exposed waits marked. Needs matplotlib (``pip install 'fsdp2[plot]'``)."""
        every = self._every_rank()
        self._require_steps("plot", self._mine())
        plot_step(every, step, Path(path))

    def _require_steps(self, api: str, mine: dict[str, Any]) -> None:
        if not mine["steps"]:
            where = "" if self._recorders else " (no FSDP tree ran a forward while it was open)"
            raise RuntimeError(
                f"ScheduleTrace.{api}: no step recorded yet{where}. Run at least one "
                f"forward and backward of the traced model inside `with "
                f"fsdp2.trace_schedule(...) as trace:`, then call trace.{api}(...)."
            )


# Every tree that finished its lazy init in this process (weakly): what a trace of every
# tree attaches to when it starts; trees built later reach it through ``tree_observers``.
_TREES: weakref.WeakSet[TreeContext] = weakref.WeakSet()
tree_observers.append(_TREES.add)


def _live_trees() -> list[TreeContext]:
    """The initialized trees alive in this process (not those a root took over)."""
    return [tree for tree in list(_TREES) if getattr(tree.root, "tree", None) is tree]


def _describe(module: nn.Module | None) -> str:
    return "None" if module is None else type(module).__name__


def _overlapping(a: nn.Module | None, b: nn.Module | None) -> str | None:
    """What two traces would both record, or None."""
    if a is None or b is None:
        return "every FSDP tree" if b is None else f"the FSDP tree of {_describe(b)}"
    state_a, state_b = fsdp_state_of(a), fsdp_state_of(b)
    if state_a is not None and state_b is not None and state_a.tree is not None:
        if state_a.tree is state_b.tree:
            return f"the FSDP tree rooted at {state_a.tree.root.label}"
    if any(m is b for m in a.modules()) or any(m is a for m in b.modules()):
        return f"the FSDP tree of {_describe(b)}"
    return None


def _gathers() -> bool:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return False
    return str(dist.get_backend()) != "fake"  # its collectives move no data


@contextlib.contextmanager
def trace_schedule(module: nn.Module | None = None) -> Iterator[ScheduleTrace]:
    """Record fsdp2's schedule while the block runs: for every step and every group of
    ``module``'s FSDP tree (``module`` is the root or any sharded module of it; None:
    every tree), each collective's issue, communication, exposed wait and copy-out, the
    compute windows and the optimizer steps ([Note: what the trace measures]).

    Every rank enters and leaves the block together: when it ends without an exception,
    the ranks' records are gathered onto rank 0 (one ``gather_object`` on the default
    process group), whose outputs then show every rank."""
    if module is not None:
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"fsdp2.trace_schedule(module) expects an nn.Module or None, got "
                f"{type(module).__name__}."
            )
        if fsdp_state_of(module) is None:
            inside = [name for name, m in module.named_modules() if fsdp_state_of(m) is not None]
            hint = f" Its sharded submodules include '{inside[0]}': pass that." if inside else ""
            raise ValueError(
                f"fsdp2.trace_schedule(module): {type(module).__name__} is not a module "
                f"fully_shard was applied to (neither the root nor a child of an FSDP tree). "
                f"Pass the sharded root (the module fully_shard was applied to last), any "
                f"sharded module of its tree, or None to trace every tree.{hint}"
            )
    trace = ScheduleTrace(module)
    trace._start()
    failed = True
    try:
        yield trace
        failed = False
    finally:
        trace._stop(gather=not failed)
