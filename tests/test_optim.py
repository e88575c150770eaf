"""The optimizer fast path (``fsdp2/optim.py``): ``torch.optim`` optimizers step on the
plain local shards of fsdp2's parameters, bitwise equal to stepping on the ``DTensor``s.

What to look at first when a test fails:

* ``_compare`` lists every parameter or state tensor that differs, by name, between the
  fast path and the ``DTensor`` path (``set_optimizer_fast_path(False)``, torch's path),
  and between the fast path and the same optimizer stepping plain tensors that hold the
  same local shards and gradients (``_plain_replay``). The second needs no ``DTensor``
  support, so it also covers what torch's ``DTensor`` path cannot run (fused SGD and
  Adagrad, Rprop);
* ``test_no_dtensor_dispatch_in_the_step`` counts the ops with a ``DTensor`` argument
  during ``step()``: zero on the fast path, thousands without it;
* the fallback tests check that optimizers that need whole tensors keep the ``DTensor``
  path (they dispatch ``DTensor`` ops and give torch's results).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _launcher import run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import fsdp2
from fsdp2 import optim as fsdp2_optim

STEPS = 3


class Net(nn.Module):
    """Three linears with dim-0 sizes 10, 10 and 5: at 4 ranks the shards are uneven and
    one rank holds no row of ``out`` (an empty local shard)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 10)
        self.hidden = nn.Linear(10, 10)
        self.out = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(torch.relu(self.inp(x)))))


def _net(mesh: Any = None, dtype: torch.dtype = torch.float32, **shard_kwargs: Any) -> Net:
    torch.manual_seed(0)
    model = Net().to(dtype)
    fsdp2.fully_shard(model.hidden, mesh=mesh, **shard_kwargs)
    fsdp2.fully_shard(model.out, mesh=mesh, **shard_kwargs)
    fsdp2.fully_shard(model, mesh=mesh, **shard_kwargs)
    return model


def _batch(step: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(4, 6, generator=generator).to(dtype)


# name, optimizer class, keyword arguments: every flag the issue lists, on some optimizer.
CONFIGS: list[tuple[str, type, dict[str, Any]]] = [
    ("sgd", torch.optim.SGD, {"lr": 0.1}),
    (
        "sgd-nesterov",
        torch.optim.SGD,
        {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    ),
    (
        "sgd-maximize",
        torch.optim.SGD,
        {"lr": 0.1, "momentum": 0.5, "dampening": 0.1, "maximize": True},
    ),
    ("adam-amsgrad", torch.optim.Adam, {"lr": 0.01, "amsgrad": True, "weight_decay": 0.01}),
    ("adam-maximize", torch.optim.Adam, {"lr": 0.01, "maximize": True}),
    (
        "adam-decoupled",
        torch.optim.Adam,
        {"lr": 0.01, "decoupled_weight_decay": True, "weight_decay": 0.1},
    ),
    ("adamw", torch.optim.AdamW, {"lr": 0.01}),
    ("adamw-amsgrad", torch.optim.AdamW, {"lr": 0.01, "amsgrad": True, "weight_decay": 0.1}),
    (
        "adagrad",
        torch.optim.Adagrad,
        {"lr": 0.1, "lr_decay": 0.01, "weight_decay": 0.01, "initial_accumulator_value": 0.1},
    ),
    ("rmsprop", torch.optim.RMSprop, {"lr": 0.01}),
    (
        "rmsprop-centered",
        torch.optim.RMSprop,
        {"lr": 0.01, "centered": True, "momentum": 0.5, "weight_decay": 0.01},
    ),
    ("nadam", torch.optim.NAdam, {"lr": 0.01, "decoupled_weight_decay": True, "weight_decay": 0.1}),
    ("radam", torch.optim.RAdam, {"lr": 0.01, "decoupled_weight_decay": True, "weight_decay": 0.1}),
    ("adamax", torch.optim.Adamax, {"lr": 0.01, "weight_decay": 0.01}),
    ("adadelta", torch.optim.Adadelta, {"lr": 1.0, "weight_decay": 0.01, "maximize": True}),
    ("asgd", torch.optim.ASGD, {"lr": 0.01, "t0": 1.0, "weight_decay": 0.01}),
    ("rprop", torch.optim.Rprop, {"lr": 0.01}),
]
FUSED_ON_CPU = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad)


def _implementations(cls: type) -> list[dict[str, bool]]:
    """for-loop, foreach, and fused where torch has it on the CPU."""
    return [{"foreach": False}, {"foreach": True}] + (
        [{"fused": True}] if cls in FUSED_ON_CPU else []
    )


class _Run:
    """One training run of ``_net``: two parameter groups with different settings, a
    learning-rate schedule, and ``out``'s parameters added as a third group after the
    first step (with a new schedule); records what the plain replay needs."""

    def __init__(
        self,
        cls: type,
        kwargs: dict[str, Any],
        fast: bool,
        model: nn.Module | None = None,
        dtype: torch.dtype = torch.float32,
        microbatches: int = 1,
        inputs: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        fsdp2.set_optimizer_fast_path(fast)
        self.inputs = inputs or (lambda step: _batch(step, dtype))
        self.model = model if model is not None else _net(dtype=dtype)
        self.dtype = dtype
        self.microbatches = microbatches
        self.params = list(self.model.parameters())
        self.cls, self.kwargs = cls, kwargs
        self.initial = [p.to_local().clone() for p in self.params]
        self.grads: list[list[torch.Tensor | None]] = []
        self.optimizer, self.scheduler = _schedule(self.params, cls, kwargs, step=None)

    def train(self, steps: int = STEPS) -> _Run:
        for step in range(steps):
            for micro in range(self.microbatches):
                if self.microbatches > 1:  # accumulate without reducing, reduce at the last
                    self.model.set_requires_gradient_sync(micro == self.microbatches - 1)
                x = self.inputs(self.microbatches * step + micro)
                self.model(x).float().square().mean().backward()
            self.grads.append(
                [None if p.grad is None else p.grad.to_local().clone() for p in self.params]
            )
            self.optimizer.step()
            self.scheduler.step()
            self.model.zero_grad(set_to_none=True)
            self.optimizer, self.scheduler = _schedule(
                self.params, self.cls, self.kwargs, step, self.optimizer, self.scheduler
            )
        return self


def _schedule(
    params: list[Any],
    cls: type,
    kwargs: dict[str, Any],
    step: int | None,
    optimizer: Any = None,
    scheduler: Any = None,
) -> tuple[Any, Any]:
    """The optimizer and schedule of a run: built at ``step=None``; after step 0 the
    last two parameters (``out``'s) join as a new group and the schedule restarts."""

    def lr_lambda(s: int) -> float:
        return 0.8**s

    if step is None:
        kwargs = copy.deepcopy(kwargs)  # a tensor lr is the run's own: schedules fill_ it
        first, second = params[:2], params[2:4]
        optimizer = cls(first, **kwargs)
        optimizer.add_param_group({"params": second, "lr": kwargs["lr"] / 2})
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    if step == 0:
        optimizer.add_param_group({"params": params[4:], "lr": kwargs["lr"] * 0.3})
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    return optimizer, scheduler


def _plain_replay(
    run: _Run,
) -> tuple[list[torch.Tensor], torch.optim.Optimizer, list[nn.Parameter]]:
    """The same optimizer, groups and schedule on plain tensors holding the same local
    shards and gradients: what the fast path must compute, bitwise."""
    params = [nn.Parameter(t.clone()) for t in run.initial]
    optimizer, scheduler = _schedule(params, run.cls, run.kwargs, step=None)
    for step, grads in enumerate(run.grads):
        for param, grad in zip(params, grads):
            param.grad = grad
        optimizer.step()
        scheduler.step()
        for param in params:
            param.grad = None
        optimizer, scheduler = _schedule(params, run.cls, run.kwargs, step, optimizer, scheduler)
    return [p.detach() for p in params], optimizer, params


def _state_of(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[dict[str, Any]]:
    return [dict(optimizer.state[p]) if p in optimizer.state else {} for p in params]


def _compare(
    what: str,
    params_a: list[torch.Tensor],
    state_a: list[dict[str, Any]],
    params_b: list[torch.Tensor],
    state_b: list[dict[str, Any]],
) -> list[str]:
    """Every parameter and state entry that is not bitwise equal (local parts compared;
    ``DTensor`` state must have the same placements and shape on both sides when both are
    ``DTensor``s)."""
    bad = []
    for i, (a, b) in enumerate(zip(params_a, params_b)):
        a, b = _local(a), _local(b)
        if not torch.equal(a, b):
            bad.append(f"{what}: param {i} differs by {(a.float() - b.float()).abs().max():.3g}")
    for i, (sa, sb) in enumerate(zip(state_a, state_b)):
        if sa.keys() != sb.keys():
            bad.append(f"{what}: state {i} keys {sorted(sa)} vs {sorted(sb)}")
            continue
        for key in sa:
            va, vb = sa[key], sb[key]
            if isinstance(va, DTensor) and isinstance(vb, DTensor):
                if va.placements != vb.placements or va.shape != vb.shape:
                    bad.append(f"{what}: state {i}/{key} layouts differ")
            if isinstance(va, torch.Tensor) != isinstance(vb, torch.Tensor):
                bad.append(f"{what}: state {i}/{key} {type(va).__name__} vs {type(vb).__name__}")
            elif isinstance(va, torch.Tensor):
                if not torch.equal(_local(va), _local(vb)):
                    bad.append(f"{what}: state {i}/{key} differs")
            elif va != vb:
                bad.append(f"{what}: state {i}/{key} {va!r} vs {vb!r}")
    return bad


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to_local() if isinstance(t, DTensor) else t.detach()


def _check_state_is_dtensor(run: _Run) -> list[str]:
    """What users see: every state tensor of a parameter's shape is a ``DTensor`` of the
    parameter's placements, sharing memory with nothing but itself."""
    bad = []
    for i, param in enumerate(run.params):
        for key, value in run.optimizer.state.get(param, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                if not isinstance(value, DTensor):
                    bad.append(f"state {i}/{key} is a {type(value).__name__}")
                elif value.placements != param.placements or value.shape != param.shape:
                    bad.append(f"state {i}/{key} has placements {value.placements}")
    return bad


def rank_fast_path_matches(configs: list[tuple[str, type, dict[str, Any]]]) -> list[str]:
    bad: list[str] = []
    try:
        for name, cls, kwargs in configs:
            for impl in _implementations(cls):
                label = f"{name} {impl}"
                fast = _Run(cls, {**kwargs, **impl}, fast=True).train()
                bad += [f"{label}: {b}" for b in _check_state_is_dtensor(fast)]
                plain, plain_opt, plain_params = _plain_replay(fast)
                bad += _compare(
                    f"{label} vs plain",
                    fast.params,
                    _state_of(fast.optimizer, fast.params),
                    plain,
                    _state_of(plain_opt, plain_params),
                )
                try:
                    slow = _Run(cls, {**kwargs, **impl}, fast=False).train()
                except (NotImplementedError, RuntimeError) as error:
                    # torch's DTensor path lacks this kernel (fused SGD/Adagrad, Rprop's
                    # index_put_): the plain replay above is the reference.
                    bad += [] if _dtensor_unsupported(error) else [f"{label}: {error}"]
                    continue
                bad += _compare(
                    f"{label} vs DTensor path",
                    fast.params,
                    _state_of(fast.optimizer, fast.params),
                    slow.params,
                    _state_of(slow.optimizer, slow.params),
                )
    finally:
        fsdp2.set_optimizer_fast_path(True)
    return bad


def _dtensor_unsupported(error: Exception) -> bool:
    text = str(error)
    return "sharding strategy" in text or "placement changes are not supported" in text


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_optimizer_and_implementation_matches_bitwise(world_size: int) -> None:
    reports = run_ranks(rank_fast_path_matches, world_size, CONFIGS, timeout=600)
    for rank, bad in enumerate(reports):
        assert bad == [], f"rank {rank}: {bad[:10]}"


def _torch_optimizer_inputs() -> list[tuple[str, type, dict[str, Any]]]:
    """Every input torch's own optimizer tests use on the CPU (``optim_db``), for the
    optimizers the fast path takes: tensor learning rates, every flag combination torch
    checks. Inputs that make the step differentiable keep the ``DTensor`` path anyway."""
    common = pytest.importorskip("torch.testing._internal.common_optimizers")
    configs = []
    for info in common.optim_db:
        if info.optim_cls not in fsdp2_optim._ELEMENTWISE:
            continue
        inputs = info.optim_inputs_func(device="cpu", dtype=torch.float32)
        for i, optim_input in enumerate(inputs):
            kwargs = dict(optim_input.kwargs)
            if kwargs.get("differentiable") or kwargs.get("capturable"):
                continue
            kwargs.setdefault("lr", 0.01)  # _schedule scales the later groups' lr
            name = f"{info.optim_cls.__name__}[{i}: {optim_input.desc}]"
            configs.append((name, info.optim_cls, kwargs))
    return configs


def test_torch_optimizer_test_inputs_match_bitwise() -> None:
    """torch's own optimizer test inputs, at 2 ranks: the fast path against the plain
    replay and torch's ``DTensor`` path, every implementation."""
    configs = _torch_optimizer_inputs()
    assert len(configs) >= 60, [name for name, _, _ in configs]
    reports = run_ranks(rank_fast_path_matches, 2, configs, timeout=600)
    for rank, bad in enumerate(reports):
        assert bad == [], f"rank {rank}: {bad[:10]}"


def _fast_against_references(
    label: str, make: Callable[[bool], _Run], dtensor_path: bool = True
) -> list[str]:
    """Train with the fast path, then compare with the plain replay and (where torch's
    path supports it) with the same run on the ``DTensor`` path."""
    fast = make(True).train()
    bad = [f"{label}: {b}" for b in _check_state_is_dtensor(fast)]
    plain, plain_opt, plain_params = _plain_replay(fast)
    fast_state = _state_of(fast.optimizer, fast.params)
    bad += _compare(
        f"{label} vs plain", fast.params, fast_state, plain, _state_of(plain_opt, plain_params)
    )
    if dtensor_path:
        slow = make(False).train()
        bad += _compare(
            f"{label} vs DTensor path",
            fast.params,
            fast_state,
            slow.params,
            _state_of(slow.optimizer, slow.params),
        )
    return bad


POLICY_OPTIMIZERS = [
    (torch.optim.AdamW, {"lr": 0.01, "foreach": False}),
    (torch.optim.AdamW, {"lr": 0.01, "foreach": True}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "foreach": True}),
]


def rank_policies(variant: str) -> list[str]:
    """bf16 parameters, a bf16 compute policy, CPU offload and gradient accumulation."""
    from fsdp2 import CPUOffloadPolicy, MixedPrecisionPolicy

    dtype = torch.bfloat16 if variant == "bf16" else torch.float32
    shard_kwargs: dict[str, Any] = {
        "mixed_precision": {
            "mp_policy": MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            )
        },
        "offload": {"offload_policy": CPUOffloadPolicy(pin_memory=False)},
    }.get(variant, {})
    microbatches = 2 if variant == "grad_accum" else 1
    bad: list[str] = []
    try:
        for cls, kwargs in POLICY_OPTIMIZERS:

            def make(fast: bool, cls: type = cls, kwargs: dict[str, Any] = kwargs) -> _Run:
                model = _net(dtype=dtype, **shard_kwargs)
                return _Run(cls, kwargs, fast, model=model, dtype=dtype, microbatches=microbatches)

            bad += _fast_against_references(f"{variant} {cls.__name__} {kwargs}", make)
    finally:
        fsdp2.set_optimizer_fast_path(True)
    return bad


@pytest.mark.parametrize("variant", ["bf16", "mixed_precision", "offload", "grad_accum"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_dtypes_policies_and_accumulation_match_bitwise(variant: str, world_size: int) -> None:
    for rank, bad in enumerate(run_ranks(rank_policies, world_size, variant)):
        assert bad == [], f"rank {rank}: {bad[:10]}"


class DTensorOps(TorchDispatchMode):
    """Counts the ops that get a ``DTensor`` argument, and which tensors those were."""

    def __init__(self, watch: Sequence[torch.Tensor] = ()) -> None:
        super().__init__()
        self.count = 0
        self.ops: list[str] = []
        self.watch = {id(t) for t in watch}  # alive while active: ids are not reused
        self.touched = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        dtensors = [t for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, DTensor)]
        if dtensors:
            self.count += 1
            self.ops.append(str(func))
            self.touched |= any(id(t) in self.watch for t in dtensors)
        return func(*args, **(kwargs or {}))


def _tp_mlp() -> nn.Module:
    """FSDP over dp x TP over 2 ranks: colwise, rowwise (a TP-replicated bias), plain head."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))
    world = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, world["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fsdp2.fully_shard(model[0], mesh=world["dp"])
    fsdp2.fully_shard(model, mesh=world["dp"])
    return model


def _tp_batch(step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + dist.get_rank() // 2)
    return torch.randn(4, 8, generator=generator)


def rank_meshes(layout: str) -> list[str]:
    bad: list[str] = []
    try:
        for cls, kwargs in POLICY_OPTIMIZERS:

            def make(fast: bool, cls: type = cls, kwargs: dict[str, Any] = kwargs) -> _Run:
                if layout == "hsdp":
                    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
                    return _Run(cls, kwargs, fast, model=_net(mesh=mesh))
                return _Run(cls, kwargs, fast, model=_tp_mlp(), inputs=_tp_batch)

            bad += _fast_against_references(f"{layout} {cls.__name__} {kwargs}", make)
    finally:
        fsdp2.set_optimizer_fast_path(True)
    return bad


@pytest.mark.parametrize("layout", ["hsdp", "fsdp_tp"])
def test_hsdp_and_tensor_parallel_meshes_match_bitwise(layout: str) -> None:
    for rank, bad in enumerate(run_ranks(rank_meshes, 4, layout)):
        assert bad == [], f"rank {rank}: {bad[:10]}"


def _roots_run(fast: bool, foreach: bool) -> dict[str, Any]:
    """Two fsdp2 roots, a plain parameter and a replicated DTensor fsdp2 does not manage,
    in one AdamW: group 0 holds root ``a`` and the foreign DTensor (it keeps the DTensor
    path), group 1 root ``b`` and the plain parameter (fast)."""
    fsdp2.set_optimizer_fast_path(fast)
    a, b = _net(), _net()
    torch.manual_seed(1)
    plain = nn.Parameter(torch.randn(3))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    foreign = nn.Parameter(distribute_tensor(torch.randn(4), mesh, [Replicate()]))
    groups = [list(a.parameters()) + [foreign], list(b.parameters()) + [plain]]
    params = groups[0] + groups[1]
    initial = [_local(p).clone() for p in params]
    optimizer = torch.optim.AdamW(
        [{"params": groups[0]}, {"params": groups[1], "lr": 0.02}], lr=0.01, foreach=foreach
    )
    grads, counters = [], []
    for step in range(STEPS):
        x = _batch(step)
        (a(x).square().mean() + b(x).square().mean() + plain.square().sum()).backward()
        foreign.grad = distribute_tensor(torch.full((4,), 0.1 * (step + 1)), mesh, [Replicate()])
        grads.append([_local(p.grad).clone() for p in params])
        watch = [t for p in groups[1] for t in (p, p.grad) if isinstance(t, DTensor)]
        with DTensorOps(watch) as counter:
            optimizer.step()
        counters.append(counter)
        optimizer.zero_grad()
    return {
        "params": params,
        "state": _state_of(optimizer, params),
        "initial": initial,
        "grads": grads,
        "group_sizes": [len(g) for g in groups],
        "dispatches": sum(c.count for c in counters),
        "fast_group_dispatched": any(c.touched for c in counters),
    }


def _roots_replay(
    run: dict[str, Any], foreach: bool
) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    params = [nn.Parameter(t.clone()) for t in run["initial"]]
    n = run["group_sizes"][0]
    optimizer = torch.optim.AdamW(
        [{"params": params[:n]}, {"params": params[n:], "lr": 0.02}], lr=0.01, foreach=foreach
    )
    for grads in run["grads"]:
        for param, grad in zip(params, grads):
            param.grad = grad
        optimizer.step()
    return [p.detach() for p in params], _state_of(optimizer, params)


def rank_roots_plain_and_foreign() -> list[str]:
    bad: list[str] = []
    try:
        for foreach in (False, True):
            fast = _roots_run(True, foreach)
            replay = _roots_replay(fast, foreach)
            bad += _compare(f"foreach={foreach} vs plain", fast["params"], fast["state"], *replay)
            if fast["fast_group_dispatched"]:
                bad.append(
                    f"foreach={foreach}: the group without a foreign DTensor dispatched DTensor ops"
                )
            if not fast["dispatches"]:
                bad.append(f"foreach={foreach}: the foreign DTensor's group did not keep its path")
            if not foreach:  # torch's foreach cannot mix plain tensors and DTensors in a group
                slow = _roots_run(False, foreach)
                bad += _compare(
                    "DTensor path", fast["params"], fast["state"], slow["params"], slow["state"]
                )
    finally:
        fsdp2.set_optimizer_fast_path(True)
    return bad


@pytest.mark.parametrize("world_size", [2, 4])
def test_several_roots_plain_parameters_and_foreign_dtensors(world_size: int) -> None:
    for rank, bad in enumerate(run_ranks(rank_roots_plain_and_foreign, world_size)):
        assert bad == [], f"rank {rank}: {bad[:10]}"


COPIES = ("aten.copy_", "aten.clone", "aten._to_copy", "aten._foreach_copy_", "aten.cat")


class _Ops(TorchDispatchMode):
    """Every op dispatched while active (by name)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def rank_dispatches(cls: type, kwargs: dict[str, Any], fast: bool) -> dict[str, Any]:
    """DTensor dispatches and copies during the steps after the first, and whether the
    parameters' and state's local tensors are still the same memory."""
    fsdp2.set_optimizer_fast_path(fast)
    try:
        model = _net()
        optimizer = cls(model.parameters(), **kwargs)
        params = list(model.parameters())
        addresses = [p.to_local().data_ptr() for p in params]
        counts, copies = [], []
        for step in range(STEPS):
            model(_batch(step)).square().mean().backward()
            if step == 1:
                state_locals = {
                    (i, k): (v, v.to_local().data_ptr())
                    for i, p in enumerate(params)
                    for k, v in optimizer.state[p].items()
                    if isinstance(v, DTensor)
                }
            with DTensorOps() as counter, _Ops() as ops:
                optimizer.step()
            if step:
                counts.append(counter.count)
                copies += [op for op in ops.ops if op.startswith(COPIES)]
            optimizer.zero_grad()
        same_state = all(
            optimizer.state[params[i]][k] is value and value.to_local().data_ptr() == address
            for (i, k), (value, address) in state_locals.items()
        )
    finally:
        fsdp2.set_optimizer_fast_path(True)
    return {
        "dtensor_ops": counts,
        "copies": copies,
        "params_in_place": addresses == [p.to_local().data_ptr() for p in params],
        "state_in_place": same_state and bool(state_locals),
    }


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (torch.optim.AdamW, {"lr": 0.01, "foreach": False}),
        (torch.optim.AdamW, {"lr": 0.01, "foreach": True}),
        (torch.optim.AdamW, {"lr": 0.01, "fused": True}),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    ],
)
def test_no_dtensor_dispatch_in_the_step(cls: type, kwargs: dict[str, Any]) -> None:
    """The fast path dispatches no DTensor op and copies nothing (the same kernels run
    on the same memory); without it the same steps dispatch DTensor ops."""
    fast = run_ranks(rank_dispatches, 2, cls, kwargs, True)
    for rep in fast:
        assert rep["dtensor_ops"] == [0] * (STEPS - 1), rep["dtensor_ops"]
        assert rep["copies"] == [], rep["copies"]
        assert rep["params_in_place"] and rep["state_in_place"], rep
    slow = run_ranks(rank_dispatches, 2, cls, kwargs, False)
    assert all(min(rep["dtensor_ops"]) > 0 for rep in slow), slow[0]["dtensor_ops"]


def rank_state_dict_round_trip() -> list[str]:
    """``state_dict()`` after fast steps, loaded into a fresh optimizer of a fresh model
    holding the same parameters: both continue bitwise alike, and the state dict has the
    layout the DTensor path gives."""
    bad: list[str] = []
    for kwargs in ({"foreach": True}, {"foreach": False}, {"fused": True}):
        trained = _Run(torch.optim.AdamW, {"lr": 0.01, **kwargs}, fast=True).train()
        saved = copy.deepcopy(trained.optimizer.state_dict())
        fsdp2.set_optimizer_fast_path(False)
        slow = _Run(torch.optim.AdamW, {"lr": 0.01, **kwargs}, fast=False).train()
        fsdp2.set_optimizer_fast_path(True)
        bad += _compare_state_dicts(saved, slow.optimizer.state_dict())
        model = _net()
        model.load_state_dict(trained.model.state_dict())
        resumed = _Run(torch.optim.AdamW, {"lr": 0.01, **kwargs}, fast=True, model=model)
        resumed.optimizer.add_param_group({"params": resumed.params[4:], "lr": 0.003})
        resumed.scheduler = trained.scheduler.__class__(resumed.optimizer, lambda s: 0.8**s)
        resumed.optimizer.load_state_dict(saved)  # after the schedule, which sets lr
        resumed.scheduler.load_state_dict(trained.scheduler.state_dict())
        for run in (trained, resumed):
            for step in range(STEPS, STEPS + 2):
                run.model(_batch(step)).square().mean().backward()
                run.optimizer.step()
                run.scheduler.step()
                run.model.zero_grad()
        bad += _compare(
            f"{kwargs} resumed",
            trained.params,
            _state_of(trained.optimizer, trained.params),
            resumed.params,
            _state_of(resumed.optimizer, resumed.params),
        )
    return bad


def _compare_state_dicts(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    bad = [] if a["param_groups"] == b["param_groups"] else ["param_groups differ"]
    for key, state in a["state"].items():
        for name, value in state.items():
            other = b["state"][key][name]
            if type(value) is not type(other):
                bad.append(f"state {key}/{name}: {type(value).__name__} vs {type(other).__name__}")
            elif isinstance(value, DTensor) and (
                value.placements != other.placements
                or value.shape != other.shape
                or value.stride() != other.stride()
                or value.dtype != other.dtype
                or not torch.equal(value.to_local(), other.to_local())
            ):
                bad.append(f"state {key}/{name}: DTensors differ")
    return bad


@pytest.mark.parametrize("world_size", [1, 2])
def test_state_dict_round_trip(world_size: int) -> None:
    for rank, bad in enumerate(run_ranks(rank_state_dict_round_trip, world_size)):
        assert bad == [], f"rank {rank}: {bad[:10]}"


def _full_snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Every parameter and state value as a whole tensor (collective), by name."""
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, Any] = {n: p.full_tensor() for n, p in model.named_parameters()}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            full = value.full_tensor() if isinstance(value, DTensor) else value
            out[f"{names[id(param)]}/{key}"] = (
                full.clone() if isinstance(full, torch.Tensor) else full
            )
    return out


def _fresh_run(fast: bool) -> _Run:
    """A new model and optimizer with the groups a trained run has after its first step."""
    run = _Run(torch.optim.AdamW, {"lr": 0.01, "foreach": True}, fast=fast)
    run.optimizer.add_param_group({"params": run.params[4:], "lr": 0.003})
    return run


def rank_dcp_save(path: str) -> dict[str, Any] | None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    run = _Run(torch.optim.AdamW, {"lr": 0.01, "foreach": True}, fast=True).train()
    model_sd, optim_sd = get_state_dict(run.model, run.optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    snapshot = _full_snapshot(run.model, run.optimizer)
    return snapshot if dist.get_rank() == 0 else None


def rank_dcp_load_and_continue(path: str) -> dict[str, Any]:
    """Load the checkpoint (through the fast path's lazy state creation, which torch's
    ``get_state_dict`` triggers with a zero step), then continue on the fast path and on
    the DTensor path: the continuations must agree bitwise."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    results = {}
    try:
        for fast in (True, False):
            run = _fresh_run(fast)
            model_sd, optim_sd = get_state_dict(run.model, run.optimizer)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=path)
            set_state_dict(
                run.model, run.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd
            )
            loaded = _full_snapshot(run.model, run.optimizer)
            for step in range(STEPS, STEPS + 2):
                run.model(_batch(step)).square().mean().backward()
                run.optimizer.step()
                run.model.zero_grad()
            results[fast] = (loaded, _full_snapshot(run.model, run.optimizer))
    finally:
        fsdp2.set_optimizer_fast_path(True)
    return {"loaded": results[True][0], "fast": results[True][1], "dtensor_path": results[False][1]}


def _unequal_snapshots(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    if a.keys() != b.keys():
        return [f"keys differ: {sorted(a.keys() ^ b.keys())}"]
    return [
        key
        for key in a
        if not (
            torch.equal(a[key], b[key]) if isinstance(a[key], torch.Tensor) else a[key] == b[key]
        )
    ]


@pytest.mark.parametrize(("ws_save", "ws_load"), [(2, 4), (4, 2)])
def test_dcp_resume_at_another_world_size(ws_save: int, ws_load: int, tmp_path) -> None:
    saved = run_ranks(rank_dcp_save, ws_save, str(tmp_path))[0]
    for rank, rep in enumerate(run_ranks(rank_dcp_load_and_continue, ws_load, str(tmp_path))):
        assert _unequal_snapshots(rep["loaded"], saved) == [], f"rank {rank} lost state"
        assert _unequal_snapshots(rep["fast"], rep["dtensor_path"]) == [], f"rank {rank}"


def _layout_seen(optimizer: torch.optim.Optimizer) -> tuple[bool, bool]:
    """Whether every parameter, and every non-scalar state tensor, is a DTensor."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return (
        all(isinstance(p, DTensor) for p in params),
        all(isinstance(v, DTensor) for v in state if v.dim() > 0),
    )


def rank_hooks(fast: bool) -> dict[str, Any]:
    """Per-optimizer pre- and post-hooks and a global pre-hook registered after fsdp2's
    see the optimizer itself with DTensor parameters and state; a learning rate set in a
    pre-hook takes effect."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    fsdp2.set_optimizer_fast_path(fast)
    seen: list[tuple[Any, ...]] = []
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=True)

    def pre(opt: Any, args: Any, kwargs: Any) -> None:
        seen.append(("pre", opt is optimizer, *_layout_seen(opt), len(opt.state)))
        opt.param_groups[0]["lr"] = 0.02 + 0.01 * len(seen)

    def post(opt: Any, args: Any, kwargs: Any) -> None:
        # The state the step created lazily is already there, as DTensors.
        seen.append(("post", opt is optimizer, *_layout_seen(opt), len(opt.state)))

    def global_pre(opt: Any, args: Any, kwargs: Any) -> None:
        if opt is optimizer:
            seen.append(("global", *_layout_seen(opt)))

    handles = [
        optimizer.register_step_pre_hook(pre),
        optimizer.register_step_post_hook(post),
        register_optimizer_step_pre_hook(global_pre),
    ]
    try:
        for step in range(STEPS):
            model(_batch(step)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        for handle in handles:
            handle.remove()
        fsdp2.set_optimizer_fast_path(True)
    return {"seen": seen, "params": [p.to_local() for p in model.parameters()]}


def _scaled_run(fused: bool, fast: bool, unscale: bool) -> tuple[list[torch.Tensor], float]:
    """Three steps under ``torch.amp.GradScaler`` (fused: the scaler hands the step its
    scale and inf flag as optimizer attributes); step 1 has an inf on rank 0, so the
    scaler skips that step and halves its scale."""
    fsdp2.set_optimizer_fast_path(fast)
    model = _net()
    impl = {"fused": True} if fused else {"foreach": True}
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, **impl)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for step in range(3):
        x = _batch(step)
        if step == 1 and dist.get_rank() == 0:
            x[0, 0] = float("inf")
        scaler.scale(model(x).square().mean()).backward()
        if unscale:
            scaler.unscale_(optimizer)
            fsdp2.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    return [p.to_local().clone() for p in model.parameters()], scaler.get_scale()


def rank_grad_scaler() -> list[str]:
    bad = []
    try:
        for fused in (False, True):
            for unscale in (False, True):
                fast, fast_scale = _scaled_run(fused, True, unscale)
                slow, slow_scale = _scaled_run(fused, False, unscale)
                label = f"fused={fused} unscale={unscale}"
                if fast_scale != slow_scale or fast_scale != 2.0**9:
                    bad.append(f"{label}: scales {fast_scale} and {slow_scale}")
                bad += [f"{label}: param {i}" for i, (a, b) in enumerate(zip(fast, slow))
                        if not torch.equal(a, b)]  # fmt: skip
    finally:
        fsdp2.set_optimizer_fast_path(True)
    return bad


def test_grad_scaler_steps_match_the_dtensor_path() -> None:
    """AMP's ``GradScaler`` (``scale``, ``unscale_`` then clipping, ``step`` skipping a
    step with an inf, ``update``) on the fast path: bitwise the ``DTensor`` path's."""
    for rank, bad in enumerate(run_ranks(rank_grad_scaler, 2)):
        assert bad == [], f"rank {rank}: {bad}"


def test_hooks_see_the_optimizer_and_dtensors() -> None:
    fast, slow = run_ranks(rank_hooks, 2, True)[0], run_ranks(rank_hooks, 2, False)[0]
    n = len(list(Net().parameters()))
    assert fast["seen"][:3] == [
        ("global", True, True),
        ("pre", True, True, True, 0),
        ("post", True, True, True, n),
    ]
    assert fast["seen"] == slow["seen"]
    assert all(torch.equal(a, b) for a, b in zip(fast["params"], slow["params"]))


class SubclassedAdam(torch.optim.Adam):
    """A user's subclass: it could override anything, so it keeps the DTensor path."""


class RegisteredAdam(torch.optim.Adam):
    """The same, declared elementwise with ``register_elementwise_optimizer``."""


fsdp2_optim.register_elementwise_optimizer(RegisteredAdam)


def rank_fallback(kind: str, fast: bool) -> dict[str, Any]:
    fsdp2.set_optimizer_fast_path(fast)
    model = _net()
    if kind == "lbfgs_even":  # dim-0 sizes that 2 ranks divide: DTensor can flatten them
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 4))
        fsdp2.fully_shard(model)
    make = {
        "lbfgs_even": lambda: torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3),
        "lbfgs": lambda: torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3),
        "subclass": lambda: SubclassedAdam(model.parameters(), lr=0.01),
        "registered": lambda: RegisteredAdam(model.parameters(), lr=0.01),
        "closure": lambda: torch.optim.Adam(model.parameters(), lr=0.01, foreach=True),
        "differentiable": lambda: torch.optim.Adam(
            model.parameters(), lr=0.01, differentiable=True
        ),
    }[kind]
    optimizer = make()
    counts = []
    try:
        for step in range(STEPS):

            def closure(step: int = step) -> torch.Tensor:
                optimizer.zero_grad()
                loss = model(_batch(step)).square().mean()
                loss.backward()
                return loss

            with_closure = kind in ("lbfgs", "lbfgs_even", "closure")
            if not with_closure:
                closure()
            with DTensorOps() as counter:
                try:
                    optimizer.step(closure if with_closure else None)
                except RuntimeError as error:
                    return {"error": str(error)}
            counts.append(counter.count)
    finally:
        fsdp2.set_optimizer_fast_path(True)
    return {"dtensor_ops": counts, "params": [p.to_local() for p in model.parameters()]}


@pytest.mark.parametrize(
    "kind", ["lbfgs", "lbfgs_even", "subclass", "registered", "closure", "differentiable"]
)
def test_optimizers_that_are_not_elementwise_keep_the_dtensor_path(kind: str) -> None:
    """LBFGS (whole-tensor dot products) and unregistered subclasses keep the DTensor path:
    they dispatch DTensor ops and give the DTensor path's results. A registered class and
    a step with a closure (its backward's gradients are the ones stepped) take the fast
    path. ``differentiable=True`` keeps torch's path, and its error for leaf parameters."""
    fast = run_ranks(rank_fallback, 2, kind, True)[0]
    slow = run_ranks(rank_fallback, 2, kind, False)[0]
    if kind == "differentiable":
        assert fast == slow and "leaf Variable" in fast["error"], fast
        return
    if "error" in slow:  # LBFGS flattens each parameter: torch's DTensor path refuses
        assert kind == "lbfgs" and fast == slow, (fast, slow)  # uneven shards; so do we
        return
    assert all(torch.equal(a, b) for a, b in zip(fast["params"], slow["params"]))
    assert min(slow["dtensor_ops"]) > 0
    if kind in ("registered", "closure"):
        assert fast["dtensor_ops"] == [0] * STEPS, fast["dtensor_ops"]
    else:
        assert fast["dtensor_ops"] == slow["dtensor_ops"], (
            fast["dtensor_ops"],
            slow["dtensor_ops"],
        )


def _step_error(model: nn.Module, optimizer: torch.optim.Optimizer, step: int = 0) -> str:
    model(_batch(step)).square().mean().backward()
    try:
        optimizer.step()
    except RuntimeError as error:
        return str(error)
    finally:
        optimizer.zero_grad()
    return "no error"


def rank_bad_input() -> dict[str, str]:
    errors: dict[str, str] = {}
    # A full (non-sharded) optimizer state dict loaded with optimizer.load_state_dict.
    torch.manual_seed(0)
    plain = Net()
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=0.01)
    plain(_batch(0)).square().mean().backward()
    plain_optimizer.step()
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    optimizer.load_state_dict(plain_optimizer.state_dict())
    errors["plain_state"] = _step_error(model, optimizer)
    # A DTensor of another shape where the parameter's state belongs.
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    _step_error(model, optimizer)
    weight = model.hidden.weight
    optimizer.state[weight]["exp_avg"] = distribute_tensor(
        torch.zeros(4, 10), weight.device_mesh, weight.placements
    )
    errors["dtensor_shape"] = _step_error(model, optimizer, 1)
    # The local shard given other memory behind fsdp2's back.
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    _step_error(model, optimizer)
    with torch.no_grad():  # DTensor's local tensor: to_local() returns a view of it
        local = model.inp.weight._local_tensor
        local.data = local.clone()
    errors["moved"] = _step_error(model, optimizer, 1)
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    _step_error(model, optimizer)
    model.hidden.weight._local_tensor = model.hidden.weight._local_tensor.clone()
    errors["replaced"] = _step_error(model, optimizer, 1)
    model.hidden.weight._local_tensor = torch.zeros(3, 10)
    errors["replaced_shape"] = _step_error(model, optimizer, 2)
    try:
        fsdp2.set_optimizer_fast_path("off")  # type: ignore[arg-type]
        errors["switch"] = "no error"
    except TypeError as error:
        errors["switch"] = str(error)
    return errors


def test_bad_input_is_a_clear_error_on_every_rank() -> None:
    for errors in run_ranks(rank_bad_input, 2):
        assert "'inp.weight'" in errors["plain_state"], errors["plain_state"]
        assert "plain tensor of shape (10, 6)" in errors["plain_state"]
        assert "set_optimizer_state_dict" in errors["plain_state"]
        assert "'weight' (of a FSDPLinear)" in errors["dtensor_shape"], errors["dtensor_shape"]
        assert "DTensor of shape (4, 10)" in errors["dtensor_shape"]
        assert "'inp.weight'" in errors["moved"] and "other memory" in errors["moved"], errors[
            "moved"
        ]
        assert "copy_" in errors["moved"]
        assert "'weight' (of a FSDPLinear)" in errors["replaced"], errors["replaced"]
        assert "other memory" in errors["replaced"]
        assert "other memory" in errors["replaced_shape"], errors["replaced_shape"]
        assert "expects True or False" in errors["switch"]


def rank_switched(schedule: tuple[bool, ...], in_hook: bool) -> dict[str, Any]:
    """Steps on the paths ``schedule`` names (switched between steps, or by a pre-hook
    of the step itself)."""
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=True)
    if in_hook:
        optimizer.register_step_pre_hook(
            lambda *_: fsdp2.set_optimizer_fast_path(schedule[len(counts)])
        )
    counts: list[int] = []
    try:
        for step, fast in enumerate(schedule):
            if not in_hook:
                fsdp2.set_optimizer_fast_path(fast)
            model(_batch(step)).square().mean().backward()
            with DTensorOps() as counter:
                optimizer.step()
            counts.append(counter.count)
            optimizer.zero_grad()
    finally:
        fsdp2.set_optimizer_fast_path(True)
    return {
        "params": [p.to_local() for p in model.parameters()],
        "state": _state_of(optimizer, list(model.parameters())),
        "dispatched": [count > 0 for count in counts],
    }


def test_switching_between_steps_keeps_the_same_state() -> None:
    """Both paths keep the same state, so switching between steps (or in a pre-hook of
    a step, which applies from the next one) changes nothing but the speed."""
    fast = run_ranks(rank_switched, 2, (True,) * 4, False)[0]
    for schedule in ((False, True, False, True), (True, False, False, True)):
        for in_hook in (False, True):
            rep = run_ranks(rank_switched, 2, schedule, in_hook)[0]
            # In a hook, the switch applies from the next step (on at the start).
            paths = (True, *schedule[:-1]) if in_hook else schedule
            assert rep["dispatched"] == [not fast for fast in paths], (schedule, in_hook)
            assert (
                _compare("switched", rep["params"], rep["state"], fast["params"], fast["state"])
                == []
            )


_SWITCH_SCRIPT = """
import os
import fsdp2.optim as optim
first = optim.optimizer_fast_path_enabled()
os.environ["FSDP2_OPTIMIZER_FAST_PATH"] = "1"  # read once: later changes do nothing
print(first, optim.optimizer_fast_path_enabled())
"""


@pytest.mark.parametrize(
    ("value", "expected"),
    [("0", "False False"), ("off", "False False"), ("1", "True True"), (None, "True True")],
)
def test_environment_variable_is_read_once(value: str | None, expected: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != fsdp2_optim.ENV_VAR}
    if value is not None:
        env[fsdp2_optim.ENV_VAR] = value
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run(
        [sys.executable, "-c", _SWITCH_SCRIPT], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected


def test_bad_environment_value_names_the_variable() -> None:
    env = {**os.environ, fsdp2_optim.ENV_VAR: "maybe"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run(
        [sys.executable, "-c", _SWITCH_SCRIPT], env=env, capture_output=True, text=True
    )
    assert result.returncode != 0
    assert "FSDP2_OPTIMIZER_FAST_PATH='maybe'" in result.stderr, result.stderr


def test_register_elementwise_optimizer_checks_its_argument() -> None:
    with pytest.raises(TypeError, match="Optimizer subclass"):
        fsdp2_optim.register_elementwise_optimizer(object)  # type: ignore[arg-type]


def rank_state_replaced_between_steps(fast: bool) -> dict[str, Any]:
    """A state tensor the user replaces between steps (a reset of the moments) is the one
    the next step uses: the fast path keeps its view of the state only while the
    optimizer's state holds the same objects."""
    fsdp2.set_optimizer_fast_path(fast)
    try:
        model = _net()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=True)
        for step in range(STEPS):
            model(_batch(step)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            weight = model.hidden.weight
            state = optimizer.state[weight]
            state["exp_avg"] = torch.zeros_like(state["exp_avg"])
            if step == 1:
                optimizer.state[model.inp.weight] = {}  # forget one parameter's state
    finally:
        fsdp2.set_optimizer_fast_path(True)
    params = list(model.parameters())
    return {"params": [p.to_local() for p in params], "state": _state_of(optimizer, params)}


def test_state_replaced_between_steps_is_used() -> None:
    fast = run_ranks(rank_state_replaced_between_steps, 2, True)[0]
    slow = run_ranks(rank_state_replaced_between_steps, 2, False)[0]
    assert _compare("replaced", fast["params"], fast["state"], slow["params"], slow["state"]) == []


def test_docs_example() -> None:
    """docs/optimizer.md's first example, as written, on 2 ranks."""
    import pathlib

    from test_grad_accumulation import exec_doc_example, first_python_block

    doc = pathlib.Path(__file__).resolve().parent.parent / "docs" / "optimizer.md"
    assert all(run_ranks(exec_doc_example, 2, first_python_block(doc), str(doc)))


def rank_dropped_state_is_freed() -> dict[str, bool]:
    """State the optimizer drops (a load_state_dict, a reset) is freed at once: the fast
    path remembers state tensors only weakly, and the view of a step dies with it."""
    import gc
    import weakref

    gc.disable()  # freed by reference counting, not by a later collection
    try:
        run = _Run(torch.optim.AdamW, {"lr": 0.01, "foreach": True}, fast=True).train()
        optimizer = run.optimizer
        weight = run.model.hidden.weight
        # DTensor's own local tensors (to_local() would return a new view each time).
        old = weakref.ref(optimizer.state[weight]["exp_avg"]._local_tensor)
        optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        loaded = old() is None
        kept = weakref.ref(optimizer.state[run.params[0]]["exp_avg"]._local_tensor)
        reset = weakref.ref(optimizer.state[weight]["exp_avg_sq"]._local_tensor)
        optimizer.state[weight] = {}
        # Sanity: a tensor the optimizer still holds stays alive.
        return {"loaded": loaded, "reset": reset() is None, "alive": kept() is not None}
    finally:
        gc.enable()


def test_state_the_optimizer_drops_is_freed_at_once() -> None:
    assert run_ranks(rank_dropped_state_is_freed, 2)[0] == {
        "loaded": True,
        "reset": True,
        "alive": True,
    }
