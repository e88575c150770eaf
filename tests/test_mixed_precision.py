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
  None, on ``itemsize * numel`` bytes; one collective per group per pass;
  ``output_dtype`` casts floating outputs; ``cast_forward_inputs`` casts floating inputs
  (not integer ones) to ``param_dtype``.
* fp16: the pre/post division of the reduction agrees with torch bitwise at 4 ranks.
* mixed-dtype groups (fsdp2 only; torch's FSDP2 rejects them): parity with a same-casts
  reference, one uint8 all-gather per group with its exact byte count, state dicts,
  ``to()``/``to_empty()``; see the section at the end of the file.
"""

from __future__ import annotations

import copy
import functools
import importlib
import math
import pathlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _control_helpers import (
    HIDDENS,
    CollectiveLog,
    adamw,
    api,
    build_net,
    clone_model,
    flag_numel,
    global_batch,
    group_numels,
    max_param_diff,
    rank_slice,
    shard_net,
)
from _helpers import (
    IMPLS,
    deterministic_init,
    full,
    get_fully_shard,
    is_dtensor,
    lies_inside,
    make_mesh,
    memory_regions,
    memory_span,
    mlp_and_sharded_copy,
    require_impl,
    torch_fsdp_has,
)
from _launcher import run_ranks
from test_grad_accumulation import exec_doc_example, first_python_block
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from fsdp2._fingerprints import block_numel, tailed_numel

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


def policies(impl: str, reduce_dtype, output_dtype, param_dtype=BF16) -> dict:
    """``shard_net`` keyword arguments: ``param_dtype`` everywhere; ``output_dtype`` on the
    root only (a block's fp32 output would not fit the root's own low-precision layers)."""
    mp = policy(impl, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    root = policy(
        impl, param_dtype=param_dtype, reduce_dtype=reduce_dtype, output_dtype=output_dtype
    )
    return {"mp_policy": mp, "root_kwargs": {"mp_policy": root}}


def mse32(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """MSE computed in fp32 whatever the output dtype."""
    return F.mse_loss(model(batch[0]).float(), batch[1])


# ------------------------------------------------------------------ fsdp2 vs torch


def cross_impl(
    reduce_dtype: torch.dtype | None,
    output_dtype: torch.dtype | None,
    param_dtype=BF16,
    autocast: bool = False,
) -> dict:
    """Rank function: the same model under fsdp2 and torch with the same policy (or, with
    ``autocast``, no policy and every forward under ``torch.autocast`` in bf16)."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    base = build_net()
    models = {
        impl: shard_net(
            clone_model(base),
            impl,
            **({} if autocast else policies(impl, reduce_dtype, output_dtype, param_dtype)),
        )
        for impl in IMPLS
    }
    opts = {impl: adamw(m) for impl, m in models.items()}
    mismatches = []
    for step in range(STEPS):
        batch = rank_slice(global_batch(step, 2 * ws), rank, ws)
        losses, grads = {}, {}
        for impl, model in models.items():
            with torch.autocast("cpu", dtype=BF16, enabled=autocast):
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
    ("param_dtype", "reduce_dtype", "output_dtype", "world_size"),
    [
        (BF16, FP32, None, 2),
        (BF16, None, None, 2),
        (BF16, FP32, FP32, 2),
        # fp16 reduces divide by 2 before and 2 after the sum at 4 ranks (overflow and
        # underflow guards); equal bits mean the same split as torch.
        (torch.float16, None, None, 4),
        # One rank: no collectives; the cast writes straight into the unsharded buffer.
        (BF16, FP32, None, 1),
    ],
    ids=["reduce_fp32", "reduce_bf16", "output_fp32", "fp16_pre_post_divide", "one_rank"],
)
def test_bitwise_equal_to_torch(param_dtype, reduce_dtype, output_dtype, world_size) -> None:
    for impl in IMPLS:
        require_impl(impl)
    args = (reduce_dtype, output_dtype, param_dtype)
    for rank, report in enumerate(run_ranks(cross_impl, world_size, *args)):
        assert not report["mismatches"], f"rank {rank}: not bitwise equal: {report['mismatches']}"


def test_autocast_bitwise_equal_to_torch() -> None:
    """``torch.autocast`` instead of a policy: the unsharded fp32 parameters are cast by
    autocast inside each forward (and cached for it), exactly as with torch's FSDP2."""
    for impl in IMPLS:
        require_impl(impl)
    for rank, report in enumerate(run_ranks(cross_impl, 2, None, None, BF16, True)):
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
    model = shard_net(
        clone_model(ref), impl, mp_policy=policy(impl, param_dtype=BF16, reduce_dtype=FP32)
    )
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
    # fsdp2's divergence checks end each rank's all-gather slot with a tail.
    slot = {g: tailed_numel(n, BF16) if impl == "fsdp2" else n for g, n in group_numel.items()}
    report["forward_params"] = sorted({(name, str(dtype), dt) for name, dtype, dt in seen})
    report["ag"] = sorted(
        {
            (
                str(c.in_dtype),
                str(c.out_dtype),
                c.in_bytes == 2 * slot[c.group],
                c.out_bytes == 2 * ws * slot[c.group],
            )
            for c in log.calls
            if c.kind == "AG"
        }
    )
    report["rs"] = sorted(
        {
            (
                str(c.in_dtype),
                str(c.out_dtype),
                c.out_bytes == c.out_dtype.itemsize * (group_numel[c.group] + c.flags),
                c.in_bytes == ws * c.out_bytes,
            )
            for c in log.calls
            if c.kind == "RS"
        }
    )
    report["counts"] = {
        kind: sorted({(g, log.count(kind, group=g)) for g in numels.values()})
        for kind in ("AG", "RS")
    }
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
        assert report["forward_params"] == [("Linear", "torch.bfloat16", False)], report[
            "forward_params"
        ]
        assert report["ag"] == [("torch.bfloat16", "torch.bfloat16", True, True)], report["ag"]
        assert report["rs"] == [(rs_dtype, rs_dtype, True, True)], report["rs"]
        # Two steps: the root gathers once per forward (not resharded), each block once
        # per forward and once per backward; one reduce-scatter per group per backward.
        blocks = [f"blocks.{i}" for i in range(len(HIDDENS))]
        expected_ag = sorted([("root", 2)] + [(b, 4) for b in blocks])
        assert report["counts"]["AG"] == expected_ag, report["counts"]
        assert report["counts"]["RS"] == sorted((g, 2) for g in ["root", *blocks])
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


# ------------------------------------------------------------------ mixed-dtype groups
#
# fsdp2 lets one group hold parameters of different dtypes (torch's FSDP2 rejects it; see
# [Note: mixed-dtype groups] in fsdp2/_param_group.py): the flat shard is a byte buffer,
# the all-gather sends bytes once per group, and gradients are reduced in one collective
# in the policy's reduce dtype, else in the promotion of their dtypes.

OTHER = {"fp64": torch.float64, "bf16": BF16}
# Per sharded-parameter dtype, the tolerance vs the same-casts reference at world sizes 3
# and 4 (at 1 and 2 the arithmetic is the same, so the results must be bitwise equal: a
# sum of two terms does not depend on its order and dividing by 2 is exact). At 3 and 4
# ranks only the order of the collective's sum differs: ~1 ulp of the reduce dtype in a
# gradient, which AdamW (lr 1e-2, eps 1e-3) turns into at most ~lr * 2^-23 for fp32 /
# lr * 2^-52 for fp64 per step. bf16 parameters round every update to 8 bits: one ulp
# flip of a value below 1 is <= 2^-8 (3.9e-3); 1e-2 allows two such flips. Gradients
# reduced in bf16 (param_dtype=bf16 without reduce_dtype) change by a bf16 ulp with the sum
# order, which moves every parameter by up to ~lr * 2^-8 per step: ``MP_TOL`` then.
MIXED_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, BF16: 1e-2}


class MixedBlock(nn.Module):
    """``lin1`` in fp32, ``lin2`` in ``other``; one group when sharded."""

    def __init__(self, other: torch.dtype) -> None:
        super().__init__()
        self.lin1 = nn.Linear(9, 5)
        self.lin2 = nn.Linear(5, 9, dtype=other)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin1(x.to(self.lin1.weight.dtype)))
        return x + self.lin2(h.to(self.lin2.weight.dtype)).to(x.dtype)


class MixedNet(nn.Module):
    """Two groups, each mixing fp32 and ``other``: the root (``inp`` and ``scale`` fp32,
    ``head`` in ``other``) and ``block``. Dim-0 sizes 9, 5 and 6 split unevenly over 2-4
    ranks (6 leaves rank 3 of 4 an empty shard). Activations are cast to each layer's
    dtype; the output is fp32."""

    def __init__(self, other: torch.dtype) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 9)
        self.block = MixedBlock(other)
        self.scale = nn.Parameter(torch.ones(9))
        self.head = nn.Linear(9, 6, dtype=other)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(self.inp(x.to(self.inp.weight.dtype)))
        return self.head((h * self.scale.to(h.dtype)).to(self.head.weight.dtype)).float()


def build_mixed(other: torch.dtype, seed: int = 0) -> MixedNet:
    model = MixedNet(other)
    deterministic_init(model, seed)  # draws in fp32, copies into each dtype
    return model


def shard_mixed(model: MixedNet, mesh=None, **kwargs) -> MixedNet:
    fsdp2 = api("fsdp2", "fully_shard")
    mesh = mesh if mesh is not None else make_mesh()
    fsdp2(model.block, mesh=mesh, **kwargs)
    fsdp2(model, mesh=mesh, **kwargs)
    return model


def mixed_groups(model: nn.Module) -> dict[str, list[tuple[str, nn.Parameter]]]:
    groups: dict[str, list] = {"root": [], "block": []}
    for name, p in model.named_parameters():
        groups["block" if name.startswith("block.") else "root"].append((name, p))
    return groups


def padded_numel(p: torch.Tensor, ws: int) -> int:
    """Elements of one rank's padded shard (``ceil(dim0 / ws)`` rows)."""
    return math.ceil(p.shape[0] / ws) * math.prod(p.shape[1:])


def same_casts_step(master: nn.Module, opt, batch, ws: int, param_dtype, reduce_dtype) -> float:
    """What FSDP computes, on one process: per rank slice, a copy of the master model (cast
    to ``param_dtype`` if set) computes its local gradients; they are summed in the reduce
    dtype (``reduce_dtype``, else ``param_dtype``, else the promotion of the gradients'
    dtypes), divided by ``ws`` and cast to each master parameter's dtype."""
    params = list(master.parameters())
    local_grads: list[list[torch.Tensor]] = []
    losses = []
    for r in range(ws):
        x, y = rank_slice(batch, r, ws)
        local = copy.deepcopy(master)
        if param_dtype is not None:
            local.to(param_dtype)
            x = x.to(param_dtype)
        loss = mse32(local, (x, y))
        loss.backward()
        losses.append(loss.item())
        local_grads.append([p.grad for p in local.parameters()])
    dtype = reduce_dtype or param_dtype
    if dtype is None:
        dtype = functools.reduce(torch.promote_types, (g.dtype for g in local_grads[0]))
    for i, p in enumerate(params):
        total = local_grads[0][i].to(dtype)
        for grads in local_grads[1:]:
            total = total + grads[i].to(dtype)
        p.grad = (total / ws).to(p.dtype)
    opt.step()
    opt.zero_grad()
    return sum(losses) / ws


def storages_per_group(model: nn.Module) -> dict[str, int]:
    """How many storages each group's local shards live in (1: one flat buffer)."""
    return {g: len(memory_regions([p for _, p in ps])) for g, ps in mixed_groups(model).items()}


def mixed_parity(other: str, param_dtype, reduce_dtype, setup: str) -> dict:
    """Rank function: train the mixed-dtype model sharded and the same-casts reference.
    ``setup``: "" (1-D mesh), "offload", "reshard_2" (reshard_after_forward=2) or "hsdp"
    (a 2 x (ws/2) mesh)."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    ref = build_mixed(OTHER[other])
    kwargs: dict = {}
    if param_dtype is not None or reduce_dtype is not None:
        kwargs["mp_policy"] = policy("fsdp2", param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if setup == "offload":
        kwargs["offload_policy"] = api("fsdp2", "CPUOffloadPolicy")(pin_memory=False)
    elif setup == "reshard_2":
        kwargs["reshard_after_forward"] = 2
    elif setup == "hsdp":
        names = ("replicate", "shard")
        kwargs["mesh"] = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=names)
    model = shard_mixed(copy.deepcopy(ref), **kwargs)
    ref_opt, opt = adamw(ref), adamw(model)
    ref_params = dict(ref.named_parameters())
    report: dict = {"steps": [], "dtypes": set(), "storages": []}
    for step in range(STEPS):
        batch = global_batch(step, 2 * ws)
        ref_loss = same_casts_step(ref, ref_opt, batch, ws, param_dtype, reduce_dtype)
        loss = mse32(model, rank_slice(batch, rank, ws))
        loss.backward()
        for name, p in model.named_parameters():
            report["dtypes"].add(
                (name, str(p.dtype), str(p.to_local().dtype), str(p.grad.to_local().dtype))
            )
        opt.step()
        opt.zero_grad()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        diffs = {}
        for name, p in model.named_parameters():
            expected = ref_params[name].detach()
            diffs[name] = (str(expected.dtype), (full(p.detach()) - expected).abs().max().item())
        report["steps"].append(
            {"loss": mean_loss.item() / ws, "ref_loss": ref_loss, "params": diffs}
        )
        report["storages"].append(storages_per_group(model))
    report["dtypes"] = sorted(report["dtypes"])
    return report


MIXED_CASES = {
    # name: ((other dtype, param_dtype, reduce_dtype, setup), world sizes)
    "fp32+fp64": (("fp64", None, None, ""), (1, 2, 3, 4)),
    "fp32+bf16": (("bf16", None, None, ""), (2, 3)),
    "fp32+bf16-reduce_fp32": (("bf16", None, FP32, ""), (2, 3)),
    "fp32+fp64-param_bf16": (("fp64", BF16, None, ""), (2, 3)),
    "fp32+fp64-param_bf16-reduce_fp32": (("fp64", BF16, FP32, ""), (2, 3)),
    "fp32+bf16-offload": (("bf16", None, None, "offload"), (2, 3)),
    "fp32+bf16-reshard_2": (("bf16", None, None, "reshard_2"), (4,)),
    "fp32+fp64-param_bf16-reshard_2": (("fp64", BF16, None, "reshard_2"), (4,)),
    "fp32+bf16-hsdp": (("bf16", None, None, "hsdp"), (4,)),
}


@pytest.mark.parametrize(
    ("case", "world_size"), [(c, ws) for c, (_, sizes) in MIXED_CASES.items() for ws in sizes]
)
def test_mixed_dtype_group_matches_reference(case: str, world_size: int) -> None:
    """Sharded parameters keep their own dtypes (and so do their gradients); training
    matches the same-casts reference: bitwise at 1-2 ranks, within ``MIXED_TOL`` at 3-4;
    every group's shards stay in one buffer through the optimizer steps."""
    args = MIXED_CASES[case][0]
    other, param_dtype, reduce_dtype, _ = args
    bf16_reduce = (reduce_dtype or param_dtype) == BF16
    for rank, report in enumerate(run_ranks(mixed_parity, world_size, *args)):
        for name, dtype, local_dtype, grad_dtype in report["dtypes"]:
            expected = str(OTHER[other]) if name.startswith(("head", "block.lin2")) else str(FP32)
            assert (dtype, local_dtype, grad_dtype) == (expected,) * 3, (name, report["dtypes"])
        for step, e in enumerate(report["steps"]):
            where = f"[{case}, ws {world_size}, rank {rank}, step {step}]"
            # Losses are averaged differently (an fp32 all-reduce vs Python floats).
            loss_tol = MP_TOL if bf16_reduce else 1e-5
            assert abs(e["loss"] - e["ref_loss"]) < loss_tol, f"{where} {e}"
            exact = world_size <= 2
            for name, (dtype, diff) in e["params"].items():
                tol = 0.0 if exact else MIXED_TOL[getattr(torch, dtype.split(".")[1])]
                tol = max(tol, MP_TOL) if bf16_reduce and not exact else tol
                assert diff <= tol, f"{where} {name} ({dtype}) differs by {diff:.3g} > {tol}"
        assert all(s == {"root": 1, "block": 1} for s in report["storages"]), report["storages"]


def expected_sizes(other: torch.dtype, ws: int, param_dtype, reduce_dtype) -> dict:
    """Per group: the all-gather's dtype and input bytes, the reduce-scatter's dtype and
    output elements, from the unsharded shapes (every parameter is trainable)."""
    sizes = {}
    for group, params in mixed_groups(build_mixed(other)).items():
        dtypes = [p.dtype for _, p in params]
        numels = [padded_numel(p, ws) for _, p in params]
        ag_dtype = param_dtype or torch.uint8
        per_element = [(param_dtype or d).itemsize for d in dtypes]
        rs_dtype = reduce_dtype or param_dtype or functools.reduce(torch.promote_types, dtypes)
        ag_numel = sum(n * b for n, b in zip(numels, per_element)) // ag_dtype.itemsize
        sizes[group] = {
            "ag_dtype": str(ag_dtype),
            # The divergence checks' tail ends each rank's slot ([Note: in-band
            # fingerprints] in fsdp2/_fingerprints.py).
            "ag_bytes": tailed_numel(ag_numel, ag_dtype) * ag_dtype.itemsize,
            "rs_dtype": str(rs_dtype),
            # fsdp2 appends one "had a gradient" flag per parameter to each rank's chunk,
            # padded to 64 bytes, then the divergence checks' 64-byte fingerprint block
            "rs_numel": sum(numels) + flag_numel(len(params), rs_dtype) + block_numel(rs_dtype),
        }
    return sizes


def mixed_collectives(other: str, param_dtype, reduce_dtype, sizes: dict) -> dict:
    """Rank function: two training steps; every all-gather / reduce-scatter by phase, and
    the storages of the all-gather inputs vs those of each group's shards."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    kwargs = {}
    if param_dtype is not None or reduce_dtype is not None:
        kwargs["mp_policy"] = policy("fsdp2", param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    model = shard_mixed(build_mixed(OTHER[other]), **kwargs)
    opt = adamw(model)
    # Groups are told apart by all-gather input numel (bytes when uint8) and reduce-scatter
    # output numel; the model's shapes keep these four numbers distinct.
    keys: dict[int, str] = {}
    for group, s in sizes.items():
        ag_numel = s["ag_bytes"] // getattr(torch, s["ag_dtype"].split(".")[1]).itemsize
        for numel in (ag_numel, s["rs_numel"]):
            assert keys.setdefault(numel, group) == group, f"group sizes collide: {sizes}"
    ag_storages: list[int] = []
    with CollectiveLog(keys) as log:
        # The function fsdp2's all_gather_flat calls (torch < 2.13 has no all_gather_single).
        name = (
            "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
        )
        inner = getattr(dist, name)

        def spy(output_tensor, input_tensor, *args, **kwargs):
            ag_storages.append(memory_span(input_tensor))
            return inner(output_tensor, input_tensor, *args, **kwargs)

        setattr(dist, name, spy)
        try:
            for step in range(2):
                x, y = rank_slice(global_batch(step, 2 * ws), rank, ws)
                log.phase = f"forward{step}"
                loss = mse32(model, (x, y))
                log.phase = f"backward{step}"
                loss.backward()
                log.phase = ""
                opt.step()
                opt.zero_grad()
        finally:
            setattr(dist, name, inner)
    shard_storages = {
        g: memory_regions([p for _, p in ps]) for g, ps in mixed_groups(model).items()
    }
    return {
        "calls": [
            (c.kind, c.group, c.phase, str(c.in_dtype), str(c.out_dtype), c.in_bytes, c.out_bytes)
            for c in log.calls
        ],
        "out_numels": [(c.kind, c.group, c.out_numel) for c in log.calls],
        "ag_storages": ag_storages,
        "shard_storages": shard_storages,
    }


COLLECTIVE_CASES = {
    "fp32+fp64": ("fp64", None, None),
    "fp32+bf16": ("bf16", None, None),
    "fp32+bf16-reduce_fp32": ("bf16", None, FP32),
    "fp32+fp64-param_bf16-reduce_fp32": ("fp64", BF16, FP32),
}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("case", list(COLLECTIVE_CASES))
def test_mixed_dtype_group_collectives(case: str, world_size: int) -> None:
    """One all-gather per group per pass that needs it (forward; backward for the resharded
    block), in uint8 carrying exactly the padded shards' bytes (param_dtype: in that dtype),
    its input the flat shard buffer itself (no copy-in); one reduce-scatter per group per
    backward, in the reduce dtype (policy, else the promotion of the dtypes)."""
    other, param_dtype, reduce_dtype = COLLECTIVE_CASES[case]
    sizes = expected_sizes(OTHER[other], world_size, param_dtype, reduce_dtype)
    args = (*COLLECTIVE_CASES[case], sizes)
    for rank, r in enumerate(run_ranks(mixed_collectives, world_size, *args)):
        where = f"[{case}, ws {world_size}, rank {rank}]"
        per_phase = {}
        for kind, group, phase, *_ in r["calls"]:
            key = (phase, kind, group)
            per_phase[key] = per_phase.get(key, 0) + 1
        expected = {}
        for step in range(2):
            for group in sizes:
                expected[(f"forward{step}", "AG", group)] = 1
                expected[(f"backward{step}", "RS", group)] = 1
            expected[(f"backward{step}", "AG", "block")] = 1  # the root stays unsharded
        assert per_phase == expected, f"{where} collectives per phase: {per_phase}"
        for kind, group, _, in_dtype, out_dtype, in_bytes, out_bytes in r["calls"]:
            s = sizes[group]
            if kind == "AG":
                assert (in_dtype, out_dtype) == (s["ag_dtype"],) * 2, (where, group, in_dtype)
                assert in_bytes == s["ag_bytes"], (where, group, in_bytes, s)
                assert out_bytes == world_size * s["ag_bytes"], (where, group, out_bytes, s)
            else:
                assert (in_dtype, out_dtype) == (s["rs_dtype"],) * 2, (where, group, in_dtype)
                itemsize = getattr(torch, s["rs_dtype"].split(".")[1]).itemsize
                assert out_bytes == itemsize * s["rs_numel"], (where, group, out_bytes, s)
                assert in_bytes == world_size * out_bytes, (where, group, in_bytes)
        for group, storages in r["shard_storages"].items():
            assert len(storages) == 1, f"{where} {group}: shards in {len(storages)} storages"
            ag_spans = [tuple(span) for span in r["ag_storages"]]
            if param_dtype is None:  # the byte buffer itself is sent
                assert tuple(storages[0]) in ag_spans, f"{where} {group}: all-gather copied in"
            else:  # one cast: a new buffer
                assert not lies_inside(tuple(storages[0]), ag_spans), (where, group)


def grads_and_sgd_step(model: nn.Module, batch) -> dict[str, torch.Tensor]:
    """One forward/backward and a plain SGD step (no optimizer state); full gradients."""
    mse32(model, batch).backward()
    grads = {n: full(p.grad) for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-0.1)
            p.grad = None
    return grads


def mixed_views_survive(other: str) -> dict:
    """Rank function: a trained mixed-dtype model through state_dict, load_state_dict,
    ``to()``, ``to(float64)`` and a meta-device ``to_empty()``."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    dtype = OTHER[other]
    model = shard_mixed(build_mixed(dtype))
    opt = adamw(model)
    for step in range(2):
        mse32(model, rank_slice(global_batch(step, 2 * ws), rank, ws)).backward()
        opt.step()
        opt.zero_grad()
    batch = rank_slice(global_batch(5, 2 * ws), rank, ws)
    report: dict = {}
    sd = model.state_dict()
    report["sd"] = sorted((k, str(v.dtype), is_dtensor(v)) for k, v in sd.items())
    values = {k: full(v).clone() for k, v in sd.items()}

    def same_values(m: nn.Module) -> bool:
        return all(torch.equal(full(p.detach()), values[n]) for n, p in m.named_parameters())

    # load_state_dict into a differently initialized sharded model: in place, same views.
    loaded = shard_mixed(build_mixed(dtype, seed=1))
    ptrs = [p.to_local().data_ptr() for p in loaded.parameters()]
    loaded.load_state_dict(sd)
    report["load_equal"] = same_values(loaded)
    report["load_in_place"] = ptrs == [p.to_local().data_ptr() for p in loaded.parameters()]
    # A meta-device model, materialized with to_empty() and loaded.
    with torch.device("meta"):
        meta = MixedNet(dtype)
    shard_mixed(meta)
    meta.to_empty(device="cpu")
    meta.load_state_dict(sd)
    report["to_empty_equal"] = same_values(meta)
    # module.to() on the device it is on: nothing moves.
    model.to("cpu")
    report["to_same_equal"] = same_values(model)
    # All three then compute the same step, bitwise.
    grads = [grads_and_sgd_step(m, batch) for m in (model, loaded, meta)]
    report["grads_equal"] = all(torch.equal(g[n], grads[0][n]) for g in grads[1:] for n in grads[0])
    report["params_equal_after_step"] = all(
        torch.equal(full(p.detach()), full(q.detach()))
        for m in (loaded, meta)
        for p, q in zip(model.parameters(), m.parameters())
    )
    report["storages"] = [storages_per_group(m) for m in (model, loaded, meta)]
    # to(float64) makes every group one-dtype: values kept, one buffer, still trains.
    before = {n: full(p.detach()).double() for n, p in model.named_parameters()}
    model.to(torch.float64)
    report["f64_values_kept"] = all(
        torch.equal(full(p.detach()), before[n]) for n, p in model.named_parameters()
    )
    grads64 = grads_and_sgd_step(model, (batch[0].double(), batch[1]))
    report["f64_dtypes"] = sorted(
        {
            (str(p.dtype), str(p.to_local().dtype), str(g.dtype))
            for (_, p), g in zip(model.named_parameters(), grads64.values())
        }
    )
    report["f64_storages"] = storages_per_group(model)
    return report


@pytest.mark.parametrize("other", ["fp64", "bf16"])
def test_mixed_dtype_group_state_dict_and_moves(other: str) -> None:
    """The typed views into the byte buffer survive optimizer steps, ``load_state_dict``
    (in place), ``to_empty()`` + load, ``to()``; ``to(float64)`` re-lays the group out as
    one dtype. State dicts hold DTensors in each parameter's own dtype."""
    for rank, r in enumerate(run_ranks(mixed_views_survive, 3, other)):
        where = f"[{other}, rank {rank}]"
        dtypes = {k: d for k, d, _ in r["sd"]}
        assert all(dt for _, _, dt in r["sd"]), f"{where} state dict not DTensors: {r['sd']}"
        assert dtypes["head.weight"] == str(OTHER[other]), (where, dtypes)
        assert dtypes["inp.weight"] == dtypes["block.lin1.bias"] == str(FP32), (where, dtypes)
        for key in ("load_equal", "load_in_place", "to_empty_equal", "to_same_equal"):
            assert r[key], f"{where} {key}"
        assert r["grads_equal"] and r["params_equal_after_step"], where
        assert all(s == {"root": 1, "block": 1} for s in r["storages"]), (where, r["storages"])
        assert r["f64_values_kept"], where
        f64 = str(torch.float64)
        assert r["f64_dtypes"] == [(f64, f64, f64)], (where, r["f64_dtypes"])
        assert r["f64_storages"] == {"root": 1, "block": 1}, (where, r["f64_storages"])


def rank_convert_while_gathered(impl: str) -> dict:
    """A ``reshard_after_forward=False`` module still holds its gathered parameters after an
    eval forward; ``module.to(bfloat16)`` then has to convert the sharded parameters (torch
    reshards before converting), so the dtype change survives and the next step uses it."""
    reference, model = mlp_and_sharded_copy(impl, reshard=False)
    batch = torch.randn(4, 4)
    with torch.no_grad():
        model(batch)
    model.to(BF16)
    reference.to(BF16)
    report: dict = {
        "sharded": all(is_dtensor(p) for p in model.parameters()),
        "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "values": all(
            torch.equal(full(p.detach()), r.detach())
            for p, r in zip(model.parameters(), reference.parameters())
        ),
    }
    if impl == "fsdp2":  # torch 2.13 keeps its fp32 unsharded parameters for this forward
        out = model(batch.to(BF16))
        report["forward"] = torch.equal(out, reference(batch.to(BF16)))
        out.float().sum().backward()
        report["grad_dtypes"] = sorted({str(p.grad.dtype) for p in model.parameters()})
    return report


@pytest.mark.parametrize("impl", IMPLS)
def test_to_dtype_while_parameters_gathered(impl: str) -> None:
    require_impl(impl)
    for rank, r in enumerate(run_ranks(rank_convert_while_gathered, 2, impl)):
        where = f"[{impl}, rank {rank}]"
        assert r["sharded"], f"{where} parameters left unsharded by to(): {r}"
        assert r["dtypes"] == [str(BF16)], (where, r)
        assert r["values"], where
        if impl == "fsdp2":
            assert r["forward"], where
            assert r["grad_dtypes"] == [str(BF16)], (where, r)


def rank_convert_with_unsynced_grads(reduce_dtype: str | None) -> dict:
    """Microbatches accumulated without gradient sync, then ``module.to()``: a dtype change
    is refused before anything changes (the unreduced sums cannot follow the conversion);
    a conversion that changes nothing keeps them; ``reset_iter_state()`` drops them."""
    import fsdp2

    torch.manual_seed(0)
    reference = nn.Linear(4, 3, bias=False)
    model = copy.deepcopy(reference)
    policy = fsdp2.MixedPrecisionPolicy(
        param_dtype=BF16 if reduce_dtype else None,
        reduce_dtype=FP32 if reduce_dtype else None,
    )
    fsdp2.fully_shard(model, mp_policy=policy)
    batch = torch.ones(2, 4)
    model.set_requires_gradient_sync(False)
    model(batch).sum().backward()
    weight = model.weight
    report: dict = {}
    try:
        model.to(torch.float64)
        report["refused"] = None
    except RuntimeError as err:
        report["refused"] = str(err)
    report["untouched"] = model.weight is weight and weight.dtype == FP32
    model.float()  # nothing to convert: allowed, sums kept
    model.set_requires_gradient_sync(True)
    model(batch).sum().backward()
    # Both microbatches, averaged over 2 ranks that saw the same batch.
    reference(batch).sum().mul(2).backward()
    report["grad_kept"] = torch.allclose(full(model.weight.grad), reference.weight.grad)
    model.zero_grad(set_to_none=True)
    model.set_requires_gradient_sync(False)
    model(batch).sum().backward()
    model.reset_iter_state()
    model.to(torch.float64)
    report["after_reset"] = str(model.weight.dtype)
    return report


@pytest.mark.parametrize("reduce_dtype", [None, "fp32"])
def test_to_dtype_with_unsynced_gradients(reduce_dtype: str | None) -> None:
    require_impl("fsdp2")
    for rank, r in enumerate(run_ranks(rank_convert_with_unsynced_grads, 2, reduce_dtype)):
        where = f"[{reduce_dtype}, rank {rank}]"
        assert r["refused"] and "without gradient sync" in r["refused"], (where, r)
        assert r["untouched"] and r["grad_kept"], (where, r)
        assert r["after_reset"] == str(torch.float64), (where, r)


def test_docs_example() -> None:
    """The first ```python block of docs/mixed_precision.md runs on 2 ranks."""
    require_impl("fsdp2")
    doc = pathlib.Path(__file__).resolve().parent.parent / "docs" / "mixed_precision.md"
    assert all(run_ranks(exec_doc_example, 2, first_python_block(doc), str(doc)))


def rank_unsynced_accumulation_and_recompute(impl: str) -> dict:
    """Two mixed-precision paths torch gets right: (1) microbatches accumulated without
    gradient sync sum in ``reduce_dtype`` (fp32), not in bf16, which would round
    256 + 1 + 1 + 1 to 256; (2) activation checkpointing's recomputation inside backward
    casts the module's inputs (to ``param_dtype``) and outputs (to ``output_dtype``) again."""
    from torch.utils.checkpoint import checkpoint

    fully_shard = get_fully_shard(impl)
    policy_cls = importlib.import_module(
        "fsdp2" if impl == "fsdp2" else "torch.distributed.fsdp"
    ).MixedPrecisionPolicy
    model = nn.Linear(2, 2, bias=False)
    fully_shard(model, mp_policy=policy_cls(param_dtype=BF16, reduce_dtype=FP32))
    for i, value in enumerate([256.0, 1.0, 1.0, 1.0]):
        model.set_requires_gradient_sync(i == 3)
        model(torch.full((1, 2), value)).sum().backward()
    accumulated = model.weight.grad.full_tensor().flatten().tolist()

    seen: list[tuple[str, torch.dtype]] = []

    class Recording(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(("in", x.dtype))
            return super().forward(x)

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = Recording(2, 2)

        def run(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            seen.append(("out", y.dtype))
            return y

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.run, x, use_reentrant=False, early_stop=False).float().sum()

    wrapper = Wrapper()
    policy = policy_cls(param_dtype=BF16, output_dtype=FP32)
    fully_shard(wrapper.lin, mp_policy=policy)
    fully_shard(wrapper, mp_policy=policy)
    wrapper(torch.randn(4, 2)).backward()
    return {"accumulated": accumulated, "seen": [(k, str(d)) for k, d in seen]}


@pytest.mark.parametrize("impl", IMPLS)
def test_unsynced_accumulation_and_recompute_casts(impl: str) -> None:
    require_impl(impl)
    # torch < 2.13's post-forward hook returns early inside backward (the recomputation)
    # without the output_dtype cast; 2.13 applies it there (FSDPState._cast_output_dtype).
    recompute_casts = impl == "fsdp2" or torch_fsdp_has(
        "_fully_shard._fsdp_state", "FSDPState._cast_output_dtype"
    )
    for rep in run_ranks(rank_unsynced_accumulation_and_recompute, 2, impl):
        # 2 ranks with the same inputs: the average of 259 over ranks is 259.
        assert rep["accumulated"] == [259.0] * 4, rep
        twice = [("in", "torch.bfloat16"), ("out", "torch.float32")] * 2
        assert rep["seen"] == twice or not recompute_casts, rep
    if not recompute_casts:
        pytest.skip(
            f"torch {torch.__version__}'s FSDP2 lacks FSDPState._cast_output_dtype (the "
            "output_dtype cast of a checkpoint recomputation); accumulation checked"
        )


class FrozenFloat8(nn.Module):
    """A trainable fp32 weight beside a frozen float8 one (a quantized lookup table)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.ones(4, 4).to(torch.float8_e4m3fn), requires_grad=False)
        self.weight = nn.Parameter(torch.arange(16.0).reshape(4, 4) / 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t() + self.table.float().sum()


def rank_frozen_float8_beside_trainable(impl: str) -> tuple[list[float], float]:
    model = FrozenFloat8()
    get_fully_shard(impl)(model)
    out = model(torch.ones(2, 4))
    out.sum().backward()
    # The table is checked through the output: gloo cannot gather a float8 DTensor.
    return model.weight.grad.full_tensor().flatten().tolist(), out[0, 0].item()


@pytest.mark.parametrize("impl", IMPLS)
def test_frozen_float8_param_beside_trainable(impl: str) -> None:
    """A group may hold a frozen parameter whose dtype has no promotion with the trainable
    ones (float8 and fp32): only trainable parameters are reduced, so only their dtypes
    decide the reduce dtype. torch accepts this group; fsdp2 failed at the first forward."""
    require_impl(impl)
    for grad, first in run_ranks(rank_frozen_float8_beside_trainable, 2, impl):
        assert grad == [2.0] * 16
        assert first == (0 + 1 + 2 + 3) / 16 + 16  # row 0 of the weight, plus the table's sum


def rank_grad_scaler(impl: str) -> tuple[list[float], list[torch.Tensor]]:
    """fp16 compute with ``torch.amp.GradScaler``, ``unscale_`` and clipping; step 1 feeds
    an inf on rank 0 only. Returns the scale after each step and the full parameters."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    mp = api(impl, "MixedPrecisionPolicy")(param_dtype=torch.float16, reduce_dtype=torch.float32)
    get_fully_shard(impl)(model[0], mp_policy=mp)
    get_fully_shard(impl)(model, mp_policy=mp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    rank, ws = dist.get_rank(), dist.get_world_size()
    scales = []
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).chunk(ws)[rank]
        if step == 1 and rank == 0:
            x = x * float("inf")
        scaler.scale(model(x).float().pow(2).mean()).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales, [p.full_tensor() for p in model.parameters()]


def test_grad_scaler_with_fp16_equals_torch() -> None:
    """The gradient shards are ``DTensor``s: ``GradScaler`` unscales and checks them, and an
    inf on one rank reaches every rank through the reduction, so all skip that step."""
    for impl in IMPLS:
        require_impl(impl)
    ours, theirs = (run_ranks(rank_grad_scaler, 2, impl) for impl in IMPLS)
    for (scales, params), (torch_scales, torch_params) in zip(ours, theirs, strict=True):
        assert scales == torch_scales == [256.0, 128.0, 128.0]
        for p, q in zip(params, torch_params, strict=True):
            assert torch.equal(p, q)
