"""fsdp2 composed with pipeline parallelism (``torch.distributed.pipelining``).

torch's schedules recognise torch's own ``FSDPModule`` by ``isinstance`` and then run
every microbatch's backward without gradient sync or resharding, reducing once after the
last one (``perform_reduce_grad``). fsdp2's modules are not torch's class, so:

* with torch's ``PipelineStage`` (switching only the ``fully_shard`` import) a schedule
  drives them as plain modules: fsdp2's hooks reduce after every microbatch's backward.
  Correct (checked against the reference), but one reduce-scatter per group per
  microbatch, and not bitwise equal to torch with more than one data-parallel rank;
* with ``fsdp2.pipelining.PipelineStage`` they get torch's treatment: one reduce-scatter
  per group per step, and parameters and gradients bitwise equal to torch's
  ``fully_shard`` under the same schedule.

Every case trains a model of ``LAYERS`` MLP blocks split into pipeline stages on a
``("pp", "dp")`` mesh, each block and each stage module sharded over ``dp``, for
``STEPS`` steps of ``N_MB`` microbatches (so gradients accumulate across microbatches),
and compares with the unsharded, non-pipelined model trained on the global batch
(max abs diff <= 1e-5), after every step. If the bitwise comparison with torch fails
while the reference one passes, check the reduce-scatter count first: more than one per
group per step means the stage reduced per microbatch.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _control_helpers import CollectiveLog
from _helpers import require_impl
from _launcher import run_ranks
from torch import nn

DIM = 8
LAYERS = 8
N_MB = 4
MB_ROWS = 2
STEPS = 2
TOL = 1e-5


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(DIM, DIM)
        self.net2 = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(torch.relu(self.net1(x)))


def _model() -> nn.Sequential:
    torch.manual_seed(1234)
    return nn.Sequential(*[_Block() for _ in range(LAYERS)])


def _batch(step: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    rows = dp * N_MB * MB_ROWS
    return torch.randn(rows, DIM, generator=g), torch.randn(rows, DIM, generator=g)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _reference(dp: int) -> list[dict[str, torch.Tensor]]:
    """Per step: the gradients, then (key ``"param:<name>"``) the parameters after SGD."""
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(STEPS):
        x, y = _batch(step, dp)
        _mse(model(x), y).backward()
        record = {n: p.grad.clone() for n, p in model.named_parameters()}
        optim.step()
        optim.zero_grad()
        record |= {f"param:{n}": p.detach().clone() for n, p in model.named_parameters()}
        out.append(record)
    return out


def _train(impl: str, schedule_name: str, pp: int, dp: int) -> dict:
    """impl: "fsdp2" (fsdp2's PipelineStage), "fsdp2-plain" (fsdp2 modules in torch's
    PipelineStage) or "torch" (torch's fully_shard and PipelineStage)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import schedules
    from torch.distributed.tensor import DTensor

    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.pipelining import PipelineStage
    else:
        from fsdp2 import fully_shard

        if impl == "fsdp2":
            from fsdp2.pipelining import PipelineStage
        else:
            from torch.distributed.pipelining import PipelineStage
    mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    cls = getattr(schedules, schedule_name)
    single = issubclass(cls, schedules.PipelineScheduleSingle)
    n_stages = pp if single else 2 * pp
    stage_ids = [pp_rank] if single else [pp_rank, pp_rank + pp]  # looped placement
    per = LAYERS // n_stages
    model = _model()
    stages, subs = [], []
    for sid in stage_ids:
        sub = nn.Sequential(*[copy.deepcopy(model[sid * per + j]) for j in range(per)])
        for block in sub:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(sub, mesh=mesh["dp"])
        subs.append((sid, sub))
        stage = PipelineStage(sub, sid, n_stages, torch.device("cpu"), group=mesh["pp"].get_group())
        stages.append(stage)
    schedule = cls(stages[0] if single else stages, n_microbatches=N_MB, loss_fn=_mse)
    optim = torch.optim.SGD([p for _, s in subs for p in s.parameters()], lr=0.1)
    rows = N_MB * MB_ROWS
    out: dict = {"steps": [], "reduce_scatters": [], "unsharded_after_step": []}
    for step in range(STEPS):
        x, y = _batch(step, dp)
        x, y = x[dp_rank * rows : (dp_rank + 1) * rows], y[dp_rank * rows : (dp_rank + 1) * rows]
        kwargs = {"target": y} if any(s.is_last for s in stages) else {}
        args = (x,) if any(s.is_first for s in stages) else ()
        with CollectiveLog() as log:
            schedule.step(*args, **kwargs)
        out["reduce_scatters"].append(sum(c.kind == "RS" for c in log.calls))
        # Nothing may stay unsharded after the step: every parameter is a DTensor shard.
        out["unsharded_after_step"].append(
            [n for _, s in subs for n, p in s.named_parameters() if not isinstance(p, DTensor)]
        )
        grads = {}  # .clone(): on a 1-rank mesh full_tensor() returns the local tensor itself
        for sid, sub in subs:
            for name, p in sub.named_parameters():
                index, rest = name.split(".", 1)
                grads[f"{sid * per + int(index)}.{rest}"] = p.grad.full_tensor().clone()
        optim.step()
        optim.zero_grad()
        for sid, sub in subs:
            for name, p in sub.named_parameters():
                index, rest = name.split(".", 1)
                grads[f"param:{sid * per + int(index)}.{rest}"] = p.detach().full_tensor().clone()
        out["steps"].append(grads)
    return out


def _compare(schedule_name: str, pp: int, dp: int, impls: tuple[str, ...]) -> dict:
    results = {impl: _train(impl, schedule_name, pp, dp) for impl in impls}
    dist.barrier()
    reference = _reference(dp)
    report: dict = {}
    for impl, res in results.items():
        worst = 0.0
        for ours, ref in zip(res["steps"], reference):
            worst = max(worst, *((ours[k] - ref[k]).abs().max().item() for k in ours))
        report[impl] = {
            "ref_diff": worst,
            "reduce_scatters": res["reduce_scatters"],
            "unsharded": res["unsharded_after_step"],
        }
        if "torch" in results and impl != "torch":
            report[impl]["bitwise_torch"] = all(
                torch.equal(ours[k], theirs[k])
                for ours, theirs in zip(res["steps"], results["torch"]["steps"])
                for k in theirs
            )
    return report


def _check(reports: list[dict], impl: str, reduce_scatters: int) -> None:
    for rank, report in enumerate(reports):
        r = report[impl]
        assert r["ref_diff"] <= TOL, (rank, impl, r)
        assert r["unsharded"] == [[]] * STEPS, (rank, impl, r)
        assert r["reduce_scatters"] == [reduce_scatters] * STEPS, (rank, impl, r)
        if "bitwise_torch" in r:
            assert r["bitwise_torch"], (rank, impl, "differs from torch's fully_shard")


@pytest.mark.parametrize("schedule", ["ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B"])
def test_pp2_dp2_matches_torch_bitwise(schedule: str) -> None:
    """4 ranks, pp=2 x dp=2: fsdp2's PipelineStage reduces once per group per step and
    equals torch's fully_shard bitwise; fsdp2 modules in torch's PipelineStage are
    correct but reduce once per microbatch."""
    require_impl("torch")
    reports = run_ranks(_compare, 4, schedule, 2, 2, ("fsdp2", "torch", "fsdp2-plain"), timeout=120)
    groups = LAYERS // 2  # blocks per rank (the stage modules own no parameters)
    _check(reports, "torch", groups)
    _check(reports, "fsdp2", groups)
    for rank, report in enumerate(reports):
        r = report["fsdp2-plain"]
        assert r["ref_diff"] <= TOL, (rank, r)
        assert r["unsharded"] == [[]] * STEPS, (rank, r)
        # The first step also reduces (zeros) after the backward metadata inference.
        first, *rest = r["reduce_scatters"]
        assert rest == [groups * N_MB] * (STEPS - 1), (rank, r)
        assert groups * N_MB <= first <= groups * (N_MB + 1), (rank, r)


def test_pp2_dp1() -> None:
    """2 ranks, pp=2 x dp=1 (no collective is issued on one data-parallel rank)."""
    require_impl("torch")
    reports = run_ranks(_compare, 2, "Schedule1F1B", 2, 1, ("fsdp2", "torch"), timeout=120)
    _check(reports, "torch", 0)
    _check(reports, "fsdp2", 0)


def _reduce_through_torch_private_protocol(impl: str) -> dict:
    """Two microbatch backwards with gradient sync and resharding off, then exactly the
    calls torch's ``PipelineStage.perform_reduce_grad`` makes on a stage module it takes
    for torch's ``FSDPModule`` (which fsdp2's modules are wherever torch's names are
    pointed at fsdp2's): the setters back on, ``post_backward()`` on every entry of
    ``_fsdp_param_groups`` (torch 2.11: ``_fsdp_param_group``) of every state in
    ``_state_ctx.all_states``, then the root's
    ``_root_post_backward_final_callback()``."""
    from _helpers import get_fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    fully_shard = get_fully_shard(impl)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = nn.Sequential(*list(_model())[:3])
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_is_last_backward(False)
    model.set_reshard_after_backward(False)
    model.set_requires_gradient_sync(False)
    gen = torch.Generator().manual_seed(7 + dist.get_rank())
    for _ in range(2):
        model(torch.randn(MB_ROWS, DIM, generator=gen)).pow(2).sum().backward()
    model.set_is_last_backward(True)
    model.set_reshard_after_backward(True)
    model.set_requires_gradient_sync(True)
    with CollectiveLog() as log:
        state = fully_shard.state(model)
        for s in state._state_ctx.all_states:
            if hasattr(s, "_fsdp_param_groups"):  # torch 2.13
                groups = s._fsdp_param_groups
            else:  # torch 2.11's stage reads one optional group per state
                groups = [s._fsdp_param_group] if s._fsdp_param_group else []
            for group in groups:
                group.post_backward()
        state._root_post_backward_final_callback()
    return {
        "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()},
        "resharded": all(isinstance(p, DTensor) for p in model.parameters()),
        "reduce_scatters": sum(c.kind == "RS" for c in log.calls),
    }


def _private_protocol_both() -> dict:
    return {impl: _reduce_through_torch_private_protocol(impl) for impl in ("fsdp2", "torch")}


def test_torch_private_reduce_protocol_matches_torch() -> None:
    """torch's stage reduces an FSDP stage through torch-private state attributes; on
    fsdp2's state they reduce each group once and reshard, with torch's gradients."""
    require_impl("torch")
    for rank, report in enumerate(run_ranks(_private_protocol_both, 2, timeout=120)):
        ours, theirs = report["fsdp2"], report["torch"]
        assert ours["resharded"] and theirs["resharded"], rank
        # One per block (the stage module itself owns no parameters), as torch.
        assert ours["reduce_scatters"] == theirs["reduce_scatters"] == 3, (rank, ours, theirs)
        for name, grad in theirs["grads"].items():
            assert torch.equal(ours["grads"][name], grad), (rank, name)
