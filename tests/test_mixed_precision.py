"""``MixedPrecisionPolicy``: bf16 all-gathers and compute over fp32 master shards, the
reduce dtype, output and input casts.

* fsdp2 vs torch's FSDP2 with the same policy: losses, gradients and parameters are
  **bitwise** equal (both cast the same fp32 shards to bf16, compute the same local
  forward/backward, and reduce the same values).
* fsdp2/torch vs an unsharded reference that applies the same casts by hand: per rank
  slice, a bf16 copy of the fp32 master model runs forward/backward on the bf16-cast
  input, the bf16 gradients are cast to fp32 and averaged over the slices, and AdamW steps
  the fp32 master. See ``MP_TOL`` for the tolerance.
* dtypes and sizes: sharded parameters and their gradients stay fp32; the parameters a
  forward sees are bf16; every all-gather sends and receives bf16 (``numel * 2`` bytes);
  the reduce-scatter runs in ``reduce_dtype`` (fp32), or in bf16 when ``reduce_dtype`` is
  None; ``output_dtype`` casts floating outputs; ``cast_forward_inputs`` casts floating
  inputs (not integer ones) to ``param_dtype``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _control_helpers import (
    CollectiveLog,
    adamw,
    api,
    build_net,
    clone_model,
    global_batch,
    group_numels,
    max_param_diff,
    rank_slice,
    shard_net,
)
from _helpers import IMPLS, full, is_dtensor, require_impl
from _launcher import run_ranks
from torch import nn

BF16, FP32 = torch.bfloat16, torch.float32
STEPS = 3

# Tolerance vs the hand-cast reference (fp32 master weights of magnitude ~0.1-1, 3 AdamW
# steps, lr 1e-2, eps 1e-3). The reference performs the very same casts, so differences
# can only come from bf16 kernel summation orders; observed: 0 (bitwise). A one-ulp bf16
# change of a gradient (2^-8 relative) moves an AdamW update by at most ~lr * 2^-8 (4e-5)
# per step for gradients above eps; 1e-3 leaves margin for a few such ulps and for small
# gradients. Training without the casts (the plain fp32 reference) ends ~1e-2 away, more
# than 5x this (asserted, so the tolerance cannot hide a missing cast).
MP_TOL = 1e-3


def policy(impl: str, **kwargs):
    return api(impl, "MixedPrecisionPolicy")(**kwargs)


def policies(impl: str, reduce_dtype, output_dtype) -> dict:
    """``shard_net`` keyword arguments: bf16 everywhere; ``output_dtype`` on the root only
    (a block's fp32 output would not fit the root's own bf16 layers that consume it)."""
    mp = policy(impl, param_dtype=BF16, reduce_dtype=reduce_dtype)
    root = policy(impl, param_dtype=BF16, reduce_dtype=reduce_dtype, output_dtype=output_dtype)
    return {"mp_policy": mp, "root_kwargs": {"mp_policy": root}}


def mse32(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """MSE computed in fp32 whatever the output dtype."""
    return F.mse_loss(model(batch[0]).float(), batch[1])


# ------------------------------------------------------------------ fsdp2 vs torch


def cross_impl(reduce_dtype: torch.dtype | None, output_dtype: torch.dtype | None) -> dict:
    """Rank function: the same model under fsdp2 and torch with the same policy."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    base = build_net()
    models = {
        impl: shard_net(clone_model(base), impl, **policies(impl, reduce_dtype, output_dtype))
        for impl in IMPLS
    }
    opts = {impl: adamw(m) for impl, m in models.items()}
    mismatches = []
    for step in range(STEPS):
        batch = rank_slice(global_batch(step, 2 * ws), rank, ws)
        losses, grads = {}, {}
        for impl, model in models.items():
            loss = mse32(model, batch)
            loss.backward()
            losses[impl] = loss.detach()
            grads[impl] = {n: full(p.grad) for n, p in model.named_parameters()}
            opts[impl].step()
            opts[impl].zero_grad()
        if not torch.equal(losses["fsdp2"], losses["torch"]):
            mismatches.append(f"step {step}: loss {losses['fsdp2']} vs {losses['torch']}")
        params = {impl: dict(m.named_parameters()) for impl, m in models.items()}
        for name, p in params["torch"].items():
            if not torch.equal(grads["fsdp2"][name], grads["torch"][name]):
                mismatches.append(f"step {step}: grad of {name}")
            if not torch.equal(full(params["fsdp2"][name].detach()), full(p.detach())):
                mismatches.append(f"step {step}: {name}")
    return {"mismatches": mismatches}


@pytest.mark.parametrize(
    ("reduce_dtype", "output_dtype"),
    [(FP32, None), (None, None), (FP32, FP32)],
    ids=["reduce_fp32", "reduce_bf16", "output_fp32"],
)
def test_bitwise_equal_to_torch(reduce_dtype, output_dtype) -> None:
    for impl in IMPLS:
        require_impl(impl)
    for rank, report in enumerate(run_ranks(cross_impl, 2, reduce_dtype, output_dtype)):
        assert not report["mismatches"], f"rank {rank}: not bitwise equal: {report['mismatches']}"


# ------------------------------------------------------------------ vs hand-cast reference


def reference_mp_step(master: nn.Module, opt, batch, ws: int, cast: bool) -> float:
    """What FSDP does, on one process: per rank slice, a bf16 copy computes its local
    gradient; the gradients are cast to fp32 and averaged. ``cast=False``: plain fp32."""
    grads = [torch.zeros_like(p) for p in master.parameters()]
    losses = []
    for r in range(ws):
        x, y = rank_slice(batch, r, ws)
        local = copy.deepcopy(master)
        if cast:
            local.to(BF16)
            x = x.to(BF16)
        loss = F.mse_loss(local(x).float(), y)
        loss.backward()
        losses.append(loss.item())
        for g, p in zip(grads, local.parameters()):
            g.add_(p.grad.float())
    for g, p in zip(grads, master.parameters()):
        p.grad = g / ws
    opt.step()
    opt.zero_grad()
    return sum(losses) / ws


def vs_reference(impl: str) -> dict:
    rank, ws = dist.get_rank(), dist.get_world_size()
    ref = build_net()
    ref32 = build_net()
    model = shard_net(clone_model(ref), impl, mp_policy=policy(impl, param_dtype=BF16, reduce_dtype=FP32))
    ref_opt, ref32_opt, opt = adamw(ref), adamw(ref32), adamw(model)
    steps = []
    for step in range(STEPS):
        batch = global_batch(step, 2 * ws)
        ref_loss = reference_mp_step(ref, ref_opt, batch, ws, cast=True)
        reference_mp_step(ref32, ref32_opt, batch, ws, cast=False)
        loss = mse32(model, rank_slice(batch, rank, ws))
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        steps.append(
            {
                "loss": mean_loss.item() / ws,
                "ref_loss": ref_loss,
                "param_worst": max_param_diff(ref, model),
                "fp32_gap": max_param_diff(ref32, model)[1],
            }
        )
    return {"steps": steps}


@pytest.mark.parametrize("impl", IMPLS)
def test_matches_hand_cast_reference(impl: str) -> None:
    require_impl(impl)
    for rank, report in enumerate(run_ranks(vs_reference, 2, impl)):
        for step, e in enumerate(report["steps"]):
            where = f"[{impl}, rank {rank}, step {step}]"
            assert abs(e["loss"] - e["ref_loss"]) <= MP_TOL, f"{where} loss {e}"
            name, diff = e["param_worst"]
            assert diff <= MP_TOL, f"{where} {name} differs from the reference by {diff:.3g}"
        # The casts matter: without them training would be measurably different.
        assert report["steps"][-1]["fp32_gap"] > 5 * MP_TOL, report["steps"][-1]


# ------------------------------------------------------------------ dtypes and sizes


def dtypes_and_sizes(impl: str, reduce_dtype: torch.dtype | None, output_dtype) -> dict:
    rank, ws = dist.get_rank(), dist.get_world_size()
    ref = build_net()
    numels = group_numels(ref, ws)
    model = shard_net(clone_model(ref), impl, **policies(impl, reduce_dtype, output_dtype))
    opt = adamw(model)
    seen: list[tuple[str, torch.dtype, bool]] = []

    def record(module: nn.Module, args: tuple) -> None:
        seen.append((type(module).__name__, module.weight.dtype, is_dtensor(module.weight)))

    for module in (model.inp, model.blocks[0].lin1, model.blocks[3].lin2, model.head):
        module.register_forward_pre_hook(record)
    report: dict = {"sharded": [], "grads": [], "outputs": []}
    with CollectiveLog(numels) as log:
        for step in range(2):
            x, y = rank_slice(global_batch(step, 2 * ws), rank, ws)
            out = model(x)
            report["outputs"].append(out.dtype)
            F.mse_loss(out.float(), y).backward()
            report["grads"] += sorted(
                {(str(p.grad.dtype), is_dtensor(p.grad)) for p in model.parameters()}
            )
            opt.step()
            opt.zero_grad()
            report["sharded"] += sorted(
                {(str(p.dtype), str(p.to_local().dtype), is_dtensor(p)) for p in model.parameters()}
            )
    group_numel = {g: n for n, g in numels.items()}
    report["forward_params"] = sorted({(name, str(dtype), dt) for name, dtype, dt in seen})
    report["ag"] = sorted(
        {
            (
                str(c.in_dtype),
                str(c.out_dtype),
                c.in_bytes == 2 * group_numel[c.group],
                c.out_bytes == 2 * ws * group_numel[c.group],
            )
            for c in log.calls
            if c.kind == "AG"
        }
    )
    report["rs"] = sorted({(str(c.in_dtype), str(c.out_dtype)) for c in log.calls if c.kind == "RS"})
    report["unknown_groups"] = [c for c in log.calls if c.group == "?"]
    return report


@pytest.mark.parametrize(
    ("reduce_dtype", "output_dtype"),
    [(FP32, None), (None, None), (FP32, FP32)],
    ids=["reduce_fp32", "reduce_none_is_bf16", "output_fp32"],
)
@pytest.mark.parametrize("impl", IMPLS)
def test_dtypes_and_sizes(impl: str, reduce_dtype, output_dtype) -> None:
    require_impl(impl)
    rs_dtype = str(reduce_dtype or BF16)
    for report in run_ranks(dtypes_and_sizes, 2, impl, reduce_dtype, output_dtype):
        assert not report["unknown_groups"], report["unknown_groups"]
        assert set(report["sharded"]) == {("torch.float32", "torch.float32", True)}, report
        assert set(report["grads"]) == {("torch.float32", True)}, report["grads"]
        assert report["forward_params"] == [
            ("Linear", "torch.bfloat16", False)
        ], report["forward_params"]
        assert report["ag"] == [("torch.bfloat16", "torch.bfloat16", True, True)], report["ag"]
        assert report["rs"] == [(rs_dtype, rs_dtype)], report["rs"]
        assert set(report["outputs"]) == {output_dtype or BF16}, report["outputs"]


class CastProbe(nn.Module):
    """Records the dtypes its forward receives; casts itself so any input dtype works."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: list[tuple[str, ...]] = []

    def forward(self, x: torch.Tensor, ids: torch.Tensor, *, scale: torch.Tensor):
        self.seen.append((str(x.dtype), str(ids.dtype), str(scale.dtype)))
        out = self.lin(x.to(self.lin.weight.dtype)) * scale.to(self.lin.weight.dtype)
        return {"out": out, "ids": ids}


def input_output_casts(impl: str) -> dict:
    results = {}
    for cast in (True, False):
        for output_dtype in (None, FP32):
            torch.manual_seed(0)
            probe = CastProbe()
            mp = policy(impl, param_dtype=BF16, output_dtype=output_dtype, cast_forward_inputs=cast)
            api(impl, "fully_shard")(probe, mp_policy=mp)
            x = torch.randn(2, 4, dtype=torch.float64)
            ids = torch.arange(2)
            out = probe(x, ids, scale=torch.ones(4))
            out["out"].float().sum().backward()
            results[f"cast={cast},output={output_dtype}"] = {
                "inputs": probe.seen[0],
                "out": str(out["out"].dtype),
                "ids": str(out["ids"].dtype),
                "grad": str(probe.lin.weight.grad.dtype),
            }
    return results


@pytest.mark.parametrize("impl", IMPLS)
def test_cast_forward_inputs_and_output_dtype(impl: str) -> None:
    require_impl(impl)
    for results in run_ranks(input_output_casts, 2, impl):
        for key, r in results.items():
            cast, output = "cast=True" in key, "float32" in key
            x_dtype = "torch.bfloat16" if cast else "torch.float64"
            scale_dtype = "torch.bfloat16" if cast else "torch.float32"
            assert r["inputs"] == (x_dtype, "torch.int64", scale_dtype), (key, r)
            assert r["out"] == ("torch.float32" if output else "torch.bfloat16"), (key, r)
            assert r["ids"] == "torch.int64", (key, r)
            assert r["grad"] == "torch.float32", (key, r)
