"""One forward and backward of the model without memory: live bytes between module events.

``trace_step`` runs the model once under torch's ``FakeTensorMode`` (tensors with shapes,
dtypes and devices but no data), so the model's own parameters are never read, written
or allocated: every parameter and buffer is bound to a fake tensor in its module's
``_parameters``/``_buffers`` for the forward and the backward (which may run the forward
again: activation checkpointing), as ``torch.func.functional_call`` binds them for a call,
and put back afterwards, the model left as it was (the same objects). A
``TorchDispatchMode`` counts the bytes of every storage an operator creates, by storage
(views and in-place results count once, as ``benchmarks/memory.py`` counts them), and
frees it when the storage dies.

What the trace records is what ``fully_shard`` does not own: saved activations, autograd
temporaries, the loss. Parameters, buffers and parameter gradients are left out of the
count: the simulation (``_simulate``) owns them. Each parameter gradient is dropped the
moment autograd stores it (a post-accumulate-grad hook), and recorded as an event, so the
simulation can hold it until the group's reduce-scatter, as the runtime does.

Module events are recorded the way the runtime's hooks see them ([Note: traced module
events]). Between two events, the trace keeps the most bytes that were live at once: the
simulation adds its own buffers to that to find the peak.

[Note: traced module events]
For each module that may become a group, the trace installs what ``fully_shard``
installs: a forward pre-hook that routes the inputs needing gradients through an
identity autograd node (its backward is the module's post-backward, when the gradients of
its inputs, and so of its parameters, are done) and a forward hook that registers a
gradient hook on the outputs (the module's pre-backward, when backward reaches them).
These nodes change which branch autograd runs first, and so when temporaries live, so the
same nodes must exist in the traced graph as in the sharded one; the final plan is traced
again with exactly its groups' modules when they differ from the candidates traced first.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from fsdp2._module_io import hook_first_gradient


@dataclass
class TraceEvent:
    """One event of the traced step. ``target`` is a module index (forward and backward
    events of a module) or a parameter index (``grad``)."""

    kind: str  # fwd_pre | fwd_post | bwd_pre | bwd_post | grad | end
    target: int
    in_backward: bool
    live: int  # bytes live when the event fired
    live_fwd: int  # of which allocated in forward (saved activations)
    # The most bytes live at once since the previous event (this one's live included),
    # and how many of those were allocated in forward.
    peak_before: int
    peak_before_fwd: int
    # fwd_pre: some input needed a gradient (the runtime then attaches its post-backward
    # node; a call without one is reduced by the final callback).
    grad_inputs: bool = False


@dataclass
class Trace:
    """The events of one traced step; empty when no example inputs were given."""

    events: list[TraceEvent] = field(default_factory=list)
    start_live: int = 0  # the example inputs
    end_live: int = 0  # what stays after backward (the inputs, the loss)
    traced: bool = False
    modules: tuple[int, ...] = ()  # the module indices that had hooks

    def forward_calls(self, module: int) -> int:
        return sum(1 for e in self.events if e.kind == "fwd_pre" and e.target == module)


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages created by operators, freed with their storage."""

    def __init__(self, excluded: set[int]) -> None:
        super().__init__()
        self.excluded = excluded  # storages owned elsewhere (fake parameters, buffers)
        self.sizes: dict[int, tuple[int, bool]] = {}  # storage -> (bytes, made in forward)
        self._refs: dict[int, Any] = {}
        self.in_forward = True
        self.total = 0
        self.total_fwd = 0
        self.peak = 0
        self.peak_fwd = 0

    def track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.excluded or key in self.sizes:
            return
        nbytes = storage.nbytes()
        self.sizes[key] = (nbytes, self.in_forward)
        self._refs[key] = weakref.ref(storage, self._freer(key))
        self._grow(nbytes, self.in_forward)

    def _freer(self, key: int) -> Callable[[Any], None]:
        def free(_: Any) -> None:
            entry = self.sizes.pop(key, None)
            self._refs.pop(key, None)
            if entry is not None:
                self._grow(-entry[0], entry[1])

        return free

    def _grow(self, delta: int, in_forward: bool) -> None:
        self.total += delta
        if in_forward:
            self.total_fwd += delta
        if self.total > self.peak:
            self.peak, self.peak_fwd = self.total, self.total_fwd

    def restart_segment(self) -> tuple[int, int]:
        """The peak since the last call (and its forward part); start a new segment."""
        out = (self.peak, self.peak_fwd)
        self.peak, self.peak_fwd = self.total, self.total_fwd
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                self.track(leaf)
        return out


class _Recorder:
    """Collects the events, closing a segment of the live-bytes count at each."""

    def __init__(self, live: _LiveBytes) -> None:
        self.live = live
        self.events: list[TraceEvent] = []
        self.in_backward = False

    def mark(self, kind: str, target: int) -> None:
        peak, peak_fwd = self.live.restart_segment()
        self.events.append(
            TraceEvent(
                kind,
                target,
                self.in_backward,
                self.live.total,
                self.live.total_fwd,
                peak,
                peak_fwd,
            )
        )


class _PostBackwardMark(torch.autograd.Function):
    """The identity node of [Note: traced module events]: its backward marks the
    module's post-backward."""

    @staticmethod
    def forward(ctx: Any, recorder: _Recorder, index: int, *inputs: torch.Tensor) -> Any:
        ctx.recorder, ctx.index = recorder, index
        return tuple(torch.ops.aten.alias(x) for x in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.recorder.mark("bwd_post", ctx.index)
        return (None, None, *grads)


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(obj)[0] if isinstance(x, torch.Tensor)]


def _install_hooks(
    modules: Sequence[tuple[int, nn.Module]],
    recorder: _Recorder,
    cast_inputs: dict[int, torch.dtype],
) -> list[Any]:
    """The pre- and post-forward hooks of [Note: traced module events] on ``modules``
    (index, module); ``cast_inputs``: modules whose floating inputs are cast, as
    ``MixedPrecisionPolicy.cast_forward_inputs`` does."""
    handles = []
    for index, module in modules:

        def pre(
            _m: nn.Module, args: Any, kwargs: Any, index: int = index
        ) -> tuple[Any, dict[str, Any]]:
            recorder.mark("fwd_pre", index)
            dtype = cast_inputs.get(index)
            if dtype is not None:
                cast = lambda x: x.to(dtype) if torch.is_floating_point(x) else x  # noqa: E731
                args, kwargs = tree_map(
                    lambda x: cast(x) if isinstance(x, torch.Tensor) else x, (args, kwargs)
                )
            if not torch.is_grad_enabled():
                return args, kwargs
            needing = list({id(x): x for x in _tensors((args, kwargs)) if x.requires_grad}.values())
            if not needing:
                return args, kwargs
            recorder.events[-1].grad_inputs = True
            aliases = _PostBackwardMark.apply(recorder, index, *needing)
            swap = dict(zip((id(x) for x in needing), aliases))
            return tree_map(
                lambda x: swap.get(id(x), x) if isinstance(x, torch.Tensor) else x,
                (args, kwargs),
            )

        def post(_m: nn.Module, _args: Any, output: Any, index: int = index) -> None:
            recorder.mark("fwd_post", index)
            if recorder.in_backward or not torch.is_grad_enabled():
                return
            # Where the runtime's pre-backward trigger fires (the same tensors).
            hook_first_gradient(output, lambda *_: recorder.mark("bwd_pre", index))

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True, prepend=True))
        handles.append(module.register_forward_hook(post))
    return handles


def _fake_like(
    mode: Any, t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None
) -> torch.Tensor:
    with mode:
        return torch.empty(t.shape, dtype=dtype or t.dtype, device=device)


def trace_step(
    model: nn.Module,
    example_inputs: Any,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    hooked: Sequence[int],
    cast_inputs: dict[int, torch.dtype],
    compute_dtype: dict[int, torch.dtype],
    device: torch.device,
) -> Trace:
    """Run one forward, ``loss_fn`` and backward of ``model`` on fake tensors and record
    the events of the modules at ``hooked`` (indices into ``model.modules()``).

    ``compute_dtype``: parameter index (in ``model.parameters()`` order) -> the dtype the
    sharded runtime computes with (the policy's ``param_dtype``). Errors the forward
    raises on the example inputs are passed through as they are, with a note.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    params = list(model.parameters())
    fake_params: dict[int, torch.Tensor] = {}
    for i, p in enumerate(params):
        leaf = _fake_like(fake, p, device, compute_dtype.get(i, p.dtype))
        fake_params[id(p)] = leaf.requires_grad_(p.requires_grad)
    fake_buffers = {id(b): _fake_like(fake, b, device) for b in model.buffers()}
    excluded = {t.untyped_storage()._cdata for t in [*fake_params.values(), *fake_buffers.values()]}
    args, kwargs = _as_call(example_inputs)
    args, kwargs = tree_map(
        lambda x: _fake_like(fake, x, device) if isinstance(x, torch.Tensor) else x,
        (args, kwargs),
    )
    live = _LiveBytes(excluded)
    recorder = _Recorder(live)
    modules = list(model.modules())
    index_of_param = {id(leaf): i for i, leaf in enumerate(fake_params.values())}

    def drop_grad(leaf: torch.Tensor) -> None:
        leaf.grad = None  # first: the simulation holds it from this event on
        recorder.mark("grad", index_of_param[id(leaf)])

    grad_hooks = [
        leaf.register_post_accumulate_grad_hook(drop_grad)
        for leaf in fake_params.values()
        if leaf.requires_grad
    ]
    handles = _install_hooks([(i, modules[i]) for i in hooked], recorder, cast_inputs)
    loss_fn = loss_fn or _sum_loss
    try:
        with _bound(model, {**fake_params, **fake_buffers}), fake, live:
            for x in _tensors((args, kwargs)):
                live.track(x)
            live.restart_segment()
            start_live = live.total
            try:
                output = model(*args, **kwargs)
            except Exception as exc:
                _note(
                    exc,
                    f"raised by the forward of {type(model).__name__} on the example "
                    f"inputs, traced by plan_sharding under FakeTensorMode",
                )
                raise
            loss = loss_fn(output)
            del output
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TypeError(
                    f"plan_sharding: loss_fn must return a one-element tensor for backward, "
                    f"got {type(loss).__name__}"
                    f"{f' of shape {tuple(loss.shape)}' if isinstance(loss, torch.Tensor) else ''}"
                    f" from the output of {type(model).__name__}."
                )
            if not loss.requires_grad:
                raise ValueError(
                    f"plan_sharding: the loss computed from {type(model).__name__}'s output "
                    f"does not require grad (no trainable parameter reaches it), so there is "
                    f"no backward to plan."
                )
            live.in_forward = False
            recorder.in_backward = True
            loss.backward()
            del loss
            recorder.mark("end", -1)
            end_live = live.total
    finally:
        for h in handles + grad_hooks:
            h.remove()
    return Trace(recorder.events, start_live, end_live, True, tuple(hooked))


@contextlib.contextmanager
def _bound(model: nn.Module, fakes: dict[int, torch.Tensor]) -> Iterator[None]:
    """Every parameter and buffer of ``model`` (by identity, so tied ones stay tied)
    replaced by its fake in its module's dict, and put back on exit."""
    saved: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for module in model.modules():
            tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
            for table in tables:
                for name, t in table.items():
                    if t is not None and id(t) in fakes:
                        saved.append((table, name, t))
                        table[name] = fakes[id(t)]
        yield
    finally:
        for table, name, t in reversed(saved):
            table[name] = t


def _sum_loss(output: Any) -> torch.Tensor:
    """The default loss: the sum of every floating-point output."""
    parts = [x.sum() for x in _tensors(output) if torch.is_floating_point(x)]
    if not parts:
        raise ValueError(
            "plan_sharding: the model's output holds no floating-point tensor to sum; pass "
            "loss_fn=lambda output: ... returning the scalar loss."
        )
    return torch.stack(parts).sum() if len(parts) > 1 else parts[0]


def _as_call(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``example_inputs`` as positional and keyword arguments: a tensor, a tuple or list
    (positional), a dict (keywords), or a ``(args, kwargs)`` pair."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        if (
            len(example_inputs) == 2
            and isinstance(example_inputs[0], (tuple, list))
            and isinstance(example_inputs[1], dict)
        ):
            return tuple(example_inputs[0]), dict(example_inputs[1])
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def _note(exc: BaseException, text: str) -> None:
    add_note = getattr(exc, "add_note", None)  # Python >= 3.11
    if add_note is not None:
        add_note(text)
