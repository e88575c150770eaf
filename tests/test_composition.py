"""fsdp2 composed with other torch APIs: the composable distributed APIs and ``torch.func``.

torch's ``replicate()`` (DDP as a composable API) skips submodules that ``fully_shard``
manages: it finds them in the registry that torch's composable APIs share
(``torch.distributed._composable.contract``). fsdp2 records itself there as torch's
``fully_shard`` does; without that, ``replicate`` on the root turned the blocks' ``DTensor``
shards into plain local parameters (a ``ValueError`` at the first forward, or gradients
all-reduced as if they were replicas).

A sharded module's first forward (so its lazy init and first all-gather) may run inside a
``torch.func`` transform, e.g. ``torch.func.jvp``: the buffers fsdp2 allocates there must
not become functorch wrappers ("Cannot access storage of TensorWrapper").

Runs on 2 ranks, parametrized on ``impl``, with an unsharded reference trained on the
global batch (fp32, max abs diff <= 1e-5). If it fails, check first whether the blocks'
parameters are still ``DTensor``s after ``replicate``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _control_helpers import (
    TOL,
    adamw,
    build_net,
    clone_model,
    global_batch,
    max_param_diff,
    mse,
    rank_slice,
    reference_step,
)
from _helpers import (
    IMPLS,
    full,
    get_fsdp_module_cls,
    get_fully_shard,
    is_dtensor,
    make_mesh,
    require_impl,
    require_impl_feature,
    torch_fsdp_has,
)
from _launcher import run_ranks
from torch import nn


def _train_three_steps(model: torch.nn.Module, ref: torch.nn.Module) -> None:
    """Three AdamW steps of ``model`` on this rank's rows and of the unsharded ``ref`` on
    the global batch."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    opt, ref_opt = adamw(model), adamw(ref)
    for step in range(3):
        batch = global_batch(step, 4 * ws)
        mse(model, rank_slice(batch, rank, ws)).backward()
        opt.step()
        opt.zero_grad()
        reference_step(ref, ref_opt, batch)


def _train_against_reference(model: torch.nn.Module, ref: torch.nn.Module) -> dict:
    """``_train_three_steps`` of ``model`` (sharded or replicated parts): which parameters
    are DTensors, and the largest parameter difference."""
    kinds = {name: is_dtensor(p) for name, p in model.named_parameters()}
    _train_three_steps(model, ref)
    return {"kinds": kinds, "diff": max_param_diff(ref, model)}


def _replicate_root_over_sharded_blocks(impl: str) -> dict:
    from torch.distributed._composable import replicate

    model = build_net()
    ref = clone_model(model)
    fully_shard = get_fully_shard(impl)
    mesh = make_mesh()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    replicate(model)  # DDP for the root's own parameters (inp, head) only
    return _train_against_reference(model, ref)


@pytest.mark.parametrize("impl", IMPLS)
def test_replicate_root_over_sharded_blocks(impl: str) -> None:
    require_impl(impl)
    result = run_ranks(_replicate_root_over_sharded_blocks, 2, impl)[0]
    assert result["kinds"] == {name: name.startswith("blocks.") for name in result["kinds"]}, (
        result["kinds"]
    )
    name, diff = result["diff"]
    assert diff <= TOL, f"{name}: max abs diff {diff}"


def _replicated_block_under_sharded_root(impl: str) -> dict:
    from torch.distributed._composable import replicate

    model = build_net()
    ref = clone_model(model)
    fully_shard = get_fully_shard(impl)
    mesh = make_mesh()
    replicate(model.blocks[0])  # DDP for this block: the root's fully_shard leaves it alone
    fully_shard(model, mesh=mesh)
    return _train_against_reference(model, ref)


@pytest.mark.parametrize("impl", IMPLS)
def test_replicated_block_under_sharded_root(impl: str) -> None:
    """The converse of the test above: ``fully_shard`` skips a submodule that
    ``replicate()`` manages (its parameters stay plain, replicated ``Parameter``s), as
    torch's does; fsdp2 sharded them too."""
    require_impl(impl)
    result = run_ranks(_replicated_block_under_sharded_root, 2, impl)[0]
    expected = {name: not name.startswith("blocks.0.") for name in result["kinds"]}
    assert result["kinds"] == expected, result["kinds"]
    name, diff = result["diff"]
    assert diff <= TOL, f"{name}: max abs diff {diff}"


def _jvp_first_forward(impl: str) -> float:
    """``enc`` runs normally, ``dec`` (a separate root) runs its first forward inside
    ``torch.func.jvp``; outputs and tangents must equal the unsharded modules'."""
    torch.manual_seed(0)
    enc, dec = torch.nn.Linear(8, 16, bias=False), torch.nn.Linear(16, 12, bias=False)
    ref_enc, ref_dec = clone_model(enc), clone_model(dec)
    fully_shard = get_fully_shard(impl)
    mesh = make_mesh()
    for module in (enc, dec):
        fully_shard(module, mesh=mesh, reshard_after_forward=False)
    x = torch.randn(2, 8)
    primal, tangent = torch.randn(2, 12), torch.randn(2, 12)
    e, ref_e = enc(x), ref_enc(x)
    out, out_tangent = torch.func.jvp(lambda p: dec(e) * p, (primal,), (tangent,))
    ref_out, ref_tangent = torch.func.jvp(lambda p: ref_dec(ref_e) * p, (primal,), (tangent,))
    return max((out - ref_out).abs().max().item(), (out_tangent - ref_tangent).abs().max().item())


@pytest.mark.parametrize("impl", IMPLS)
def test_first_forward_inside_jvp(impl: str) -> None:
    # torch < 2.13 allocates the all-gather outputs under the jvp transform ("Cannot access
    # storage of TensorWrapper"); 2.13 unwraps with _disable_functorch_if_active.
    require_impl_feature(
        impl,
        torch_fsdp_has("_fully_shard._fsdp_common", "_disable_functorch_if_active"),
        "_disable_functorch_if_active (a first forward inside torch.func.jvp)",
    )
    diffs = run_ranks(_jvp_first_forward, 2, impl)
    assert max(diffs) <= TOL, diffs


def _checkpoint_wrapped_blocks(impl: str, order: str) -> dict:
    """Blocks wrapped in torch's ``CheckpointWrapper`` (activation checkpointing), sharded
    as torchtitan does (the wrapper) or as accelerate does (the block, then its wrapper,
    whose auto-wrap policy looks through the wrapper), then the root; three steps."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = build_net()
    ref = clone_model(model)
    fully_shard = get_fully_shard(impl)
    mesh = make_mesh()
    for i, block in enumerate(model.blocks):
        wrapper = checkpoint_wrapper(block, preserve_rng_state=False)
        model.blocks[i] = wrapper
        if order == "block_then_wrapper":
            fully_shard(block, mesh=mesh)
        fully_shard(wrapper, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _train_three_steps(model, ref)
    params = [full(p).detach() for p in model.parameters()]  # same order as ref's
    return {
        "diff": max((p - q).abs().max().item() for p, q in zip(params, ref.parameters())),
        "same_keys": list(model.state_dict()) == list(ref.state_dict()),
        "params": params if dist.get_rank() == 0 else None,
    }


@pytest.mark.parametrize("order", ["wrapper", "block_then_wrapper"])
def test_checkpoint_wrapped_blocks(order: str) -> None:
    """fsdp2 refused ``fully_shard`` on a wrapper around a sharded block ("already
    applied"): ``CheckpointWrapper`` forwards unknown attributes to the block, so the
    wrapper seemed to carry the block's state. Parity with the reference and bitwise with
    torch, in both orders."""
    results = {}
    for impl in IMPLS:
        require_impl(impl)
        results[impl] = run_ranks(_checkpoint_wrapped_blocks, 2, impl, order)
        for rep in results[impl]:
            assert rep["diff"] <= TOL and rep["same_keys"], (impl, rep["diff"], rep["same_keys"])
    if len(results) == 2:
        for ours, theirs in zip(results["fsdp2"][0]["params"], results["torch"][0]["params"]):
            assert torch.equal(ours, theirs)


def _composable_api_surface(impl: str) -> dict:
    """What torch's composable-API contract gives ``fully_shard``, observed without
    reading any state attribute: the per-call state accessor, the errors for a second call
    and for ``copy.deepcopy``, and what slicing a sharded ``nn.Sequential`` returns."""
    fully_shard = get_fully_shard(impl)
    fsdp_module_cls = get_fsdp_module_cls(impl)
    mesh = make_mesh()
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model[0], mesh=mesh)
    fully_shard([model[1], model[2]], mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = fully_shard.state
    facts: dict = {
        "distinct_per_call": len({id(state(model)), id(state(model[0])), id(state(model[1]))}),
        "shared_by_list": state(model[1]) is state(model[2]),
        "unsharded_is_none": state(nn.Linear(2, 2)) is None,
    }
    sliced = model[:2]
    facts["slice"] = (
        type(sliced).__name__,
        isinstance(sliced, fsdp_module_cls),
        sliced[0] is model[0] and sliced[1] is model[1],
    )
    for name, action in (
        ("again", lambda: fully_shard(model[0], mesh=mesh)),
        ("deepcopy", lambda: copy.deepcopy(model)),
    ):
        try:
            action()
        except Exception as error:
            facts[name] = (isinstance(error, AssertionError), str(error))
        else:
            facts[name] = (False, "no error")
    return facts


@pytest.mark.parametrize("impl", IMPLS)
def test_composable_api_surface(impl: str) -> None:
    """fsdp2 had no ``fully_shard.state``, kept ``FSDPSequential`` for a slice of a sharded
    ``nn.Sequential`` (a new module with no state, treated as sharded), and raised
    ValueError / RuntimeError where torch raises AssertionError (a second ``fully_shard``
    on a module, ``copy.deepcopy``)."""
    require_impl(impl)
    facts = run_ranks(_composable_api_surface, 2, impl)[0]
    assert facts["distinct_per_call"] == 3
    assert facts["shared_by_list"] and facts["unsharded_is_none"]
    assert facts["slice"] == ("Sequential", False, True)
    assert facts["again"][0], facts["again"]
    assert "can only be applied to a module once" in facts["again"][1]
    assert facts["deepcopy"][0], facts["deepcopy"]
    assert "FSDP does not support deepcopy" in facts["deepcopy"][1]


def _managed_flags(impl: str) -> list[str]:
    """The modules flagged ``_is_fsdp_managed_module`` (with ``_fsdp_use_orig_params``)
    after sharding two blocks, a list group of two more and the root, one leaf ignored."""
    fully_shard = get_fully_shard(impl)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(4)])
    fully_shard(model[0])
    fully_shard(model[1])
    fully_shard([model[2], model[3]])
    fully_shard(model, ignored_params={model[3][0].bias})
    flagged = []
    for name, module in model.named_modules():
        managed = getattr(module, "_is_fsdp_managed_module", False)
        if managed != getattr(module, "_fsdp_use_orig_params", False):
            flagged.append(f"{name or '<root>'}: flags disagree")
        if managed:
            flagged.append(name or "<root>")
    return flagged


@pytest.mark.parametrize("impl", IMPLS)
def test_managed_modules_are_flagged_as_torch_flags_them(impl: str) -> None:
    """[Note: modules flagged as FSDP-managed]: Dynamo and transformers' ``generate``
    (``synced_gpus``) recognize FSDP by these flags. Without them ``generate`` with
    per-rank prompts or sampling left the ranks still generating waiting on the first
    rank to finish (torch's modules are flagged, so torch's run finished)."""
    require_impl(impl)
    flagged = run_ranks(_managed_flags, 1, impl)[0]
    every = ["<root>"] + [f"{i}{sub}" for i in range(4) for sub in ("", ".0", ".1")]
    assert sorted(flagged) == sorted(every), flagged
