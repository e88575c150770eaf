"""``fsdp2.plan_sharding``: predicted against measured memory, exact collectives, automatic
grouping, the budget, the CLI, and the errors.

The accuracy tests shard a small Llama with fsdp2, step it (two warm-up steps, one
measured) and compare rank 0's peak of live tensor bytes (``benchmarks.memory.StepProbe``,
as ``benchmarks/compare.py`` measures it) and the step's collectives
(``benchmarks.comm.CollectiveCounter``) with what the planner predicts from the same model
on the meta device. The cases are ``benchmarks/plan_accuracy.py``'s, made small.

When one fails, look first at the printed row: a peak off by one buffer size points at
the simulation's order of allocations in that phase (``fsdp2/plan/_simulate.py`` follows
the runtime step by step); a collective count off points at the schedule (prefetch,
``reshard_after_forward``); bytes off at ``fsdp2/plan/_layout.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import fsdp2
from benchmarks.plan_accuracy import (
    Case,
    compare,
    make_mesh,
    measure,
    measure_step,
    predict,
    run_fake,
)
from examples.llama import ModelArgs, Transformer
from examples.llama import loss_fn as llama_loss
from fsdp2.plan._layout import MeshShape, ParamInfo, group_layout

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOLERANCE = 0.10  # the bound; the cases here land within 0.1%

SMALL = {"n_layers": 2, "dim": 128}


def _check(rows: list[dict[str, Any]]) -> None:
    bad = [r for r in rows if abs(r["ratio"] - 1) > TOLERANCE or not r["collectives_exact"]]
    detail = "\n".join(
        f"{r['label']}: measured {r['measured_peak']}, predicted {r['predicted_peak']} "
        f"(ratio {r['ratio']:.4f}); collectives measured {r['measured_collectives']}, "
        f"predicted {r['predicted_collectives']}"
        for r in rows
    )
    assert not bad, detail


# -- accuracy: fake process group (one process, up to 1024 ranks) ---------------------------
FAKE_CASES = [
    Case("small-many", 64, True, n_layers=6),
    Case("small-many", 1024, True, n_layers=6),
    Case("bf16", 64, True, **SMALL),
    Case("bf16", 1024, True, **SMALL),
    Case("large-few", 64, True, n_layers=2),  # 50 MB blocks: the CPU buffer pool, copy-out
    Case("no-reshard", 256, True, **SMALL),
    Case("grad-accum", 64, True, **SMALL),
    Case("cpu-offload", 1024, True, **SMALL),
    Case("bf16", 64, True, reshard=8, **SMALL),
    Case("small-many", 64, True, n_layers=6, checkpoint=True),
    Case("bf16", 256, True, replicate=4, **SMALL),
    Case("cpu-offload", 256, True, reshard=False, checkpoint=True, **SMALL),
]


@pytest.mark.parametrize("case", FAKE_CASES, ids=lambda c: c.label)
def test_predicted_peak_and_collectives_on_fake_ranks(case: Case) -> None:
    _check([run_fake(case)])


# -- accuracy: gloo ranks -------------------------------------------------------------------
def _measure_and_predict(cases: list[Case]) -> list[dict[str, Any]]:
    """In every rank: measure each case; rank 0 also predicts it and compares."""
    rank = dist.get_rank()
    rows = []
    for case in cases:
        mesh = make_mesh(case)  # on every rank: a 2-D mesh makes process groups
        measured = measure(case, rank, mesh)
        if rank == 0:
            rows.append(compare(case, measured, predict(case, mesh=mesh)))
    return rows


GLOO_CASES = {
    2: [
        Case("small-many", 2, False, n_layers=6),
        Case("bf16", 2, False, **SMALL),
        Case("large-few", 2, False, n_layers=2),
        Case("no-reshard", 2, False, **SMALL),
        Case("grad-accum", 2, False, **SMALL),
        Case("cpu-offload", 2, False, **SMALL),
        Case("bf16", 2, False, checkpoint=True, **SMALL),
    ],
    4: [
        Case("small-many", 4, False, n_layers=6),
        Case("bf16", 4, False, **SMALL),
        Case("no-reshard", 4, False, **SMALL),
        Case("bf16", 4, False, reshard=2, **SMALL),
        Case("bf16", 4, False, replicate=2, **SMALL),
        Case("cpu-offload", 4, False, checkpoint=True, **SMALL),
    ],
}


@pytest.mark.parametrize("world", sorted(GLOO_CASES))
def test_predicted_peak_and_collectives_on_gloo_ranks(run_ranks, world: int) -> None:
    rows = run_ranks(_measure_and_predict, world, GLOO_CASES[world], timeout=240)[0]
    _check(rows)


# -- layouts against the runtime's own buffers ------------------------------------------------
class _Uneven(nn.Module):
    """Rows not divisible by the world size, mixed dtypes, a frozen parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(13, 7)
        self.b = nn.Linear(7, 5, bias=False).to(torch.bfloat16)
        self.frozen = nn.Parameter(torch.ones(9, 3), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (
            self.b(self.a(x).to(torch.bfloat16)).float().sum(-1, keepdim=True) * self.frozen[0, 0]
        )


@contextmanager
def _fake_world(size: int) -> Iterator[None]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 3, 4])
@pytest.mark.parametrize("mp", [None, torch.bfloat16])
def test_layout_matches_the_runtime_group(world: int, mp: torch.dtype | None) -> None:
    """Every size the planner derives equals the attribute of a real ``ParamGroup``."""
    policy = fsdp2.MixedPrecisionPolicy(param_dtype=mp, reduce_dtype=mp and torch.float32)
    model = _Uneven()
    infos = [
        ParamInfo(i, n, tuple(p.shape), p.dtype, p.requires_grad)
        for i, (n, p) in enumerate(model.named_parameters())
    ]
    layout = group_layout(infos, MeshShape(world), policy)
    with _fake_world(world):
        fsdp2.fully_shard(model, mp_policy=policy)
        group = model._fsdp_state.groups[0]  # type: ignore[union-attr]
        assert layout.shard_bytes == group.flat_shard.numel() * group.flat_shard.element_size()
        assert layout.gather_numel == group.gather_numel
        assert layout.gather_itemsize == group.gather_dtype.itemsize
        assert layout.gather_in_place == group._gather_in_place
        assert layout.unsharded_bytes == group.unsharded_numel * group.gather_dtype.itemsize
        assert layout.reduce_flag_slack == group.reduce_flag_bytes
        positions = group.reduced_positions()
        reduce_dtype = group.reduce_dtype or torch.float32
        numel = group._packed_offsets(positions)[-1] + group.flag_numel(
            len(positions), reduce_dtype
        )
        # The divergence checks' fingerprint block ([Note: in-band fingerprints]).
        numel += group.fingerprint_block_numel(reduce_dtype, None)
        assert layout.reduce_numel == numel
        assert layout.tail_slack == group.tail_bytes


# -- grouping ---------------------------------------------------------------------------------
def _tiny_llama(layers: int = 8, dim: int = 64, vocab: int = 128, tie: bool = False) -> Transformer:
    with torch.device("meta"):
        return Transformer(
            ModelArgs(
                vocab_size=vocab,
                dim=dim,
                n_layers=layers,
                n_heads=4,
                max_seq_len=32,
                tie_embeddings=tie,
            )
        )


def _tokens(vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 16))


def _plan(model: nn.Module, tokens: torch.Tensor, **kw: Any) -> fsdp2.ShardingPlan:
    kw.setdefault("world_size", 8)
    kw.setdefault("device_type", "cpu")
    return fsdp2.plan_sharding(
        model, example_inputs=tokens, loss_fn=lambda out: llama_loss(out, tokens), **kw
    )


def test_auto_merges_small_blocks_within_the_peak_allowance() -> None:
    """Blocks of 209 KiB (fp32) below a 1 MiB merge size: merged into list groups of
    consecutive blocks, as many as the 5% peak allowance lets through (activations of 8
    sequences of 32 tokens dominate the peak)."""
    model, tokens = _tiny_llama(layers=16), torch.randint(0, 128, (8, 32))
    per_block = _plan(model, tokens, groups=[*model.layers, model])
    auto = _plan(model, tokens, min_group_bytes="1MiB")
    lists = [g for g in auto.groups if isinstance(g, tuple)]
    assert lists, auto.groups
    merged = [name for g in lists for name in g]
    assert merged == [f"layers.{i}" for i in range(16)]  # consecutive, in forward order
    assert auto.groups[-1] == ""
    assert len(auto.groups) < len(per_block.groups)
    assert auto.peak_bytes <= per_block.peak_bytes * 1.05
    collectives = sum(c for c, _ in auto.totals().values())
    assert collectives < sum(c for c, _ in per_block.totals().values())


def test_auto_keeps_one_group_per_large_block() -> None:
    """3.1 MiB blocks above a 1 MiB merge size stay one group each; the 128 KiB embedding
    and output head stay in the root's group."""
    model, tokens = _tiny_llama(layers=3, dim=256), _tokens()
    auto = _plan(model, tokens, min_group_bytes="1MiB")
    assert auto.groups == ["layers.0", "layers.1", "layers.2", ""]


def test_auto_takes_layers_that_differ_as_blocks() -> None:
    """A layer stack whose layers differ in their parameters (T5's first block holds the
    relative position bias, DeepSeek's first layers are dense where the rest are
    mixture-of-experts): each layer is still a block, not its projections. Here layer 0's
    feed-forward is twice as wide; before, the plan grouped q/k/v/o and w1/w2/w3 of the
    other layers instead ([Note: automatic grouping])."""
    from examples.llama import FeedForward

    model, tokens = _tiny_llama(layers=3, dim=256), _tokens()
    with torch.device("meta"):
        model.layers[0].feed_forward = FeedForward(256, 512)
    shapes = {tuple(p.shape for p in layer.parameters()) for layer in model.layers}
    assert len(shapes) == 2  # the layers really differ
    auto = _plan(model, tokens, min_group_bytes="1MiB")
    assert auto.groups == ["layers.0", "layers.1", "layers.2", ""]
    # The projections inside the layers are not groups of their own.
    assert not any("attention" in str(g) for g in auto.groups)


class _Stage(nn.Module):
    """A vision-style stage: a projection to its width, then repeated layers."""

    def __init__(self, width_in: int, width: int, depth: int) -> None:
        super().__init__()
        self.project = nn.Linear(width_in, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.project(x)
        for layer in self.layers:
            x = x + torch.relu(layer(x))
        return x


class _Staged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.ModuleList([_Stage(16, 32, 2), _Stage(32, 64, 3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            x = stage(x)
        return x


def test_auto_takes_the_layers_inside_stages_as_blocks() -> None:
    """Stages of different widths (ConvNeXt, Swin, ResNet) are one class in a layer
    stack, but each holds a stack of repeated layers: those are the blocks (finer units
    that merging can still join), not the stages."""
    with torch.device("meta"):
        model = _Staged()
    plan = fsdp2.plan_sharding(
        model, world_size=8, example_inputs=torch.randn(4, 16), device_type="cpu",
        min_group_bytes="1KiB",
    )  # fmt: skip
    layers = [f"stages.{s}.layers.{i}" for s, depth in ((0, 2), (1, 3)) for i in range(depth)]
    assert [g for g in plan.groups if "layers" in str(g)] == layers, plan.groups
    assert "stages.0" not in plan.groups and "stages.1" not in plan.groups, plan.groups


def test_auto_keeps_tied_parameters_in_one_group() -> None:
    """The tied embedding and output (4 MiB, above the merge size) get one group together;
    the plan applies and trains (fully_shard refuses a parameter in two groups)."""
    model, tokens = _tiny_llama(layers=2, vocab=4096, tie=True), _tokens(4096)
    plan = _plan(model, tokens, min_group_bytes="256KiB")
    holding = [g for g in plan.groups if "tok_embeddings" in (g if isinstance(g, tuple) else (g,))]
    assert len(holding) == 1 and "output" in holding[0], plan.groups
    with _fake_world(8):
        real = Transformer(model.args)
        plan.apply(real)
        llama_loss(real(tokens), tokens).backward()
        weight = real.tok_embeddings.weight
        assert real.output.weight is weight and weight.grad is not None


def test_auto_respects_ignored_params() -> None:
    model, tokens = _tiny_llama(layers=2), _tokens()
    plan = _plan(model, tokens, ignored_params={model.output.weight})
    assert plan.ignored_params == ("output.weight",)
    assert sum(g.num_params for g in plan.group_plans) == len(list(model.parameters())) - 1


# -- budget -----------------------------------------------------------------------------------
def test_budget_is_honoured_and_spent_on_fewer_all_gathers() -> None:
    model, tokens = _tiny_llama(layers=6), _tokens()
    default = _plan(model, tokens, groups=[*model.layers, model])
    budget = int(default.peak_bytes * 1.03)
    fitted = _plan(model, tokens, groups=[*model.layers, model], memory_budget=budget)
    assert fitted.peak_bytes <= budget
    kept = [g for g in fitted.group_plans if g.reshard_after_forward is False]
    assert len(kept) > 1  # the root, and blocks that keep their parameters for backward
    assert fitted.totals()["all_gather"][0] < default.totals()["all_gather"][0]
    # Applied, the measured peak stays within the budget (the prediction's accuracy).
    with _fake_world(8):
        real = Transformer(model.args)
        fitted.apply(real)
        measured = measure_step(real, [tokens])
    assert measured["peak_bytes"] <= budget, (measured["peak_bytes"], budget, fitted.peak_bytes)


def test_budget_below_every_plan_names_the_smallest_peak() -> None:
    model, tokens = _tiny_llama(layers=2), _tokens()
    with pytest.raises(
        ValueError,
        match=r"Transformer fits memory_budget=1\.00 MiB.*smallest "
        r"predicted peak is .* dominated by",
    ):
        _plan(model, tokens, memory_budget="1MiB")


def test_budget_string_forms() -> None:
    from fsdp2.plan._plan_sharding import parse_bytes

    assert parse_bytes("40GiB", "b") == 40 * 2**30
    assert parse_bytes("1.5 GB", "b") == 1_500_000_000
    assert parse_bytes("512mib", "b") == 512 * 2**20
    assert parse_bytes(123, "b") == 123
    with pytest.raises(ValueError, match="memory_budget='lots'"):
        parse_bytes("lots", "memory_budget")


# -- the model is left alone; nothing full is allocated ---------------------------------------
def test_planning_leaves_the_model_unchanged() -> None:
    torch.manual_seed(0)
    model = Transformer(ModelArgs(vocab_size=128, dim=64, n_layers=2, n_heads=4, max_seq_len=32))
    model.layers[0] = checkpoint_wrapper(model.layers[0])
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    buffers = {n: b for n, b in model.named_buffers()}
    hooks = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]
    tokens = _tokens()
    _plan(model, tokens)
    for n, p in model.named_parameters():
        assert p is before[n][0] and p.grad is None and torch.equal(p, before[n][1]), n
    assert {n: b for n, b in model.named_buffers()} == buffers
    assert [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()] == hooks
    assert not any(isinstance(m, fsdp2.FSDPModule) for m in model.modules())


_RSS_SCRIPT = """
import resource, torch, fsdp2
from torch import nn
model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(6)])  # 403 MB of fp32
x = torch.randn(4, 4096)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
plan = fsdp2.plan_sharding(model, world_size=1024, example_inputs=x)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) * 1024, plan.peak_bytes)
"""


def _run_python(*args: str) -> subprocess.CompletedProcess[str]:
    """``python *args`` in a fresh interpreter at the repository root; it must succeed."""
    out = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    return out


def test_planning_a_real_model_allocates_no_full_parameters() -> None:
    out = _run_python("-c", _RSS_SCRIPT)
    growth, _ = map(int, out.stdout.split())
    assert growth < 100 * 2**20, f"resident set grew {growth} bytes while planning"


def test_plans_1024_ranks_and_hsdp_without_a_process_group() -> None:
    assert not dist.is_initialized()
    model, tokens = _tiny_llama(layers=2), _tokens()
    plan = _plan(model, tokens, world_size=None, mesh=(4, 256))
    assert plan.world_size == 1024 and plan.mesh_shape == (4, 256)
    counts = {g.target: g.all_reduce_count for g in plan.group_plans}
    assert counts == dict.fromkeys(plan.groups, 1)  # one all-reduce per group per step
    assert not dist.is_initialized()


# -- output -----------------------------------------------------------------------------------
def test_report_to_dict_and_apply() -> None:
    model, tokens = _tiny_llama(layers=2), _tokens()
    plan = _plan(model, tokens, groups=["layers.0", "layers.1"])
    text = plan.report()
    for piece in ("Assumptions:", "Predicted peak per rank", "layers.0", "<root>", "all-gather"):
        assert piece in text
    data = json.loads(json.dumps(plan.to_dict()))
    assert [g["modules"] for g in data["groups"]] == [["layers.0"], ["layers.1"], [""]]
    assert data["peak_bytes"] == plan.peak_bytes
    assert sum(data["breakdown"].values()) == plan.peak_bytes
    with _fake_world(8):
        real = Transformer(model.args)
        plan.apply(real)
        for name in ("layers.0", "layers.1", ""):
            assert isinstance(real.get_submodule(name), fsdp2.FSDPModule)
        with pytest.raises(ValueError, match="the plan is for 8 ranks, the mesh has 4"):
            from torch.distributed.device_mesh import init_device_mesh

            plan.apply(Transformer(model.args), mesh=init_device_mesh("cpu", (4,)))


def test_cli_prints_the_report() -> None:
    out = _run_python(
        "-m", "fsdp2.plan", "benchmarks.plan_speed:llama_small", "--world-size", "16",
        "--batch", "2", "--seq", "16", "--mp", "bf16", "--groups", "auto",
    )  # fmt: skip
    assert "Predicted peak per rank" in out.stdout and "param_dtype bfloat16" in out.stdout


# -- errors -----------------------------------------------------------------------------------
def test_error_model_without_parameters() -> None:
    with pytest.raises(ValueError, match="Sequential has no parameters"):
        fsdp2.plan_sharding(nn.Sequential(nn.ReLU()), world_size=2)


def test_error_group_not_in_model() -> None:
    model = _tiny_llama(layers=2)
    with pytest.raises(ValueError, match=r"'layers\.7', which is not a submodule of Transformer"):
        fsdp2.plan_sharding(model, world_size=2, groups=["layers.7"])
    with pytest.raises(ValueError, match="Linear that is not a submodule of Transformer"):
        fsdp2.plan_sharding(model, world_size=2, groups=[nn.Linear(2, 2)])


def test_error_child_after_parent() -> None:
    model = _tiny_llama(layers=2)
    with pytest.raises(
        ValueError,
        match=r"lists 'layers\.0\.attention' \(Attention\) after its "
        r"parent 'layers\.0' \(TransformerBlock\)",
    ):
        fsdp2.plan_sharding(model, world_size=2, groups=["layers.0", "layers.0.attention"])


def test_error_container_whose_forward_never_runs() -> None:
    model, tokens = _tiny_llama(layers=2), _tokens()
    with pytest.raises(ValueError, match=r"forward of 'layers' \(ModuleList\) does not run"):
        _plan(model, tokens, groups=["layers"])


def test_error_inputs_the_forward_rejects_pass_through() -> None:
    model = Transformer(ModelArgs(vocab_size=128, dim=64, n_layers=1, n_heads=4, max_seq_len=32))
    bad = torch.zeros(2, 16)  # float token ids
    with pytest.raises(RuntimeError) as expected:
        model(bad)
    with pytest.raises(type(expected.value)) as got:
        fsdp2.plan_sharding(model, world_size=2, example_inputs=bad)
    # The fake kernel's wording of the same check (the dtype named another way).
    assert str(expected.value).split("but got")[0] in str(got.value)


@pytest.mark.parametrize("size", [0, -4])
def test_error_world_size_below_one(size: int) -> None:
    with pytest.raises(ValueError, match=f"world_size={size}.*at least 1"):
        fsdp2.plan_sharding(_tiny_llama(layers=1), world_size=size)


def test_error_reshard_int_not_dividing_the_shard_size() -> None:
    with pytest.raises(
        ValueError, match=r"reshard_after_forward=3.*divisor of the shard group size 8"
    ):
        fsdp2.plan_sharding(_tiny_llama(layers=1), world_size=8, reshard_after_forward=3)


def test_error_zero_dim_parameter_names_it() -> None:
    class Scalar(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(1.0))

    with pytest.raises(ValueError, match="parameter 'scale' is 0-dimensional"):
        fsdp2.plan_sharding(Scalar(), world_size=2)


def test_docs_example_runs() -> None:
    """The first ```python block of docs/planning.md runs as written (no process group)."""
    import pathlib
    import re

    doc = pathlib.Path(REPO) / "docs" / "planning.md"
    match = re.search(r"```python\n(.*?)```", doc.read_text(), re.DOTALL)
    assert match, f"no python block in {doc}"
    exec(compile(match.group(1), str(doc), "exec"), {"__name__": "docs_planning"})


def test_cpu_offload_from_an_accelerator_moves_state_to_host_memory() -> None:
    """Planned for CUDA with CPU offload, the shards, sharded gradients and optimizer
    state count in host memory, not in the device's peak."""
    model, tokens = _tiny_llama(layers=2), _tokens()
    kept = _plan(model, tokens, world_size=4, device_type="cuda")
    offloaded = _plan(
        model,
        tokens,
        world_size=4,
        device_type="cuda",
        offload_policy=fsdp2.CPUOffloadPolicy(pin_memory=False),
    )
    assert offloaded.breakdown["sharded_params"] == 0
    assert offloaded.breakdown["optimizer_state"] == 0
    assert kept.host_peak_bytes == 0
    host_state = kept.breakdown["sharded_params"] + kept.breakdown["optimizer_state"]
    assert offloaded.host_peak_bytes >= host_state
    assert offloaded.peak_bytes < kept.peak_bytes
    assert "host memory (CPU offload" in offloaded.report()
