"""All-gather extensions: a parameter whose local shard defines ``fsdp_pre_all_gather`` and
``fsdp_post_all_gather`` decides itself what is gathered and what the unsharded parameter
is. torchao's float8 training gathers float8 bytes instead of fp32 weights, and its NF4
tensors (QLoRA) gather their quantized blocks and scales; both rebuild their tensor
subclass from the gathered pieces. The contract is torch's, so the same subclasses work
with either implementation:

- ``fsdp_pre_all_gather(mesh)`` (version 1) or ``fsdp_pre_all_gather(mesh, outer_size,
  outer_stride, module, mp_policy)`` (version 2) returns ``(inputs, metadata)``: the
  tensors to all-gather over ``mesh`` (the 1-D shard mesh) and anything to hand back.
- ``fsdp_post_all_gather(outputs, metadata, param_dtype)`` returns ``(tensor,
  inner_tensors)``: the unsharded value, and the tensors whose memory to free when
  resharding. Later gathers call it with ``out=`` the unsharded parameter, which it
  refills in place, so autograd's saved references stay valid.

Both hooks run under ``torch.no_grad()``: building and refilling the unsharded parameter
is not part of the model's computation.

[Note: extension buffers]
Each input gets a persistent all-gather output, ``(world_size * size(0), *size[1:])``,
created at the first gather and kept as the same tensor object: the post-all-gather hook
may wrap it without copying (torch's ``TwoTensor`` test checks that the storage it gets
with ``out=`` is the one it wrapped). Resharding resizes these storages, and those of the
returned inner tensors that are separate allocations (a cast), to zero bytes; unsharding
resizes them back before the copy-out writes the outputs and the hook refills ``out``.
The group gathers every input of every parameter, with its plain parameters, in one
``uint8`` collective (see [Note: groups with extensions] in ``_all_gather``).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def has_gather_extension(tensor: torch.Tensor, fqn: str) -> bool:
    """Whether ``tensor`` defines the all-gather hooks (both, or a clear error)."""
    pre = hasattr(tensor, "fsdp_pre_all_gather")
    post = hasattr(tensor, "fsdp_post_all_gather")
    if pre != post:
        missing = "fsdp_post_all_gather" if pre else "fsdp_pre_all_gather"
        raise TypeError(
            f"fully_shard: parameter '{fqn}' ({type(tensor).__name__}) defines only one of "
            f"fsdp_pre_all_gather/fsdp_post_all_gather; define {missing} too, or neither."
        )
    return pre


def is_plain(tensor: torch.Tensor) -> bool:
    """A plain tensor (or plain ``nn.Parameter``), which can live in a flat buffer; a
    tensor subclass keeps its own storage."""
    return type(tensor) in (torch.Tensor, nn.Parameter)


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    stride: list[int] = []
    running = 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))


class GatherExtension:
    """One parameter's extension hooks: the inputs of the current all-gather, their
    persistent outputs and the memory to free on reshard (see [Note: extension buffers])."""

    def __init__(
        self,
        fqn: str,
        module: nn.Module,
        shape: torch.Size,
        padded_shape: tuple[int, ...],
        local_shape: tuple[int, ...],
        uneven: bool,
    ) -> None:
        self.fqn = fqn
        self.module = module
        self.shape = shape  # the unsharded shape (TP-local for a TP parameter)
        self.stride = contiguous_stride(shape)
        self.padded_shape = padded_shape  # this rank's shard, dim 0 padded
        self.local_shape = local_shape  # this rank's real shard
        self.uneven = uneven  # the parameter's shard group pads it (dim 0 not divisible)
        self.metadata: Any = None
        self.input_layout: list[tuple[torch.Size, torch.dtype]] = []
        self.outputs: list[torch.Tensor] = []
        self._output_bytes: list[int] = []
        self._hook_views: tuple[torch.Tensor, ...] = ()
        self._targets: list[torch.Tensor] = []
        # Inner tensors of the unsharded value allocated apart from ``outputs``.
        self._owned: list[tuple[torch.Tensor, int]] = []
        self._pre_version: tuple[Any, int] | None = None  # (function, parameter count)

    # -- before the collective -------------------------------------------------------------
    @torch.no_grad()
    def inputs(
        self,
        local: torch.Tensor,
        mesh: DeviceMesh,
        mp_policy: Any,
        device: torch.device,
    ) -> list[torch.Tensor]:
        """Call ``fsdp_pre_all_gather`` on the local shard; return its inputs, contiguous,
        on ``device``, padded to the padded shard where they have the real shard's shape."""
        pre = local.fsdp_pre_all_gather  # type: ignore[attr-defined]
        if local.device != device:
            # CPU offload: a subclass's hook runs on its copy on the device (as in torch);
            # hooks patched onto the CPU tensor itself stay with it, and their inputs move.
            moved = local.to(device, non_blocking=True)
            pre = getattr(moved, "fsdp_pre_all_gather", pre)
        if self._version(pre) == 1:
            result = pre(mesh)
        else:
            result = pre(mesh, self.shape, self.stride, self.module, mp_policy)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(
                f"fully_shard: fsdp_pre_all_gather of parameter '{self.fqn}' must return "
                f"(all_gather_inputs, metadata), got {type(result).__name__}"
            )
        raw, self.metadata = result
        if isinstance(raw, torch.Tensor):
            raw = (raw,)
        inputs: list[torch.Tensor] = []
        for t in raw:
            if not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"fully_shard: fsdp_pre_all_gather of parameter '{self.fqn}' returned "
                    f"a {type(t).__name__} among its all-gather inputs; return tensors"
                )
            inputs.append(self._padded(t.to(device)).contiguous())
        layout = [(t.shape, t.dtype) for t in inputs]
        if layout != self.input_layout:
            if self.outputs:
                raise RuntimeError(
                    f"fully_shard: fsdp_pre_all_gather of parameter '{self.fqn}' returned "
                    f"inputs {layout} after {self.input_layout} at an earlier all-gather; "
                    f"their shapes and dtypes must stay the same between all-gathers"
                )
            self.input_layout = layout
        return inputs

    def _version(self, pre: Any) -> int:
        function = getattr(pre, "__func__", pre)
        if self._pre_version is None or self._pre_version[0] is not function:
            count = len(inspect.signature(pre).parameters)
            if count not in (1, 5):
                raise TypeError(
                    f"fully_shard: fsdp_pre_all_gather of parameter '{self.fqn}' takes "
                    f"{count} arguments; it must take (mesh) or (mesh, outer_size, "
                    f"outer_stride, module, mp_policy)"
                )
            self._pre_version = (function, 1 if count == 1 else 2)
        return self._pre_version[1]

    def _padded(self, t: torch.Tensor) -> torch.Tensor:
        """An input shaped like this rank's real shard, padded on dim 0 to the padded
        shard (every rank must send the same sizes). Others must already be padded."""
        if not self.uneven or tuple(t.shape) == self.padded_shape:
            return t
        if tuple(t.shape) == self.local_shape:
            padded = t.new_zeros(self.padded_shape)
            padded[: t.shape[0]].copy_(t)
            return padded
        raise RuntimeError(
            f"fully_shard: parameter '{self.fqn}' (shape {tuple(self.shape)}) is sharded "
            f"unevenly, so fsdp_pre_all_gather must return inputs of the padded shard shape "
            f"{self.padded_shape} (or of the local shard shape {self.local_shape}, which "
            f"fsdp2 pads); got {tuple(t.shape)}"
        )

    # -- after the collective ---------------------------------------------------------------
    def alloc_outputs(self, world_size: int, device: torch.device) -> list[torch.Tensor]:
        """The persistent outputs with memory, as ``(world_size, bytes)`` copy-out targets
        (made at the first all-gather; the input layout cannot change after it)."""
        if not self.outputs:
            self.outputs = [
                torch.empty(
                    (world_size * s[0], *s[1:]) if s else (world_size,), dtype=d, device=device
                )
                for s, d in self.input_layout
            ]
            self._output_bytes = [o.numel() * o.element_size() for o in self.outputs]
            # The hook sees each output with its input's trailing dims.
            self._hook_views = tuple(
                o.view(-1, *s[1:]) if s else o for o, (s, _) in zip(self.outputs, self.input_layout)
            )
            # Written through ``.data`` aliases, whose version counters are their own: the
            # unsharded value may be a view of an output that autograd saved in forward,
            # and a refill must not look like an in-place edit of it ([Note: storage
            # resize and autograd] in ``_param``).
            self._targets = [
                o.data.view(-1).view(torch.uint8).view(world_size, -1) for o in self.outputs
            ]
        for output, nbytes in zip(self.outputs, self._output_bytes):
            storage = output.untyped_storage()
            if storage.size() < nbytes:
                storage.resize_(nbytes)
        return self._targets

    @torch.no_grad()
    def post_all_gather(
        self, local: torch.Tensor, param_dtype: torch.dtype, out: nn.Parameter | None
    ) -> torch.Tensor | None:
        """Call ``fsdp_post_all_gather``: the first time, return the unsharded value (the
        parameter's shape, padding cut off); later, refill ``out`` in place."""
        post = local.fsdp_post_all_gather  # type: ignore[attr-defined]
        outputs = self._hook_views
        metadata, self.metadata = self.metadata, None
        if out is not None:
            for tensor, nbytes in self._owned:
                storage = tensor.untyped_storage()
                if storage.size() < nbytes:
                    storage.resize_(nbytes)
            post(outputs, metadata, param_dtype, out=out)
            return None
        result = post(outputs, metadata, param_dtype)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(
                f"fully_shard: fsdp_post_all_gather of parameter '{self.fqn}' must return "
                f"(unsharded_tensor, inner_tensors) when called without out=, got "
                f"{type(result).__name__}"
            )
        tensor, inner = result
        ours = {o.untyped_storage().data_ptr() for o in self.outputs}
        self._owned = []
        for t in inner:
            storage = t.untyped_storage()
            if storage.size() and storage.data_ptr() not in ours:
                self._owned.append((t, storage.size()))
        return torch.as_strided(tensor, self.shape, self.stride, storage_offset=0)

    def free(self) -> None:
        """Release the outputs' memory and the hook's own allocations (reshard)."""
        for output in self.outputs:
            output.untyped_storage().resize_(0)
        for tensor, _ in self._owned:
            tensor.untyped_storage().resize_(0)


def shard_mesh(mesh: DeviceMesh, shard_group: Any) -> DeviceMesh:
    """The 1-D mesh of the shard dim (HSDP: the last dim), which extensions gather over."""
    if mesh.ndim == 1:
        return mesh
    names = mesh.mesh_dim_names
    if names:
        return mesh[names[-1]]
    return DeviceMesh.from_group(shard_group, mesh.device_type)
