"""Property tests of the sharded layout, for random parameter shapes and world sizes 1-4.

For every generated shape (1-D to 3-D, dim 0 in 1..9, other dims in 1..5), a module holding
the parameter(s) is wrapped with ``fully_shard`` and, on every rank:

* ``param.to_local()`` equals ``distribute_tensor(full, mesh, [Shard(0)]).to_local()``
  exactly (shape and values) -- torch's ``Shard(0)`` chunking: ceil(dim0 / ws) rows per
  rank, trailing ranks possibly short or empty;
* ``param.full_tensor()`` equals the original tensor exactly;
* (multi-parameter groups) after ``unshard()`` the registered parameters are the exact full
  tensors, each starting at a 64-byte aligned address (like separately allocated tensors:
  CPU matmuls round differently for unaligned weights, so an unaligned parameter breaks
  bitwise parity with torch), and after ``reshard()`` the sharded views are intact.

Hypothesis generates *lists* of shapes in the pytest process (derandomized, no example
database); one ``run_ranks`` call checks a whole list, so the cost is one launch per
example list. The rank function never raises on a mismatch: it returns every problem, so a
failure message lists all failing shapes at once (no shrinking needed). Look first at the
smallest failing shape and whether the failing ranks are the trailing (short/empty) ones.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _helpers import IMPLS, get_fully_shard, make_mesh, require_impl
from _launcher import run_ranks
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

shapes_st = st.integers(1, 3).flatmap(
    lambda ndim: st.tuples(st.integers(1, 9), *[st.integers(1, 5)] * (ndim - 1))
)

SETTINGS = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=10,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# What the CPU allocator guarantees for any tensor, so torch's separately allocated unsharded
# parameters always have it.
UNSHARDED_ALIGN_BYTES = 64

EDGE_SHAPES = [(1,), (2,), (4,), (5,), (9,), (1, 5), (3, 1), (9, 5, 5), (2, 1, 1), (7, 3, 2)]


class Holder(nn.Module):
    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        for i, t in enumerate(tensors):
            self.register_parameter(f"p{i}", nn.Parameter(t.clone()))


def _tensor_for(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen)


def _check_local_and_full(p, full: torch.Tensor, mesh, label: str) -> list[str]:
    from torch.distributed.tensor import Shard, distribute_tensor

    problems = []
    rank = dist.get_rank()
    if tuple(p.shape) != tuple(full.shape):
        problems.append(f"{label}: rank {rank}: global shape {tuple(p.shape)}")
    if tuple(p.placements) != (Shard(0),):
        problems.append(f"{label}: rank {rank}: placements {p.placements}")
    expected = distribute_tensor(full, mesh, [Shard(0)]).to_local()
    local = p.to_local()
    if local.shape != expected.shape:
        problems.append(
            f"{label}: rank {rank}: local shape {tuple(local.shape)}, "
            f"expected {tuple(expected.shape)}"
        )
    elif not torch.equal(local.detach(), expected):
        problems.append(f"{label}: rank {rank}: local values differ")
    gathered = p.full_tensor()
    if not torch.equal(gathered.detach(), full):
        problems.append(f"{label}: rank {rank}: full_tensor() differs from the original")
    return problems


def check_single_param_shapes(impl: str, shapes: list[tuple[int, ...]]) -> list[str]:
    """Rank function: one module with one parameter per shape."""
    fully_shard = get_fully_shard(impl)
    mesh = make_mesh()
    problems: list[str] = []
    for i, shape in enumerate(shapes):
        full = _tensor_for(shape, i)
        module = Holder([full])
        label = f"shape {shape}"
        try:
            fully_shard(module, mesh=mesh)
            problems += _check_local_and_full(module.p0, full, mesh, label)
        except Exception as exc:
            problems.append(f"{label}: rank {dist.get_rank()}: {type(exc).__name__}: {exc}")
    return problems


def check_group_shapes(impl: str, groups: list[list[tuple[int, ...]]]) -> list[str]:
    """Rank function: one module holding several parameters (one FSDP group) per entry."""
    fully_shard = get_fully_shard(impl)
    mesh = make_mesh()
    problems: list[str] = []
    for i, shapes in enumerate(groups):
        fulls = [_tensor_for(s, 1000 * i + j) for j, s in enumerate(shapes)]
        module = Holder(fulls)
        label = f"group {shapes}"
        try:
            fully_shard(module, mesh=mesh)
            for j, full in enumerate(fulls):
                problems += _check_local_and_full(
                    getattr(module, f"p{j}"), full, mesh, f"{label} param {j}"
                )
            module.unshard()
            for j, full in enumerate(fulls):
                p = getattr(module, f"p{j}")
                value = p.full_tensor() if hasattr(p, "full_tensor") else p
                if not torch.equal(value.detach(), full):
                    problems.append(f"{label} param {j}: rank {dist.get_rank()}: unsharded value")
                local = p.to_local() if hasattr(p, "to_local") else p
                if local.data_ptr() % UNSHARDED_ALIGN_BYTES:
                    problems.append(
                        f"{label} param {j}: rank {dist.get_rank()}: unsharded parameter at "
                        f"address {local.data_ptr():#x}, not {UNSHARDED_ALIGN_BYTES}-byte aligned"
                    )
            module.reshard()
            for j, full in enumerate(fulls):
                problems += _check_local_and_full(
                    getattr(module, f"p{j}"), full, mesh, f"{label} param {j} after reshard"
                )
        except Exception as exc:
            problems.append(f"{label}: rank {dist.get_rank()}: {type(exc).__name__}: {exc}")
    return problems


def _report(problems_per_rank: list[list[str]]) -> None:
    problems = [p for rank_problems in problems_per_rank for p in rank_problems]
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems[:60])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4], ids=lambda v: f"ws{v}")
@SETTINGS
@given(shapes=st.lists(shapes_st, min_size=5, max_size=25))
@example(shapes=EDGE_SHAPES)
def test_single_param_layout(impl: str, world_size: int, shapes: list) -> None:
    require_impl(impl)
    _report(run_ranks(check_single_param_shapes, world_size, impl, shapes))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4], ids=lambda v: f"ws{v}")
@SETTINGS
@given(groups=st.lists(st.lists(shapes_st, min_size=1, max_size=4), min_size=3, max_size=8))
@example(groups=[[(1,), (9, 5), (3,)], [(2, 1, 1), (1,)], [(9,), (4, 5, 5), (7, 3)]])
def test_group_layout_and_unshard(impl: str, world_size: int, groups: list) -> None:
    require_impl(impl)
    _report(run_ranks(check_group_shapes, world_size, impl, groups))


class WithEmptyParams(nn.Module):
    """Zero-size parameters (placeholders sized by a config, e.g. zero register tokens)
    beside ordinary ones in one group: they own no part of the flat shard."""

    def __init__(self) -> None:
        super().__init__()
        self.no_rows = nn.Parameter(torch.zeros(0, 5))
        self.lin = nn.Linear(5, 7)
        self.no_cols = nn.Parameter(torch.zeros(3, 0))
        self.empty = nn.Parameter(torch.zeros(0))
        self.out = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x)) + self.no_rows.sum() + self.no_cols.sum() + self.empty.sum()
        return self.out(h)


def train_with_empty_params(mixed: bool) -> list[str]:
    """Rank function: fsdp2 against the non-sharded model on the same global batch; the
    zero-size parameters get zero-size gradients and the others match."""
    import fsdp2

    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = WithEmptyParams()
    model = WithEmptyParams()
    model.load_state_dict(ref.state_dict())
    kw = {}
    if mixed:  # bf16 compute, fp32 reduction: the copy-in casts (the torch.cat path)
        kw["mp_policy"] = fsdp2.MixedPrecisionPolicy(torch.bfloat16, torch.float32)
        ref = ref.to(torch.bfloat16)
    fsdp2.fully_shard(model.lin, **kw)
    fsdp2.fully_shard(model, **kw)
    problems: list[str] = []
    for step in range(2):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(2 * ws, 5, generator=gen)
        local = x[2 * rank : 2 * rank + 2]
        model(local).square().mean().backward()
        ref(x.to(ref.lin.weight.dtype)).square().mean().backward()
        for name, p in model.named_parameters():
            ref_grad = ref.get_parameter(name).grad
            grad = p.grad.full_tensor()
            if grad.shape != p.shape:
                problems.append(f"step {step} {name}: gradient shape {tuple(grad.shape)}")
            elif not torch.allclose(grad, ref_grad.float(), atol=2e-2 if mixed else 1e-6):
                problems.append(
                    f"step {step} {name}: gradient off by {(grad - ref_grad).abs().max()}"
                )
        model.zero_grad()
        ref.zero_grad()
    return problems


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("world_size", [2, 3], ids=lambda v: f"ws{v}")
def test_zero_size_parameters_train(world_size: int, mixed: bool) -> None:
    """torch's fully_shard fails here ("_chunk_cat expects non-empty tensor")."""
    _report(run_ranks(train_with_empty_params, world_size, mixed))
