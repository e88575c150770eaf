"""Explicit prefetching with ``set_modules_to_forward_prefetch`` and
``set_modules_to_backward_prefetch``.

A ``Net`` with 4 blocks (each its own group, ``reshard_after_forward=True`` for blocks, the
root keeps its parameters) trains 2 steps; every all-gather and reduce-scatter is
intercepted and mapped to its group by size, and the blocks log when their forward body
starts (``F<i>``) and when their backward reaches their middle (``B<i>``). The whole
interleaved sequence must equal the schedule the configuration implies:

* ``default``: no explicit prefetch. Forward gathers each block right before it runs;
  backward prefetches the block that ran before (one ahead). fsdp2 on the CPU also
  gathers one block ahead in forward from the second step on, following the order of the
  step before (``FSDP2_CPU_FORWARD``; [Note: forward prefetch on the CPU]).
* ``forward_off``: ``set_modules_to_forward_prefetch([])`` on every module turns that off.
* ``next_two``: block ``i`` prefetches blocks ``i+1, i+2`` in forward and ``i-1, i-2`` in
  backward, so block 0's pre-forward issues three all-gathers before ``F0``.
* ``farthest_first``: the same sets, farthest first (``i+2, i+1`` / ``i-2, i-1``): the
  all-gathers are issued in the configured order, not in execution order.

Parameters must match the unsharded reference within 1e-5 in every mode. A prefetch of a
group already gathered (or in flight) is a no-op, which is why e.g. block 1 of
``next_two`` only issues block 3's all-gather.

``test_default_backward_prefetch_nested`` shards a submodule inside each block: backward
needs a block's own parameters before its inner module's, so the default prefetch must
follow the order in which forwards *finished* (inner, block, ..., root), read backwards,
and the root prefetches the last block.

The docs example (the first ```python block of docs/prefetch.md) runs on 2 ranks too.
"""

from __future__ import annotations

import math
import pathlib

import pytest
import torch
import torch.distributed as dist
from _control_helpers import (
    IN_DIM,
    TOL,
    CollectiveLog,
    adamw,
    build_net,
    clone_model,
    data_parallel_steps,
    global_batch,
    group_numels,
    max_param_diff,
    mse,
    rank_slice,
    recording_events,
    reference_step,
    shard_net,
)
from _helpers import IMPLS, deterministic_init, get_fully_shard, make_mesh, require_impl
from _launcher import run_ranks
from test_grad_accumulation import exec_doc_example, first_python_block
from torch import nn

AG = "AG:blocks.{}".format
RS = "RS:blocks.{}".format

EXPECTED = {
    "default": (
        ["AG:root", AG(0), "F0", AG(1), "F1", AG(2), "F2", AG(3), "F3"],
        [AG(3), AG(2), "B3", RS(3), AG(1), "B2", RS(2), AG(0), "B1", RS(1), "B0", RS(0), "RS:root"],
    ),
    # set_modules_to_forward_prefetch([]) on every module: fsdp2's CPU forward prefetch off.
    "forward_off": (
        ["AG:root", AG(0), "F0", AG(1), "F1", AG(2), "F2", AG(3), "F3"],
        [AG(3), AG(2), "B3", RS(3), AG(1), "B2", RS(2), AG(0), "B1", RS(1), "B0", RS(0), "RS:root"],
    ),
    "next_two": (
        ["AG:root", AG(0), AG(1), AG(2), "F0", AG(3), "F1", "F2", "F3"],
        [AG(3), AG(2), AG(1), "B3", RS(3), AG(0), "B2", RS(2), "B1", RS(1), "B0", RS(0), "RS:root"],
    ),
    "farthest_first": (
        ["AG:root", AG(0), AG(2), AG(1), "F0", AG(3), "F1", "F2", "F3"],
        [AG(3), AG(1), AG(2), "B3", RS(3), AG(0), "B2", RS(2), "B1", RS(1), "B0", RS(0), "RS:root"],
    ),
}

# fsdp2's default forward on the CPU once an order is recorded: each pre-forward (the
# root's too) issues the next block's all-gather before the compute it then overlaps.
FSDP2_CPU_FORWARD = ["AG:root", AG(0), AG(1), "F0", AG(2), "F1", AG(3), "F2", "F3"]


def configure(model, mode: str) -> None:
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        forward = blocks[i + 1 : i + 3]  # next two
        backward = blocks[max(i - 2, 0) : i][::-1]  # previous two, nearest first
        if mode == "farthest_first":
            forward, backward = forward[::-1], backward[::-1]
        if mode == "forward_off":
            block.set_modules_to_forward_prefetch([])
        elif mode != "default":
            block.set_modules_to_forward_prefetch(forward)
            block.set_modules_to_backward_prefetch(backward)
    if mode == "forward_off":
        model.set_modules_to_forward_prefetch([])


def prefetch_schedule(impl: str, mode: str, steps: int = 2) -> dict:
    """Rank function: per step, the interleaved forward and backward event sequences."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    ref = build_net()
    model = shard_net(clone_model(ref), impl)
    configure(model, mode)
    ref_opt, opt = adamw(ref), adamw(model)
    out: dict = {"steps": []}
    with CollectiveLog(group_numels(ref, ws)):
        for step in range(steps):
            batch = global_batch(step, 2 * ws)
            reference_step(ref, ref_opt, batch)
            with recording_events() as events:
                loss = mse(model, rank_slice(batch, rank, ws))
                n_forward = len(events)
                loss.backward()
            opt.step()
            opt.zero_grad()
            out["steps"].append(
                {
                    "forward": events[:n_forward],
                    "backward": events[n_forward:],
                    "param_worst": max_param_diff(ref, model),
                }
            )
    return out


@pytest.mark.parametrize("mode", list(EXPECTED))
@pytest.mark.parametrize("impl", IMPLS)
def test_prefetch_schedule(impl: str, mode: str) -> None:
    require_impl(impl)
    forward, backward = EXPECTED[mode]
    for rank, report in enumerate(run_ranks(prefetch_schedule, 2, impl, mode)):
        for step, e in enumerate(report["steps"]):
            where = f"[{impl}, {mode}, rank {rank}, step {step}]"
            expected = forward
            if impl == "fsdp2" and mode == "default" and step > 0:
                expected = FSDP2_CPU_FORWARD
            assert e["forward"] == expected, (
                f"{where} forward:\n  got      {e['forward']}\n  expected {expected}"
            )
            assert e["backward"] == backward, (
                f"{where} backward:\n  got      {e['backward']}\n  expected {backward}"
            )
            name, diff = e["param_worst"]
            assert diff <= TOL, f"{where} parameter {name} differs from the reference by {diff:.3g}"


class Outer(nn.Module):
    """A block whose ``inner`` layer is its own group: backward uses ``down`` (the block's
    group) before ``inner``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.inner = nn.Linear(hidden, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.inner(torch.tanh(self.up(x)))))


class NestedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN_DIM, 16)
        self.blocks = nn.ModuleList([Outer(16, 8), Outer(16, 12)])
        self.head = nn.Linear(16, IN_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def nested_group_of(name: str) -> str:
    parts = name.split(".")
    if parts[0] != "blocks":
        return "root"
    return ".".join(parts[:3]) if parts[2] == "inner" else ".".join(parts[:2])


def nested_prefetch(impl: str) -> dict:
    """Rank function: the all-gathers issued in backward, in issue order."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    ref = NestedNet()
    deterministic_init(ref, 0)
    model = clone_model(ref)
    fully_shard, mesh = get_fully_shard(impl), make_mesh()
    for block in model.blocks:
        fully_shard(block.inner, mesh=mesh)
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    numels: dict[str, int] = {}
    for name, p in ref.named_parameters():
        group = nested_group_of(name)
        per_rank = math.ceil(p.shape[0] / ws) * math.prod(p.shape[1:])
        numels[group] = numels.get(group, 0) + per_rank
    ref_opt, opt = adamw(ref), adamw(model)
    with CollectiveLog({n: g for g, n in numels.items()}) as log:
        for step in range(2):
            batch = global_batch(step, 2 * ws)
            reference_step(ref, ref_opt, batch)
            loss = mse(model, rank_slice(batch, rank, ws))
            log.phase = f"backward{step}"
            loss.backward()
            log.phase = ""
            opt.step()
            opt.zero_grad()
    return {
        "backward": [log.groups("AG", f"backward{step}") for step in range(2)],
        "param_worst": max_param_diff(ref, model),
    }


@pytest.mark.parametrize("impl", IMPLS)
def test_default_backward_prefetch_nested(impl: str) -> None:
    require_impl(impl)
    expected = ["blocks.1", "blocks.1.inner", "blocks.0", "blocks.0.inner"]
    for rank, report in enumerate(run_ranks(nested_prefetch, 2, impl)):
        for step, gathers in enumerate(report["backward"]):
            assert gathers == expected, f"[{impl}, rank {rank}, step {step}] {gathers}"
        name, diff = report["param_worst"]
        assert diff <= TOL, f"[{impl}, rank {rank}] {name} differs by {diff:.3g}"


DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "prefetch.md"


def test_docs_example() -> None:
    require_impl("fsdp2")
    assert all(run_ranks(exec_doc_example, 2, first_python_block(DOC), str(DOC)))


class Alternating(nn.Module):
    """Two blocks applied alternately, twice each (weights shared across depth): the
    recorded forward order cycles (``a`` -> ``b`` -> ``a``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN_DIM, 8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.out = nn.Linear(8, IN_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for _ in range(2):
            h = torch.tanh(self.b(torch.tanh(self.a(h))))
        return self.out(h)


def alternating_blocks(reshard: bool) -> float:
    """Rank function: no-grad forwards (the blocks stay gathered without resharding), then
    training steps; the largest difference from the unsharded model."""
    torch.manual_seed(0)
    ref = Alternating()
    model = clone_model(ref)
    fully_shard = get_fully_shard("fsdp2")
    for block in (model.a, model.b):
        fully_shard(block, reshard_after_forward=reshard)
    fully_shard(model)
    ref_opt, opt = adamw(ref), adamw(model)  # before the forwards that leave groups gathered
    worst = 0.0
    with torch.no_grad():
        for step in range(3):
            x = global_batch(100 + step, 2)[0]
            worst = max(worst, (model(x) - ref(x)).abs().max().item())
    data_parallel_steps(model, ref, opt, ref_opt)
    return max(worst, max_param_diff(ref, model)[1])


@pytest.mark.parametrize("reshard", [False, True])
def test_forward_prefetch_follows_a_cycling_order(reshard: bool) -> None:
    """The CPU forward prefetch follows the recorded order through groups that keep their
    parameters; with blocks called alternately that order cycles, and a chain of
    already-gathered groups looped forever (a hang, caught by the timeout)."""
    require_impl("fsdp2")
    for diff in run_ranks(alternating_blocks, 2, reshard, timeout=60):
        assert diff <= TOL, diff


class TrunkAndHead(nn.Module):
    """``Net``'s layers, with the head applied by the loss, chunk by chunk."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.inp, self.blocks, self.head = net.inp, net.blocks, net.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return h


def trunk_backward_after_chunks(impl: str) -> dict:
    """Rank function: the events of the trunk's backward, after the head's chunks had
    their own backwards (their final callbacks ran first)."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    fully_shard = get_fully_shard(impl)
    ref = build_net()
    model = TrunkAndHead(clone_model(ref))
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model.head)
    fully_shard(model)
    numels = group_numels(ref, ws)  # the root's entry counts the head: split it
    head = sum(math.ceil(p.shape[0] / ws) * math.prod(p.shape[1:]) for p in ref.head.parameters())
    root = next(n for n, g in numels.items() if g == "root")
    numels = {n: g for n, g in numels.items() if g != "root"} | {head: "head", root - head: "root"}
    out: dict = {"steps": []}
    with CollectiveLog(numels):
        for step in range(2):
            x, y = rank_slice(global_batch(step, 2 * ws), rank, ws)
            with recording_events() as events:
                hidden = model(x)
                detached = hidden.detach().requires_grad_()
                for chunk, target in zip(detached.chunk(2), y.chunk(2)):
                    torch.nn.functional.mse_loss(model.head(chunk), target).backward()
                events.append("trunk")
                hidden.backward(detached.grad)
            out["steps"].append(events[events.index("trunk") + 1 :])
            model.zero_grad()
    return out


def test_trunk_backward_after_chunked_head_prefetches() -> None:
    """The final callback of each chunk's backward used to forget the forward order, so the
    trunk's backward, which runs later on the same forward, prefetched nothing: each block
    gathered itself at its own pre-backward (torch's ``fully_shard`` loses the order the
    same way). The order is kept while a forward's backward is still to come."""
    require_impl("fsdp2")
    for rank, report in enumerate(run_ranks(trunk_backward_after_chunks, 2, "fsdp2")):
        for step, events in enumerate(report["steps"]):
            for i in (3, 2, 1):  # block i-1 is gathered before block i's backward runs
                assert events.index(AG(i - 1)) < events.index(f"B{i}"), (rank, step, events)
            assert [e for e in events if e.startswith("B")] == ["B3", "B2", "B1", "B0"]
