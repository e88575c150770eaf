"""Optimizer steps on the plain local shards of fsdp2's parameters.

Every fsdp2 parameter is a ``DTensor`` whose local tensor is this rank's shard, and its
gradient and optimizer state are ``DTensor``s of the same placements. An elementwise
optimizer (Adam, SGD, ...) computes each element of the new value from the same element of
the parameter, its gradient and its state, so the step needs no other rank and no
``DTensor`` at all. Through ``DTensor`` it still pays sharding propagation on every op
(every parameter on the for-loop path): on the CPU most of an AdamW step, and
per-parameter Python work at any size. This module runs the same ``torch.optim`` code on
the local tensors instead, and is never imported by the runtime.

[Note: optimizer steps on local shards]
Nothing changes for the user: ``torch.optim.AdamW(model.parameters())`` holds the
``DTensor`` parameters, ``optimizer.state`` and ``state_dict()`` hold ``DTensor`` state,
and the step hooks see both. A global optimizer step pre-hook (installed when this module
is imported, i.e. by ``import fsdp2``) hands the step function a *view* of the optimizer in
place of the optimizer itself: torch's step wrapper calls the step with the arguments the
last pre-hook returned, so the view is what the step's own code sees as ``self``, and only
it. Every pre-hook and post-hook still gets the optimizer itself (only the ``args`` tuple
they are passed holds the view as its first element).

The view is an instance of a subclass of the optimizer's class, with the optimizer's
attributes, whose ``param_groups`` and ``state`` are built when the step first reads them,
after every pre-hook (a learning-rate change made in a hook is seen) and after the
closure (its backward's gradients are seen; a closure given to the step runs first and
the view is built again after it):

* each parameter group is a copy of the optimizer's with, in place of each fsdp2
  parameter, an alias of its local tensor (``detach()``: the same memory and version
  counter) whose ``.grad`` is the local tensor of the ``DTensor`` gradient. Plain
  parameters stay as they are. The aliases die with the view, so nothing the step leaves
  behind holds a gradient alive, and an exception inside the step leaves nothing half
  swapped. Writes to a group's hyperparameters go to the optimizer's group too;
* ``state[alias]`` is a dict of the local tensors of the parameter's ``DTensor`` state.
  Writes go through at once: a new state tensor of the local shard's shape (the
  ``zeros_like`` a first step makes) is stored in the optimizer's state wrapped in a
  ``DTensor`` of the parameter's mesh, placements and global shape, sharing its storage
  (no copy), exactly what the step on ``DTensor``s would have stored; a scalar (``step``)
  is stored as it is. So lazily created state, ``add_param_group`` after the first step
  and a step that raises midway all leave the optimizer's state as torch's path would;
* attributes the step sets on ``self`` are set on the optimizer too.

Per optimizer and parameter the fast path keeps what it has checked (``_Record``: the
gradient's layout, the state's objects), so a step compares object identities and
re-checks a layout only when an object changed: a gradient or state tensor replaced, a
state dict loaded, a shard bound anew by fsdp2 (``_if_unchanged`` is that identity check,
``_local_entry`` the whole one). It holds tensors weakly, so state the optimizer drops is
freed at once. Its cost is about 7 microseconds of CPU time per parameter (small-many,
caches cold), against one ``DTensor`` dispatch per op and parameter on torch's for-loop
path.

The result is bitwise what the same optimizer computes on the ``DTensor``s (the same
kernels on the same local tensors; ``_foreach_*`` and fused kernels group by device and
dtype alike). A group keeps the ``DTensor`` path when the step could not be elementwise
on the shards or would see something else than torch's path: a ``DTensor`` that fsdp2
does not manage with a gradient (a ``foreach`` list may not mix it with plain tensors), a
gradient whose layout differs from its parameter's, a local tensor of a tensor subclass
(all-gather extensions), state held with other placements, or ``differentiable=True``
(the step must build an autograd graph through the parameters; with leaf parameters torch
then raises, and so does this path).

Which optimizers are elementwise is an allow-list of classes (exact class, not
subclasses, which may override the step): torch's SGD, Adam, AdamW, Adagrad, RMSprop,
NAdam, RAdam, Adamax, Adadelta, ASGD and Rprop. LBFGS (dot products over whole
parameters), Adafactor (row and column statistics), Muon (orthogonalises whole matrices)
and any other optimizer keep the ``DTensor`` path; ``register_elementwise_optimizer`` adds
a class whose step is elementwise. The switch ``set_optimizer_fast_path(False)`` (or
``FSDP2_OPTIMIZER_FAST_PATH=0``, read once) restores the ``DTensor`` path everywhere.

Mistakes the ``DTensor`` path would turn into a confusing error, a broadcast or a lost
update raise here, naming the parameter: optimizer state that is a plain tensor or a
``DTensor`` of another shape (a full or foreign state dict loaded with
``optimizer.load_state_dict``), and a local shard whose memory was replaced since the
last step (``.data =`` or ``set_`` on ``to_local()``: the all-gather keeps reading the
old memory, so neither the step nor the next forward would see the new one).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.optim.optimizer import Optimizer, register_optimizer_step_pre_hook

from fsdp2._param import _SHARD_OWNERS, ShardedParam, owner_of, shard_binding
from fsdp2._switches import read_switch

__all__ = [
    "optimizer_fast_path_enabled",
    "register_elementwise_optimizer",
    "set_optimizer_fast_path",
]

ENV_VAR = "FSDP2_OPTIMIZER_FAST_PATH"

# Classes whose step computes each element from the same element of the parameter, its
# gradient and its state (and scalars): see [Note: optimizer steps on local shards].
_ELEMENTWISE: set[type] = {
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adamax,
    torch.optim.Adadelta,
    torch.optim.ASGD,
    torch.optim.Rprop,
}

_enabled: bool | None = None  # None: not decided yet (the environment is read once)


def set_optimizer_fast_path(enabled: bool) -> None:
    """Turn the optimizer fast path on or off for every optimizer (it is on by default;
    ``FSDP2_OPTIMIZER_FAST_PATH=0`` turns it off at start). Off, optimizers step on the
    ``DTensor`` parameters as with torch's ``fully_shard``: for debugging, and to compare.
    Both paths keep the same state, so switching between steps is safe; the value when
    ``step()`` is called decides that step (a switch inside one of its hooks applies
    from the next step)."""
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(
            f"fsdp2.set_optimizer_fast_path(enabled) expects True or False, got {enabled!r}."
        )
    _enabled = enabled


def optimizer_fast_path_enabled() -> bool:
    """Whether optimizer steps run on the local shards (see ``set_optimizer_fast_path``)."""
    global _enabled
    if _enabled is None:
        _enabled = _read_environment()
    return _enabled


def _read_environment() -> bool:
    return read_switch(
        ENV_VAR,
        "optimizer steps on the local shards",
        "steps on the DTensor parameters, as torch's fully_shard",
    )


def register_elementwise_optimizer(optimizer_class: type[Optimizer]) -> None:
    """Let instances of ``optimizer_class`` (exactly that class) step on the local shards.

    Only for a step that computes every element of a parameter's new value and state from
    the same element of the parameter, its gradient and its state, plus scalars: no norm,
    sum or matrix product over a parameter, and no state of another shape than the
    parameter's other than scalars. Such a step gives the same result on a shard as on
    the whole tensor; any other would silently train another model."""
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
        raise TypeError(
            f"fsdp2.optim.register_elementwise_optimizer expects a torch.optim.Optimizer "
            f"subclass, got {optimizer_class!r}."
        )
    _ELEMENTWISE.add(optimizer_class)


def _step_pre_hook(
    optimizer: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The global step pre-hook: hand the step a view of ``optimizer`` on local shards."""
    if (
        not _SHARD_OWNERS  # no fsdp2 parameter alive: nothing to do
        or type(optimizer) not in _ELEMENTWISE
        or not optimizer_fast_path_enabled()
        or optimizer.defaults.get("differentiable", False)
        or not args
        or args[0] is not optimizer  # another hook already replaced the optimizer
        or torch.compiler.is_compiling()
    ):
        return None
    view = _LocalStepView.of(optimizer)
    rest = args[1:]
    closure = rest[0] if rest else kwargs.get("closure")
    if closure is not None:
        wrapped = _rebuild_after(closure, view)
        if rest:
            rest = (wrapped, *rest[1:])
        else:
            kwargs = {**kwargs, "closure": wrapped}
    return (view, *rest), kwargs


def _rebuild_after(closure: Callable[[], Any], view: Any) -> Callable[[], Any]:
    """``closure``, after which the view is built again: its backward assigns new
    gradients, and a step may read its groups before calling it (a graph-capture check)."""

    def run() -> Any:
        try:
            return closure()
        finally:
            view._fsdp2_rebuild()

    return run


class _BuiltOnFirstRead:
    """``param_groups`` or ``state`` of a view: built (both) when the step first reads
    either, then plain attributes of the view (a descriptor without ``__set__``, so the
    instance's own attribute wins from then on)."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __get__(self, view: Any, owner: type | None = None) -> Any:
        if view is None:
            return self
        groups, states = _local_layout(view.__dict__["_fsdp2_optimizer"])
        view.__dict__["param_groups"] = groups
        view.__dict__["state"] = states
        return (groups, states)[self.index]


class _LocalStepView:
    """Mixed into a subclass of the optimizer's class: the ``self`` its step sees."""

    _fsdp2_optimizer: Optimizer
    param_groups = _BuiltOnFirstRead(0)
    state = _BuiltOnFirstRead(1)

    @staticmethod
    def of(optimizer: Optimizer) -> Any:
        view: Any = object.__new__(_view_class(type(optimizer)))
        attributes = view.__dict__
        attributes.update(optimizer.__dict__)
        attributes.pop("param_groups", None)
        attributes.pop("state", None)
        attributes["_fsdp2_optimizer"] = optimizer
        return view

    def _fsdp2_rebuild(self) -> None:
        """Build the groups and state again when next read (after a closure)."""
        self.__dict__.pop("param_groups", None)
        self.__dict__.pop("state", None)

    def __setattr__(self, name: str, value: Any) -> None:
        # An attribute the step sets (a warned-once flag) belongs to the optimizer.
        object.__setattr__(self, name, value)
        setattr(self._fsdp2_optimizer, name, value)


_VIEW_CLASSES: dict[type, type] = {}


def _view_class(optimizer_class: type) -> type:
    view_class = _VIEW_CLASSES.get(optimizer_class)
    if view_class is None:
        view_class = type(
            optimizer_class.__name__,
            (_LocalStepView, optimizer_class),
            {"__module__": optimizer_class.__module__},
        )
        _VIEW_CLASSES[optimizer_class] = view_class
    return view_class


def _local_layout(optimizer: Optimizer) -> tuple[list[dict[str, Any]], Any]:
    """The groups and state the step sees (see [Note: optimizer steps on local shards])."""
    records = _RECORDS.get(optimizer)
    if records is None:
        records = _RECORDS[optimizer] = {}
    states = _LocalStates(optimizer.state)
    groups: list[dict[str, Any]] = []
    fast = False
    for group in optimizer.param_groups:
        local = _local_group(group, optimizer.state, states, records)
        fast = fast or local is not None
        groups.append(group if local is None else local)
    if not fast:  # nothing to step on shards: the optimizer's own, at no cost
        return optimizer.param_groups, optimizer.state
    return groups, states


class _Record:
    """What the fast path keeps of one fsdp2 parameter between steps, so that a step
    checks identities instead of layouts: its owner, its local tensor with that tensor's
    address and fsdp2's binding token (``shard_binding``), a gradient layout already
    checked, and the state entries already checked. Tensors and the owner are held
    weakly: a state the optimizer drops (a ``load_state_dict``) is freed at once, as
    without the fast path."""

    __slots__ = ("address", "binding", "grad_spec", "local", "owner", "seen")

    def __init__(self, owner: ShardedParam) -> None:
        self.owner = weakref.ref(owner)
        self.local: weakref.ref[torch.Tensor] | None = None
        self.address = 0
        self.binding: object = None
        self.grad_spec: DTensorSpec | None = None
        # The state's entries as last checked: a weak reference to each tensor, other
        # values as they are; None: not checked (or no state).
        self.seen: dict[str, Any] | None = None


# Per optimizer, per parameter (by id): the parameter's ``_Record``.
_RECORDS: weakref.WeakKeyDictionary[Optimizer, dict[int, _Record]] = weakref.WeakKeyDictionary()


def _record_of(
    param: torch.Tensor, records: dict[int, _Record]
) -> tuple[_Record, ShardedParam] | None:
    """``param``'s record and owner, or None if fsdp2 does not manage it."""
    record = records.get(id(param))
    if record is not None:
        owner = record.owner()
        if owner is not None and owner.sharded_param is param:
            return record, owner
    owner = owner_of(param)
    if owner is None:
        return None
    record = records[id(param)] = _Record(owner)
    return record, owner


class _Entry(NamedTuple):
    """One fsdp2 parameter of a group on the fast path: what the step sees of it."""

    alias: torch.Tensor
    param: DTensor
    record: _Record
    shared: dict[str, Any] | None  # its state in the optimizer (None: none yet)
    values: dict[str, Any] | None  # that state's local values


def _local_group(
    group: dict[str, Any], shared_state: Any, states: _LocalStates, records: dict[int, _Record]
) -> dict[str, Any] | None:
    """``group`` with its fsdp2 parameters replaced by aliases of their local shards, or
    None if the group keeps the ``DTensor`` path."""
    if group.get("differentiable", False):
        return None
    params: list[torch.Tensor] = []
    entries: list[_Entry] = []
    for param in group["params"]:
        if not isinstance(param, DTensor):
            params.append(param)  # a plain parameter
            continue
        unchanged = _if_unchanged(param, records.get(id(param)), shared_state)
        if unchanged is not None:
            params.append(unchanged.alias)
            entries.append(unchanged)
            continue
        found = _record_of(param, records)
        if found is None:
            if param.grad is not None:
                return None  # a DTensor fsdp2 does not manage: its group keeps that path
            params.append(param)
            continue
        entry = _local_entry(param, *found, shared_state)
        if entry is None:
            return None
        params.append(entry.alias)
        entries.append(entry)
    if not entries:
        return None  # no fsdp2 parameter: the group as it is
    add = states.add
    for entry in entries:
        add(entry)
    return _LocalGroup(group, params)


def _if_unchanged(param: DTensor, record: _Record | None, shared_state: Any) -> _Entry | None:
    """The common case of ``_local_entry``, checked by identities only: ``param``'s
    owner, binding, local tensor and its memory, gradient layout and state objects are
    all those the record checked at an earlier step. None when anything differs or is
    missing (``_local_entry`` then checks everything)."""
    if record is None or record.seen is None or record.local is None:
        return None
    owner = record.owner()
    if owner is None or owner.sharded_param is not param:
        return None
    local = param._local_tensor
    grad = param.grad
    if (
        record.binding is not owner._local_layout
        or record.local() is not local
        or type(grad) is not DTensor
        or grad._spec is not record.grad_spec
        or record.address != local.data_ptr()
    ):
        return None
    shared = shared_state.get(param)
    if not shared:
        return None
    values = _values_if_unchanged(shared, record.seen)
    if values is None:
        return None
    alias = local.detach()
    alias.grad = grad._local_tensor
    return _Entry(alias, param, record, shared, values)


def _local_entry(
    param: DTensor, record: _Record, owner: ShardedParam, shared_state: Any
) -> _Entry | None:
    """An alias of ``param``'s local shard whose ``.grad`` is its gradient's, and its
    state's local values; None if ``param`` keeps the ``DTensor`` path."""
    local = param._local_tensor
    if type(local) is not torch.Tensor:
        return None  # a subclass (all-gather extensions) keeps its own dispatch
    binding = shard_binding(owner)
    if record.binding is not binding:  # fsdp2 bound it (anew): start over
        record.binding, record.grad_spec, record.seen = binding, None, None
        record.local, record.address = weakref.ref(local), local.data_ptr()
    elif record.local is None or record.local() is not local or record.address != local.data_ptr():
        # fsdp2 did not bind it anew, yet it is another tensor or other memory.
        if local.data_ptr() != record.address and local.numel():
            raise _moved_error(owner)
        record.local = weakref.ref(local)
    alias = local.detach()
    grad = param.grad
    if grad is not None:
        if type(grad) is not DTensor:
            return None
        spec = grad._spec
        local_grad = grad._local_tensor
        if spec is not record.grad_spec:
            if not _same_layout(spec, param._spec):
                return None
            if local_grad.shape != local.shape:
                raise _replaced_error(owner, local, local_grad)
            if (
                type(local_grad) is not torch.Tensor
                or local_grad.dtype != local.dtype
                or local_grad.device != local.device
            ):
                return None
            record.grad_spec = spec
        alias.grad = local_grad
    shared = shared_state.get(param)
    if not shared:
        record.seen = None
        return _Entry(alias, param, record, shared, None)
    values = None if record.seen is None else _values_if_unchanged(shared, record.seen)
    if values is None:
        values = _local_values(shared, param, owner)
        if values is None:
            return None
        record.seen = {key: _token(value) for key, value in shared.items()}
    return _Entry(alias, param, record, shared, values)


def _token(value: Any) -> Any:
    """How ``_Record.seen`` remembers a state value: tensors weakly."""
    return weakref.ref(value) if isinstance(value, torch.Tensor) else value


def _values_if_unchanged(shared: dict[str, Any], seen: dict[str, Any]) -> dict[str, Any] | None:
    """The local values of ``shared`` if it holds exactly the objects ``seen`` remembers
    (checked before: no layout to check again), else None."""
    if len(shared) != len(seen):
        return None
    values = {}
    for key, token in seen.items():
        value = shared.get(key)
        if (token() if type(token) is weakref.ref else token) is not value:
            return None
        values[key] = value._local_tensor if type(value) is DTensor else value
    return values


def _moved_error(owner: ShardedParam) -> RuntimeError:
    return RuntimeError(
        f"fsdp2 optimizer step: the local shard of parameter {_describe(owner)} was given "
        f"other memory since the last step (a new _local_tensor, or .data = / set_() on "
        f"it). fsdp2's "
        f"all-gather still reads the old memory, so neither this step nor the next forward "
        f"would see the new values. Change values in place instead: "
        f"param.to_local().copy_(values) under torch.no_grad(), or load_state_dict."
    )


def _replaced_error(
    owner: ShardedParam, local: torch.Tensor, local_grad: torch.Tensor
) -> RuntimeError:
    return RuntimeError(
        f"fsdp2 optimizer step: parameter {_describe(owner)} has a local shard of shape "
        f"{tuple(local.shape)} but its gradient's local shard has shape "
        f"{tuple(local_grad.shape)}: the parameter's local tensor was replaced outside "
        f"fsdp2. Change values in place (param.to_local().copy_(...) under "
        f"torch.no_grad()) or load them with load_state_dict."
    )


def _describe(owner: ShardedParam) -> str:
    """A parameter as messages name it: its name in the module ``fully_shard`` was called
    on, and that module's class."""
    module = owner.uses[0][0]
    return f"'{owner.fqn}' (of a {type(module).__name__})"


def _same_layout(spec: DTensorSpec, reference: DTensorSpec) -> bool:
    return spec is reference or (
        spec.placements == reference.placements
        and spec.mesh == reference.mesh
        and spec.shape == reference.shape
    )


def _local_values(
    shared: dict[str, Any], param: DTensor, owner: ShardedParam
) -> dict[str, Any] | None:
    """The state's values as the step sees them: local tensors of its ``DTensor``s (None
    if one has other placements: the group keeps the ``DTensor`` path)."""
    spec = param._spec
    values: dict[str, Any] = {}
    for key, value in shared.items():
        if isinstance(value, DTensor):
            if type(value) is not DTensor:
                return None  # a DTensor subclass: its own dispatch
            if value._spec is not spec and not _same_layout(value._spec, spec):
                if value.shape != param.shape:
                    raise _state_error(owner, key, f"a DTensor of shape {tuple(value.shape)}")
                return None
            value = value._local_tensor
            if type(value) is not torch.Tensor:
                return None
        elif isinstance(value, torch.Tensor) and value.dim() > 0:
            raise _state_error(owner, key, f"a plain tensor of shape {tuple(value.shape)}")
        values[key] = value
    return values


def _state_error(owner: ShardedParam, key: str, what: str) -> RuntimeError:
    param = owner.sharded_dtensor()
    return RuntimeError(
        f"fsdp2 optimizer step: optimizer state '{key}' of parameter {_describe(owner)} is "
        f"{what}, but the parameter is a DTensor of shape {tuple(param.shape)} with "
        f"placements {tuple(param.placements)}, and its state must be laid out alike. Was a "
        f"full or another model's optimizer state dict loaded with "
        f"optimizer.load_state_dict? Load sharded state with torch.distributed.checkpoint "
        f"(set_optimizer_state_dict(model, optimizer, state_dict), which also converts "
        f"full state dicts) or fsdp2.load_checkpoint."
    )


class _LocalGroup(dict[str, Any]):
    """A parameter group as the step sees it; hyperparameters it sets reach the original."""

    def __init__(self, shared: dict[str, Any], params: list[torch.Tensor]) -> None:
        super().__init__(shared)
        dict.__setitem__(self, "params", params)
        self._shared = shared

    def __setitem__(self, key: str, value: Any) -> None:
        dict.__setitem__(self, key, value)
        if key != "params":
            self._shared[key] = value


class _LocalState(dict[str, Any]):
    """One fsdp2 parameter's state as the step sees it: local tensors. Every write also
    goes to the optimizer's state, a local tensor of the shard's shape as a ``DTensor``,
    and to the record of what the fast path has checked."""

    __slots__ = ("_param", "_record", "_shared")

    def __init__(
        self, shared: dict[str, Any], param: DTensor, values: dict[str, Any], record: _Record
    ) -> None:
        # One per parameter and step: dict's own __init__, not super()'s lookup.
        dict.__init__(self, values)
        self._shared = shared
        self._param = param
        self._record = record
        if record.seen is None:
            record.seen = {key: _token(value) for key, value in shared.items()}

    def __setitem__(self, key: str, value: Any) -> None:
        dict.__setitem__(self, key, value)
        shared = self._shared[key] = self._as_shared(key, value)
        seen = self._record.seen
        if seen is not None:
            seen[key] = _token(shared)

    def _as_shared(self, key: str, value: Any) -> Any:
        if (
            type(value) is not torch.Tensor
            or value.dim() == 0
            or value.shape != self._param._local_tensor.shape
        ):
            return value
        current = self._shared.get(key)
        if isinstance(current, DTensor) and current._local_tensor is value:
            return current
        spec = self._param._spec
        meta = spec.tensor_meta
        if meta is None or meta.dtype != value.dtype:
            meta = TensorMeta(self._param.shape, self._param.stride(), value.dtype)
            spec = DTensorSpec(spec.mesh, spec.placements, meta)
        return DTensor(value, spec, requires_grad=False)

    def __delitem__(self, key: str) -> None:
        dict.__delitem__(self, key)
        del self._shared[key]
        self._record.seen = None

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def pop(self, key: str, *default: Any) -> Any:
        self._shared.pop(key, None)
        self._record.seen = None
        return dict.pop(self, key, *default)

    def clear(self) -> None:
        dict.clear(self)
        self._shared.clear()
        self._record.seen = None


class _LocalStates(dict[torch.Tensor, Any]):
    """``optimizer.state`` as the step sees it: an alias's entry is its parameter's state
    (created in the optimizer's state on first use, as torch's ``defaultdict`` does);
    any other key reads the optimizer's state itself."""

    def __init__(self, shared: Any) -> None:
        super().__init__()
        self._shared = shared
        self._new: dict[torch.Tensor, _Entry] = {}  # aliases whose parameter has no state

    def add(self, entry: _Entry) -> None:
        if entry.shared is None or entry.values is None:
            self._new[entry.alias] = entry
            return
        local = _LocalState(entry.shared, entry.param, entry.values, entry.record)
        dict.__setitem__(self, entry.alias, local)

    def __missing__(self, key: torch.Tensor) -> Any:
        entry = self._new.pop(key, None)
        if entry is None:
            value = self._shared[key]
        else:
            value = self._fresh(entry)
        dict.__setitem__(self, key, value)
        return value

    def _fresh(self, entry: _Entry) -> _LocalState:
        """An empty state for ``entry``'s parameter, in the optimizer's state too (as
        torch's ``defaultdict`` creates it on first access)."""
        entry.record.seen = None
        shared = self._shared[entry.param]
        return _LocalState(shared, entry.param, {}, entry.record)

    def __contains__(self, key: object) -> bool:
        if dict.__contains__(self, key):
            return True
        return key not in self._new and key in self._shared

    def get(self, key: torch.Tensor, default: Any = None) -> Any:
        return self[key] if key in self else default

    def __setitem__(self, key: torch.Tensor, value: Any) -> None:
        entry = self._new.pop(key, None)
        current = dict.get(self, key)
        if entry is None and isinstance(current, _LocalState):
            entry = _Entry(key, current._param, current._record, None, None)
        if entry is None:
            self._shared[key] = value
            dict.__setitem__(self, key, value)
            return
        self._shared[entry.param] = {}  # replaced as a whole
        local = self._fresh(entry)
        local.update(value)
        dict.__setitem__(self, key, local)


register_optimizer_step_pre_hook(_step_pre_hook)
