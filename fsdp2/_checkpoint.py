"""Initializing and checkpointing sharded models: deferred (meta-device) init, full state
dicts that only rank 0 holds, and crash-safe ``torch.distributed.checkpoint`` saves.

Nothing here depends on fsdp2's internals beyond the public contract: managed parameters
are ``DTensor``s whose ``to_local()`` (under ``no_grad``) is the real, in-place-writable
shard, and ``FSDPModule.reshard()`` registers them on their modules again. Every helper
therefore also works on models sharded by ``torch.distributed.fsdp.fully_shard``.

- ``init_sharded_``: initialize sharded parameters as if the full model had been
  initialized on one device and then sharded, holding one full parameter (or one
  module's own parameters) at a time.
- ``load_full_state_dict`` / ``get_full_state_dict``: rank 0's full state dict in and out,
  one tensor (one broadcast or one all-gather) at a time.
- ``ModelOptimizerState``, ``save_checkpoint``, ``load_checkpoint``: sharded
  ``torch.distributed.checkpoint`` checkpoints (any world size can load them) written to a
  temporary directory, renamed into place and published through a ``latest`` file.

See ``docs/deferred_init.md`` and ``docs/checkpoint.md``.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import pickle
import re
import shutil
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from fsdp2._fully_shard import FSDPModule

__all__ = [
    "IncompatibleKeys",
    "ModelOptimizerState",
    "get_full_state_dict",
    "init_sharded_",
    "load_checkpoint",
    "load_full_state_dict",
    "save_checkpoint",
]


# ------------------------------------------------------------------------------ shared


def _is_fsdp_module(module: nn.Module) -> bool:
    if isinstance(module, FSDPModule):
        return True
    # torch's own fully_shard: the helpers work on its models too. Matched by name in the
    # MRO because fsdp2 never imports torch.distributed.fsdp.
    return any(
        klass.__name__ == "FSDPModule" and klass.__module__.startswith("torch.distributed.fsdp")
        for klass in type(module).__mro__
    )


def _reshard_all(module: nn.Module) -> None:
    """Register the sharded parameters everywhere (a local operation, no collective), so
    ``named_parameters()`` and ``state_dict()`` see the ``DTensor`` shards even if some
    group is still unsharded, e.g. the root after a forward without backward."""
    for m in module.modules():
        if _is_fsdp_module(m):
            m.reshard()  # type: ignore[operator]


def _check_module(module: Any, caller: str) -> None:
    """Every rank passes the same kind of argument: raising here cannot strand a rank."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{caller}(module=...) expects an nn.Module, got {type(module).__name__}.")


def _model_mesh(tensors: Iterable[Any]) -> DeviceMesh | None:
    """The mesh spanning the model's ranks: the largest ``DTensor`` mesh (the first one
    among equals). Per-parameter meshes (MoE experts over a subset of the data-parallel
    ranks) are smaller than the module's mesh, whichever parameter comes first."""
    best: DeviceMesh | None = None
    for t in tensors:
        if isinstance(t, DTensor) and (best is None or t.device_mesh.size() > best.size()):
            best = t.device_mesh
    return best


def _mesh_device(mesh: DeviceMesh | None) -> torch.device:
    if mesh is None or mesh.device_type == "cpu":
        return torch.device("cpu")
    device_module = torch.get_device_module(mesh.device_type)
    return torch.device(mesh.device_type, device_module.current_device())


def _on_mesh_device(value: DTensor) -> DTensor:
    """``value``, or, when its local tensor is on another device type than its mesh (a
    CPU-offloaded shard of an accelerator's mesh), a copy on the mesh's device: the
    mesh's collective backend (NCCL) cannot gather host memory."""
    local, mesh = value.to_local(), value.device_mesh
    if local.device.type == mesh.device_type:
        return value
    return DTensor.from_local(
        local.to(_mesh_device(mesh)),
        mesh,
        value.placements,
        run_check=False,
        shape=value.shape,
        stride=value.stride(),
    )


def _mesh_comm(mesh: DeviceMesh | None) -> tuple[dist.ProcessGroup | None, int]:
    """(process group spanning the mesh, global rank of the mesh's first rank)."""
    if mesh is None:
        return None, 0
    src = int(mesh.mesh.flatten()[0].item())
    if mesh.ndim == 1:
        return mesh.get_group(), src
    if mesh.size() == dist.get_world_size():
        return None, src  # the default group spans every rank of the mesh
    raise NotImplementedError(
        f"fsdp2 full state dicts: a {mesh.ndim}-D mesh that does not span every rank is not "
        f"supported; use torch.distributed.checkpoint (save_checkpoint) instead."
    )


def _local_chunk(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's piece of ``full`` under ``like``'s layout (no communication)."""
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()


def _copy_into_shard(param: DTensor, full: torch.Tensor, name: str) -> None:
    """Copy this rank's rows of ``full`` into ``param``'s local tensor, in place, so the
    local tensor (a view into fsdp2's flat shard buffer) stays the same tensor."""
    local = param.to_local()  # under no_grad: the local tensor itself, not a copy
    chunk = _local_chunk(full, param)
    if chunk.shape != local.shape:
        raise AssertionError(
            f"{name}: this rank's chunk of the full tensor has shape {tuple(chunk.shape)} but "
            f"the local shard has shape {tuple(local.shape)}; the parameter is not laid out "
            f"like DTensor's {param.placements}."
        )
    local.copy_(chunk)


def _on_rank0(fn: Callable[[], Any], group: dist.ProcessGroup | None = None) -> Any:
    """Run ``fn`` on the group's first rank, send its result (or its error) to every rank
    and raise the error everywhere, so no rank is left waiting in a later collective."""
    src = 0 if group is None else dist.get_global_rank(group, 0)
    box: list[Any] = [None]
    error: Exception | None = None
    if dist.get_rank() == src:
        try:
            box[0] = ("ok", fn())
        except Exception as exc:  # raised on every rank below
            error = exc
            try:
                pickle.dumps(exc)
                box[0] = ("error", exc)
            except Exception:
                box[0] = ("error", RuntimeError(f"rank {src}: {type(exc).__name__}: {exc}"))
    dist.broadcast_object_list(box, src=src, group=group)
    status, value = box[0]
    if status == "error":
        raise error if error is not None else value
    return value


# ------------------------------------------------------------------------ deferred init


@contextlib.contextmanager
def _rng(seed: int | None, device: torch.device) -> Iterator[None]:
    if seed is None:
        yield
        return
    if device.type == "cpu":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            yield
        return
    index = device.index
    if index is None:
        index = torch.get_device_module(device.type).current_device()
    with torch.random.fork_rng(devices=[index], device_type=device.type):
        torch.manual_seed(seed)
        yield


def _materialize(module: nn.Module, device: torch.device | str | None) -> None:
    """``module.to_empty(device=...)`` if any parameter or buffer is still on meta."""
    params = list(module.parameters())
    on_meta = any(t.device.type == "meta" for t in params) or any(
        b.device.type == "meta" for b in module.buffers()
    )
    if not on_meta:
        return
    if device is None:
        device = _mesh_device(_model_mesh(params))
    module.to_empty(device=device)


def _full_like(param: DTensor) -> torch.Tensor:
    local = param.to_local()
    return torch.empty(param.shape, dtype=param.dtype, device=local.device)


def init_sharded_(
    module: nn.Module,
    init_fn: Callable[[str, torch.Tensor], torch.Tensor | None] | None = None,
    *,
    seed: int | None = None,
    device: torch.device | str | None = None,
) -> None:
    """Initialize the (sharded) parameters of ``module`` as if the whole model had been
    initialized on one device and then sharded, without ever holding the full model.

    Each parameter is materialized in full on its own, on every rank (same values on
    every rank: the random number generators must agree), and each rank keeps its rows.
    Peak memory is the shards plus one full parameter (``init_fn``) or one module's own
    parameters (``reset_parameters``), not the model.

    Args:
        module: a module after ``fully_shard`` (typically built under
            ``torch.device("meta")``); parameters and buffers still on the meta device
            are first materialized, uninitialized, with ``module.to_empty(device=...)``.
        init_fn: ``init_fn(fqn, tensor)`` initializes ``tensor``, the full, unsharded and
            uninitialized value of parameter ``fqn``, in place (or returns a tensor of its
            shape to use). Called once per parameter in ``module.named_parameters()``
            order (tied parameters once). ``None``: call ``reset_parameters()`` on every
            submodule that has it, in ``module.modules()`` order, while that submodule's
            own parameters are temporarily full tensors. A submodule with parameters but
            no ``reset_parameters`` is an error then.
        seed: seed the global RNG with it for the duration of the call (restored after),
            so every rank draws the same values. ``None``: use the RNG as it is, which must
            then be in the same state on every rank (or ``init_fn`` uses its own
            ``torch.Generator``).
        device: where meta tensors are materialized; default: the mesh's device.

    Buffers are not parameters: ``to_empty`` leaves them uninitialized unless a
    ``reset_parameters`` sets them. Recompute them yourself (e.g. rotary tables).
    Parameters that are not ``DTensor``s (``ignored_params``) are initialized in place.
    """
    _check_module(module, "init_sharded_")
    _reshard_all(module)
    _materialize(module, device)
    params = list(module.parameters())
    rng_device = next((p.to_local().device for p in params if isinstance(p, DTensor)), None)
    if rng_device is None:
        rng_device = params[0].device if params else torch.device("cpu")
    with torch.no_grad(), _rng(seed, rng_device):
        if init_fn is None:
            _reset_modules(module)
        else:
            _init_each_param(module, init_fn)


def _init_each_param(
    module: nn.Module, init_fn: Callable[[str, torch.Tensor], torch.Tensor | None]
) -> None:
    for name, param in module.named_parameters():
        if isinstance(param, DTensor):
            full = _full_like(param)
            result = init_fn(name, full)
            if result is not None and result is not full:
                if tuple(result.shape) != tuple(full.shape):
                    raise ValueError(
                        f"init_sharded_: init_fn returned shape {tuple(result.shape)} for "
                        f"'{name}', expected {tuple(full.shape)}."
                    )
                full = result
            _copy_into_shard(param, full, name)
            del full, result
        else:
            result = init_fn(name, param)
            if result is not None and result is not param:
                param.copy_(result)


def _own_reset(m: nn.Module) -> Any:
    """``m.reset_parameters`` if it is ``m``'s own: wrappers such as ``CheckpointWrapper``
    forward unknown attributes to the module they wrap, whose method would run here on
    its sharded parameters (and again when the loop reaches that module)."""
    if inspect.getattr_static(m, "reset_parameters", None) is None:
        return None  # not on the instance or its class: only reachable by forwarding
    reset = getattr(m, "reset_parameters", None)
    return reset if callable(reset) else None


def _reset_modules(module: nn.Module) -> None:
    missing = [
        f"{name or '<root>'} ({type(m).__name__})"
        for name, m in module.named_modules()
        if _own_reset(m) is None and any(isinstance(p, DTensor) for p in m._parameters.values())
    ]
    if missing:
        raise ValueError(
            f"init_sharded_: these submodules own sharded parameters but have no "
            f"reset_parameters(): {', '.join(missing)}. Pass init_fn(fqn, tensor) to "
            f"initialize each parameter instead."
        )
    for name, m in module.named_modules():
        reset = _own_reset(m)
        if reset is None:
            continue
        swapped: dict[str, tuple[DTensor, nn.Parameter]] = {}
        try:
            for attr, param in m._parameters.items():
                if isinstance(param, DTensor):
                    full = nn.Parameter(_full_like(param), requires_grad=param.requires_grad)
                    swapped[attr] = (param, full)
                    m._parameters[attr] = full
            reset()
            for attr, (param, full) in swapped.items():
                _copy_into_shard(param, full, f"{name}.{attr}" if name else attr)
        finally:
            for attr, (param, _) in swapped.items():
                m._parameters[attr] = param


# -------------------------------------------------------------------- full state dicts


class IncompatibleKeys(NamedTuple):
    """What ``load_full_state_dict(strict=False)`` skipped, like ``load_state_dict``'s."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def _check_full_state_dict(
    targets: Mapping[str, Any], state_dict: Any, strict: bool
) -> tuple[str | None, list[str], list[str]]:
    """On the source rank: (error message or None, missing keys, unexpected keys)."""
    if not isinstance(state_dict, Mapping):
        return (
            f"load_full_state_dict: the source rank must pass the full state dict (a "
            f"mapping), got {type(state_dict).__name__}. Other ranks may pass None.",
            [],
            [],
        )
    missing = [k for k in targets if k not in state_dict]
    unexpected = [k for k in state_dict if k not in targets]
    problems: list[str] = []
    if strict and missing:
        problems.append("missing key(s): " + ", ".join(repr(k) for k in missing))
    if strict and unexpected:
        problems.append("unexpected key(s): " + ", ".join(repr(k) for k in unexpected))
    for key, target in targets.items():
        if key not in state_dict or not isinstance(target, torch.Tensor):
            continue
        value = state_dict[key]
        if isinstance(value, torch.Tensor) and value.device.type == "meta":
            problems.append(f"{key!r} is on the meta device (it has no values)")
        elif isinstance(value, DTensor):
            problems.append(
                f"{key!r} is a DTensor; load_full_state_dict expects full tensors (load a "
                f"sharded state dict with model.load_state_dict on every rank)"
            )
        elif not isinstance(value, torch.Tensor):
            problems.append(f"{key!r} is a {type(value).__name__}, expected a tensor")
        elif tuple(value.shape) != tuple(target.shape):
            problems.append(
                f"size mismatch for {key!r}: the state dict has shape {tuple(value.shape)}, "
                f"the model has {tuple(target.shape)}"
            )
    if problems:
        return "load_full_state_dict: " + "; ".join(problems) + ".", missing, unexpected
    return None, missing, unexpected


def load_full_state_dict(
    module: nn.Module, state_dict: Mapping[str, Any] | None, *, strict: bool = True
) -> IncompatibleKeys:
    """Load a full (unsharded) state dict that only rank 0 holds into a sharded model.

    Collective: every rank of the model's mesh calls it. Rank 0 (the mesh's first rank)
    passes the state dict; the others pass ``None``. Tensors are broadcast one at a time
    (so other ranks hold at most one full tensor), and each rank copies its dim-0 chunk
    into the sharded parameter's local tensor in place (fsdp2's flat shard buffer and any
    optimizer keep pointing at the same tensors). Buffers and unsharded parameters get the
    whole value. Values are cast to the model's dtypes. A model still on the meta device
    is materialized first (``to_empty`` on the mesh's device); buffers missing from the
    state dict (non-persistent ones) are then uninitialized: recompute them.

    Errors (missing or unexpected keys with ``strict``, shape mismatches, sharded values)
    are detected on rank 0 before anything is loaded and raised on every rank.

    Returns:
        ``IncompatibleKeys(missing_keys, unexpected_keys)`` (empty lists with ``strict``).
    """
    _check_module(module, "load_full_state_dict")
    _reshard_all(module)
    _materialize(module, None)  # built on the meta device: the shards need storage first
    targets = module.state_dict(keep_vars=True)
    mesh = _model_mesh(targets.values())
    group, src = _mesh_comm(mesh)
    device = _mesh_device(mesh)
    is_src = dist.get_rank() == src
    box: list[Any] = [_check_full_state_dict(targets, state_dict, strict) if is_src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    error, missing, unexpected = box[0]
    if error is not None:
        raise ValueError(error)
    skip = set(missing)
    extra: dict[str, Any] = {}  # get_extra_state() values: not tensors
    done: set[int] = set()
    with torch.no_grad():
        for key, target in targets.items():
            if key in skip:
                continue
            if not isinstance(target, torch.Tensor):
                obj = [state_dict[key] if is_src else None]  # type: ignore[index]
                dist.broadcast_object_list(obj, src=src, group=group)
                extra[key] = obj[0]
                continue
            if id(target) in done:
                continue  # tied parameter, loaded under its first key
            done.add(id(target))
            if is_src:
                full = state_dict[key].detach().to(device, target.dtype).contiguous()  # type: ignore[index]
            else:
                full = torch.empty(target.shape, dtype=target.dtype, device=device)
            dist.broadcast(full, src=src, group=group)
            if isinstance(target, DTensor):
                _copy_into_shard(target, full, key)
            else:
                target.copy_(full)
            del full
    if extra:
        module.load_state_dict(extra, strict=False)
    return IncompatibleKeys(list(missing), list(unexpected))


def get_full_state_dict(
    module: nn.Module, *, cpu_offload: bool = True, rank0_only: bool = True
) -> dict[str, Any]:
    """The full (unsharded) state dict of a sharded model, gathered one tensor at a time.

    Collective: every rank of the model's mesh calls it. Each ``DTensor`` is all-gathered
    (``full_tensor()``) on its own; with ``rank0_only`` only rank 0 (the mesh's first rank)
    keeps it and the others return ``{}``, so they hold at most one full tensor at a time.
    ``cpu_offload`` moves every kept tensor to the CPU (so the device holds one full
    tensor at a time too). Values are new tensors, not views of the model's; tied
    parameters map to one tensor under both keys, as in ``state_dict()``.
    """
    _check_module(module, "get_full_state_dict")
    _reshard_all(module)
    targets = module.state_dict(keep_vars=True)
    mesh = _model_mesh(targets.values())
    _, src = _mesh_comm(mesh)
    keep = not rank0_only or dist.get_rank() == src
    out: dict[str, Any] = {}
    done: dict[int, torch.Tensor | None] = {}  # tied parameters: gathered once
    with torch.no_grad():
        for key, value in targets.items():
            if not isinstance(value, torch.Tensor):
                if keep:
                    out[key] = value
                continue
            if id(value) in done:
                if keep:
                    out[key] = done[id(value)]
                continue
            if isinstance(value, DTensor):
                full = _on_mesh_device(value).full_tensor()
            else:
                full = value.detach().clone()
            if not keep:
                done[id(value)] = None
                del full
                continue
            if cpu_offload:
                full = full.cpu()
            out[key] = done[id(value)] = full
    return out


# ------------------------------------------------------------------ DCP checkpoints


class ModelOptimizerState:
    """A ``torch.distributed.checkpoint`` *Stateful* for a model and its optimizer(s).

    ``state_dict()`` returns ``{"model": ..., "optim": ...}`` with sharded (``DTensor``)
    values and parameter FQNs as optimizer keys (``get_state_dict``), so a checkpoint can
    be loaded at another world size; ``load_state_dict()`` loads them back in place
    (``set_state_dict``). A fresh optimizer gets its state initialized first, so the
    checkpoint has a place to load into. Put it in the dict given to
    ``save_checkpoint``/``load_checkpoint`` (or ``dcp.save``/``dcp.load``)::

        state = {"app": ModelOptimizerState(model, optimizer), "train": train_state}
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"ModelOptimizerState(model=...) expects an nn.Module, got {type(model).__name__}."
            )
        self.model = model
        if optimizer is None:
            self.optimizers: tuple[torch.optim.Optimizer, ...] = ()
        elif isinstance(optimizer, torch.optim.Optimizer):
            self.optimizers = (optimizer,)
        else:
            self.optimizers = tuple(optimizer)
        bad = [
            type(o).__name__ for o in self.optimizers if not isinstance(o, torch.optim.Optimizer)
        ]
        if bad:
            raise TypeError(
                f"ModelOptimizerState(optimizer=...) expects torch.optim.Optimizer(s), got "
                f"{', '.join(bad)}."
            )

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        _reshard_all(self.model)
        if not self.optimizers:
            return {"model": get_model_state_dict(self.model)}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizers)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        _reshard_all(self.model)
        if not self.optimizers:
            set_model_state_dict(self.model, state_dict["model"])
            return
        set_state_dict(
            self.model,
            self.optimizers,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )


LATEST = "latest"
_STEP_DIR = re.compile(r"^step_(\d+)(\.old)?$")


def _step_dir(step: int, caller: str = "save_checkpoint") -> str:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"{caller}(step=...) expects an int >= 0, got {step!r}.")
    return f"step_{step}"


def _is_complete(path: str) -> bool:
    # torch.distributed.checkpoint writes ``.metadata`` last, after every rank's data.
    return os.path.isfile(os.path.join(path, ".metadata"))


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):  # not every platform can open a directory
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_latest(directory: str, name: str) -> None:
    tmp = os.path.join(directory, f".{LATEST}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, LATEST))
    _fsync_dir(directory)


def _complete_checkpoints(directory: str) -> list[tuple[int, str]]:
    """(step, directory name) of every complete checkpoint, ``.old`` ones after the rest."""
    found: dict[int, str] = {}
    for name in sorted(os.listdir(directory), key=lambda n: n.endswith(".old")):
        match = _STEP_DIR.match(name)
        if match and _is_complete(os.path.join(directory, name)):
            found.setdefault(int(match.group(1)), name)
    return sorted(found.items())


def _find_checkpoint(directory: str, step: int | None) -> tuple[int, str] | None:
    """(step, path) to load: ``step``'s, else the one ``latest`` names, else the newest
    complete one (``latest`` is missing or names a directory that is gone)."""
    if not os.path.isdir(directory):
        return None
    available = _complete_checkpoints(directory)
    if step is not None:
        for s, name in available:
            if s == step:
                return s, os.path.join(directory, name)
        raise FileNotFoundError(
            f"load_checkpoint: no complete checkpoint for step {step} in {directory}; "
            f"available steps: {[s for s, _ in available]}."
        )
    latest = os.path.join(directory, LATEST)
    if os.path.isfile(latest):
        with open(latest) as f:
            name = f.read().strip()
        match = _STEP_DIR.match(name)
        if match:
            for candidate in (name, name + ".old"):  # .old: killed while overwriting
                path = os.path.join(directory, candidate)
                if _is_complete(path):
                    return int(match.group(1)), path
        if available:
            warnings.warn(
                f"load_checkpoint: {latest} names {name!r}, which is not a complete "
                f"checkpoint; loading the newest complete one, {available[-1][1]!r}.",
                stacklevel=3,
            )
    if not available:
        return None
    s, name = available[-1]
    return s, os.path.join(directory, name)


def _check_state(state: Any, caller: str) -> None:
    """Same input on every rank, so raising here (before any collective) cannot hang."""
    if not isinstance(state, dict):
        raise TypeError(
            f"{caller}(state=...) expects a dict of state dicts and Stateful objects (e.g. "
            f"{{'app': ModelOptimizerState(model, optimizer)}}), got {type(state).__name__}."
        )


@contextlib.contextmanager
def _as_runtime_error(message: str) -> Iterator[None]:
    """DCP reports failures (on every rank, with each failing rank's traceback) as
    ``CheckpointException``, a ``BaseException`` that ``except Exception`` misses: re-raise
    it as a ``RuntimeError`` so ordinary error handling (and retries) see it."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        raise RuntimeError(f"{message}:\n{exc}") from exc


def _prune(directory: str, keep: int, current: str) -> None:
    checkpoints = [name for _, name in _complete_checkpoints(directory)]
    for name in checkpoints[:-keep]:
        if name != current:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    for name in os.listdir(directory):  # leftovers of saves that were killed
        if name.endswith((".tmp", ".old")) and name.startswith("step_"):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def save_checkpoint(
    state: dict[str, Any],
    directory: str | os.PathLike[str],
    *,
    step: int,
    keep: int | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> str:
    """Save ``state`` with ``torch.distributed.checkpoint`` so that a killed save never
    loses the previous checkpoint. Collective: every rank calls it.

    1. rank 0 creates ``<directory>/step_<step>.tmp`` (deleting a leftover of a killed
       save); every rank writes its shards there (``dcp.save``);
    2. once all ranks are done, rank 0 renames it to ``step_<step>`` and then replaces the
       ``latest`` file (written to a temporary file, fsynced, ``os.replace``) with that name.

    A save killed before step 2 leaves a ``.tmp`` directory that ``load_checkpoint``
    ignores; ``latest`` still names the previous checkpoint. ``directory`` must be on a
    file system every rank sees.

    Args:
        state: what to save: ``Stateful`` objects (``ModelOptimizerState``, anything with
            ``state_dict``/``load_state_dict``) and/or state dicts, as for ``dcp.save``.
        step: the training step, which names the checkpoint.
        keep: keep only the newest ``keep`` checkpoints (and delete leftovers of killed
            saves); ``None`` keeps everything.
        process_group: passed to ``dcp.save``; default: all ranks.

    Returns:
        The checkpoint's directory.
    """
    import torch.distributed.checkpoint as dcp

    if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
        raise ValueError(f"save_checkpoint(keep=...) expects an int >= 1 or None, got {keep!r}.")
    directory = os.fspath(directory)
    name = _step_dir(step)
    final = os.path.join(directory, name)
    tmp = final + ".tmp"

    def prepare() -> None:
        os.makedirs(directory, exist_ok=True)
        if os.path.lexists(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp)

    def commit() -> None:
        if not _is_complete(tmp):
            raise RuntimeError(f"save_checkpoint: {tmp} has no .metadata after dcp.save.")
        old = None
        if os.path.lexists(final):  # saving the same step again: keep the old one until
            old = final + ".old"  # the new one is in place (load_checkpoint knows .old)
            if os.path.lexists(old):
                shutil.rmtree(old)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(directory)
        _write_latest(directory, name)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        if keep is not None:
            _prune(directory, keep, name)

    _check_state(state, "save_checkpoint")
    _on_rank0(prepare, process_group)
    with _as_runtime_error(
        f"save_checkpoint: writing {tmp} failed; {LATEST!r} still names the previous checkpoint"
    ):
        dcp.save(state, checkpoint_id=tmp, process_group=process_group)
    _on_rank0(commit, process_group)
    return final


def load_checkpoint(
    state: dict[str, Any],
    directory: str | os.PathLike[str],
    *,
    step: int | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> int | None:
    """Load the checkpoint that ``latest`` names in ``directory`` (or ``step``'s) into
    ``state`` in place, with ``torch.distributed.checkpoint``; the world size may differ
    from the one that saved it. Collective: every rank calls it.

    Rank 0 picks the checkpoint (``latest``; if that is missing or names a directory that
    is gone, the newest complete ``step_<n>``; ``.tmp`` leftovers never) and tells the
    others, so every rank loads the same one.

    Returns:
        The loaded checkpoint's step, or ``None`` if ``directory`` has no checkpoint yet
        (with ``step`` given, a missing checkpoint is a ``FileNotFoundError``).
    """
    import torch.distributed.checkpoint as dcp

    _check_state(state, "load_checkpoint")
    if step is not None:
        _step_dir(step, "load_checkpoint")  # on every rank, before any collective
    directory = os.fspath(directory)
    found = _on_rank0(lambda: _find_checkpoint(directory, step), process_group)
    if found is None:
        return None
    loaded_step, path = found
    with _as_runtime_error(f"load_checkpoint: loading {path} failed"):
        dcp.load(state, checkpoint_id=path, process_group=process_group)
    return loaded_step
