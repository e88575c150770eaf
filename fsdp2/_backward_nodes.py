"""The autograd nodes that trigger a group's post-backward, and the claims they carry.

Each forward call of a sharded module routes the inputs that need grad through an
identity node (``PostBackward``); its backward runs once the gradients of all those
inputs, and so of the module's parameters, are done, and that is where the group reduces
its gradients. Each node is a claim on the group's post-backward: the group reduces when
every forward call counted since the last reset has had its backward, or its graph was
dropped without one.

The owner of the claims (``fsdp2._state.FSDPState``) is described by ``ClaimOwner``, so
that this module stays below the state in the import chain.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch


class ClaimOwner(Protocol):
    """What the nodes need of the state whose post-backward they trigger."""

    @property
    def tree(self) -> Any:  # TreeContext | None: counts the tree's live claims
        ...

    def current_forward(self) -> ForwardCall:
        """The forward call being recorded (made on first use)."""
        ...

    def return_claim(self, forward: ForwardCall) -> None:
        """A graph of ``forward`` was freed without its backward: uncount its call."""
        ...

    def post_backward(self) -> None:
        """Reduce and reshard once every counted call has had its backward."""
        ...


class ForwardCall:
    """One forward of a state (every module call of a list group): its claims not yet
    settled, its calls without a post-backward node, whether its backward has started, and
    the backward epoch its claims count in.

    [Note: forwards whose backward comes later]
    Several forwards may precede their backwards, each backward a separate call (pipeline
    schedules, microbatches forwarded together): ``loss1, loss2 = m(x1), m(x2)`` then
    ``loss2.backward()``, ``loss1.backward()``. The final callback of the first backward
    settles every call of the forwards that took part in it (reducing what they owe), but
    the calls of a forward whose pre-backward has not fired are still to come: their
    count is carried into the next backward, so a group of several modules (two claims per
    forward) is not resharded after its first module's backward while the other still
    needs the parameters."""

    __slots__ = ("epoch", "live", "opened", "untracked")

    def __init__(self, epoch: int, opened: bool = False) -> None:
        self.epoch = epoch
        self.live = 0  # claims (post-backward nodes) neither run nor released
        self.untracked = 0
        self.opened = opened


class PendingBackward:
    """One forward call's claim on its group's post-backward.

    The owner's ``post_backward`` reduces once every forward call it counted has had its
    backward. A forward whose graph is dropped without a backward (a validation loss
    computed with grad enabled, a forward for logging) must give its claim back, or the
    next training backward would hold every group unsharded until the final callback. The
    claim is returned when the graph's ``PostBackward`` node is freed without having run.
    """

    __slots__ = ("forward", "ran", "state", "tree")

    def __init__(self, state: ClaimOwner) -> None:
        self.state = state
        self.forward = state.current_forward()
        self.forward.live += 1
        self.ran = False
        self.tree = state.tree
        if self.tree is not None:
            self.tree.live_claims += 1

    def mark_ran(self) -> None:
        if not self.ran:
            self.ran = True
            self._settle()

    def release_unused(self) -> None:
        if self.ran:
            return
        self._settle()
        self.state.return_claim(self.forward)

    def _settle(self) -> None:
        self.forward.live -= 1
        if self.tree is not None:
            self.tree.live_claims = max(0, self.tree.live_claims - 1)


def _alias_inputs(inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    # Aliases with the inputs' exact strides: ``view_as`` (or returning the inputs, which
    # autograd turns into ``view_as``) recomputes the stride of a size-1 dim, and kernels
    # choose their path by strides (matmul folds a batch into one mm or not). A
    # checkpointed forward is recomputed without this node, so it would take another path
    # than the original forward and save tensors of other shapes.
    return tuple(torch.ops.aten.alias(x) for x in inputs)


def claim_node(ctx: Any, state: ClaimOwner) -> None:
    """Make the graph node ``ctx`` one forward call's claim on ``state``'s post-backward."""
    ctx.state = state
    ctx.claim = PendingBackward(state)
    # ``ctx`` is the graph node: it dies with the graph, backward or not.
    weakref.finalize(ctx, ctx.claim.release_unused).atexit = False


def _run_post_backward(ctx: Any, grads: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
    ctx.claim.mark_ran()
    ctx.state.post_backward()
    return (None, *grads)


class PostBackward(torch.autograd.Function):
    """Identity in forward; its backward is the group's post-backward hook.

    Written with ``setup_context``, a ``jvp`` (the identity on tangents) and a generated
    vmap rule, so that a sharded module also runs inside ``torch.func`` transforms such as
    ``torch.func.jvp``. Used only while such a transform is active; otherwise
    ``EagerPostBackward`` builds the same node for less.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(state: ClaimOwner, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _alias_inputs(inputs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        claim_node(ctx, inputs[0])

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        return _run_post_backward(ctx, grads)

    @staticmethod
    def jvp(ctx: Any, state_tangent: Any, *tangents: torch.Tensor) -> tuple[Any, ...]:
        return tangents


class EagerPostBackward(torch.autograd.Function):
    """``PostBackward`` without ``torch.func`` support, for the common case (no transform
    active): the same aliases, claim and backward, so the same graph.

    Why two classes: ``Function.apply`` on a Function that defines ``setup_context`` binds
    its arguments through ``inspect.signature`` on every call, about 30 us, twice what the
    rest of the node costs; once per forward call of every group that adds up. A Function
    whose ``forward`` takes ``ctx`` skips that, but cannot run under ``torch.func``.
    """

    @staticmethod
    def forward(ctx: Any, state: ClaimOwner, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        claim_node(ctx, state)
        return _alias_inputs(inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        return _run_post_backward(ctx, grads)
