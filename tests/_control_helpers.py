"""Shared pieces of the explicit-control tests (``test_control``, ``test_grad_accumulation``,
``test_prefetch``, ``test_mixed_precision``, ``test_offload``, ``test_errors``).

Everything here runs inside the rank processes of ``_launcher.run_ranks``:

* ``Net``: a small residual MLP. The root group holds ``inp`` and ``head``; each block
  (``blocks.i``, its own group when sharded with ``shard_net``) has a different hidden
  width, so every group's all-gather input has a different number of elements and an
  intercepted all-gather can be mapped back to its group (``group_numels``).
* ``CollectiveLog``: patches ``torch.distributed``'s all-gather / reduce-scatter functions
  (looked up at call time by both fsdp2 and torch) and records every call, with the
  group it belongs to, the dtypes, the sizes and the reduce op.
* ``EVENTS``: when a list, ``Block`` appends ``"F<i>"`` when its forward body starts and
  ``"B<i>"`` when its backward reaches its middle; ``CollectiveLog`` appends
  ``"AG:<group>"`` / ``"RS:<group>"``, so tests can check what ran before what.
* reference training: ``reference_step`` does on one unsharded model what FSDP does on the
  sharded one (the global batch is the concatenation of the ranks' local batches).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _helpers import deterministic_init, full, get_fsdp_module_cls, get_fully_shard, make_mesh
from torch import nn

from fsdp2._fingerprints import tailed_numel

IN_DIM = 6
DIM = 16
HIDDENS = (8, 10, 12, 14)
TOL = 1e-5

# When a list: the order of forward/backward markers and collectives (see module docstring).
EVENTS: list[str] | None = None


def _mark(event: str) -> None:
    if EVENTS is not None:
        EVENTS.append(event)


def _raise(message: str) -> None:
    raise RuntimeError(message)


class Block(nn.Module):
    """``x + lin2(tanh(lin1(x)))``; logs ``F<index>`` / ``B<index>`` into ``EVENTS``."""

    def __init__(self, dim: int, hidden: int, index: int) -> None:
        super().__init__()
        self.index = index
        self.lin1 = nn.Linear(dim, hidden)
        self.lin2 = nn.Linear(hidden, dim)
        # test_control: inject an exception in the middle of forward / backward.
        self.fail_next_forward = False
        self.fail_next_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _mark(f"F{self.index}")
        if self.fail_next_forward:
            self.fail_next_forward = False
            raise RuntimeError(f"injected failure in blocks.{self.index}")
        h = self.lin1(x)
        if self.fail_next_backward and h.requires_grad:
            self.fail_next_backward = False
            index = self.index
            h.register_hook(lambda grad: _raise(f"injected failure in blocks.{index} backward"))
        if EVENTS is not None and h.requires_grad:
            index = self.index
            h.register_hook(lambda grad: _mark(f"B{index}"))
        return x + self.lin2(torch.tanh(h))


class Net(nn.Module):
    """``head(blocks(inp(x)))``; ``generate`` feeds the head's output back as the input."""

    def __init__(self, hiddens: tuple[int, ...] = HIDDENS) -> None:
        super().__init__()
        self.inp = nn.Linear(IN_DIM, DIM)
        self.blocks = nn.ModuleList(Block(DIM, h, i) for i, h in enumerate(hiddens))
        self.head = nn.Linear(DIM, IN_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def generate(self, x: torch.Tensor, steps: int) -> torch.Tensor:
        """Autoregressive-style decoding that bypasses ``forward``: it uses the root
        group's ``inp``/``head`` directly (and calls the blocks, their own groups)."""
        outputs = []
        for _ in range(steps):
            h = self.inp(x)
            for block in self.blocks:
                h = block(h)
            x = torch.tanh(self.head(h))
            outputs.append(x)
        return torch.stack(outputs)

    def embed_only(self, x: torch.Tensor) -> torch.Tensor:
        """A method that touches the root group's parameters and is never registered."""
        return self.inp(x)


def api(impl: str, name: str) -> Any:
    """``name`` (e.g. ``"share_comm_ctx"``) from fsdp2 or ``torch.distributed.fsdp``."""
    module = importlib.import_module("fsdp2" if impl == "fsdp2" else "torch.distributed.fsdp")
    return getattr(module, name)


def build_net(seed: int = 0, hiddens: tuple[int, ...] = HIDDENS) -> Net:
    model = Net(hiddens)
    deterministic_init(model, seed)
    return model


def shard_net(
    model: Net, impl: str, mesh: Any = None, root_kwargs: dict | None = None, **kwargs: Any
) -> Net:
    """``fully_shard`` each block, then the root (same keyword arguments for all, updated
    by ``root_kwargs`` for the root)."""
    fully_shard = get_fully_shard(impl)
    mesh = mesh if mesh is not None else make_mesh()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **{**kwargs, **(root_kwargs or {})})
    return model


def fsdp_modules(model: nn.Module, impl: str) -> list[nn.Module]:
    cls = get_fsdp_module_cls(impl)
    return [m for m in model.modules() if isinstance(m, cls)]


def group_of(param_name: str) -> str:
    """The group a ``Net`` parameter belongs to when sharded with ``shard_net``."""
    match = re.match(r"blocks\.(\d+)\.", param_name)
    return f"blocks.{match.group(1)}" if match else "root"


def group_numels(model: nn.Module, world_size: int) -> dict[int, str]:
    """Elements of each group's all-gather input (padded local shards, summed) -> group.

    Both implementations all-gather one flat buffer per group holding every parameter's
    ``ceil(dim0 / world_size) * row_numel`` elements. ``model`` must be unsharded."""
    numels: dict[str, int] = {}
    for name, p in model.named_parameters():
        per_rank = math.ceil(p.shape[0] / world_size) * math.prod(p.shape[1:])
        numels[group_of(name)] = numels.get(group_of(name), 0) + per_rank
    by_numel = {n: g for g, n in numels.items()}
    assert len(by_numel) == len(numels), f"groups are not distinguishable by size: {numels}"
    return by_numel


# ------------------------------------------------------------------ intercepted collectives

ALL_GATHERS = ("all_gather_single", "all_gather_into_tensor")
REDUCE_SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor")


@dataclass
class Call:
    kind: str  # "AG" or "RS"
    group: str  # from group_numels; "?" if unknown
    phase: str
    in_numel: int
    in_dtype: torch.dtype
    out_numel: int
    out_dtype: torch.dtype
    in_bytes: int
    out_bytes: int
    op: str = ""
    flags: int = 0  # fsdp2's padded "had a gradient" flags at the end of an RS chunk
    process_group: Any = None  # the ``group`` argument (None: the default group)


# fsdp2 appends one flag per parameter to each rank's reduce-scatter chunk, zero-padded to a
# multiple of 64 bytes ([Note: padded gradient flags]), then (divergence checks on) a 64-byte
# fingerprint block; groups in these tests have far fewer parameters than this, and sizes
# far further apart.
MAX_FLAGS = 64
FLAG_ALIGN_BYTES = 64


def flag_numel(count: int, dtype: torch.dtype) -> int:
    """The elements fsdp2's flags add to each rank's reduce-scatter chunk for ``count``
    parameters reduced in ``dtype``: ``count`` rounded up to a multiple of 64 bytes."""
    per_region = FLAG_ALIGN_BYTES // dtype.itemsize
    return -(-count // per_region) * per_region


@dataclass
class CollectiveLog:
    """Records every all-gather and reduce-scatter ``torch.distributed`` is asked for.

    Use as a context manager; ``phase`` labels the calls recorded while it is set."""

    numel_to_group: dict[int, str] = field(default_factory=dict)
    phase: str = ""
    calls: list[Call] = field(default_factory=list)
    _originals: dict[str, Any] = field(default_factory=dict)

    def __enter__(self) -> CollectiveLog:
        for names, kind in ((ALL_GATHERS, "AG"), (REDUCE_SCATTERS, "RS")):
            for name in names:
                fn = getattr(dist, name, None)
                if fn is not None:
                    self._originals[name] = fn
                    setattr(dist, name, self._wrap(kind, fn))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, fn)
        self._originals.clear()

    def _wrap(self, kind: str, fn: Any) -> Any:
        signature = inspect.signature(fn)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            values = list(bound.arguments.values())
            out, inp = values[0], values[1]  # (output, input) for all four functions
            # The group is named by the all-gather input / reduce-scatter output size.
            key = inp.numel() if kind == "AG" else out.numel()
            if kind == "AG" and key not in self.numel_to_group:
                # fsdp2's divergence checks end each rank's slot with a 16-byte tail
                # ([Note: in-band fingerprints] in fsdp2/_fingerprints.py).
                key = next(
                    (n for n in self.numel_to_group if tailed_numel(n, inp.dtype) == key), key
                )
            flags = 0
            if kind == "RS" and key not in self.numel_to_group:
                # A flags region is a whole number of 64-byte blocks.
                itemsize = out.element_size()
                base = max(
                    (
                        n
                        for n in self.numel_to_group
                        if 0 < key - n <= MAX_FLAGS and (key - n) * itemsize % FLAG_ALIGN_BYTES == 0
                    ),
                    default=0,
                )
                flags = key - base if base else 0
                key = base or key
            group = self.numel_to_group.get(key, "?")
            op = bound.arguments.get("op")
            self.calls.append(
                Call(
                    kind,
                    group,
                    self.phase,
                    inp.numel(),
                    inp.dtype,
                    out.numel(),
                    out.dtype,
                    inp.numel() * inp.element_size(),
                    out.numel() * out.element_size(),
                    "" if op is None else str(op),
                    flags,
                    bound.arguments.get("group"),
                )
            )
            _mark(f"{kind}:{group}")
            return fn(*args, **kwargs)

        return wrapper

    def count(self, kind: str, phase: str | None = None, group: str | None = None) -> int:
        return sum(
            1
            for c in self.calls
            if c.kind == kind
            and (phase is None or c.phase == phase)
            and (group is None or c.group == group)
        )

    def groups(self, kind: str, phase: str | None = None) -> list[str]:
        return [
            c.group for c in self.calls if c.kind == kind and (phase is None or c.phase == phase)
        ]


@contextlib.contextmanager
def recording_events() -> Iterator[list[str]]:
    """Collect ``Block`` markers and collective markers into a fresh ``EVENTS`` list."""
    global EVENTS
    EVENTS = []
    try:
        yield EVENTS
    finally:
        EVENTS = None


# ------------------------------------------------------------------ data and reference


def global_batch(step: int, rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * seed + step)
    return torch.randn(rows, IN_DIM, generator=gen), torch.randn(rows, IN_DIM, generator=gen)


def rank_slice(batch: tuple[torch.Tensor, ...], rank: int, world_size: int) -> tuple:
    rows = batch[0].shape[0] // world_size
    return tuple(t[rank * rows : (rank + 1) * rows] for t in batch)


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


def adamw(model: nn.Module, lr: float = 1e-2) -> torch.optim.Optimizer:
    # eps=1e-3 for the reason given at _helpers.ADAM_EPS (bounded noise amplification).
    return torch.optim.AdamW(model.parameters(), lr=lr, eps=1e-3)


def reference_step(
    ref: nn.Module, opt: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]
) -> float:
    """One optimizer step of the unsharded reference on the whole global batch."""
    loss = mse(ref, batch)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def data_parallel_steps(
    model: nn.Module,
    ref: nn.Module,
    opt: torch.optim.Optimizer,
    ref_opt: torch.optim.Optimizer,
    steps: int = 3,
) -> None:
    """``steps`` optimizer steps: ``model`` on this rank's rows of each global batch (two
    rows per rank), the unsharded ``ref`` on the whole batch."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    for step in range(steps):
        batch = global_batch(step, 2 * ws)
        reference_step(ref, ref_opt, batch)
        mse(model, rank_slice(batch, rank, ws)).backward()
        opt.step()
        opt.zero_grad()


def max_param_diff(ref: nn.Module, model: nn.Module) -> tuple[str, float]:
    """(name, max abs diff) of the worst parameter (collective: every rank calls it)."""
    sharded = dict(model.named_parameters())
    worst = ("", 0.0)
    for name, p in ref.named_parameters():
        diff = (full(sharded[name].detach()) - p.detach()).abs().max().item()
        if not diff <= worst[1]:
            worst = (name, diff)
    return worst


def full_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Unsharded gradients by name (collective)."""
    return {
        n: None if p.grad is None else full(p.grad).detach().clone()
        for n, p in model.named_parameters()
    }


def clone_model(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
