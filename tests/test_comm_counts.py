"""Collective counts per training step, and (fsdp2 only) zero-copy all-gather inputs.

Inside each rank, the collectives of ``torch.distributed`` are monkeypatched with counting
wrappers (``all_gather_single``/``all_gather_into_tensor``/``_all_gather_base`` count as
all-gathers, ``reduce_scatter_single``/``reduce_scatter_tensor``/``_reduce_scatter_base``
as reduce-scatters, plus ``all_reduce``), then the Llama model (``n_layers`` blocks wrapped
one by one, then the root) runs training steps; counts are kept per phase (forward,
backward, optimizer step). Implementations must look these functions up on the
``torch.distributed`` module at call time for the counts to be seen.

When a count test fails, look first at the per-phase table in the message: an extra
backward all-gather usually means a group was resharded after forward when it should not
have been (root with ``reshard_after_forward=None``/``False``), a missing one that the
group was never resharded; reduce-scatters must be exactly one per group with gradients.
Expected counts follow torch's documented semantics: ``None`` = ``True`` for non-root
modules and ``False`` for the root; an explicit ``True`` on the root reshards it as well.
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch
import torch.distributed as dist
from _helpers import (
    IMPLS,
    ParityCase,
    build_model,
    fsdp_groups,
    get_fully_shard,
    local_slice,
    loss_of,
    make_global_batch,
    make_mesh,
    make_optimizer,
    memory_regions,
    memory_span,
    require_impl,
)
from _launcher import run_ranks

import fsdp2._fingerprints as fingerprints

ALL_GATHERS = ("all_gather_single", "all_gather_into_tensor", "_all_gather_base")
REDUCE_SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base")
ALL_REDUCES = ("all_reduce",)


class _Recorder:
    def __init__(self) -> None:
        self.phase = "setup"
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.raw: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        # (phase, storage span, numel) of every all-gather input
        self.ag_inputs: list[tuple[str, tuple[int, int], int]] = []

    def wrap(self, name: str, kind: str, fn):
        def wrapper(*args, **kwargs):
            self.counts[self.phase][kind] += 1
            self.raw[self.phase][name] += 1
            if kind == "all_gather":
                inp = args[1] if len(args) > 1 else kwargs.get("input_tensor")
                if inp is None:
                    inp = kwargs.get("input")
                if inp is not None:
                    self.ag_inputs.append((self.phase, memory_span(inp), inp.numel()))
            return fn(*args, **kwargs)

        return wrapper


def _patch(rec: _Recorder) -> dict:
    originals = {}
    for names, kind in (
        (ALL_GATHERS, "all_gather"),
        (REDUCE_SCATTERS, "reduce_scatter"),
        (ALL_REDUCES, "all_reduce"),
    ):
        for name in names:
            fn = getattr(dist, name, None)
            if fn is not None:
                originals[name] = fn
                setattr(dist, name, rec.wrap(name, kind, fn))
    return originals


def _restore(originals: dict) -> None:
    for name, fn in originals.items():
        setattr(dist, name, fn)


def _wrap_llama(model, impl: str, mesh, block_raf, root_raf):
    fully_shard = get_fully_shard(impl)
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=block_raf)
    fully_shard(model, mesh=mesh, reshard_after_forward=root_raf)
    return model


def count_step_collectives(impl: str, n_layers: int, block_raf, root_raf, steps: int = 2):
    """Rank function: per step, the collective counts of forward/backward/optimizer."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    case = ParityCase(impl=impl, n_layers=n_layers)
    model = _wrap_llama(build_model(case), impl, make_mesh(), block_raf, root_raf)
    opt = make_optimizer(model, case.lr)
    rec = _Recorder()
    originals = _patch(rec)
    try:
        for step in range(steps):
            batch = local_slice(make_global_batch(case, step, ws), rank, case.local_batch)
            rec.phase = f"forward{step}"
            loss = loss_of(model, case, batch, step)
            rec.phase = f"backward{step}"
            loss.backward()
            rec.phase = f"optim{step}"
            opt.step()
            opt.zero_grad()
            rec.phase = "idle"
    finally:
        _restore(originals)
    return {
        "counts": {k: dict(v) for k, v in rec.counts.items()},
        "raw": {k: dict(v) for k, v in rec.raw.items()},
    }


def _table(result: dict) -> str:
    return "\n".join(f"  {phase:>10}: {result['raw'][phase]}" for phase in result["raw"])


L = 3  # blocks; the root is one more group

COUNT_CASES = {
    # name: (block reshard_after_forward, root reshard_after_forward, expected backward AGs)
    "default_none": (None, None, L),
    "blocks_true_root_default": (True, None, L),
    "all_true": (True, True, L + 1),
    "all_false": (False, False, 0),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("variant", list(COUNT_CASES))
def test_collectives_per_step(impl: str, variant: str) -> None:
    require_impl(impl)
    block_raf, root_raf, bwd_ag = COUNT_CASES[variant]
    results = run_ranks(count_step_collectives, 2, impl, L, block_raf, root_raf)
    for rank, result in enumerate(results):
        c = result["counts"]
        where = f"[{impl}, {variant}, rank {rank}] per-phase calls:\n{_table(result)}\n"
        for step in range(2):
            fwd = c.get(f"forward{step}", {})
            bwd = c.get(f"backward{step}", {})
            optim = c.get(f"optim{step}", {})
            assert fwd.get("all_gather", 0) == L + 1, (
                f"{where}step {step}: expected {L + 1} forward all-gathers"
            )
            assert fwd.get("reduce_scatter", 0) == 0, f"{where}step {step}: RS in forward"
            assert bwd.get("all_gather", 0) == bwd_ag, (
                f"{where}step {step}: expected {bwd_ag} backward all-gathers"
            )
            assert bwd.get("reduce_scatter", 0) == L + 1, (
                f"{where}step {step}: expected {L + 1} backward reduce-scatters"
            )
            # fsdp2's lazy-init layout check ([Note: ranks that built different models])
            # goes to the backend directly: torch's counts, also in the first forward.
            assert fwd.get("all_reduce", 0) == 0, f"{where}step {step}: all-reduce used"
            assert bwd.get("all_reduce", 0) == 0, f"{where}step {step}: all-reduce used"
            assert not optim, f"{where}step {step}: collectives in the optimizer step"


def comm_debug_mode_first_step(impl: str) -> dict:
    """Rank function: what ``CommDebugMode`` (dispatcher-level) counts in the first
    forward and backward, lazy init included."""
    from torch.distributed.tensor.debug import CommDebugMode

    rank, ws = dist.get_rank(), dist.get_world_size()
    case = ParityCase(impl=impl, n_layers=L)
    model = _wrap_llama(build_model(case), impl, make_mesh(), None, None)
    batch = local_slice(make_global_batch(case, 0, ws), rank, case.local_batch)
    with CommDebugMode() as fwd:
        loss = loss_of(model, case, batch, 0)
    with CommDebugMode() as bwd:
        loss.backward()
    return {
        phase: {str(op).rsplit(".", 1)[-1]: n for op, n in mode.get_comm_counts().items()}
        for phase, mode in (("forward", fwd), ("backward", bwd))
    }


@pytest.mark.parametrize("impl", IMPLS)
def test_first_step_comm_debug_mode_counts(impl: str) -> None:
    """torch's own tests count collectives of the very first forward with CommDebugMode
    and expect all-gathers only; fsdp2's layout check at lazy init showed there as one
    extra all-reduce."""
    require_impl(impl)
    for counts in run_ranks(comm_debug_mode_first_step, 2, impl):
        assert counts["forward"] == {"_allgather_base_": L + 1}, counts
        assert counts["backward"] == {"_allgather_base_": L, "_reduce_scatter_base_": L + 1}, counts


def count_no_grad_forwards(impl: str, n_layers: int, block_raf, root_raf, calls: int = 3):
    """Rank function: all-gathers issued by each of ``calls`` forwards under
    ``torch.no_grad()`` in a row (an evaluation or generation loop), whether their outputs
    agree, and the same for a forward after a training step."""
    import torch

    rank, ws = dist.get_rank(), dist.get_world_size()
    case = ParityCase(impl=impl, n_layers=n_layers)
    model = _wrap_llama(build_model(case), impl, make_mesh(), block_raf, root_raf)
    opt = make_optimizer(model, case.lr)
    batch = local_slice(make_global_batch(case, 0, ws), rank, case.local_batch)
    rec = _Recorder()
    originals = _patch(rec)
    outputs = []
    try:
        for call in range(calls):
            rec.phase = f"eval{call}"
            with torch.no_grad():
                outputs.append(model(*batch))
        rec.phase = "train"
        loss_of(model, case, batch, 0).backward()
        opt.step()
        opt.zero_grad()
        rec.phase = "eval_after_step"
        with torch.no_grad():
            after = model(*batch)
    finally:
        _restore(originals)
    return {
        "all_gathers": [rec.counts[f"eval{c}"].get("all_gather", 0) for c in range(calls)],
        "after_step": rec.counts["eval_after_step"].get("all_gather", 0),
        "same_outputs": all(torch.equal(o, outputs[0]) for o in outputs),
        "changed_after_step": not torch.equal(after, outputs[0]),
        "raw": {k: dict(v) for k, v in rec.raw.items()},
    }


NO_GRAD_CASES = {
    # name: (block reshard_after_forward, root reshard_after_forward, all-gathers of a
    # repeated no_grad forward: the groups that reshard after forward gather again)
    "default_none": (None, None, L),
    "all_true": (True, True, L + 1),
    "all_false": (False, False, 0),
    "blocks_false_root_true": (False, True, 1),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("variant", list(NO_GRAD_CASES))
def test_no_grad_forwards_keep_what_reshard_after_forward_keeps(impl: str, variant: str) -> None:
    """Under ``torch.no_grad()`` each group reshards after forward exactly when its
    ``reshard_after_forward`` says so, as in training: a loop of no-grad forwards with
    ``reshard_after_forward=False`` gathers once (fsdp2 used to reshard every group after
    a no-grad forward, re-gathering every parameter at every call). A forward after an
    optimizer step still gathers the updated shards."""
    require_impl(impl)
    block_raf, root_raf, repeat = NO_GRAD_CASES[variant]
    for rank, res in enumerate(run_ranks(count_no_grad_forwards, 2, impl, L, block_raf, root_raf)):
        where = f"[{impl}, {variant}, rank {rank}] per-phase calls:\n{_table(res)}\n"
        assert res["all_gathers"] == [L + 1, repeat, repeat], where
        assert res["same_outputs"], f"{where}repeated no_grad forwards differ"
        assert res["changed_after_step"], f"{where}the forward after the step used old weights"
        assert res["after_step"] == L + 1, f"{where}forward after the optimizer step"


@pytest.mark.parametrize("impl", IMPLS)
def test_one_rank_issues_no_collectives(impl: str) -> None:
    """A shard group of one rank holds whole parameters: no all-gather, no reduce-scatter
    (torch issues none either). Parity with the non-sharded model is in test_parity."""
    require_impl(impl)
    (result,) = run_ranks(count_step_collectives, 1, impl, L, None, None)
    totals = collections.Counter()
    for phase in result["counts"].values():
        totals.update(phase)
    assert not totals, f"[{impl}] collectives at world size 1:\n{_table(result)}"


# ------------------------------------------------------------------ zero-copy all-gather


def all_gather_input_storage(impl: str, n_layers: int) -> dict:
    """Rank function: after a training step, for every FSDP group, the storages of its
    parameters' local shards vs. the storages of the all-gather inputs of that step."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    case = ParityCase(impl=impl, n_layers=n_layers)
    base = build_model(case)
    model = _wrap_llama(copy.deepcopy(base), impl, make_mesh(), True, True)
    opt = make_optimizer(model, case.lr)
    rec = _Recorder()
    originals = _patch(rec)
    try:
        for step in range(2):
            batch = local_slice(make_global_batch(case, step, ws), rank, case.local_batch)
            rec.phase = f"step{step}"
            loss_of(model, case, batch, step).backward()
            opt.step()
            opt.zero_grad()
    finally:
        _restore(originals)
    ag_spans = {span for phase, span, _ in rec.ag_inputs if phase == "step1"}
    groups = {}
    for gname, params in fsdp_groups(model, impl).items():
        groups[gname or "<root>"] = memory_regions([p for _, p in params])
    return {"ag_spans": sorted(ag_spans), "groups": groups, "n_all_gathers": len(rec.ag_inputs)}


def test_all_gather_input_is_flat_shard_view() -> None:
    """fsdp2 only: each group's sharded parameters are views into one flat shard buffer,
    and that buffer is what the all-gather sends (no copy-in)."""
    require_impl("fsdp2")
    results = run_ranks(all_gather_input_storage, 2, "fsdp2", L)
    for rank, res in enumerate(results):
        assert res["n_all_gathers"] > 0, f"rank {rank}: no all-gather was intercepted"
        assert len(res["groups"]) == L + 1, f"rank {rank}: groups {list(res['groups'])}"
        ag_spans = [tuple(span) for span in res["ag_spans"]]
        for gname, regions in res["groups"].items():
            assert regions, f"rank {rank}: group {gname} has no parameters"
            assert len(regions) == 1, (
                f"rank {rank}: group {gname}: parameters' local shards live in "
                f"{len(regions)} separate buffers (expected one flat shard buffer): {regions}"
            )
            span = tuple(regions[0])
            assert span in ag_spans, (
                f"rank {rank}: group {gname}: its flat shard buffer {span[0]:#x} was not the "
                f"input of any all-gather in the step (inputs: "
                f"{[hex(s[0]) for s in ag_spans]}): the all-gather copies in"
            )


def train_with_frozen_weights(impl: str, freeze_after_shard: bool, steps: int = 3) -> dict:
    """Rank function: three blocks of two ``Linear(32, 32)``, only the biases trained
    (frozen before or after ``fully_shard``), AdamW against a non-sharded copy on the same
    global batch. Returns the reduce-scatter output sizes per call and the largest
    parameter difference from the reference."""
    import torch
    from torch import nn

    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32)) for _ in range(3)]
    )

    def freeze(m: nn.Module) -> None:
        for name, p in m.named_parameters():
            if not name.endswith("bias"):
                p.requires_grad_(False)

    ref = copy.deepcopy(model)
    freeze(ref)
    if not freeze_after_shard:
        freeze(model)
    fully_shard = get_fully_shard(impl)
    for block in model:
        fully_shard(block, mesh=make_mesh())
    fully_shard(model, mesh=make_mesh())
    if freeze_after_shard:
        freeze(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    sizes: list[int] = []
    originals = {}
    for name in REDUCE_SCATTERS:
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        originals[name] = fn

        def counted(output, *args, _fn=fn, **kwargs):
            sizes.append(output.numel())
            return _fn(output, *args, **kwargs)

        setattr(dist, name, counted)
    try:
        for step in range(steps):
            g = torch.Generator().manual_seed(100 + step)
            batch = torch.randn(ws * 4, 32, generator=g)
            model(batch[rank * 4 : (rank + 1) * 4]).square().mean().backward()
            ref(batch).square().mean().backward()
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
    finally:
        _restore(originals)
    diff = max(
        (p.full_tensor() - r).abs().max().item()
        for p, r in zip(model.parameters(), ref.parameters(), strict=True)
    )
    return {"sizes": sizes, "diff": diff}


@pytest.mark.parametrize("freeze_after_shard", [False, True], ids=["frozen_first", "frozen_later"])
def test_reduce_scatter_carries_only_the_trainable_parameters(freeze_after_shard: bool) -> None:
    """Weights frozen (before or after ``fully_shard``), biases trained: each
    reduce-scatter carries the biases only, as torch's does, plus fsdp2's padded
    has-gradient flags (16 fp32 elements per rank, [Note: gradients some ranks lack]).
    Reducing every parameter up to the last trainable one sent the frozen weights too
    when they were frozen after sharding: 1056 gradient elements per rank instead of 32."""
    ours = run_ranks(train_with_frozen_weights, 2, "fsdp2", freeze_after_shard, timeout=60)
    theirs = run_ranks(train_with_frozen_weights, 2, "torch", freeze_after_shard, timeout=60)
    for report in ours + theirs:
        assert report["diff"] <= 1e-5, report
    # One fp32 flag per reduced parameter, padded to 64 bytes, then the divergence checks'
    # 64-byte fingerprint block ([Note: in-band fingerprints] in fsdp2/_fingerprints.py).
    flags = 16 + fingerprints.block_numel(torch.float32)
    assert [s - flags for s in ours[0]["sizes"]] == theirs[0]["sizes"], (ours[0], theirs[0])


def train_mixed_dtype_groups_frozen_in_between(hsdp: bool) -> float:
    """Rank function: blocks of fp32, fp64 and fp32 ``Linear`` layers (one mixed-dtype
    group each) with the fp64 weight and the first bias frozen after sharding, so the
    reduced parameters are not the first ones of the group; the bias is trained again
    from the third step. Returns the largest difference from a non-sharded copy."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    class Block(nn.Sequential):
        def forward(self, x):
            return self[2](self[1](self[0](x).double()).float())

    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    blocks = [Block(nn.Linear(8, 12), nn.Linear(12, 8), nn.Linear(8, 8)) for _ in range(2)]
    for block in blocks:
        block[1].double()
    model = nn.Sequential(*blocks)
    ref = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (2, ws // 2)) if hsdp else make_mesh()
    fsdp2_fully_shard = get_fully_shard("fsdp2")  # torch's groups take one dtype only
    for block in model:
        fsdp2_fully_shard(block, mesh=mesh)
    fsdp2_fully_shard(model, mesh=mesh)

    def set_trainable(m: nn.Module, bias: bool) -> None:
        for block in m:
            block[1].weight.requires_grad_(False)
            block[0].bias.requires_grad_(bias)

    opts = []
    for m in (model, ref):
        set_trainable(m, bias=False)
        opts.append(torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2))
    for step in range(3):
        if step == 2:
            for m, opt in zip((model, ref), opts):
                set_trainable(m, bias=True)
                opt.add_param_group({"params": [block[0].bias for block in m]})
        batch = torch.randn(ws * 4, 8, generator=torch.Generator().manual_seed(step))
        model(batch[rank * 4 : (rank + 1) * 4]).square().mean().backward()
        ref(batch).square().mean().backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return max(
        (p.full_tensor() - r).abs().max().item()
        for p, r in zip(model.parameters(), ref.parameters(), strict=True)
    )


@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp", "hsdp"])
def test_mixed_dtype_groups_with_frozen_parameters_in_between(hsdp: bool) -> None:
    """The packed reduce layout of [Note: reducing only the trainable parameters] where
    frozen parameters sit between trained ones of a mixed-dtype group (fp32 and fp64, so
    exact): every gradient lands on its own parameter, on 2 ranks and on 2 x 2 (HSDP)."""
    for diff in run_ranks(train_mixed_dtype_groups_frozen_in_between, 4 if hsdp else 2, hsdp):
        assert diff <= 1e-6, diff
