"""fsdp2 composed with torch's other composable distributed APIs.

torch's ``replicate()`` (DDP as a composable API) skips submodules that ``fully_shard``
manages: it finds them in the registry that torch's composable APIs share
(``torch.distributed._composable.contract``). fsdp2 records itself there as torch's
``fully_shard`` does; without that, ``replicate`` on the root turned the blocks' ``DTensor``
shards into plain local parameters (a ``ValueError`` at the first forward, or gradients
all-reduced as if they were replicas).

Runs on 2 ranks, parametrized on ``impl``, with an unsharded reference trained on the
global batch (fp32, max abs diff <= 1e-5). If it fails, check first whether the blocks'
parameters are still ``DTensor``s after ``replicate``.
"""

from __future__ import annotations

import pytest
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
from _helpers import IMPLS, get_fully_shard, is_dtensor, make_mesh, require_impl
from _launcher import run_ranks


def _replicate_root_over_sharded_blocks(impl: str) -> dict:
    from torch.distributed._composable import replicate

    rank, ws = dist.get_rank(), dist.get_world_size()
    model = build_net()
    ref = clone_model(model)
    fully_shard = get_fully_shard(impl)
    mesh = make_mesh()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    replicate(model)  # DDP for the root's own parameters (inp, head) only
    kinds = {name: is_dtensor(p) for name, p in model.named_parameters()}
    opt, ref_opt = adamw(model), adamw(ref)
    for step in range(3):
        batch = global_batch(step, 4 * ws)
        mse(model, rank_slice(batch, rank, ws)).backward()
        opt.step()
        opt.zero_grad()
        reference_step(ref, ref_opt, batch)
    return {"kinds": kinds, "diff": max_param_diff(ref, model)}


@pytest.mark.parametrize("impl", IMPLS)
def test_replicate_root_over_sharded_blocks(impl: str) -> None:
    require_impl(impl)
    result = run_ranks(_replicate_root_over_sharded_blocks, 2, impl)[0]
    assert result["kinds"] == {name: name.startswith("blocks.") for name in result["kinds"]}, (
        result["kinds"]
    )
    name, diff = result["diff"]
    assert diff <= TOL, f"{name}: max abs diff {diff}"
