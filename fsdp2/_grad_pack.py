"""A group's gradients packed for reduction: the per-rank chunks every reduction sends.

``GradientPacking`` is the part of ``GradientReduction`` (``_grad_reduce``, mixed into
``ParamGroup``) that decides what a group's reduction carries and builds its input: which
parameters are reduced (the trainable ones), each rank's chunk (their padded shards back
to back, then the padded has-gradient flags), the one fused copy-in that fills every
rank's chunk, and the sums kept between backwards without gradient sync. How the chunks
are then summed over ranks, and where the result lands, is ``_grad_reduce``'s business.

[Note: gradients some ranks lack]
Ranks may use different parameters of one group in a step (mixture-of-experts routing,
optional branches), so a rank can reach a group's reduce-scatter without some gradients.
Two things must then not depend on local gradients: the collective's size (else ranks
disagree and hang), and whether a rank stores its shard of the reduced gradient (else the
update that other ranks' gradients make to this rank's rows is lost). So which parameters
are reduced is fixed by ``requires_grad`` (the trainable ones, packed in group order; see
[Note: reducing only the trainable parameters]), a missing gradient contributes zeros,
and each rank's chunk of the reduce-scatter input ends with one flag per parameter (1 if
this rank had its gradient). After the reduction (a sum or an average: nonzero either
way), a rank stores a gradient if any rank had it; a parameter no rank used keeps ``grad
is None``, like in non-sharded training. Only a rank that lacked some gradient itself
reads them (a host sync on accelerators). A group with no gradient on any rank still
reduces (zeros): the schedule of collectives must not depend on data.
``set_reduce_scatter_unused_params(True)`` makes every trainable parameter of a reducing
group store its shard, zeros where no rank used it (torch's meaning of that switch: its
unused parameters then join the reduce-scatter). The flags region of a chunk is padded
with zeros to a multiple of ``REDUCE_FLAG_ALIGN_BYTES`` (64); see [Note: padded gradient
flags]. The flags cost that region per rank in each reduce-scatter input and once in the
reduced gradients; nothing is kept between steps, and the buffer pool's slack is sized
for them.

[Note: padded gradient flags]
The flags lengthen each rank's chunk of the reduce-scatter input from torch's ``S``
elements (the padded shards) to ``S + F``, and how a backend sums a chunk can depend on
that length. Gloo's ring splits the whole input into ``k`` segments per rank of
``ceil(chunk / k)`` elements (``k = 2`` while a segment stays under 1 MiB, more beyond),
so rank ``r``'s first ``r * ((-chunk) % k)`` elements belong to the segment of rank
``r - 1``, which adds the ranks' terms in another order. With one flag per parameter
(``F = count``) that changed with the parity of ``count``: at 3 ranks gradients came out
one ulp off torch's. Padding ``F`` to 64 bytes (16 fp32 or 32 bf16 elements) keeps
``S + F = S (mod k)`` for every ``k`` dividing that, which covers ``k = 2`` (per-rank
chunks up to 2 MiB) and ``k = 4, 8, 16``, so every element is summed in torch's order
there; larger groups can still differ in the last bit at the first few elements of a
rank's chunk, and so can groups of a few elements per rank (fuzz seed 4266: a 1-element
chunk becomes 17 elements, and the sum order changes with the absolute length too) and
steps where torch leaves parameters without a gradient out of its reduce-scatter (its
chunk shrinks, ours does not). Both sides stay on the reference; only the last bit
differs. At 2 ranks the order of a two-term sum does not matter. The cost is at most
64 bytes per rank per reduce-scatter.

[Note: reducing only the trainable parameters]
A group's layout is planned at ``fully_shard`` with the frozen parameters at the end, but
``requires_grad`` may change afterwards (fine-tuning that freezes the weights of an
already sharded model and trains the biases). The reduce-scatter packs the parameters
trainable at this step, each rank's chunk holding their padded shards back to back in
group order, so its size follows what is trained, as torch's does: reducing every
parameter up to the last trainable one instead sent 52 times the bytes when a model's
weights were frozen after sharding (3 MLP blocks of dim 32, biases trained: 4192 elements
per rank instead of 80). When the trainable parameters are the first ones of the group
(the planned case), the packed layout is the group's reduce layout and each parameter's
``offset`` applies unchanged. A frozen parameter is never reduced: a gradient it still
holds (frozen between microbatches of an accumulation) is dropped, since whether a rank
holds one cannot decide a collective's size.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from fsdp2._divergence import Issued, checks_enabled
from fsdp2._fingerprints import (
    BLOCK_BYTES,
    allocate_with_room,
    block_numel,
    block_tensor,
    custom_refused,
)
from fsdp2._param import ShardedParam


class GradientPacking:
    """Per-rank chunks of a group's gradients (mixed into ``ParamGroup`` through
    ``GradientReduction``).

    The attributes below are set by ``ParamGroup.__init__`` and its layout planning."""

    params: list[ShardedParam]
    label: str
    path: str
    device: torch.device
    world_size: int
    reduce_dtype: torch.dtype | None
    _reduce_sizes: list[int]
    grads_unsynced: bool
    replicate_group: Any  # HSDP's process group over replicas, or None

    @property
    def where(self) -> str:
        """The group in messages: its modules' names under the root and their classes."""
        return f"{self.path} ({self.label})" if self.path else f"the root ({self.label})"

    @property
    def reduce_flag_bytes(self) -> int:
        """The most the has-gradient flags add to a reduce-scatter input: the padded flags
        region of every parameter, per rank (see [Note: gradients some ranks lack]). Only
        trainable parameters are reduced, so only their dtypes count (a frozen one may have
        a dtype that promotes with nothing, float8); a mixed group's reduce dtype is chosen
        per step, and its widest candidate bounds it."""
        trainable = [p.dtype for p in self.params if p.sharded_param.requires_grad]
        if not trainable:
            return 0
        dtype = self.reduce_dtype or promote_dtypes(trainable)
        flags = self.flag_numel(len(self.params), dtype) * dtype.itemsize
        return self.world_size * (flags + BLOCK_BYTES)  # and a fingerprint block

    def flag_numel(self, count: int, dtype: torch.dtype) -> int:
        """Elements of the flags region at the end of each rank's reduce-scatter chunk:
        ``count`` flags, zero-padded to a multiple of ``REDUCE_FLAG_ALIGN_BYTES`` so the
        chunk keeps torch's length modulo the backend's segmenting (see
        [Note: padded gradient flags])."""
        per_region = max(1, REDUCE_FLAG_ALIGN_BYTES // dtype.itemsize)
        return -(-count // per_region) * per_region

    def fingerprint_block_numel(self, dtype: torch.dtype, custom: Any) -> int:
        """Elements of the fingerprint block after the flags of each rank's chunk in
        ``dtype`` ([Note: in-band fingerprints] in ``_fingerprints``): none with the
        divergence checks off, for one rank without replicas (no collective), or with a
        custom reduce-scatter found unable to carry it."""
        if not checks_enabled() or (self.world_size == 1 and self.replicate_group is None):
            return 0
        if custom is not None and custom_refused(custom, self.where, _CUSTOM_API):
            return 0
        return block_numel(dtype)

    def reduce_input(
        self,
        custom: Any,
        rows: list[torch.Tensor],
        numel: int,
        block: int,
        dtype: torch.dtype,
        pool: Any,
    ) -> tuple[torch.Tensor, int, int]:
        """The reduction's input buffer for ``world_size`` chunks of ``numel`` elements (the
        last ``block`` of them the fingerprint block), from ``custom``'s allocator or the
        host buffer ``pool``; returns it, ``numel`` and ``block``, without the block (taken
        off ``rows`` too) when a custom allocator cannot carry it."""
        ws = self.world_size
        if custom is None:
            return pool.empty(ws * numel, dtype, self.device), numel, block
        if block:
            args = (ws * numel, dtype, self.device, self.where, _CUSTOM_API)
            roomy = allocate_with_room(custom, *args)
            if roomy is not None:
                return roomy, numel, block
            numel, block = numel - block, 0
            rows[-1] = rows[-1][:, : rows[-1].shape[1] - block_numel(dtype)]
        return custom.allocate((ws * numel,), dtype=dtype, device=self.device), numel, block

    def append_fingerprint_block(
        self, rows: list[torch.Tensor], issued: Issued | None, block: int
    ) -> int:
        """Add ``issued``'s fingerprint block (zeros without one: room for HSDP's
        all-reduce) after the flags, the last of ``rows`` (``gradient_rows``), in every
        rank's chunk; returns its elements."""
        flags = rows[-1]
        fingerprint = None if issued is None else issued.fingerprint
        values = block_tensor(fingerprint, block, flags.dtype, self.device)
        rows[-1] = torch.cat([flags, values.expand(self.world_size, block)], dim=1)
        return block

    # -- gradients -------------------------------------------------------------------------
    def reduced_positions(self) -> tuple[int, ...]:
        """Where in ``params`` the parameters this step's reduce-scatter carries sit: the
        trainable ones (see [Note: reducing only the trainable parameters])."""
        return tuple(i for i, p in enumerate(self.params) if p.sharded_param.requires_grad)

    def _packed_offsets(self, positions: tuple[int, ...]) -> list[int]:
        """Each reduced parameter's start in the packed reduce layout of ``positions``,
        and (last entry) the layout's length without the flags."""
        offsets = [0]
        for i in positions:
            offsets.append(offsets[-1] + self._reduce_sizes[i])
        return offsets

    def has_unsharded_grads(self) -> bool:
        return any(
            p.unsharded_param is not None and p.unsharded_param.grad is not None
            for p in self.params
        )

    def gradient_rows(
        self, positions: tuple[int, ...], reduce_dtype: torch.dtype
    ) -> tuple[list[torch.Tensor], list[bool], int]:
        """Take the unsharded gradients of the parameters at ``positions`` (this step's
        ``reduced_positions()``) off them and lay them out for the copy-in: one tensor per
        parameter with the sharded dim first (zeros where missing), then the ``(ws,
        flags)`` block. Returns them, which parameters had a local gradient, and the
        elements of one rank's chunk."""
        reduced = [self.params[i] for i in positions]
        count = len(reduced)
        grads = [self._take_unsharded_grad(p) for p in reduced]
        ws = self.world_size
        # ``rows``: each gradient with the sharded dim first (zeros where missing), cut
        # into ``ws`` chunks of its padded shard, one chunk per rank's input slice.
        rows: list[torch.Tensor] = []
        for p, grad in zip(reduced, grads):
            unsharded = p.require_unsharded_param()
            unsharded.grad = None
            if grad is None:
                dtype = unsharded.dtype
                padded_rows = (ws * p.rows_per_rank, p.row_numel)
                rows.append(grad_zeros(padded_rows, dtype, self.device))
            else:
                rows.append(p.as_rows(grad))
        # One "had a gradient" flag per parameter, repeated in every rank's chunk: after
        # the reduction each rank knows whether any rank had each gradient, for free. The
        # region is zero-padded to keep torch's summation order ([Note: padded gradient
        # flags]).
        # The common case (every gradient present) fills on the device: no host-to-device
        # copy, and nothing kept between steps (the flags cost memory only inside the
        # collective's buffers).
        # The flags take the gradients' dtype when they share one (0 and 1 are exact in
        # any), so one ``_chunk_cat`` copies and casts everything; a contiguous
        # ``(ws, flags)`` block keeps that kernel on its fast path on accelerators.
        has_grad = [g is not None for g in grads]
        flag_numel = self.flag_numel(count, reduce_dtype)
        row_dtypes = {t.dtype for t in rows}
        flag_dtype = row_dtypes.pop() if len(row_dtypes) == 1 else reduce_dtype
        if all(has_grad):
            flags = torch.zeros(ws, flag_numel, dtype=flag_dtype, device=self.device)
            flags[:, :count].fill_(1)
        else:
            padded = has_grad + [False] * (flag_numel - count)
            flags = torch.tensor(padded, dtype=flag_dtype, device=self.device).expand(ws, -1)
        rows.append(flags)
        numel = self._packed_offsets(positions)[-1] + flag_numel
        return rows, has_grad, numel

    def copy_in_grads(
        self, reduced: list[ShardedParam], rows: list[torch.Tensor], out: torch.Tensor
    ) -> None:
        """``_copy_in_grads``, with a clear error for a gradient it cannot take."""
        try:
            self._copy_in_grads(reduced, rows, out)
        except RuntimeError as exc:
            self._explain_copy_in_failure(reduced, rows[:-1], exc)
            raise

    def accumulate_unsynced(self) -> None:
        """Backward without gradient sync: move low-precision unsharded gradients into
        per-parameter sums in the reduce dtype, so accumulating microbatches in bf16 does
        not round away small contributions (256 + 1 + 1 + 1 stays 259, as in torch)."""
        self.grads_unsynced = True
        dtype = self.reduce_dtype
        if dtype is None:
            return
        for p in self.params:
            unsharded = p.unsharded_param
            if unsharded is None:
                continue
            grad = unsharded.grad
            if grad is None or grad.dtype == dtype:
                continue
            if p.accumulated_grad is None:
                p.accumulated_grad = grad.to(dtype)
            else:
                p.accumulated_grad.add_(grad)
            unsharded.grad = None

    def _take_unsharded_grad(self, p: ShardedParam) -> torch.Tensor | None:
        """The parameter's unsharded gradient, with any unsynced sum added (and cleared)."""
        grad = p.require_unsharded_param().grad
        total = p.accumulated_grad
        if total is None:
            return grad
        p.accumulated_grad = None
        if grad is not None:
            total.add_(grad)
        return total

    def _explain_copy_in_failure(
        self,
        reduced: list[ShardedParam],
        grads: Sequence[torch.Tensor | None],
        exc: RuntimeError,
    ) -> None:
        """Raise a clear error if the copy-in failed on a gradient it cannot take (checked
        only after a failure, so the common path pays nothing)."""
        for p, grad in zip(reduced, grads, strict=True):
            if grad is not None and grad.layout != torch.strided:
                raise RuntimeError(
                    f"fully_shard: parameter '{p.fqn}' of {self.where} got a gradient with "
                    f"layout {grad.layout}; fully_shard reduce-scatters dense (strided) "
                    f"gradients only. Make the op that uses it produce a dense gradient, or "
                    f"pass the parameter in ignored_params and reduce it yourself."
                ) from exc

    def _copy_in_grads(
        self, reduced: list[ShardedParam], rows: list[torch.Tensor], out: torch.Tensor
    ) -> None:
        """Fill ``out`` (``ws`` rank rows of the reduction's input) from ``rows`` (see
        ``gradient_rows``; one per parameter of ``reduced``, then the flags) in one kernel:
        chunk, pad and copy every gradient at once. When every row has one dtype (bf16
        gradients reduced in fp32 included) that kernel is ``torch._chunk_cat``, which pads
        uneven chunks and casts to ``out``'s dtype itself; otherwise (a group of mixed
        dtypes) one ``torch.cat`` also casts, after padding uneven gradients (one extra
        copy each) to whole chunks. Zero-size parameters own no columns of ``out``
        and are left out (neither kernel takes an empty tensor)."""
        ws = self.world_size
        if any(p.padded_numel == 0 for p in reduced):
            kept = [i for i, p in enumerate(reduced) if p.padded_numel]
            reduced = [reduced[i] for i in kept]
            rows = [rows[i] for i in kept] + [rows[-1]]
        if _chunk_cat is not None and len({t.dtype for t in rows}) == 1:
            _chunk_cat(rows, dim=0, num_chunks=ws, out=out)  # casts to ``out``'s dtype
            return
        chunks: list[torch.Tensor] = []
        for p, t in zip(reduced, rows[:-1], strict=True):
            if p.shard_dim or t.shape[0] == ws * p.rows_per_rank:
                chunks.append(t.reshape(ws, -1))  # even: a view (Shard(d > 0): a copy)
            else:
                padding = (ws * p.rows_per_rank - t.shape[0]) * p.row_numel
                chunks.append(F.pad(t.reshape(-1), (0, padding)).view(ws, -1))
        chunks.append(rows[-1])
        torch.cat(chunks, dim=1, out=out)


# See [Note: padded gradient flags].
REDUCE_FLAG_ALIGN_BYTES = 64
_CUSTOM_API = "set_custom_reduce_scatter"

# One aten kernel that chunks, pads and concatenates (what the reduce-scatter copy-in needs);
# torch's own FSDP uses it. Private in name, so looked up with a fallback.
_chunk_cat: Callable[..., torch.Tensor] | None = getattr(torch, "_chunk_cat", None)


def promote_dtypes(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """The dtype every given dtype converts to without loss (fp32 for bf16 and fp32)."""
    return functools.reduce(torch.promote_types, dtypes)


def grad_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros standing in for a missing gradient; expanded from one element, so they
    allocate nothing (the copy-in reads them as zeros)."""
    return torch.zeros(1, dtype=dtype, device=device).expand(shape)
