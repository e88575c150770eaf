"""Backwards that build a graph (``create_graph=True``): gradient penalties, second
derivatives, ``backward(create_graph=True)`` (see [Note: backward that builds a graph] in
``fsdp2/_unsharded_upkeep.py``).

The graph of such a backward saves the unsharded parameters; torch's ``fully_shard``
frees them at the end of that backward and the next backward fails ("setStorage ... out
of bounds for storage of size 0"). fsdp2 keeps them until the optimizer step. Every loss
here is a mean of per-sample terms, so the mean of the ranks' losses on their local
batches is the non-sharded model's loss on the global batch, and the sharded model must
train like it.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from _helpers import compare_grads, compare_params
from _launcher import run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

import fsdp2

LOCAL_BATCH = 3


def _model(activation: type[nn.Module] = nn.Tanh) -> nn.Sequential:
    """Tanh: smooth, second derivatives are not zero. Identity (a linear model): the
    graph of ``grad(model(x).sum(), x)`` holds the weights alone, so a backward of the
    penalty alone reaches them through no module output, so no fsdp2 pre-backward hook."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 7), activation(), nn.Linear(7, 3), activation(), nn.Linear(3, 9),
        activation(), nn.Linear(9, 4),
    )  # fmt: skip


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_(True)


def _input_grad(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    (grad,) = torch.autograd.grad(out, x, create_graph=True)
    return grad


def _loss(model: nn.Module, x: torch.Tensor, scenario: str) -> torch.Tensor:
    """One per-sample-mean loss of ``scenario``; backward is the caller's."""
    if scenario == "penalty":  # R1 / gradient-norm penalty on the inputs
        x = _leaf(x)
        y = model(x)
        grad = _input_grad(y.pow(2).sum(), x)
        return y.pow(2).sum(1).mean() + grad.pow(2).sum(1).mean()
    if scenario == "penalty-alone":  # StyleGAN2's lazy R1 step: the penalty on its own
        x = _leaf(x)
        grad = _input_grad(model(x).sum(), x)  # its graph holds the weights only
        return grad.pow(2).sum(1).mean()
    if scenario == "penalty-between-forwards":  # WGAN-GP's order: D(real), penalty, D(fake)
        real = model(x)
        mixed = _leaf(0.5 * x)
        grad = _input_grad(model(mixed).sum(), mixed)
        fake = model(x + 1.0)
        penalty = (grad.norm(dim=1) - 1.0).pow(2).mean()
        return fake.sum(1).mean() - real.sum(1).mean() + penalty
    if scenario == "second-derivative":  # a physics-informed residual u'' + u
        x = _leaf(x)
        u = model(x)[:, 0]
        du = _input_grad(u.sum(), x)
        d2u = _input_grad(du[:, 0].sum(), x)
        return (d2u[:, 0] + u).pow(2).mean() + du.pow(2).sum(1).mean()
    raise ValueError(scenario)


def _train(scenario: str, reshard: bool, hsdp: bool) -> float:
    """Three AdamW steps of the sharded and the non-sharded model; returns the largest
    difference in gradients and parameters."""
    warnings.simplefilter("ignore")  # backward(create_graph=True)'s reference-cycle warning
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = (
        init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard")) if hsdp else None
    )
    reference = _model(nn.Identity if scenario == "penalty-alone" else nn.Tanh)
    model = copy.deepcopy(reference)
    for block in (model[0], model[2], model[4]):
        fsdp2.fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fsdp2.fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=0.05)
    worst = 0.0
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        batch = torch.randn(world * LOCAL_BATCH, 5, generator=gen)
        local = batch.chunk(world)[rank]
        if scenario == "backward-create-graph":
            # Gradients with a graph, then a step. Nothing backpropagates through that
            # graph (torch's fully_shard trains here too): this checks the held groups'
            # bookkeeping, reduced by the final callback, gathered again after the step.
            model(local).pow(2).sum(1).mean().backward(create_graph=True)
            reference(batch).pow(2).sum(1).mean().backward(create_graph=True)
        elif scenario == "accumulation":  # two microbatches, the first without sync
            halves = local.chunk(2), batch.view(world, LOCAL_BATCH, 5).chunk(2, dim=1)
            for i in range(2):
                model.set_requires_gradient_sync(i == 1)
                (_loss(model, halves[0][i], "penalty") / 2).backward()
                (_loss(reference, halves[1][i].reshape(-1, 5), "penalty") / 2).backward()
        elif scenario == "two-forwards-then-backwards":  # each loss's graph kept to its own
            for m, x in ((model, local), (reference, batch)):
                first, second = _loss(m, x, "penalty"), _loss(m, x.flip(0), "penalty")
                (first / 2).backward()
                (second / 2).backward()
        else:
            _loss(model, local, scenario).backward()
            _loss(reference, batch, scenario).backward()
        # (The penalty alone does not depend on the biases: no gradient on either side.)
        _, grad_diff, missing = compare_grads(reference, model)
        assert not missing, missing
        worst = max(worst, grad_diff)
        for opt in (optim, ref_optim):
            opt.step()
            opt.zero_grad()
        worst = max(worst, compare_params(reference, model)[1])
    if reshard:  # every group resharded, its storage freed by the last step
        allocated = [g for s in _states(model) for g in s.groups
                     if g.unsharded_flat.untyped_storage().size() > 0]  # fmt: skip
        assert not allocated, "a group held by the graph was not freed by the step"
    return worst


def _states(model: nn.Module) -> list:
    return [m._fsdp_state for m in model.modules() if isinstance(m, fsdp2.FSDPModule)]


@pytest.mark.parametrize(
    "scenario",
    ["penalty", "penalty-alone", "penalty-between-forwards", "second-derivative",
     "backward-create-graph", "accumulation", "two-forwards-then-backwards"],
)  # fmt: skip
@pytest.mark.parametrize("reshard", [True, False])
def test_backward_that_builds_a_graph_trains_like_the_non_sharded_model(
    scenario: str, reshard: bool
) -> None:
    for worst in run_ranks(_train, 3, scenario, reshard, False):
        assert worst <= 1e-5


def test_gradient_penalty_with_hsdp() -> None:
    for worst in run_ranks(_train, 4, "penalty", True, True):
        assert worst <= 1e-5


def _phases_of_a_penalty_step() -> list[tuple[bool | None, bool, dict[str, int]]]:
    """After each phase of a penalty step (forward, the create_graph backward, the plain
    backward, the optimizer step): whether the groups' unsharded storage is allocated
    (True: all, False: none, None: some), whether the modules hold the sharded
    ``DTensor`` parameters, and the collectives the phase issued."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    model = _model()
    for block in (model[0], model[2], model[4]):
        fsdp2.fully_shard(block)
    fsdp2.fully_shard(model, reshard_after_forward=True)
    groups = [g for s in _states(model) for g in s.groups]
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    x = _leaf(torch.randn(LOCAL_BATCH, 5))
    phases = []

    def record(mode: CommDebugMode) -> None:
        allocated = {g.unsharded_flat.untyped_storage().size() > 0 for g in groups}
        kept = allocated.pop() if len(allocated) == 1 else None
        sharded = all(isinstance(p, DTensor) for p in model.parameters())
        counts = {str(op).rsplit(".", 1)[-1]: n for op, n in mode.get_comm_counts().items()}
        phases.append((kept, sharded, counts))

    for _ in range(2):
        # (CommDebugMode's module tracker hooks the forward's leaf input, which
        # autograd.grad then refuses: the forward is not counted.)
        y = model(x)
        record(CommDebugMode())
        with CommDebugMode() as mode:
            grad = _input_grad(y.sum(), x)
        record(mode)
        with CommDebugMode() as mode:
            (y.sum() + grad.pow(2).sum()).backward()
        record(mode)
        with CommDebugMode() as mode:
            optim.step()
            optim.zero_grad()
        record(mode)
    return phases


def test_the_graph_keeps_the_gathered_parameters_until_the_optimizer_step() -> None:
    groups = 4
    forward = (False, True, {})
    # The create_graph backward gathers every group again and keeps the storage (the
    # modules show the sharded parameters); its reduce-scatters carry no gradient (it
    # took gradients of the inputs only), as without create_graph.
    graph_building = (True, True, {"_allgather_base_": groups, "_reduce_scatter_base_": groups})
    # The next backward reuses the kept parameters (no all-gather); the step frees them.
    plain = (True, True, {"_reduce_scatter_base_": groups})
    step = (False, True, {})
    for phases in run_ranks(_phases_of_a_penalty_step, 2):
        assert phases == [forward, graph_building, plain, step] * 2


class _CheckpointedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(lambda t: torch.tanh(self.lin(t)), x, use_reentrant=False)


def _penalty_with(variant: str) -> float:
    """Three AdamW steps of an input-gradient penalty with ``variant``; returns the largest
    parameter difference to the non-sharded model."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    if variant == "checkpoint":  # recomputed in both backwards
        reference = nn.Sequential(*(_CheckpointedBlock() for _ in range(3)), nn.Linear(6, 2))
    else:
        reference = nn.Sequential(*(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(3)))
    model = copy.deepcopy(reference)
    kwargs: dict = {}
    if variant == "cpu-offload":
        kwargs["offload_policy"] = fsdp2.CPUOffloadPolicy(pin_memory=False)
    for block in model[:3]:
        block_kwargs = {"reshard_after_forward": 2} if variant == "reshard-to-2" else {}
        fsdp2.fully_shard(block, **kwargs, **block_kwargs)
    fsdp2.fully_shard(model, **kwargs)
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=0.05)
    worst = 0.0
    for step in range(3):
        batch = torch.randn(world * 2, 6, generator=torch.Generator().manual_seed(step))
        for m, x, opt in ((model, batch.chunk(world)[rank], optim), (reference, batch, ref_optim)):
            _loss(m, x, "penalty").backward()
            opt.step()
            opt.zero_grad()
        worst = max(worst, compare_params(reference, model)[1])
    return worst


@pytest.mark.parametrize(
    "variant, world_size",
    [("checkpoint", 2), ("cpu-offload", 2), ("reshard-to-2", 4), ("plain", 1)],
)
def test_gradient_penalty_with(variant: str, world_size: int) -> None:
    for worst in run_ranks(_penalty_with, world_size, variant):
        assert worst <= 1e-5


def _storage_after_backward_and_step() -> list[bool]:
    """``backward(create_graph=True)`` whose graph nobody uses: whether the blocks' storage
    is allocated after the backward and after the optimizer step."""
    warnings.simplefilter("ignore")  # backward(create_graph=True)'s reference-cycle warning
    model = _model()
    for block in (model[0], model[2], model[4]):
        fsdp2.fully_shard(block)
    fsdp2.fully_shard(model)
    blocks = [g for s in _states(model)[1:] for g in s.groups]
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(LOCAL_BATCH, 5)).sum().backward(create_graph=True)
    seen = [all(g.unsharded_flat.untyped_storage().size() > 0 for g in blocks)]
    optim.step()
    seen.append(any(g.unsharded_flat.untyped_storage().size() > 0 for g in blocks))
    return seen


def test_an_optimizer_step_frees_what_a_graph_held() -> None:
    assert run_ranks(_storage_after_backward_and_step, 2) == [[True, False]] * 2


def _updated_by_hand() -> tuple[float, bool]:
    """Penalty steps with a by-hand SGD update (no optimizer, so no step pre-hook): the
    largest parameter difference to the non-sharded model, and whether the blocks'
    storage is allocated after a forward that follows the last update."""
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = _model()
    model = copy.deepcopy(reference)
    for block in (model[0], model[2], model[4]):
        fsdp2.fully_shard(block)
    fsdp2.fully_shard(model)
    worst = 0.0
    for step in range(3):
        batch = torch.randn(world * 2, 5, generator=torch.Generator().manual_seed(step))
        for m, x in ((model, batch.chunk(world)[rank]), (reference, batch)):
            _loss(m, x, "penalty").backward()
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
        worst = max(worst, compare_params(reference, model)[1])
    model(torch.randn(2, 5))  # the shards changed: the hold ends, the blocks reshard
    blocks = [g for s in _states(model)[1:] for g in s.groups]
    return worst, any(g.unsharded_flat.untyped_storage().size() > 0 for g in blocks)


def test_shards_updated_by_hand_end_the_hold() -> None:
    for worst, allocated in run_ranks(_updated_by_hand, 2):
        assert worst <= 1e-5
        assert not allocated


class _ForceField(nn.Module):
    """A machine-learned potential: an energy per sample, and forces ``-dE/dx`` taken with
    ``autograd.grad`` inside the root's forward (with a graph while training), as
    conservative force fields do."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.detach().requires_grad_(True)
        h = x
        for block in self.blocks:
            h = block(h)
        energy = self.head(h).squeeze(-1)
        (grad,) = torch.autograd.grad(energy.sum(), x, create_graph=self.training)
        return energy, -grad


def _force_field(reshard: bool) -> float:
    """Three AdamW steps on energies and forces, then an eval forward (forces without a
    graph); the largest difference to the non-sharded model."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = _ForceField()
    model = copy.deepcopy(reference)
    for block in model.blocks:
        fsdp2.fully_shard(block, reshard_after_forward=reshard)
    fsdp2.fully_shard(model, reshard_after_forward=reshard)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=0.01)
    worst = 0.0
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x, e, f = (torch.randn(world * 2, *s, generator=gen) for s in ((6,), (), (6,)))
        rows = slice(2 * rank, 2 * rank + 2)
        for m, opt, r in ((model, optim, rows), (reference, ref_optim, slice(None))):
            energy, forces = m(x[r])
            loss = (energy - e[r]).pow(2).mean() + (forces - f[r]).pow(2).sum(1).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        worst = max(worst, compare_params(reference, model)[1])
    model.eval()
    reference.eval()
    x = torch.randn(2, 6)
    for a, b in zip(model(x), reference(x), strict=True):
        worst = max(worst, (a - b).abs().max().item())
    return worst


@pytest.mark.parametrize("reshard", [True, False])
def test_forces_taken_inside_forward(reshard: bool) -> None:
    for worst in run_ranks(_force_field, 2, reshard):
        assert worst <= 1e-5


def _held_after_a_plain_backward(reentrant: bool) -> list[bool]:
    """Checkpointing recomputes forwards with grad enabled, inside backward: whether any
    group is held for a graph after a plain backward through checkpointed blocks."""

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Linear(6, 6), nn.Tanh())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.block, x, use_reentrant=reentrant)

    torch.manual_seed(0)
    model = nn.Sequential(*(Checkpointed() for _ in range(3)), nn.Linear(6, 2))
    for wrapper in model[:3]:
        fsdp2.fully_shard(wrapper.block)
    fsdp2.fully_shard(model)
    model(torch.randn(4, 6, requires_grad=True)).sum().backward()
    return [g.held_by_graph or g.kept_for_graph for s in _states(model) for g in s.groups]


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint_recomputation_holds_nothing(reentrant: bool) -> None:
    assert run_ranks(_held_after_a_plain_backward, 2, reentrant) == [[False] * 4] * 2
