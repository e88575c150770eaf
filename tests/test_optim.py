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

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _launcher import run_ranks
from torch import nn
from torch.distributed.tensor import DTensor

import fsdp2

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
    ) -> None:
        fsdp2.set_optimizer_fast_path(fast)
        self.model = model if model is not None else _net(dtype=dtype)
        self.dtype = dtype
        self.params = list(self.model.parameters())
        self.cls, self.kwargs = cls, kwargs
        self.initial = [p.to_local().clone() for p in self.params]
        self.grads: list[list[torch.Tensor | None]] = []
        self.optimizer, self.scheduler = _schedule(self.params, cls, kwargs, step=None)

    def train(self, steps: int = STEPS) -> _Run:
        for step in range(steps):
            self.model(_batch(step, self.dtype)).float().square().mean().backward()
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
