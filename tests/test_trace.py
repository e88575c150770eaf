"""``fsdp2.trace_schedule``: what the schedule trace records, and its outputs.

Every check is on counts and orders, never on durations. The workhorse compares the
trace with an independent count: inside each rank, ``torch.distributed``'s collectives are
wrapped by a counter that names the group from the call stack (the ``ParamGroup`` whose
method issued it), the phase from the test's own marker (forward, backward, an explicit
``unshard()``) and "prefetched" from the stack too (issued by another state's hook than
the group's own). The trace must list exactly those collectives, step by step.

If a count test fails, the message shows both tables; a collective missing from the
trace means a path that issues collectives without ``CommContext.before_collective``
([Note: schedule records] in ``fsdp2/_comm_records.py``).
"""

from __future__ import annotations

import collections
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _helpers import divergence_checks
from _launcher import run_ranks
from _stream_sanitizer import stream_sanitizer
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
from fsdp2._param_group import ParamGroup
from fsdp2._state import FSDPState

DIM = 16
BLOCKS = 4
COLLECTIVES = {
    "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_to_all_single": "all_to_all",
}
# The methods that reduce gradients: every collective issued under them is a reduction.
REDUCING = {"reduce_grads", "finish_reduce", "_all_reduce_replicas"}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("block failed on purpose")
        return torch.relu(self.lin(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def sharded_net(mesh: Any = None, **kwargs: Any) -> Net:
    torch.manual_seed(0)
    model = Net()
    mesh = mesh if mesh is not None else init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fsdp2.fully_shard(block, mesh=mesh, **kwargs)
    fsdp2.fully_shard(model, mesh=mesh)
    return model


class Counter:
    """Counts every collective by (step, group, kind, phase), independently of the trace."""

    def __init__(self) -> None:
        self.marker = "idle"
        self.step = 0
        self.counts: collections.Counter[tuple[int, str, str, str]] = collections.Counter()
        self.order: list[tuple[str, str, str]] = []  # (group, kind, phase), issue order

    def wrap(self, kind: str, fn: Any) -> Any:
        def counting(*args: Any, **kwargs: Any) -> Any:
            group, prefetched, reducing = _issuer()
            if group is not None:  # a collective of fsdp2's schedule
                phase = "reduction" if reducing else self.marker
                if prefetched and phase in ("forward", "backward"):
                    phase += ", prefetched"
                self.counts[(self.step, group, kind, phase)] += 1
                self.order.append((group, kind, phase))
            return fn(*args, **kwargs)

        return counting

    @contextmanager
    def patched(self) -> Iterator[Counter]:
        originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
        for name, fn in originals.items():
            setattr(dist, name, self.wrap(COLLECTIVES[name], fn))
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)


def _issuer() -> tuple[str | None, bool, bool]:
    """The group whose method issues the collective being called (from the stack),
    whether a hook of another state asked for it, and whether it reduces gradients."""
    frame = sys._getframe(2)
    group: ParamGroup | None = None
    reducing = False
    while frame is not None:
        owner = frame.f_locals.get("self")
        if group is None and isinstance(owner, ParamGroup):
            group = owner
            reducing = frame.f_code.co_name in REDUCING
        elif group is not None and isinstance(owner, FSDPState):
            prefetched = not any(g is group for g in owner.groups)
            return group.path or "(root)", prefetched and not reducing, reducing
        frame = frame.f_back
    return (None, False, False) if group is None else (group.path or "(root)", False, reducing)


def recorded(trace: dict[str, Any]) -> collections.Counter[tuple[int, str, str, str]]:
    counts: collections.Counter[tuple[int, str, str, str]] = collections.Counter()
    for step in trace["steps"]:
        for c in step["collectives"]:
            counts[(step["step"], c["group"], c["kind"], c["phase"])] += 1
    return counts


def check_consistent(rank: dict[str, Any]) -> list[str]:
    """What must hold of any trace: every collective issued, its communication window
    ordered, waits closed, consumed after its waits; every window closed and ordered."""
    problems = []
    for step in rank["steps"]:
        assert step["end_us"] >= step["begin_us"]
        for c in step["collectives"]:
            where = f"step {step['step']} #{c['seq']} {c['kind']} {c['group']}"
            if c["comm_end_us"] is None or c["comm_begin_us"] is None:
                problems.append(f"{where}: communication window unknown")
            elif not c["issue_us"] <= c["comm_begin_us"] <= c["comm_end_us"]:
                problems.append(f"{where}: issue/communication out of order")
            if not c["waited"]:
                problems.append(f"{where}: never waited for")
            for begin, end in c["waits_us"]:
                if not (c["issue_us"] <= begin <= end):
                    problems.append(f"{where}: wait out of order")
            if c["waits_us"] and c["consumed_us"] is not None:
                if c["consumed_us"] < c["waits_us"][-1][1]:
                    problems.append(f"{where}: consumed before its wait ended")
        for w in step["windows"]:
            if w["end_us"] < w["begin_us"] or w["end_order"] <= w["begin_order"]:
                problems.append(f"step {step['step']}: window {w} out of order")
    return problems


# -- recorded collectives equal counted ones --------------------------------------------------
def traced_training(config: str) -> dict[str, Any]:
    """Rank function: three steps of ``config`` under the trace and the counter."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = None
    kwargs: dict[str, Any] = {}
    if config == "no_reshard":
        kwargs["reshard_after_forward"] = False
    if config.startswith("hsdp"):
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    if config.endswith("policy"):  # the blocks exchange with all-to-alls (issue 28)
        bf16_wire = fsdp2.ReducePolicy(comm_dtype=torch.bfloat16, accumulate_dtype=torch.float32)
        kwargs["reduce_policy"] = bf16_wire
    model = sharded_net(mesh, **kwargs)
    untraced = sharded_net(mesh, **kwargs)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    counter = Counter()
    microbatches = 3 if config == "accumulation" else 1
    with fsdp2.trace_schedule(model) as trace:
        with counter.patched():
            for step in range(3):
                counter.step = step
                if config == "unshard_async" and step > 0:
                    counter.marker = "unshard"
                    handle = model.blocks[1].unshard(async_op=True)
                    if step == 1 and handle is not None:
                        handle.wait()  # the next step leaves the wait to the forward
                for micro in range(microbatches):
                    model.set_requires_gradient_sync(micro == microbatches - 1)
                    x = torch.randn(2, DIM, generator=torch.Generator().manual_seed(rank + step))
                    counter.marker = "forward"
                    loss = model(x).sum()
                    counter.marker = "backward"
                    loss.backward()
                counter.marker = "optimizer"
                optim.step()
                optim.zero_grad()
                counter.marker = "idle"
    mine = trace.to_dict()["ranks"][str(rank)]
    # The same steps untraced: tracing changes no number.
    reference = torch.optim.SGD(untraced.parameters(), lr=0.1)
    for step in range(3):
        for micro in range(microbatches):
            untraced.set_requires_gradient_sync(micro == microbatches - 1)
            x = torch.randn(2, DIM, generator=torch.Generator().manual_seed(rank + step))
            untraced(x).sum().backward()
        reference.step()
        reference.zero_grad()
    differ = [
        name
        for (name, a), b in zip(model.named_parameters(), untraced.parameters())
        if not torch.equal(a.to_local(), b.to_local())
    ]
    return {
        "differ": differ,
        "counted": dict(counter.counts),
        "recorded": dict(recorded(mine)),
        "problems": check_consistent(mine),
        "steps": [s["step"] for s in mine["steps"]],
        "ranks": sorted(trace.ranks),
        "summary": trace.summary(),
    }


EXPECTED_KINDS = {
    "hsdp": {"all_gather", "reduce_scatter", "all_reduce"},
    "reduce_policy": {"all_gather", "reduce_scatter", "all_to_all"},
    # Replicas under the policy: an all-to-all and an all-gather (in the reduction).
    "hsdp_policy": {"all_gather", "reduce_scatter", "all_to_all", "all_reduce"},
}


def _table(counts: dict[tuple[int, str, str, str], int]) -> str:
    return "\n".join(f"  {key}: {n}" for key, n in sorted(counts.items()))


def _aggregate(counts: dict[tuple[int, str, str, str], int]) -> collections.Counter[Any]:
    out: collections.Counter[Any] = collections.Counter()
    for (_, group, kind, phase), n in counts.items():
        out[(group, kind, phase)] += n
    return out


@pytest.mark.parametrize(
    ("config", "world"),
    [
        ("default", 2),
        ("no_reshard", 2),
        ("accumulation", 2),
        ("hsdp", 4),
        ("unshard_async", 2),
        ("reduce_policy", 2),
        ("hsdp_policy", 4),
    ],
)
def test_recorded_collectives_equal_counted(config: str, world: int) -> None:
    for rank, result in enumerate(run_ranks(traced_training, world, config)):
        counted, traced = result["counted"], result["recorded"]
        where = f"[{config}, rank {rank}]\ncounted:\n{_table(counted)}\ntraced:\n{_table(traced)}"
        assert result["problems"] == [], f"{where}\n{result['problems']}"
        assert result["differ"] == [], "tracing changed the training"
        # One trace step per optimizer step: accumulation's microbatches included.
        assert result["steps"] == [0, 1, 2], where
        if config == "unshard_async":
            # An unshard() before a step's forward counts in the step before it.
            assert _aggregate(counted) == _aggregate(traced), where
            assert _aggregate(traced)[("blocks.1", "all_gather", "unshard")] == 2, where
        else:
            assert counted == traced, where
        kinds = {key[2] for key in traced}
        assert kinds == EXPECTED_KINDS.get(config, {"all_gather", "reduce_scatter"}), where
        if config.endswith("policy"):  # the blocks' reductions, the root's reduce-scatter
            exchanges = 2 if config == "hsdp_policy" else 1  # + the replicas' all-to-all
            assert traced[(1, "blocks.0", "all_to_all", "reduction")] == exchanges, where
            assert traced[(1, "(root)", "reduce_scatter", "reduction")] == 1, where
        phases = {key[3] for key in traced}
        if config in ("default", "accumulation"):
            # The CPU's implicit forward prefetch from step 1 on, the backward prefetch.
            assert {"forward, prefetched", "backward, prefetched"} <= phases, where
        if config == "no_reshard":
            assert not any(p.startswith("backward") for k, p in
                           ((key[2], key[3]) for key in traced) if k == "all_gather"), where  # fmt: skip
        if rank == 0:
            assert result["ranks"] == list(range(world)), "gathered onto rank 0"
            assert "exposed communication" in result["summary"]


# -- orders ----------------------------------------------------------------------------------
def prefetch_orders() -> dict[str, Any]:
    """Rank function: the default forward prefetch, and an explicit backward list."""
    model = sharded_net()
    blocks = list(model.blocks)
    blocks[3].set_modules_to_backward_prefetch([blocks[1], blocks[2]])
    blocks[2].set_modules_to_backward_prefetch([blocks[0]])
    blocks[1].set_modules_to_backward_prefetch([])
    blocks[0].set_modules_to_backward_prefetch([])
    counter = Counter()
    with fsdp2.trace_schedule(model) as trace, counter.patched():
        for step in range(2):
            counter.step = step
            counter.marker = "forward"
            loss = model(torch.randn(2, DIM)).sum()
            counter.marker = "backward"
            loss.backward()
    (_, step1) = trace.to_dict()["ranks"][str(dist.get_rank())]["steps"]
    ends = {w["name"]: w["end_order"] for w in step1["windows"] if w["kind"] == "forward"}
    forward_issues = {
        c["group"]: c["order"]
        for c in step1["collectives"]
        if c["kind"] == "all_gather" and c["phase"].startswith("forward")
    }
    backward = [
        (c["group"], c["phase"])
        for c in sorted(step1["collectives"], key=lambda c: c["seq"])
        if c["kind"] == "all_gather" and c["phase"].startswith("backward")
    ]
    counted_backward = [
        (group, phase)
        for group, kind, phase in counter.order[len(counter.order) // 2 :]
        if kind == "all_gather" and phase.startswith("backward")
    ]
    return {
        "ends": ends,
        "forward_issues": forward_issues,
        "phases": {c["group"]: c["phase"] for c in step1["collectives"]
                   if c["kind"] == "all_gather" and c["phase"].startswith("forward")},
        "backward": backward,
        "counted_backward": counted_backward,
    }  # fmt: skip


def test_prefetch_orders() -> None:
    for result in run_ranks(prefetch_orders, 2):
        ends, issues = result["ends"], result["forward_issues"]
        for i in range(BLOCKS - 1):
            # Implicit forward prefetch on the CPU: block i+1's all-gather is issued (by
            # block i's pre-forward) before block i's forward ends.
            assert issues[f"blocks.{i + 1}"] < ends[f"blocks.{i}"], result
            assert result["phases"][f"blocks.{i + 1}"] == "forward, prefetched", result
        # set_modules_to_backward_prefetch: the root prefetches the last block (default),
        # block 3 its list in its order, block 2 its list.
        expected = ["blocks.3", "blocks.1", "blocks.2", "blocks.0"]
        assert [g for g, _ in result["backward"]] == expected, result
        assert all(p == "backward, prefetched" for _, p in result["backward"]), result
        assert result["backward"] == result["counted_backward"], result


# -- outputs ---------------------------------------------------------------------------------
def outputs(directory: str) -> dict[str, Any]:
    """Rank function: two steps traced, then every output written on rank 0."""
    model = sharded_net()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    with fsdp2.trace_schedule() as trace:  # every tree, built inside the trace
        for _ in range(2):
            model(torch.randn(2, DIM)).sum().backward()
            optim.step()
            optim.zero_grad()
    assert "; step 1." in trace.summary(step=1).splitlines()[0]
    with pytest.raises(ValueError, match="no step 7 recorded"):
        trace.summary(step=7)
    if dist.get_rank() == 0:
        trace.save_chrome_trace(Path(directory) / "trace.json")
        trace.plot(Path(directory) / "step.png")
        json.dumps(trace.to_dict())  # JSON-ready
    return {"summary": trace.summary(), "dict": trace.to_dict()}


def test_chrome_trace_and_plot(tmp_path: Path) -> None:
    results = run_ranks(outputs, 2, str(tmp_path))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    processes = {e["pid"] for e in events}
    assert processes == {0, 1}
    for rank in (0, 1):
        names = {e["args"]["name"] for e in events
                 if e["pid"] == rank and e["name"] == "thread_name"}  # fmt: skip
        assert {"compute", "all-gather", "reduce-scatter"} <= names, names
        spans = [e for e in events if e["pid"] == rank and e["ph"] == "X"]
        assert spans and all(e["dur"] >= 0 for e in spans)
        assert any(e["cat"] == "optimizer" for e in spans)
        assert any(e["cat"] == "exposed" for e in spans)
    png = (tmp_path / "step.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    data = results[0]["dict"]
    assert set(data["ranks"]) == {"0", "1"}
    assert results[1]["dict"]["ranks"].keys() == {"1"}  # gathered onto rank 0 only
    rows = data["summary"]["rows"]
    assert {(r["kind"], r["group"]) for r in rows} >= {("all_gather", "blocks.0"),
                                                        ("reduce_scatter", "(root)")}  # fmt: skip
    summary = results[0]["summary"]
    assert summary.splitlines()[3].startswith("exposed communication:"), summary
    assert "step total" in summary and "per rank" in summary


def test_plot_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fsdp2._trace_views import plot_step

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    data = {0: {"rank": 0, "origin_unix_us": 0.0, "steps": []}}
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'fsdp2\[plot\]'"):
        plot_step(data, None, tmp_path / "x.png")


# -- a step that fails -----------------------------------------------------------------------
def failing_step() -> dict[str, Any]:
    """Rank function: step 1 raises in block 2's forward; ``reset_iter_state`` recovers."""
    model = sharded_net()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    counter = Counter()
    with fsdp2.trace_schedule(model) as trace, counter.patched():
        for step in range(4):
            counter.step = step
            model.blocks[2].fail = step == 1
            try:
                counter.marker = "forward"
                loss = model(torch.randn(2, DIM)).sum()
                counter.marker = "backward"
                loss.backward()
                optim.step()
            except RuntimeError:
                model.reset_iter_state()
            optim.zero_grad()
    mine = trace.to_dict()["ranks"][str(dist.get_rank())]
    return {
        "counted": dict(counter.counts),
        "recorded": dict(recorded(mine)),
        "problems": check_consistent(mine),
        "aborted": [s["step"] for s in mine["steps"] if s["aborted"]],
        "open": [w for s in mine["steps"] for w in s["windows"] if w["aborted"]],
        "summary": trace.summary(),
    }


def test_trace_across_a_failed_step() -> None:
    for result in run_ranks(failing_step, 2):
        assert result["problems"] == [], result["problems"]
        assert result["aborted"] == [1]
        counted, traced = result["counted"], result["recorded"]
        assert counted == traced, f"counted:\n{_table(counted)}\ntraced:\n{_table(traced)}"
        # The failed forward left the root's and block 2's windows open: closed by reset.
        assert {w["name"] for w in result["open"]} == {"(root)", "blocks.2"}
        per_step = {s: {k[1:]: n for k, n in traced.items() if k[0] == s} for s in range(4)}
        assert per_step[2] == per_step[3], "the steps after the reset record as before"
        assert "1 failed" in result["summary"] and "steps 2, 3" in result["summary"]


# -- bad input -------------------------------------------------------------------------------
def bad_input() -> list[str]:
    """Rank function: each misuse, and the error it raises."""
    model = sharded_net()
    seen = []

    def expect(error: type, match: str, fn: Any) -> None:
        with pytest.raises(error, match=match):
            fn()
        seen.append(match)

    def nested(outer: Any, inner: Any) -> None:
        with fsdp2.trace_schedule(outer), fsdp2.trace_schedule(inner):
            pass

    for outer, inner in ((model, model), (model, model.blocks[1]), (None, model),
                         (model.blocks[0], None)):  # fmt: skip
        expect(RuntimeError, "already traced by an enclosing trace_schedule",
               lambda o=outer, i=inner: nested(o, i))  # fmt: skip
    model(torch.randn(2, DIM)).sum().backward()  # now the tree exists
    expect(RuntimeError, "already traced", lambda: nested(model.blocks[2], model))
    with fsdp2.trace_schedule(model) as trace:
        pass
    expect(RuntimeError, r"save_chrome_trace: no step recorded yet",
           lambda: trace.save_chrome_trace("x.json"))  # fmt: skip
    expect(RuntimeError, r"plot: no step recorded yet", lambda: trace.plot("x.png"))
    plain = nn.Linear(2, 2)
    expect(ValueError, r"Linear is not a module fully_shard was applied to",
           lambda: fsdp2.trace_schedule(plain).__enter__())  # fmt: skip
    wrapper = nn.Sequential(model)
    expect(ValueError, r"sharded submodules include '0': pass that",
           lambda: fsdp2.trace_schedule(wrapper).__enter__())  # fmt: skip
    expect(TypeError, "expects an nn.Module or None",
           lambda: fsdp2.trace_schedule("model").__enter__())  # type: ignore[arg-type]  # fmt: skip
    # Nothing is left attached after the failures, and a trace works again.
    assert model._fsdp_state.tree.comm.recorder is None
    with fsdp2.trace_schedule(model) as trace:
        model(torch.randn(2, DIM)).sum().backward()
    assert trace.steps == [0]
    return seen


def test_bad_input() -> None:
    for seen in run_ranks(bad_input, 2):
        assert len(seen) == 10, seen


# -- no trace: nothing recorded ----------------------------------------------------------------
def untraced_after_a_trace() -> int:
    """Rank function: how many descriptors a step makes after a trace ended."""
    from fsdp2 import _comm_records

    model = sharded_net()
    with fsdp2.trace_schedule(model):
        model(torch.randn(2, DIM)).sum().backward()
    made = []
    original = _comm_records.CollectiveRecord.__init__

    def counting(self: Any, *args: Any) -> None:
        made.append(1)
        original(self, *args)

    _comm_records.CollectiveRecord.__init__ = counting  # type: ignore[method-assign]
    try:
        model(torch.randn(2, DIM)).sum().backward()
    finally:
        _comm_records.CollectiveRecord.__init__ = original  # type: ignore[method-assign]
    assert model._fsdp_state.tree.comm.recorder is None
    return len(made)


def test_nothing_recorded_without_a_trace() -> None:
    assert run_ranks(untraced_after_a_trace, 2) == [0, 0]


# -- the accelerator path, on the CPU ----------------------------------------------------------
def traced_with_streams(lagging: bool) -> dict[str, Any]:
    """Rank function: fsdp2's CUDA code path under the stream sanitizer's stand-in streams
    and timing events. ``lagging``: the stand-in device passes no event while steps run."""
    counter = Counter()
    # The trace's own events and waits: without the divergence checks' (one event per
    # collective, and a wait before the optimizer step; see tests/test_divergence.py).
    with divergence_checks(False), stream_sanitizer() as sanitizer:
        sanitizer.device_caught_up = not lagging
        model = sharded_net()
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        with fsdp2.trace_schedule(model) as trace, counter.patched():
            for step in range(3):
                counter.step = step
                counter.marker = "forward"
                loss = model(torch.randn(2, DIM)).sum()
                counter.marker = "backward"
                loss.backward()
                counter.marker = "optimizer"
                optim.step()
                optim.zero_grad()
            synced_while_training = len(sanitizer.synchronized)
            sanitizer.device_caught_up = True
        streams = model._fsdp_state.tree.comm.streams
        on = collections.Counter(
            {streams.all_gather: "all_gather", streams.reduce_scatter: "reduce_scatter"}.get(
                e.stream, "compute" if e.stream is sanitizer.compute else str(e.stream)
            )
            for e in sanitizer.timing_events
        )
        races = list(sanitizer.races)
    mine = trace.to_dict()["ranks"][str(dist.get_rank())]
    return {
        "counted": dict(counter.counts),
        "recorded": dict(recorded(mine)),
        "problems": check_consistent(mine),
        "timing": mine["timing"],
        "synced_while_training": synced_while_training,
        "synced": len(sanitizer.synchronized),
        "events_on": dict(on),
        "races": races,
    }


@pytest.mark.parametrize("lagging", [False, True], ids=["device-caught-up", "device-lagging"])
def test_device_events_without_sync_on_the_hot_path(lagging: bool) -> None:
    """On an accelerator the trace records timing events on the streams fsdp2 uses and
    reads them after the step: while steps run it synchronizes only the one event that
    ties the device's clock to the host's (at lazy init); events the device has passed
    are read when the next step starts, the rest when the trace ends."""
    for result in run_ranks(traced_with_streams, 2, lagging):
        assert result["races"] == [], result["races"]
        assert result["timing"] == "device events"
        assert result["problems"] == [], result["problems"]
        assert result["counted"] == result["recorded"]
        assert result["synced_while_training"] == 1, "synchronized on the hot path"
        kinds = collections.Counter()
        for (_, _, kind, _), n in result["recorded"].items():
            kinds[kind] += n
        # Two events on its own stream per collective (around it); the rest (waits,
        # copy-outs, windows, the anchor) on the compute stream.
        on = result["events_on"]
        assert on["all_gather"] == 2 * kinds["all_gather"], on
        assert on["reduce_scatter"] == 2 * kinds["reduce_scatter"], on
        assert set(on) == {"all_gather", "reduce_scatter", "compute"}, on
        if lagging:  # nothing passed while training: everything read at the end
            assert result["synced"] == sum(on.values()), result
        else:  # the steps before the last were read as the device passed them
            assert result["synced"] < sum(on.values()) / 2, result


@pytest.mark.slow
def test_example_writes_the_trace(tmp_path: Path) -> None:
    """``examples/train_llama.py --trace DIR`` through torchrun: the summary, the Chrome
    trace of both ranks and the PNG."""
    from test_checkpoint import _torchrun

    output = _torchrun("--steps", "3", "--trace", str(tmp_path / "trace"))
    assert "exposed communication:" in output, output[-2000:]
    summary = (tmp_path / "trace" / "summary.txt").read_text()
    assert "step total" in summary and "layers.0" in summary, summary
    events = json.loads((tmp_path / "trace" / "trace.json").read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    assert (tmp_path / "trace" / "schedule.png").read_bytes()[:4] == b"\x89PNG"
