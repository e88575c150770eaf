"""``torch.compile`` of sharded blocks: the FSDP hooks stay out of the graph (they resize
storages and copy into aliased views, which AOTAutograd rejects), so compiling a block
before or after ``fully_shard``, or the whole sharded model (``torch.compile(model)``,
whose graph breaks at the root's hooks), trains exactly like eager. Compile time dominates
these tests (~10 s per rank), so there are three of them."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _helpers import get_fully_shard, require_impl
from _launcher import run_ranks
from torch import nn

WORLD_SIZE = 2
STEPS = 2


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 4))


def rank_compiled_blocks(impl: str, mode: str) -> dict:
    rank, ws = dist.get_rank(), dist.get_world_size()
    fully_shard = get_fully_shard(impl)
    ref = _mlp()
    model = copy.deepcopy(ref)
    for block in (model[0], model[2], model[3]):
        if mode == "compile-then-shard":
            block.compile(backend="aot_eager")
            fully_shard(block)
        else:
            fully_shard(block)
            if mode == "shard-then-compile":
                block.compile(backend="aot_eager")
    fully_shard(model)
    if mode == "compiled-root":  # the whole sharded model: its hooks break the graph
        model = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    rows = 2
    with torch.no_grad():  # an inference call first, as in evaluation before training
        model(torch.randn(rows, 8, generator=gen))
    for _ in range(STEPS):
        x = torch.randn(ws * rows, 8, generator=gen)
        model(x[rank * rows : (rank + 1) * rows]).pow(2).sum().backward()
        ref(x).pow(2).sum().div(ws).backward()  # the gradient average over ranks
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    diffs = [
        (p.full_tensor() - q).abs().max().item()
        for p, q in zip(model.parameters(), ref.parameters())
    ]
    return {"max_diff": max(diffs)}


@pytest.mark.parametrize("mode", ["shard-then-compile", "compile-then-shard", "compiled-root"])
def test_compiled_blocks_match_non_sharded(mode: str) -> None:
    require_impl("fsdp2")
    reports = run_ranks(rank_compiled_blocks, WORLD_SIZE, "fsdp2", mode, timeout=300)
    for rank, rep in enumerate(reports):
        assert rep["max_diff"] <= 1e-5, (rank, rep)
