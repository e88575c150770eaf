"""Ranks that run different paths through the sharded modules, under
``TORCH_DISTRIBUTED_DEBUG=DETAIL``: every rank raises, naming what each rank was about to
issue, instead of mixing two modules' data or hanging (see
[Note: ranks that run different paths] in ``fsdp2/_comm_context.py``).

Without the debug switch (and without fsdp2's divergence checks) the same runs mix data,
hang or make gloo abort the process, in fsdp2 as in torch's ``fully_shard``; the
divergence checks, on by default, are tested in ``tests/test_divergence.py``. Here the
strict check runs first and raises before any collective pairs up wrongly. Each rank
function catches its own error and returns the message, so a rank that did not raise
shows up as a wrong message, not as a timeout.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _launcher import run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
import fsdp2._collectives as collectives
import fsdp2._fingerprints as fingerprints


class Blocks(nn.Module):
    """Four equal blocks: a skipped block's all-gather meets the next one's, same size."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor, skip: int = -1, detach: int = -1) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i == skip:
                continue
            y = torch.relu(block(x))
            x = x + (y.detach() if i == detach else y)
        return x.sum()


@contextlib.contextmanager
def _debug_level(level: Any) -> Iterator[None]:
    """Set torch's distributed debug level for this rank (the pool's processes are reused,
    so it is restored)."""
    before = dist.get_debug_level()
    dist.set_debug_level(level)
    try:
        yield
    finally:
        dist.set_debug_level(before)


def _sharded(mesh: Any = None, **kwargs: Any) -> Blocks:
    torch.manual_seed(0)
    model = Blocks()
    for block in model.blocks:
        fsdp2.fully_shard(block, mesh=mesh, **kwargs)
    fsdp2.fully_shard(model, mesh=mesh, **kwargs)
    return model


def _first_error(model: Blocks, steps: list[dict[str, Any]]) -> str:
    """Run one forward and backward per entry of ``steps`` (forward keyword arguments);
    return the first error's type and message, or ``"no error"``."""
    try:
        for kwargs in steps:
            model(torch.randn(2, 8), **kwargs).backward()
    except RuntimeError as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _rank_1_diverges(second_step: dict[str, Any]) -> str:
    """One step on the same path everywhere, then a second in which rank 1 alone passes
    ``second_step`` to the forward."""
    with _debug_level(dist.DebugLevel.DETAIL):
        model = _sharded()
        return _first_error(model, [{}, second_step if dist.get_rank() == 1 else {}])


def test_module_skipped_on_one_rank_is_named() -> None:
    """Rank 1 skips ``blocks.2`` in the second step's forward. The CPU's forward prefetch,
    which follows the first step's order, gathers ``blocks.2`` on every rank, so the paths
    first differ in backward: rank 1's all-gather of ``blocks.1`` (same size) would meet
    the others' ``blocks.2``."""
    messages = run_ranks(_rank_1_diverges, 2, {"skip": 2}, timeout=60)
    assert messages[0] == messages[1], messages
    assert "about to issue different collectives" in messages[0]
    # 2 ranks x 36 elements, each slot with the divergence checks' 16-byte tail (4 fp32).
    numel = 2 * fingerprints.tailed_numel(36, torch.float32)
    assert f"rank 0: all-gather of blocks.2 (Linear), {numel} elements" in messages[0]
    assert f"rank 1: all-gather of blocks.1 (Linear), {numel} elements" in messages[0]
    assert "ran different paths through the sharded modules" in messages[0]


def test_module_left_out_of_backward_on_one_rank_is_named() -> None:
    """Rank 1's loss does not reach ``blocks.2``'s parameters: its backward never gathers
    them again, so its next collective is another group's."""
    messages = run_ranks(_rank_1_diverges, 4, {"detach": 2}, timeout=60)
    assert len(set(messages)) == 1, messages
    assert "ranks 0, 2, 3: all-gather of blocks.2 (Linear)" in messages[0]
    assert "rank 1: " in messages[0]
    assert "ran different paths" in messages[0]


def _frozen_on_one_rank() -> str:
    with _debug_level(dist.DebugLevel.DETAIL):
        model = _sharded()
        first = _first_error(model, [{}])
        if dist.get_rank() == 1:  # after lazy init, which checks the layouts once
            model.blocks[1].bias.requires_grad_(False)
        return first + " | " + _first_error(model, [{}])


def test_parameter_frozen_on_one_rank_is_named() -> None:
    """A reduce-scatter carries the trainable parameters: a bias frozen on rank 1 only
    shrinks its message (gloo would abort the process)."""
    messages = run_ranks(_frozen_on_one_rank, 2, timeout=60)
    assert messages[0] == messages[1], messages
    first, _, second = messages[0].partition(" | ")
    assert first == "no error"
    assert "reduce-scatter of the gradients of blocks.1 (Linear)" in second
    assert "rank 0: " in second and "rank 1: " in second
    assert "requires_grad was changed on some ranks only" in second


def _train(level: Any, hsdp: bool) -> tuple[list[torch.Tensor], int]:
    """Three steps with HSDP, prefetch, ``reshard_after_forward`` int and gradient
    accumulation without all-reduce; the parameters after them and how many collectives
    were checked."""
    checks = 0
    real = collectives.min_and_max

    def counting(*args: Any) -> tuple[int, int]:
        nonlocal checks
        checks += 1
        return real(*args)

    collectives.min_and_max = counting  # descriptions_if_different looks it up here
    try:
        with _debug_level(level):
            world = dist.get_world_size()
            shape, names = ((2, world // 2), ("replicate", "shard")) if hsdp else ((world,), None)
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            model = _sharded(mesh, reshard_after_forward=2 if not hsdp else True)
            blocks = list(model.blocks)
            for block, following in itertools.pairwise(blocks):
                block.set_modules_to_forward_prefetch([following])
                following.set_modules_to_backward_prefetch([block])
            optim = torch.optim.SGD(model.parameters(), lr=0.1)
            torch.manual_seed(dist.get_rank())
            for _ in range(3):
                for micro in range(2):
                    model.set_requires_all_reduce(micro == 1, recurse=True) if hsdp else None
                    model.set_requires_gradient_sync(micro == 1 or hsdp)
                    model(torch.randn(2, 8)).backward()
                optim.step()
                optim.zero_grad()
            return [p.full_tensor() for p in model.parameters()], checks
    finally:
        collectives.min_and_max = real


@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp", "hsdp"])
def test_checks_change_nothing_when_ranks_agree(hsdp: bool) -> None:
    """Ranks on the same path pass every check, and the results are bitwise those of the
    same run without the debug switch, which checks nothing after lazy init."""
    plain = run_ranks(_train, 4, dist.DebugLevel.OFF, hsdp, timeout=90)
    checked = run_ranks(_train, 4, dist.DebugLevel.DETAIL, hsdp, timeout=90)
    assert all(count == 0 for _, count in plain)
    assert all(count > 0 for _, count in checked)
    for (params, _), (params_checked, _) in zip(plain, checked, strict=True):
        for p, q in zip(params, params_checked, strict=True):
            assert torch.equal(p, q)


class _FailingWork:
    """A ``Work`` whose wait fails as gloo's does when a peer is gone."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        raise dist.DistBackendError("Connection reset by peer (simulated)")


@contextlib.contextmanager
def _failing(name: str, when_issued: bool) -> Iterator[None]:
    """``torch.distributed.<name>`` fails: when issued (as on an accelerator, where the
    collective runs synchronously on a side stream) or when waited on (the CPU)."""
    real = getattr(dist, name)

    def fail(*args: Any, **kwargs: Any) -> Any:
        if when_issued:
            raise dist.DistBackendError("Connection reset by peer (simulated)")
        return _FailingWork()

    setattr(dist, name, fail)
    try:
        yield
    finally:
        setattr(dist, name, real)


def _failed_collective(name: str, when_issued: bool) -> dict[str, Any]:
    mesh = None
    if name == "all_reduce":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _sharded(mesh)
    model(torch.randn(2, 8)).backward()  # lazy init and a first step go through
    with _failing(name, when_issued):
        try:
            model(torch.randn(2, 8)).backward()
        except RuntimeError as error:
            return {"type": type(error).__name__, "notes": getattr(error, "__notes__", [])}
    return {"type": "no error", "notes": []}


COLLECTIVE_NAMES = {
    "all_gather": "all-gather of blocks.0 (Linear)",
    "reduce_scatter": "reduce-scatter of the gradients of blocks.3 (Linear)",
    "all_reduce": "all-reduce of the gradients of blocks.3 (Linear)",
}


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes need Python 3.11")
@pytest.mark.parametrize("when_issued", [False, True], ids=["at-wait", "at-issue"])
@pytest.mark.parametrize("kind", list(COLLECTIVE_NAMES))
def test_a_failed_collective_names_the_module(kind: str, when_issued: bool) -> None:
    """A backend error names no module; fsdp2 adds a note naming the collective this rank
    was in, and keeps the backend's exception class (``DistBackendError``)."""
    # The functions fsdp2 calls (torch < 2.13 has no all_gather_single).
    name = {
        "all_gather": "all_gather_single",
        "reduce_scatter": "reduce_scatter_single",
        "all_reduce": "all_reduce",
    }[kind]
    if not hasattr(dist, name):
        name = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor"}[
            kind
        ]
    reports = run_ranks(_failed_collective, 4 if kind == "all_reduce" else 2, name, when_issued)
    for report in reports:
        assert report["type"] == "DistBackendError", report
        (note,) = report["notes"]
        assert f"this rank was in the {COLLECTIVE_NAMES[kind]} when the collective" in note
        assert "TORCH_DISTRIBUTED_DEBUG=DETAIL" in note
