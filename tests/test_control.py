"""Explicit control of the FSDP runtime: ``unshard``/``reshard``, forward methods,
gradient scaling switches, recovery with ``reset_iter_state``, hooks on reduced gradients,
``share_comm_ctx``, ``set_post_optim_event`` and ``set_reshard_after_forward``.

Every test runs on 2 ranks with ``_control_helpers.Net`` (a root group and 4 block groups
of different sizes, so intercepted collectives map back to their group) and, where
training is involved, compares every parameter with an unsharded reference trained on the
global batch (fp32, max abs diff <= 1e-5). Tests are parametrized on ``impl`` ("fsdp2",
"torch") wherever torch supports the same thing: the semantics must be equal.

Gradient accumulation (``set_requires_gradient_sync``, ``set_reshard_after_backward``,
``set_is_last_backward``) is in ``test_grad_accumulation.py``; explicit prefetching in
``test_prefetch.py``.

Where torch differs (documented in docs/torch_mapping.md):

* torch's ``set_gradient_divide_factor`` with a factor other than the world size needs
  ``ReduceOp.PREMUL_SUM``, which gloo lacks: torch runs those cases with
  ``set_force_sum_reduction_for_comms(True)`` (which keeps the values, see below).
* calling an unregistered method, or ``forward`` directly, on sharded parameters: fsdp2
  raises an explanatory ``RuntimeError``; torch raises DTensor's "mixed torch.Tensor and
  DTensor" ``RuntimeError``.
"""

from __future__ import annotations

import math
import pathlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _control_helpers import (
    IN_DIM,
    TOL,
    CollectiveLog,
    adamw,
    api,
    build_net,
    clone_model,
    fsdp_modules,
    full_grads,
    global_batch,
    group_numels,
    group_of,
    max_param_diff,
    mse,
    rank_slice,
    reference_step,
    shard_net,
)
from _helpers import (
    IMPLS,
    get_fully_shard,
    is_dtensor,
    require_impl,
    require_impl_feature,
    torch_fsdp_has,
)
from _launcher import run_ranks
from test_grad_accumulation import exec_doc_example, first_python_block
from torch.distributed.tensor import DTensor

GROUPS = ["root", "blocks.0", "blocks.1", "blocks.2", "blocks.3"]
BLOCK_GROUPS = GROUPS[1:]


def _train_step(model, opt, batch, rank, ws) -> None:
    mse(model, rank_slice(batch, rank, ws)).backward()
    opt.step()
    opt.zero_grad()


def _check_parity(ref, model, where: str) -> None:
    name, diff = max_param_diff(ref, model)
    assert diff <= TOL, f"{where}: parameter {name} differs from the reference by {diff:.3g}"


def _registered_is_sharded(module) -> bool:
    return all(is_dtensor(p) for p in module.parameters())


# ------------------------------------------------------------------ unshard / reshard


def unshard_controls(impl: str) -> dict:
    """Rank function: ``unshard(async_op=True)`` + forward, ``handle.wait()``, sync
    ``unshard()``, ``reshard()``; all-gather counts per phase; parity throughout."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    handle_cls = api(impl, "UnshardHandle")
    ref = build_net()
    model = shard_net(clone_model(ref), impl)
    ref_opt, opt = adamw(ref), adamw(model)
    counts: dict[str, dict[str, int]] = {}
    with CollectiveLog(group_numels(ref, ws)) as log:

        def step(n: int) -> None:
            batch = global_batch(n, 2 * ws)
            reference_step(ref, ref_opt, batch)
            log.phase = f"forward{n}"
            loss = mse(model, rank_slice(batch, rank, ws))
            log.phase = f"backward{n}"
            loss.backward()
            log.phase = ""
            opt.step()
            opt.zero_grad()
            _check_parity(ref, model, f"after step {n}")
            counts[f"forward{n}"] = {g: log.count("AG", f"forward{n}", g) for g in GROUPS}

        step(0)  # lazy initialization

        # 1. async unshard, no explicit wait: the forward waits and does not all-gather again.
        log.phase = "unshard1"
        handle = model.blocks[1].unshard(async_op=True)
        assert isinstance(handle, handle_cls), type(handle)
        assert log.groups("AG", "unshard1") == ["blocks.1"], log.groups("AG", "unshard1")
        step(1)
        assert _registered_is_sharded(model.blocks[1]), "not resharded after forward"

        # 2. async unshard + wait(): the unsharded parameters are registered, full values.
        log.phase = "unshard2"
        handle = model.blocks[2].unshard(async_op=True)
        handle.wait()
        handle.wait()  # idempotent
        lin1 = model.blocks[2].lin1
        assert not is_dtensor(lin1.weight), type(lin1.weight)
        assert (lin1.weight - ref.blocks[2].lin1.weight).abs().max() <= TOL, "unsharded values"
        assert model.blocks[2].unshard(async_op=True) is not None  # already unsharded: no AG
        assert log.groups("AG", "unshard2") == ["blocks.2"], log.groups("AG", "unshard2")
        step(2)

        # 3. sync unshard returns None; reshard() registers the shards again.
        log.phase = "unshard3"
        assert model.blocks[3].unshard() is None
        weight = model.blocks[3].lin2.weight
        assert not is_dtensor(weight) and weight.shape == ref.blocks[3].lin2.weight.shape
        assert (weight - ref.blocks[3].lin2.weight).abs().max() <= TOL
        model.blocks[3].reshard()
        assert _registered_is_sharded(model.blocks[3])
        assert log.groups("AG", "unshard3") == ["blocks.3"], log.groups("AG", "unshard3")
        step(3)

        # 4. the root too (reshard_after_forward=None keeps it unsharded for backward).
        log.phase = "unshard4"
        model.unshard()
        assert not is_dtensor(model.inp.weight) and _registered_is_sharded(model.blocks[0])
        step(4)
        log.phase = "unshard4"
        model.reshard()
        assert _registered_is_sharded(model)
        counts["unshard4"] = {g: log.count("AG", "unshard4", g) for g in GROUPS}
    return counts


@pytest.mark.parametrize("impl", IMPLS)
def test_unshard_reshard(impl: str) -> None:
    require_impl(impl)
    for rank, counts in enumerate(run_ranks(unshard_controls, 2, impl)):
        expected_forward = {
            0: dict.fromkeys(GROUPS, 1),
            1: {**dict.fromkeys(GROUPS, 1), "blocks.1": 0},
            2: {**dict.fromkeys(GROUPS, 1), "blocks.2": 0},
            3: dict.fromkeys(GROUPS, 1),  # resharded by reshard(): gathered again
            4: {**dict.fromkeys(GROUPS, 1), "root": 0},
        }
        for n, expected in expected_forward.items():
            assert counts[f"forward{n}"] == expected, (impl, rank, n, counts[f"forward{n}"])
        assert counts["unshard4"] == {**dict.fromkeys(GROUPS, 0), "root": 1}, counts["unshard4"]


# ------------------------------------------------------------------ forward methods


def forward_methods(impl: str) -> dict:
    """Rank function: a registered ``generate`` matches the reference and leaves the model
    trainable; an unregistered method and a direct ``forward`` call fail."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    ref = build_net()
    model = shard_net(clone_model(ref), impl)
    api(impl, "register_fsdp_forward_method")(model, "generate")
    ref_opt, opt = adamw(ref), adamw(model)
    x = global_batch(100, 3)[0]
    report: dict = {"generate": [], "errors": {}}
    for n in range(2):
        with torch.no_grad():
            expected, got = ref.generate(x, 3), model.generate(x, 3)
        report["generate"].append((got - expected).abs().max().item())
        # with grad: generate is a forward of the root group and backward works through it
        ref.generate(x, 2).square().mean().backward()
        model.generate(x, 2).square().mean().backward()
        grads = full_grads(model)
        worst = max((grads[k] - p.grad).abs().max().item() for k, p in ref.named_parameters())
        report["generate"].append(worst)
        ref_opt.zero_grad()
        opt.zero_grad()
        assert _registered_is_sharded(model)
        batch = global_batch(n, 2 * ws)
        reference_step(ref, ref_opt, batch)
        _train_step(model, opt, batch, rank, ws)
        _check_parity(ref, model, f"after step {n}")
    for name, call in (
        ("method", lambda: model.embed_only(x)),
        ("forward", lambda: model.forward(x)),
        ("block_forward", lambda: model.blocks[0].forward(torch.ones(2, 16))),
    ):
        try:
            call()
        except RuntimeError as error:
            report["errors"][name] = str(error)
        else:
            report["errors"][name] = None
    # Read-only use after an explicit unshard() works in both implementations.
    model.unshard()
    report["unsharded_method"] = (model.embed_only(x) - ref.embed_only(x)).abs().max().item()
    model.reshard()
    return report


@pytest.mark.parametrize("impl", IMPLS)
def test_register_fsdp_forward_method(impl: str) -> None:
    require_impl(impl)
    for report in run_ranks(forward_methods, 2, impl):
        assert max(report["generate"]) <= TOL, report["generate"]
        assert report["unsharded_method"] <= TOL, report["unsharded_method"]
        errors = report["errors"]
        assert all(errors.values()), f"calls on sharded parameters did not fail: {errors}"
        if impl == "torch":  # torch: DTensor's own error
            assert all("DTensor" in e for e in errors.values()), errors
            continue
        assert "FSDPNet.embed_only()" in errors["method"], errors["method"]
        for needle in ("register_fsdp_forward_method", "unshard()"):
            assert needle in errors["method"], errors["method"]
            assert needle in errors["forward"], errors["forward"]
        assert "FSDPNet.forward() was called directly" in errors["forward"], errors["forward"]
        assert "FSDPBlock.forward() was called directly" in errors["block_forward"]


# ------------------------------------------------------------------ gradient scaling

FACTOR = 3.0


def _local_grads(ref, batch, rank, ws) -> dict[str, torch.Tensor]:
    """Summed over ranks: each rank's gradient of its own local mean loss."""
    local = clone_model(ref)
    mse(local, rank_slice(batch, rank, ws)).backward()
    grads = {}
    for name, p in local.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        grads[name] = g
    return grads


def _flat_shard(grads: dict[str, torch.Tensor], group: str, rank: int, ws: int) -> torch.Tensor:
    """A group's flat local gradient shard (dims divide by 2: no padding)."""
    names = [n for n in grads if group_of(n) == group]
    return torch.cat([grads[n].chunk(ws)[rank].flatten() for n in names])


def reduction(impl: str, mode: str) -> dict:
    """Rank function: one backward with a divide factor / force-sum / all-reduce hook;
    returns max abs diffs of the sharded gradients (and hook inputs) from the expected."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    ref = build_net()
    model = shard_net(clone_model(ref), impl)
    modules = fsdp_modules(model, impl)
    batch = global_batch(0, 4 * ws)
    grad_sum = _local_grads(ref, batch, rank, ws)
    numels = group_numels(ref, ws)
    hook_inputs: list[torch.Tensor] = []

    def hook(output: torch.Tensor) -> None:
        hook_inputs.append(output.detach().clone())
        if mode == "hook_scales":
            output.mul_(0.5)

    # expected gradient = sum over ranks / divisor[group]; hook sees sum / hook_divisor
    divisor = dict.fromkeys(GROUPS, float(ws))
    hook_divisor = float(ws)
    hook_on = modules
    if mode == "divide_factor":
        for m in modules:
            m.set_gradient_divide_factor(FACTOR)
        divisor = dict.fromkeys(GROUPS, FACTOR)
        hook_divisor = FACTOR
    elif mode in ("force_sum", "divide_factor_force_sum"):
        # torch: sum-only collectives, then division afterwards; the gradients keep their
        # values, and the hook sees the not-yet-divided sum.
        for m in modules:
            m.set_force_sum_reduction_for_comms(True)
            if mode == "divide_factor_force_sum":
                m.set_gradient_divide_factor(FACTOR)
        if mode == "divide_factor_force_sum":
            divisor = dict.fromkeys(GROUPS, FACTOR)
        hook_divisor = 1.0
    elif mode == "root_only":
        # torch's setters act on the module they are called on, not on its children.
        if impl == "torch":  # gloo has no PREMUL_SUM: force sum (values unchanged)
            for m in modules:
                m.set_force_sum_reduction_for_comms(True)
        model.set_gradient_divide_factor(FACTOR)
        divisor["root"] = FACTOR
        hook_on = [model]
        hook_divisor = 1.0 if impl == "torch" else FACTOR
    for m in hook_on:
        m.set_all_reduce_hook(hook)
    scale = 0.5 if mode == "hook_scales" else 1.0
    with CollectiveLog(numels) as log:
        mse(model, rank_slice(batch, rank, ws)).backward()
    grads = full_grads(model)
    grad_diff = max(
        (grads[n] - scale * g / divisor[group_of(n)]).abs().max().item()
        for n, g in grad_sum.items()
    )
    expected_hook = {
        numels[t.numel()]: _flat_shard(grad_sum, numels[t.numel()], rank, ws) / hook_divisor
        for t in hook_inputs
    }
    hook_diff = max(
        [(t - expected_hook[numels[t.numel()]]).abs().max().item() for t in hook_inputs],
        default=0.0,
    )
    return {
        "grad_diff": grad_diff,
        "hook_groups": sorted(numels[t.numel()] for t in hook_inputs),
        "hook_expected_groups": sorted(["root"] if mode == "root_only" else GROUPS),
        "hook_diff": hook_diff,
        "rs_ops": sorted({c.op for c in log.calls if c.kind == "RS"}),
    }


REDUCTION_CASES = [
    ("fsdp2", "mean"),
    ("torch", "mean"),
    ("fsdp2", "hook_scales"),
    ("torch", "hook_scales"),
    # torch + gloo: a factor other than the world size needs PREMUL_SUM (NCCL only)
    ("fsdp2", "divide_factor"),
    ("fsdp2", "force_sum"),
    ("torch", "force_sum"),
    ("fsdp2", "divide_factor_force_sum"),
    ("torch", "divide_factor_force_sum"),
    ("fsdp2", "root_only"),
    ("torch", "root_only"),
]


@pytest.mark.parametrize(("impl", "mode"), REDUCTION_CASES)
def test_gradient_reduction(impl: str, mode: str) -> None:
    """mean: sum / world size; divide_factor: sum / 3; force_sum: SUM collectives, same
    gradients, the all-reduce hook sees the sum; hook_scales: the hook's in-place change is
    what is stored; root_only: the setters called on the root do not reach the blocks."""
    require_impl(impl)
    for rank, r in enumerate(run_ranks(reduction, 2, impl, mode)):
        where = f"[{impl}, {mode}, rank {rank}]"
        assert r["grad_diff"] <= TOL, f"{where} gradients differ by {r['grad_diff']:.3g}"
        assert r["hook_groups"] == r["hook_expected_groups"], f"{where} hook calls {r}"
        assert r["hook_diff"] <= TOL, f"{where} hook inputs differ by {r['hook_diff']:.3g}"
        # As torch: fp32 gradients with the default divisor are averaged by the
        # collective (ReduceOp.AVG; on NCCL it scales inputs before summing, so results
        # match torch's bits there too); a custom divisor or force-sum sums, then divides.
        avg, total = str(dist.ReduceOp.AVG), str(dist.ReduceOp.SUM)
        expected_ops = {"mean": [avg], "hook_scales": [avg]}
        if mode == "root_only" and impl == "fsdp2":  # torch's run forces sums (above)
            expected_ops["root_only"] = [avg, total]
        assert r["rs_ops"] == expected_ops.get(mode, [total]), f"{where} ops {r['rs_ops']}"


# ------------------------------------------------------------------ reset_iter_state


def recover(impl: str, where: str) -> dict:
    """Rank function: step 2 fails in the middle of forward or backward; after
    ``reset_iter_state()`` the step is retried and training matches the reference."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    ref = build_net()
    model = shard_net(clone_model(ref), impl)
    ref_opt, opt = adamw(ref), adamw(model)
    report: dict = {"errors": [], "counts_after_reset": None}
    with CollectiveLog(group_numels(ref, ws)) as log:
        for step in range(4):
            batch = global_batch(step, 2 * ws)
            reference_step(ref, ref_opt, batch)
            local = rank_slice(batch, rank, ws)
            if step == 2:
                try:
                    if where == "forward":
                        model.blocks[2].fail_next_forward = True
                        mse(model, local)
                    else:
                        model.blocks[1].fail_next_backward = True
                        mse(model, local).backward()
                except RuntimeError as error:
                    report["errors"].append(str(error))
                model.reset_iter_state()
                opt.zero_grad()  # gradients of the failed step are partial: drop them
                report["sharded_after_reset"] = _registered_is_sharded(model)
                log.phase = "retry"
            _train_step(model, opt, batch, rank, ws)
            log.phase = ""
            _check_parity(ref, model, f"after step {step}")
    report["counts_after_reset"] = (log.count("AG", "retry"), log.count("RS", "retry"))
    return report


@pytest.mark.parametrize(
    ("impl", "where"),
    # torch + backward: torch's reset_iter_state keeps the unsharded gradients autograd
    # already wrote for the failing block, and the retried backward adds to them.
    [("fsdp2", "forward"), ("torch", "forward"), ("fsdp2", "backward")],
)
def test_reset_iter_state_after_exception(impl: str, where: str) -> None:
    require_impl_feature(
        impl, torch_fsdp_has("", "FSDPModule.reset_iter_state"), "FSDPModule.reset_iter_state"
    )
    for report in run_ranks(recover, 2, impl, where):
        assert len(report["errors"]) == 1 and "injected" in report["errors"][0], report
        assert report["sharded_after_reset"], "reset_iter_state left parameters unsharded"
        # the retried step is an ordinary one: 5 + 4 all-gathers, 5 reduce-scatters
        assert report["counts_after_reset"] == (9, 5), report["counts_after_reset"]


# ------------------------------------------------------------------ optimizer in backward


def optimizer_in_backward(impl: str) -> dict:
    """Rank function: a per-parameter AdamW stepped from post-accumulate-grad hooks on
    the sharded parameters; matches a normal AdamW on the reference."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    ref = build_net()
    model = shard_net(clone_model(ref), impl)
    ref_opt = adamw(ref)
    names = {p: n for n, p in model.named_parameters()}
    optims = {p: torch.optim.AdamW([p], lr=1e-2, eps=1e-3) for p in model.parameters()}
    fired: list[tuple[str, bool, bool, int]] = []
    log = CollectiveLog(group_numels(ref, ws))

    def hook(p: torch.nn.Parameter) -> None:
        name = names[p]
        fired.append(
            (
                name,
                isinstance(p.grad, DTensor),
                p.grad.to_local().shape == p.to_local().shape,
                log.count("RS", log.phase, group_of(name)),
            )
        )
        optims[p].step()
        optims[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    steps = []
    with log:
        for step in range(3):
            batch = global_batch(step, 2 * ws)
            reference_step(ref, ref_opt, batch)
            fired.clear()
            log.phase = f"step{step}"
            mse(model, rank_slice(batch, rank, ws)).backward()
            log.phase = ""
            steps.append(
                {
                    "fired": sorted(fired),
                    "grads_left": [n for n, p in model.named_parameters() if p.grad is not None],
                    "param_worst": max_param_diff(ref, model),
                }
            )
    return {"steps": steps, "names": sorted(names.values())}


@pytest.mark.parametrize("impl", IMPLS)
def test_post_accumulate_grad_hooks(impl: str) -> None:
    require_impl(impl)
    for report in run_ranks(optimizer_in_backward, 2, impl):
        for step, e in enumerate(report["steps"]):
            assert [f[0] for f in e["fired"]] == report["names"], f"step {step}: {e['fired']}"
            for name, is_dt, local_shape, rs_issued in e["fired"]:
                assert is_dt and local_shape, f"step {step}: {name}: grad is not the shard"
                assert rs_issued == 1, f"step {step}: {name}: hook ran before the reduce-scatter"
            assert not e["grads_left"], e["grads_left"]
            name, diff = e["param_worst"]
            assert diff <= TOL, f"step {step}: {name} differs from the reference by {diff:.3g}"


# ------------------------------------------------------------------ share_comm_ctx etc.


def two_roots(impl: str, style: str) -> dict:
    """Rank function: two separately-rooted models sharing a comm context, with a
    post-optimizer event each step. ``alternate``: each model trains on its own (a model
    and, e.g., a second model in the same loop); ``pipeline``: two stages of one model,
    ``stage2(stage1(x))``, with one backward per stage as a pipeline schedule runs them."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    ref1, ref2 = build_net(0), build_net(1, hiddens=(4, 6))
    model1 = shard_net(clone_model(ref1), impl)
    model2 = shard_net(clone_model(ref2), impl)
    api(impl, "share_comm_ctx")([model1, model2])
    api(impl, "share_comm_ctx")([])  # nothing to share: a no-op in torch, not an error
    ref_opts = [adamw(ref1), adamw(ref2)]
    opts = [adamw(model1), adamw(model2)]
    diffs = []
    for step in range(3):
        x, y = global_batch(step, 2 * ws)
        xl, yl = rank_slice((x, y), rank, ws)
        if style == "alternate":
            for ref, model, ref_opt, opt in zip((ref1, ref2), (model1, model2), ref_opts, opts):
                reference_step(ref, ref_opt, (x, y))
                _train_step(model, opt, (x, y), rank, ws)
        else:
            F.mse_loss(ref2(ref1(x)), y).backward()
            h = model1(xl)
            h_in = h.detach().requires_grad_()
            F.mse_loss(model2(h_in), yl).backward()
            h.backward(h_in.grad)
            for o in (*ref_opts, *opts):
                o.step()
                o.zero_grad()
        # On the CPU there are no streams: an event (not recordable here) is just accepted.
        for model in (model1, model2):
            model.set_post_optim_event(torch.Event(device="cpu"))
        diffs.append(max(max_param_diff(ref1, model1)[1], max_param_diff(ref2, model2)[1]))
    return {"diffs": diffs}


@pytest.mark.parametrize(
    ("impl", "style"),
    # torch + pipeline: IndexError in torch's backward prefetch (the shared context's
    # post-forward order is cleared by the first stage's backward).
    [("fsdp2", "alternate"), ("torch", "alternate"), ("fsdp2", "pipeline")],
)
def test_share_comm_ctx_and_post_optim_event(impl: str, style: str) -> None:
    require_impl(impl)
    for report in run_ranks(two_roots, 2, impl, style):
        assert max(report["diffs"]) <= TOL, report["diffs"]


def reshard_after_forward_switch(impl: str) -> dict:
    """Rank function: backward all-gathers per step as ``set_reshard_after_forward``
    changes between steps."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    ref = build_net()
    model = shard_net(clone_model(ref), impl)
    ref_opt, opt = adamw(ref), adamw(model)
    settings = [
        lambda: None,  # default: blocks True, root False (None)
        lambda: model.set_reshard_after_forward(False),  # recursive: nothing reshards
        lambda: model.set_reshard_after_forward(True),  # the root too
        lambda: (
            model.set_reshard_after_forward(False),
            model.blocks[0].set_reshard_after_forward(True, recurse=False),
        ),
    ]
    counts = []
    with CollectiveLog(group_numels(ref, ws)) as log:
        for step, apply in enumerate(settings):
            apply()
            batch = global_batch(step, 2 * ws)
            reference_step(ref, ref_opt, batch)
            local = rank_slice(batch, rank, ws)
            log.phase = "forward"
            loss = mse(model, local)
            log.phase = "backward"
            loss.backward()
            log.phase = ""
            opt.step()
            opt.zero_grad()
            counts.append((log.count("AG", "forward"), sorted(log.groups("AG", "backward"))))
            log.calls.clear()
            _check_parity(ref, model, f"after step {step}")
    return {"counts": counts}


@pytest.mark.parametrize("impl", IMPLS)
def test_set_reshard_after_forward(impl: str) -> None:
    require_impl(impl)
    expected = [
        (5, sorted(BLOCK_GROUPS)),
        (5, []),
        (5, sorted(GROUPS)),
        (5, ["blocks.0"]),
    ]
    for report in run_ranks(reshard_after_forward_switch, 2, impl):
        assert report["counts"] == expected, report["counts"]


def separate_reduce_scatter_group(impl: str) -> dict:
    """Three AdamW steps with ``set_separate_reduce_scatter_group()`` on the root (all
    groups), then one with it switched off again: parity with the reference, and which
    process groups the all-gathers and reduce-scatters used."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    ref = build_net()
    model = shard_net(clone_model(ref), impl)
    model.set_separate_reduce_scatter_group()
    opt, ref_opt = adamw(model), adamw(ref)
    used: list[tuple[str, str]] = []
    for step in range(4):
        if step == 3:
            model.set_separate_reduce_scatter_group(False)
        batch = global_batch(step, 8)
        with CollectiveLog(group_numels(model, ws)) as log:
            _train_step(model, opt, batch, rank, ws)
        reference_step(ref, ref_opt, batch)
        ag_groups = {id(c.process_group) for c in log.calls if c.kind == "AG"}
        rs_groups = {id(c.process_group) for c in log.calls if c.kind == "RS"}
        (ag_group,) = ag_groups
        (rs_group,) = rs_groups  # one new group for all five (same ranks)
        used.append(("shared" if rs_group == ag_group else "separate", f"{len(log.calls)}"))
    return {"diff": max_param_diff(ref, model)[1], "used": [u for u, _ in used]}


@pytest.mark.parametrize("impl", IMPLS)
def test_separate_reduce_scatter_group(impl: str) -> None:
    """torch's ``set_separate_reduce_scatter_group``: reduce-scatters on a process group
    of their own (one for all groups over the same ranks), switchable back; fsdp2 raised
    NotImplementedError."""
    require_impl_feature(
        impl,
        torch_fsdp_has("", "FSDPModule.set_separate_reduce_scatter_group"),
        "FSDPModule.set_separate_reduce_scatter_group",
    )
    for report in run_ranks(separate_reduce_scatter_group, 2, impl):
        assert report["diff"] <= TOL, report["diff"]
        assert report["used"] == ["separate"] * 3 + ["shared"], report["used"]


class _CountingComm:
    """torch's ``AllGather`` / ``ReduceScatter`` contract over ``torch.distributed``,
    counting allocations and calls."""

    def __init__(self) -> None:
        self.allocations: list[tuple[tuple[int, ...], torch.dtype]] = []
        self.calls = 0

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.allocations.append((tuple(size), dtype))
        return torch.empty(*size, dtype=dtype, device=device)


def _custom_comms(impl: str) -> tuple[Any, Any]:
    if impl == "torch":
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    else:
        AllGather = ReduceScatter = object  # fsdp2 needs no base class

    class CountingAllGather(_CountingComm, AllGather):  # type: ignore[misc, valid-type]
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            self.calls += 1
            return dist.all_gather_into_tensor(
                output_tensor, input_tensor, group=group, async_op=async_op
            )

    class CountingReduceScatter(_CountingComm, ReduceScatter):  # type: ignore[misc, valid-type]
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            self.calls += 1
            return dist.reduce_scatter_tensor(
                output_tensor, input_tensor, op=op, group=group, async_op=async_op
            )

    return CountingAllGather(), CountingReduceScatter()


def custom_collectives(impl: str, single_param_blocks: bool) -> dict:
    """Three AdamW steps with a custom all-gather and reduce-scatter on every sharded
    module: parity with the reference; how often the comm objects allocated and ran.
    ``single_param_blocks``: 4 groups of one parameter each (bias-free Linears) and a
    root Linear: such groups gather in place into the unsharded buffer without a custom
    all-gather."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    if single_param_blocks:
        torch.manual_seed(0)
        ref: Any = torch.nn.Sequential(
            *(torch.nn.Linear(IN_DIM, IN_DIM, bias=False) for _ in range(4)),
            torch.nn.Linear(IN_DIM, IN_DIM),
        )
        model = clone_model(ref)
        for block in list(model)[:4]:
            get_fully_shard(impl)(block)
        get_fully_shard(impl)(model)
    else:
        ref = build_net()
        model = shard_net(clone_model(ref), impl)
    all_gather, reduce_scatter = _custom_comms(impl)
    for module in fsdp_modules(model, impl):
        module.set_custom_all_gather(all_gather)
        module.set_custom_reduce_scatter(reduce_scatter)
    opt, ref_opt = adamw(model), adamw(ref)
    for step in range(3):
        batch = global_batch(step, 8)
        _train_step(model, opt, batch, rank, ws)
        reference_step(ref, ref_opt, batch)
    return {
        "diff": max_param_diff(ref, model)[1],
        "ag": (len(all_gather.allocations), all_gather.calls),
        "rs": (len(reduce_scatter.allocations), reduce_scatter.calls),
    }


@pytest.mark.parametrize("single_param_blocks", [False, True], ids=["blocks", "in_place"])
@pytest.mark.parametrize("impl", IMPLS)
def test_custom_all_gather_and_reduce_scatter(impl: str, single_param_blocks: bool) -> None:
    """torch's ``set_custom_all_gather`` / ``set_custom_reduce_scatter``: every
    all-gather allocates its output and runs through the comm object, every reduce-scatter
    its input and output; training is unchanged. fsdp2 raised NotImplementedError."""
    require_impl(impl)
    for report in run_ranks(custom_collectives, 2, impl, single_param_blocks):
        assert report["diff"] <= TOL, report["diff"]
        ag_allocations, ag_calls = report["ag"]
        rs_allocations, rs_calls = report["rs"]
        # Per step: the 4 blocks gather in forward and again in backward, the root once;
        # every group reduce-scatters once.
        assert ag_calls == 3 * 9 and ag_allocations == ag_calls, report
        assert rs_calls == 3 * 5 and rs_allocations == 2 * rs_calls, report


def process_group_allocated_buffers(impl: str, backend_can_allocate: bool) -> dict:
    """``set_allocate_memory_from_process_group_for_comm(True)`` on every sharded module,
    three AdamW steps, then ``False`` and one more. gloo has no backend allocator, so the
    call changes nothing (as in torch); ``backend_can_allocate`` (fsdp2 only) pretends it
    has one, counting the buffers it hands out."""
    import fsdp2._collectives as collectives
    import fsdp2._fully_shard as api

    rank, ws = dist.get_rank(), dist.get_world_size()
    allocations: list[tuple[int, ...]] = []
    saved = (api.backend_allocates, collectives.backend_tensor)
    # Collectives seen through torch's current names (tests patch those; the old names
    # warn FutureWarning and call the current ones inside torch, past any patch).
    seen = {"all_gather_single": 0, "reduce_scatter_single": 0}
    originals = {name: getattr(dist, name, None) for name in seen}
    for name, original in originals.items():
        if original is not None:

            def counted(*args: Any, _name: str = name, _orig: Any = original, **kw: Any) -> Any:
                seen[_name] += 1
                return _orig(*args, **kw)

            setattr(dist, name, counted)
    if backend_can_allocate:

        def fake_tensor(group: Any, size: Any, dtype: Any, device: Any) -> torch.Tensor:
            allocations.append(tuple(size))
            return torch.empty(math.prod(size), dtype=dtype, device=device)

        api.backend_allocates = lambda group, device: True  # type: ignore[assignment]
        collectives.backend_tensor = fake_tensor  # type: ignore[assignment]
    try:
        ref = build_net()
        model = shard_net(clone_model(ref), impl)
        modules = fsdp_modules(model, impl)
        for module in modules:
            module.set_allocate_memory_from_process_group_for_comm(True)
        installed = impl == "fsdp2" and any(
            g.custom_all_gather is not None for m in modules for g in m._fsdp_state.groups
        )
        opt, ref_opt = adamw(model), adamw(ref)
        for step in range(4):
            if step == 3:
                for module in modules:
                    module.set_allocate_memory_from_process_group_for_comm(False)
                during = len(allocations)
            batch = global_batch(step, 8)
            _train_step(model, opt, batch, rank, ws)
            reference_step(ref, ref_opt, batch)
    finally:
        api.backend_allocates, collectives.backend_tensor = saved
        for name, original in originals.items():
            if original is not None:
                setattr(dist, name, original)
    return {
        "seen": seen if all(originals.values()) else None,
        "diff": max_param_diff(ref, model)[1],
        "installed": installed,
        "during": len(allocations) if not backend_can_allocate else during,
        "after": len(allocations),
    }


@pytest.mark.parametrize(
    ("impl", "backend_can_allocate"),
    [("fsdp2", False), ("torch", False), ("fsdp2", True)],
    ids=["fsdp2-gloo", "torch-gloo", "fsdp2-allocating-backend"],
)
def test_process_group_allocated_buffers(impl: str, backend_can_allocate: bool) -> None:
    """torch's ``set_allocate_memory_from_process_group_for_comm``: on gloo it is accepted
    and changes nothing; with a backend that allocates, every all-gather output and
    reduce-scatter buffer comes from it until it is switched off; training is unchanged
    either way. fsdp2 raised NotImplementedError."""
    require_impl(impl)
    for report in run_ranks(process_group_allocated_buffers, 2, impl, backend_can_allocate):
        assert report["diff"] <= TOL, report["diff"]
        assert report["installed"] is backend_can_allocate
        if backend_can_allocate:
            # Three steps: 9 all-gathers (4 blocks twice, the root once) and 5 groups
            # reduce-scattering (input and output) per step; none after switching off.
            assert report["during"] == 3 * (9 + 2 * 5) == report["after"], report
            # Four steps of 9 all-gathers and 5 reduce-scatters, through the current names
            # also while the backend allocates (those went through the deprecated names).
            if report["seen"] is not None:
                assert report["seen"] == {
                    "all_gather_single": 4 * 9,
                    "reduce_scatter_single": 4 * 5,
                }, report
        else:
            assert report["during"] == report["after"] == 0


CONTROL_DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "control.md"


def test_docs_example() -> None:
    require_impl("fsdp2")
    source = first_python_block(CONTROL_DOC)
    assert all(run_ranks(exec_doc_example, 2, source, str(CONTROL_DOC)))


def rank_submodule_unshard_before_first_forward(impl: str) -> dict:
    """``block.unshard()`` before the root's first forward (e.g. to inspect weights): the
    root still becomes the root at its first forward, and training matches."""
    import copy

    from _helpers import get_fully_shard
    from torch import nn

    rank, ws = dist.get_rank(), dist.get_world_size()
    fully_shard = get_fully_shard(impl)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model = copy.deepcopy(ref)
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    model[0].unshard()
    first_rows = model[0].weight[:2].detach().clone()  # an unsharded, plain tensor now
    model[0].reshard()
    x = torch.randn(2 * ws, 4, generator=torch.Generator().manual_seed(1))
    model(x[2 * rank : 2 * rank + 2]).sum().backward()
    (ref(x).sum() / ws).backward()
    diff = max(
        (p.grad.full_tensor() - q.grad).abs().max().item()
        for p, q in zip(model.parameters(), ref.parameters())
    )
    return {"grad_diff": diff, "peek_ok": torch.equal(first_rows, ref[0].weight[:2])}


@pytest.mark.parametrize("impl", IMPLS)
def test_submodule_unshard_before_first_forward(impl: str) -> None:
    require_impl(impl)
    for rep in run_ranks(rank_submodule_unshard_before_first_forward, 2, impl):
        assert rep["grad_diff"] <= 1e-6 and rep["peek_ok"], rep


def rank_reduce_scatters_in_flight(setting: str) -> int:
    """fsdp2 only (torch's CPU reduce-scatters finish before they return, so none is ever
    in flight): the most reduce-scatters issued and not yet waited for during backward."""
    ws = dist.get_world_size()
    model = shard_net(build_net(), "fsdp2")
    if setting == "block_only":
        # torch resolves every group's setting to the largest on the shared context.
        model.blocks[0].set_reduce_scatter_max_input_buffers(3, recurse=False)
    elif setting == "root":
        model.set_reduce_scatter_max_input_buffers(3)
    name = (
        "reduce_scatter_single"
        if hasattr(dist, "reduce_scatter_single")
        else "reduce_scatter_tensor"
    )
    original, in_flight, most = getattr(dist, name), [0], [0]

    class Counted:
        def __init__(self, work: object) -> None:
            self.work = work

        def wait(self) -> object:
            in_flight[0] -= 1
            return self.work.wait()  # type: ignore[attr-defined]

    def counting(*args: object, **kwargs: object) -> Counted:
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        return Counted(original(*args, **kwargs))

    setattr(dist, name, counting)
    try:
        batch = global_batch(0, 2 * ws)
        mse(model, rank_slice(batch, dist.get_rank(), ws)).backward()
    finally:
        setattr(dist, name, original)
    return most[0]


@pytest.mark.parametrize(("setting", "expected"), [("default", 1), ("root", 3), ("block_only", 3)])
def test_reduce_scatter_max_input_buffers_resolves_to_max(setting: str, expected: int) -> None:
    require_impl("fsdp2")
    assert run_ranks(rank_reduce_scatters_in_flight, 2, setting) == [expected] * 2
