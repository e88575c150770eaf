"""Replay the runtime's schedule over a traced step: peak memory and collectives per rank.

The trace (``_trace``) says when each module's forward and backward start and end, when
each parameter gradient appears, and how many bytes the model's own computation holds in
between. This module walks those events and does, with sizes instead of tensors, what
``fully_shard``'s hooks do at each: all-gather (with the CPU's implicit forward prefetch
and backward's prefetch of the previous group), copy out, reshard (keeping a share for
``reshard_after_forward=int``), hold unsharded gradients until the group's
reduce-scatter, reduce one group at a time, then run the optimizer. Memory is the trace's
bytes plus every buffer the simulation holds, observed after each allocation, so the
transients inside a hook (an all-gather output beside the unsharded buffer it is copied
into, a reduce-scatter input beside the gradients it is filled from) count too.

[Note: the simulation follows the runtime]
Each method below is named after the runtime function it mirrors (``_pre_backward``,
``_unshard``, ``_wait_for_unshard``, ``_reduce_grads``, ``_Pool.empty`` for
``HostBufferPool.empty``...) and allocates and frees in the same order, because the peak
is decided by that order:
large-few's peak is the all-gather output and the unsharded buffer alive together during
the copy-out, twice the analytic bound that counts one of them. What is modelled:
implicit forward prefetch on the CPU, backward prefetch, ``reshard_after_forward``
True/False/int, the root kept unsharded, list groups (one group for several modules),
modules called more than once, activation checkpointing (forwards recomputed in backward),
one reduce-scatter in flight (``set_reduce_scatter_max_input_buffers`` at its default),
the reduce-scatter input's lifetime per backend (gloo copies it when issued, beside ours
until we drop it, and keeps the copy until the wait; NCCL reads ours until the wait; the
fake process group does neither), HSDP's all-reduce, gradient accumulation
without sync, CPU offload (on an accelerator, shards, sharded gradients and the optimizer
count in host memory, apart), the CPU buffer pool ([Note: host buffer pool]), ignored
parameters (whole on every rank, with whole gradients and optimizer state). What is not:
explicit prefetch lists, ``set_reshard_after_backward(False)``, several forwards before
one backward, a ``ReducePolicy`` (its all-to-all exchange holds other buffers), gradients
that some ranks lack (their zeros allocate nothing anyway).
``tests/test_plan.py`` compares the result with measured steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from fsdp2._host_buffers import _CAN_SWAP, MIN_POOLED_BYTES
from fsdp2.plan._layout import GroupLayout, MeshShape
from fsdp2.plan._optimizer import OptimizerMemory
from fsdp2.plan._trace import Trace, TraceEvent

# Categories of the breakdown, in report order.
CATEGORIES = (
    "sharded_params",
    "gradients",
    "optimizer_state",
    "unsharded_params",
    "comm_buffers",
    "activations",
    "temporaries",
    "buffers",
)


@dataclass
class GroupSpec:
    """One planned ``fully_shard`` call as the simulation needs it."""

    modules: tuple[int, ...]  # module indices (several: a list group)
    layout: GroupLayout
    reshard_after_forward: bool
    post_forward_size: int  # reshard_after_forward=int: ranks per backward all-gather
    is_root: bool


@dataclass
class CollectiveCount:
    count: int = 0
    bytes: int = 0  # payload: all-gather output, reduce-scatter input, all-reduce tensor

    def add(self, nbytes: int) -> None:
        self.count += 1
        self.bytes += nbytes


@dataclass
class GroupComm:
    all_gather: CollectiveCount = field(default_factory=CollectiveCount)
    reduce_scatter: CollectiveCount = field(default_factory=CollectiveCount)
    all_reduce: CollectiveCount = field(default_factory=CollectiveCount)


@dataclass
class SimResult:
    peak_bytes: int
    breakdown: dict[str, int]  # CATEGORIES -> bytes live at the peak
    peak_phase: str  # forward | backward | optimizer
    peak_at: str  # the event the peak happened at, for the report
    comm: list[GroupComm]  # per group, per optimizer step
    host_peak_bytes: int = 0  # CPU offload from an accelerator: the host's share


class _Memory:
    """Named buffers with sizes and categories; the peak of them plus the trace's bytes.
    Buffers in host memory while compute runs on an accelerator (CPU offload) are kept
    apart: they count towards ``host_peak``, not the device's peak."""

    def __init__(self) -> None:
        self.host: dict[str, int] = {}
        self.host_total = 0
        self.host_peak = 0
        self.sizes: dict[str, tuple[int, str]] = {}
        self.by_category = dict.fromkeys(CATEGORIES, 0)
        self.total = 0
        self.trace = (0, 0)  # (bytes, of which activations) at the current event
        self.phase = "forward"
        self.where = ""
        self.peak = 0
        self.peak_breakdown = dict.fromkeys(CATEGORIES, 0)
        self.peak_phase = "forward"
        self.peak_at = ""

    def alloc(self, name: str, nbytes: int, category: str, *, host: bool = False) -> None:
        if name in self.sizes or name in self.host:
            raise AssertionError(f"plan simulation: {name} allocated twice")
        if host:
            self.host[name] = nbytes
            self.host_total += nbytes
            self.host_peak = max(self.host_peak, self.host_total)
            return
        self.sizes[name] = (nbytes, category)
        self.by_category[category] += nbytes
        self.total += nbytes
        self.observe()

    def free(self, name: str) -> int:
        if name in self.host:
            nbytes = self.host.pop(name)
            self.host_total -= nbytes
            return nbytes
        nbytes, category = self.sizes.pop(name)
        self.by_category[category] -= nbytes
        self.total -= nbytes
        return nbytes

    def has(self, name: str) -> bool:
        return name in self.sizes or name in self.host

    def size(self, name: str) -> int:
        return self.sizes[name][0]

    def observe(self, trace: tuple[int, int] | None = None) -> None:
        live, fwd = self.trace if trace is None else trace
        total = self.total + live
        if total > self.peak:
            self.peak = total
            self.peak_breakdown = dict(self.by_category)
            self.peak_breakdown["activations"] += fwd
            self.peak_breakdown["temporaries"] += live - fwd
            self.peak_phase = self.phase
            self.peak_at = self.where


class _Pool:
    """``HostBufferPool`` with sizes: kept buffers are live memory (comm buffers)."""

    def __init__(self, memory: _Memory, enabled: bool, slack: int) -> None:
        self.memory = memory
        self.enabled = enabled and _CAN_SWAP
        self.slack = slack
        self.max_buffers = 1
        self.kept: list[str] = []
        self._ids = 0

    def _pooled(self, nbytes: int) -> bool:
        return self.enabled and nbytes >= MIN_POOLED_BYTES

    def _take(self, nbytes: int) -> int | None:
        for i, name in enumerate(self.kept):
            size = self.memory.size(name)
            if nbytes <= size <= nbytes + 2 * self.slack:
                del self.kept[i]
                return self.memory.free(name)
        self.clear()
        return None

    def _keep(self, nbytes: int) -> bool:
        if self.max_buffers < 1:
            return False
        while len(self.kept) >= self.max_buffers:
            self.memory.free(self.kept.pop(0))
        self._ids += 1
        name = f"pool#{self._ids}"
        self.kept.append(name)
        self.memory.alloc(name, nbytes, "comm_buffers")
        return True

    def empty(self, name: str, nbytes: int, category: str) -> None:
        """A new buffer ``name`` of ``nbytes``, from the pool if one fits."""
        if not self._pooled(nbytes):
            self.memory.alloc(name, nbytes, category)
            return
        taken = self._take(nbytes)
        self.memory.alloc(name, taken if taken is not None else nbytes + self.slack, category)

    fill = empty  # the unsharded buffer: same rule (``HostBufferPool.fill``)

    def release(self, name: str) -> None:
        """Give ``name`` back (``release``/``drain``): kept if pooled, else freed."""
        nbytes = self.memory.free(name)
        if self._pooled(nbytes):
            self._keep(nbytes)

    def clear(self) -> None:
        while self.kept:
            self.memory.free(self.kept.pop())


class _State:
    """One group's scheduling state (``FSDPState`` and its ``ParamGroup``)."""

    def __init__(self, index: int, spec: GroupSpec) -> None:
        self.index = index
        self.spec = spec
        self.layout = spec.layout
        self.has_params = bool(spec.layout.params)
        self.unsharded = False
        self.post_forward = False  # holds the share of reshard_after_forward=int
        self.in_flight: tuple[str | None, bool] | None = None  # (output, from post-forward)
        self.pending_calls = 0
        self.open_claims = 0
        self.claims_this_forward = 0
        self.untracked_calls = 0
        self.post_backward_done = False
        self.forward_positions: list[int] = []
        self.next_in_forward: _State | None = None
        self.in_forward = False  # training state FORWARD
        self.modules_to_run: set[int] = set()
        self.hooked_output: int | None = None  # the module whose output arms pre-backward
        self.hook_claims: list[int] = []
        self.grads_unsynced = False


class StepSimulation:
    """One optimizer step (``microbatches`` forward+backward, then the optimizer)."""

    def __init__(
        self,
        specs: Sequence[GroupSpec],
        trace: Trace,
        mesh: MeshShape,
        *,
        param_group: dict[int, int],
        ignored_params: dict[int, int],
        optimizer: OptimizerMemory,
        buffer_bytes: int,
        microbatches: int = 1,
        offload_to_host: bool = False,
    ) -> None:
        self.specs = list(specs)
        self.trace = trace
        self.mesh = mesh
        self.param_group = param_group  # parameter index -> group index
        self.ignored = ignored_params  # parameter index -> its whole bytes (gradient too)
        self.optimizer = optimizer
        self.buffer_bytes = buffer_bytes
        self.microbatches = microbatches
        self.cpu = mesh.device_type == "cpu"
        # CPU offload from an accelerator: shards, sharded gradients and the optimizer live
        # in host memory (on the CPU, offload changes no memory).
        self.offload_to_host = offload_to_host
        # gloo copies the reduce-scatter input when issued, an accelerator's backend reads
        # it until the wait, the fake process group does neither (see [Note:
        # reduce-scatter input lifetime]).
        self.backend = mesh.backend

    # -- set-up --------------------------------------------------------------------------
    def run(self) -> SimResult:
        mem = self.mem = _Memory()
        slack = max(
            (
                s.layout.reduce_flag_slack + s.layout.gap_bytes + s.layout.tail_slack
                for s in self.specs
            ),
            default=0,
        )
        self.pool = _Pool(mem, self.cpu, slack)
        self.states = [_State(i, s) for i, s in enumerate(self.specs)]
        self.comm = [GroupComm() for _ in self.specs]
        self.of_module = {m: st for st in self.states for m in st.spec.modules}
        self.root = next(st for st in self.states if st.spec.is_root)
        # ``TreeContext.states``: in module order (the root's ``modules()`` walk).
        self.tree_states = sorted(self.states, key=lambda st: min(st.spec.modules))
        self.forward_order: list[_State] = []
        self.forward_prefetched: set[int] = set()
        self.last_forward_started: _State | None = None
        self.parked: list[_State] = []
        self.reduces: list[_State] = []
        host = self.offload_to_host
        for st in self.states:
            mem.alloc(f"shard{st.index}", st.layout.shard_bytes, "sharded_params", host=host)
        for p, nbytes in self.ignored.items():
            mem.alloc(f"ignored{p}", nbytes, "sharded_params")
        mem.alloc("optimizer_state", self.optimizer.state_bytes, "optimizer_state", host=host)
        mem.alloc("buffers", self.buffer_bytes, "buffers")
        self._steady_forward_order()
        mem.trace = (self.trace.start_live, self.trace.start_live)
        for micro in range(self.microbatches):
            self.sync = micro == self.microbatches - 1
            mem.phase = "forward"
            for event in self.trace.events:
                self._event(event)
        mem.phase = "optimizer"
        mem.where = "optimizer step"
        end = self.trace.end_live
        if host:  # the optimizer steps the shards where they live
            mem.alloc(
                "optimizer_step", self.optimizer.step_temporary_bytes, "temporaries", host=True
            )
            mem.observe((end, 0))
        else:
            mem.observe((end + self.optimizer.step_temporary_bytes, 0))
        return SimResult(
            mem.peak, mem.peak_breakdown, mem.peak_phase, mem.peak_at, self.comm, mem.host_peak
        )

    def _steady_forward_order(self) -> None:
        """``_next_in_forward`` as the previous step left it: the state whose pre-forward
        followed each one's (the trace's order; every step runs the same)."""
        previous: _State | None = None
        started: set[int] = set()  # list groups: only the first module's pre-forward counts
        for e in self.trace.events:
            if e.kind != "fwd_pre" or e.in_backward:
                continue
            st = self.of_module.get(e.target)
            if st is None or (len(st.spec.modules) > 1 and st.index in started):
                continue
            started.add(st.index)
            if previous is not None and previous is not st:
                previous.next_in_forward = st
            previous = st

    # -- events --------------------------------------------------------------------------
    def _event(self, e: TraceEvent) -> None:
        mem = self.mem
        mem.observe((e.peak_before, e.peak_before_fwd))
        mem.trace = (e.live, e.live_fwd)
        if e.in_backward:
            mem.phase = "backward"
        if e.kind == "grad":
            self._gradient(e.target)
            return
        if e.kind == "end":
            mem.where = "end of backward"
            self._finish_backward()
            return
        st = self.of_module.get(e.target)
        if st is None:
            return
        mem.where = f"{e.kind} of group {st.index}"
        if e.kind == "fwd_pre":
            if e.in_backward:
                self._unshard_and_wait(st)  # a checkpointed forward recomputed
            else:
                self._pre_forward_hook(st, e.target, e.grad_inputs)
        elif e.kind == "fwd_post":
            if not e.in_backward:
                self._post_forward_hook(st, e.target)
        elif e.kind == "bwd_pre":
            if st.hooked_output == e.target and st.hook_claims:
                self._pre_backward(st, st.hook_claims.pop())
        elif e.kind == "bwd_post":
            self._post_backward(st)

    # -- forward (``FSDPState.pre_forward`` / ``post_forward``) ----------------------------
    def _pre_forward_hook(self, st: _State, module: int, grad_inputs: bool) -> None:
        if len(st.spec.modules) > 1:
            if st.modules_to_run:  # ``_pre_forward_again``
                self._unshard_and_wait(st)
                self._claim(st, grad_inputs)
                return
            st.modules_to_run = set(st.spec.modules)
        if st is self.root:
            self.last_forward_started = None
            self.forward_prefetched.clear()
            self.forward_order.clear()
            for other in self.states:
                other.forward_positions.clear()
            self.pool.max_buffers = 2
        self.forward_prefetched.discard(st.index)
        previous = self.last_forward_started
        if previous is not None and previous is not st:
            previous.next_in_forward = st
        self.last_forward_started = st
        st.in_forward = True
        st.claims_this_forward = 0
        if st.has_params:
            self._unshard(st)
            for target in self._implicit_forward_prefetch(st):
                self._unshard(target)
            self._wait_for_unshard(st)
        self._claim(st, grad_inputs)

    def _claim(self, st: _State, grad_inputs: bool) -> None:
        if not st.has_params:
            return
        st.pending_calls += 1
        if grad_inputs:
            st.claims_this_forward += 1
        else:
            st.untracked_calls += 1

    def _implicit_forward_prefetch(self, st: _State) -> list[_State]:
        if not self.cpu:
            return []
        targets: list[_State] = []
        seen = {st.index}
        target = st.next_in_forward
        while target is not None and target.index not in seen:
            seen.add(target.index)
            if target.index in self.forward_prefetched:
                break
            if target.has_params and not target.unsharded:
                targets.append(target)
                self.forward_prefetched.add(target.index)
            if target.spec.reshard_after_forward:
                break
            target = target.next_in_forward
        return targets

    def _post_forward_hook(self, st: _State, module: int) -> None:
        if len(st.spec.modules) > 1:
            if module not in st.modules_to_run:
                return
            st.modules_to_run.discard(module)
            if st.modules_to_run:
                return
        if st is self.root:
            for other in reversed(self.tree_states):
                if other is not st and other.modules_to_run:
                    other.modules_to_run.clear()
                    self._end_forward(other, module)
            for other in self.states:
                if other.index in self.forward_prefetched and not other.in_forward:
                    self._reshard(other)
            self.forward_prefetched.clear()
        self._end_forward(st, module)
        if st is self.root:
            self.pool.clear()
            self.pool.max_buffers = 1

    def _end_forward(self, st: _State, module: int) -> None:
        if st.has_params and st.spec.reshard_after_forward:
            self._reshard(st, post_forward=True)
        st.in_forward = False
        self.forward_order.append(st)
        st.forward_positions.append(len(self.forward_order) - 1)
        st.hooked_output = module
        st.hook_claims.append(st.claims_this_forward)

    # -- backward (``BackwardHooks``) ------------------------------------------------------
    def _pre_backward(self, st: _State, claims: int) -> None:
        st.open_claims += claims
        if self.parked:
            for other in self.parked:
                if other is not st:
                    self._reduce_and_reshard(other)
            self.parked.clear()
        if st.has_params:
            self._unshard_and_wait(st)
        if st.forward_positions:
            position = st.forward_positions.pop()
            previous = position - 1
            while previous >= 0 and self.forward_order[previous] is st:
                previous -= 1
            if previous >= 0:
                target = self.forward_order[previous]
                if target.pending_calls > 0 and target.has_params:
                    self._unshard(target)
        self.pool.clear()

    def _post_backward(self, st: _State) -> None:
        st.open_claims = max(0, st.open_claims - 1)
        if st.pending_calls > 1:
            st.pending_calls -= 1
            if st.open_claims == 0 and st.untracked_calls == 0 and st not in self.parked:
                self.parked.append(st)
            return
        st.pending_calls = 0
        self._reduce_and_reshard(st)
        st.post_backward_done = True

    def _reduce_and_reshard(self, st: _State) -> None:
        if not st.has_params:
            return
        if st.in_flight is not None:
            self._wait_for_unshard(st)
        self._reshard(st)
        if self.sync:
            self._reduce_grads(st)
        else:
            self._accumulate_unsynced(st)

    def _finish_backward(self) -> None:
        """``BackwardHooks._finish_backward``: groups whose post-backward did not run."""
        for st in self.tree_states:
            gathered = st.unsharded or st.in_flight is not None
            if st.pending_calls > 0 or (gathered and not st.post_backward_done):
                st.pending_calls = 1
                self._post_backward(st)
            elif gathered:
                self._reshard(st)
            elif self.sync and st.grads_unsynced:
                self._reduce_grads(st)
            st.post_backward_done = False
            st.open_claims = 0
            st.pending_calls = 0
            st.untracked_calls = 0
            st.forward_positions.clear()
            st.modules_to_run.clear()
            st.hook_claims.clear()
        self._finish_reduces(keep=0)
        self.pool.clear()
        self.parked.clear()
        self.forward_order.clear()

    # -- unshard / reshard (``ParamGroup``) -------------------------------------------------
    def _unshard_and_wait(self, st: _State) -> None:
        if st.has_params:
            if not st.unsharded:
                self._unshard(st)
            self._wait_for_unshard(st)

    def _unshard(self, st: _State) -> None:
        if st.unsharded or st.in_flight is not None:
            return
        layout = st.layout
        from_post_forward = st.post_forward
        size = st.spec.post_forward_size
        nbytes = (
            layout.post_forward_gather_bytes(size) if from_post_forward else layout.all_gather_bytes
        )
        if layout.gathers_in_place:
            self.pool.fill(f"unsharded{st.index}", layout.unsharded_bytes, "unsharded_params")
            output = None
        else:
            output = f"gather{st.index}"
            self.pool.empty(output, nbytes, "comm_buffers")
        if self.mesh.shard > 1:
            self.comm[st.index].all_gather.add(nbytes)
        st.in_flight = (output, from_post_forward)
        st.post_forward = False

    def _wait_for_unshard(self, st: _State) -> None:
        if st.in_flight is None:
            return
        output, from_post_forward = st.in_flight
        st.in_flight = None
        if output is not None:
            self.pool.fill(f"unsharded{st.index}", st.layout.unsharded_bytes, "unsharded_params")
            self.pool.release(output)  # after the copy-out
        if from_post_forward:
            self.mem.free(f"post_forward{st.index}")  # the all-gather input, done
        st.unsharded = True

    def _reshard(self, st: _State, *, post_forward: bool = False) -> None:
        if st.in_flight is not None:
            self._wait_for_unshard(st)
        if not st.unsharded:
            return
        size = st.spec.post_forward_size
        if post_forward and size > 1:
            nbytes = st.layout.post_forward_bytes(size)
            self.mem.alloc(f"post_forward{st.index}", nbytes, "unsharded_params")
            st.post_forward = True
        self.pool.release(f"unsharded{st.index}")
        st.unsharded = False

    # -- gradients (``GradientReduction``) --------------------------------------------------
    def _gradient(self, param: int) -> None:
        mem = self.mem
        if param in self.ignored:
            if not mem.has(f"ignored_grad{param}"):
                mem.alloc(f"ignored_grad{param}", self.ignored[param], "gradients")
            return
        group = self.param_group.get(param)
        if group is None:
            return
        name = f"grad{param}"
        if not mem.has(name):
            layout = self.states[group].layout
            info = next(p for p in layout.params if p.index == param)
            if info.requires_grad:
                mem.alloc(name, layout.unsharded_grad_bytes(info), "gradients")

    def _accumulate_unsynced(self, st: _State) -> None:
        """``accumulate_unsynced``: gradients narrower than the reduce dtype are summed
        into a copy in that dtype; others stay on the unsharded parameters."""
        st.grads_unsynced = True
        layout = st.layout
        for p in layout.trainable:
            name = f"grad{p.index}"
            if not self.mem.has(name) or layout.compute_itemsize[p.index] == layout.reduce_itemsize:
                continue
            total = f"grad_sum{p.index}"
            if not self.mem.has(total):
                self.mem.alloc(total, p.numel * layout.reduce_itemsize, "gradients")
            self.mem.free(name)

    def _reduce_grads(self, st: _State) -> None:
        st.grads_unsynced = False
        layout = st.layout
        if not layout.reduce_numel:
            return
        mem, i = self.mem, st.index
        mem.alloc(f"flags{i}", layout.flags_bytes, "comm_buffers")
        self._finish_reduces(keep=0)
        self.pool.empty(f"reduce_input{i}", layout.reduce_input_bytes, "comm_buffers")
        for p in layout.trainable:  # copied in: the unsharded gradients die
            for name in (f"grad{p.index}", f"grad_sum{p.index}"):
                if mem.has(name):
                    mem.free(name)
        mem.free(f"flags{i}")
        if self.mesh.shard == 1:  # no collective: the input is the reduced shard
            nbytes = mem.free(f"reduce_input{i}")
            mem.alloc(f"reduced{i}", nbytes, "gradients")
        else:
            mem.alloc(f"reduced{i}", layout.reduce_output_bytes, "gradients")
            self.comm[i].reduce_scatter.add(layout.reduce_input_bytes)
            if self.backend == "gloo":  # copies the input at the issue; ours is dropped then
                mem.alloc(f"reduce_held{i}", layout.reduce_input_bytes, "comm_buffers")
                mem.free(f"reduce_input{i}")
            elif self.backend == "fake":  # reads nothing later
                mem.free(f"reduce_input{i}")
            else:  # an accelerator's backend reads the input until the wait
                mem.alloc(f"reduce_held{i}", mem.free(f"reduce_input{i}"), "comm_buffers")
        self.reduces.append(st)

    def _finish_reduces(self, keep: int) -> None:
        while len(self.reduces) > keep:
            self._finish_reduce(self.reduces.pop(0))

    def _finish_reduce(self, st: _State) -> None:
        mem, i, layout = self.mem, st.index, st.layout
        if mem.has(f"reduce_held{i}"):
            mem.free(f"reduce_held{i}")
        if self.mesh.replicate > 1:
            self.comm[i].all_reduce.add(layout.reduce_output_bytes)
        if layout.grad_copy_bytes:  # gradients stored in another dtype or device
            mem.alloc(
                f"grad_shards{i}", layout.grad_copy_bytes, "gradients", host=self.offload_to_host
            )
            if not layout.grads_view_reduced:
                mem.free(f"reduced{i}")
