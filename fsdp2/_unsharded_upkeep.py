"""Keeping a group's unsharded parameters consistent with its shards, and alive while a
graph needs them.

``UnshardedUpkeep`` is the part of ``ParamGroup`` (``_param_group``) that decides what
happens to gathered values outside the plain gather-compute-free cycle: shards updated
while the group stayed unsharded ([Note: stale unsharded parameters]), unsharded
parameters changed in place ([Note: in-place changes to unsharded parameters] in
``_param``), ``requires_grad`` changed on either copy while gathered ([Note:
requires_grad changed while gathered]), and unsharded parameters saved by the graph of a
``create_graph=True`` backward ([Note: backward that builds a graph]). The group's
buffers and layout are ``ParamGroup``'s; this module reads and registers them.

[Note: stale unsharded parameters]
A group that stays unsharded after its forward (``reshard_after_forward=False``, the root
by default, or ``unshard()`` called by the user) is normally resharded by its
post-backward, before the optimizer runs. Without a backward (the loss was discarded, a
forward with grad enabled for logging, a step whose outputs needed no gradient) it stays
unsharded through ``optimizer.step()``, which writes only the shards; the next forward
would find the group unsharded and compute with the old weights (torch's ``fully_shard``
does). So every all-gather records the flat shard it read and the version counters of it
and of the sharded parameters (an optimizer's in-place update bumps the ``DTensor``'s own
counter, not its local tensor's: one integer read per parameter per step), and the
root's pre-forward reshards any group whose shards changed since: its forward gathers the
current values. A sharded submodule called directly (outside the root's forward) checks
its own group the same way. Forwards without an update in between (several forwards then
one backward, eval loops) see the same version and keep their unsharded parameters. The
same holds for a kept post-forward share of ``reshard_after_forward=k``, and for a user's
``unshard()`` followed by an optimizer step: a forward always uses the current shards.
Resharding keeps the unsharded buffer's storage object (it is only emptied), so an older
graph that saved the unsharded parameters and still runs a backward sees the re-gathered
values.

[Note: requires_grad changed while gathered]
While a group is unsharded, its modules hold the unsharded parameters, so
``model.requires_grad_(...)`` (or ``p.requires_grad_()`` over ``model.parameters()``)
changes those, not the sharded ones the reduce-scatter packs by; code that kept the
sharded parameters from before (an optimizer's param groups) changes the others. An eval
forward leaves the root gathered (``reshard_after_forward=False``, the root's default), so
"evaluate, then unfreeze the layers and train" hit this: the gradients computed through the
unfrozen unsharded weights were dropped as frozen (torch's ``fully_shard`` fails
differently, with "element 0 of tensors does not require grad"). Each parameter remembers
the flag it was registered with; the root's pre-forward (through ``reshard_if_stale``) and
every reshard outside the hooks (``reshard()``, ``state_dict()``, ``module.to()``) give
both parameters the value of whichever side changed since (the module's, when both did).
The hooks' reshards skip it: their step began with the root's pre-forward. Cost: one flag
comparison per parameter of a gathered group at the root's pre-forward, nothing per hook.

[Note: backward that builds a graph]
A gradient penalty (WGAN-GP, R1), a physics-informed residual or a Jacobian term takes
gradients with ``torch.autograd.grad(..., create_graph=True)`` and then runs backward
through them. The graph of those gradients saves the unsharded parameters they were
computed with (``grad_x = grad_y @ W`` saves ``W``), and in the later backward its nodes
run in no fixed order relative to the groups' pre-backward hooks. Freeing the unsharded
storage at the end of the first backward, as torch's ``fully_shard`` does, breaks the
second ("setStorage ... out of bounds for storage of size 0"). So:

- A group gathered in a backward whose grad mode is on (autograd sets it to
  ``create_graph`` while it runs nodes and hooks) is *held*. Where the hooks would free
  it, they *park* it instead: the sharded parameters are registered on the modules again
  (so ``model.parameters()``, ``clip_grad_norm_`` and checkpoints see the sharded
  ``DTensor`` and its gradient, as after any backward) while the unsharded storage stays
  allocated for the graph. Its next unshard registers the kept parameters again without
  an all-gather, unless the shards changed meanwhile (then it gathers into the same
  storage, as above).
- While held, a group's gradients are reduced by the backward's final callback, not by its
  post-backward node: contributions through the saved parameters can arrive after that
  node ran. For a backward that only reaches the parameters through such a graph (an R1
  penalty backpropagated on its own), a hook on each held unsharded parameter makes sure
  the final callback is queued.
- An optimizer step (its pre-hook) releases the holds and frees the parked storage: a
  graph saved before the step would compute with the old weights, which a non-sharded
  model's graph refuses too. So does an explicit ``reshard()``, and shards updated
  otherwise (by hand, or by an optimizer stepping in gradient hooks) end the hold at the
  next gather. The end of a backward does not: with two penalized forwards and one
  backward per loss, the second backward still runs through its own graph. The cost:
  the groups such a backward gathered stay in memory until the step, which the graphs
  need anyway; ``backward(create_graph=True)`` whose graph nobody uses pays it too, as
  hooks cannot tell whether a graph will be used.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable
from enum import Enum, auto
from typing import TYPE_CHECKING, Any, Protocol

import torch

from fsdp2._param import ShardedParam

if TYPE_CHECKING:
    from fsdp2._comm_context import CommContext


def outside_transforms(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn`` outside ``torch.func`` transforms (jvp, vmap, grad) and outside
    ``torch.inference_mode`` when one is active. Unsharding and resharding allocate and fill
    buffers that outlive the call, but a module's forward, and so its first all-gather and
    lazy init, can run inside either: tensors created inside a transform would be functorch
    wrappers, whose storage cannot be resized or aliased, and tensors created in inference
    mode would be inference tensors, which have no version counter and which a later
    training step may neither update in place nor save for backward. Inference mode also
    turns grad mode off, so ``fn`` runs under ``no_grad`` there, as it would have."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        in_transform = torch._C._are_functorch_transforms_active()
        in_inference_mode = torch.is_inference_mode_enabled()
        if not (in_transform or in_inference_mode):
            return fn(*args, **kwargs)
        with contextlib.ExitStack() as modes:
            if in_transform:
                modes.enter_context(torch._C._DisableFuncTorch())
            if in_inference_mode:
                modes.enter_context(torch.inference_mode(False))
                modes.enter_context(torch.no_grad())
            return fn(*args, **kwargs)

    return wrapper


# Groups held for a graph, for ``release_graph_holds`` (the optimizer step pre-hook).
_HELD: weakref.WeakSet[UnshardedUpkeep] = weakref.WeakSet()


def release_graph_holds() -> None:
    """Release every group held for a graph and free the storage of the parked ones (an
    optimizer step is about to change the shards the graphs were computed from). Not
    during a backward of the group's tree (an optimizer stepping in gradient hooks): that
    backward may still run through the graph."""
    for group in list(_HELD):
        owner = group.hold_owner
        if owner is not None and owner.in_backward:
            continue
        if group.kept_for_graph:
            group.reshard()  # releases, and frees the kept storage
        else:
            group.release_from_graph()  # unsharded: freed by its next reshard


class GraphHoldOwner(Protocol):
    """What a hold needs of the tree it belongs to (``TreeContext``)."""

    in_backward: bool

    def queue_final_callback(self) -> None: ...


class ShardedState(Enum):
    SHARDED = auto()
    # reshard_after_forward=int: sharded over a smaller group until backward gathers it.
    SHARDED_POST_FORWARD = auto()
    UNSHARDED = auto()


class UnshardedUpkeep:
    """Stale checks, write-back of in-place changes and graph holds (mixed into
    ``ParamGroup``). The attributes below are set by ``ParamGroup.__init__``."""

    params: list[ShardedParam]
    flat_shard: torch.Tensor
    extensions: list[ShardedParam]
    sharded_state: ShardedState
    shard_rank: int
    _gathered_from: tuple[int, int] | None
    _unsharded_version: int | None
    _gather_params: list[ShardedParam]
    _copy_out_targets: list[torch.Tensor]
    # See [Note: backward that builds a graph].
    held_by_graph: bool
    hold_owner: GraphHoldOwner | None
    kept_for_graph: bool  # parked: sharded parameters registered, storage kept
    _hold_hooks: list[Any]

    _all_gather: Any  # the all-gather in flight, if any
    comm: CommContext | None  # set at the group's lazy init
    # ``ParamGroup``'s methods, and ``GradientReduction``'s name of the group.
    reshard: Callable[..., None]
    _require_unsharded_flat: Callable[[], torch.Tensor]
    if TYPE_CHECKING:

        @property
        def where(self) -> str: ...

    @property
    def is_unsharded(self) -> bool:
        return self.sharded_state is ShardedState.UNSHARDED

    @property
    def unshard_pending(self) -> bool:
        return self._all_gather is not None

    # -- stale unsharded parameters --------------------------------------------------------
    def reshard_if_stale(self) -> bool:
        """Reshard (dropping a kept post-forward share too) when the shards were written
        since the unsharded parameters were gathered from them, so the next unshard
        gathers the current values; see [Note: stale unsharded parameters]. Returns
        whether it resharded."""
        if self.is_unsharded:
            for p in self.params:  # see [Note: requires_grad changed while gathered]
                p.sync_requires_grad()
        gathered = self.is_unsharded or self.unshard_pending
        if not gathered and self.sharded_state is not ShardedState.SHARDED_POST_FORWARD:
            return False
        if self._gathered_from == self._shard_version():
            return False
        self.reshard()  # raises if the unsharded parameters were changed too
        return True

    def _shard_version(self) -> tuple[int, int]:
        """Identifies the values of the shards: the flat shard's identity and the sum of the
        version counters of it, of every sharded parameter and of every local tensor (each
        counter only grows, so the sum changes with any of them). Each has its own counter:
        an optimizer updating a ``DTensor`` in place bumps the wrapper's counter, not its
        local tensor's (written below autograd); one stepping on the local shards
        (``fsdp2.optim``'s fast path) bumps the local tensor's only; and the local tensors
        are aliases of the flat shard with counters of their own ([Note: shard aliases at
        offset 0] in ``_param``)."""
        flat = self.flat_shard
        return id(flat), flat._version + sum(
            p.sharded_param._version + p.local_tensor()._version for p in self.params
        )

    # -- in-place changes to unsharded parameters ------------------------------------------
    def unsharded_modified(self) -> bool:
        """Whether the unsharded parameters were changed in place since they were filled."""
        version = self._unsharded_version
        return (
            version is not None
            and self.is_unsharded
            and self._require_unsharded_flat()._version != version
        )

    @outside_transforms
    def write_back_unsharded(self) -> None:
        """Copy in-place changes of the unsharded parameters into this rank's shards; see
        [Note: in-place changes to unsharded parameters] in ``_param``."""
        if not self.unsharded_modified():
            return
        if self._gathered_from is not None and self._gathered_from != self._shard_version():
            raise RuntimeError(
                f"fully_shard: {self.where}: its unsharded parameters were changed in place "
                f"and its shards were updated (optimizer.step()) since they were gathered; "
                f"one of the two changes would be lost. Run backward before the optimizer "
                f"step (the end of backward writes such changes back), reshard() before "
                f"stepping, or change the sharded parameters instead."
            )
        for p, target in zip(self._gather_params, self._copy_out_targets, strict=True):
            p.write_back(target[self.shard_rank])
        if self.comm is not None:
            # The shards were written on the compute stream; this group's next all-gather
            # reads them on the all-gather stream, which may have waited only for an
            # event recorded before this write (at the copy-out).
            self.comm.order_all_gathers_after_compute()
        self._unsharded_version = self._require_unsharded_flat()._version
        self._gathered_from = self._shard_version()

    # -- unsharded parameters a graph saved ------------------------------------------------
    def hold_for_graph(self, owner: GraphHoldOwner) -> None:
        """Keep the unsharded storage for the graph a create_graph backward is building.
        Whenever a later backward reaches a held parameter, the owner's final callback is
        queued (it reduces this group)."""
        if self.held_by_graph:
            return
        self.held_by_graph = True
        self.hold_owner = owner
        _HELD.add(self)
        for p in self.params:
            unsharded = p.unsharded_param
            if unsharded is not None and unsharded.requires_grad:
                hook = unsharded.register_hook(lambda _grad: owner.queue_final_callback())
                self._hold_hooks.append(hook)

    def release_from_graph(self) -> None:
        """End the hold; the storage is freed by the reshard that follows."""
        self.held_by_graph = False
        self.hold_owner = None
        _HELD.discard(self)
        for handle in self._hold_hooks:
            handle.remove()
        self._hold_hooks.clear()

    def park_for_graph(self) -> None:
        """What a hook's reshard does to a held group: register the sharded parameters
        again but keep the unsharded storage, which the graph reads. Groups with
        all-gather extensions (whose unsharded parameters their hooks own) stay unsharded."""
        if not self.is_unsharded or self.extensions:
            return
        self.write_back_unsharded()
        for p in self.params:
            p.register(p.sharded_param)
        self.sharded_state = ShardedState.SHARDED
        self.kept_for_graph = True

    def reuse_kept(self) -> bool:
        """At an unshard of a parked group: register its kept unsharded parameters again,
        without an all-gather, when the shards have not changed since they were gathered;
        returns whether it did. Otherwise the all-gather refills the kept storage."""
        if not self.kept_for_graph:
            return False
        self.kept_for_graph = False
        if self._gathered_from != self._shard_version():
            # Updated without an optimizer step's pre-hook (by hand, or by an optimizer
            # in backward hooks): the graphs are stale, end the hold.
            self.release_from_graph()
            return False
        self.sharded_state = ShardedState.UNSHARDED
        for p in self.params:
            p.register_unsharded()
        return True
