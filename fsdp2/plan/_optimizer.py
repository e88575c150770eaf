"""The optimizer's memory on one rank: its state and the temporaries of one step.

The optimizer steps the sharded parameters, so both scale with the local shards. They
depend on the optimizer's code (AdamW keeps two moments and a step count per parameter;
its single-tensor path makes a few temporaries of one parameter's size, its ``foreach``
path of all of them), so the planner runs it rather than assume: the given optimizer is
built on fake tensors of rank 0's shard shapes, with fake gradients, and stepped twice
under ``FakeTensorMode``. The first step creates the state (as the first training step
does); the second is the steady state that the plan predicts. No memory is allocated.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@dataclass(frozen=True)
class OptimizerMemory:
    state_bytes: int  # kept between steps (moments, step counts)
    step_temporary_bytes: int  # the most the step allocates on top of that at once


class _StepPeak(TorchDispatchMode):
    """Most bytes of storages created by the step's operators live at once."""

    def __init__(self, excluded: set[int]) -> None:
        super().__init__()
        self.excluded = excluded
        self.sizes: dict[int, int] = {}
        self.refs: dict[int, Any] = {}
        self.total = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided:
                storage = leaf.untyped_storage()
                key = storage._cdata
                if key in self.excluded or key in self.sizes:
                    continue
                self.sizes[key] = storage.nbytes()
                self.refs[key] = weakref.ref(storage, self._freer(key))
                self.total += self.sizes[key]
                self.peak = max(self.peak, self.total)
        return out

    def _freer(self, key: int) -> Callable[[Any], None]:
        def free(_: Any) -> None:
            self.total -= self.sizes.pop(key, 0)
            self.refs.pop(key, None)

        return free


def optimizer_memory(
    optimizer: Callable[..., torch.optim.Optimizer] | None,
    shards: Sequence[tuple[tuple[int, ...], torch.dtype]],
    device: torch.device,
    *,
    foreach: bool = False,
) -> OptimizerMemory:
    """State and step temporaries of ``optimizer(params)`` over parameters of the given
    local shapes and dtypes (those with gradients: the trainable ones). ``foreach``: the
    step is planned for an accelerator but run on fake CPU tensors, so a torch optimizer
    class is given ``foreach=True``, its default there (its temporaries cover every
    parameter at once)."""
    if optimizer is None or not shards:
        return OptimizerMemory(0, 0)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        params = [
            torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
            for shape, dtype in shards
        ]
        for p in params:
            p.grad = torch.empty_like(p)
        kwargs = {}
        if foreach and isinstance(optimizer, type):
            if "foreach" in inspect.signature(optimizer).parameters:
                kwargs["foreach"] = True
        try:
            opt = optimizer(params, **kwargs)
        except TypeError as exc:
            raise TypeError(
                f"plan_sharding: optimizer must be an optimizer class or a callable taking the "
                f"parameters (e.g. torch.optim.AdamW, or lambda ps: torch.optim.SGD(ps, lr=0.1)), "
                f"got {optimizer!r}: {exc}"
            ) from exc
        opt.step()  # creates the state, as the first training step does
        state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        kept = {t.untyped_storage()._cdata for t in [*params, *state]}
        kept |= {p.grad.untyped_storage()._cdata for p in params if p.grad is not None}
        state_bytes = sum(
            {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in state}.values()
        )
        probe = _StepPeak(kept)
        with probe:
            opt.step()
        return OptimizerMemory(state_bytes, probe.peak)
