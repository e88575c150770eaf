"""Per-step instrumentation that works without CUDA: live tensor memory, copy bytes, c10d ops.

``StepProbe`` is one ``TorchDispatchMode`` doing three jobs while a single training step runs:

* **Live storage tracking.** Every tensor that passes through the dispatcher (inputs and
  outputs of every op) has its untyped storage registered once, keyed by the address of the
  C++ ``StorageImpl`` (``storage._cdata``), with its current ``nbytes()``. A ``weakref`` to the
  Python storage object removes it when the storage dies (storages keep their Python object
  alive as long as the ``StorageImpl`` lives, so the callback fires exactly at free time).
  Storages grown or freed in place are followed in two ways: ``torch.UntypedStorage.resize_``
  is wrapped while the probe is active (FSDP implementations free unsharded parameters with
  ``untyped_storage().resize_(0)`` and re-allocate them with ``resize_(n)``; fsdp2's CPU
  buffer pool moves memory between storages with ``_swap_data_ptr_``, wrapped the same way),
  and after every
  op the storages of its arguments are re-measured (``aten.resize_``, ``aten.set_``...).
  Tensor subclasses (DTensor) are flattened to their inner local tensors, so sizes are local.
  Tensors that exist before the step (parameters, gradients, optimizer state, buffers) are
  registered explicitly by :meth:`StepProbe.register`. A registered storage whose bytes lie
  inside another registered storage (fsdp2's shards are DLPack aliases of slots of one flat
  buffer, each a storage of its own) counts as that outer storage, not twice.

* **Copy bytes.** Bytes written by copy-like ops (see :data:`COPY_OP_NAMES`): for ops with
  mutated arguments (``copy_``, ``_foreach_copy_``, ``split_with_sizes_copy.out``,
  ``cat.out``, ``fsdp::chunk_cat``...) the local bytes of the mutated tensors; for functional
  ones (``_to_copy``, ``cat``, ``clone``, ``_chunk_cat``...) the bytes of the returned
  tensors; ``fsdp::all_gather_copy_in`` counts its first output (this rank's slice).
  The inner ops of a custom op or of DTensor's dispatch are not seen again (the mode is
  disabled while it handles an op), so nothing is counted twice.

* **c10d ops at the dispatcher.** Every ``c10d::*`` / ``_c10d_functional::*`` op (which is how
  every ProcessGroup collective reaches its backend, whatever Python API called it), with its
  count and the local bytes of its tensor arguments. A cross-check for :mod:`benchmarks.comm`.

At the peak of live bytes the probe keeps a snapshot (storage uid -> bytes), taken lazily just
before the first decrease after a new maximum, so it is exact and cheap. :meth:`categorize`
then labels the peak by what owns each storage at the end of the step (parameters, gradients,
optimizer state) and, for the rest, by flags gathered while the step ran.

Limitations: temporaries created *inside* a single kernel or inside a DTensor/custom-op
dispatch and freed before it returns are invisible (the allocator is never consulted), and so
is memory that backends allocate outside the PyTorch allocator (gloo's own buffers), with one
modelled exception:

* **gloo's reduce-scatter copy.** gloo's ``reduce_scatter_tensor`` clones its whole input when
  the collective is issued, all-reduces the clone, and in ``Work.wait()`` splits it and copies
  this rank's chunk out (``benchmarks/gloo_collective_memory.py`` measures it). The clone is
  allocated in C++, so the dispatcher first sees it at that ``aten.split``. A synchronous
  reduce-scatter (torch's CPU path) waits at once, but an asynchronous one (fsdp2 overlaps it
  with the next block's backward) keeps the clone alive, unseen, until the wait. The probe
  therefore charges the input's bytes from the issue of a reduce-scatter on a gloo group
  (flagged ``comm``) and moves the charge onto the clone's storage when the split surfaces it
  (or drops it when the chunk is copied out, if no split is seen).
"""

from __future__ import annotations

import collections
import functools
import itertools
import threading
import types
import weakref
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

# Op names (without namespace and overload) whose written bytes count as "copies".
COPY_OP_NAMES = frozenset(
    {
        "copy_",
        "_foreach_copy_",
        "split_with_sizes_copy",
        "_chunk_cat",
        "chunk_cat",
        "cat",
        "_to_copy",
        "clone",
        "all_gather_copy_in",
        "_copy_from",
        "_copy_from_and_resize",
        "stack",
    }
)
COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd"})
NON_COLLECTIVE_C10D = frozenset({"wait_tensor", "wait", "monitored_barrier"})

# Categories reported for the peak, in display order.
CATEGORIES = (
    "params",
    "grads",
    "optim_state",
    "unsharded_params",
    "comm_buffers",
    "activations_fwd",
    "bwd_temporaries",
    "optim_temporaries",
    "other",
)

_active: list[StepProbe] = []
_resize_lock = threading.Lock()
_orig_resize: Any = None
_orig_swap: Any = None


def local_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """Plain tensors backing ``t`` (recursing through traceable wrapper subclasses)."""
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        for name in attrs:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):  # DTensor also lists its (opaque) device mesh
                yield from local_tensors(inner)
    else:
        yield t


def outer_storages(
    storages: Iterable[torch.UntypedStorage],
) -> dict[int, torch.UntypedStorage]:
    """Map every storage (by ``_cdata``) whose bytes lie inside another storage of
    ``storages`` to the outermost such storage. Storages that alias memory without sharing a
    ``StorageImpl`` (DLPack aliases of slices of one buffer) would otherwise count twice."""
    spans = []
    for st in storages:
        n = st.nbytes()
        if n:
            ptr = st.data_ptr()
            spans.append((str(st.device), ptr, -(ptr + n), st))
    spans.sort(key=lambda x: x[:3])
    out: dict[int, torch.UntypedStorage] = {}
    outer: tuple[str, int, int, torch.UntypedStorage] | None = None
    for device, ptr, neg_end, st in spans:
        if outer is not None and device == outer[0] and -neg_end <= -outer[2]:
            if st._cdata != outer[3]._cdata:
                out[st._cdata] = outer[3]
        else:
            outer = (device, ptr, neg_end, st)
    return out


def distinct_nbytes(ts: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct memory behind ``ts`` (local tensors of subclasses; a storage
    inside another counts once, see :func:`outer_storages`)."""
    storages = {}
    for t in ts:
        for lt in local_tensors(t):
            st = lt.untyped_storage()
            storages[st._cdata] = st
    inner = outer_storages(storages.values())
    return sum(st.nbytes() for key, st in storages.items() if key not in inner)


def local_nbytes(t: torch.Tensor) -> int:
    return sum(lt.numel() * lt.element_size() for lt in local_tensors(t))


_SKIP_TYPES = (
    type,
    types.ModuleType,
    types.BuiltinFunctionType,
    types.CodeType,
    types.FrameType,
    weakref.ReferenceType,
    str,
    bytes,
    int,
    float,
    bool,
    complex,
    torch.dtype,
    torch.device,
)


def reachable_tensors(*roots: Any, limit: int = 1_000_000) -> list[torch.Tensor]:
    """Tensors reachable from ``roots`` through instance attributes and containers.

    Used to register an implementation's persistent internal buffers (all-gather/reduce-scatter
    buffers kept across steps, flat parameter storage...) before the step, so that a buffer
    first touched after the peak still counts at the peak. Python modules, classes, function
    globals and weak references are not followed, so the walk stays inside the objects owned
    by the model and optimizer (hooks are followed through bound methods, partials and
    closures, which is how FSDP state hangs off a module).
    """
    seen: set[int] = set()
    out: list[torch.Tensor] = []
    stack = list(roots)
    while stack and len(seen) < limit:
        o = stack.pop()
        if o is None or id(o) in seen or isinstance(o, _SKIP_TYPES):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            out.append(o)
            d = getattr(o, "__dict__", None)
            if d:
                stack.extend(d.values())
            continue
        if isinstance(o, types.MethodType):
            stack += [o.__self__, o.__func__]
            continue
        if isinstance(o, types.FunctionType):
            stack += [c.cell_contents for c in (o.__closure__ or ()) if _cell_ok(c)]
            continue
        if isinstance(o, functools.partial):
            stack += [o.func, *o.args, *o.keywords.values()]
            continue
        if isinstance(o, dict):
            stack += list(o.keys()) + list(o.values())
            continue
        if isinstance(o, (list, tuple, set, frozenset, collections.deque)):
            stack += list(o)
            continue
        d = getattr(o, "__dict__", None)
        if isinstance(d, dict):
            stack += list(d.values())
        for cls in type(o).__mro__:
            for slot in getattr(cls, "__slots__", ()):
                if isinstance(slot, str) and slot not in ("__dict__", "__weakref__"):
                    stack.append(getattr(o, slot, None))
    return out


def _cell_ok(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - empty cells raise
    except ValueError:
        return False
    return True


def _collective_kind(op_name: str) -> str:
    if "allgather" in op_name or "all_gather" in op_name:
        return "all_gather"
    if "reduce_scatter" in op_name:
        return "reduce_scatter"
    if "allreduce" in op_name or "all_reduce" in op_name:
        return "all_reduce"
    return "other"


def _on_gloo(args: tuple) -> bool:
    """Whether a c10d op's process group argument is a gloo group."""
    import torch.distributed as dist

    for arg in args:
        if isinstance(arg, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(arg).name() == "gloo"
            except RuntimeError:  # another custom class (the ReduceOp)
                continue
    return False


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    leaves, _ = tree_flatten(obj)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            yield leaf


def _storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    if t.device.type == "meta":
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse / functional wrappers
        return None


def _patched_resize(self: torch.UntypedStorage, size: int) -> Any:
    out = _orig_resize(self, size)
    for probe in _active:
        probe._track(self, origin=None)
    return out


def _patched_swap(self: torch.UntypedStorage, other: torch.UntypedStorage) -> Any:
    out = _orig_swap(self, other)
    # The side that lost memory first, so the move never looks like a new peak.
    pair = sorted((self, other), key=lambda st: st.nbytes())
    for probe in _active:
        for st in pair:
            probe._track(st, origin=None)
    return out


def _install_resize_hook() -> None:
    global _orig_resize, _orig_swap
    with _resize_lock:
        if _orig_resize is None:
            _orig_resize = torch.UntypedStorage.resize_
            torch.UntypedStorage.resize_ = _patched_resize  # type: ignore[method-assign]
        # fsdp2 moves pooled CPU buffers in and out of storages this way.
        if _orig_swap is None and hasattr(torch.UntypedStorage, "_swap_data_ptr_"):
            _orig_swap = torch.UntypedStorage._swap_data_ptr_
            torch.UntypedStorage._swap_data_ptr_ = _patched_swap  # type: ignore[method-assign]


def _remove_resize_hook() -> None:
    global _orig_resize, _orig_swap
    with _resize_lock:
        if _orig_resize is not None and not _active:
            if "resize_" in torch.UntypedStorage.__dict__:
                del torch.UntypedStorage.resize_
            if torch.UntypedStorage.resize_ is not _orig_resize:
                torch.UntypedStorage.resize_ = _orig_resize  # type: ignore[method-assign]
            _orig_resize = None
        if _orig_swap is not None and not _active:
            if "_swap_data_ptr_" in torch.UntypedStorage.__dict__:
                del torch.UntypedStorage._swap_data_ptr_
            _orig_swap = None


class _Rec:
    __slots__ = ("flags", "nbytes", "origin", "persistent", "uid", "wref")

    def __init__(self, uid: int, nbytes: int, origin: str, persistent: bool) -> None:
        self.uid = uid
        self.nbytes = nbytes
        self.origin = origin
        self.persistent = persistent
        self.flags: set[str] = set()
        self.wref: Any = None


class StepProbe(TorchDispatchMode):
    """Dispatch mode measuring live bytes, copy bytes and c10d ops over one step."""

    def __init__(self, track_memory: bool = True) -> None:
        super().__init__()
        self.track_memory = track_memory
        self.phase = "fwd"
        self._uids = itertools.count()
        self._live: dict[int, _Rec] = {}
        self.total = 0
        self.persistent_live = 0
        self.peak = 0
        self.start_bytes = 0
        self._snapshot_due = False
        self._snapshot: dict[int, int] = {}
        self._snapshot_phase = ""
        self._phase_at_peak = ""
        self.transient_peak_by_phase: dict[str, int] = defaultdict(int)
        self.copy_bytes: Counter[str] = Counter()
        self.copy_calls: Counter[str] = Counter()
        self.c10d_calls: Counter[str] = Counter()
        self.c10d_bytes: Counter[str] = Counter()
        self.op_calls = 0
        # Copies classified by the collective they feed or drain (see _classify_copy).
        self.copy_role_bytes: Counter[str] = Counter()
        self._pending_copy: dict[int, tuple[Any, int]] = {}  # storage -> (weakref, bytes)
        self._coll_out: dict[int, tuple[Any, str]] = {}  # storage -> (weakref, collective kind)
        self._flags_by_uid: dict[int, set[str]] = {}
        self._origin_by_uid: dict[int, str] = {}
        # Registered storages inside another registered storage -> that storage.
        self._registered: dict[int, torch.UntypedStorage] = {}
        self._outer: dict[int, torch.UntypedStorage] = {}
        # gloo reduce-scatters in flight: output storage key -> (charge key, input bytes).
        self._gloo_clones: dict[int, tuple[int, int]] = {}
        self._charge_keys = itertools.count(-1, -1)  # never a real storage's _cdata

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> StepProbe:
        if self.track_memory:
            _active.append(self)
            _install_resize_hook()
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        if self.track_memory:
            _active.remove(self)
            _remove_resize_hook()
            if self._snapshot_due:
                self._take_snapshot()

    def close(self) -> None:
        """Drop every weakref so no callback outlives the probe."""
        for rec in list(self._live.values()):
            rec.wref = None
        self._live.clear()
        self._pending_copy.clear()
        self._coll_out.clear()
        self._registered.clear()
        self._outer.clear()

    # ------------------------------------------------------------------ registration
    def register(self, tensors: Iterable[torch.Tensor], persistent: bool = True) -> None:
        """Register tensors that exist before the step (params, grads, optimizer state)."""
        for t in tensors:
            for lt in local_tensors(t):
                st = _storage_of(lt)
                if st is not None:
                    self._registered[st._cdata] = st
                    self._track(st, origin="pre", persistent=persistent)
        self._merge_inner_storages()
        self.start_bytes = self.total
        self.peak = max(self.peak, self.total)
        self._snapshot_due = True

    def _merge_inner_storages(self) -> None:
        """Count each registered storage lying inside another as that outer storage."""
        for key, outer in outer_storages(self._registered.values()).items():
            self._outer[key] = outer
            rec = self._live.pop(key, None)
            if rec is not None and rec.nbytes:
                self._grow(-rec.nbytes, rec.persistent)
            self._track(outer, origin="pre", persistent=bool(rec and rec.persistent))

    def uid_of(self, t: torch.Tensor) -> list[int]:
        out = []
        for lt in local_tensors(t):
            st = _storage_of(lt)
            if st is not None:
                st = self._outer.get(st._cdata, st)
                rec = self._live.get(st._cdata)
                if rec is not None:
                    out.append(rec.uid)
        return out

    def _take_snapshot(self) -> None:
        # list() copies the values in one C call: a free callback running on another thread
        # (the last reference to a storage can drop anywhere) cannot change it mid-iteration.
        recs = list(self._live.values())
        self._snapshot = {rec.uid: rec.nbytes for rec in recs if rec.nbytes}
        self._flags_by_uid = {rec.uid: set(rec.flags) for rec in recs}
        self._origin_by_uid = {rec.uid: rec.origin for rec in recs}
        self._snapshot_phase = self._phase_at_peak
        self._snapshot_due = False

    def _grow(self, delta: int, persistent: bool) -> None:
        if delta < 0 and self._snapshot_due:
            self._take_snapshot()
        self.total += delta
        if persistent:
            self.persistent_live += delta
        if self.total > self.peak:
            self.peak = self.total
            self._phase_at_peak = self.phase
            self._snapshot_due = True
        transient = self.total - self.persistent_live
        if transient > self.transient_peak_by_phase[self.phase]:
            self.transient_peak_by_phase[self.phase] = transient

    def _track(
        self, st: torch.UntypedStorage, origin: str | None, persistent: bool = False
    ) -> _Rec:
        st = self._outer.get(st._cdata, st)
        key = st._cdata
        n = st.nbytes()
        rec = self._live.get(key)
        if rec is None:
            rec = _Rec(next(self._uids), 0, origin or self.phase, persistent)
            self._live[key] = rec
            rec.wref = weakref.ref(st, self._make_free_cb(key, rec.uid))
        if n != rec.nbytes:
            delta = n - rec.nbytes
            if delta < 0 and self._snapshot_due:
                self._take_snapshot()  # before the record changes: the snapshot is the peak
            rec.nbytes = n
            self._grow(delta, rec.persistent)
        return rec

    def _make_free_cb(self, key: int, uid: int) -> Any:
        def _on_free(_ref: object) -> None:
            rec = self._live.get(key)
            if rec is not None and rec.uid == uid:
                if rec.nbytes and self._snapshot_due:
                    self._take_snapshot()
                del self._live[key]
                if rec.nbytes:
                    self._grow(-rec.nbytes, rec.persistent)

        return _on_free

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        self.op_calls += 1
        schema = func._schema
        ns = schema.name.split("::")[0] if "::" in schema.name else "aten"
        name = func.__name__.split(".")[0]
        is_coll = ns in COLLECTIVE_NAMESPACES and name not in NON_COLLECTIVE_C10D
        in_tensors = list(_tensors((args, kwargs)))
        if is_coll:
            self.c10d_calls[f"{ns}::{name}"] += 1
            self.c10d_bytes[f"{ns}::{name}"] += sum(local_nbytes(t) for t in in_tensors)
            self._note_collective(schema, name, args, kwargs)

        if self.track_memory and self._gloo_clones and name in ("split", "copy_"):
            self._settle_gloo_clone(name, in_tensors)
        out = func(*args, **kwargs)
        if self.track_memory and is_coll and "reduce_scatter" in name and _on_gloo(args):
            self._charge_gloo_clone(schema, args, kwargs)

        if name in COPY_OP_NAMES:
            self._count_copy(func, schema, name, args, kwargs, out)
        if self.track_memory:
            for t in in_tensors:
                param_like = isinstance(t, torch.nn.Parameter)
                for lt in local_tensors(t):
                    st = _storage_of(lt)
                    if st is None:
                        continue
                    rec = self._track(st, origin="pre")
                    if param_like:
                        rec.flags.add("param")
                    if is_coll:
                        rec.flags.add("comm")
            for t in _tensors(out):
                for lt in local_tensors(t):
                    st = _storage_of(lt)
                    if st is not None:
                        rec = self._track(st, origin=None)
                        if is_coll:
                            rec.flags.add("comm")
        return out

    def _charge_gloo_clone(self, schema: Any, args: tuple, kwargs: dict) -> None:
        """Charge gloo's hidden clone of a reduce-scatter input from the issue on (see the
        module docstring), keyed by the output that its wait fills."""
        in_bytes, out_key = 0, None
        for i, arg in enumerate(schema.arguments):
            val = kwargs.get(arg.name, args[i] if i < len(args) else None)
            for t in _tensors(val):
                st = _storage_of(t)
                if st is None:
                    continue
                if "input" in arg.name:
                    in_bytes += t.numel() * t.element_size()
                elif "output" in arg.name:
                    out_key = st._cdata
        if not in_bytes or out_key is None:
            return
        charge = next(self._charge_keys)
        rec = _Rec(next(self._uids), in_bytes, self.phase, False)
        rec.flags.add("comm")
        self._live[charge] = rec
        self._gloo_clones[out_key] = (charge, in_bytes)
        self._grow(in_bytes, False)

    def _settle_gloo_clone(self, name: str, in_tensors: list[torch.Tensor]) -> None:
        """End a charge where the wait surfaces the clone: at the ``split`` of a storage
        never seen before with the charged size (which is then tracked as usual), or at the
        ``copy_`` into the reduce-scatter's output."""
        if not in_tensors:
            return
        st = _storage_of(in_tensors[0])
        if st is None:
            return
        key = st._cdata
        if name == "copy_":
            found = self._gloo_clones.pop(key, None)
        elif key in self._live:
            return
        else:
            nbytes = st.nbytes()
            out_key = next((k for k, v in self._gloo_clones.items() if v[1] == nbytes), None)
            found = self._gloo_clones.pop(out_key) if out_key is not None else None
        if found is not None:
            rec = self._live.pop(found[0], None)
            if rec is not None:
                self._grow(-rec.nbytes, False)

    def _note_collective(self, schema: Any, name: str, args: tuple, kwargs: dict) -> None:
        """Attribute pending copies into this collective's inputs; remember its outputs.

        c10d schemas carry no alias annotations, so inputs and outputs are told apart by the
        argument name (``input*`` / ``output*``; an all-reduce's ``tensors`` are both).
        """
        kind = _collective_kind(name)
        for i, arg in enumerate(schema.arguments):
            val = kwargs.get(arg.name, args[i] if i < len(args) else None)
            is_in = "output" not in arg.name
            is_out = "input" not in arg.name
            for t in _tensors(val):
                for lt in local_tensors(t):
                    st = _storage_of(lt)
                    if st is None:
                        continue
                    key = st._cdata
                    if is_in:
                        pending = self._pending_copy.pop(key, None)
                        if pending is not None and pending[0]() is not None:
                            self.copy_role_bytes[f"{kind}_copy_in"] += pending[1]
                    if is_out:
                        self._coll_out[key] = (weakref.ref(st), kind)

    def _count_copy(self, func, schema, name, args, kwargs, out) -> None:  # type: ignore[no-untyped-def]
        key = f"{func.namespace}::{name}" if func.namespace != "aten" else name
        written = 0
        dests: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        if name == "all_gather_copy_in":
            written = local_nbytes(out[0])
            dests = [out[0]]
            sources = [t for t in _tensors((args, kwargs))]
        else:
            mutated = False
            for i, arg in enumerate(schema.arguments):
                val = kwargs.get(
                    arg.name, args[i] if i < len(args) and not arg.kwarg_only else None
                )
                if arg.alias_info is None or not arg.alias_info.is_write:
                    sources += list(_tensors(val))
                    continue
                mutated = True
                dests += list(_tensors(val))
            if mutated:
                written = sum(local_nbytes(t) for t in dests)
            else:
                dests = list(_tensors(out))
                written = sum(local_nbytes(t) for t in dests)
        self.copy_bytes[key] += written
        self.copy_calls[key] += 1
        self._classify_copy(written, dests, sources)

    def _classify_copy(
        self, written: int, dests: list[torch.Tensor], sources: list[torch.Tensor]
    ) -> None:
        """A copy reading a collective's output is that collective's copy-out; any other copy
        is pending until its destination is (copy-in) or is not (other) fed to a collective."""
        for t in sources:
            for lt in local_tensors(t):
                st = _storage_of(lt)
                hit = self._coll_out.get(st._cdata) if st is not None else None
                if hit is not None and hit[0]() is not None:
                    self.copy_role_bytes[f"{hit[1]}_copy_out"] += written
                    return
        for t in dests:
            for lt in local_tensors(t):
                st = _storage_of(lt)
                if st is None:
                    continue
                ref, before = self._pending_copy.get(st._cdata, (None, 0))
                if ref is None or ref() is None:
                    ref, before = weakref.ref(st), 0
                self._pending_copy[st._cdata] = (ref, before + written)
                written = 0  # a multi-output copy is attributed once, to its first output

    # ------------------------------------------------------------------ results
    def categorize(
        self,
        params: Iterable[torch.Tensor],
        grads: Iterable[torch.Tensor],
        optim_state: Iterable[torch.Tensor],
    ) -> dict[str, int]:
        """Split the peak snapshot by owner. Call at the end of the step, before freeing."""
        owner: dict[int, str] = {}
        for cat, ts in (("optim_state", optim_state), ("grads", grads), ("params", params)):
            for t in ts:
                for uid in self.uid_of(t):
                    owner[uid] = cat
        out = dict.fromkeys(CATEGORIES, 0)
        for uid, nbytes in self._snapshot.items():
            cat = owner.get(uid)
            if cat is None:
                flags = self._flags_by_uid.get(uid, set())
                origin = self._origin_by_uid.get(uid, "")
                if "comm" in flags:
                    cat = "comm_buffers"
                elif "param" in flags:
                    cat = "unsharded_params"
                elif origin == "fwd":
                    cat = "activations_fwd"
                elif origin == "bwd":
                    cat = "bwd_temporaries"
                elif origin == "opt":
                    cat = "optim_temporaries"
                else:
                    cat = "other"
            out[cat] += nbytes
        return out

    def copy_roles(self) -> dict[str, int]:
        """Copy bytes by role: ``{all_gather,reduce_scatter,all_reduce}_copy_{in,out}`` and
        ``other`` (copies that neither fed nor drained a collective)."""
        roles = {
            f"{k}_copy_{d}": 0 for k in ("all_gather", "reduce_scatter") for d in ("in", "out")
        }
        roles.update(self.copy_role_bytes)
        roles["other"] = sum(self.copy_bytes.values()) - sum(self.copy_role_bytes.values())
        return roles

    def summary(self) -> dict[str, Any]:
        return {
            "copy_roles": self.copy_roles(),
            "memory_tracked": self.track_memory,
            "peak_bytes": self.peak,
            "start_bytes": self.start_bytes,
            "peak_phase": self._snapshot_phase,
            "transient_peak_by_phase": dict(self.transient_peak_by_phase),
            "copy_bytes": dict(self.copy_bytes),
            "copy_calls": dict(self.copy_calls),
            "copy_bytes_total": sum(self.copy_bytes.values()),
            "c10d_calls": dict(self.c10d_calls),
            "c10d_arg_bytes": dict(self.c10d_bytes),
            "c10d_calls_total": sum(self.c10d_calls.values()),
            "dispatched_ops": self.op_calls,
        }
