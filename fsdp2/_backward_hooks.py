"""The backward half of a module's FSDP state: pre-backward, post-backward, the final
callback, and what the tree's states share.

``BackwardHooks`` is mixed into ``FSDPState`` (``_state``), which sets the attributes
declared below and owns the forward half: the forward hooks attach the triggers (a tensor
hook on the outputs for the pre-backward, a ``PostBackward`` node on the inputs for the
post-backward), and the methods here run when backward reaches them:

- pre-backward (first gradient of an output): unshard again if resharded, and prefetch
  the group whose forward ended just before this one's (the recorded order, reversed).
- post-backward (gradients of the inputs done): reduce-scatter gradients, reshard.
- final callback (end of backward): finish groups whose post-backward did not run
  (inputs without grad, unused outputs), wait for outstanding reductions, reset state.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from enum import Enum, auto
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd import Variable

from fsdp2._backward_nodes import ForwardCall
from fsdp2._comm_context import CommContext
from fsdp2._comm_records import Phase
from fsdp2._divergence import step_probes
from fsdp2._param_group import ParamGroup

# Debug events of the hooks, named like torch's ("FSDP::pre_forward (layers.0)"), under
# torch's FSDP logger so that ``TORCH_LOGS=+fsdp`` (or setting the level of the
# "torch.distributed.fsdp" logger) shows them as it shows torch's own.
logger = logging.getLogger("torch.distributed.fsdp.fsdp2")


def run_eagerly(fn: Any) -> Any:
    """Keep ``fn`` (a hook) out of ``torch.compile``: called from compiled code, it breaks the
    graph and runs eagerly, callees included.

    Why: the hooks resize storages and copy into aliased views of one buffer, which dynamo
    and AOTAutograd cannot trace, so compiling a sharded block would fail; torch's
    ``fully_shard`` keeps its hooks out of the graph the same way. ``torch._disable_dynamo``
    imports dynamo on the first call instead of at our import (about 0.9 s); the public
    ``torch.compiler.disable`` is the fallback where it is missing.
    """
    lazy = getattr(torch, "_disable_dynamo", None)
    if lazy is not None:
        return lazy(fn, recursive=True)
    return torch.compiler.disable(fn, recursive=True)


class TrainingState(Enum):
    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()  # unsharded for backward, gradients being computed
    POST_BACKWARD = auto()


class TreeContext:
    """State shared by every ``FSDPState`` under one root, created at lazy init."""

    def __init__(
        self, root: BackwardHooks, states: Sequence[BackwardHooks], comm: CommContext
    ) -> None:
        self.root = root
        self.states: list[BackwardHooks] = list(states)
        self.comm = comm
        self.forward_order: list[BackwardHooks] = []  # states, in post-forward order, with repeats
        self.in_backward = False
        self.callback_queued = False
        # Post-backward nodes of live graphs that have not run: while any exists, a later
        # forward (several forwards, then one backward) keeps the recorded order.
        self.live_claims = 0
        # States whose backward for one forward call ended while another call's is still to
        # come; the next other state's pre-backward finishes them (see ``post_backward``).
        self.parked: list[BackwardHooks] = []
        # This backward runs with ``create_graph=True``; see [Note: backward that builds a
        # graph] in ``_unsharded_upkeep``.
        self.building_graph = False
        # The implicit forward prefetch on the CPU ([Note: forward prefetch on the CPU] in
        # ``_state``): the last state whose pre-forward ran in this forward, and the states
        # gathered ahead whose pre-forward has not run yet (freed at the root's
        # post-forward if it does not).
        self.last_forward_started: Any = None
        self.forward_prefetched: dict[int, Any] = {}
        # False until the root's first forward: a tree that ``unshard()`` on a submodule
        # created is taken over by the outermost root at its first forward.
        self.started = False
        _LIVE_TREES.add(self)

    def step_in_progress(self) -> str | None:
        """What of a step is under way in this tree, or None (for switches that may only
        change between steps: ``fsdp2.set_divergence_checks``)."""
        where = f"the tree rooted at {self.root.label}"
        if self.in_backward:
            return f"{where} is in a backward"
        if any(s.training_state is not TrainingState.IDLE for s in self.states):
            return f"{where} is in a forward"
        if self.live_claims > 0:
            return f"{where} has a forward whose backward is still to come"
        comm = self.comm
        if comm.all_gathers_in_flight or comm.reduces:
            return f"{where} has collectives in flight (an unshard(async_op=True) not waited for, or reductions left by set_is_last_backward(False))"
        owed = [
            g.where
            for s in self.states
            for g in s.groups
            if g.grads_unsynced or g._partial_reduce is not None
        ]
        if owed:
            return f"{where} holds gradient sums for a later reduction (set_requires_gradient_sync(False) or set_requires_all_reduce(False)) in {', '.join(owed)}"
        return None

    def queue_final_callback(self) -> None:
        """Have the root's final callback run at the end of the backward under way."""
        if not self.callback_queued:
            self.callback_queued = True
            self.in_backward = True
            Variable._execution_engine.queue_callback(self.root._finish_backward)


# Every tree alive, for ``set_divergence_checks`` (which may only switch between steps).
_LIVE_TREES: weakref.WeakSet[TreeContext] = weakref.WeakSet()


def _steps_in_progress() -> str | None:
    reasons = [r for tree in list(_LIVE_TREES) if (r := tree.step_in_progress()) is not None]
    return "; ".join(reasons) if reasons else None


step_probes.append(_steps_in_progress)

# Called with every tree at the end of its lazy init: a schedule trace active before the
# first forward attaches its recorder to the tree built then ([Note: schedule records] in
# ``_comm_records``).
tree_observers: list[Callable[[TreeContext], None]] = []


class BackwardHooks:
    """The backward hooks and final callback of a state (mixed into ``FSDPState``).

    The attributes below are set by ``FSDPState.__init__`` (see there for each)."""

    groups: tuple[ParamGroup, ...]
    tree: TreeContext | None
    fqn: str
    training_state: TrainingState
    backward_prefetch: list[Any] | None  # FSDPState objects
    unshard_in_backward: bool
    is_last_backward: bool
    _forward_positions: list[int]
    _pending_backward_calls: int
    _post_backward_done: bool
    _open_claims: int
    _open_untracked: int
    _untracked_calls: int
    _backward_epoch: int
    _unopened_forwards: list[ForwardCall]
    _had_untracked_call: bool
    _reduced_early: bool
    _modules_to_run: set[int]
    max_reduces_in_flight: int
    if TYPE_CHECKING:  # ``FSDPState``'s, read through the tree's states

        @property
        def label(self) -> str: ...

        def _complete_partial_forward(self, output: Any) -> Any: ...

    def _gathered(self) -> bool:
        """Some group is unsharded or being all-gathered."""
        return any(g.is_unsharded or g.unshard_pending for g in self.groups)

    def _unshard_and_wait(self, phase: Phase) -> None:
        for group in self.groups:
            if not group.is_unsharded:
                group.unshard(phase=phase)
        for group in self.groups:
            group.wait_for_unshard()

    @run_eagerly
    def _pre_backward(
        self, claims: int, forward: ForwardCall, *_: Any, prefetch: bool = True
    ) -> None:
        """Backward reached an output of one forward call, whose ``claims`` post-backward
        nodes (one per module call of the group) will now run. ``prefetch``: prefetch by
        the forward's recorded position (False for a list group's open call, which has
        none: [Note: calls that leave a list group open] in ``_state``)."""
        forward.opened = True
        tree = self.tree
        if tree is None:
            raise AssertionError("pre-backward before lazy init")
        tree.queue_final_callback()
        self._open_claims += claims
        self._open_untracked += forward.untracked
        if tree.parked:
            for state in tree.parked:
                if state is not self:
                    state._reduce_and_reshard()
                    state._reduced_early = True
            tree.parked.clear()
        self._reduced_early = False  # gathered again: its gradients are owed once more
        self.training_state = TrainingState.PRE_BACKWARD
        if self.groups:
            logger.debug("FSDP::pre_backward (%s)", self.fqn)
            self._unshard_and_wait(Phase.BACKWARD)
            if torch.is_grad_enabled():  # autograd's grad mode is create_graph here
                self._hold_for_graph()
        if prefetch:
            self._prefetch_for_backward()
        # A buffer the prefetch did not take would sit idle through this block's
        # backward, where memory peaks: see [Note: host buffer pool].
        tree.comm.host_buffers.clear()
        if tree.comm.recorder is not None:
            tree.comm.recorder.compute_begins(self, Phase.BACKWARD)

    def _prefetch_for_backward(self) -> None:
        tree = self.tree
        if tree is None or not self._forward_positions:
            return
        position = self._forward_positions.pop()
        if self.backward_prefetch is not None:
            targets = self.backward_prefetch
        else:
            # The group whose forward ended just before this one's runs next in backward.
            previous = position - 1
            while previous >= 0 and tree.forward_order[previous] is self:
                previous -= 1
            targets = [tree.forward_order[previous]] if previous >= 0 else []
        for target in targets:
            if target._pending_backward_calls > 0 and target.unshard_in_backward:
                for target_group in target.groups:
                    target_group.unshard(phase=Phase.BACKWARD_PREFETCH)

    # [Note: repeated backwards over one forward]
    # Two counters decide when a group's post-backward may reshard and reduce.
    # ``_pending_backward_calls`` counts the forward calls whose backward has not run yet
    # (set by the forwards, reset by each final callback to the calls still to come);
    # ``_open_claims`` counts the post-backward nodes of the calls this backward opened
    # (added by each pre-backward trigger, one per module call of the group). A loss
    # computed chunk by chunk, each chunk's backward through the trunk over a retained
    # graph, runs the same forward's backward several times: from the second one on, the
    # forward's calls are no longer pending, so the pending count alone would let the
    # first node of a list group (its last module) reshard the group while its earlier
    # modules' backward, in the same backward, still reads the parameters. So a node also
    # waits while other nodes of the calls this backward opened are still to run, and
    # while one of those calls has no node at all (``_open_untracked``: its inputs need
    # no gradient, so nothing reports the end of its backward; in a first backward the
    # pending count keeps such a group gathered until the final callback, as it must
    # here); the final callback settles them, after clearing both counts.

    def post_backward(self) -> None:
        """Reduce this group's gradients and reshard, once the backward of every forward
        call that has reached backward ran.

        A module called several times keeps its parameters gathered while the backward of
        another of its calls is under way (``i = m(x); j = m(x)``: both run together, and
        the parameters' gradients are complete only after both). When none is, but more
        calls' backward is still to come (two forwards of the whole model, then one
        backward), the state is parked: if this module's next backward follows at once
        (``m(m(x))``) nothing happens; if another group's backward comes first, that
        group's pre-backward reduces and reshards this one, as torch does after each call,
        so the model is never left gathered as a whole. A state with a call that has no
        post-backward node (``fully_shard([embed, head])``: the embedding's input needs no
        gradient) is not parked: that call's backward may still be to come in this
        backward and read the parameters (its inputs need no gradient, its parameters do),
        and nothing would report it; the final callback reduces the group.
        """
        tree = self.tree
        if tree is not None:
            # Every backward that runs a post-backward node ends with the final callback,
            # which settles what this backward left here (reduces it, or moves it into the
            # unsynced sums), even when no pre-backward trigger of this tree fired in it:
            # see [Note: calls that leave a list group open] in ``_state``. (A no-op when
            # called from the final callback itself.)
            tree.queue_final_callback()
        self._open_claims = max(0, self._open_claims - 1)
        if self._held_by_graph():
            return  # the final callback reduces, once every use of the parameters is done
        if self._pending_backward_calls > 1:
            self._pending_backward_calls -= 1
            if (
                self._open_claims == 0
                and self._untracked_calls == 0
                and tree is not None
                and self not in tree.parked
            ):
                tree.parked.append(self)
            return
        if self._open_claims > 0 or self._open_untracked > 0:
            # Another call this backward opened may still read the parameters: a list
            # group's earlier module, with a node still to run or with none (its inputs
            # need no gradient), in a backward over a retained graph whose calls were all
            # counted off by an earlier backward (a loss computed chunk by chunk, each
            # chunk's backward through the trunk). Reduce after its node, or from the final
            # callback; see [Note: repeated backwards over one forward].
            return
        self._pending_backward_calls = 0
        self._reduce_and_reshard()
        self._post_backward_done = True

    def _held_by_graph(self) -> bool:
        return any(group.held_by_graph for group in self.groups)

    def _hold_for_graph(self) -> None:
        """This state's gathered groups are saved by the graph a backward is building."""
        tree = self.tree
        if tree is None:
            raise AssertionError("backward before lazy init")
        tree.building_graph = True
        for group in self.groups:
            if group.is_unsharded or group.unshard_pending:
                group.hold_for_graph(tree)

    @torch.no_grad()  # in a create_graph backward, grad mode is on: record nothing
    def _reduce_and_reshard(self) -> None:
        tree = self.tree
        if tree is not None and tree.comm.recorder is not None:
            tree.comm.recorder.compute_ends(self, Phase.BACKWARD)
        self.training_state = TrainingState.POST_BACKWARD
        if self.groups:
            logger.debug("FSDP::post_backward (%s)", self.fqn)
        for group in self.groups:
            if group.unshard_pending:
                group.wait_for_unshard()
            # Reshard first: the gradients are separate tensors, so the unsharded
            # parameters can be freed before the reduce-scatter input is allocated.
            if group.reshard_after_backward:
                if group.held_by_graph:
                    group.park_for_graph()
                else:
                    group.reshard(in_hook=True)
            if group.requires_gradient_sync:
                group.reduce_grads()
            else:
                group.accumulate_unsynced()
        self.training_state = TrainingState.IDLE

    def _finish_held(self) -> None:
        """Final callback for a state held for a graph (see [Note: backward that builds a
        graph] in ``_unsharded_upkeep``): reduce what this backward accumulated, park."""
        self._pending_backward_calls = 0
        self._reduce_and_reshard()

    @run_eagerly
    def _finish_backward(self) -> None:
        """Final callback of backward, queued on the root's tree by the first pre-backward."""
        tree = self.tree
        if tree is None:
            raise AssertionError("final callback before lazy init")
        logger.debug("FSDP::root_post_backward")
        # Forwards whose backward is still to come (the trunk's, after a loss head's
        # chunks each had their own backward) keep the recorded order to prefetch by.
        keep_order = tree.live_claims > 0
        if tree.building_graph:
            # Groups gathered without their pre-backward firing (kept unsharded since
            # forward, used by another module) may be saved by the new graph too.
            for state in tree.states:
                if state._gathered():
                    state._hold_for_graph()
        for state in tree.states:
            # Forwards whose backward has not started keep their claims for a later one.
            later = [f for f in state._unopened_forwards if not f.opened and f.live > 0]
            gathered = state._gathered()
            if state._held_by_graph():
                state._finish_held()
            elif state._reduced_early and not state._post_backward_done:
                state._pending_backward_calls = 0  # as if reduced here, which it was
                state._reshard_after_backward()
            elif (
                state._pending_backward_calls > 0
                or (gathered and not state._post_backward_done)
                or (
                    state._had_untracked_call and any(g.has_unsharded_grads() for g in state.groups)
                )
            ):
                # The last case: gradients accumulated after the group's post-backward,
                # by a call whose backward came later and has no post-backward node (its
                # inputs need no gradient: the inner ``m`` of ``m(m(x))``, or the embedding
                # of ``fully_shard([embed, head])``), in the second backward over two
                # forwards. A parameter used twice gets its gradient only once autograd has
                # summed both uses, after the earlier post-backward ran. They are owed.
                state._pending_backward_calls = 1
                # Calls whose backward did not report (no node, or one that did not run in
                # this backward): settle now.
                state._open_claims = state._open_untracked = 0
                state.post_backward()
            elif gathered:
                # Gathered again after its post-backward (a backward prefetch nothing
                # used): free it; its gradients were reduced already.
                state._reshard_after_backward()
            else:
                # Sums left by backwards without gradient sync (or, with HSDP, without the
                # all-reduce) in a group this backward did not use: reduce them now, or
                # the optimizer step would miss them (torch's final callback does the
                # former, and drops HSDP's partial sums).
                for group in state.groups:
                    if group.owes_reduction():
                        group.reduce_grads()
            state._post_backward_done = False
            state._reduced_early = False
            state._open_claims = state._open_untracked = 0
            state._backward_epoch += 1
            for forward in later:
                forward.epoch = state._backward_epoch
            state._unopened_forwards = later
            state._pending_backward_calls = sum(f.live + f.untracked for f in later)
            state._untracked_calls = sum(f.untracked for f in later)
            state.training_state = TrainingState.IDLE
            if not keep_order:
                state._forward_positions.clear()
            state._modules_to_run.clear()
            for group in state.groups:  # kept unsharded: before the optimizer step
                group.write_back_unsharded()
        if self.is_last_backward:
            tree.comm.finish_all()
        tree.comm.host_buffers.clear()  # nothing held while the optimizer runs
        tree.parked.clear()
        if not keep_order:
            tree.forward_order.clear()
        tree.in_backward = False
        tree.callback_queued = False
        tree.building_graph = False

    def _reshard_after_backward(self) -> None:
        """Free the gathered groups that reshard after backward."""
        for group in self.groups:
            gathered = group.is_unsharded or group.unshard_pending
            if group.reshard_after_backward and gathered:
                if group.held_by_graph:
                    group.park_for_graph()
                else:
                    group.reshard(in_hook=True)

    def reduce_unsynced_grads(self) -> None:
        """Outside any backward: reduce-scatter the gradients that backwards without
        gradient sync accumulated, and reshard, for every group of this tree; then, if this
        is the last backward, wait for the reductions as the final callback does.

        Why: ``torch.distributed.pipelining`` runs each microbatch's backward separately,
        all of them without sync and without resharding, and only afterwards decides that
        the step's backward is over. No autograd hook of fsdp2 runs then, so the stage
        calls this instead (see ``fsdp2.pipelining``). Which groups reduce depends only on
        which ran an unsynced backward, the same on every rank, never on which local
        gradients exist, so ranks issue the same collectives."""
        tree = self.tree
        if tree is None:  # no forward yet: nothing to reduce
            return
        for state in tree.states:
            state._reduce_unsynced()
        self._finish_unsynced_reduction()

    def _reduce_unsynced(self) -> None:
        """This state's part of ``reduce_unsynced_grads``: reduce-scatter what backwards
        without gradient sync accumulated (if sync is on now) and reshard."""
        if any(g.owes_reduction() for g in self.groups):
            self._reduce_and_reshard()
        else:
            self._reshard_after_backward()

    def _finish_unsynced_reduction(self) -> None:
        """The root's part of ``reduce_unsynced_grads``, after every state's part: on the
        last backward, wait for the reductions, as the final callback does."""
        tree = self.tree
        if tree is None:
            return
        if self.is_last_backward:
            tree.comm.finish_all()
        tree.comm.host_buffers.clear()  # nothing held while the optimizer runs

    # [Note: torch's private pipelining protocol]
    # torch.distributed.pipelining's stage (torch 2.13, ``perform_reduce_grad``) reduces
    # the gradients of a stage module that ``isinstance(m, torch.distributed.fsdp
    # .FSDPModule)`` by reaching into torch's FSDP state:
    #     state = fully_shard.state(m)
    #     for s in state._state_ctx.all_states:
    #         for g in s._fsdp_param_groups: g.post_backward()
    #         # torch 2.11: ``if s._fsdp_param_group: s._fsdp_param_group.post_backward()``
    #     state._root_post_backward_final_callback()
    # fsdp2's modules pass that check only where torch's names are pointed at fsdp2's
    # (``torch.distributed.fsdp.FSDPModule = fsdp2.FSDPModule`` before the pipelining
    # modules are imported), and then that code runs on fsdp2's state. These three names
    # give it the meaning of ``reduce_unsynced_grads``: each state reduces (or reshards)
    # once, the root then waits. (``fsdp2.pipelining.PipelineStage`` calls
    # ``reduce_unsynced_grads`` directly.)

    @property
    def _state_ctx(self) -> _TorchStateContext:
        return _TorchStateContext(self.tree.states if self.tree is not None else [])

    @property
    def _fsdp_param_groups(self) -> list[_TorchParamGroupView]:
        return [_TorchParamGroupView(self)] if self.groups else []

    @property
    def _fsdp_param_group(self) -> _TorchParamGroupView | None:
        return _TorchParamGroupView(self) if self.groups else None

    def _root_post_backward_final_callback(self) -> None:
        self._finish_unsynced_reduction()

    def reset_iter_state(self) -> None:
        """Drop per-iteration state after an exception left a step half done."""
        tree = self.tree
        if tree is None:
            return
        for state in tree.states:
            state.training_state = TrainingState.IDLE
            state._forward_positions.clear()
            state._pending_backward_calls = 0
            state._post_backward_done = False
            state._reduced_early = False
            state._open_claims = state._open_untracked = 0
            state._untracked_calls = 0
            state._backward_epoch += 1
            state._unopened_forwards.clear()
            state._modules_to_run.clear()
            for group in state.groups:
                group.reshard()
                group.grads_unsynced = False
                for p in group.params:
                    p.accumulated_grad = None
                    if p.unsharded_param is not None:
                        p.unsharded_param.grad = None
        tree.comm.finish_reduces(keep=0)
        tree.comm.host_buffers.clear()
        tree.parked.clear()
        tree.forward_order.clear()
        tree.in_backward = False
        tree.callback_queued = False
        tree.building_graph = False
        tree.comm.abandon_step()


class _TorchStateContext:
    """``_state_ctx`` of [Note: torch's private pipelining protocol]."""

    def __init__(self, states: list[BackwardHooks]) -> None:
        self.all_states = list(states)


class _TorchParamGroupView:
    """An entry of ``_fsdp_param_groups`` ([Note: torch's private pipelining protocol]):
    one per state, whose groups are reduced together."""

    def __init__(self, state: BackwardHooks) -> None:
        self._state = state

    def post_backward(self) -> None:
        self._state._reduce_unsynced()
