"""Per-module FSDP state and the hooks that drive the runtime.

Timeline of one training step for a tree sharded bottom-up (blocks, then the root):

- root pre-forward: lazy init on the first call (find the tree, pick defaults, build the
  groups' buffers); start a fresh forward order.
- each pre-forward: all-gather the group (or wait for a prefetched one), on the CPU also
  issue the next group's all-gather, register the unsharded parameters, attach the
  post-backward trigger to the inputs.
- each post-forward: reshard if ``reshard_after_forward``; record the order; attach the
  pre-backward trigger to the outputs.
- pre-backward, post-backward and the final callback: ``BackwardHooks``
  (``_backward_hooks``), which ``FSDPState`` mixes in.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp2._backward_hooks import (
    BackwardHooks,
    TrainingState,
    TreeContext,
    logger,
    run_eagerly,
    tree_observers,
)
from fsdp2._backward_nodes import EagerPostBackward, ForwardCall, PostBackward
from fsdp2._comm_context import CommContext
from fsdp2._comm_records import Phase
from fsdp2._divergence import checks_enabled, require_stores
from fsdp2._module_io import cast_floating, hook_first_gradient, map_tensors, tensors_in
from fsdp2._param import refuse_plain_values
from fsdp2._param_group import ParamGroup
from fsdp2._policies import MixedPrecisionPolicy, OffloadPolicy
from fsdp2._rank_agreement import check_ranks_agree
from fsdp2._stream_utils import wait_event, wait_stream


def fsdp_state_of(module: nn.Module) -> FSDPState | None:
    """The state ``fully_shard`` attached to ``module`` itself, or None.

    Read from the instance's ``__dict__``, not with ``getattr``: wrappers such as
    ``CheckpointWrapper`` forward unknown attributes to the module they wrap, so ``getattr``
    would hand a wrapper the state of a sharded module inside it (and ``fully_shard`` on
    the wrapper, as accelerate applies it, would be refused as a second call)."""
    state = module.__dict__.get("_fsdp_state")
    return state if isinstance(state, FSDPState) else None


# [Note: a sharded module run outside its group's forward]
# fully_shard gathers a group's parameters around the forward of the module it was applied
# to, and nowhere else. A forward that calls a submodule of another sharded block directly
# (diffusers' DiT computes its output conditioning with ``transformer_blocks[0].norm1.emb``
# after the blocks, when block 0 has resharded) reaches a kernel with the sharded
# DTensors, and DTensor raises "got mixed torch.Tensor and DTensor", which names no
# module. Every ``FSDP<Name>.forward`` catches that error (free unless one is raised) and
# reads the traceback for the module that computed on the shards of a group that was not
# gathered; the error it raises instead names the caller, that module, the group, and the
# fixes. torch's ``fully_shard`` lets DTensor's message through.
_EXPLAINED_ATTR = "_fsdp2_explained"


def explain_sharded_call(caller: nn.Module, error: RuntimeError) -> RuntimeError | None:
    """fsdp2's explanation of ``error``, raised in ``caller``'s forward, if it came from a
    submodule of ``caller`` computing on a group's shards; else None. See [Note: a sharded
    module run outside its group's forward]."""
    if getattr(error, _EXPLAINED_ATTR, False) or "DTensor" not in str(error):
        return None
    names = {id(m): name for name, m in caller.named_modules()}
    sharded: dict[int, ParamGroup] = {}
    for module in caller.modules():
        state = fsdp_state_of(module)
        for group in state.groups if state is not None else ():
            if not group.is_unsharded:
                sharded.update((id(p.sharded_param), group) for p in group.params)
    # The modules whose code is on the stack, from ``caller``'s forward inward: the
    # innermost one holding shards is where the kernel failed; the outermost one
    # containing it is the module that was called, and the one before that called it.
    frames: list[nn.Module] = []
    tb = error.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            if not frames or frames[-1] is not owner:
                frames.append(owner)
        tb = tb.tb_next
    found = next(
        (
            (inner, sharded[id(p)])
            for inner in reversed(frames)
            for p in inner.parameters(recurse=False)
            if id(p) in sharded
        ),
        None,
    )
    if found is None:
        return None
    inner, group = found
    inner_name = names[id(inner)]
    at = next(
        (
            i
            for i, m in enumerate(frames)
            if m is not caller
            and (inner_name == names[id(m)] or inner_name.startswith(names[id(m)] + "."))
        ),
        None,
    )
    if at is None:  # ``caller`` itself computed on its own shards (resharded mid-forward)
        return None
    called, runner = frames[at], frames[at - 1] if at > 0 else caller
    state = fsdp_state_of(caller)
    prefix = f"{state.fqn}." if state is not None and state.fqn else ""
    name = prefix + names[id(called)]
    explained = RuntimeError(
        f"fully_shard: {type(runner).__name__}.forward() ran '{name}' "
        f"({type(called).__name__}) while the parameters it uses were sharded: they belong "
        f"to the group of {group.where}, which fully_shard all-gathers only around that "
        f"module's own forward. Call '{name}' only inside that forward; or also apply "
        f"fully_shard to '{name}' (before its parents), so that it gathers its parameters "
        f"wherever it runs; or do not apply fully_shard to {group.where} itself, so that "
        f"its parameters join the enclosing group."
    )
    setattr(explained, _EXPLAINED_ATTR, True)
    return explained


# [Note: per-parameter meshes]
# torch 2.13's ``shard_placement_fn`` may return ``ShardPlacementResult(placement,
# mesh_info)``: that parameter is sharded over a mesh of its own, e.g. a MoE block's
# experts over the expert-data-parallel ranks while its attention uses every
# data-parallel rank. Parameters on different process groups cannot share a collective,
# so one call then makes one ``ParamGroup`` per mesh, in the order of each mesh's first
# parameter, and its state holds them all in ``groups``. The state stays the unit of
# scheduling: every hook acts on all its groups at once (all-gathers issued back to back,
# then waited for; one reduce-scatter per group in post-backward), prefetching a state
# prefetches all of its groups, and the ``FSDPModule`` setters apply to each. Each group
# keeps its own mesh facts: the default gradient divisor is its own data-parallel size
# (as in torch), and an int ``reshard_after_forward`` that equals a group's shard size
# reshards that group fully.

# [Note: calls that leave a list group open]
# A group of several modules runs its pre-forward when the first of them starts and its
# post-forward (reshard, pre-backward trigger) when the last one finishes; inside the
# root's forward, the root's post-forward finishes a group some of whose modules did not
# run. A call outside the root's forward leaves the group open: the output head of
# ``fully_shard([norm, lm_head])`` applied chunk by chunk after ``model(x)``, each chunk
# with its own backward. Nothing used to finish it, so a chunk's output carried no
# pre-backward trigger, and a backward through the chunk alone ended without the final
# callback. The head's post-backward meanwhile waited for the call ``norm`` made in the
# root's forward, whose backward comes last, with the trunk's: every chunk's backward
# left its bf16 gradients on the unsharded parameters, the next one added to them in
# bf16, and only the trunk's backward moved them into the sums in the reduce dtype (or
# reduced them): 1e-4 off torch on gradients of 2e-2, and no reduced gradient after a
# synced chunk. So:
# - such a call arms a pre-backward trigger on its output for the post-backward nodes it
#   attached (``_end_partial_call``), without a forward position to prefetch by; a list
#   group that is the root, which nothing finishes either, does the same;
# - every post-backward node also queues the final callback (``post_backward``), so each
#   backward that reaches a group ends by settling what it produced there: reduced with
#   gradient sync, moved into the unsynced sums without, as each backward of torch's
#   ``fully_shard`` does. The calls whose backward comes later keep their count ([Note:
#   forwards whose backward comes later] in ``_backward_nodes``).
# The common path pays nothing new: a group's last module finishes its forward as before,
# and queueing the final callback is one flag check once it is queued.

# [Note: forward prefetch on the CPU]
# On an accelerator the host queues a block's kernels and moves on, so the next block's
# pre-forward issues its all-gather while the current block still computes: streams give
# forward overlap without prefetching. On the CPU the compute runs in the hook's thread,
# so an all-gather issued at a block's own pre-forward is waited for at once and the
# collective never overlaps compute (torch's ``fully_shard`` runs so). Each pre-forward
# therefore records which state's pre-forward follows it within the root's forward, and
# on the CPU, unless ``set_modules_to_forward_prefetch`` chose for it, a pre-forward issues
# the all-gather of the state that followed it in the previous forward right after its
# own, before the compute it then overlaps (gloo runs collectives on its own thread).
# After that state, the chain goes on while the states in it keep their parameters until
# backward anyway (``reshard_after_forward=False``): gathering those early costs no peak
# memory, since all of them are gathered by the end of the forward. Otherwise the cost is
# one more group alive in forward, as the backward prefetch already holds one in
# backward. Every rank follows the previous step's order, so the issued collectives agree
# as long as the ranks agreed then; a state prefetched for a path the forward did not
# take (a branch chosen per step) is freed at the root's post-forward. With it the
# no-reshard config's step ratio to torch on 2 gloo ranks went from 0.88-0.93 to 0.82
# (``benchmarks/results/2026-11-25.notes.md``).


class FSDPState(BackwardHooks):
    """What one ``fully_shard`` call created: its parameter groups (one per mesh, usually
    one) and the scheduling state of the module (or list of modules) it was applied to."""

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        groups: list[ParamGroup],
        mesh: DeviceMesh,
        device: torch.device,
        reshard_after_forward: bool | int | None,
        mp_policy: MixedPrecisionPolicy,
        offload_policy: OffloadPolicy,
    ) -> None:
        self.modules = modules
        self._label = ", ".join(type(m).__name__ for m in modules)  # before FSDP<Name>
        # One per mesh its parameters are sharded over: usually one, or none (a module
        # whose parameters all belong to submodules' calls); see [Note: per-parameter
        # meshes].
        self.groups = tuple(groups)
        self.mesh = mesh
        self.device = device
        self.reshard_after_forward_setting = reshard_after_forward
        self.reshard_after_forward = bool(reshard_after_forward)
        self.mp_policy = mp_policy
        self.offload_policy = offload_policy
        self.tree: TreeContext | None = None
        self.fqn = ""  # of the module(s), relative to the root; set at lazy init, for logs
        self.training_state = TrainingState.IDLE
        self.forward_prefetch: list[FSDPState] | None = None
        # The state whose pre-forward followed this one's in the last forward of the tree:
        # the implicit forward prefetch on the CPU ([Note: forward prefetch on the CPU]).
        self._next_in_forward: FSDPState | None = None
        self.backward_prefetch: list[FSDPState] | None = None
        self.unshard_in_backward = True
        self._forward_positions: list[int] = []
        self._pending_backward_calls = 0  # forward calls whose post-backward has not run
        self._post_backward_done = False  # in this backward; reset by the final callback
        # Post-backward nodes attached since this group's forward started, and those whose
        # forward's pre-backward has fired but whose own backward has not run yet.
        self._claims_this_forward = 0
        self._claims_armed = 0  # of those, the ones an armed pre-backward trigger counts
        self._open_claims = 0
        self._open_untracked = 0
        # Pending calls without a post-backward node (no input needed grad): nothing reports
        # their backward, which may still read the parameters, so the group is not parked.
        self._untracked_calls = 0
        self._backward_epoch = 0  # +1 whenever the count above is reset
        # This state's current forward, and those whose backward has not started yet; see
        # [Note: forwards whose backward comes later].
        self._forward_call: ForwardCall | None = None
        self._unopened_forwards: list[ForwardCall] = []
        # Ever had such a call: only then can gradients land after the post-backward (see
        # ``_finish_backward``), so only then does the final callback look for them.
        self._had_untracked_call = False
        # Reduced when parked, in this backward, with calls left whose backward comes in a
        # later one (N forwards, then one backward per output, as pipeline schedules do):
        # the final callback must not reduce it again, it would only reduce zeros.
        self._reduced_early = False
        self._recompute_registers_backward = False
        self._modules_to_run: set[int] = set()  # for a list of modules: who has not run
        self._hook_handles: list[Any] = []
        self.shared_comm: CommContext | None = None  # set by share_comm_ctx
        # Parameters this call found already managed by another call (see
        # ``collect_params``): lazy init raises, as torch does at the first forward.
        self.shared_with_other_call: list[tuple[str, str]] = []  # (name, managing call)
        # Root-level settings (read from the root's state; set before or after lazy init):
        # set_is_last_backward(False) leaves reductions in flight at the end of backward;
        # set_post_optim_event makes the next forward's all-gathers wait for that event.
        self.is_last_backward = True
        self.post_optim_event: Any = None
        self.max_reduces_in_flight = 1  # set_reduce_scatter_max_input_buffers
        for module in modules:
            self._hook_handles.append(
                module.register_forward_pre_hook(
                    self._pre_forward_hook, prepend=True, with_kwargs=True
                )
            )
            self._hook_handles.append(module.register_forward_hook(self._post_forward_hook))
        if self.groups:
            # state_dict()/load_state_dict() must see (and load into) the sharded DTensors,
            # even right after a forward that kept the parameters unsharded.
            owners = {id(m): m for g in self.groups for p in g.params for m, _ in p.uses}
            for owner in owners.values():
                names = tuple(n for g in self.groups for p in g.params for m, n in p.uses
                              if m is owner)  # fmt: skip
                self._hook_handles += [
                    owner.register_state_dict_pre_hook(self._reshard_for_state_dict),
                    owner.register_load_state_dict_pre_hook(self._reshard_for_state_dict),
                    owner.register_load_state_dict_pre_hook(
                        functools.partial(refuse_plain_values, names)
                    ),
                    # load_state_dict(assign=True) replaces the parameters: adopt them.
                    owner.register_load_state_dict_post_hook(self._adopt_loaded),
                ]

    @property
    def group(self) -> ParamGroup | None:
        """The state's only group (None without parameters). With per-parameter meshes
        there are several: code that handles groups iterates ``groups``."""
        if len(self.groups) > 1:
            raise RuntimeError(
                f"fully_shard: {self.label} has {len(self.groups)} parameter groups (per-"
                f"parameter meshes from shard_placement_fn); use FSDPState.groups."
            )
        return self.groups[0] if self.groups else None

    def _adopt_loaded(self, *_: Any) -> None:
        for group in self.groups:
            group.ensure_shards_bound()

    def _reshard_for_state_dict(self, *_: Any) -> None:
        for group in self.groups:
            if group.is_unsharded or group.unshard_pending:
                group.reshard()

    # -- naming --------------------------------------------------------------------------
    @property
    def label(self) -> str:
        """The sharded module classes (their own names, before ``FSDP<Name>``)."""
        return self._label

    # -- lazy init -----------------------------------------------------------------------
    def lazy_init(self) -> TreeContext:
        """Make this state the root of every FSDP state below its module(s)."""
        if self.tree is not None:
            return self.tree
        states: list[FSDPState] = []
        seen: set[int] = set()
        for top in self.modules:
            for module in top.modules():
                state = fsdp_state_of(module)
                if state is not None and id(state) not in seen:
                    seen.add(id(state))
                    states.append(state)
        for state in states:
            if state.shared_with_other_call:
                fqn, owner = state.shared_with_other_call[0]
                raise ValueError(
                    f"fully_shard on {state.label}: parameter '{fqn}' is already managed by "
                    f"another fully_shard group (the call on {owner}). A parameter shared "
                    f"between modules must belong to one group: shard the modules that share "
                    f"it together, fully_shard([module_a, module_b]), or their common ancestor "
                    f"only (e.g. keep tied embedding and output weights in the root group)."
                )
        names = {id(m): name for top in self.modules for name, m in top.named_modules()}
        paths = {id(state): ", ".join(names.get(id(m), "") for m in state.modules)
                 for state in states}  # fmt: skip
        for state in states:
            if state.tree is not None and not state.tree.started:
                state.tree = None  # created by a submodule's unshard(): this root takes over
            if state.tree is not None:
                raise RuntimeError(
                    f"FSDP state has already been lazily initialized for {paths[id(state)]}\n"
                    f"FSDP requires running forward through the root module first. "
                    f"fully_shard: {state.label} was already initialized as part of the tree "
                    f"rooted at {state.tree.root.label}, but {self.label} is running its first "
                    f"forward now. Run the first forward (or unshard()) through the outermost "
                    f"sharded module, so it can become the root."
                )
        comm = self.shared_comm if self.shared_comm is not None else CommContext(self.device)
        # One limit for the shared context: the largest any group asked for, as in torch.
        comm.max_reduces_in_flight = max(state.max_reduces_in_flight for state in states)
        tree = TreeContext(self, states, comm)
        for state in states:
            state.tree = tree
            state.fqn = paths[id(state)]
            if state.reshard_after_forward_setting is None:
                # The root's parameters are needed again at the very start of backward.
                state.reshard_after_forward = state is not self
        for state in states:
            for group in state.groups:
                group.path = state.fqn
                if group.comm is not None:
                    group.comm = tree.comm  # initialized under a submodule's unshard() already
                else:
                    group.lazy_init(tree.comm, names)
        groups = [group for state in states for group in state.groups]
        check_ranks_agree(groups)
        tree.comm.register_groups(groups)  # a fingerprint names a group by its number
        if checks_enabled():  # reports go through the stores: [Note: named timeouts]
            for group in groups:
                used = (group.process_group, group.post_forward_group, group.replicate_group)
                require_stores(used, f"collectives of {group.where}")
        for observe in tree_observers:  # e.g. a schedule trace attaching its recorder
            observe(tree)
        return tree

    @property
    def is_root(self) -> bool:
        return self.tree is not None and self.tree.root is self

    # -- forward -------------------------------------------------------------------------
    # A group of several modules (``fully_shard([a, b])``) runs its pre-forward (root set-up,
    # unshard, prefetch, forward order) when the first of them starts and its post-forward
    # (reshard, pre-backward trigger) when the last of them finishes. Every module call
    # still casts its inputs and outputs and registers its own backward trigger, so the
    # gradients reduce once all calls' backward ran. A module that does not run in a
    # forward (a loss head called later, chunk by chunk) leaves the group incomplete; the
    # root's post-forward completes it (see ``_complete_partial_forward``).
    @run_eagerly
    def _pre_forward_hook(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if len(self.modules) > 1 and not (self.tree is not None and self.tree.in_backward):
            if self._modules_to_run:  # another module of this group already started it
                return self._pre_forward_again(args, kwargs)
            self._modules_to_run = {id(m) for m in self.modules}
        return self.pre_forward(args, kwargs)

    @run_eagerly
    def _post_forward_hook(self, module: nn.Module, args: Any, output: Any) -> Any:
        if len(self.modules) > 1 and not (self.tree is not None and self.tree.in_backward):
            if id(module) not in self._modules_to_run:  # a repeated call in this pass
                return self._end_partial_call(output)
            self._modules_to_run.discard(id(module))
            if self._modules_to_run:
                return self._end_partial_call(output)
        return self.post_forward(output)

    def _pre_forward_again(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Another module of a group that already started this forward."""
        policy = self.mp_policy
        if policy.cast_forward_inputs and policy.param_dtype is not None:
            args, kwargs = cast_floating((args, kwargs), policy.param_dtype)
        self._unshard_and_wait(Phase.FORWARD)  # no-op for groups already gathered
        if torch.is_grad_enabled():
            args, kwargs = self._claim_post_backward(args, kwargs)
        return args, kwargs

    def _cast_output(self, output: Any) -> Any:
        if self.mp_policy.output_dtype is not None:
            output = cast_floating(output, self.mp_policy.output_dtype)
        return output

    def _end_partial_call(self, output: Any) -> Any:
        """A module of a list group finished a call that leaves the group's forward open
        (its other modules have not run). Inside the root's forward, the root's post-forward
        completes the group and arms its pre-backward trigger. Outside it (a loss head
        called chunk by chunk after ``model(x)``), or when the group is the root itself,
        nothing would: see [Note: calls that leave a list group open]."""
        tree = self.tree
        unfinished = tree is not None and (
            tree.root is self or tree.root.training_state is not TrainingState.FORWARD
        )
        if unfinished and torch.is_grad_enabled():
            output = self._attach_pre_backward(output, prefetch=False)
        return self._cast_output(output)

    def _complete_partial_forward(self, output: Any) -> Any:
        """Finish the forward of a group some of whose modules did not run, from the root's
        post-forward, as its last module would have; the pre-backward unshard is then
        triggered from the root's output."""
        self._modules_to_run.clear()
        return self._end_forward(output)

    def _end_forward(self, output: Any) -> Any:
        """Reshard if configured (with or without grad, as torch: a no-grad loop with
        ``reshard_after_forward=False`` gathers once), record the forward order and arm the
        pre-backward trigger on ``output``."""
        grad_enabled = torch.is_grad_enabled()
        tree = self.tree
        if tree is not None and tree.comm.recorder is not None:
            tree.comm.recorder.compute_ends(self, Phase.FORWARD)
        if self.groups:
            logger.debug("FSDP::post_forward (%s)", self.fqn)
            if self.reshard_after_forward:
                for group in self.groups:
                    if group.held_by_graph:
                        group.park_for_graph()
                    else:
                        group.reshard(post_forward=True, in_hook=True)
        self.training_state = TrainingState.IDLE
        if not grad_enabled:
            return output
        # Recorded when the forward ends, not when it starts: backward runs in the reverse
        # of this order (a block before the FSDP submodules inside it, the root first).
        if tree is not None:
            tree.forward_order.append(self)
            self._forward_positions.append(len(tree.forward_order) - 1)
        # Forwards whose graphs are gone (no live claim) drop out here, so grad-enabled
        # forwards that never reach a backward do not pile up.
        forward = self.current_forward()
        pending = [f for f in self._unopened_forwards if f.live > 0 and not f.opened]
        if not forward.opened and not any(f is forward for f in pending):
            pending.append(forward)
        self._unopened_forwards = pending
        return self._attach_pre_backward(output)

    def current_forward(self) -> ForwardCall:
        if self._forward_call is None:
            self._forward_call = ForwardCall(self._backward_epoch)
        return self._forward_call

    def pre_forward(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        tree = self.lazy_init()
        groups = self.groups
        policy = self.mp_policy
        if policy.cast_forward_inputs and policy.param_dtype is not None:
            args, kwargs = cast_floating((args, kwargs), policy.param_dtype)
        if tree.in_backward:
            # Activation checkpointing recomputes this forward inside backward.
            self.training_state = TrainingState.FORWARD
            self._unshard_and_wait(Phase.BACKWARD)
            # Reentrant checkpointing ran the original forward without grad, so only the
            # recomputation builds the graph this module's backward runs on.
            self._recompute_registers_backward = (
                torch.is_grad_enabled() and self._pending_backward_calls == 0
            )
            self._claims_this_forward = self._claims_armed = 0
            self._forward_call = ForwardCall(self._backward_epoch, opened=True)
            if self._recompute_registers_backward:
                args, kwargs = self._claim_post_backward(args, kwargs)
            return args, kwargs
        if self.is_root:
            self._root_pre_forward()
        elif groups and tree.root.training_state is not TrainingState.FORWARD:
            # Called directly, not inside the root's forward: the root's check of stale
            # unsharded parameters did not run for this step ([Note: stale unsharded
            # parameters]).
            for group in groups:
                group.reshard_if_stale()
        in_root_forward = self.is_root or tree.root.training_state is TrainingState.FORWARD
        if in_root_forward:
            tree.forward_prefetched.pop(id(self), None)
            previous = tree.last_forward_started
            if previous is not None and previous is not self:
                previous._next_in_forward = self
            tree.last_forward_started = self
        self.training_state = TrainingState.FORWARD
        self._claims_this_forward = self._claims_armed = 0
        self._forward_call = ForwardCall(self._backward_epoch)
        if groups:
            logger.debug("FSDP::pre_forward (%s)", self.fqn)
            for group in groups:
                group.unshard()
            targets = self.forward_prefetch
            if targets is None:
                targets = self._implicit_forward_prefetch(tree) if in_root_forward else []
            for target in targets:
                for target_group in target.groups:
                    target_group.unshard(phase=Phase.FORWARD_PREFETCH)
            for group in groups:
                group.wait_for_unshard()
        if torch.is_grad_enabled():
            args, kwargs = self._claim_post_backward(args, kwargs)
        if tree.comm.recorder is not None:
            tree.comm.recorder.compute_begins(self, Phase.FORWARD)
        return args, kwargs

    def _implicit_forward_prefetch(self, tree: TreeContext) -> list[FSDPState]:
        """The states to all-gather ahead on the CPU ([Note: forward prefetch on the CPU]):
        the one whose forward followed this one's last time, and after it every next one
        that keeps its parameters until backward anyway. None on accelerators."""
        if tree.comm.streams.all_gather is not None:
            return []
        targets: list[FSDPState] = []
        seen = {id(self)}  # the recorded order can cycle (modules called alternately)
        target = self._next_in_forward
        while target is not None and id(target) not in seen and target.tree is tree:
            seen.add(id(target))
            if id(target) in tree.forward_prefetched:
                break
            if not all(g.is_unsharded for g in target.groups):
                targets.append(target)
                tree.forward_prefetched[id(target)] = target
            if target.reshard_after_forward:
                break
            target = target._next_in_forward
        return targets

    def _root_pre_forward(self) -> None:
        tree = self.tree
        if tree is None:
            raise AssertionError("root pre-forward before lazy init")
        tree.started = True
        logger.debug("FSDP::root_pre_forward")
        tree.comm.root_forward_begins(self)
        tree.last_forward_started = None
        tree.forward_prefetched.clear()
        # A step starts a fresh forward order, unless an earlier forward's backward is
        # still to come (several forwards, then one backward): it needs its positions.
        fresh = tree.live_claims == 0
        if fresh:
            tree.forward_order.clear()
        for state in tree.states:
            if fresh:
                state._forward_positions.clear()
            if state is not self:  # groups left incomplete by calls outside a forward
                state._modules_to_run.clear()
        # Groups left unsharded by a forward without backward (or by unshard()) whose shards
        # the optimizer updated since: gather again ([Note: stale unsharded parameters]).
        for state in tree.states:
            for group in state.groups:
                group.reshard_if_stale()
        comm = tree.comm
        comm.host_buffers.max_buffers = 2  # see [Note: host buffer pool]
        if self.post_optim_event is not None:
            wait_event(comm.streams.all_gather, self.post_optim_event)
            self.post_optim_event = None
        else:
            # The optimizer updated the shards on the compute stream; gather only after it.
            wait_stream(comm.streams.all_gather, comm.streams.compute())

    def post_forward(self, output: Any) -> Any:
        tree = self.tree
        if tree is None:
            raise AssertionError("post-forward before lazy init")
        if tree.in_backward:
            self.training_state = TrainingState.PRE_BACKWARD
            if self._recompute_registers_backward:
                output = self._attach_pre_backward(output)
            return self._cast_output(output)
        if self.is_root:
            for state in reversed(tree.states):
                if state is not self and state._modules_to_run:
                    output = state._complete_partial_forward(output)
            # Prefetched for a forward that took another path this time: free them.
            for state in tree.forward_prefetched.values():
                if state.training_state is TrainingState.IDLE:
                    for group in state.groups:
                        group.reshard(in_hook=True)
            tree.forward_prefetched.clear()
        output = self._end_forward(output)
        if self.is_root:  # backward starts with an empty pool: [Note: host buffer pool]
            tree.comm.host_buffers.clear()
            tree.comm.host_buffers.max_buffers = 1
        return self._cast_output(output)

    # -- backward triggers ---------------------------------------------------------------
    def return_claim(self, forward: ForwardCall) -> None:
        """A graph of ``forward`` was freed without its backward (a forward for logging or
        validation with grad enabled): uncount its call, unless the count was reset since,
        so that the next training backward does not wait for it."""
        if forward.epoch == self._backward_epoch:
            self._pending_backward_calls = max(0, self._pending_backward_calls - 1)

    def _claim_post_backward(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Count this forward call for the group's post-backward and attach its trigger.
        A state without parameters (``fully_shard`` on a module whose parameters all
        belong to submodules' groups) has nothing to reduce, so its calls add no autograd
        node: an extra node changes the order in which autograd sums the gradients of a
        tensor used several times, so the same model would round differently than torch's
        ``fully_shard`` (which adds none there) and than the non-sharded model."""
        if not self.groups:
            return args, kwargs
        self._pending_backward_calls += 1
        attached = self._claims_this_forward
        args, kwargs = self._attach_post_backward(args, kwargs)
        if self._claims_this_forward == attached:
            self._untracked_calls += 1
            self._had_untracked_call = True
            self.current_forward().untracked += 1
        return args, kwargs

    def _attach_post_backward(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Route the inputs that need grad through ``PostBackward`` so its backward runs
        once gradients for all of them (and so for this module's parameters) are done."""
        inputs = [x for x in tensors_in((args, kwargs)) if x.requires_grad]
        if not inputs:
            return args, kwargs
        self._claims_this_forward += 1
        # The node without torch.func support is much cheaper to apply: see EagerPostBackward.
        if torch._C._are_functorch_transforms_active():
            aliases = PostBackward.apply(self, *inputs)
        else:
            aliases = EagerPostBackward.apply(self, *inputs)
        outputs = dict(zip(map(id, inputs), aliases))
        return map_tensors(lambda x: outputs.get(id(x), x), (args, kwargs))

    def _attach_pre_backward(self, output: Any, *, prefetch: bool = True) -> Any:
        """Arm the pre-backward trigger on ``output`` for the post-backward nodes this
        forward attached since the last trigger was armed (a list group's open calls arm
        their own: [Note: calls that leave a list group open]). ``prefetch``: whether its
        backward prefetches by the recorded forward order (only a forward that recorded
        its position does)."""
        claims = self._claims_this_forward - self._claims_armed
        self._claims_armed = self._claims_this_forward
        hook = functools.partial(
            self._pre_backward, claims, self.current_forward(), prefetch=prefetch
        )
        hook_first_gradient(output, hook)
        return output
