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


def rank_other_orders(layout: str, norm_type: float) -> dict:
    """``norm_type`` 0, between 0 and 1, or negative, on ``layout``: for the 0-"norm" one
    gradient is zero everywhere and another only in rank 0's shard, so the count of
    nonzero tensors (torch's 0-"norm", [Note: the 0-"norm" counts whole tensors]) differs
    from a count of nonzero shards, runs or elements."""
    model, params = _sharded(layout)
    if norm_type == 0.0:
        with torch.no_grad():
            _local(model.up.bias.grad).zero_()
            if dist.get_rank() == 0:
                _local(model.down.weight.grad).zero_()
    full_grads = [_full(p.grad).clone() for p in params]
    expected = torch.nn.utils.get_total_norm(full_grads, norm_type)
    total = fsdp2.get_total_norm([p.grad for p in params], norm_type)
    clipped_total = fsdp2.clip_grad_norm_(params, 0.1, norm_type)
    coefficient = min(1.0, 0.1 / (float(expected) + 1e-6))
    worst = max(
        ((_full(p.grad) - f * coefficient).abs().max() / f.abs().max().clamp_min(1e-30)).item()
        for p, f in zip(params, full_grads)
    )
    return {
        "totals": (float(total), float(clipped_total), float(expected)),
        "dtype": (total.dtype, expected.dtype),
        "clip_error": worst,
    }


@pytest.mark.parametrize(
    ("layout", "world_size"), [("fsdp", 2), ("mixed", 2), ("fsdp", 4), ("hsdp", 4), ("fsdp_tp", 4)]
)
@pytest.mark.parametrize("norm_type", [0.0, 0.5, -1.0, -math.inf])
def test_other_norm_orders_match_torch(layout: str, world_size: int, norm_type: float) -> None:
    """Orders whose total does not compose like ``sum |x| ** p`` in the obvious way: the
    0-"norm" counts tensors, negative orders are dominated by the smallest elements, and
    ``-inf`` takes the minimum (an empty shard at 4 ranks must not supply it)."""
    reports = run_ranks(rank_other_orders, world_size, layout, norm_type)
    for rank, rep in enumerate(reports):
        total, clipped_total, expected = rep["totals"]
        if norm_type == 0.0:
            assert total == clipped_total == expected, (rank, layout, rep["totals"])
        else:
            for value in (total, clipped_total):
                assert abs(value - expected) <= REL * abs(expected), (rank, rep["totals"])
        assert rep["dtype"][0] == rep["dtype"][1], rep
        assert rep["clip_error"] <= REL, rep


@pytest.mark.parametrize("foreach", [None, False, True])
@pytest.mark.parametrize("norm_type", [2.0, math.inf, 0.5, 0.0, -1.0])
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


def test_adjacent_views_are_one_tensor() -> None:
    """[Note: adjacent gradients are one tensor]: only contiguous views that lie back to
    back in one base join; anything else starts a new run, and nothing is copied."""
    from fsdp2.clip_grad import coalesce_adjacent

    base, other = torch.randn(100), torch.randn(100)
    tensors = [
        base[0:10].view(2, 5),
        base[10:30],
        base[30:31],  # three back to back: one run of 31
        base[40:50],  # a gap before it
        base[50:60].view(5, 2).t(),  # not contiguous: alone
        base[60:70],
        base[60:70],  # the same elements again: not joined
        other[70:80],  # another storage at the offset where the run ends
        base[80:90].view(torch.int32),  # another dtype
        torch.randn(3),  # no base
    ]
    runs = coalesce_adjacent(tensors)
    assert [(r.storage_offset(), tuple(r.shape)) for r in runs] == [
        (0, (31,)),
        (40, (10,)),
        (50, (2, 5)),
        (60, (10,)),
        (60, (10,)),
        (70, (10,)),
        (80, (10,)),
        (0, (3,)),
    ]
    assert runs[0].untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    # Views whose values a flat view of their range would not read: never joined.
    complex_base = torch.randn(8, dtype=torch.complex64)
    conjugated = [complex_base[0:4].conj(), complex_base[4:8]]
    assert len(coalesce_adjacent(conjugated)) == 2
    negated = [torch._neg_view(base[0:4]), base[4:8]]
    assert len(coalesce_adjacent(negated)) == 2
    runs[0].mul_(0.0)  # a view: writes reach the tensors it joined
    assert not tensors[0].any() and not tensors[2].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm_type", [2.0, math.inf, -math.inf])
def test_empty_views_contribute_nothing(dtype: torch.dtype, norm_type: float) -> None:
    """Empty shards (a rank past the last row) join a run or stand alone; either way they
    add nothing to the norm, and a set of only empty tensors has the norm's identity
    (torch's infinity norm raises on an empty tensor instead)."""
    base = torch.randn(12, dtype=torch.float32).to(dtype)
    tensors = [base[0:0], base[0:5], base[5:5], base[5:12], base[12:12]]
    expected = torch.linalg.vector_norm(base.float(), norm_type)
    total = fsdp2.get_total_norm(tensors, norm_type)
    assert torch.allclose(total.float(), expected, rtol=1e-2 if dtype != torch.float32 else 1e-6)
    identity = math.inf if norm_type == -math.inf else 0.0
    alone = fsdp2.get_total_norm([base[3:3], torch.empty(0, dtype=dtype)], norm_type)
    assert float(alone) == identity and alone.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("foreach", [None, False])
def test_views_of_one_buffer_clip_as_torch(dtype: torch.dtype, foreach: bool | None) -> None:
    """Gradients that are views of one buffer, as fsdp2's reduced gradients are: the
    clipped gradients are torch's bitwise (a product per element either way), the total
    within 1e-6 (fp32: one norm over the run) or bitwise (bf16: per tensor, as torch)."""
    torch.manual_seed(0)
    shapes = [(4, 3), (3,), (5, 2), (7,)]
    flat = torch.randn(sum(math.prod(s) for s in shapes), dtype=dtype) * 10
    ours = [nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes]
    theirs = [nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes]
    start = 0
    for a, b, shape in zip(ours, theirs, shapes):
        n = math.prod(shape)
        a.grad = flat[start : start + n].view(shape)
        b.grad = a.grad.clone()
        start += n
    originals = [b.grad.clone() for b in theirs]
    total = fsdp2.clip_grad_norm_(ours, 1.0, foreach=foreach)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0, foreach=foreach)
    if dtype == torch.bfloat16:
        assert torch.equal(total, expected)
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours, theirs))
    else:
        assert abs(total.item() - expected.item()) <= REL * expected.item()
    # Scaled as one run: each gradient is its own product with the coefficient, bitwise.
    coefficient = torch.clamp(1.0 / (total + 1e-6), max=1.0)
    assert coefficient.item() < 1.0
    assert all(torch.equal(a.grad, g * coefficient) for a, g in zip(ours, originals))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_norm_of_views_counts_tensors_not_runs(dtype: torch.dtype) -> None:
    """torch's 0-"norm" of gradients is the number of gradients with a nonzero element.
    Views of one buffer would coalesce into one run; the count must still be per view:
    here 2 of 3 views are nonzero (1 run, 13 nonzero elements)."""
    flat = torch.randn(20).to(dtype)
    flat[4:9] = 0
    views = [flat[0:4], flat[4:9], flat[9:20]]
    expected = torch.nn.utils.get_total_norm([v.clone() for v in views], 0.0)
    for foreach in (None, False):
        total = fsdp2.get_total_norm(views, 0.0, foreach=foreach)
        assert torch.equal(total, expected) and float(total) == 2.0, (foreach, total)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_host_coefficient_is_torch_bitwise(dtype: torch.dtype) -> None:
    """[Note: the clip coefficient on the host]: the float the CPU path computes is
    exactly torch's ``clamp(max_norm / (total + 1e-6), max=1.0)`` on a 0-dim tensor, over
    twelve decades of totals and clip norms (negative and zero ones too) and the special
    values; magnitudes that could overflow fp32 are left to tensors."""
    from fsdp2.clip_grad import _host_coefficient

    generator = torch.Generator().manual_seed(0)
    exponents = torch.rand(4000, 2, generator=generator, dtype=torch.float64) * 24 - 12
    mantissas = torch.rand(4000, 2, generator=generator, dtype=torch.float64)
    cases = [(float(t), float(m)) for t, m in (10**exponents * mantissas).tolist()]
    cases += [(t, -m) for t, m in cases[:500]]
    special = [0.0, 1e-6, 1.0, math.inf, math.nan]
    cases += [(t, m) for t in special for m in (0.0, -1.0, 1.0, 1e30, math.inf)]
    for total, max_norm in cases:
        tensor = torch.tensor(total, dtype=dtype)
        expected = torch.clamp(max_norm / (tensor + 1e-6), max=1.0).item()
        got = _host_coefficient(tensor.item(), max_norm, dtype)
        if got is None:
            assert dtype == torch.float32 and abs(max_norm) > 1e30
            continue
        same = got == expected or (math.isnan(got) and math.isnan(expected))
        assert same, f"total {total!r}, max_norm {max_norm!r}: {got!r} vs torch {expected!r}"
        assert math.copysign(1.0, got) == math.copysign(1.0, expected) or math.isnan(got)
    assert _host_coefficient(1.0, 1.0, torch.bfloat16) is None  # torch rounds to bf16


def test_no_clipping_leaves_cpu_gradients_untouched() -> None:
    """A CPU total below ``max_norm`` scales by exactly 1: the pass is skipped, so the
    gradients keep their values and their version counters."""
    grads = [torch.randn(4, 3), torch.randn(3)]
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    versions = [p.grad._version for p in params]
    fsdp2.clip_grad_norm_(params, 1e9)
    assert [p.grad._version for p in params] == versions
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))
    fsdp2.clip_grad_norm_(params, 1e-3)
    assert all(p.grad._version > v for p, v in zip(params, versions))


def rank_norm_kernels() -> dict:
    """fsdp2's gradients of two groups with evenly sharded parameters: how many tensors
    the norm and the scaling kernels get, against the number of gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    fsdp2.fully_shard(model[0])
    fsdp2.fully_shard(model)
    model(torch.randn(4, 8)).square().sum().backward()
    params = list(model.parameters())
    full = [_full(p.grad).clone() for p in params]
    seen: dict[str, list[int]] = {"norm": [], "mul": []}
    real_norm, real_mul = torch._foreach_norm, torch._foreach_mul_

    def norm(tensors: list[torch.Tensor], *args: Any) -> Any:
        seen["norm"].append(len(tensors))
        return real_norm(tensors, *args)

    def mul(tensors: list[torch.Tensor], *args: Any) -> Any:
        seen["mul"].append(len(tensors))
        return real_mul(tensors, *args)

    torch._foreach_norm, torch._foreach_mul_ = norm, mul  # type: ignore[assignment]
    try:
        total = fsdp2.clip_grad_norm_(params, 1e-2)
    finally:
        torch._foreach_norm, torch._foreach_mul_ = real_norm, real_mul  # type: ignore[assignment]
    expected = torch.nn.utils.get_total_norm(full)
    coefficient = 1e-2 / (expected + 1e-6)
    error = max(
        ((_full(p.grad) - f * coefficient).abs().max() / f.abs().max()).item()
        for p, f in zip(params, full)
    )
    return {
        "seen": seen,
        "grads": len(params),
        "total": (total.item(), expected.item()),
        "error": error,
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp2_gradients_are_clipped_per_group(world_size: int) -> None:
    """One norm and one product per group of fsdp2 gradients, not one per parameter."""
    for rep in run_ranks(rank_norm_kernels, world_size):
        assert rep["seen"] == {"norm": [2], "mul": [2]}, rep
        assert rep["grads"] == 4
        ours, expected = rep["total"]
        assert abs(ours - expected) <= REL * expected, rep
        assert rep["error"] <= REL, rep
