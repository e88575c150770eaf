"""Differential tests: fsdp2 against torch's ``fully_shard`` and against a DDP-like replica,
bitwise in fp32.

``test_replica_bitwise``: regression cases found by differential fuzzing. At world size 2
in fp32 a sharded model must compute exactly what a non-sharded replica on each rank
computes with its gradients averaged as ``(g0 + g1) / 2`` (what DDP does): the same
kernels on the same values, and a sum of two terms does not depend on its order.

When a case fails, look first at:

* whether the ``torch`` case fails too: then the case (or the replica) is wrong, not fsdp2;
* the first differing quantity: a loss points at forward (the unsharded parameters'
  values, or their memory layout: CPU matmuls round differently for unaligned weights), a
  gradient with equal losses at backward (autograd nodes fsdp2 adds change the order in
  which gradients of a reused tensor are summed) or at the reduce-scatter.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _helpers import IMPLS, get_fully_shard, make_mesh, require_impl
from _launcher import run_ranks
from torch import nn


class _Scale(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class _Residual(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(x)


class _ParamlessWrapperNet(nn.Module):
    """``block`` is applied twice; sharded, it manages no parameters (its Linear is a
    group of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.block = _Residual(4)
        self.head = nn.Linear(4, 7, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.head(self.block(h) + self.block(0.5 * h))


def _build(name: str) -> tuple[nn.Module, list[str]]:
    """The model and the names of the submodules to shard (bottom-up; the root last)."""
    torch.manual_seed(0)
    if name == "unaligned_weights":
        # One group; the (1,)-shaped scale comes first, so at world size 2 the weights
        # after it would start 8 bytes into the unsharded buffer if packed back to back.
        model = nn.Sequential(_Scale(1), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3))
        return model, [""]
    if name == "paramless_wrapper":
        return _ParamlessWrapperNet(), ["block.lin", "block", ""]
    raise ValueError(name)


def _batch(name: str, step: int, ws: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    if name == "paramless_wrapper":
        x = torch.randint(0, 7, (2 * ws, 3), generator=gen)
        y = torch.randint(0, 7, (2 * ws, 3), generator=gen)
        return x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]
    # One row per rank: matrix-vector products are the alignment-sensitive kernels.
    x, y = torch.randn(ws, 7, generator=gen), torch.randn(ws, 3, generator=gen)
    return x[rank : rank + 1], y[rank : rank + 1]


def _loss(name: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if name == "paramless_wrapper":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return F.mse_loss(out, y)


def _average_grads_like_ddp(model: nn.Module) -> None:
    ws = dist.get_world_size()
    for p in model.parameters():
        parts = [torch.empty_like(p.grad) for _ in range(ws)]
        dist.all_gather(parts, p.grad)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        p.grad = total / ws


def rank_replica_bitwise(impl: str, name: str, steps: int) -> list[str]:
    rank, ws = dist.get_rank(), dist.get_world_size()
    fully_shard = get_fully_shard(impl)
    replica, to_shard = _build(name)
    model = copy.deepcopy(replica)
    mesh = make_mesh()
    for sub in to_shard:
        fully_shard(model.get_submodule(sub), mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    replica_opt = torch.optim.SGD(replica.parameters(), lr=0.1, momentum=0.9)
    problems: list[str] = []
    for step in range(steps):
        x, y = _batch(name, step, ws, rank)
        loss = _loss(name, model(x), y)
        loss.backward()
        expected = _loss(name, replica(x), y)
        expected.backward()
        _average_grads_like_ddp(replica)
        if not torch.equal(loss, expected):
            problems.append(f"rank {rank} step {step}: loss {loss.item()!r} vs {expected.item()!r}")
        for (n, p), q in zip(model.named_parameters(), replica.parameters()):
            if not torch.equal(p.grad.full_tensor(), q.grad):
                problems.append(f"rank {rank} step {step}: grad of {n}")
        opt.step()
        replica_opt.step()
        opt.zero_grad()
        replica_opt.zero_grad()
        for (n, p), q in zip(model.named_parameters(), replica.parameters()):
            if not torch.equal(p.detach().full_tensor(), q.detach()):
                problems.append(f"rank {rank} after step {step}: parameter {n}")
    return problems


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ["unaligned_weights", "paramless_wrapper"])
def test_replica_bitwise(impl: str, name: str) -> None:
    """unaligned_weights: fsdp2 packed unsharded parameters back to back, and MKL's matmul
    rounds differently for a weight that is not 16-byte aligned. paramless_wrapper: fsdp2
    put a post-backward autograd node on the inputs of a sharded module without
    parameters (torch adds none), which reordered the sum of the gradients of ``h``."""
    require_impl(impl)
    problems = [p for rank in run_ranks(rank_replica_bitwise, 2, impl, name, 3) for p in rank]
    assert not problems, f"{impl} differs from the DDP-like replica:\n" + "\n".join(problems[:20])
