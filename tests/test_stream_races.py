"""fsdp2's accelerator stream ordering, checked on the CPU by ``_stream_sanitizer``.

CI has no GPU, and on the CPU fsdp2's streams are ``None``: the waits and events that keep
CUDA kernels on different streams apart never run there. ``stream_sanitizer()`` gives the
tree stand-in streams, so fsdp2 takes its CUDA branches, and checks every operator's
reads and writes against the waits issued so far (and every reuse of freed memory against
the caching allocator's per-stream pools). Each scenario trains three steps and must run
without a race; the mutation tests remove one wait at a time and must find one, so a
scenario that passes is known to be able to fail.

If a scenario fails, its message lists the races: the operator and stream, the buffer,
the conflicting access, and the fsdp2 frames that issued it.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _fuzz import Gathered
from _launcher import run_ranks
from _stream_sanitizer import stream_sanitizer
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

import fsdp2

DIM = 16


class Block(nn.Module):
    """Two linears whose second one a step may skip (an unused parameter)."""

    def __init__(self, use_checkpoint: bool, edit: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.extra = nn.Linear(DIM, DIM)
        self.use_checkpoint = use_checkpoint
        self.edit = edit

    def _body(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        if self.edit:  # an in-place change of the gathered weight (Embedding(max_norm))
            with torch.no_grad():
                self.lin.weight.mul_(0.999)
        y = torch.relu(self.lin(x))
        return y + self.extra(x) if use_extra else y

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        if self.use_checkpoint:
            return checkpoint(self._body, x, use_extra, use_reentrant=False)
        return self._body(x, use_extra)


class Net(nn.Module):
    def __init__(
        self, use_checkpoint: bool = False, single_weight: bool = False, edit_last: bool = False
    ) -> None:
        super().__init__()
        blocks: list[nn.Module] = [
            nn.Linear(DIM, DIM, bias=False)
            if single_weight
            else Block(use_checkpoint, edit=edit_last and i == 2)
            for i in range(3)
        ]
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(DIM, 4)

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, use_extra) if isinstance(block, Block) else torch.relu(block(x))
        return self.head(x)


class _AllGather:
    """A custom all-gather (``set_custom_all_gather``) with its own output buffers."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output: Any, input: Any, group: Any, async_op: bool = False) -> Any:
        call = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return call(output, input, group=group, async_op=async_op)


class _ReduceScatter(_AllGather):
    def __call__(  # type: ignore[override]
        self, output: Any, input: Any, group: Any, op: Any, async_op: bool = False
    ) -> Any:
        call = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return call(output, input, op=op, group=group, async_op=async_op)


SCENARIOS: dict[str, dict[str, Any]] = {
    "reshard": {},
    "no-reshard": {"reshard_after_forward": False},
    "reshard-to-2-of-4": {"reshard_after_forward": 2, "world_size": 4},
    "one-rank": {"world_size": 1},
    "in-place-gather": {"single_weight": True},
    "in-place-gather-to-2-of-4": {
        "single_weight": True,
        "reshard_after_forward": 2,
        "world_size": 4,
    },
    "accumulation": {"accumulate": "gradient_sync"},
    "accumulation-kept-unsharded": {"accumulate": "gradient_sync", "keep_after_backward": True},
    "deferred-reduction-as-in-pipelining": {"accumulate": "deferred"},
    "hsdp-deferred-reduction": {"accumulate": "deferred", "hsdp": True, "world_size": 4},
    "hsdp": {"hsdp": True, "world_size": 4},
    "hsdp-partial-sums": {"hsdp": True, "world_size": 4, "accumulate": "all_reduce"},
    "hsdp-hook-on-a-stream": {"hsdp": True, "world_size": 4, "all_reduce_hook": True},
    "bf16": {"bf16": True},
    "bf16-accumulation": {"bf16": True, "accumulate": "gradient_sync"},
    "explicit-prefetch": {"prefetch": True},
    "explicit-unshard": {"explicit": True},
    "post-optim-event": {"post_optim_event": True},
    "activation-checkpointing": {"use_checkpoint": True},
    "gradient-penalty": {"penalty": True},
    "gradient-penalty-no-reshard": {"penalty": True, "reshard_after_forward": False},
    "two-forwards": {"two_forwards": True},
    # The last block's post-forward reshard writes the change back into its shards on
    # the compute stream; its backward all-gather then reads them on the all-gather one.
    "in-place-change-written-back": {"edit_last": True},
    "eval-between-steps": {"eval": True},
    "unused-and-frozen": {"unused": True, "frozen": True},
    "grads-kept-and-clipped": {"keep_grads": True, "clip": True},
    "three-reductions-in-flight": {"max_reduces": 3},
    "custom-collectives": {"custom": True},
    "optimizer-in-backward": {"optimizer_in_backward": True},
    "teacher-sharing-the-comm-context": {"teacher": "shared"},
    "teacher-with-its-own-streams": {"teacher": "separate"},
    "state-dicts-after-eval": {"eval": True, "state_dicts": True, "reshard_after_forward": False},
    "step-on-a-user-stream": {"user_stream": 1},
    "first-step-on-a-user-stream": {"user_stream": 0, "reshard_after_forward": False},
    "user-stream-hsdp-accumulation": {
        "user_stream": 2,
        "hsdp": True,
        "world_size": 4,
        "accumulate": "all_reduce",
    },
    "extensions": {"extensions": True},
    # ReducePolicy: an all-to-all per group, summed on the reduce-scatter stream; HSDP
    # then exchanges and gathers over replicas on the all-reduce stream.
    "reduce-policy": {"reduce_policy": True},
    "reduce-policy-accumulation": {"reduce_policy": True, "accumulate": "gradient_sync"},
    "reduce-policy-three-in-flight": {"reduce_policy": True, "max_reduces": 3},
    "reduce-policy-hsdp": {"reduce_policy": True, "hsdp": True, "world_size": 4},
    "reduce-policy-hsdp-partial-sums": {
        "reduce_policy": True,
        "hsdp": True,
        "world_size": 4,
        "accumulate": "all_reduce",
    },
    "extensions-to-2-of-4": {"extensions": True, "reshard_after_forward": 2, "world_size": 4},
}


def _shard(model: Net, case: dict[str, Any]) -> None:
    kw: dict[str, Any] = {}
    if case.get("hsdp"):
        kw["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    if "reshard_after_forward" in case:
        kw["reshard_after_forward"] = case["reshard_after_forward"]
    if case.get("reduce_policy"):
        kw["reduce_policy"] = fsdp2.ReducePolicy(
            comm_dtype=torch.bfloat16, accumulate_dtype=torch.float32
        )
    if case.get("bf16"):
        kw["mp_policy"] = fsdp2.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    for block in model.blocks:
        fsdp2.fully_shard(block, **kw)
    fsdp2.fully_shard(model, **kw)


def _configure(model: Any, case: dict[str, Any], sanitizer: Any) -> None:
    blocks = list(model.blocks)
    if case.get("prefetch"):
        for first, second in itertools.pairwise(blocks):
            first.set_modules_to_forward_prefetch([second])
            second.set_modules_to_backward_prefetch([first])
    if case.get("keep_after_backward"):
        model.set_reshard_after_backward(False)
    if case.get("frozen"):
        blocks[1].lin.weight.requires_grad_(False)
    if case.get("max_reduces"):
        model.set_reduce_scatter_max_input_buffers(case["max_reduces"])
    if case.get("all_reduce_hook"):
        blocks[0].set_all_reduce_hook(lambda t: t.mul_(1.0), stream=sanitizer.module.Stream())
    if case.get("custom"):
        for module in [*blocks, model]:
            module.set_custom_all_gather(_AllGather())
            module.set_custom_reduce_scatter(_ReduceScatter())


def _loss(model: Any, case: dict[str, Any], step: int) -> torch.Tensor:
    x = torch.randn(4, DIM, requires_grad=bool(case.get("penalty")))
    loss = model(x, use_extra=not (case.get("unused") and step == 1)).pow(2).sum()
    if case.get("penalty"):
        (grad,) = torch.autograd.grad(loss, x, create_graph=True)
        loss = loss + grad.pow(2).sum()
    if case.get("two_forwards"):
        loss = loss + model(torch.randn(4, DIM)).sum()
    return loss


def rank_sanitized_training(case: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(0)
    model: Any = Net(
        case.get("use_checkpoint", False),
        case.get("single_weight", False),
        case.get("edit_last", False),
    )
    if case.get("extensions"):
        for block in model.blocks:
            block.lin.weight = nn.Parameter(Gathered(block.lin.weight.detach()))
    teacher: Any = Net() if case.get("teacher") else None
    with stream_sanitizer() as sanitizer:
        _shard(model, case)
        _configure(model, case, sanitizer)
        if teacher is not None:  # a second root (distillation, EMA) run before each step
            _shard(teacher, {})
            if case["teacher"] == "shared":
                fsdp2.share_comm_ctx([model, teacher])
        if case.get("optimizer_in_backward"):
            # One optimizer per parameter, stepped as soon as its reduced gradient lands.
            for param in model.parameters():
                one = torch.optim.AdamW([param], lr=0.1)
                param.register_post_accumulate_grad_hook(
                    lambda _, one=one: (one.step(), one.zero_grad())
                )
        optim = torch.optim.AdamW(model.parameters(), lr=0.1)
        for step in range(3):
            with _user_stream(sanitizer, case.get("user_stream") == step):
                _step(model, teacher, optim, case, sanitizer, step)
    return {"races": sanitizer.races, "by_stream": sanitizer.ops_by_stream}


@contextlib.contextmanager
def _user_stream(sanitizer: Any, enter: bool) -> Iterator[None]:
    """A whole step on a stream of the user's, entered and left the documented way (as
    CUDA graph warm-up does): the side stream waits for the current one first, and the
    current one waits for it after."""
    if not enter:
        yield
        return
    outer = sanitizer.current
    side = sanitizer.module.Stream()
    side.wait_stream(outer)
    with sanitizer.module.stream(side):
        yield
    outer.wait_stream(side)


def _step(model: Any, teacher: Any, optim: Any, case: dict, sanitizer: Any, step: int) -> None:
    microbatches = 2 if case.get("accumulate") else 1
    if case.get("explicit"):
        model.blocks[0].unshard(async_op=True).wait()
    if teacher is not None:
        with torch.no_grad():
            teacher(torch.randn(4, DIM))
    for micro in range(microbatches):
        last = micro == microbatches - 1
        if case.get("accumulate") == "gradient_sync":
            model.set_requires_gradient_sync(last)
        elif case.get("accumulate") == "all_reduce":
            model.set_requires_all_reduce(last)
        elif case.get("accumulate") == "deferred":  # as fsdp2.pipelining's stage does
            model.set_is_last_backward(False)
            model.set_reshard_after_backward(False)
            model.set_requires_gradient_sync(False)
        _loss(model, case, step).backward()
    if case.get("accumulate") == "deferred":
        model.set_is_last_backward(True)
        model.set_reshard_after_backward(True)
        model.set_requires_gradient_sync(True)
        model._fsdp_state.reduce_unsynced_grads()
    if case.get("clip"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optim.step()
    optim.zero_grad(set_to_none=not case.get("keep_grads"))
    if case.get("post_optim_event"):
        model.set_post_optim_event(sanitizer.current.record_event())
    if case.get("explicit"):  # right after the step: must wait for the optimizer
        model.blocks[1].unshard()
        model.blocks[2].unshard(async_op=True)
    if case.get("eval"):
        with torch.no_grad():
            model(torch.randn(2, DIM))
    if case.get("state_dicts") and step == 1:  # loaded back before the last step
        saved = {key: value.detach().clone() for key, value in model.state_dict().items()}
        model.load_state_dict(saved)
        fsdp2.load_full_state_dict(model, fsdp2.get_full_state_dict(model))


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_no_stream_races(name: str) -> None:
    case = SCENARIOS[name]
    reports = run_ranks(rank_sanitized_training, case.get("world_size", 2), case, timeout=180)
    races = [race for report in reports for race in report["races"]]
    assert not races, f"{len(races)} race(s) on the stand-in streams:\n" + "\n".join(races)
    by_stream = reports[0]["by_stream"]
    # Not vacuous: compute ran, and with more than one rank so did the all-gather and
    # reduce-scatter streams (at least two side streams).
    assert by_stream.get("compute", 0) > 100, by_stream
    if case.get("world_size", 2) > 1:
        assert sum(1 for name in by_stream if name != "compute") >= 2, by_stream


@contextlib.contextmanager
def _without(target: str) -> Iterator[None]:
    """Replace ``module:attr.path`` with a function that does nothing."""
    module_name, _, path = target.partition(":")
    owner: Any = importlib.import_module(module_name)
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    saved = getattr(owner, name)
    setattr(owner, name, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def rank_mutated_training(case: dict[str, Any], target: str) -> list[str]:
    with _without(target):
        return rank_sanitized_training(case)["races"]


MUTATIONS = {
    # The compute stream waits for the all-gather (and reduce-scatter) before reading.
    "collective-wait": ("reshard", "fsdp2._collectives:wait_event"),
    # The all-gather stream reuses memory only after the compute stream's last use.
    "release-event": (
        "in-place-gather",
        "fsdp2._comm_context:CommContext.order_all_gathers_after_compute",
    ),
    # The reduce-scatter reads gradients only after the compute stream wrote them.
    "reduce-scatter-after-compute": ("reshard", "fsdp2._grad_reduce:wait_stream"),
    # The first all-gather of a step reads shards only after the optimizer wrote them.
    "all-gather-after-optimizer": ("reshard", "fsdp2._state:wait_stream"),
    # ... or after the event given with set_post_optim_event.
    "post-optim-event": ("post-optim-event", "fsdp2._state:wait_event"),
    # An unshard() right after optimizer.step() waits for it too.
    "explicit-unshard-after-step": ("explicit-unshard", "fsdp2._all_gather:wait_stream"),
    # The all-gather stream waits for the events of the compute stream's last use of
    # its memory and (int reshard_after_forward) of the post-forward shard's copy.
    "all-gather-stream-events": ("reshard-to-2-of-4", "fsdp2._all_gather:wait_event"),
    # The next all-gather reads shards written back on the compute stream after it.
    "write-back-before-all-gather": (
        "in-place-change-written-back",
        "fsdp2._comm_context:CommContext.order_all_gathers_after_compute",
    ),
    # HSDP: the compute stream waits for the all-reduce's result.
    "hsdp-all-reduce": ("hsdp", "fsdp2._replica_sum:wait"),
    # HSDP: the all-reduce waits for the reduce-scatter's result (its event only).
    "hsdp-all-reduce-after-reduce-scatter": ("hsdp", "fsdp2._replica_sum:wait_event"),
    # ReducePolicy: the compute stream waits for the sum of the all-to-all's chunks.
    "reduce-policy-sum-before-use": ("reduce-policy", "fsdp2._grad_reduce:wait"),
    # ... and HSDP's exchange over replicas waits for that sum (its event only).
    "reduce-policy-replicas-after-sum": ("reduce-policy-hsdp", "fsdp2._replica_sum:wait_event"),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_a_missing_wait_is_a_race(name: str) -> None:
    scenario, target = MUTATIONS[name]
    case = SCENARIOS[scenario]
    reports = run_ranks(rank_mutated_training, case.get("world_size", 2), case, target)
    assert any(reports), f"removing {target} went unnoticed in scenario {scenario!r}"


# Fuzzer cases that between them cover every feature ``_fuzz.features`` names (a greedy
# cover of seeds 0-60, 3000-3060, 4000-4080, 6000-6060, 7000-7060, 7500-7560, 8000-8060):
# per-parameter meshes, extensions, meta loading, experts, shard dims, HSDP accumulation
# modes, explicit unshard/reshard between steps, discarded forwards, gradient penalties.
# 10193: ``unshard(async_op=True)`` of a module that step's forward skipped, and no
# backward (nothing needed a gradient), so the all-gather was still reading the shards
# when the optimizer wrote them (fixed: the optimizer's pre-step hook orders the compute
# stream after the all-gather stream).
FUZZ_SEEDS = [7048, 7547, 3056, 7039, 6021, 48, 7013, 7506, 4052, 8002, 10193]


@pytest.mark.parametrize("seed", FUZZ_SEEDS)
def test_fuzz_cases_have_no_stream_races(seed: int) -> None:
    from _fuzz import gen_case, run_sanitized

    case = gen_case(seed)
    reports = run_ranks(run_sanitized, case["ws"], case, timeout=180)
    races = [race for report in reports for race in report]
    assert not races, f"seed {seed}: {len(races)} race(s):\n" + "\n".join(races)
