"""The optimizer fast path under the training-loop patterns real code uses.

``tests/test_optim.py`` covers every optimizer, flag, implementation, dtype and mesh. This
file covers how training loops drive an optimizer: parameters passed by name, schedules
that change ``betas`` or ``momentum`` each step, tied weights, gradients zeroed in place,
two optimizers over one model, stepping twice on one gradient, a gradient missing on some
steps, a closure, and a post-hook that reads the new parameters. Each is what users of
torch's ``fully_shard``, HF Trainer, Lightning or torchtitan write, and each reaches the
step through another route (a group dict the scheduler mutates, a state the optimizer
creates lazily, a parameter seen twice through ``model.parameters()``...).

For each pattern the fast path must (a) take every fsdp2 parameter: no op with a
``DTensor`` argument inside ``step()``, and (b) give bitwise the parameters, state and
``state_dict()`` groups of the same loop on the ``DTensor`` path
(``set_optimizer_fast_path(False)``, torch's path). A failure names the pattern and the
parameter or state entry that differs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _launcher import run_ranks
from test_optim import DTensorOps
from torch import nn
from torch.distributed.tensor import DTensor

import fsdp2

STEPS = 4


class TiedLM(nn.Module):
    """An embedding whose weight is also the output head's (as in GPT-2 and Llama-style
    models with ``tie_word_embeddings``), around one sharded block."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.block = nn.Linear(8, 8)
        self.head = nn.Linear(8, 20, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.block(self.embed(tokens))))


def _model() -> TiedLM:
    torch.manual_seed(0)
    model = TiedLM()
    fsdp2.fully_shard(model.block)
    fsdp2.fully_shard(model)
    return model


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * step + dist.get_rank())
    tokens = torch.randint(0, 20, (4, 3), generator=generator)
    return model(tokens).square().mean()


class _Loop:
    """One pattern: how its optimizers are built, and what it does around each step."""

    def __init__(self, model: TiedLM) -> None:
        self.model = model
        self.params = list(model.parameters())  # the tied weight once
        self.optimizers: list[torch.optim.Optimizer] = []
        self.schedulers: list[Any] = []
        self.seen_by_hook: list[torch.Tensor] = []

    def backward(self, step: int) -> None:
        _loss(self.model, step).backward()

    def step(self, step: int) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def after(self, step: int) -> None:
        for scheduler in self.schedulers:
            scheduler.step()
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)


class NamedParameters(_Loop):
    """``AdamW(model.named_parameters())``: groups carry ``param_names`` (torch >= 2.5)."""

    def __init__(self, model: TiedLM) -> None:
        super().__init__(model)
        self.optimizers = [torch.optim.AdamW(model.named_parameters(), lr=0.01, foreach=True)]


class CycledBetas(_Loop):
    """OneCycleLR changes ``lr`` and ``betas`` (Adam) or ``momentum`` (SGD) in the groups
    every step, after the optimizer's state exists."""

    def __init__(self, model: TiedLM) -> None:
        super().__init__(model)
        adam = torch.optim.Adam(self.params[:2], lr=0.01, foreach=True)
        sgd = torch.optim.SGD(self.params[2:], lr=0.01, momentum=0.9, nesterov=True)
        self.optimizers = [adam, sgd]
        self.schedulers = [
            torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS + 1)
            for opt in self.optimizers
        ]


class ZeroedInPlace(_Loop):
    """``zero_grad(set_to_none=False)``: the next backward accumulates into zeroed
    gradients, which the step then reads."""

    def __init__(self, model: TiedLM) -> None:
        super().__init__(model)
        self.optimizers = [torch.optim.Adam(self.params, lr=0.01, weight_decay=0.1)]

    def after(self, step: int) -> None:
        self.optimizers[0].zero_grad(set_to_none=False)


class TwiceOnOneGradient(_Loop):
    """Two steps on the same gradients (as a loop that retries a step does)."""

    def __init__(self, model: TiedLM) -> None:
        super().__init__(model)
        self.optimizers = [torch.optim.RMSprop(self.params, lr=0.01, momentum=0.5, foreach=True)]

    def step(self, step: int) -> None:
        self.optimizers[0].step()
        self.optimizers[0].step()


class MissingGradient(_Loop):
    """The block's weight has no gradient on odd steps: the step skips it, and its state
    must not move."""

    def __init__(self, model: TiedLM) -> None:
        super().__init__(model)
        self.optimizers = [torch.optim.NAdam(self.params, lr=0.01, foreach=True)]

    def step(self, step: int) -> None:
        if step % 2:
            self.model.block.weight.grad = None
        self.optimizers[0].step()


class Closure(_Loop):
    """``step(closure)``: the closure's backward makes the gradients the step uses."""

    def __init__(self, model: TiedLM) -> None:
        super().__init__(model)
        self.optimizers = [torch.optim.SGD(self.params, lr=0.1, momentum=0.9)]

    def backward(self, step: int) -> None:
        pass

    def step(self, step: int) -> None:
        optimizer = self.optimizers[0]

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = _loss(self.model, step)
            loss.backward()
            return loss

        optimizer.step(closure)


class PostHookReadsParameters(_Loop):
    """A step post-hook keeping an average of the parameters (an EMA): it must see the
    parameters the step just wrote."""

    def __init__(self, model: TiedLM) -> None:
        super().__init__(model)
        self.optimizers = [torch.optim.AdamW(self.params, lr=0.01, foreach=True)]
        self.optimizers[0].register_step_post_hook(self._average)
        self.average: list[torch.Tensor] = []

    def _average(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        current = [p.to_local().detach().clone() for p in self.model.parameters()]
        if not self.average:
            self.average = current
        else:
            self.average = [0.9 * a + 0.1 * c for a, c in zip(self.average, current)]
        self.seen_by_hook = list(self.average)


PATTERNS: list[type[_Loop]] = [
    NamedParameters,
    CycledBetas,
    ZeroedInPlace,
    TwiceOnOneGradient,
    MissingGradient,
    Closure,
    PostHookReadsParameters,
]


def _train(pattern: type[_Loop], fast: bool) -> dict[str, Any]:
    fsdp2.set_optimizer_fast_path(fast)
    loop = pattern(_model())
    dispatches = 0
    for step in range(STEPS):
        loop.backward(step)
        with DTensorOps() as counter:
            loop.step(step)
        dispatches += counter.count
        loop.after(step)
    tensors = {f"param {i}": p.detach().to_local() for i, p in enumerate(loop.params)}
    groups = []
    for k, optimizer in enumerate(loop.optimizers):
        for i, param in enumerate(loop.params):
            for key, value in optimizer.state.get(param, {}).items():
                if isinstance(value, DTensor):
                    value = value.to_local()
                tensors[f"optimizer {k} state of param {i} / {key}"] = torch.as_tensor(value)
        groups.append(optimizer.state_dict()["param_groups"])
    for i, value in enumerate(loop.seen_by_hook):
        tensors[f"post-hook average {i}"] = value
    return {"tensors": tensors, "groups": groups, "dispatches": dispatches}


def rank_patterns() -> list[str]:
    bad: list[str] = []
    try:
        for pattern in PATTERNS:
            fast = _train(pattern, fast=True)
            slow = _train(pattern, fast=False)
            name = pattern.__name__
            if fast["dispatches"]:
                bad.append(f"{name}: {fast['dispatches']} DTensor ops inside step()")
            if not slow["dispatches"]:
                bad.append(f"{name}: the DTensor path dispatched nothing (the check is blind)")
            if fast["tensors"].keys() != slow["tensors"].keys():
                bad.append(
                    f"{name}: entries {sorted(fast['tensors'])} vs {sorted(slow['tensors'])}"
                )
            for key, value in fast["tensors"].items():
                other = slow["tensors"].get(key)
                if other is not None and not torch.equal(value, other):
                    bad.append(f"{name}: {key} differs from the DTensor path")
            if fast["groups"] != slow["groups"]:
                bad.append(f"{name}: state_dict() groups {fast['groups']} vs {slow['groups']}")
    finally:
        fsdp2.set_optimizer_fast_path(True)
    return bad


@pytest.mark.parametrize("world_size", [1, 2])
def test_training_loop_patterns_match_the_dtensor_path(world_size: int) -> None:
    for rank, bad in enumerate(run_ranks(rank_patterns, world_size, timeout=300)):
        assert bad == [], f"rank {rank}: {bad[:10]}"
