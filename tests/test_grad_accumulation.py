"""Gradient accumulation over microbatches with ``set_requires_gradient_sync``,
``set_reshard_after_backward``, ``set_reshard_after_forward`` and ``set_is_last_backward``.

Every rank runs ``N_MICRO`` microbatches per optimizer step; the reference (one unsharded
model) trains on the concatenation of every rank's microbatches, so after each step the
parameters must match within 1e-5. Collectives are intercepted and counted per step:

* reduce-scatters: one per group per step when only the last microbatch syncs, one per
  group per microbatch when every microbatch syncs (also when groups stay unsharded
  between microbatches);
* all-gathers, with ``G`` groups of which ``L`` (the blocks) reshard after forward (the
  root keeps its parameters, ``reshard_after_forward=None``):

  - resharding after every backward: each microbatch gathers ``G`` in forward and ``L`` in
    backward: ``N * (G + L)``;
  - ``set_reshard_after_backward(False)`` on all but the last microbatch: parameters stay
    unsharded from one microbatch to the next, so only the first forward gathers:
    ``G + N * L`` (the blocks still reshard after forward and gather again in backward);
  - additionally ``set_reshard_after_forward(False)``: ``G`` (the first forward only).

If a count test fails, look at the per-step list of (kind, group) in the message: a missing
backward all-gather means a group was not resharded after forward; an extra forward one
means ``reshard_after_backward=False`` did not keep it unsharded.

The docs example (the first ```python block of docs/gradient_accumulation.md) is executed
on 2 ranks as well; it asserts its own result.
"""

from __future__ import annotations

import pathlib
import re
from typing import Any

import pytest
import torch.distributed as dist
from _control_helpers import (
    HIDDENS,
    TOL,
    CollectiveLog,
    adamw,
    build_net,
    clone_model,
    global_batch,
    group_numels,
    max_param_diff,
    mse,
    rank_slice,
    reference_step,
    shard_net,
)
from _helpers import IMPLS, compare_grads, require_impl
from _launcher import run_ranks

N_MICRO = 3
MICRO_ROWS = 2
STEPS = 2
L = len(HIDDENS)
G = L + 1

# variant: (reshard_after_backward on non-last microbatches, reshard_after_forward for all,
#           sync every microbatch, use set_is_last_backward, expected AGs, expected RSs)
VARIANTS = {
    "reshard_after_backward": (True, None, False, False, N_MICRO * (G + L), G),
    "keep_unsharded_between_microbatches": (False, None, False, False, G + N_MICRO * L, G),
    "no_reshard_until_last_backward": (False, False, False, False, G, G),
    "is_last_backward": (True, None, False, True, N_MICRO * (G + L), G),
    "sync_every_microbatch": (True, None, True, True, N_MICRO * (G + L), N_MICRO * G),
    # Groups kept unsharded after a synced backward still reduce once per backward (the end
    # of backward must not run their post-backward a second time).
    "sync_every_microbatch_unsharded": (False, None, True, False, G + N_MICRO * L, N_MICRO * G),
}


def accumulate(impl: str, variant: str) -> dict:
    """Rank function: STEPS optimizer steps of N_MICRO microbatches each."""
    rab, raf, sync_every, use_is_last, _, _ = VARIANTS[variant]
    rank, ws = dist.get_rank(), dist.get_world_size()
    ref = build_net()
    model = shard_net(clone_model(ref), impl)
    if raf is not None:
        model.set_reshard_after_forward(raf)
    ref_opt, opt = adamw(ref), adamw(model)
    report: dict = {"steps": []}
    with CollectiveLog(group_numels(ref, ws)) as log:
        for step in range(STEPS):
            batch = global_batch(step, ws * N_MICRO * MICRO_ROWS)
            ref_loss = reference_step(ref, ref_opt, batch)
            local = rank_slice(batch, rank, ws)
            log.phase = f"step{step}"
            loss_sum = 0.0
            for i in range(N_MICRO):
                last = i == N_MICRO - 1
                model.set_requires_gradient_sync(last or sync_every)
                model.set_reshard_after_backward(last or rab)
                if use_is_last:
                    model.set_is_last_backward(last)
                micro = tuple(t[i * MICRO_ROWS : (i + 1) * MICRO_ROWS] for t in local)
                loss = mse(model, micro) / N_MICRO
                loss.backward()
                loss_sum += loss.item()
            log.phase = ""
            opt.step()
            opt.zero_grad()
            report["steps"].append(
                {
                    "ag": log.count("AG", f"step{step}"),
                    "rs": log.count("RS", f"step{step}"),
                    "calls": [(c.kind, c.group) for c in log.calls if c.phase == f"step{step}"],
                    "rs_groups": sorted(log.groups("RS", f"step{step}")),
                    "loss": loss_sum,
                    "ref_loss": ref_loss,
                    "param_worst": max_param_diff(ref, model),
                }
            )
    # After the last backward of a step every group must be sharded again.
    report["all_sharded"] = all(
        type(p).__name__ == "DTensor" for p in model.parameters()
    )  # parameters registered on the modules are the sharded DTensors again
    return report


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("impl", IMPLS)
def test_grad_accumulation(impl: str, variant: str) -> None:
    require_impl(impl)
    *_, expected_ag, expected_rs = VARIANTS[variant]
    reports = run_ranks(accumulate, 2, impl, variant)
    for rank, report in enumerate(reports):
        for s, e in enumerate(report["steps"]):
            where = f"[{impl}, {variant}, rank {rank}, step {s}] calls {e['calls']}"
            assert e["rs"] == expected_rs, (
                f"{where}: {e['rs']} reduce-scatters, expected {expected_rs}"
            )
            assert set(e["rs_groups"]) == {"root"} | {f"blocks.{i}" for i in range(L)}, where
            assert e["ag"] == expected_ag, f"{where}: {e['ag']} all-gathers, expected {expected_ag}"
            name, diff = e["param_worst"]
            assert diff <= TOL, (
                f"{where}: parameter {name} differs from the reference by {diff:.3g}"
            )
        assert report["all_sharded"], f"[{impl}, {variant}, rank {rank}] parameters left unsharded"
    # The mean of the local losses over ranks is the reference (global-batch) loss.
    for s in range(STEPS):
        mean = sum(r["steps"][s]["loss"] for r in reports) / len(reports)
        ref = reports[0]["steps"][s]["ref_loss"]
        assert abs(mean - ref) <= TOL * max(1.0, abs(ref)), (impl, variant, s, mean, ref)


# ------------------------------------------------------------------ the docs example

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "gradient_accumulation.md"


def first_python_block(path: pathlib.Path) -> str:
    match = re.search(r"```python\n(.*?)```", path.read_text(), re.DOTALL)
    assert match, f"no ```python block in {path}"
    return match.group(1)


def exec_doc_example(source: str, filename: str) -> bool:
    """Rank function: run a docs example as a script (it asserts its own result)."""
    namespace = {"__name__": "__main__"}
    exec(compile(source, filename, "exec"), namespace)
    return True


def test_docs_example() -> None:
    require_impl("fsdp2")
    assert all(run_ranks(exec_doc_example, 2, first_python_block(DOC), str(DOC)))


def rank_reductions_after_dropped_forward() -> dict:
    """A forward with grad enabled whose graph is dropped (a validation loss computed
    without no_grad) must not delay the next backward's reductions to the final callback,
    where every group would have stayed unsharded through backward."""
    import traceback

    import torch
    from torch import nn

    import fsdp2
    from fsdp2._param_group import ParamGroup

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2))
    for layer in model:
        fsdp2.fully_shard(layer)
    fsdp2.fully_shard(model)
    where: list[str] = []
    original = ParamGroup.reduce_grads

    def reduce_grads(self: ParamGroup) -> None:
        stack = [frame.name for frame in traceback.extract_stack()]
        where.append("final callback" if "_finish_backward" in stack else "in backward")
        original(self)

    ParamGroup.reduce_grads = reduce_grads  # type: ignore[method-assign]
    try:
        x = torch.randn(2, 4)
        model(x).sum()  # graph dropped right away
        model(x).sum().backward()
    finally:
        ParamGroup.reduce_grads = original  # type: ignore[method-assign]
    return {"where": where}


def test_dropped_forward_does_not_delay_reductions() -> None:
    require_impl("fsdp2")
    for rep in run_ranks(rank_reductions_after_dropped_forward, 2):
        # The first layer's input needs no grad: it reduces in the final callback.
        assert rep["where"] == ["in backward", "in backward", "final callback"], rep


def rank_group_unused_by_the_synced_microbatch(impl: str, mode: str) -> float:
    """The first microbatch uses an auxiliary head without reducing it fully, the second
    does not use it: the auxiliary head's sum must still be reduced at the end of the
    second backward, or the optimizer step misses it. ``mode``: ``sync`` (no gradient sync
    on the first microbatch), ``sync-kept`` (also kept unsharded after it), ``all-reduce``
    (HSDP 2x2: reduce-scattered but not all-reduced on the first). Returns the largest
    gradient difference from a non-sharded model on the same microbatches (inf: a
    gradient is missing)."""
    import copy

    import torch
    from _helpers import get_fully_shard
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    class WithAux(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(4, 4)
            self.aux = nn.Linear(4, 1)
            self.head = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor, use_aux: bool) -> torch.Tensor:
            h = torch.relu(self.body(x))
            out = self.head(h).sum()
            return out + self.aux(h).sum() if use_aux else out

    torch.manual_seed(0)
    model = WithAux()
    reference = copy.deepcopy(model)
    fully_shard = get_fully_shard(impl)
    mesh = None
    if mode == "all-reduce":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for module in (model.aux, model.body, model):
        fully_shard(module, mesh=mesh)
    ws, rank = dist.get_world_size(), dist.get_rank()
    batches = torch.randn(2, ws, 3, 4)
    for micro, use_aux in enumerate([True, False]):
        if mode == "all-reduce":
            model.set_requires_all_reduce(micro == 1)
        else:
            model.set_requires_gradient_sync(micro == 1)
            model.set_reshard_after_backward(micro == 1 or mode != "sync-kept")
        model(batches[micro, rank], use_aux).backward()
        for r in range(ws):
            (reference(batches[micro, r], use_aux) / ws).backward()
    _, worst, missing = compare_grads(reference, model)
    return float("inf") if missing else worst


@pytest.mark.parametrize(
    "impl,mode",
    [(impl, mode) for impl in IMPLS for mode in ("sync", "sync-kept")]
    # torch 2.13 drops HSDP's partial sums of a group the last microbatch did not use.
    + [("fsdp2", "all-reduce")],
)
def test_group_unused_by_the_last_microbatch_is_reduced(impl: str, mode: str) -> None:
    require_impl(impl)
    world_size = 4 if mode == "all-reduce" else 2
    worst = run_ranks(rank_group_unused_by_the_synced_microbatch, world_size, impl, mode)
    assert max(worst) <= 1e-6, worst


def rank_step_after_backward_not_flagged_last(impl: str) -> float:
    """Every backward under ``set_is_last_backward(False)`` (never set back): the
    optimizer step must still see every reduced gradient. Returns the largest parameter
    difference from a non-sharded model after two SGD steps."""
    import copy

    import torch
    from _helpers import get_fully_shard
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1))
    reference = copy.deepcopy(model)
    fully_shard = get_fully_shard(impl)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    ws, rank = dist.get_world_size(), dist.get_rank()
    worst = 0.0
    for _ in range(2):
        batch = torch.randn(ws, 3, 4)
        model.set_is_last_backward(False)
        model(batch[rank]).sum().backward()
        for r in range(ws):
            (reference(batch[r]).sum() / ws).backward()
        for opt in (optim, ref_optim):
            opt.step()
            opt.zero_grad()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            worst = max(worst, (p.full_tensor() - q).abs().max().item())
    return worst


@pytest.mark.parametrize("impl", IMPLS)
def test_optimizer_step_after_backward_not_flagged_last(impl: str) -> None:
    require_impl(impl)
    worst = run_ranks(rank_step_after_backward_not_flagged_last, 2, impl)
    assert max(worst) <= 1e-6, worst


def _hsdp_mlp_2x2() -> tuple[Any, Any, Any]:
    """A two-group MLP sharded on a 2x2 HSDP mesh, a non-sharded copy, and two microbatches
    of the global batch (``[micro, rank]``)."""
    import copy

    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp2

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    fsdp2.fully_shard(model[0], mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    return model, reference, torch.randn(2, dist.get_world_size(), 3, 4)


def rank_partial_sums_reduced_by_reduce_unsynced_grads() -> float:
    """HSDP 2x2: every microbatch reduce-scatters without the all-reduce, then
    ``reduce_unsynced_grads`` (what ``fsdp2.pipelining``'s stage calls at the end of a
    schedule) with the all-reduce switched back on must all-reduce the partial sums. Returns
    the largest gradient difference from a non-sharded model (inf: a gradient is missing)."""
    model, reference, batches = _hsdp_mlp_2x2()
    ws, rank = dist.get_world_size(), dist.get_rank()
    model.set_requires_all_reduce(False)
    for micro in range(2):
        model(batches[micro, rank]).sum().backward()
        for r in range(ws):
            (reference(batches[micro, r]).sum() / ws).backward()
    model.set_requires_all_reduce(True)
    model._fsdp_state.reduce_unsynced_grads()
    _, worst, missing = compare_grads(reference, model)
    return float("inf") if missing else worst


def test_reduce_unsynced_grads_all_reduces_partial_sums() -> None:
    require_impl("fsdp2")
    worst = run_ranks(rank_partial_sums_reduced_by_reduce_unsynced_grads, 4)
    assert max(worst) <= 1e-6, worst


def rank_partial_sums_across_a_divisor_switch(avg_first: bool) -> float:
    """HSDP 2x2 accumulation with ``set_requires_all_reduce(False)`` whose divisor switches
    between microbatches: the default (the collectives average) on one, sum-only collectives
    (the same average, divided after the sums) on the other. The partial sums kept from the
    first must be rescaled to the second's convention before they are added. Returns the
    largest gradient difference from a non-sharded model (inf: a gradient is missing)."""
    model, reference, batches = _hsdp_mlp_2x2()
    ws, rank = dist.get_world_size(), dist.get_rank()
    for micro in range(2):
        summing = (micro == 0) != avg_first
        for module in (model[0], model):
            module.set_force_sum_reduction_for_comms(summing)
        model.set_requires_all_reduce(micro == 1)
        model(batches[micro, rank]).sum().backward()
        for r in range(ws):
            (reference(batches[micro, r]).sum() / ws).backward()
    _, worst, missing = compare_grads(reference, model)
    return float("inf") if missing else worst


@pytest.mark.parametrize("avg_first", [True, False], ids=["avg_then_sum", "sum_then_avg"])
def test_partial_sums_across_a_divisor_switch(avg_first: bool) -> None:
    require_impl("fsdp2")
    worst = run_ranks(rank_partial_sums_across_a_divisor_switch, 4, avg_first)
    assert max(worst) <= 1e-6, worst
