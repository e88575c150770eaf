"""Parameters that some ranks use and others do not (data-dependent routing, as in
mixture-of-experts models) must neither hang nor lose updates.

Each rank routes its batch through one expert chosen by its rank (the experts live in the
root group, next to parameters every rank uses); a third expert is used by no rank; the
block's own group is used by every rank (a group whose forward some ranks skip would leave
its all-gather unmatched: every rank must run the same groups, see docs/fully_shard.md).
The reference is one
unsharded model whose loss is the mean of every rank's loss with that rank's routing.
AdamW with weight decay tells a ``None`` gradient (parameter skipped) from a zero gradient
(decayed), so the parameters match only if exactly the globally unused parameters keep
``grad is None``, as in the reference.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _helpers import IMPLS, get_fully_shard, make_mesh, require_impl, torch_fsdp_has
from _launcher import run_ranks
from torch import nn


class Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 6)
        self.experts = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
        self.block = nn.Linear(6, 6)
        self.out = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor, expert: int, use_block: bool) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        h = self.experts[expert](h)
        if use_block:
            h = self.block(h)
        return self.out(h)


def routing(rank: int) -> tuple[int, bool]:
    return rank % 2, True  # expert 2 is never used


def train_routed(impl: str, steps: int) -> float:
    """Rank function: max abs parameter diff from the unsharded reference."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = Routed()
    model = copy.deepcopy(ref)
    fully_shard = get_fully_shard(impl)
    mesh = make_mesh()
    fully_shard(model.block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        data = torch.randn(ws, 4, 6, generator=torch.Generator().manual_seed(step))
        loss = model(data[rank], *routing(rank)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = sum(ref(data[r], *routing(r)).pow(2).mean() for r in range(ws)) / ws
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return max(
        (p.full_tensor() - q).abs().max().item()
        for p, q in zip(model.parameters(), ref.parameters())
    )


@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_dependent_unused_params(world_size: int) -> None:
    require_impl("fsdp2")
    diffs = run_ranks(train_routed, world_size, "fsdp2", 3, timeout=60)
    assert max(diffs) <= 1e-5, diffs


@pytest.mark.parametrize("impl", IMPLS)
def test_all_ranks_same_routing(impl: str) -> None:
    """World size 1: routing is rank-independent, so torch's fully_shard handles it too
    (the reference run of this test)."""
    require_impl(impl)
    diffs = run_ranks(train_routed, 1, impl, 3, timeout=60)
    assert max(diffs) <= 1e-5, diffs


def train_reducing_unused(impl: str, reduce_unused: bool) -> dict:
    """Rank function: rank-dependent routing with ``set_reduce_scatter_unused_params``;
    which gradients exist after each backward, and the parameters after AdamW steps
    (weight decay moves a parameter with a zero gradient, not one with ``None``)."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Routed()
    fully_shard = get_fully_shard(impl)
    fully_shard(model.block)
    fully_shard(model)
    model.set_reduce_scatter_unused_params(reduce_unused)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    has_grad = []
    for step in range(2):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x, *routing(rank)).pow(2).mean().backward()
        has_grad.append(sorted(n for n, p in model.named_parameters() if p.grad is not None))
        opt.step()
        opt.zero_grad()
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    return {"has_grad": has_grad, "params": params}


def test_reduce_scatter_unused_params_gives_zero_gradients() -> None:
    """With ``set_reduce_scatter_unused_params(True)`` torch gives a parameter that no rank
    used a zero gradient (its group reduced it); fsdp2 left it ``None`` whatever the
    setting (torch's test of an unused expert DTensor parameter). Each rank routes through
    its own expert (torch needs the switch for that), the third expert is unused: the
    gradients present and the parameters after AdamW match torch's bitwise."""
    ours = run_ranks(train_reducing_unused, 2, "fsdp2", True, timeout=60)
    every = sorted(n for n, _ in Routed().named_parameters())
    for mine in ours:
        assert mine["has_grad"] == [every, every]
    if torch_fsdp_has("", "FSDPModule.set_reduce_scatter_unused_params"):  # not in 2.11
        theirs = run_ranks(train_reducing_unused, 2, "torch", True, timeout=60)
        for mine, torchs in zip(ours, theirs):
            assert mine["has_grad"] == torchs["has_grad"]
            for name, value in mine["params"].items():
                assert torch.equal(value, torchs["params"][name]), name
    # The default keeps ``None`` for the parameters no rank used.
    (default, _) = run_ranks(train_reducing_unused, 2, "fsdp2", False, timeout=60)
    assert "experts.2.weight" not in default["has_grad"][0]
    assert "experts.0.weight" in default["has_grad"][0]
