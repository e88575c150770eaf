"""Module inputs and outputs: dataclass instances pytree does not know get the
mixed-precision casts and the backward triggers like any container's, and an output that
is a view keeps its trigger when the caller modifies it in place. Without the trigger,
backward ran on resharded (freed) parameters ("setStorage: ... out of bounds for storage
of size 0")."""

from __future__ import annotations

import copy
import dataclasses
import importlib
from collections.abc import Iterable

import pytest
import torch
import torch.distributed as dist
from _helpers import IMPLS, get_fully_shard, require_impl, require_impl_feature, torch_fsdp_has
from _launcher import run_ranks
from torch import nn

DIM = 4


@dataclasses.dataclass
class Hidden:
    x: torch.Tensor
    scale: float = 1.0


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, h: Hidden) -> Hidden:
        return Hidden(torch.tanh(self.linear(h.x)) * h.scale, h.scale)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.out = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = Hidden(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h.x)


def _train_against_reference(
    model: nn.Module, ref: nn.Module, replicated: Iterable[torch.Tensor] = ()
) -> float:
    """Two SGD steps of ``model`` on this rank's rows and of the non-sharded ``ref`` on the
    whole batch; ``replicated`` parameters (not sharded) get their gradients averaged
    here, as DDP would. Returns the largest parameter difference afterwards."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(2 * ws, DIM, generator=gen)
        model(x[2 * rank : 2 * rank + 2]).pow(2).sum().backward()
        for p in replicated:
            dist.all_reduce(p.grad)
            p.grad /= ws
        (ref(x).pow(2).sum() / ws).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    return max(
        ((p.full_tensor() if hasattr(p, "full_tensor") else p) - q).abs().max().item()
        for p, q in zip(model.parameters(), ref.parameters())
    )


def rank_dataclass_io(impl: str) -> dict:
    fully_shard = get_fully_shard(impl)
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    diff = _train_against_reference(model, ref)
    # Mixed precision casts inside dataclasses: inputs to param_dtype, outputs to output_dtype.
    package = importlib.import_module("fsdp2" if impl == "fsdp2" else "torch.distributed.fsdp")
    policy = package.MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    block = Block()
    fully_shard(block, mp_policy=policy)
    out = block(Hidden(torch.randn(2, DIM)))
    return {"max_diff": diff, "out": (type(out).__name__, str(out.x.dtype), out.scale)}


@pytest.mark.parametrize("impl", IMPLS)
def test_dataclass_inputs_and_outputs(impl: str) -> None:
    # torch < 2.13 finds the outputs to hook for backward with tree_flatten, which does not
    # look inside a dataclass pytree does not know: the error above. 2.13 traverses
    # dataclasses (torch.distributed.fsdp._common_utils.collect_grad_tensors).
    require_impl_feature(
        impl,
        torch_fsdp_has("_common_utils", "collect_grad_tensors"),
        "_common_utils.collect_grad_tensors (backward hooks on tensors inside dataclasses)",
    )
    for rep in run_ranks(rank_dataclass_io, 2, impl):
        assert rep["max_diff"] <= 1e-6, (impl, rep)
        assert rep["out"] == ("Hidden", "torch.float32", 1.0), (impl, rep)


def rank_global_ignored_params(impl: str) -> dict:
    """One ``ignored_params`` set passed to every fully_shard call (torch allows it): each
    call ignores the parameters it owns. Ignored parameters stay plain, replicated tensors
    whose gradients the user reduces (here: an all-reduce, as DDP would)."""
    fully_shard = get_fully_shard(impl)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, 1))
    model = copy.deepcopy(ref)
    ignored = {model[1].weight, model[1].bias}
    fully_shard(model[0], ignored_params=ignored)
    fully_shard(model[1], ignored_params=ignored)
    fully_shard(model, ignored_params=ignored)
    diff = _train_against_reference(model, ref, replicated=ignored)
    kinds = [type(p).__name__ for p in model[1].parameters()]
    return {"max_diff": diff, "ignored_kinds": kinds}


def test_one_ignored_params_set_for_every_call() -> None:
    for impl in ("fsdp2", "torch"):
        require_impl(impl)
        for rep in run_ranks(rank_global_ignored_params, 2, impl):
            assert rep["max_diff"] <= 1e-6, (impl, rep)
            assert rep["ignored_kinds"] == ["Parameter", "Parameter"], (impl, rep)


class ViewBlock(nn.Module):
    """Returns a view of its linear layer's output."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2 * DIM, 2 * DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.tanh(x)).view(x.shape[0], 2, DIM)


class InPlaceOnViews(nn.Module):
    """Modifies its blocks' view outputs in place, or (``clone``) copies of them."""

    def __init__(self, clone: bool) -> None:
        super().__init__()
        self.clone = clone
        self.a, self.b = ViewBlock(), ViewBlock()
        self.head = nn.Linear(2 * DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        y = y.clone() if self.clone else y
        y += 0.5
        z = self.b(y.reshape(x.shape[0], -1))
        z = z.clone() if self.clone else z
        z.mul_(2.0)
        return self.head(z.reshape(x.shape[0], -1))


def _in_place_on_view_outputs(impl: str, clone: bool) -> dict:
    torch.manual_seed(0)
    ref = InPlaceOnViews(clone)
    model = copy.deepcopy(ref)
    fully_shard = get_fully_shard(impl)
    fully_shard(model.a)
    fully_shard(model.b)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    rank = dist.get_rank()
    for step in range(3):
        x = torch.randn(4, 2 * DIM, generator=torch.Generator().manual_seed(step))
        model(x[2 * rank : 2 * rank + 2]).pow(2).sum().backward()
        ref(x).pow(2).sum().div(2).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    return {
        "diff": max(
            (p.full_tensor() - r).abs().max().item()
            for p, r in zip(model.parameters(), ref.parameters())
        ),
        "params": [p.full_tensor() for p in model.parameters()],
    }


def test_in_place_op_on_a_view_output() -> None:
    """A block returning ``h.view(...)`` whose caller does ``y += 0.5``: autograd rebases
    the view, dropping a hook on it. fsdp2 also hooks the view's base, so backward
    unshards in time: parity with the reference, and bitwise equal to torch on the same
    model with ``.clone()`` before the in-place ops (torch itself fails without the
    clone, on freed parameters)."""
    require_impl("torch")
    fsdp2 = run_ranks(_in_place_on_view_outputs, 2, "fsdp2", False)
    torch_clone = run_ranks(_in_place_on_view_outputs, 2, "torch", True)
    for mine, theirs in zip(fsdp2, torch_clone):
        assert mine["diff"] <= 1e-5, mine["diff"]
        assert all(torch.equal(a, b) for a, b in zip(mine["params"], theirs["params"]))
