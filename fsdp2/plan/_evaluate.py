"""Evaluate candidate plans of one model: layouts, the trace, the simulated step.

A ``Planner`` holds what does not change between candidate groupings (the model's
metadata, the mesh, the policies, the optimizer's memory, the traces already taken) so
that automatic grouping can compare many plans for the cost of a simulation each.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fsdp2._policies import MixedPrecisionPolicy
from fsdp2.plan._layout import GroupLayout, MeshShape, group_layout, padded_rows, shard_shape
from fsdp2.plan._model import Group, ModelInfo, group_params
from fsdp2.plan._optimizer import OptimizerMemory, optimizer_memory
from fsdp2.plan._simulate import GroupSpec, SimResult, StepSimulation
from fsdp2.plan._trace import Trace, TraceEvent, trace_step

# A group's reshard_after_forward as planned: True, False, or an int (ranks per backward
# all-gather, 1 < n < shard size).
Reshard = bool | int


@dataclass
class Evaluation:
    groups: list[Group]
    reshard: list[Reshard]
    params: list[list[int]]  # per group: parameter indices
    layouts: list[GroupLayout]
    result: SimResult


class Planner:
    def __init__(
        self,
        info: ModelInfo,
        mesh: MeshShape,
        *,
        mp_policy: MixedPrecisionPolicy,
        offload: bool,
        optimizer: Callable[..., torch.optim.Optimizer] | None,
        example_inputs: Any,
        loss_fn: Callable[[Any], torch.Tensor] | None,
        ignored: set[int],
        microbatches: int,
        device: torch.device,
    ) -> None:
        self.info = info
        self.mesh = mesh
        self.mp_policy = mp_policy
        self.offload = offload
        self.example_inputs = example_inputs
        self.loss_fn = loss_fn
        self.ignored = ignored
        self.microbatches = microbatches
        self.device = device
        self._traces: dict[tuple[tuple[int, ...], tuple[int, ...]], Trace] = {}
        self._layouts: dict[tuple[int, ...], GroupLayout] = {}
        # Host memory holds the shards (and so the optimizer) when offloading from an
        # accelerator; on the CPU it is the same memory.
        self.offload_to_host = offload and mesh.device_type != "cpu"
        ws = mesh.shard
        for p in info.params:
            if p.index not in ignored:
                padded_rows(p, ws)  # a 0-dim parameter is refused here, by name
        shards = [
            (p.shape if p.index in ignored else shard_shape(p.shape, ws), p.dtype)
            for p in info.params
            if p.requires_grad
        ]
        # Fake tensors of a device type this build of torch lacks (CUDA on a CPU-only
        # build) abort the process in autograd: trace on the CPU then, and say so.
        self.trace_device = device if _can_fake(device) else torch.device("cpu")
        opt_device = torch.device("cpu") if offload else self.trace_device
        self.optimizer_memory: OptimizerMemory = optimizer_memory(
            optimizer,
            shards,
            opt_device,
            foreach=not offload and device.type != "cpu" and opt_device.type == "cpu",
        )

    # -- traces --------------------------------------------------------------------------
    def trace(self, groups: Sequence[Group], cast_inputs: Sequence[int]) -> Trace:
        """The traced step with hooks on the modules of ``groups`` (and the model), cast
        inputs at ``cast_inputs``; one trace per distinct set."""
        hooked = tuple(sorted({m for g in groups for m in g} | {0}))
        key = (hooked, tuple(sorted(cast_inputs)))
        if key not in self._traces:
            self._traces[key] = self._take_trace(hooked, key[1])
        return self._traces[key]

    def _take_trace(self, hooked: tuple[int, ...], cast: tuple[int, ...]) -> Trace:
        if self.example_inputs is None:
            return Trace()
        param_dtype = self.mp_policy.param_dtype
        compute = {
            p.index: param_dtype
            for p in self.info.params
            if param_dtype is not None and p.index not in self.ignored
        }
        casts = {m: param_dtype for m in cast if param_dtype is not None}
        if not self.mp_policy.cast_forward_inputs:
            casts = {}
        return trace_step(
            self.info.model,
            self.example_inputs,
            loss_fn=self.loss_fn,
            hooked=hooked,
            cast_inputs=casts,
            compute_dtype=compute,
            device=self.trace_device,
        )

    # -- one plan ------------------------------------------------------------------------
    def layout(self, params: Sequence[int]) -> GroupLayout:
        key = tuple(params)
        if key not in self._layouts:
            self._layouts[key] = group_layout(
                [self.info.params[p] for p in params],
                self.mesh,
                self.mp_policy,
                offload_to_host=self.offload_to_host,
            )
        return self._layouts[key]

    def evaluate(
        self,
        groups: Sequence[Group],
        reshard: Sequence[Reshard],
        *,
        trace: Trace | None = None,
        cast_inputs: Sequence[int] = (0,),
    ) -> Evaluation:
        params = group_params(self.info, groups, self.ignored)
        layouts = [self.layout(ps) for ps in params]
        trace = trace if trace is not None else self.trace(groups, cast_inputs)
        specs = []
        for group, layout, setting in zip(groups, layouts, reshard):
            size = 0 if isinstance(setting, bool) else int(setting)
            specs.append(GroupSpec(group, layout, bool(setting), size, 0 in group))
        param_group = {p: g for g, ps in enumerate(params) for p in ps}
        ignored = {
            p: self.info.params[p].numel * self.info.params[p].dtype.itemsize for p in self.ignored
        }
        sim = StepSimulation(
            specs,
            _events_for(trace, groups, params),
            self.mesh,
            param_group=param_group,
            ignored_params=ignored,
            optimizer=self.optimizer_memory,
            buffer_bytes=self.info.buffer_bytes,
            microbatches=self.microbatches,
            offload_to_host=self.offload_to_host,
        )
        return Evaluation(list(groups), list(reshard), params, layouts, sim.run())


def _can_fake(device: torch.device) -> bool:
    """Whether fake tensors of ``device`` can run forward and backward in this process."""
    if device.type == "cpu":
        return True
    backend = getattr(torch, device.type, None)
    is_available = getattr(backend, "is_available", None)
    return bool(is_available is not None and is_available())


def _events_for(trace: Trace, groups: Sequence[Group], params: Sequence[Sequence[int]]) -> Trace:
    """The trace itself, or without example inputs a stand-in that runs the groups in
    ``fully_shard`` order inside the root's forward, with no activation memory: the
    order of a model whose blocks run one after another. Each group's gradients appear
    during its backward; the root's at the start of backward."""
    if trace.traced:
        return trace
    events: list[TraceEvent] = []

    def add(kind: str, target: int, in_backward: bool = False, grad_inputs: bool = True) -> None:
        events.append(TraceEvent(kind, target, in_backward, 0, 0, 0, 0, grad_inputs))

    root = groups[-1][0]
    add("fwd_pre", root, grad_inputs=False)
    for g in groups[:-1]:
        for m in g:
            add("fwd_pre", m)
            add("fwd_post", m)
    add("fwd_post", root)
    add("bwd_pre", root, True)
    for p in params[-1]:
        add("grad", p, True)
    for g, ps in reversed(list(zip(groups[:-1], params[:-1]))):
        add("bwd_pre", g[-1], True)
        for p in ps:
            add("grad", p, True)
        for m in reversed(g):
            add("bwd_post", m, True)
    add("end", -1, True)
    return Trace(events, 0, 0, False, ())
