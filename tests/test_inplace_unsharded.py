"""In-place changes to unsharded parameters are written back to the shards (see
[Note: in-place changes to unsharded parameters] in ``fsdp2/_param.py``).

torch's ``fully_shard`` drops them when it reshards: ``Embedding(max_norm=...)`` trains
away from the non-sharded model, and an edit between ``unshard()`` and ``reshard()`` is
lost. Each test here fails without the write-back.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _launcher import run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import fsdp2


class MaxNormModel(nn.Module):
    """An embedding that renormalizes the rows it looks up (in place, during forward),
    then two blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 8, max_norm=1.0)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids).mean(1)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _init(model: nn.Module) -> None:
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))  # rows well above max_norm


def _max_norm_parity(variant: str) -> float:
    """Every rank trains on the same batch, so every rank renormalizes the same rows and
    the sharded model must follow the non-sharded one; returns the largest difference."""
    torch.manual_seed(0)
    model = MaxNormModel()
    _init(model)
    reference = copy.deepcopy(model)
    if variant == "own-group":  # resharded after forward: written back, gathered again
        fsdp2.fully_shard(model.emb, reshard_after_forward=True)
    for block in model.blocks:
        fsdp2.fully_shard(block)
    fsdp2.fully_shard(model)  # the root stays unsharded into backward
    if variant == "kept-after-backward":  # written back at the end of backward
        model.set_reshard_after_backward(False)
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=0.05)
    worst = 0.0
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 30, (4, 5), generator=gen)
        target = torch.randn(4, 3, generator=gen)
        for m, opt in ((model, optim), (reference, ref_optim)):
            nn.functional.mse_loss(m(ids), target).backward()
            opt.step()
            opt.zero_grad()
        shards = optim.param_groups[0]["params"]  # kept unsharded: not what modules hold
        for p, q in zip(shards, reference.parameters(), strict=True):
            worst = max(worst, (p.full_tensor() - q.detach()).abs().max().item())
    return worst


@pytest.mark.parametrize("variant", ["root", "own-group", "kept-after-backward"])
def test_embedding_max_norm_trains_like_the_non_sharded_model(variant: str) -> None:
    worst = run_ranks(_max_norm_parity, 2, variant, timeout=60)
    assert max(worst) <= 1e-6, worst


def _edit_between_unshard_and_reshard(kind: str) -> dict[str, Any]:
    """``unshard()``, edit the unsharded parameters under ``no_grad``, ``reshard()``: the
    shards hold the edit. Returns the sharded parameters' full values before and after."""
    torch.manual_seed(0)
    kwargs: dict[str, Any] = {}
    model: nn.Module = nn.Linear(6, 7)  # 7 rows: uneven (padded) shards on 2 and 4 ranks
    if kind == "bf16":
        kwargs["mp_policy"] = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    elif kind == "offload":
        kwargs["offload_policy"] = fsdp2.CPUOffloadPolicy(pin_memory=False)
    elif kind == "shard-dim1":
        model = nn.Linear(8, 6)
        kwargs["shard_placement_fn"] = lambda p: Shard(p.dim() - 1)
    elif kind == "mixed-dtypes":
        model.bias.data = model.bias.data.double()  # one group, a byte buffer
    elif kind == "hsdp":
        kwargs["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    fsdp2.fully_shard(model, **kwargs)
    before = {n: p.full_tensor() for n, p in model.named_parameters()}
    model.unshard()
    with torch.no_grad():
        weight = model.weight  # the unsharded parameter now
        assert not isinstance(weight, torch.distributed.tensor.DTensor)
        weight[1].mul_(3.0)  # one row: in bf16 the other rows must keep full precision
        model.bias.add_(1.0)
    model.reshard()
    after = {n: p.full_tensor() for n, p in model.named_parameters()}
    return {"before": before, "after": after, "rank": dist.get_rank()}


@pytest.mark.parametrize(
    "kind,world_size",
    [
        ("fp32", 2),
        ("fp32", 3),
        ("bf16", 2),
        ("offload", 2),
        ("shard-dim1", 2),
        ("mixed-dtypes", 2),
        ("hsdp", 4),
    ],
)
def test_edit_between_unshard_and_reshard_is_kept(kind: str, world_size: int) -> None:
    results = run_ranks(_edit_between_unshard_and_reshard, world_size, kind, timeout=60)
    before, after = results[0]["before"], results[0]["after"]
    weight, bias = before["weight"].clone(), before["bias"]
    if kind == "bf16":  # the edit was made on the bf16 copy: that row is rounded
        weight[1] = (weight[1].to(torch.bfloat16) * 3.0).float()
    else:
        weight[1] *= 3.0
    assert torch.equal(after["weight"], weight)  # the other rows bitwise, also in bf16
    expected_bias = (bias.to(torch.bfloat16) + 1.0).float() if kind == "bf16" else bias + 1.0
    assert torch.equal(after["bias"], expected_bias)
    for other in results[1:]:  # every rank sees the same parameters
        for name in after:
            assert torch.equal(other["after"][name], after[name])


def _edit_then_optimizer_step() -> str:
    """A forward without backward changes the kept unsharded embedding (``max_norm``),
    then the shards are updated: one change would be lost, so the next forward raises."""
    torch.manual_seed(0)
    model = MaxNormModel()
    _init(model)
    fsdp2.fully_shard(model, reshard_after_forward=False)
    shards = list(model.parameters())
    ids = torch.randint(0, 30, (4, 5))
    with torch.no_grad():
        model(ids)  # stays unsharded, its looked-up rows renormalized in place
        for p in shards:
            p.add_(0.1)  # what optimizer.step() does to the DTensor parameters
    try:
        model(ids)
    except RuntimeError as error:
        return str(error)
    return "no error"


def _unshard_edit_step_reshard() -> str:
    """``unshard()``, an edit, an optimizer step on the shards, then ``reshard()``: writing
    the edit back would undo the step."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    fsdp2.fully_shard(model)
    shards = list(model.parameters())
    model.unshard()
    with torch.no_grad():
        model.weight.zero_()
        for p in shards:
            p.add_(0.1)
    try:
        model.reshard()
    except RuntimeError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("where", ["next forward", "reshard"])
def test_in_place_change_and_shard_update_together_are_an_error(where: str) -> None:
    rank_fn = _edit_then_optimizer_step if where == "next forward" else _unshard_edit_step_reshard
    module = "the root (MaxNormModel)" if where == "next forward" else "the root (Linear)"
    messages = run_ranks(rank_fn, 2, timeout=60)
    for message in messages:
        assert f"{module}: its unsharded parameters were changed in place" in message, message
        assert "one of the two changes would be lost" in message
