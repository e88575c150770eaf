"""Meshes: HSDP on a 2-D (replicate, shard) mesh, ``reshard_after_forward=int``.

Each test trains the Llama model sharded on a 4-rank mesh next to a non-sharded reference
on the same global batch and records every collective with the size of its process group.
When a parity check fails, look at the recorded collectives first: an HSDP gradient must
be reduce-scattered over the shard group (2 ranks) then all-reduced over the replicate
group (2 ranks); with int resharding, the backward all-gathers must span 2 ranks.
"""

from __future__ import annotations

import collections
import copy
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _control_helpers import flag_numel
from _helpers import (
    ParityCase,
    build_model,
    compare_params,
    get_fully_shard,
    local_slice,
    loss_of,
    make_global_batch,
    make_optimizer,
    require_impl,
    torch_fsdp_has,
)
from _launcher import run_ranks
from torch.distributed.device_mesh import init_device_mesh

import fsdp2._fingerprints as fingerprints
from examples.llama import parallelize

TOL = 1e-5


def _record_collectives(
    log: list[tuple[str, int]], volume: collections.Counter | None = None
) -> None:
    """Patch torch.distributed so each collective logs (kind, group size); ``volume``
    sums the elements of each collective's full-size buffer per (kind, group size): the
    all-gather output, the reduce-scatter input, the all-reduce tensor."""
    kinds = {
        "all_gather_single": "all_gather",
        "all_gather_into_tensor": "all_gather",
        "reduce_scatter_single": "reduce_scatter",
        "reduce_scatter_tensor": "reduce_scatter",
        "all_reduce": "all_reduce",
    }
    for name, kind in kinds.items():
        original = getattr(dist, name, None)
        if original is None or getattr(original, "_recording", False):
            continue

        def wrapper(*args, _orig=original, _kind=kind, **kwargs):
            group = kwargs.get("group")
            size = dist.get_world_size(group) if group is not None else dist.get_world_size()
            log.append((_kind, size))
            if volume is not None:
                values = [*args, *kwargs.values()]
                tensors = [a for a in values if isinstance(a, torch.Tensor)]
                big = tensors[0] if _kind == "all_reduce" else max(tensors, key=torch.numel)
                volume[(_kind, size)] += big.numel()
            return _orig(*args, **kwargs)

        wrapper._recording = True  # type: ignore[attr-defined]
        wrapper._original = original  # type: ignore[attr-defined]
        setattr(dist, name, wrapper)


def _restore_collectives() -> None:
    for name in (
        "all_gather_single",
        "all_gather_into_tensor",
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "all_reduce",
    ):
        fn = getattr(dist, name, None)
        if fn is not None and getattr(fn, "_recording", False):
            setattr(dist, name, fn._original)


def _train(
    impl: str,
    mesh_shape: tuple[int, ...],
    reshard: bool | int | None,
    microbatches: int,
    all_reduce_on_last_only: bool,
) -> dict:
    rank, ws = dist.get_rank(), dist.get_world_size()
    case = ParityCase(impl=impl, steps=3)
    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    ref = build_model(case)
    model = copy.deepcopy(ref)
    parallelize(model, get_fully_shard(impl), mesh=mesh, reshard_after_forward=reshard)
    opt, ref_opt = make_optimizer(model, case.lr), make_optimizer(ref, case.lr)
    log: list[tuple[str, int]] = []
    volume: collections.Counter = collections.Counter()
    worst = []
    per_step_logs = []
    try:
        for step in range(case.steps):
            micro = [make_global_batch(case, step * 10 + i, ws) for i in range(microbatches)]
            log.clear()
            volume.clear()
            _record_collectives(log, volume)
            for i, batch in enumerate(micro):
                if all_reduce_on_last_only:
                    model.set_requires_all_reduce(i == len(micro) - 1)
                local = local_slice(batch, rank, case.local_batch)
                (loss_of(model, case, local, step) / microbatches).backward()
            _restore_collectives()
            per_step_logs.append(collections.Counter(log))
            for batch in micro:
                (loss_of(ref, case, batch, step) / microbatches).backward()
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
            worst.append(compare_params(ref, model))
    finally:
        _restore_collectives()
    placements = [tuple(type(p).__name__ for p in param.placements) for param in model.parameters()]
    root_numel = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("layers."))
    # Groups: each block, and the root with the rest. Each adds its padded flags per chunk.
    n_root = sum(1 for n, _ in model.named_parameters() if not n.startswith("layers."))
    group_sizes = [len(list(block.parameters())) for block in model.layers] + [n_root]
    # Each group's elements per rank of the shard dim (padded shards), blocks then root.
    w = mesh_shape[-1]
    root_params = [p for n, p in ref.named_parameters() if not n.startswith("layers.")]
    groups = [list(block.parameters()) for block in ref.layers] + [root_params]
    shards = [sum(-(-p.shape[0] // w) * p[0].numel() for p in params) for params in groups]
    return {
        "worst": worst,
        "counts": per_step_logs,
        "placements": placements,
        "volume": dict(volume),
        "numel": sum(p.numel() for p in model.parameters()),
        "n_params": len(list(model.parameters())),
        "root_numel": root_numel,
        "flags": sum(flag_numel(n, torch.float32) for n in group_sizes),
        "shards": shards,
    }


def _check_parity(reports: list[dict]) -> None:
    for rank, rep in enumerate(reports):
        for step, (name, diff) in enumerate(rep["worst"]):
            assert diff <= TOL, f"rank {rank} step {step}: {name} differs by {diff:.3g}"


N_GROUPS = 3  # 2 blocks + root


@pytest.mark.parametrize("impl", ["fsdp2", "torch"])
def test_hsdp_2x2_parity(impl: str) -> None:
    require_impl(impl)
    reports = run_ranks(_train, 4, impl, (2, 2), None, 1, False)
    _check_parity(reports)
    assert set(reports[0]["placements"]) == {("Replicate", "Shard")}
    counts = reports[0]["counts"][-1]
    # Recording spans forward and backward of the last step.
    assert counts[("reduce_scatter", 2)] == N_GROUPS
    assert counts[("all_reduce", 2)] == N_GROUPS
    assert counts[("all_gather", 2)] == N_GROUPS + (N_GROUPS - 1)  # root not resharded
    assert not any(size == 4 for (_, size) in counts), counts


@pytest.mark.parametrize("impl", ["fsdp2", "torch"])
def test_hsdp_accumulation_skips_all_reduce(impl: str) -> None:
    require_impl(impl)
    reports = run_ranks(_train, 4, impl, (2, 2), None, 3, True)
    _check_parity(reports)
    counts = reports[0]["counts"][-1]
    # Reduce-scatter every microbatch (gradient sync is on), all-reduce only on the last.
    assert counts[("reduce_scatter", 2)] == 3 * N_GROUPS
    assert counts[("all_reduce", 2)] == N_GROUPS


def _hsdp_freeze_between_microbatches(frozen_per_microbatch: tuple[bool, bool]) -> dict:
    """Two microbatches on a (2, 2) mesh, the first without the replica all-reduce; the
    group's last parameter is frozen in one of them, so the two reduce-scatter outputs
    cover different numbers of parameters. Returns each gradient's difference from the
    non-sharded run, or a string where one side has a gradient and the other none."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    model = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    get_fully_shard("fsdp2")(model, mesh=mesh)
    torch.manual_seed(1)
    for i, frozen in enumerate(frozen_per_microbatch):
        batch = torch.randn(16, 8)
        for net in (model, ref):
            net[1].bias.requires_grad_(not frozen)
        model.set_requires_all_reduce(i == len(frozen_per_microbatch) - 1)
        model(batch[4 * rank : 4 * rank + 4]).pow(2).sum().div(4).backward()
        ref(batch).pow(2).sum().div(16).backward()
    diffs: dict[str, float | str] = {}
    for (name, param), ref_param in zip(model.named_parameters(), ref.parameters()):
        if (param.grad is None) != (ref_param.grad is None):
            diffs[name] = (
                f"gradient is None: {param.grad is None} vs reference {ref_param.grad is None}"
            )
        elif param.grad is not None:
            diffs[name] = (param.grad.full_tensor() - ref_param.grad).abs().max().item()
    return diffs


@pytest.mark.parametrize("frozen", [(True, False), (False, True)])
def test_hsdp_partial_sums_survive_freezing_between_microbatches(
    frozen: tuple[bool, bool],
) -> None:
    """Freezing the group's last parameter changes the reduce-scatter layout (the flags
    follow the last trainable gradient). The kept partial sum was added to the next output
    prefix-wise, mixing flags into gradients (wrong by 1.0) or dropping a gradient; torch
    raises a size mismatch here. Both sums now move to the whole group's layout."""
    for diffs in run_ranks(_hsdp_freeze_between_microbatches, 4, frozen):
        assert len(diffs) == 4, diffs
        for name, diff in diffs.items():
            assert isinstance(diff, float) and diff <= TOL, (name, diff)


@pytest.mark.parametrize("impl", ["fsdp2", "torch"])
def test_int_reshard_after_forward(impl: str) -> None:
    require_impl(impl)
    reports = run_ranks(_train, 4, impl, (4,), 2, 1, False)
    _check_parity(reports)
    counts = reports[0]["counts"][-1]
    # Forward all-gathers span all 4 ranks; backward ones only the 2-rank post-forward group
    # (the root, whose reshard_after_forward is also 2 here, included).
    assert counts[("all_gather", 4)] == N_GROUPS
    assert counts[("all_gather", 2)] == N_GROUPS
    assert counts[("reduce_scatter", 4)] == N_GROUPS


@pytest.mark.parametrize(("value", "expected_backward_all_gathers"), [(4, 3), (1, 0)])
def test_int_reshard_extremes_behave_as_bool(
    value: int, expected_backward_all_gathers: int
) -> None:
    reports = run_ranks(_train, 4, "fsdp2", (4,), value, 1, False)
    _check_parity(reports)
    counts = reports[0]["counts"][-1]
    assert counts[("all_gather", 4)] == N_GROUPS + expected_backward_all_gathers
    assert counts[("all_gather", 2)] == 0


def _bad_int(value: int) -> str:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    try:
        get_fully_shard("fsdp2")(torch.nn.Linear(4, 4), mesh=mesh, reshard_after_forward=value)
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("value", [3, 0, -2, 8])
def test_int_reshard_validation(value: int) -> None:
    messages = run_ranks(_bad_int, 4, value)
    assert "positive divisor of the shard group size 4" in messages[0], messages[0]


def _shard_dim1(param: torch.nn.Parameter):
    from torch.distributed.tensor import Shard

    return Shard(1) if param.dim() == 2 else None


def _train_shard_dim1(impl: str) -> dict:
    rank, ws = dist.get_rank(), dist.get_world_size()
    case = ParityCase(impl=impl, steps=3)
    mesh = init_device_mesh("cpu", (ws,))
    ref = build_model(case)
    model = copy.deepcopy(ref)
    parallelize(model, get_fully_shard(impl), mesh=mesh, shard_placement_fn=_shard_dim1)
    opt, ref_opt = make_optimizer(model, case.lr), make_optimizer(ref, case.lr)
    worst = []
    for step in range(case.steps):
        batch = make_global_batch(case, step, ws)
        loss_of(model, case, local_slice(batch, rank, case.local_batch), step).backward()
        loss_of(ref, case, batch, step).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        worst.append(compare_params(ref, model))
    dims = {n: [p.dim for p in param.placements] for n, param in model.named_parameters()}
    local_shapes = {n: tuple(param.to_local().shape) for n, param in model.named_parameters()}
    return {"worst": worst, "dims": dims, "local_shapes": local_shapes}


@pytest.mark.parametrize("impl", ["fsdp2", "torch"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_shard_placement_dim1_parity(impl: str, world_size: int) -> None:
    require_impl(impl)
    reports = run_ranks(_train_shard_dim1, world_size, impl)
    _check_parity(reports)
    rep = reports[0]
    assert rep["dims"]["layers.0.attention.wq.weight"] == [1]
    assert rep["dims"]["norm.weight"] == [0]
    assert rep["local_shapes"]["layers.0.attention.wq.weight"] == (32, 32 // world_size)


class _Experts(torch.nn.Module):
    """Expert weights sharded on dims 1 and 2 next to dim-0 ones; the forward reshapes
    parameters with ``.view``, which needs them contiguous (as without sharding)."""

    def __init__(self, dim: int = 8, hidden: int = 12, experts: int = 2) -> None:
        super().__init__()
        self.w_in = torch.nn.Parameter(torch.randn(experts, dim, hidden) / dim**0.5)
        self.w_out = torch.nn.Parameter(torch.randn(experts, hidden, dim) / hidden**0.5)
        self.proj = torch.nn.Linear(dim, dim)  # weight on dim 1, bias on dim 0
        self.seen_contiguous: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen_contiguous += [self.w_in.is_contiguous(), self.w_out.is_contiguous()]
        e, d, h = self.w_in.shape
        hidden = torch.relu(x @ self.w_in.view(e * d, h)[:d])  # a view of the parameter
        return self.proj(torch.bmm(hidden.expand(e, -1, -1), self.w_out).sum(0))


class _Router(torch.nn.Module):
    """A group with one parameter, sharded on dim 1 (no in-place all-gather for it)."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.gate = torch.nn.Parameter(torch.randn(dim, dim) / dim**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.gate.view(-1).view(self.gate.shape)


def _shard_last_dims(param: torch.nn.Parameter):
    from torch.distributed.tensor import Shard

    return Shard(param.dim() - 1) if param.dim() >= 2 else None


def _train_shard_last_dims(impl: str, reshard: bool | int) -> dict:
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = torch.nn.Sequential(_Router(), _Experts(), _Experts())
    model = copy.deepcopy(ref)
    fully_shard = get_fully_shard(impl)
    mesh = init_device_mesh("cpu", (ws,))
    for block in model:
        fully_shard(
            block, mesh=mesh, reshard_after_forward=reshard, shard_placement_fn=_shard_last_dims
        )
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    worst = []
    local_contiguous = []
    torch.manual_seed(1)
    for _ in range(3):
        batch = torch.randn(4 * ws, 8)
        model(batch[4 * rank : 4 * rank + 4]).pow(2).mean().backward()
        ref(batch).pow(2).mean().backward()
        local_contiguous += [p.to_local().is_contiguous() for p in model.parameters()]
        local_contiguous += [p.grad.to_local().is_contiguous() for p in model.parameters()]
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        worst.append(compare_params(ref, model))
    return {
        "worst": worst,
        "placements": {n: str(p.placements[0]) for n, p in model.named_parameters()},
        "local_contiguous": all(local_contiguous),
        "unsharded_contiguous": all(model[1].seen_contiguous + model[2].seen_contiguous),
        "params": [p.full_tensor() for p in model.parameters()],
    }


@pytest.mark.parametrize(("world_size", "reshard"), [(2, True), (4, True), (4, 2), (4, False)])
def test_shard_placement_higher_dims_contiguous_and_like_torch(
    world_size: int, reshard: bool | int
) -> None:
    """Shard(1) and Shard(2) parameters, alone in a group or mixed with Shard(0) ones:
    unsharded parameters, local shards and gradient shards are contiguous as in torch (a
    forward calling ``.view()`` on a parameter failed on fsdp2's transposed views), and
    training matches the non-sharded model and torch's ``fully_shard`` (which raises an
    IndexError in backward's copy-out with ``reshard_after_forward=2`` here)."""
    ours = run_ranks(_train_shard_last_dims, world_size, "fsdp2", reshard)
    _check_parity(ours)
    rep = ours[0]
    assert rep["placements"]["0.gate"] == "S(1)"
    assert rep["placements"]["1.w_in"] == "S(2)"
    assert rep["placements"]["1.proj.bias"] == "S(0)"
    assert rep["local_contiguous"] and rep["unsharded_contiguous"]
    if isinstance(reshard, int) and not isinstance(reshard, bool):
        return
    theirs = run_ranks(_train_shard_last_dims, world_size, "torch", reshard)
    _check_parity(theirs)
    assert theirs[0]["local_contiguous"] and theirs[0]["unsharded_contiguous"]
    for a, b in zip(rep["params"], theirs[0]["params"]):
        assert (a - b).abs().max().item() <= 1e-6


def _data_parallel_mesh_dims(**names: Any) -> Any:
    """torch's ``DataParallelMeshDims`` where it exists (torch >= 2.12), else a stand-in
    with the same two fields (fsdp2 reads only those)."""
    import dataclasses

    try:
        from torch.distributed.fsdp import DataParallelMeshDims  # type: ignore[attr-defined]
    except ImportError:

        @dataclasses.dataclass
        class DataParallelMeshDims:  # type: ignore[no-redef]
            shard: Any = None
            replicate: Any = None

    return DataParallelMeshDims(**names)


def _train_dp_mesh_dims(layout: str) -> dict:
    """A 4-rank mesh of data-parallel dims named in ``layout``'s way, sharded with
    ``dp_mesh_dims`` (plain parameters): the parameter differences from the non-sharded
    model after 3 AdamW steps, and the placements."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    shape, names, dims = {
        "fsdp": ((ws,), ("dp",), {"shard": "dp"}),
        "hsdp": ((2, 2), ("dp_replicate", "dp_shard"), {"shard": "dp_shard", "replicate": "dp_replicate"}),
        "flatten": ((2, 2), ("dp_shard", "cp"), {"shard": ("dp_shard", "cp")}),
    }[layout]  # fmt: skip
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    model = copy.deepcopy(ref)
    kwargs = {"mesh": mesh, "dp_mesh_dims": _data_parallel_mesh_dims(**dims)}
    get_fully_shard("fsdp2")(model[0], **kwargs)
    get_fully_shard("fsdp2")(model, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    torch.manual_seed(1)
    worst = []
    for _ in range(3):
        batch = torch.randn(4 * ws, 8)
        model(batch[4 * rank : 4 * rank + 4]).pow(2).mean().backward()
        ref(batch).pow(2).mean().backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        worst.append(compare_params(ref, model))
    weight = model[0].weight
    return {
        "worst": worst,
        "placements": [str(p) for p in weight.placements],
        "shard_group_size": weight.device_mesh.size(weight.device_mesh.ndim - 1),
    }


@pytest.mark.parametrize(
    ("layout", "placements", "shard_group_size"),
    [("fsdp", ["S(0)"], 4), ("hsdp", ["R", "S(0)"], 2), ("flatten", ["S(0)"], 4)],
)
def test_dp_mesh_dims_name_the_data_parallel_mesh(
    layout: str, placements: list[str], shard_group_size: int
) -> None:
    """``dp_mesh_dims`` on a mesh made only of data-parallel dims, with plain parameters
    (torch 2.13 raises; later torch and torchtitan's flows pass them): FSDP on a named dim,
    HSDP on (replicate, shard), and two shard dims flattened into one 4-rank shard group,
    each training like the non-sharded model. ``DTensor`` parameters: test_spmd.py."""
    reports = run_ranks(_train_dp_mesh_dims, 4, layout)
    _check_parity(reports)
    assert reports[0]["placements"] == placements
    assert reports[0]["shard_group_size"] == shard_group_size


def _uneven_dim1() -> str:
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    try:
        get_fully_shard("fsdp2")(
            torch.nn.Linear(5, 4), mesh=mesh, shard_placement_fn=lambda p: Shard(p.dim() - 1)
        )
    except ValueError as error:
        return str(error)
    return "no error"


def test_shard_placement_uneven_dim_is_rejected() -> None:
    message = run_ranks(_uneven_dim1, 2)[0]
    assert "divisible by the shard group size 2" in message, message


@pytest.mark.parametrize(
    ("mesh_shape", "reshard"), [((4,), None), ((4,), False), ((2, 2), None), ((4,), 2)]
)
def test_communication_volume_matches_docs(mesh_shape: tuple[int, ...], reshard) -> None:
    """The per-step volumes docs/meshes.md gives, in elements of the full-size buffers
    (P: parameters; P_root: the root group's, never resharded with None; F: the "had a
    gradient" flags of every group in one rank chunk, each group's padded to 64 bytes:
    3 groups of at most 16 fp32 parameters, F = 3 x 16 = 48; and the divergence checks'
    fingerprints, T and B there)."""
    rep = run_ranks(_train, 4, "fsdp2", mesh_shape, reshard, 1, False)[0]
    P, P_root, vol, F = rep["numel"], rep["root_numel"], rep["volume"], rep["flags"]
    assert (P, P_root, rep["n_params"], F) == (30880, 4128, 21, 48)  # as docs/meshes.md says
    W = mesh_shape[-1]
    # The divergence checks' fingerprints (docs/meshes.md): per rank's all-gather slot of
    # m elements, a tail (T(m) elements with the padding); per reduction chunk, 16 fp32.
    shards = rep["shards"]  # elements per rank of each group: blocks, then the root

    def tails(ranks: int, groups: list[int]) -> int:
        return sum(ranks * (fingerprints.tailed_numel(m, torch.float32) - m) for m in groups)

    B = len(shards) * fingerprints.block_numel(torch.float32)
    resharded = {None: P - P_root, False: 0, 2: P}[reshard]
    if reshard == 2:
        assert vol[("all_gather", 4)] == P + tails(4, shards)  # forward, over all 4 ranks
        assert vol[("all_gather", 2)] == P + tails(2, [2 * m for m in shards])  # backward
    else:
        again = {None: shards[:-1], False: []}[reshard]
        assert vol[("all_gather", W)] == P + resharded + tails(W, shards + again)
    assert vol[("reduce_scatter", W)] == P + W * (F + B)
    if len(mesh_shape) == 2:
        assert vol[("all_reduce", 2)] == P // W + F + B  # each rank all-reduces its shard


def _tp_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }


def _tp_opposite_dim(param: torch.nn.Parameter):
    """FSDP on the dim TP does not shard: colwise weights on dim 1, rowwise on dim 0."""
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(param, DTensor) and isinstance(param.placements[0], Shard):
        return Shard(1 - param.placements[0].dim) if param.ndim == 2 else Shard(0)
    return None


def _tp_same_dim(param: torch.nn.Parameter):
    """FSDP on the dim TP shards too (a strided shard), rowwise weights included (dim 1)."""
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(param, DTensor) and isinstance(param.placements[0], Shard):
        return Shard(param.placements[0].dim)
    return None


def _train_fsdp_tp(
    impls: tuple[str, ...],
    dp_shape: tuple[int, ...] = (2,),
    placement_fn: str | None = None,
    layout: str = "dp_tp",
) -> dict:
    """``dp_shape`` (dp, or HSDP's replicate x shard) x 2 (tp): TP inside each block, FSDP
    over dp, optionally with ``shard_placement_fn`` (the name of one above); SGD so that
    the comparison with the reference is not dominated by Adam's normalization of
    near-zero gradients. ``layout``: the world mesh's dims, ``dp_tp``; ``pp_dp_tp`` (a
    pipeline dim of size 1 in front, as in 3-D parallel set-ups); ``tp_dp`` (TP outer)."""
    shard_placement_fn = {"opposite": _tp_opposite_dim, "same": _tp_same_dim, None: None}[
        placement_fn
    ]
    from torch.distributed.tensor.parallel import parallelize_module

    case = ParityCase(steps=3)
    dp_names = ("dp",) if len(dp_shape) == 1 else ("replicate", "shard")
    if layout == "pp_dp_tp":
        world = init_device_mesh("cpu", (1, *dp_shape, 2), mesh_dim_names=("pp", *dp_names, "tp"))
    elif layout == "tp_dp":
        world = init_device_mesh("cpu", (2, *dp_shape), mesh_dim_names=("tp", *dp_names))
    else:
        world = init_device_mesh("cpu", (*dp_shape, 2), mesh_dim_names=(*dp_names, "tp"))
    dp_mesh = world[dp_names[0]] if len(dp_names) == 1 else world[dp_names]
    dp_rank = 0
    for dim in range(len(dp_shape)):  # this rank's data slice: row-major over the dp dims
        dp_rank = dp_rank * dp_shape[dim] + dp_mesh.get_local_rank(dim)
    dp_size = math.prod(dp_shape)
    ref = build_model(case)
    models = {}
    log: list[tuple[str, int]] = []
    for impl in impls:
        model = copy.deepcopy(ref)
        for block in model.layers:
            block.attention.n_heads //= 2  # heads per TP rank
            block.attention.n_kv_heads //= 2
            parallelize_module(block, world["tp"], _tp_plan())
            get_fully_shard(impl)(block, mesh=dp_mesh, shard_placement_fn=shard_placement_fn)
        get_fully_shard(impl)(model, mesh=dp_mesh)
        models[impl] = (model, torch.optim.SGD(model.parameters(), lr=0.5))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    worst: dict[str, list[float]] = {impl: [] for impl in impls}
    for step in range(case.steps):
        batch = make_global_batch(case, step, dp_size)
        for impl, (model, opt) in models.items():
            if impl == "fsdp2" and step == case.steps - 1:
                _record_collectives(log)
            loss_of(model, case, local_slice(batch, dp_rank, case.local_batch), step).backward()
            _restore_collectives()
            opt.step()
            opt.zero_grad()
        loss_of(ref, case, batch, step).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for impl, (model, _) in models.items():
            worst[impl].append(compare_params(ref, model)[1])
    params = {impl: [p.full_tensor() for p in m.parameters()] for impl, (m, _) in models.items()}
    same = all(torch.equal(a, b) for a, b in zip(*params.values())) if len(impls) == 2 else None
    block = models[impls[0]][0].layers[0]
    wq = block.attention.wq.weight
    return {
        "worst": worst,
        "bitwise_equal": same,
        "placements": [type(p).__name__ for p in wq.placements],
        "dims": {
            name: [getattr(p, "dim", None) for p in block.get_parameter(name).placements]
            for name in ("attention.wq.weight", "attention.wo.weight")
        },
        "contiguous": all(
            p.to_local().is_contiguous() for m, _ in models.values() for p in m.parameters()
        ),
        "mesh_ndim": wq.device_mesh.ndim,
        "collectives": collections.Counter(log),
    }


def _check_fsdp_tp_2x2(reports: list[dict]) -> None:
    """Parity, bitwise equality with torch, 2-D (dp, tp) shards, and FSDP's all-gathers
    and reduce-scatters over the 2 dp ranks only."""
    for rank, rep in enumerate(reports):
        for impl, diffs in rep["worst"].items():
            assert max(diffs) <= TOL, f"rank {rank} {impl}: max diff {max(diffs):.3g}"
        assert rep["bitwise_equal"], f"rank {rank}: fsdp2 and torch differ"
        assert rep["mesh_ndim"] == 2
        assert rep["placements"] == ["_StridedShard", "Shard"]
        counts = rep["collectives"]
        assert counts[("all_gather", 2)] >= N_GROUPS and counts[("reduce_scatter", 2)] == N_GROUPS
        assert counts[("all_gather", 4)] == 0 and counts[("reduce_scatter", 4)] == 0


def test_fsdp_with_tensor_parallel_2x2() -> None:
    _check_fsdp_tp_2x2(run_ranks(_train_fsdp_tp, 4, ("fsdp2", "torch")))


@pytest.mark.parametrize("layout", ["pp_dp_tp", "tp_dp"])
def test_fsdp_with_tensor_parallel_on_a_larger_or_reordered_mesh(layout: str) -> None:
    """The world mesh of 3-D parallel training, (pp, dp, tp), and a mesh with TP outer,
    (tp, dp): the sharded DTensors live on the dp and tp dims of that mesh, with parity
    and bitwise equal to torch. fsdp2 required the dp mesh's parent to be exactly
    (dp, tp) and raised a ValueError (pp) or NotImplementedError (tp outer)."""
    _check_fsdp_tp_2x2(run_ranks(_train_fsdp_tp, 4, ("fsdp2", "torch"), (2,), None, layout))


@pytest.mark.parametrize(
    ("placement_fn", "wq_dims", "wo_dims"), [("opposite", [1, 0], [0, 1]), ("same", [0, 0], [1, 1])]
)
def test_fsdp_with_tensor_parallel_and_shard_placement_fn(
    placement_fn: str, wq_dims: list[int], wo_dims: list[int]
) -> None:
    """FSDP + TP with ``shard_placement_fn`` (torch's own test shards each TP weight on the
    dim TP leaves alone): parity with the reference and bitwise with torch, whether FSDP
    takes the other dim or splits the TP dim again (a strided shard on dim 1 for rowwise
    weights). fsdp2 raised NotImplementedError for any shard_placement_fn with TP."""
    reports = run_ranks(_train_fsdp_tp, 4, ("fsdp2", "torch"), (2,), placement_fn)
    for rank, rep in enumerate(reports):
        for impl, diffs in rep["worst"].items():
            assert max(diffs) <= TOL, f"rank {rank} {impl}: max diff {max(diffs):.3g}"
        assert rep["bitwise_equal"], f"rank {rank}: fsdp2 and torch differ"
        assert rep["dims"] == {"attention.wq.weight": wq_dims, "attention.wo.weight": wo_dims}
        assert rep["contiguous"]


def _tp_uneven_local_dim() -> str:
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = torch.nn.Sequential(torch.nn.Linear(6, 6))
    parallelize_module(model, world["tp"], {"0": RowwiseParallel()})  # weight: local (6, 3)
    try:
        get_fully_shard("fsdp2")(model, mesh=world["dp"], shard_placement_fn=_tp_same_dim)
    except ValueError as error:
        return str(error)
    return "no error"


def test_tensor_parallel_shard_placement_needs_an_even_local_dim() -> None:
    """The global dim (6) divides over dp, but the TP-local one (3) does not: a clear error
    naming the parameter, not a wrong layout."""
    message = run_ranks(_tp_uneven_local_dim, 4)[0]
    assert "Shard(1) for '0.weight'" in message and "tensor-parallel local shard" in message


@pytest.mark.parametrize("dp_shape", [(2, 1), (1, 2)], ids=["replicate2", "shard2"])
def test_hsdp_with_tensor_parallel(dp_shape: tuple[int, int]) -> None:
    """HSDP + TP on a (replicate, shard, tp) mesh: 3-D DTensor shards, parity with the
    reference and bitwise with torch (4 ranks: one of the two data-parallel dims is 1)."""
    reports = run_ranks(_train_fsdp_tp, 4, ("fsdp2", "torch"), dp_shape)
    for rank, rep in enumerate(reports):
        for impl, diffs in rep["worst"].items():
            assert max(diffs) <= TOL, f"rank {rank} {impl}: max diff {max(diffs):.3g}"
        assert rep["bitwise_equal"], f"rank {rank}: fsdp2 and torch differ"
        assert rep["mesh_ndim"] == 3
        assert rep["placements"] == ["Replicate", "_StridedShard", "Shard"]
        # Reduce-scatter over the shard dim, all-reduce over the replicate dim (a dim of
        # one rank needs neither).
        counts = rep["collectives"]
        replicate, shard = dp_shape
        assert counts[("reduce_scatter", 2)] == (N_GROUPS if shard == 2 else 0), counts
        assert counts[("all_reduce", 2)] == (N_GROUPS if replicate == 2 else 0), counts


def _tp_mesh_built_twice() -> dict:
    """A second model with a 2-D mesh built again in the same process (a new run, a test
    repeated): torch may hand back TP DTensors whose root mesh is the first, equal mesh."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    placements = []
    for _ in range(2):
        world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
        parallelize_module(model, world["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
        get_fully_shard("fsdp2")(model, mesh=world["dp"])
        model(torch.randn(2, 4)).sum().backward()
        placements.append([type(p).__name__ for p in model[0].weight.placements])
    return {"placements": placements}


def test_tensor_parallel_mesh_built_twice() -> None:
    for rep in run_ranks(_tp_mesh_built_twice, 4):
        assert rep["placements"] == [["_StridedShard", "Shard"]] * 2, rep


def _tp_embedding_grads(impl: str) -> float:
    """A vocabulary-parallel embedding (``RowwiseParallel(input_layouts=Replicate())``)
    under FSDP on a 2 (dp) x 2 (tp) mesh: the largest gradient difference from the
    non-sharded model, each dp rank running its own batch."""
    from torch.distributed._composable import replicate
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 4))
    ref = replicate(copy.deepcopy(model), process_group=world["dp"].get_group())
    parallelize_module(model, world["tp"], {"0": RowwiseParallel(input_layouts=Replicate())})
    get_fully_shard(impl)(model, mesh=world["dp"])
    torch.manual_seed(1 + world["dp"].get_local_rank())
    tokens = torch.randint(0, 8, (2, 6))
    model(tokens).pow(2).sum().backward()
    ref(tokens).pow(2).sum().backward()
    return max(
        (p.grad.full_tensor() - r.grad).abs().max().item()
        for p, r in zip(model.parameters(), ref.parameters())
    )


@pytest.mark.parametrize("impl", ["fsdp2", "torch"])
def test_tensor_parallel_embedding_grads(impl: str) -> None:
    """DTensor's embedding backward gives the row-sharded weight a *replicated* gradient;
    its local part is the whole table, not this rank's rows. fsdp2 reduced
    that tensor as if it were laid out like the parameter (wrong gradients for every
    parameter of the group); like torch, it now redistributes it to the parameter's TP
    placements first."""
    for diff in run_ranks(_tp_embedding_grads, 4, impl):
        assert diff <= TOL, diff


class _StackedExperts(torch.nn.Module):
    """Stacked expert weights (experts, out, in) applied to every token, summed."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 6, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        w = self.w.full_tensor() if isinstance(self.w, DTensor) else self.w
        return torch.einsum("eoi,bi->beo", w, x).sum(1)


def _train_experts_on_2d_mesh() -> dict:
    """Expert weights as DTensors on a 2-D (ep, etp) mesh, (Shard(0), Shard(2)), sharded
    over dp: 3-D DTensor shards on (dp, ep, etp); gradients after two SGD steps."""
    from torch.distributed.tensor import Shard, distribute_tensor

    world = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("dp", "ep", "etp"))
    torch.manual_seed(0)
    ref = _StackedExperts()
    models = {}
    for impl in ("fsdp2", "torch"):
        model = copy.deepcopy(ref)
        weight = distribute_tensor(model.w.detach(), world["ep", "etp"], [Shard(0), Shard(2)])
        model.w = torch.nn.Parameter(weight)
        get_fully_shard(impl)(model, mesh=world["dp"])
        models[impl] = (model, torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    dp_rank = world["dp"].get_local_rank()
    for step in range(2):
        torch.manual_seed(100 + step)
        batch = torch.randn(4, 8)
        for model, opt in models.values():
            model(batch[2 * dp_rank : 2 * dp_rank + 2]).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        (ref(batch).pow(2).sum() / 2).backward()  # the mean over the 2 dp ranks' sums
        ref_opt.step()
        ref_opt.zero_grad()
    weights = {impl: m.w.full_tensor() for impl, (m, _) in models.items()}
    fsdp2_w = models["fsdp2"][0].w
    return {
        "diff": {impl: (w - ref.w).abs().max().item() for impl, w in weights.items()},
        "bitwise_equal": torch.equal(weights["fsdp2"], weights["torch"]),
        "placements": [repr(p) for p in fsdp2_w.placements],
        "mesh": fsdp2_w.device_mesh.mesh_dim_names,
    }


def test_expert_weights_on_a_2d_mesh_sharded_over_dp() -> None:
    """Expert parallel x expert TP parameters (a 2-D mesh) under FSDP: fsdp2 accepted
    1-D TP meshes only (NotImplementedError)."""
    for rep in run_ranks(_train_experts_on_2d_mesh, 4):
        assert max(rep["diff"].values()) <= TOL, rep["diff"]
        assert rep["bitwise_equal"]
        assert rep["mesh"] == ("dp", "ep", "etp")
        assert rep["placements"] == ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)", "Shard(dim=2)"]


class _MoEBlock(torch.nn.Module):
    """A dense projection, then stacked experts (a weight per expert, each applied to
    every token and summed: a stand-in for routing that needs no all-to-all)."""

    def __init__(self) -> None:
        super().__init__()
        # Registered first: the experts' (smaller) mesh comes first in the call's groups
        # and in state dicts.
        self.experts = _StackedExperts()
        with torch.no_grad():
            self.experts.w.mul_(0.1)
        self.proj = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(6, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.experts(torch.relu(self.proj(x)))) + x


def _per_param_mesh_placement(
    experts: torch.nn.Module, mesh_info: Any, dp_info: Any, expert_dim: int = 0
):
    from torch.distributed.tensor import Shard

    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    except ImportError:  # torch < 2.13 (only fsdp2 runs): what fsdp2 reads of it
        from _fuzz import PlacementResult as ShardPlacementResult

    expert_params = set(experts.parameters())

    def placement(param: torch.nn.Parameter) -> Any:
        if param in expert_params:
            return ShardPlacementResult(placement=Shard(expert_dim), mesh_info=mesh_info)
        return ShardPlacementResult(placement=Shard(0), mesh_info=dp_info)

    return placement


def _train_per_param_mesh(
    kind: str, reshard_after_forward: bool | int, with_torch: bool = True
) -> dict:
    """Blocks whose experts are sharded over another mesh than the rest, in one
    ``fully_shard`` call per block, as torchtitan shards MoE blocks with torch 2.13:
    ``ep``: experts are DTensors on ``ep`` (Shard(0)), FSDP over ``edp``, the rest over all
    4 ranks (each edp pair of ranks sees one batch, as expert parallelism would route
    it); ``ep_dim1``: the same with the experts sharded on dim 1 over ``edp`` (as
    torchtitan does when ``edp`` exceeds the local experts); ``subset``: plain experts, FSDP over ``edp`` only (batches shared as for ``ep``,
    so the experts' gradients agree across ``ep``); ``hsdp``: plain experts, HSDP over
    (edp, ep), the rest FSDP over all 4 ranks.
    Three SGD steps, parity with the non-sharded model and bitwise with torch (unless
    not ``with_torch``: torch < 2.13 has no per-parameter meshes)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo
    from torch.distributed.tensor import Shard, distribute_tensor

    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("edp", "ep"))
    dp_mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    dp_info = FSDPMeshInfo(mesh=dp_mesh, shard_mesh_dim=0)
    if kind in ("ep", "ep_dim1", "subset"):
        expert_info: Any = FSDPMeshInfo(mesh=world["edp"], shard_mesh_dim=0)
    else:
        expert_info = HSDPMeshInfo(mesh=world, shard_mesh_dim=1, replicate_mesh_dim=0)
    torch.manual_seed(0)
    ref = torch.nn.Sequential(_MoEBlock(), _MoEBlock(), torch.nn.Linear(8, 8))
    models = {}
    for impl in ("fsdp2", "torch", "fsdp2-loaded") if with_torch else ("fsdp2", "fsdp2-loaded"):
        model = copy.deepcopy(ref)
        for block in model[:2]:
            if kind.startswith("ep"):
                weight = distribute_tensor(block.experts.w.detach(), world["ep"], [Shard(0)])
                block.experts.w = torch.nn.Parameter(weight)
            get_fully_shard(impl.split("-")[0])(
                block,
                mesh=dp_mesh,
                reshard_after_forward=reshard_after_forward,
                shard_placement_fn=_per_param_mesh_placement(
                    block.experts, expert_info, dp_info, 1 if kind == "ep_dim1" else 0
                ),
            )
        get_fully_shard(impl.split("-")[0])(model, mesh=dp_mesh)
        models[impl] = (model, torch.optim.SGD(model.parameters(), lr=0.05))
    loaded = models.pop("fsdp2-loaded")[0]  # gets the trained weights from rank 0 below
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    rank = dist.get_rank()
    shared = kind != "hsdp"
    batch_of_rank = rank // 2 if shared else rank  # ranks 2i, 2i+1 share batch i
    log: list[tuple[str, int]] = []
    for step in range(3):
        torch.manual_seed(10 + step)
        batches = torch.randn(4, 2, 8)
        used = [batches[b // 2 if shared else b] for b in range(4)]
        for impl, (model, opt) in models.items():
            if impl == "fsdp2" and step == 2:
                _record_collectives(log)
            model(batches[batch_of_rank]).pow(2).sum().backward()
            _restore_collectives()
            opt.step()
            opt.zero_grad()
        (sum(ref(b).pow(2).sum() for b in used) / 4).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    params = {impl: [p.full_tensor() for p in m.parameters()] for impl, (m, _) in models.items()}
    state = models["fsdp2"][0][0]._fsdp_state
    from fsdp2 import get_full_state_dict, load_full_state_dict

    full = get_full_state_dict(models["fsdp2"][0])  # on rank 0 only
    load_full_state_dict(loaded, full if rank == 0 else {})
    return {
        "diff": {impl: compare_params(ref, m)[1] for impl, (m, _) in models.items()},
        "loaded_diff": compare_params(ref, loaded)[1],
        "bitwise_equal": with_torch
        and all(torch.equal(a, b) for a, b in zip(params["fsdp2"], params["torch"])),
        "groups": [g.world_size * g.replicate_size for g in state.groups],
        "expert_mesh": models["fsdp2"][0][0].experts.w.device_mesh.mesh_dim_names,
        "collectives": collections.Counter(log),
    }


@pytest.mark.parametrize("reshard_after_forward", [True, False, 2], ids=["raf", "noraf", "raf2"])
@pytest.mark.parametrize("kind", ["ep", "ep_dim1", "subset", "hsdp"])
def test_per_parameter_meshes_from_shard_placement_fn(
    kind: str, reshard_after_forward: bool | int
) -> None:
    """torch 2.13's ``ShardPlacementResult(placement, mesh_info)``: one ``fully_shard``
    call makes one group per mesh (experts on their own). fsdp2 raised TypeError. Where
    torch lacks it (< 2.13), fsdp2 alone is checked (with a stand-in for the class)."""
    with_torch = torch_fsdp_has("_fully_shard._fsdp_common", "ShardPlacementResult")
    for rep in run_ranks(_train_per_param_mesh, 4, kind, reshard_after_forward, with_torch):
        assert max(rep["diff"].values()) <= TOL, rep["diff"]
        assert rep["loaded_diff"] <= TOL, rep["loaded_diff"]
        assert rep["bitwise_equal"] or not with_torch
        assert rep["groups"] == ([4, 4] if kind == "hsdp" else [2, 4]), rep["groups"]
        counts = rep["collectives"]
        if kind != "hsdp":
            assert rep["expert_mesh"] == (("edp",) if kind == "subset" else ("edp", "ep"))
            # Per step: one reduce-scatter per block over all 4 ranks (dense) and one over
            # each edp pair (experts); the root's over all 4.
            assert counts[("reduce_scatter", 4)] == 3 and counts[("reduce_scatter", 2)] == 2
        else:
            assert counts[("reduce_scatter", 4)] == 3 and counts[("reduce_scatter", 2)] == 2
            assert counts[("all_reduce", 2)] == 2  # the experts' HSDP replicas


def _int_reshard_on_permuted_mesh(impl: str) -> float:
    """``reshard_after_forward=2`` over ``DeviceMesh("cpu", [0, 2, 1, 3])``, whose order
    differs from its process group's (the default group's): the largest gradient
    difference from the non-sharded model after one backward."""
    from torch.distributed.device_mesh import DeviceMesh

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4))
    model = copy.deepcopy(ref)
    mesh = DeviceMesh("cpu", [0, 2, 1, 3], mesh_dim_names=("permuted",))
    get_fully_shard(impl)(model[1], mesh=mesh, reshard_after_forward=2)
    get_fully_shard(impl)(model, mesh=mesh)
    x = torch.randn(4, 3, 4, generator=torch.Generator().manual_seed(1))
    model(x[dist.get_rank()]).pow(2).sum().backward()
    ref(x).pow(2).sum().div(4).backward()  # the mean over ranks of their sums
    return compare_grads(ref, model)


def compare_grads(ref: torch.nn.Module, model: torch.nn.Module) -> float:
    return max(
        (p.grad.full_tensor() - r.grad).abs().max().item()
        for p, r in zip(model.parameters(), ref.parameters())
    )


@pytest.mark.parametrize("impl", ["fsdp2", "torch"])
def test_int_reshard_on_a_mesh_in_another_rank_order(impl: str) -> None:
    """The post-forward subgroups follow the mesh ({0, 2}, {1, 3}); fsdp2 took each
    rank's index in its subgroup from its shard-group rank (rank 2 -> 0, like rank 0), so
    backward all-gathered a wrong weight. Found by the fuzzer (per-parameter meshes)."""
    for diff in run_ranks(_int_reshard_on_permuted_mesh, 4, impl):
        assert diff <= TOL, diff


def parameters_on_equal_meshes() -> dict[str, Any]:
    """Rank function: one module sharded on a mesh over a process group of its own, then
    another module with parameters of the same shapes on the default mesh over the same
    ranks (equal as DeviceMeshes: same layout, no dim names). Which process group does
    each parameter, and its gradient, use?"""
    from datetime import timedelta

    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    import fsdp2

    ranks = list(range(dist.get_world_size()))
    own = DeviceMesh.from_group(dist.new_group(ranks, timeout=timedelta(seconds=30)), "cpu")
    default = init_device_mesh("cpu", (len(ranks),))
    first, second = nn.Linear(8, 8), nn.Linear(8, 8)
    fsdp2.fully_shard(first, mesh=own)
    fsdp2.fully_shard(second, mesh=default)
    second(torch.ones(2, 8)).sum().backward()
    return {
        "equal": own == default,
        "own": own.get_group().group_name,
        "default": default.get_group().group_name,
        "first": [p.device_mesh.get_group().group_name for p in first.parameters()],
        "second": [p.device_mesh.get_group().group_name for p in second.parameters()],
        "grads": [p.grad.device_mesh.get_group().group_name for p in second.parameters()],
    }


def test_parameters_keep_their_mesh_next_to_an_equal_one() -> None:
    """DTensor's sharding-propagation cache compares meshes by layout, so wrapping the
    second module's shards as parameters (a detach through DTensor's dispatch) would give
    them the first module's mesh and process group; fsdp2 keeps the mesh it was given
    ([Note: the parameter keeps its own mesh] in ``_param``)."""
    for result in run_ranks(parameters_on_equal_meshes, 2):
        assert result["equal"] and result["own"] != result["default"], result
        assert set(result["first"]) == {result["own"]}, result
        assert set(result["second"]) == {result["default"]}, result
        assert set(result["grads"]) == {result["default"]}, result


def test_default_mesh_is_one_object_per_process_group() -> None:
    """[Note: one default mesh]: every ``fully_shard(mesh=None)`` of a model shares one
    ``DeviceMesh`` object (clipping keys its layouts by the mesh's identity, and a mesh per
    module costs its construction every call); a new default process group gets a new
    mesh of its own size."""
    from torch import nn
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import fsdp2

    assert not dist.is_initialized()

    def meshes() -> list[Any]:
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        for layer in model:
            fsdp2.fully_shard(layer)
        fsdp2.fully_shard(model)
        return [p.device_mesh for p in model.parameters()]

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        first = meshes()
        assert all(mesh is first[0] for mesh in first + meshes())
        assert first[0].size() == 2
    finally:
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        second = meshes()
        assert second[0] is not first[0]
        assert all(mesh is second[0] for mesh in second)
        assert second[0].size() == 4
        assert second[0].get_group() is dist.group.WORLD
    finally:
        dist.destroy_process_group()
