"""``ReducePolicy`` (docs/reduction.md): bf16 on the wire with fp32 sums, and sums in rank
order.

What each group of tests pins, and what to look at first when one fails:

* precision: the max relative error of the reduced gradient against fp64, normalised per
  element by the mean |contribution| of the ranks, for the three schemes (fp32
  reduce-scatter, bf16 reduce-scatter, bf16 all-to-all with fp32 sums), on gloo at 2, 4
  and 8 ranks and, through the same summing code fed the same stacked contributions, up
  to 1,024. The message lists every scheme's error per world size: a bf16-wire error
  above 2^-8 means contributions were summed in bf16 somewhere (a reduce-scatter, or a
  cast before the sum);
* determinism: gradients of runs whose ranks are delayed differently must be bitwise
  equal, and equal to the rank-order fold the test computes (a fold in arrival order, or
  any other order, differs on most elements: the test checks that too);
* parity: fp32 on the wire with fp32 sums equals today's reduce-scatter (bitwise at 2
  ranks) and the non-sharded model; bf16 compute with bf16 wire and fp32 sums equals
  torch's ``fully_shard`` with ``reduce_dtype=fp32`` bitwise at 2 ranks, at half the bytes;
* counts: one all-to-all per group per backward and no reduce-scatter (HSDP: one
  all-to-all and one all-gather over replicas, no all-reduce);
* composition with the other features, each against the non-sharded model;
* bad input.
"""

from __future__ import annotations

import collections
import copy
import pathlib
import re
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _fuzz import Gathered
from _helpers import ParityCase, assert_parity, run_parity
from _launcher import run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
import fsdp2._fingerprints as fingerprints

# One definition of the contributions and the simulation for these tests and the docs' plot.
from benchmarks.reduction import _training_rank, contributions, relative_error, simulated
from examples.llama import ModelArgs, Transformer, loss_fn, parallelize

BF16, FP32, FP64 = torch.bfloat16, torch.float32, torch.float64
# bf16 on the wire, fp32 sums: one all-to-all per group.
BF16_WIRE = fsdp2.ReducePolicy(comm_dtype=BF16, accumulate_dtype=FP32)
# bf16 on the wire and in the sums: a bf16 reduce-scatter, what large jobs run today.
BF16_REDUCE_SCATTER = fsdp2.ReducePolicy(comm_dtype=BF16, accumulate_dtype=BF16)
# fp32 on the wire and in the sums, in rank order: an fp32 all-to-all.
FP32_DETERMINISTIC = fsdp2.ReducePolicy(comm_dtype=FP32, accumulate_dtype=FP32, deterministic=True)
SCHEMES: dict[str, fsdp2.ReducePolicy | None] = {
    "fp32 reduce-scatter": None,
    "bf16 reduce-scatter": BF16_REDUCE_SCATTER,
    "bf16 wire, fp32 sums": BF16_WIRE,
}
BOUND = 2.0**-8


class Probe(nn.Module):
    """One parameter whose gradient is the input: its group reduces exactly the
    contributions it is given."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(numel // 8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight * x.view_as(self.weight)).sum()


def _reduced(probe: nn.Module, contribution: torch.Tensor) -> torch.Tensor:
    probe(contribution).backward()
    grad = probe.weight.grad.full_tensor().flatten()
    probe.weight.grad = None
    return grad


# ------------------------------------------------------------------ precision


NUMEL = 8192


def _reduce_with_every_scheme(numel: int, seed: int) -> dict[str, torch.Tensor]:
    """Rank function: the averaged gradient of each scheme for the same contributions."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    mine = contributions(ws, numel, seed)[rank]
    out = {}
    for name, policy in SCHEMES.items():
        probe = Probe(numel)
        fsdp2.fully_shard(probe, reduce_policy=policy)
        out[name] = _reduced(probe, mine)
    return out


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_bf16_wire_error_on_gloo(world_size: int) -> None:
    """The reduced gradients on gloo, against fp64: the bf16 wire with fp32 sums stays
    within 2^-8, and equals the simulation below bitwise (the simulation runs the same
    code, so its larger world sizes speak for the real path)."""
    results = run_ranks(_reduce_with_every_scheme, world_size, NUMEL, 0, timeout=240)
    contribs = contributions(world_size, NUMEL, 0)
    errors = {name: relative_error(results[0][name], contribs) for name in SCHEMES}
    report = f"world size {world_size}: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items())
    print(report)
    for other in results[1:]:  # every rank holds the same gradient
        for name in SCHEMES:
            assert torch.equal(other[name], results[0][name]), (name, report)
    assert errors["bf16 wire, fp32 sums"] <= BOUND, report
    assert errors["fp32 reduce-scatter"] < errors["bf16 wire, fp32 sums"], report
    assert errors["bf16 reduce-scatter"] > errors["bf16 wire, fp32 sums"], report
    expected = simulated(contribs, "bf16 wire, fp32 sums")
    assert torch.equal(results[0]["bf16 wire, fp32 sums"], expected), report


def _hsdp_errors(shape: tuple[int, int], numel: int) -> dict[str, float]:
    """Rank function: each scheme's error on an HSDP mesh (replicas, shard ranks)."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    contribs = contributions(ws, numel, 0)
    out = {}
    for name, policy in SCHEMES.items():
        probe = Probe(numel)
        fsdp2.fully_shard(probe, mesh=init_device_mesh("cpu", shape), reduce_policy=policy)
        out[name] = relative_error(_reduced(probe, contribs[rank]), contribs)
    return out


@pytest.mark.parametrize("shape", [(2, 2), (2, 4)], ids=["2x2", "2x4"])
def test_bf16_wire_error_with_hsdp(shape: tuple[int, int]) -> None:
    """HSDP rounds each replica's partial sum to the wire dtype once more ([Note: replicas
    under a reduce policy]): the bound doubles to 2 * 2^-8, and the error stays below the
    bf16 reduce-scatter and all-reduce's (reported side by side in the message)."""
    errors = run_ranks(_hsdp_errors, shape[0] * shape[1], shape, NUMEL, timeout=240)[0]
    report = f"{shape}: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items())
    print(report)
    assert errors["bf16 wire, fp32 sums"] <= 2 * BOUND, report
    assert errors["bf16 wire, fp32 sums"] < errors["bf16 reduce-scatter"], report


def test_bf16_wire_error_simulated_up_to_1024_ranks() -> None:
    """The same per-rank contributions through the code a rank runs after the
    all-to-all, at 2 to 1,024 ranks: within 2^-8 everywhere, while a bf16 ring's error
    grows with the world size (reported side by side in the message)."""
    rows = []
    wire, ring = {}, {}
    for exponent in range(1, 11):
        ws = 2**exponent
        contribs = contributions(ws, 2048, exponent)
        wire[ws] = relative_error(simulated(contribs, "bf16 wire, fp32 sums"), contribs)
        ring[ws] = relative_error(simulated(contribs, "bf16 reduce-scatter"), contribs)
        rows.append(f"{ws:>5}: bf16 wire + fp32 sums {wire[ws]:.2e}, bf16 ring {ring[ws]:.2e}")
    report = "\n".join(rows)
    print(report)
    assert max(wire.values()) <= BOUND, report
    assert all(ring[ws] > wire[ws] for ws in wire), report
    assert ring[1024] > 8 * BOUND > ring[2], report  # the ring's error grows


# ------------------------------------------------------------------ training


def _loss_deviation(steps: int) -> dict[str, float]:
    curves = run_ranks(_training_rank, 4, steps, timeout=900)[0]
    reference = torch.tensor(curves["fp32 reduce-scatter"])
    return {
        name: (torch.tensor(curves[name]) - reference).abs().mean().item()
        for name in ("bf16 reduce-scatter", "bf16 wire, fp32 sums")
    }


def test_bf16_wire_follows_the_fp32_reduce_loss_curve() -> None:
    """A tiny Llama with bf16 compute on 4 ranks, 30 steps of benchmarks/reduction.py's
    training run (its 300-step curves are in docs/reduction.md): the bf16-wire run's
    losses stay closer to the fp32-reduce run's than the bf16 reduce-scatter run's do."""
    steps = 30
    deviation = _loss_deviation(steps)
    assert deviation["bf16 wire, fp32 sums"] < deviation["bf16 reduce-scatter"], deviation
    assert deviation["bf16 reduce-scatter"] > 0, deviation


# ------------------------------------------------------------------ determinism


def _order_sensitive(world_size: int, numel: int) -> torch.Tensor:
    """Contributions whose fp32 sum depends on the order of the terms on most elements:
    magnitudes spread over 2^-4..2^4, random signs (about 40% of the elements of a
    4-rank sum change with the order)."""
    gen = torch.Generator().manual_seed(7)
    magnitude = torch.exp2(8.0 * torch.rand(world_size, numel, generator=gen) - 4.0)
    sign = torch.randint(0, 2, (world_size, numel), generator=gen) * 2 - 1
    return (magnitude * sign).to(FP32)


def _deterministic_under_delays(delays: list[list[float]], hsdp: bool) -> list[torch.Tensor]:
    """Rank function: one probe with fp32 wire and sums in rank order; for each entry of
    ``delays`` a backward in which each rank first sleeps its delay, so the ranks'
    all-to-all messages arrive in different orders. Returns each run's gradient."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    mine = _order_sensitive(ws, NUMEL)[rank]
    mesh = init_device_mesh("cpu", (2, ws // 2) if hsdp else (ws,))
    probe = Probe(NUMEL)
    fsdp2.fully_shard(probe, mesh=mesh, reduce_policy=FP32_DETERMINISTIC)
    results = []
    for per_rank in delays:
        loss = probe(mine)
        time.sleep(per_rank[rank])
        loss.backward()
        results.append(probe.weight.grad.full_tensor().flatten())
        probe.weight.grad = None
    return results


def _fold(terms: list[torch.Tensor]) -> torch.Tensor:
    total = terms[0].clone()
    for term in terms[1:]:
        total = total + term
    return total


@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp-4", "hsdp-2x4"])
def test_deterministic_sums_are_rank_order_folds(hsdp: bool) -> None:
    ws = 8 if hsdp else 4
    base = [0.05 * i for i in range(ws)]
    delays = [base, base[::-1], base[1::2] + base[0::2]]
    results = run_ranks(_deterministic_under_delays, ws, delays, hsdp, timeout=180)
    contribs = list(_order_sensitive(ws, NUMEL))
    if hsdp:  # ranks 4r..4r+3 shard replica r: fold over shard ranks, then replicas
        expected = _fold([_fold(contribs[0:4]), _fold(contribs[4:8])]) / ws
    else:
        expected = _fold(contribs) / ws
    # Not vacuous: other orders give other sums on many elements.
    reversed_order = _fold(contribs[::-1]) / ws
    differs = (reversed_order != expected).float().mean().item()
    assert differs > 0.2, differs
    for rank, runs in enumerate(results):
        for run, grad in enumerate(runs):
            mismatch = (grad != expected).sum().item()
            assert mismatch == 0, (
                f"rank {rank}, run {run}: {mismatch} elements off the rank-order sum"
            )


# ------------------------------------------------------------------ parity


def _llama(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16))
    model.init_weights(seed)
    return model


def _grads_per_step(policies: dict[str, Any], mp_policy: Any, steps: int) -> dict[str, list]:
    """Rank function: the Llama trained ``steps`` SGD steps under each reduce policy (all
    from the same weights, on the same data); each step's full gradients."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    base = _llama()
    out: dict[str, list] = {}
    for name, policy in policies.items():
        model = parallelize(
            copy.deepcopy(base), fsdp2.fully_shard, reduce_policy=policy, mp_policy=mp_policy
        )
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        history = []
        for step in range(steps):
            gen = torch.Generator().manual_seed(100 + step)
            tokens = torch.randint(0, 64, (2 * ws, 16), generator=gen)[2 * rank : 2 * rank + 2]
            loss_fn(model(tokens), tokens).backward()
            history.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
            optim.step()
            optim.zero_grad()
        out[name] = history
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_fp32_exchange_matches_the_reduce_scatter(world_size: int) -> None:
    """comm = accumulate = fp32 in rank order against today's fp32 reduce-scatter:
    bitwise at 2 ranks (a two-term sum has one order), within 1e-6 at 3."""
    policies = {"reduce-scatter": None, "all-to-all": FP32_DETERMINISTIC}
    history = run_ranks(_grads_per_step, world_size, policies, fsdp2.MixedPrecisionPolicy(), 3)[0]
    for step, (ours, theirs) in enumerate(zip(history["all-to-all"], history["reduce-scatter"])):
        for name, grad in ours.items():
            diff = (grad - theirs[name]).abs().max().item()
            if world_size == 2:
                assert diff == 0.0, (step, name, diff)
            assert diff <= 1e-6, (step, name, diff)


@pytest.mark.parametrize(
    ("policy", "model", "world_size"),
    [
        (FP32_DETERMINISTIC, "llama", 1),  # no collective: the sum of one chunk
        (FP32_DETERMINISTIC, "llama", 2),
        (FP32_DETERMINISTIC, "llama", 3),
        (FP32_DETERMINISTIC, "mlp", 4),  # uneven shapes, empty shards
        (fsdp2.ReducePolicy(deterministic=True), "two_branch", 2),  # unused parameters
    ],
)
def test_parity_with_the_non_sharded_model(
    policy: fsdp2.ReducePolicy, model: str, world_size: int
) -> None:
    case = ParityCase(impl="fsdp2", model=model, extra={"fsdp2_kwargs": {"reduce_policy": policy}})
    assert_parity(run_ranks(run_parity, world_size, case), case)


def _bf16_compute_against_torch() -> dict[str, Any]:
    """Rank function: bf16 compute; torch reduce-scatters in fp32, fsdp2 sends bf16 and
    sums in fp32. Parameters after three AdamW steps, and the reduction bytes."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    ws, rank = dist.get_world_size(), dist.get_rank()
    base = _llama()
    models = {
        "torch": parallelize(
            copy.deepcopy(base),
            torch_fully_shard,
            mp_policy=TorchPolicy(param_dtype=BF16, reduce_dtype=FP32),
        ),
        "fsdp2": parallelize(
            copy.deepcopy(base),
            fsdp2.fully_shard,
            mp_policy=fsdp2.MixedPrecisionPolicy(param_dtype=BF16),
            reduce_policy=BF16_WIRE,
        ),
    }
    sent: dict[str, int] = collections.Counter()
    rs_name = (
        "reduce_scatter_single"
        if hasattr(dist, "reduce_scatter_single")
        else "reduce_scatter_tensor"
    )
    originals = {n: getattr(dist, n) for n in ("all_to_all_single", rs_name)}

    def counting(name: str) -> Any:
        def call(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            sent[name] += input.numel() * input.element_size()
            return originals[name](output, input, *args, **kwargs)

        return call

    for model in models.values():
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            tokens = torch.randint(0, 64, (2 * ws, 16), generator=gen)[2 * rank : 2 * rank + 2]
            for name in originals:
                setattr(dist, name, counting(name))
            try:
                loss_fn(model(tokens), tokens).backward()
            finally:
                for name, fn in originals.items():
                    setattr(dist, name, fn)
            optim.step()
            optim.zero_grad()
    params = {
        impl: {n: p.full_tensor() for n, p in model.named_parameters()}
        for impl, model in models.items()
    }
    return {
        "params": params,
        "bytes": {"all-to-all": sent["all_to_all_single"], "reduce-scatter": sent[rs_name]},
    }


def test_bf16_compute_equals_torch_fp32_reduction_at_half_the_bytes() -> None:
    """With bf16 compute the gradients are bf16 already: sending them in bf16 loses
    nothing, and summing in fp32 (two terms, one order) gives torch's fp32
    reduce-scatter's numbers bitwise, for half its bytes."""
    torch_fsdp = pytest.importorskip("torch.distributed.fsdp")
    assert hasattr(torch_fsdp, "MixedPrecisionPolicy")
    for report in run_ranks(_bf16_compute_against_torch, 2):
        for name, value in report["params"]["torch"].items():
            assert torch.equal(report["params"]["fsdp2"][name], value), name
        sent = report["bytes"]
        # Half of torch's bytes, plus fsdp2's has-gradient flags: 64 bytes per rank's
        # chunk ([Note: padded gradient flags]), and the divergence checks' 64-byte
        # fingerprint block, 2 ranks, 3 groups, 3 steps.
        flags = (64 + fingerprints.BLOCK_BYTES) * 2 * 3 * 3
        assert sent["all-to-all"] == sent["reduce-scatter"] // 2 + flags > flags, sent


# ------------------------------------------------------------------ counts


def _count_backward_collectives(policy: Any, hsdp: bool) -> dict[str, Any]:
    """Rank function: the collectives of one backward of the Llama (3 groups) under
    ``policy``, as (name, ranks of the group, dtype, input bytes), and this rank's shard
    and replicate groups."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (2, ws // 2) if hsdp else (ws,))
    model = parallelize(_llama(), fsdp2.fully_shard, mesh=mesh, reduce_policy=policy)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rank))
    loss_fn(model(tokens), tokens).backward()  # lazy init outside the count
    names = ["all_to_all_single", "all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor"]
    names += ["reduce_scatter_single", "all_gather_single"]
    originals = {n: getattr(dist, n) for n in names if hasattr(dist, n)}
    calls: list[tuple[str, tuple[int, ...], str, int]] = []
    depth = [0]

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:  # the outermost call (some delegate to another)
                data = args[1] if len(args) > 1 else args[0]
                ranks = tuple(dist.get_process_group_ranks(kwargs["group"]))
                calls.append((name, ranks, str(data.dtype), data.numel() * data.element_size()))
            depth[0] += 1
            try:
                return originals[name](*args, **kwargs)
            finally:
                depth[0] -= 1

        return call

    y = model(tokens)
    for name in originals:
        setattr(dist, name, counting(name))
    try:
        loss_fn(y, tokens).backward()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    groups = [tuple(dist.get_process_group_ranks(mesh.get_group(d))) for d in range(mesh.ndim)]
    return {"calls": calls, "shard": groups[-1], "replicate": groups[0] if hsdp else None}


def _reductions(report: dict[str, Any]) -> list[tuple[str, tuple[int, ...], str, int]]:
    """The gradient reductions of a backward: every collective except the all-gathers of
    parameters (those run over the shard group)."""
    return [
        c
        for c in report["calls"]
        if not (c[0].startswith("all_gather") and c[1] == report["shard"])
    ]


def test_one_all_to_all_per_group_and_no_reduce_scatter() -> None:
    """Three groups (two blocks and the root): three bf16 all-to-alls in backward and
    nothing else reduces; each carries the bytes of the bf16 reduce-scatter it replaces."""
    reports = run_ranks(_count_backward_collectives, 2, BF16_WIRE, False)
    baseline = run_ranks(_count_backward_collectives, 2, BF16_REDUCE_SCATTER, False)
    for report, base in zip(reports, baseline):
        ours = _reductions(report)
        assert [(c[0], c[2]) for c in ours] == [("all_to_all_single", "torch.bfloat16")] * 3, ours
        theirs = _reductions(base)
        assert {c[0] for c in theirs} <= {"reduce_scatter_tensor", "reduce_scatter_single"}
        assert [c[3] for c in ours] == [c[3] for c in theirs], (ours, theirs)


def test_hsdp_reduces_over_replicas_without_an_all_reduce() -> None:
    """HSDP 2x2: per group, one bf16 all-to-all over the shard group, then one bf16
    all-to-all and one fp32 all-gather over the replicate group; no all-reduce and no
    reduce-scatter."""
    for report in run_ranks(_count_backward_collectives, 4, BF16_WIRE, True):
        shard, replicate = report["shard"], report["replicate"]
        expected = [
            ("all_to_all_single", shard, "torch.bfloat16"),
            ("all_to_all_single", replicate, "torch.bfloat16"),
            ("all_gather", replicate, "torch.float32"),
        ] * 3
        got = [
            ("all_gather" if name.startswith("all_gather") else name, ranks, dtype)
            for name, ranks, dtype, _ in _reductions(report)
        ]
        assert got == expected, report["calls"]


# ------------------------------------------------------------------ composition

DIM = 8


class _Block(nn.Module):
    def __init__(self, gain_dtype: torch.dtype) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, DIM, dtype=gain_dtype))
        self.rare = nn.Linear(DIM, DIM)  # used by some ranks only, in "flags"

    def forward(self, x: torch.Tensor, use_rare: bool) -> torch.Tensor:
        y = self.lin(x) * self.gain.to(x.dtype)
        if use_rare:
            y = y + self.rare(x)
        return torch.tanh(y)


class _Net(nn.Module):
    def __init__(self, gain_dtype: torch.dtype) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(gain_dtype) for _ in range(3))
        self.head = nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor, rare_in: tuple[int, ...] = ()) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x, i in rare_in)
        return self.head(x)


def _rare_in(feature: str, rank: int) -> tuple[int, ...]:
    """Blocks whose ``rare`` layer this rank uses: with "flags", block 0's on rank 0 only
    (the other ranks lack its gradients), block 1's on no rank (its gradients stay None)."""
    if feature != "flags":
        return (0, 1, 2)
    return (0, 2) if rank == 0 else (2,)


def _compose(feature: str, policy: fsdp2.ReducePolicy) -> dict[str, Any]:
    """Rank function: a 3-block net trained 2 SGD steps with ``policy`` and ``feature``,
    against the non-sharded net on the same global batch. Returns the worst gradient and
    parameter differences, which gradients were None on one side only, and the
    collectives of the last backward."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    reference = _Net(FP64 if feature == "mixed-dtypes" else FP32)
    model = copy.deepcopy(reference)
    if feature == "extensions":
        for block in model.blocks:
            block.lin.weight = nn.Parameter(Gathered(block.lin.weight.detach().clone()))
    kw: dict[str, Any] = {"reduce_policy": policy}
    if feature.startswith("hsdp"):
        kw["mesh"] = init_device_mesh("cpu", (2, ws // 2))
    if feature == "offload":
        kw["offload_policy"] = fsdp2.CPUOffloadPolicy(pin_memory=False)
    for block in model.blocks:
        fsdp2.fully_shard(block, **kw)
    fsdp2.fully_shard(model, **kw)
    modules = [*model.blocks, model]
    scale = {name: 1.0 for name, _ in reference.named_parameters()}
    if feature == "divide-factor":
        for module in modules:
            module.set_gradient_divide_factor(2.0 * ws)  # half the mean
            module.set_force_sum_reduction_for_comms(True)
        scale = {name: 0.5 for name in scale}
    if feature == "all-reduce-hook":
        model.blocks[0].set_all_reduce_hook(lambda shard: shard.mul_(2.0))
        scale.update({n: 2.0 for n in scale if n.startswith("blocks.0.")})
    lr = 0.5
    if feature == "optimizer-in-backward":
        for param in model.parameters():
            one = torch.optim.SGD([param], lr=lr)
            param.register_post_accumulate_grad_hook(
                lambda _, one=one: (one.step(), one.zero_grad())
            )
    optim = torch.optim.SGD(model.parameters(), lr=lr)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=lr)
    microbatches = 2 if feature in ("accumulation", "hsdp-partial-sums") else 1
    worst_grad, worst_param, none_mismatch = 0.0, 0.0, []
    for step in range(2):
        gen = torch.Generator().manual_seed(step)
        data = torch.randn(microbatches, ws, 4, DIM, generator=gen)
        for micro in range(microbatches):
            last = micro == microbatches - 1
            if feature == "accumulation":
                model.set_requires_gradient_sync(last)
            if feature == "hsdp-partial-sums":
                model.set_requires_all_reduce(last)
            out = model(data[micro, rank], _rare_in(feature, rank))
            (out.pow(2).mean() / microbatches).backward()
            ref_loss = sum(
                reference(data[micro, r].to(reference.head.weight.dtype), _rare_in(feature, r))
                .pow(2)
                .mean()
                for r in range(ws)
            )
            (ref_loss / (ws * microbatches)).backward()
        for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
            if feature == "optimizer-in-backward":
                break  # stepped and zeroed inside backward
            if (param.grad is None) != (ref.grad is None):
                none_mismatch.append(name)
            elif param.grad is not None:
                diff = (param.grad.full_tensor() - scale[name] * ref.grad).abs().max().item()
                worst_grad = max(worst_grad, diff)
        if feature in ("divide-factor", "all-reduce-hook"):
            for name, ref in reference.named_parameters():  # step with what fsdp2 stepped
                if ref.grad is not None:
                    ref.grad.mul_(scale[name])
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
        for param, ref in zip(model.parameters(), reference.parameters()):
            diff = (param.full_tensor() - ref).abs().max().item()
            worst_param = max(worst_param, diff)
    exchanged = sum(
        1
        for state in {id(m._fsdp_state): m._fsdp_state for m in modules}.values()
        for group in state.groups
        if group.reduce_policy is policy
    )
    return {
        "grad": worst_grad,
        "param": worst_param,
        "none_mismatch": none_mismatch,
        "groups_with_policy": exchanged,
    }


FEATURES = [
    "plain",
    "accumulation",
    "divide-factor",
    "offload",
    "mixed-dtypes",
    "extensions",
    "all-reduce-hook",
    "optimizer-in-backward",
    "flags",
    "hsdp",
    "hsdp-partial-sums",
]


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize(
    ("policy", "tol"),
    [
        (fsdp2.ReducePolicy(deterministic=True), 1e-5),
        (BF16_WIRE, 2e-2),
        # fp16 on the wire: pre-divided before the cast, as fp16 reduce-scatters are.
        (fsdp2.ReducePolicy(comm_dtype=torch.float16, accumulate_dtype=FP32), 2e-3),
    ],
    ids=["deterministic", "bf16-wire", "fp16-wire"],
)
def test_composes_with(feature: str, policy: fsdp2.ReducePolicy, tol: float) -> None:
    """Against the non-sharded net: exact (1e-5) with sums in rank order in the
    parameters' dtypes, bf16-close with bf16 on the wire."""
    ws = 4 if feature.startswith("hsdp") else 2
    for report in run_ranks(_compose, ws, feature, policy):
        assert report["groups_with_policy"] == 4, report
        assert report["none_mismatch"] == [], report
        assert report["grad"] <= tol and report["param"] <= tol, report


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"comm_dtype": FP32, "accumulate_dtype": BF16}, ValueError, "does not fit in accumulate"),
        ({"comm_dtype": torch.float16, "accumulate_dtype": BF16}, ValueError, "does not fit"),
        ({"comm_dtype": FP64, "accumulate_dtype": FP32}, ValueError, "does not fit"),
        ({"comm_dtype": torch.int32}, ValueError, r"comm_dtype must be torch.bfloat16.*int32"),
        ({"accumulate_dtype": torch.complex64}, ValueError, "accumulate_dtype must be.*complex"),
        ({"comm_dtype": torch.float8_e4m3fn}, ValueError, "float8"),
        ({"deterministic": 1}, TypeError, "deterministic must be a bool"),
    ],
)
def test_bad_policies(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        fsdp2.ReducePolicy(**kwargs)


def test_fully_shard_checks_the_policy_type_first() -> None:
    with pytest.raises(TypeError, match=r"reduce_policy=...\) expects a fsdp2.ReducePolicy"):
        fsdp2.fully_shard(nn.Linear(2, 2), reduce_policy="bf16")  # type: ignore[arg-type]


class _ReduceScatter:
    """A custom reduce-scatter (``set_custom_reduce_scatter``)."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output: Any, input: Any, group: Any, op: Any, async_op: bool = False) -> Any:
        return dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)


def _provoke(case: str) -> tuple[str, str]:
    """Rank function: ``case``'s error, as (type name, message)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    try:
        if case == "wider-wire-by-default":  # comm_dtype None: the fp32 parameters' dtype
            fsdp2.fully_shard(model, reduce_policy=fsdp2.ReducePolicy(accumulate_dtype=BF16))
        elif case == "policy-after-custom-reduce-scatter":
            fsdp2.fully_shard(model[0])
            fsdp2.fully_shard(model)
            model[0].set_custom_reduce_scatter(_ReduceScatter())
            model.set_reduce_policy(BF16_WIRE)
        elif case == "custom-reduce-scatter-after-policy":
            fsdp2.fully_shard(model, reduce_policy=BF16_WIRE)
            model.set_custom_reduce_scatter(_ReduceScatter())
        elif case == "policy-not-a-policy":
            fsdp2.fully_shard(model)
            model.set_reduce_policy(torch.bfloat16)
        elif case == "backend-without-all-to-all":
            fsdp2.fully_shard(model, reduce_policy=BF16_WIRE)

            def refuse(*args: Any, **kwargs: Any) -> Any:  # what c10d's base Backend raises
                raise RuntimeError("Backend gloo does not support alltoall_base")

            saved, dist.all_to_all_single = dist.all_to_all_single, refuse
            try:
                model(torch.randn(2, 4)).sum().backward()
            finally:
                dist.all_to_all_single = saved
        else:
            raise AssertionError(case)
    except Exception as error:  # the error under test
        return type(error).__name__, str(error)
    return "no error", ""


ERRORS = {
    "wider-wire-by-default": (
        "ValueError",
        r"Sequential.*comm_dtype torch.float32 does not fit in accumulate_dtype torch.bfloat16",
    ),
    "policy-after-custom-reduce-scatter": (
        "ValueError",
        r"set_reduce_policy: Linear has a custom reduce-scatter .*use one or the other",
    ),
    "custom-reduce-scatter-after-policy": (
        "ValueError",
        r"set_custom_reduce_scatter: Sequential has a ReducePolicy .*set_reduce_policy\(None\)",
    ),
    "policy-not-a-policy": ("TypeError", r"set_reduce_policy expects a fsdp2.ReducePolicy"),
    "backend-without-all-to-all": (
        "RuntimeError",
        r"all-to-all of the gradients of the root \(Sequential\) cannot be issued: the process "
        r"group's backend 'gloo' has no all-to-all.*set_reduce_policy\(None\)",
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_input_errors(case: str) -> None:
    expected_type, pattern = ERRORS[case]
    for got_type, message in run_ranks(_provoke, 2, case):
        assert got_type == expected_type, (got_type, message)
        assert re.search(pattern, message, re.DOTALL), message


def _default_policy_with_custom_reduce_scatter() -> bool:
    model = nn.Linear(4, 4)
    fsdp2.fully_shard(model, reduce_policy=fsdp2.ReducePolicy())  # today's reduction
    model.set_custom_reduce_scatter(_ReduceScatter())
    model(torch.randn(2, 4)).sum().backward()
    return model.weight.grad is not None


def test_the_default_policy_leaves_room_for_a_custom_reduce_scatter() -> None:
    assert all(run_ranks(_default_policy_with_custom_reduce_scatter, 2))


# ------------------------------------------------------------------ the docs example

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "reduction.md"


def _exec_doc_example(source: str, filename: str) -> bool:
    """Rank function: run the docs example as a script (it asserts its own result)."""
    exec(compile(source, filename, "exec"), {"__name__": "__main__"})
    return True


def test_docs_example() -> None:
    """The runnable block of docs/reduction.md (the one that starts a process group)."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL)
    example = next(block for block in blocks if "init_process_group" in block)
    assert all(run_ranks(_exec_doc_example, 2, example, str(DOC)))
