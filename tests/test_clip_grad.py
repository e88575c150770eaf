"""``fsdp2.clip_grad_norm_`` / ``get_total_norm`` / ``clip_grads_with_norm_``: torch's
contract on the local shards, with one all-reduce per set of sharded mesh dims.

When a test fails, look at the report's ``totals`` (ours, the norm of the full gradients
gathered on every rank, and torch's ``clip_grad_norm_`` on the ``DTensor`` gradients) and
``reduces`` (every all-reduce our call issued: group size and op).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _launcher import run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fsdp2

REL = 1e-6


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.down(torch.relu(self.up(x)))))


def _sharded(layout: str) -> tuple[nn.Module, list[nn.Parameter]]:
    """The MLP sharded as ``layout``; returns the model and every parameter the clip
    covers (a plain one too, for ``mixed``)."""
    torch.manual_seed(0)
    model = Mlp()
    ws = dist.get_world_size()
    extra: list[nn.Parameter] = []
    if layout in ("fsdp", "mixed"):
        mesh = init_device_mesh("cpu", (ws,))
        ignored = {model.head.bias} if layout == "mixed" else None
        fsdp2.fully_shard(model.up, mesh=mesh)
        fsdp2.fully_shard(model, mesh=mesh, ignored_params=ignored)
    elif layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard"))
        fsdp2.fully_shard(model.up, mesh=mesh)
        fsdp2.fully_shard(model, mesh=mesh)
    else:  # fsdp_tp: TP over 2 ranks inside the MLP, FSDP over the others
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        world = init_device_mesh("cpu", (ws // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, world["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fsdp2.fully_shard(model.up, mesh=world["dp"])
        fsdp2.fully_shard(model, mesh=world["dp"])
    params = list(model.parameters()) + extra
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank() // 2))
    model(x).square().sum().backward()
    return model, params


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


class _Recorder:
    """Records ``dist.all_reduce`` calls (group size, op) while active."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str]] = []

    def __enter__(self) -> _Recorder:
        self.real = dist.all_reduce

        def record(
            tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, **kw: Any
        ) -> Any:
            self.calls.append((dist.get_world_size(group), str(op).split(".")[-1]))
            return self.real(tensor, op=op, group=group, **kw)

        dist.all_reduce = record  # type: ignore[assignment]
        return self

    def __exit__(self, *_: object) -> None:
        dist.all_reduce = self.real  # type: ignore[assignment]


def rank_clip(layout: str, norm_type: float, max_norm: float) -> dict:
    _, params = _sharded(layout)
    grads = [p.grad for p in params]
    saved = [g.detach().clone() for g in grads]
    full_grads = [_full(g).clone() for g in grads]  # gathered before clipping
    expected = torch.nn.utils.get_total_norm(full_grads, norm_type)
    with _Recorder() as recorder:
        ours = fsdp2.clip_grad_norm_(params, max_norm, norm_type=norm_type)
    clipped = [_full(p.grad) for p in params]
    # torch's clip_grad_norm_ on the same DTensor gradients, where it supports the layout.
    # Its infinity norm raises on a rank whose shard is empty (the other ranks then hang
    # in the reduction), so every rank skips it then.
    for p, g in zip(params, saved):
        p.grad = g
    empty = torch.tensor(float(any(_local(g).numel() == 0 for g in saved)))
    dist.all_reduce(empty)
    try:
        if norm_type == math.inf and empty.item():
            raise RuntimeError("torch's infinity norm of an empty shard")
        theirs: float | None = float(
            _full(torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type))
        )
        theirs_clipped = [_full(p.grad) for p in params]
    except (RuntimeError, NotImplementedError):
        theirs, theirs_clipped = None, None
    coefficient = min(1.0, max_norm / (float(expected) + 1e-6))
    worst = max(
        ((c - f * coefficient).abs().max() / f.abs().max().clamp_min(1e-30)).item()
        for c, f in zip(clipped, full_grads)
    )
    worst_vs_torch = (
        None
        if theirs_clipped is None
        else max(
            ((c - t).abs().max() / t.abs().max().clamp_min(1e-30)).item()
            for c, t in zip(clipped, theirs_clipped)
        )
    )
    return {
        "totals": (float(ours), float(expected), theirs),
        "plain": type(ours) is torch.Tensor,
        "reduces": recorder.calls,
        "clip_error": worst,
        "clip_error_vs_torch": worst_vs_torch,
    }


@pytest.mark.parametrize(
    ("layout", "world_size", "reduces"),
    [
        ("fsdp", 2, [(2, "SUM")]),
        ("mixed", 2, [(2, "SUM")]),
        ("fsdp", 4, [(4, "SUM")]),
        ("hsdp", 4, [(2, "SUM")]),  # over the shard dim only: replicas hold equal grads
        ("fsdp_tp", 4, [(2, "SUM"), (2, "SUM")]),  # tp, then dp with the TP-replicated bias
    ],
)
@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
def test_total_norm_and_clipping_match_torch(
    layout: str, world_size: int, reduces: list[tuple[int, str]], norm_type: float
) -> None:
    reports = run_ranks(rank_clip, world_size, layout, norm_type, 0.1)
    op = "MAX" if norm_type == math.inf else "SUM"
    for rank, rep in enumerate(reports):
        ours, expected, theirs = rep["totals"]
        assert rep["plain"], "the total norm must be a plain tensor"
        assert abs(ours - expected) <= REL * expected, (rank, rep["totals"])
        if theirs is not None:
            assert abs(ours - theirs) <= REL * theirs, (rank, rep["totals"])
            assert rep["clip_error_vs_torch"] <= REL, rep
        assert rep["clip_error"] <= REL, rep
        assert rep["reduces"] == [(size, op) for size, _ in reduces], rep["reduces"]
    assert len({rep["totals"][0] for rep in reports}) == 1, "the total differs between ranks"


def rank_errors() -> dict:
    _, params = _sharded("fsdp")
    errors: dict[str, str] = {}
    with torch.no_grad():
        params[0].grad.to_local()[0, 0] = float("inf")
    for name, call in {
        "nonfinite": lambda: fsdp2.clip_grad_norm_(params, 1.0, error_if_nonfinite=True),
        "norm_type": lambda: fsdp2.clip_grad_norm_(params, 1.0, norm_type="two"),
        "max_norm": lambda: fsdp2.clip_grad_norm_(params, "1.0"),
        "not_a_tensor": lambda: fsdp2.get_total_norm([params[0].grad, 3.0]),
        "total_norm": lambda: fsdp2.clip_grads_with_norm_(params, 1.0, 2.0),
    }.items():
        try:
            call()
            errors[name] = "no error"
        except (RuntimeError, TypeError, ValueError) as error:
            errors[name] = f"{type(error).__name__}: {error}"
    return errors


def test_bad_input_is_a_clear_error() -> None:
    errors = run_ranks(rank_errors, 2)[0]
    assert errors["nonfinite"].startswith("RuntimeError") and "non-finite" in errors["nonfinite"]
    assert errors["norm_type"].startswith("ValueError") and "'two'" in errors["norm_type"]
    assert errors["max_norm"].startswith("TypeError") and "max_norm" in errors["max_norm"]
    assert errors["not_a_tensor"].startswith("TypeError") and "tensors[1]" in errors["not_a_tensor"]
    assert errors["total_norm"].startswith("TypeError") and "total_norm" in errors["total_norm"]


@pytest.mark.parametrize("foreach", [None, False, True])
@pytest.mark.parametrize("norm_type", [2.0, math.inf, 0.5])
def test_plain_tensors_are_torchs_function(foreach: bool | None, norm_type: float) -> None:
    """Without DTensors (no process group needed) the result is torch's, bitwise."""
    torch.manual_seed(0)
    grads = [torch.randn(5, 3), torch.randn(7), torch.randn(2, 2, dtype=torch.float64)]
    ours = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    theirs = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for a, b, g in zip(ours, theirs, grads):
        a.grad, b.grad = g.clone(), g.clone()
    total = fsdp2.clip_grad_norm_(ours, 0.5, norm_type, foreach=foreach)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 0.5, norm_type, foreach=foreach)
    assert torch.equal(total, expected)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours, theirs))
    assert fsdp2.get_total_norm([]).item() == 0.0
    with pytest.warns(UserWarning, match="empty generator"):
        fsdp2.clip_grad_norm_((p for p in []), 1.0)
