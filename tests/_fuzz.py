"""Differential fuzzing of fsdp2 against torch's ``fully_shard``: random models and training
configurations from an integer seed, trained under both implementations (and without
sharding) from the same weights on the same per-rank batches.

A *case* is a plain, picklable dict (``gen_case(seed)``; any key can be overridden to
minimize a failure):

* ``spec``: the model, a tree of ``(kind, ...)`` tuples built by ``build``: Linear (with or
  without bias, odd sizes such as 1, 3, 5, 7 so shards are uneven or empty), LayerNorm,
  RMSNorm, Embedding (optionally tied to the output head), Conv1d, modules with 1-D and
  3-D parameters, inside Sequential / ModuleList / ModuleDict / custom containers (depth
  1-3): residual, called twice per forward (``twice``), skipped on every other step
  (``maybe``, the same on every rank), activation checkpointing (``ckpt``,
  ``use_reentrant=False``), own parameters around a child (``gated``);
* ``plan``: the ``fully_shard`` calls, bottom-up, each ``(module names, reshard_after_forward)``
  (several names: one group for a list of modules); the root always last;
* ``frozen``: parameters with ``requires_grad=False`` before sharding;
* training: ``steps``, bf16 ``mp`` (``param_dtype=bfloat16, reduce_dtype=float32``),
  ``accum`` (two microbatches, ``set_requires_gradient_sync(False)`` on the first),
  ``set_to_none`` for ``zero_grad``, ``optim`` (SGD with momentum or AdamW), ``clip``
  (``clip_grad_norm_``), ``eval_at`` (an ``eval()`` + ``no_grad`` forward after those
  steps), ``sd_roundtrip`` (``state_dict()`` after step 0, loaded back after step 1),
  ``ops`` (``unshard()`` / ``reshard()`` calls between steps), ``input_requires_grad``,
  ``discard_fwd`` (``{step: "pre" | "post"}``: a forward with grad enabled whose loss is
  discarded, before the step's forward or after its backward, just before
  ``optimizer.step()``), ``two_fwd`` (without ``accum``: two microbatches forwarded, then
  one backward per loss, ``"in_order"`` or ``"reversed"``); these two from seed
  ``EXTENDED_FROM`` (3000) on; ``penalty`` (from seed ``PENALTY_FROM``, 8000: an
  input-gradient penalty taken with ``create_graph=True`` and added to an MSE loss).

From seed ``SHARDING_FROM`` (4000) on (the keys below are absent from earlier cases, which
stay exactly as they were): world sizes 2, 3 or 4 (4 half the time), sizes divisible by 2
and 4 more often, and

* an ``experts`` module (``Experts``) whose forward calls ``.view()`` on its parameters: a 3-D
  weight ``(e, din, dout)`` as ``(e * din, dout)`` or a 2-D ``(din, e * dout)`` as
  ``(din, e, dout)``, so a parameter not in its natural contiguous layout raises;
* ``shard_dims``: per ``plan`` entry, None (no ``shard_placement_fn``) or ``{fqn: d}``: the
  ``shard_placement_fn`` returns ``Shard(d)`` (d > 0, only for dims the shard group size
  divides: both implementations reject uneven dims > 0) for those parameters, else None;
* ``mesh``: None (1-D mesh) or ``(2, 2)`` at 4 ranks: HSDP, ``mesh_dim_names=("replicate",
  "shard")``, passed to every ``fully_shard`` call; ``accum_mode`` (with ``accum``):
  ``"gradient_sync"`` (``set_requires_gradient_sync(False)`` on the first microbatch),
  ``"all_reduce"`` (``set_requires_all_reduce(False)`` instead, HSDP only) or ``"both"``;
* ``reshard_after_forward=2`` (int) in ``plan`` entries at 4 ranks on a 1-D mesh
  (``p_raf_int``; with HSDP the int must divide the shard group size 2, where 2 is True).

From seed ``PER_PARAM_MESH_FROM`` (6000) on (keys absent before), per-parameter meshes
(torch 2.13's ``ShardPlacementResult(placement, mesh_info)``), all over every rank so parity
with the reference holds (``PARAM_MESHES``):

* ``param_meshes``: the names of the meshes a case may use (none in some cases), created
  once per case before sharding, in this order, on every rank;
* ``param_mesh``: per ``plan`` entry, None or ``{fqn: name}``: ``shard_placement_fn``
  returns ``ShardPlacementResult(Shard(d) or None, mesh_info)`` for those parameters
  (``FSDPMeshInfo`` for a 1-D mesh, ``HSDPMeshInfo(shard_mesh_dim=1,
  replicate_mesh_dim=0)`` for a 2-D one), so one call makes a group per mesh; ``shard_dims``
  then only picks dims that mesh's shard group size divides, and an int
  ``reshard_after_forward`` only meshes whose shard size it divides;
* ``pp_raw_mesh``: fsdp2 gets the ``DeviceMesh`` itself as ``mesh_info`` (which it also
  accepts), torch the mesh info; ``accum_mode`` may be ``"all_reduce"`` / ``"both"`` with an
  HSDP per-parameter mesh on a 1-D default mesh; ``clip`` then computes the norm from every
  gradient's ``full_tensor()`` (``clip_grad_norm_`` cannot stack norms of several meshes).

From seed ``EXTENSIONS_FROM`` (7000) on (keys absent before), all-gather extensions:

* ``ext``: names of ``nn.Linear`` weights (not tied, not ``Shard(d > 0)``) made
  ``Gathered`` tensor subclasses before sharding: their ``fsdp_pre_all_gather`` returns
  the fp32 shard, padded on uneven shards by the hook when ``ext_pad`` (torch's contract)
  or left to fsdp2 (torch raises), and ``fsdp_post_all_gather`` casts to ``param_dtype``:
  the same numerics as a plain weight, so parity with the reference holds. The reference
  keeps plain weights.

From seed ``META_LOAD_FROM`` (7500) on, ``meta_load`` (cases without extensions): each
implementation's model is built on the meta device, sharded, and loaded with
``load_state_dict(assign=True)`` from ``DTensor`` shards of the case's weights, a tied head
tied again afterwards (accelerate's ``cpu_ram_efficient_loading``).

From seed ``TOGGLE_FROM`` (9000) on, ``toggle`` (``{step: [parameter names]}``, at steps in
``eval_at``): right after that step's eval forward, which may leave groups gathered,
``requires_grad`` of those parameters is flipped through the module (on whichever
parameter object the module holds then), in the reference too. From ``INFERENCE_FROM``
(9500) on, ``eval_mode`` runs half the cases' eval forwards under ``torch.inference_mode()``
(Lightning's validation loop does) instead of ``no_grad``, and ``eval_first`` adds an eval
forward before the first step in half the cases (Lightning's sanity check: lazy init then
happens there).

From seed ``CONTROL_FROM`` (10000) on (keys absent before), ``FSDPModule`` control knobs,
each drawn independently in about half the cases and applied alike to both implementations
(so parity with torch and with the reference must hold); three cases in four also drop what
torch fails on or is off the reference with (``penalty``, inference-mode evals, ``toggle``,
``ext_pad=False``), so the knobs are compared with torch:

* ``offload``: ``CPUOffloadPolicy(pin_memory=False)`` (each implementation's class) passed
  to every ``fully_shard`` call;
* ``prefetch``: None or ``{"fwd": {i: [j, ...]}, "bwd": {i: [j, ...]}}`` by ``plan`` index
  (a list group by its first module): ``set_modules_to_forward_prefetch`` on entry ``i``
  with the next 0, 1 or 2 entries in plan order, ``set_modules_to_backward_prefetch``
  with the previous 0, 1 or 2 (nearest first); an empty list turns implicit prefetching
  off for that module;
* ``rab_accum`` (with ``accum``): ``"rab"``: ``set_reshard_after_backward(False)`` on the
  root before the first microbatch, ``True`` before the last (torch's documented
  accumulation pattern; never left False across an optimizer step); ``"rab_last"``: also
  ``set_is_last_backward(False)`` / ``True`` alike; None: neither;
* ``async_unshard``: ``{step: (wait, i)}``: before that step's (first) forward, after
  ``ops`` and a ``"pre"`` discarded forward, ``root.unshard(async_op=True)``, and on
  ``plan`` entry ``i`` too unless ``i`` is None; ``wait``: wait for the handles there,
  else the forward does;
* ``divide``: None or a factor f (1 or twice the world size):
  ``set_gradient_divide_factor(f)`` and ``set_force_sum_reduction_for_comms(True)`` on
  every sharded module (gloo has no ``PREMUL_SUM``, which torch uses for a factor without
  forced sums). A gradient is then the sum over every data-parallel rank (replicas
  included) divided by f: the reference multiplies what each step's backward added to
  its gradients by ``ws / f`` (a gradient kept from an earlier step is scaled already). f is 1 where a per-parameter mesh has shard groups of one rank (torch then
  divides twice with forced sums: its single-rank copy divides, then the post-reduction
  division again).

From seed ``PARTIAL_FROM`` (11000) on (keys absent before), module-list groups whose
modules take part in different forwards and backwards: ``p_list`` is drawn again from
0.3 and 0.6, so list groups (some over a ``maybe`` child, skipped on steps of one parity)
are frequent, and a case with an output head may compute its loss chunk by chunk outside
the model's forward (``chunked``), as LLM training does to save the logits' memory:

* ``chunked``: None, ``"split"`` (the forward returns the hidden state, the head runs on
  ``chunks`` chunks of its detached rows, each with its own backward, then the trunk's
  backward takes the hidden state's gradient: each backward involves only part of a list
  group holding the head) or ``"retain"`` (each chunk's backward runs through the shared
  trunk, ``retain_graph`` until the last); the loss is the sum of the chunks' sums over the
  whole batch's count, the same objective as the unchunked loss (the reference computes
  that one);
* ``head_group``: how the head is sharded then (a call outside the root's forward needs a
  group of its own): ``"alone"``, ``"with"`` (``fully_shard([<a body module>, "head"])``,
  the module named in ``head_partner``, whose call happens in the root's forward) or, with
  a tied head, ``["embed", "head"]``;
* ``chunk_sync``: ``"last"``: ``set_requires_gradient_sync(False, recurse=False)`` on the
  head's group for every chunk but the last (the usual pattern), or ``"every"``.

``run_impls`` is the rank function (it trains one sharded copy per implementation and
returns, per step, every rank's losses and eval outputs and, from rank 0, every
parameter's and gradient's ``full_tensor()``); ``run_reference`` trains the non-sharded
model on the global batch in the calling process. ``compare_impls`` / ``compare_reference``
list the differences. ``torch_lacks(case)`` names a torch feature the case needs that this
torch lacks (per-parameter meshes before 2.13): torch is not run on such a case, and fsdp2
is still checked against the reference (label ``torch_unsupported``).

To fuzz a range of seeds (a few hundred take a few minutes on 2 cores)::

    python tests/_fuzz.py 0 300          # one line per seed that is not "ok"
    python tests/_fuzz.py 486 487 -v     # a case, its spec and every difference
    python tests/_fuzz.py 0 300 --streams  # fsdp2 only, under the stream-race checker

With ``--streams`` each case trains fsdp2 alone inside ``_stream_sanitizer``'s stand-in
streams (``run_sanitized``), and a seed is reported when its accelerator stream ordering
has a race (see ``tests/test_stream_races.py``); numbers are not compared.
"""

from __future__ import annotations

import functools
import math
import random
import sys
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn
from torch.utils.checkpoint import checkpoint

# The training step, read by ``Maybe`` (set the same on every rank).
CTX = {"step": 0}

# fsdp2 vs torch: bitwise at 2 ranks (a sum of two terms does not depend on its order).
# At 3 and 4 ranks gloo adds a reduce-scatter element's terms in an order that depends on
# the buffer's length (its ring splits the buffer into segments); fsdp2's "had a gradient"
# flags lengthen each rank's chunk. Padding them to 64 bytes ([Note: padded gradient flags])
# keeps torch's order for most layouts, not all: a group of a few elements per rank
# (seed 4266: 1 element plus 16 flags against torch's 1), or a step where torch leaves
# parameters without a gradient out of its reduce-scatter (seed 4217), can differ in the
# last bit, with both implementations on the reference. Hence a relative tolerance of a few
# ulps from 3 ranks on, and bitwise at 2.
IMPL_TOL = 0.0
MULTI_RANK_IMPL_TOL = 1e-6
# A module called several times per forward with gradient accumulation: torch reduces after
# each call's backward, fsdp2 once after the last (see ``classify``): sums round apart.
TWICE_ACCUM_TOL = 1e-6


def is_twice_accum(case: dict) -> bool:
    """Whether ``case`` calls a module several times per forward and accumulates."""
    return bool(case["accum"]) and "'twice'" in repr(case["spec"])


def is_chunked_accum(case: dict) -> bool:
    """Whether ``case`` computes a chunked loss (``chunked``) with gradient accumulation.
    Each chunk's backward ends with fsdp2's final callback, which reduces the sums that
    the earlier, unsynced microbatch left in a gathered group this backward did not reach
    (the root); the trunk's backward then reduces its own part. torch queues no final
    callback for the calls of a list group made outside the forward, so with the head in
    a list group it reduces both parts in one sum (and with the head alone it does as
    fsdp2): the sums round apart by an ulp, both on the reference."""
    return bool(case.get("chunked")) and bool(case["accum"])


def impl_tol(case: dict) -> float:
    """The relative tolerance between fsdp2 and torch on ``case``: bitwise at 2 ranks,
    a few ulps from 3 ranks on (see ``MULTI_RANK_IMPL_TOL``), except where the two reduce a
    module's gradients at different times by design."""
    if is_twice_accum(case) or is_chunked_accum(case):
        return TWICE_ACCUM_TOL
    return IMPL_TOL if case["ws"] <= 2 else MULTI_RANK_IMPL_TOL


# Seeds from here on also draw ``discard_fwd`` and ``two_fwd`` (added later).
EXTENDED_FROM = 3000

# Seeds from here on also draw world size 4, HSDP, ``shard_placement_fn``, int
# ``reshard_after_forward`` and ``Experts`` (the cases' new keys are absent before).
SHARDING_FROM = 4000

# Seeds from here on also draw per-parameter meshes (``param_mesh``; absent before).
PER_PARAM_MESH_FROM = 6000
# From this seed on, some Linear weights use all-gather extensions (``Gathered``).
EXTENSIONS_FROM = 7000
# From this seed on, some cases (without extensions) build the model on the meta device,
# shard it and load the weights with ``load_state_dict(assign=True)`` (``meta_load``).
META_LOAD_FROM = 7500
# From this seed on, half the cases with an MSE loss add an input-gradient penalty
# (``penalty``): ``autograd.grad(..., create_graph=True)``, then backward through it.
PENALTY_FROM = 8000
# From this seed on, some cases flip ``requires_grad`` after an eval forward (``toggle``).
TOGGLE_FROM = 9000
# From this seed on, half the cases run their eval forwards under ``torch.inference_mode()``
# instead of ``no_grad`` (``eval_mode``).
INFERENCE_FROM = 9500
# From this seed on, cases draw FSDPModule control knobs and policies applied alike to both
# implementations (``offload``, ``prefetch``, ``rab_accum``, ``async_unshard``, ``divide``),
# and most of them leave out what torch's ``fully_shard`` fails on (``_draw_control``).
CONTROL_FROM = 10000
# From this seed on, list groups are frequent and cases with a head may compute their loss
# chunk by chunk outside the forward (``chunked``, ``head_group``, ``chunk_sync``).
PARTIAL_FROM = 11000

# Per-parameter meshes by world size: a name and the mesh's ranks (1-D: FSDP; 2-D:
# ``(replicate, shard)``, HSDP). Every mesh spans all ranks, so training stays plain data
# parallelism. A 1-D mesh over all ranks, in any order, is on the default process group
# (``DeviceMesh`` reuses it): ``perm`` (and ``flat``) share their process group with the
# 1-D default mesh, torch then rejects them mixed with default-mesh parameters in one call
# ("must use the same FSDPMeshInfo object"). ``(1, n)``: the shard group is the default one,
# the replicate groups single ranks; ``(n, 1)``: shard groups of one rank.
PARAM_MESHES: dict[int, dict[str, list]] = {
    2: {"perm": [1, 0], "h12": [[0, 1]], "h21": [[0], [1]]},
    3: {"perm": [2, 0, 1], "h13": [[0, 1, 2]], "h31": [[0], [1], [2]]},
    4: {
        "perm": [0, 2, 1, 3],
        "flat": [0, 1, 2, 3],
        "h22": [[0, 1], [2, 3]],
        "h22t": [[0, 2], [1, 3]],
        "h14": [[0, 1, 2, 3]],
        "h41": [[0], [1], [2], [3]],
    },
}

# Against the non-sharded reference (relative to the magnitude of the values).
REF_TOL = {"fp32": 1e-5, "bf16": 5e-2}


# ---------------------------------------------------------------------------- modules


class SeqConv1d(nn.Conv1d):
    """Conv1d over (batch, length, channels) inputs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.transpose(1, 2)).transpose(1, 2)


class Raw(nn.Module):
    """Parameters of odd shapes: a 3-D weight (dim 0 of size 2), a 1-D bias, a (1,) gain."""

    def __init__(self, din: int, dout: int) -> None:
        super().__init__()
        self.w3 = nn.Parameter(torch.empty(2, din, dout))
        self.b = nn.Parameter(torch.empty(dout))
        self.g = nn.Parameter(torch.empty(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w3[0]) * self.g + torch.tanh(x @ self.w3[1]) + self.b


class Experts(nn.Module):
    """A soft mixture of ``e`` experts whose forward reshapes its parameters with
    ``.view()`` (which needs their natural contiguous layout): ``mode`` ``"view"``: a 3-D
    weight ``(e, din, dout)`` used as ``(e * din, dout)``; ``"flat"``: a 2-D weight
    ``(din, e * dout)`` used as ``(din, e, dout)``."""

    def __init__(self, din: int, dout: int, e: int, mode: str) -> None:
        super().__init__()
        self.e, self.mode = e, mode
        self.router = nn.Parameter(torch.empty(din, e))
        shape = (e, din, dout) if mode == "view" else (din, e * dout)
        self.w = nn.Parameter(torch.empty(*shape))
        self.b = nn.Parameter(torch.empty(e, dout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, din = x.shape[:-1], x.shape[-1]
        h = x.reshape(-1, din)
        g = torch.softmax(h @ self.router, dim=-1)  # (n, e)
        if self.mode == "view":
            mixed = (g[:, :, None] * h[:, None, :]).reshape(h.shape[0], self.e * din)
            out = mixed @ self.w.view(self.e * din, -1)
        else:
            out = torch.einsum("nd,deo,ne->no", h, self.w.view(din, self.e, -1), g)
        out = out + g @ self.b.view(self.e, -1)
        return out.reshape(*lead, out.shape[-1])


class Scale(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class ListBlock(nn.Module):
    def __init__(self, children: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(children)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class DictBlock(nn.Module):
    def __init__(self, children: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({f"b{i}": c for i, c in enumerate(children)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            x = block(x)
        return x


class Residual(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(x)


class Twice(nn.Module):
    """``inner`` called twice per forward: chained, or on two inputs and summed."""

    def __init__(self, inner: nn.Module, mode: str) -> None:
        super().__init__()
        self.inner = inner
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "chain":
            return self.inner(torch.tanh(self.inner(x)))
        return self.inner(x) + self.inner(0.5 * x)


class Maybe(nn.Module):
    """Skips ``inner`` on the steps of one parity."""

    def __init__(self, inner: nn.Module, phase: int) -> None:
        super().__init__()
        self.inner = inner
        self.phase = phase

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if CTX["step"] % 2 == self.phase:
            return x
        return self.inner(x)


class Ckpt(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return checkpoint(self.inner, x, use_reentrant=False)
        return self.inner(x)


class Gated(nn.Module):
    """Own parameters around a child: ``inner(x) * gain + shift``."""

    def __init__(self, inner: nn.Module, d: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.empty(d))
        self.inner = inner
        self.shift = nn.Parameter(torch.empty(1, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.gain + self.shift


class Side(nn.Module):
    """Calls ``inner`` but returns its input: ``drop`` discards the output (its backward never
    runs), ``zero`` adds it times zero (its backward runs with zero gradients)."""

    def __init__(self, inner: nn.Module, mode: str) -> None:
        super().__init__()
        self.inner = inner
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        return x if self.mode == "drop" else x + 0.0 * out


class Root(nn.Module):
    def __init__(self, spec: dict) -> None:
        super().__init__()
        self.has_embed = spec["embed"] is not None
        if self.has_embed:
            vocab, d = spec["embed"]
            self.embed = nn.Embedding(vocab, d)
        self.body = build(spec["body"])
        self.head = None
        if spec["head"] is not None:
            din, dout, bias = spec["head"]
            self.head = nn.Linear(din, dout, bias=bias)
            if spec["tied"]:
                self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor, skip_head: bool = False) -> torch.Tensor:
        """``skip_head``: return the hidden state (the loss then applies the head in
        chunks: ``chunked``)."""
        h = self.embed(x) if self.has_embed else x
        h = self.body(h)
        return self.head(h) if self.head is not None and not skip_head else h


def build(spec: tuple) -> nn.Module:
    kind, *args = spec
    if kind == "linear":
        return nn.Linear(args[0], args[1], bias=args[2])
    if kind == "layernorm":
        return nn.LayerNorm(args[0], bias=args[1])
    if kind == "rmsnorm":
        return nn.RMSNorm(args[0])
    if kind == "conv":
        return SeqConv1d(args[0], args[1], args[2], padding=args[2] // 2, bias=args[3])
    if kind == "act":
        return {"tanh": nn.Tanh, "gelu": nn.GELU, "relu": nn.ReLU}[args[0]]()
    if kind == "scale":
        return Scale(args[0])
    if kind == "raw":
        return Raw(args[0], args[1])
    if kind == "experts":
        return Experts(*args)
    if kind == "seq":
        return nn.Sequential(*[build(c) for c in args[0]])
    if kind in ("list", "dict"):
        return (ListBlock if kind == "list" else DictBlock)([build(c) for c in args[0]])
    wrappers = {"residual": Residual, "twice": Twice, "maybe": Maybe, "ckpt": Ckpt, "gated": Gated}
    wrappers["side"] = Side
    return wrappers[kind](build(args[0]), *args[1:])


# ---------------------------------------------------------------------------- generation

DIMS = [1, 2, 3, 4, 5, 7, 8, 9, 12, 16]
# From ``SHARDING_FROM`` on: more sizes that 2 and 4 divide (for ``Shard(d > 0)``).
DIMS_SHARDING = [1, 2, 3, 4, 4, 5, 8, 8, 12, 16]
LEAVES = ["linear", "linear", "layernorm", "rmsnorm", "conv", "act", "scale", "raw"]


def _gen_leaf(
    rng: random.Random, d: int, same_dim: bool, sharding: bool = False
) -> tuple[tuple, int]:
    kind = rng.choice(LEAVES + ["experts", "experts"] if sharding else LEAVES)
    out = d if same_dim else rng.choice(DIMS_SHARDING if sharding else DIMS)
    if kind == "experts":
        return ("experts", d, out, rng.choice([2, 4]), rng.choice(["view", "flat"])), out
    if kind == "linear":
        return ("linear", d, out, rng.random() < 0.7), out
    if kind == "conv":
        return ("conv", d, out, rng.choice([1, 3]), rng.random() < 0.6), out
    if kind == "raw":
        return ("raw", d, out), out
    if kind == "layernorm":
        return ("layernorm", d, rng.random() < 0.5), d
    if kind in ("rmsnorm", "scale"):
        return (kind, d), d
    return ("act", rng.choice(["tanh", "gelu", "relu"])), d


def _gen_node(
    rng: random.Random,
    depth: int,
    d: int,
    same_dim: bool = False,
    sharding: bool = False,
    skips: bool = False,
) -> tuple[tuple, int]:
    """A subtree taking ``d`` features; returns it and its output features (``sharding``:
    the leaves and sizes of seeds from ``SHARDING_FROM`` on; ``skips``: modules skipped on
    some steps (``maybe``) more often, from ``PARTIAL_FROM`` on)."""
    if depth <= 0 or rng.random() < 0.3:
        return _gen_leaf(rng, d, same_dim, sharding)
    kinds = ["seq", "list", "dict", "residual", "twice", "maybe", "ckpt", "gated"]
    kind = rng.choice(kinds + ["maybe", "maybe"] if skips else kinds)
    if kind in ("seq", "list", "dict"):
        n = rng.randint(1, 3)
        children = []
        cur = d
        for i in range(n):
            child, cur = _gen_node(rng, depth - 1, cur, same_dim and i == n - 1, sharding, skips)
            children.append(child)
        if same_dim and cur != d:
            children.append(("linear", cur, d, True))
            cur = d
        return (kind, tuple(children)), cur
    if kind in ("residual", "twice", "maybe"):
        inner, _ = _gen_node(rng, depth - 1, d, True, sharding, skips)
        if kind == "residual":
            return ("residual", inner), d
        if kind == "twice":
            return ("twice", inner, rng.choice(["chain", "sum"])), d
        return ("maybe", inner, rng.randint(0, 1)), d
    inner, out = _gen_node(rng, depth - 1, d, same_dim, sharding, skips)
    return (("ckpt", inner) if kind == "ckpt" else ("gated", inner, out)), out


def gen_case(seed: int, **overrides: Any) -> dict:
    """The case of ``seed``; ``overrides`` replace keys (the plan, frozen parameters and
    ops are generated after them, from the possibly overridden model)."""
    rng = random.Random(seed)
    # From ``SHARDING_FROM`` on, a generator of its own redraws some values (the main one
    # still draws them, so its sequence is the same).
    sharding = seed >= SHARDING_FROM
    skips = seed >= PARTIAL_FROM
    extra3 = random.Random(seed * 15485863 + 47)
    ws = rng.choice([2, 3])
    ws = extra3.choice([2, 3, 4, 4]) if sharding else ws
    language_model = rng.random() < 0.35  # token ids in, logits out
    d0 = rng.choice([3, 4, 5, 7, 8])
    d0 = extra3.choice([2, 3, 4, 4, 5, 8, 8, 12]) if sharding else d0
    spec: dict[str, Any] = {"embed": None, "head": None, "tied": False}
    if language_model:
        vocab = rng.choice([5, 7, 11])
        vocab = extra3.choice([5, 8, 11, 12]) if sharding else vocab
        tied = rng.random() < 0.6
        spec["embed"] = (vocab, d0)
        spec["body"], dout = _gen_node(rng, rng.randint(1, 3), d0, tied, sharding, skips)
        spec["head"] = (dout, vocab, (not tied) and rng.random() < 0.5)
        spec["tied"] = tied
        loss, out_dim = "ce", vocab
    else:
        spec["body"], dout = _gen_node(rng, rng.randint(1, 3), d0, False, sharding, skips)
        out_dim = dout
        if rng.random() < 0.3 or not any(True for _ in build(spec["body"]).parameters()):
            out_dim = rng.choice([1, 2, 3])
            spec["head"] = (dout, out_dim, rng.random() < 0.5)
        loss = "mse"
    case: dict[str, Any] = {
        "seed": seed,
        "ws": ws,
        "spec": spec,
        "d0": d0,
        "out_dim": out_dim,
        "loss": loss,
        "local_batch": rng.choice([1, 2, 3]),
        "seq_len": rng.choice([1, 2, 3]),
        "steps": rng.choice([2, 3]),
        "mp": rng.random() < 0.2,
        "accum": rng.random() < 0.3,
        "set_to_none": rng.random() < 0.5,
        "optim": rng.choice(["sgd", "adamw"]),
        "eval_at": [s for s in range(3) if rng.random() < 0.3],
        "sd_roundtrip": rng.random() < 0.25,
        "p_shard": rng.choice([0.2, 0.5, 0.8]),
        "p_list": rng.choice([0.0, 0.3]),
        "p_freeze_module": rng.choice([0.0, 0.0, 0.15]),
        "p_freeze_param": rng.choice([0.0, 0.0, 0.1]),
        "p_unshard_op": rng.choice([0.0, 0.0, 0.5]),
        "clip": rng.random() < 0.2,
        "plan_seed": rng.randrange(1 << 30),
    }
    # Later additions draw from their own generator, so the cases above stay the same.
    extra = random.Random(seed * 7919 + 17)
    spec["body"] = _add_side_calls(spec["body"], extra)
    case["input_requires_grad"] = loss == "mse" and extra.random() < 0.2
    # Drawn from seed ``EXTENDED_FROM`` on only: earlier seeds keep the cases tests pin.
    extra2 = random.Random(seed * 104729 + 31)
    extended = seed >= EXTENDED_FROM
    case["discard_fwd"] = {
        s: extra2.choice(["pre", "post"])
        for s in range(case["steps"])
        if extended and extra2.random() < 0.1
    }
    two_fwd = extended and extra2.random() < 0.15 and not case["accum"]
    case["two_fwd"] = extra2.choice(["in_order", "reversed"]) if two_fwd else None
    if sharding:
        hsdp = ws == 4 and extra3.random() < 0.4
        case["mesh"] = (2, 2) if hsdp else None
        modes = ["gradient_sync", "all_reduce", "both"] if hsdp else ["gradient_sync"]
        case["accum_mode"] = extra3.choice(modes)
        case["p_shard_dim"] = extra3.choice([0.0, 0.5, 0.9])
        int_raf = ws == 4 and not hsdp and extra3.random() < 0.5
        case["p_raf_int"] = extra3.choice([0.3, 0.7]) if int_raf else 0.0
    if seed >= PER_PARAM_MESH_FROM:
        _draw_param_meshes(case, random.Random(seed * 982451653 + 59))
    if seed >= EXTENSIONS_FROM:
        ext_rng = random.Random(seed * 32452843 + 71)
        case["p_ext"] = ext_rng.choice([0.0, 0.4, 0.8])
        case["ext_pad"] = ext_rng.random() < 0.7
    if seed >= META_LOAD_FROM:
        case["meta_load"] = random.Random(seed * 49979687 + 83).random() < 0.35
    if seed >= PENALTY_FROM:
        case["penalty"] = loss == "mse" and random.Random(seed * 86028121 + 97).random() < 0.5
        case["input_requires_grad"] = case["input_requires_grad"] or case["penalty"]
    if seed >= PARTIAL_FROM:
        _draw_partial(case, random.Random(seed * 122949829 + 131))
    case.update(overrides)
    model = Root(case["spec"])
    if "plan" not in overrides:
        case["plan"] = _gen_plan(model, case)
        if case.get("chunked"):
            _plan_head_group(model, case, random.Random(case["plan_seed"] + 5))
        if case.get("p_raf_int"):
            int_rng = random.Random(case["plan_seed"] + 3)
            case["plan"] = [
                (names, 2 if int_rng.random() < case["p_raf_int"] else raf)
                for names, raf in case["plan"]
            ]
    if "param_meshes" in case and "param_mesh" not in overrides:
        case["param_mesh"] = _gen_param_mesh(model, case)
    if "p_shard_dim" in case and "shard_dims" not in overrides:
        case["shard_dims"] = _gen_shard_dims(model, case)
    if "p_ext" in case and "ext" not in overrides:
        case["ext"] = _gen_ext(model, case)
    if "frozen" not in overrides:
        case["frozen"] = _gen_frozen(model, case)
    if "ops" not in overrides:
        case["ops"] = _gen_ops(case)
    if seed >= TOGGLE_FROM and "toggle" not in overrides:
        case["toggle"] = _gen_toggle(model, case, random.Random(seed * 67867967 + 101))
    if seed >= INFERENCE_FROM and "eval_mode" not in overrides:
        eval_rng = random.Random(seed * 15485863 + 7)
        case["eval_mode"] = eval_rng.choice(["no_grad", "inference"])
        case["eval_first"] = eval_rng.random() < 0.5
    if seed >= CONTROL_FROM:
        _draw_control(case, overrides, random.Random(seed * 179424673 + 113))
    return case


def _draw_partial(case: dict, rng: random.Random) -> None:
    """The keys of ``PARTIAL_FROM``: frequent list groups, and the chunked loss."""
    case["p_list"] = rng.choice([0.3, 0.6])
    chunkable = case["spec"]["head"] is not None and not case.get("penalty") and not case["two_fwd"]
    mode = rng.choice(["split", "split", "retain"])
    case["chunked"] = mode if chunkable and rng.random() < 0.6 else None
    case["chunks"] = rng.choice([2, 3])
    case["chunk_sync"] = rng.choice(["last", "every"])
    case["head_group"] = "tied" if case["spec"]["tied"] else rng.choice(["alone", "with"])
    case["head_partner_pick"] = rng.random()


def _plan_head_group(model: Root, case: dict, rng: random.Random) -> None:
    """Give the head a group of its own (``head_group``), placed just before the root's
    entry: a tied head with the embedding, else alone or with a body module that has
    parameters and that no entry covers (neither it, an ancestor nor a descendant: the
    list must be shardable bottom-up after the other entries)."""
    plan = [(names, raf) for names, raf in case["plan"] if "head" not in names]
    root_entry = plan.pop()
    mode = case["head_group"]
    entry = ["head"]
    if mode == "tied":
        entry = ["embed", "head"]
    elif mode == "with":
        taken = [n for names, _ in plan for n in names]

        def related(name: str) -> bool:
            return any(
                t == name or name.startswith(t + ".") or t.startswith(name + ".") for t in taken
            )

        candidates = [
            name
            for name, module in _post_order(model.body, "body.")
            if any(True for _ in module.parameters())
            and not isinstance(module, (nn.ModuleList, nn.ModuleDict))
            and not related(name)
        ]
        # Half the time a module that some steps skip (``maybe``), if there is one.
        skipped = [n for n in candidates if isinstance(model.get_submodule(n), Maybe)]
        pick = case["head_partner_pick"]
        if skipped and pick < 0.5:
            candidates, pick = skipped, 2 * pick
        if candidates:
            partner = candidates[min(len(candidates) - 1, int(pick * len(candidates)))]
            entry = [partner, "head"]
    plan += [(entry, rng.choice([True, False, None])), root_entry]
    case["plan"] = plan


def _draw_control(case: dict, overrides: dict, rng: random.Random) -> None:
    """The control knobs of seeds from ``CONTROL_FROM`` on (a key in ``overrides`` is kept;
    every value is drawn whether or not it is used, so one key's override does not move
    the others)."""
    drawn: dict[str, Any] = {}
    # Three cases in four leave out what torch's fully_shard fails on or is off the
    # reference with (penalty, inference-mode evals, toggle, extensions that leave padding
    # to fsdp2), so that the knobs are compared with torch too (the other cases are checked
    # against the reference alone).
    if rng.random() < 0.75:
        drawn.update(penalty=False, eval_mode="no_grad", toggle={}, ext_pad=True)
    drawn["offload"] = rng.random() < 0.5
    n = len(case["plan"])
    fwd: dict[int, list[int]] = {}
    bwd: dict[int, list[int]] = {}
    for i in range(n):
        if rng.random() < 0.5:  # the next 0, 1 or 2 entries in plan order
            fwd[i] = list(range(i + 1, min(n, i + 1 + rng.choice([0, 1, 1, 2]))))
        if rng.random() < 0.5:  # the previous 0, 1 or 2, nearest first
            bwd[i] = list(range(i - 1, max(-1, i - 1 - rng.choice([0, 1, 1, 2])), -1))
    use_prefetch = rng.random() < 0.5 and (fwd or bwd)
    drawn["prefetch"] = {"fwd": fwd, "bwd": bwd} if use_prefetch else None
    rab = rng.choice(["rab", "rab_last"])
    drawn["rab_accum"] = rab if case["accum"] and rng.random() < 0.5 else None
    async_steps: dict[int, tuple[bool, int | None]] = {}
    use_async = rng.random() < 0.5
    for s in range(case["steps"]):
        wait, other = rng.random() < 0.5, rng.randrange(n)
        extra = other if other != n - 1 and rng.random() < 0.5 else None
        if use_async and rng.random() < 0.7:
            async_steps[s] = (wait, extra)
    drawn["async_unshard"] = async_steps
    factor = rng.choice([1.0, 2.0 * case["ws"]])
    # torch divides twice where a shard group is one rank and sums are forced (its
    # single-rank copy divides, and so does the post-reduction division): a factor of 1
    # only, where a per-parameter mesh has shard groups of one rank.
    single = [n for named in case.get("param_mesh") or () for n in (named or {}).values()]
    if any(_param_mesh_shard_size(case["ws"], n) == 1 for n in single):
        factor = 1.0
    drawn["divide"] = factor if rng.random() < 0.5 else None
    for key, value in drawn.items():
        if key not in overrides:
            case[key] = value


def _gen_toggle(model: nn.Module, case: dict, rng: random.Random) -> dict[int, list[str]]:
    """Parameters whose ``requires_grad`` flips after an eval forward (half the cases with
    an eval step within training)."""
    names = [n for n, _ in model.named_parameters()]
    steps = [s for s in case["eval_at"] if s < case["steps"] - 1]
    if not names or not steps or rng.random() < 0.5:
        return {}
    return {s: rng.sample(names, min(len(names), rng.randint(1, 3))) for s in steps}


_SAME_DIM = ("residual", "twice", "maybe", "layernorm", "rmsnorm", "scale", "act")


def _add_side_calls(spec: tuple, rng: random.Random) -> tuple:
    """Wrap some shape-preserving subtrees in ``Side`` (outputs unused or times zero)."""
    kind, *args = spec
    if kind in ("seq", "list", "dict"):
        spec = (kind, tuple(_add_side_calls(c, rng) for c in args[0]))
    elif kind in ("residual", "twice", "maybe", "ckpt", "gated"):
        spec = (kind, _add_side_calls(args[0], rng), *args[1:])
    if spec[0] in _SAME_DIM and rng.random() < 0.12:
        return ("side", spec, rng.choice(["drop", "zero"]))
    return spec


def _post_order(module: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    out = []
    for name, child in module.named_children():
        out += _post_order(child, f"{prefix}{name}.")
    out.append((prefix[:-1], module))
    return out


def _gen_plan(model: Root, case: dict) -> list[tuple[list[str], Any]]:
    rng = random.Random(case["plan_seed"])
    tied = case["spec"]["tied"]
    plan: list[tuple[list[str], Any]] = []
    sharded: set[str] = set()
    for name, module in _post_order(model):
        if name == "":
            if tied and rng.random() < 0.4:  # tied embedding and head as one group
                plan.append((["embed", "head"], rng.choice([True, False, None])))
            plan.append(([""], rng.choice([True, False, None])))
            break
        if tied and name in ("embed", "head"):
            continue  # a parameter shared by two groups is an error
        free = [f"{name}.{n}" for n, _ in module.named_children()]
        free = [k for k in free if k not in sharded]
        if len(free) >= 2 and rng.random() < case["p_list"]:
            chosen = sorted(rng.sample(free, rng.randint(2, len(free))), key=free.index)
            skipped = [k for k in free if isinstance(model.get_submodule(k), Maybe)]
            if "chunk_sync" in case and skipped and not set(skipped) & set(chosen):
                # From ``PARTIAL_FROM`` on: a list group includes a module that some steps
                # skip whenever one is free.
                chosen = sorted([*chosen[1:], skipped[0]], key=free.index)
            plan.append((chosen, rng.choice([True, False, None])))
            sharded.update(chosen)
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            continue  # no forward, so no hooks: rejected by both implementations
        has_params = any(True for _ in module.parameters())
        if rng.random() < case["p_shard"] * (1.0 if has_params else 0.2):
            plan.append(([name], rng.choice([True, False, None])))
            sharded.add(name)
    return plan


def shard_group_size(case: dict) -> int:
    return case["mesh"][-1] if case.get("mesh") else case["ws"]


def _param_mesh_shard_size(ws: int, name: str) -> int:
    ranks = PARAM_MESHES[ws][name]
    return len(ranks[0]) if isinstance(ranks[0], list) else len(ranks)


def _is_hsdp_param_mesh(ws: int, name: str) -> bool:
    return isinstance(PARAM_MESHES[ws][name][0], list)


def _draw_param_meshes(case: dict, rng: random.Random) -> None:
    """The case-level keys of per-parameter meshes (seeds from ``PER_PARAM_MESH_FROM``)."""
    ws, hsdp = case["ws"], bool(case.get("mesh"))
    if ws == 4 and hsdp:  # the 1-D mesh of every rank is another group here
        pool = ["flat", "flat", "h22", "h22t", "h14", "h41", "perm"]
    elif ws == 4:
        pool = ["h22", "h22", "h22t", "h22t", "h14", "h41", "perm"]
    else:
        pool = list(PARAM_MESHES[ws]) + [f"h1{ws}"]  # (1, n) twice: its shard group is n
    names: list[str] = []
    if rng.random() < 0.75:
        names = sorted(set(rng.sample(pool, rng.choice([1, 1, 2]))))
        if {"flat", "perm"} <= set(names):  # one process group, two mesh objects
            names.remove(rng.choice(["flat", "perm"]))
    case["param_meshes"] = tuple(names)
    case["p_param_mesh"] = rng.choice([0.4, 0.7, 1.0])
    case["pp_raw_mesh"] = rng.random() < 0.3
    if not hsdp and any(_is_hsdp_param_mesh(ws, n) for n in names) and rng.random() < 0.5:
        case["accum_mode"] = rng.choice(["gradient_sync", "all_reduce", "both"])


def _first_names(model: nn.Module) -> dict[int, str]:
    """Each parameter's first FQN (a tied parameter has several)."""
    first_name: dict[int, str] = {}
    for name, p in model.named_parameters():
        first_name.setdefault(id(p), name)
    return first_name


def _plan_params(model: nn.Module, case: dict) -> list[list[nn.Parameter]]:
    """Per ``plan`` entry (bottom-up), the parameters its ``fully_shard`` call manages:
    those of its modules not managed by an earlier entry."""
    managed: set[int] = set()
    out: list[list[nn.Parameter]] = []
    for names, _ in case["plan"]:
        params = []
        for n in names:
            for p in model.get_submodule(n).parameters():
                if id(p) not in managed:
                    managed.add(id(p))
                    params.append(p)
        out.append(params)
    return out


def _gen_param_mesh(model: Root, case: dict) -> list[dict[str, str] | None]:
    """Per ``plan`` entry: None (every parameter on the call's mesh) or ``{fqn: name}``: the
    parameters of that entry's group sharded over the per-parameter mesh ``name``, all of
    them or some (the others on the call's mesh)."""
    rng = random.Random(case["plan_seed"] + 5)
    first_name = _first_names(model)
    out: list[dict[str, str] | None] = []
    for (_, raf), params in zip(case["plan"], _plan_params(model, case), strict=True):
        meshes = list(case["param_meshes"])
        if isinstance(raf, int) and not isinstance(raf, bool):  # must divide the shard size
            meshes = [m for m in meshes if _param_mesh_shard_size(case["ws"], m) % raf == 0]
        if not params or not meshes or rng.random() >= case["p_param_mesh"]:
            out.append(None)
            continue
        whole = rng.random() < 0.3  # every parameter of the call on one mesh
        mesh = rng.choice(meshes)
        chosen = {}
        for p in params:
            if whole or rng.random() < 0.5:
                chosen[first_name[id(p)]] = mesh if whole else rng.choice(meshes)
        out.append(chosen)
    return out


def _gen_shard_dims(model: Root, case: dict) -> list[dict[str, int] | None]:
    """Per ``plan`` entry: None (no ``Shard(d > 0)``), or ``{fqn: d}`` for some of the
    parameters that entry's group manages (``Shard(d)``, d > 0, for dims the shard group
    size divides, that of the parameter's own mesh if ``param_mesh`` gives it one; the
    others get None, that is ``Shard(0)``)."""
    rng = random.Random(case["plan_seed"] + 4)
    group_size = shard_group_size(case)
    first_name = _first_names(model)
    out: list[dict[str, int] | None] = []
    param_mesh = case.get("param_mesh") or [None] * len(case["plan"])
    for params, on_mesh in zip(_plan_params(model, case), param_mesh, strict=True):
        if case["p_shard_dim"] == 0.0 or rng.random() < 0.3:
            out.append(None)
            continue
        dims = {}
        for p in params:
            size = group_size
            if on_mesh and first_name[id(p)] in on_mesh:  # its own mesh's shard group
                size = _param_mesh_shard_size(case["ws"], on_mesh[first_name[id(p)]])
            ok = [d for d in range(1, p.dim()) if p.shape[d] % size == 0]
            if ok and rng.random() < case["p_shard_dim"]:
                dims[first_name[id(p)]] = rng.choice(ok)
        out.append(dims)
    return out


def _gen_ext(model: Root, case: dict) -> list[str]:
    """``nn.Linear`` weights to make ``Gathered`` (untied, and sharded on dim 0)."""
    rng = random.Random(case["plan_seed"] + 5)
    on_dim = {fqn for dims in case.get("shard_dims") or [] if dims for fqn in dims}
    first_name = _first_names(model)
    out = []
    for mname, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        name = f"{mname}.weight"
        if first_name.get(id(module.weight)) != name or name in on_dim:
            continue  # tied to an earlier use, or Shard(d > 0)
        if case["spec"]["tied"] and mname == "head":
            continue
        if rng.random() < case["p_ext"]:
            out.append(name)
    return out


class Gathered(torch.Tensor):
    """A weight gathered through all-gather extensions with a plain weight's numerics (see
    ``EXTENSIONS_FROM``)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, pad: bool = True) -> Gathered:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls,
            data.shape,
            data.stride(),
            data.storage_offset(),
            dtype=data.dtype,
            device=data.device,
        )

    def __init__(self, data: torch.Tensor, pad: bool = True) -> None:
        self._data = data
        self._pad = pad

    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: Any, outer_stride: Any, module: Any, mp_policy: Any
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        data = self._data
        rows = -(-outer_size[0] // mesh.size())
        if self._pad and data.shape[0] != rows:
            padded = data.new_zeros((rows, *data.shape[1:]))
            padded[: data.shape[0]] = data
            data = padded
        return (data,), None

    @torch.no_grad()
    def fsdp_post_all_gather(
        self, outputs: Any, metadata: Any, param_dtype: torch.dtype, *, out: Any = None
    ) -> Any:
        (gathered,) = outputs
        if out is not None:
            if out.untyped_storage().data_ptr() != gathered.untyped_storage().data_ptr():
                with torch.autograd._unsafe_preserve_version_counter(out):
                    out.copy_(gathered[: out.shape[0]])
            return None
        value = gathered.to(param_dtype)
        return value, (gathered, value)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        pad = next(x._pad for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, cls))
        out = func(
            *pytree.tree_map_only(cls, lambda x: x._data, args),
            **pytree.tree_map_only(cls, lambda x: x._data, kwargs or {}),
        )
        return pytree.tree_map_only(torch.Tensor, lambda x: cls(x, pad), out)

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["_data"], self._pad

    @classmethod
    def __tensor_unflatten__(cls, inner: Any, pad: Any, size: Any, stride: Any) -> torch.Tensor:
        return cls(inner["_data"], pad)


def _make_gathered(model: nn.Module, case: dict) -> None:
    for name in case.get("ext") or []:
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        weight = getattr(module, attr)
        gathered = nn.Parameter(
            Gathered(weight.detach(), case["ext_pad"]), requires_grad=weight.requires_grad
        )
        setattr(module, attr, gathered)


def _gen_frozen(model: Root, case: dict) -> list[str]:
    rng = random.Random(case["plan_seed"] + 1)
    frozen: set[str] = set()
    for mname, module in model.named_modules():
        if mname and rng.random() < case["p_freeze_module"]:
            frozen.update(f"{mname}.{n}" for n, _ in module.named_parameters())
    for pname, _ in model.named_parameters():
        if rng.random() < case["p_freeze_param"]:
            frozen.add(pname)
    names = [n for n, _ in model.named_parameters()]
    frozen &= set(names)
    if frozen >= set(names):
        frozen.discard(names[-1])
    return sorted(frozen)


def _gen_ops(case: dict) -> dict[int, list[tuple[str, str, str]]]:
    """``{step: [(op, module, when)]}``: op ``unshard_reshard``, ``unshard_keep`` or
    ``reshard``; when ``post`` (right after the previous optimizer step, before its eval
    forward and state_dict) or ``pre`` (just before this step's forward)."""
    rng = random.Random(case["plan_seed"] + 2)
    names = [n for names, _ in case["plan"] for n in names]
    ops: dict[int, list[tuple[str, str, str]]] = {}
    for s in range(1, case["steps"]):
        if rng.random() < case["p_unshard_op"]:
            target = rng.choice(names)
            op = rng.choice(["unshard_reshard", "unshard_keep", "reshard"])
            ops[s] = [(op, target, rng.choice(["pre", "post"]))]
    return ops


def describe(case: dict) -> str:
    keys = ["seed", "ws", "mp", "accum", "set_to_none", "optim", "clip", "eval_at"]
    keys += ["sd_roundtrip", "steps", "local_batch", "seq_len", "input_requires_grad"]
    keys += ["discard_fwd", "two_fwd", "mesh", "accum_mode", "param_meshes", "pp_raw_mesh"]
    keys += ["ext_pad", "meta_load", "penalty", "toggle", "eval_mode", "eval_first"]
    keys += ["offload", "rab_accum", "divide", "chunked", "chunks", "chunk_sync", "head_group"]
    lines = [", ".join(f"{k}={case[k]}" for k in keys if k in case)]
    listed = ("spec", "plan", "shard_dims", "param_mesh", "frozen", "ops", "ext")
    listed += ("prefetch", "async_unshard")
    lines += [f"{k}={case[k]!r}" for k in listed if k in case]
    return "\n".join(lines)


def features(case: dict) -> set[str]:
    """What a case exercises (for choosing a covering set of seeds)."""
    spec = repr(case["spec"]["body"])
    out = {f"ws{case['ws']}", case["optim"], "loss_" + case["loss"]}
    out |= {k for k in ("mp", "accum", "sd_roundtrip", "clip") if case[k]}
    out |= {"zero_grad_keep"} if not case["set_to_none"] else set()
    out |= {"eval"} if case["eval_at"] else set()
    evals = case["eval_at"] or case.get("eval_first")
    out |= {"inference_eval"} if evals and case.get("eval_mode") == "inference" else set()
    out |= {"eval_first"} if case.get("eval_first") else set()
    out |= {"tied"} if case["spec"]["tied"] else set()
    out |= {"embed"} if case["spec"]["embed"] else set()
    out |= {k for k in ("linear", "layernorm", "rmsnorm", "conv", "raw", "scale") if k in spec}
    out |= {k for k in ("seq", "list", "dict", "residual", "twice", "maybe", "ckpt") if k in spec}
    out |= {"gated"} if "'gated'" in spec else set()
    out |= {f"side_{m}" for m in ("drop", "zero") if f"'{m}')" in spec}
    out |= {"input_requires_grad"} if case["input_requires_grad"] else set()
    out |= {"frozen"} if case["frozen"] else set()
    out |= {"list_group"} if any(len(n) > 1 for n, _ in case["plan"]) else set()
    out |= {f"raf_{r}" for _, r in case["plan"]}
    out |= {"nested_groups"} if len(case["plan"]) > 1 else set()
    out |= {f"op_{op}_{when}" for ops in case["ops"].values() for op, _, when in ops}
    out |= {f"discard_fwd_{when}" for when in case["discard_fwd"].values()}
    out |= {f"two_fwd_{case['two_fwd']}"} if case["two_fwd"] else set()
    out |= {f"experts_{m}" for m in ("view", "flat") if f"'{m}')" in spec}
    out |= {"hsdp"} if case.get("mesh") else set()
    out |= {"ext_pad" if case["ext_pad"] else "ext_unpadded"} if case.get("ext") else set()
    out |= {"meta_load"} if _meta_load(case) else set()
    out |= {"penalty"} if case.get("penalty") else set()
    out |= {"toggle"} if case.get("toggle") else set()
    out |= {"offload"} if case.get("offload") else set()
    out |= {f"divide_{case['divide']:g}"} if case.get("divide") else set()
    out |= {f"{case['rab_accum']}_accum"} if case.get("rab_accum") else set()
    if case.get("chunked"):
        out |= {f"chunked_{case['chunked']}", f"chunk_sync_{case['chunk_sync']}"}
        head_entry = next(names for names, _ in case["plan"] if "head" in names)
        out.add("head_group_" + ("alone" if head_entry == ["head"] else "list"))
    if any(len(names) > 1 and "maybe" in _kinds(case, names) for names, _ in case["plan"]):
        out.add("list_group_with_skipped_module")
    prefetch = case.get("prefetch") or {}
    for way in ("fwd", "bwd"):
        lists = prefetch.get(way, {}).values()
        out |= {f"prefetch_{way}"} if any(lists) else set()
        out |= {f"prefetch_{way}_empty"} if any(not t for t in lists) else set()
    for wait, extra in (case.get("async_unshard") or {}).values():
        out.add("async_unshard_" + ("wait" if wait else "nowait"))
        out |= {"async_unshard_nonroot"} if extra is not None else set()
    if case["accum"] and case.get("accum_mode", "gradient_sync") != "gradient_sync":
        out.add(f"accum_{case['accum_mode']}")
    dims = [d for dims in case.get("shard_dims") or [] if dims for d in dims.values()]
    out |= (
        {"shard_placement_fn"}
        if any(d is not None for d in case.get("shard_dims") or [])
        else set()
    )
    out |= {f"shard_dim_{d}" for d in dims}
    plan = case["plan"]
    on_mesh = [
        (i, fqn, name)
        for i, named in enumerate(case.get("param_mesh") or [])
        for fqn, name in (named or {}).items()
    ]
    if on_mesh:
        out.add("param_mesh")
        hsdp = {_is_hsdp_param_mesh(case["ws"], name) for _, _, name in on_mesh}
        out |= {"param_mesh_hsdp" if h else "param_mesh_fsdp" for h in hsdp}
        shard_dims = case.get("shard_dims") or [None] * len(plan)
        if any((shard_dims[i] or {}).get(fqn) for i, fqn, _ in on_mesh):
            out.add("param_mesh_shard_dim")
        if any(type(plan[i][1]) is int for i, _, _ in on_mesh):
            out.add("param_mesh_raf_int")
        if case.get("pp_raw_mesh"):
            out.add("param_mesh_raw")
    return out


def _kinds(case: dict, names: list[str]) -> set[str]:
    """The spec kinds of the modules ``names`` (plan entries) of ``case``'s model."""
    model = Root(case["spec"])
    kinds = {"maybe": Maybe, "twice": Twice, "ckpt": Ckpt}
    return {k for n in names for k, cls in kinds.items() if isinstance(model.get_submodule(n), cls)}


# ---------------------------------------------------------------------------- training


def _init_weights(model: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() >= 2:
                p.copy_(noise / math.sqrt(max(p.shape[-1], 1)))
            elif "norm" in name or name.endswith(("scale", "gain", ".g", "weight")):
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.1 * noise)


def make_model(case: dict) -> Root:
    model = Root(case["spec"])
    _init_weights(model, case["seed"])
    for name, p in model.named_parameters():
        if name in case["frozen"]:
            p.requires_grad_(False)
    return model


def make_batch(case: dict, step: int, mb: int, kind: str = "train") -> tuple:
    """The global batch of a step (and microbatch); rank r takes rows r*lb:(r+1)*lb."""
    salt = {"train": 0, "eval": 500, "discard": 700}[kind]
    gen = torch.Generator().manual_seed(case["seed"] * 1000 + step * 10 + mb + salt)
    rows, length = case["local_batch"] * case["ws"], case["seq_len"]
    if case["loss"] == "ce":
        vocab = case["spec"]["embed"][0]
        x = torch.randint(0, vocab, (rows, length), generator=gen)
        y = torch.randint(0, vocab, (rows, length), generator=gen)
    else:
        x = torch.randn(rows, length, case["d0"], generator=gen)
        y = torch.randn(rows, length, case["out_dim"], generator=gen)
    return x, y


def _loss(case: dict, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = out.float()
    if case["loss"] == "ce":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return F.mse_loss(out, y)


def _chunked_step(
    case: dict, model: nn.Module, x: torch.Tensor, y: torch.Tensor, mb_sync: bool
) -> torch.Tensor:
    """``chunked``: the forward returns the hidden state and the head runs on chunks of its
    rows, each chunk's loss (its share of the whole batch's loss) with its own backward; in
    ``"split"`` the chunks run on the detached rows and the trunk's backward comes last.
    ``mb_sync``: this microbatch synchronizes gradients (the head's group then syncs on the
    last chunk, or on every chunk: ``chunk_sync``). Returns the loss (detached)."""
    hidden = model(x, skip_head=True)
    rows = hidden.reshape(-1, hidden.shape[-1])
    targets = y.reshape(-1) if case["loss"] == "ce" else y.reshape(-1, y.shape[-1])
    count = targets.numel()  # the unchunked loss is a mean over these
    split = case["chunked"] == "split"
    source = rows.detach().requires_grad_() if split else rows
    pieces = list(zip(source.chunk(case["chunks"]), targets.chunk(case["chunks"])))
    total = torch.zeros(())
    for i, (chunk, target) in enumerate(pieces):
        last = i == len(pieces) - 1
        if case["chunk_sync"] == "last":
            model.head.set_requires_gradient_sync(mb_sync and last, recurse=False)
        out = model.head(chunk).float()
        if case["loss"] == "ce":
            part = F.cross_entropy(out, target, reduction="sum") / count
        else:
            part = F.mse_loss(out, target, reduction="sum") / count
        if part.requires_grad:
            part.backward(retain_graph=not split and not last)
        total = total + part.detach()
    if split and rows.requires_grad and source.grad is not None:
        rows.backward(source.grad)
    return total


def _input_gradient_penalty(out: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> Any:
    """0.1 times the mean over rows of the squared gradient of that row's squared error
    with respect to its input: a sum of per-row terms (rows do not mix in these models),
    so the ranks' mean is the reference's value on the whole batch."""
    if not out.requires_grad:
        return 0.0
    squared_error = (out.float() - y).pow(2).sum()
    (grad,) = torch.autograd.grad(squared_error, x, create_graph=True, allow_unused=True)
    return 0.0 if grad is None else 0.1 * grad.float().pow(2).sum() / x.shape[0]


def _optimizer(case: dict, model: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if case["optim"] == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    # eps bounds AdamW's amplification of rounding noise in ~0 gradients (see _helpers).
    return torch.optim.AdamW(params, lr=0.01, eps=1e-3, weight_decay=0.01)


def shard(
    case: dict, model: Root, impl: str, mesh: Any, param_meshes: dict[str, Any] | None = None
) -> None:
    """Apply ``case['plan']``. ``param_meshes``: ``{name: (mesh_info, DeviceMesh)}`` of the
    case's per-parameter meshes (``param_mesh_infos``)."""
    if impl == "fsdp2":
        import fsdp2

        fully_shard, policy_cls = fsdp2.fully_shard, fsdp2.MixedPrecisionPolicy
        offload_cls: Any = fsdp2.CPUOffloadPolicy
    else:
        from torch.distributed.fsdp import CPUOffloadPolicy as offload_cls
        from torch.distributed.fsdp import MixedPrecisionPolicy as policy_cls
        from torch.distributed.fsdp import fully_shard
    kwargs: dict[str, Any] = {"mesh": mesh}
    if case["mp"]:
        kwargs["mp_policy"] = policy_cls(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if case.get("offload"):
        kwargs["offload_policy"] = offload_cls(pin_memory=False)
    fqns = {}
    for name, p in model.named_parameters():
        fqns.setdefault(id(p), name)
    shard_dims = case.get("shard_dims") or [None] * len(case["plan"])
    on_mesh = case.get("param_mesh") or [None] * len(case["plan"])
    # fsdp2 also takes the DeviceMesh itself as a mesh_info; torch needs its mesh info.
    raw = impl == "fsdp2" and case.get("pp_raw_mesh")
    infos = {k: mesh if raw else info for k, (info, mesh) in (param_meshes or {}).items()}
    for (names, reshard), dims, named in zip(case["plan"], shard_dims, on_mesh, strict=True):
        modules = [model.get_submodule(n) for n in names]
        if named:
            meshes = {fqn: infos[k] for fqn, k in named.items()}
            kwargs["shard_placement_fn"] = functools.partial(
                _placement, fqns, dims or {}, meshes=meshes
            )
        elif dims is not None:
            kwargs["shard_placement_fn"] = functools.partial(_placement, fqns, dims)
        else:
            kwargs.pop("shard_placement_fn", None)
        fully_shard(
            modules if len(modules) > 1 else modules[0], reshard_after_forward=reshard, **kwargs
        )
    _set_controls(case, model)


def _set_controls(case: dict, model: nn.Module) -> None:
    """The per-module knobs of ``CONTROL_FROM``, after every ``fully_shard`` call: explicit
    prefetch lists (``prefetch``, by ``plan`` index; a list group by its first module) and
    the gradient divide factor (``divide``, on every sharded module, with sum-only
    collectives: gloo has no ``PREMUL_SUM``, which torch would use otherwise)."""
    entries = [model.get_submodule(names[0]) for names, _ in case["plan"]]
    prefetch = case.get("prefetch") or {}
    for i, targets in prefetch.get("fwd", {}).items():
        entries[i].set_modules_to_forward_prefetch([entries[j] for j in targets])
    for i, targets in prefetch.get("bwd", {}).items():
        entries[i].set_modules_to_backward_prefetch([entries[j] for j in targets])
    if case.get("divide"):
        for names, _ in case["plan"]:
            for name in names:
                module = model.get_submodule(name)
                module.set_gradient_divide_factor(case["divide"])
                module.set_force_sum_reduction_for_comms(True)


def _placement(
    fqns: dict[int, str],
    dims: dict[str, int],
    param: nn.Parameter,
    meshes: dict[str, Any] | None = None,
) -> Any:
    """``shard_placement_fn``: ``Shard(dims[fqn])`` for the parameters ``dims`` names, as a
    ``ShardPlacementResult`` on ``meshes[fqn]`` (a mesh info) for those ``meshes`` names."""
    from torch.distributed.tensor import Shard

    if id(param) not in fqns:
        raise KeyError(f"shard_placement_fn called with an unknown parameter {tuple(param.shape)}")
    dim = dims.get(fqns[id(param)])
    placement = None if dim is None else Shard(dim)
    if meshes is None or fqns[id(param)] not in meshes:
        return placement
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    except ImportError:  # torch < 2.13: fsdp2 takes any (placement, mesh_info) pair
        return PlacementResult(placement, meshes[fqns[id(param)]])
    return ShardPlacementResult(placement=placement, mesh_info=meshes[fqns[id(param)]])


class PlacementResult(NamedTuple):
    """What fsdp2 reads of torch's ``ShardPlacementResult``, for torch < 2.13 (whose
    ``fully_shard`` has no per-parameter meshes: ``torch_lacks``)."""

    placement: Any
    mesh_info: Any


def torch_lacks(case: dict) -> str | None:
    """The feature of torch's ``fully_shard`` that ``case`` needs and this torch lacks,
    or None: per-parameter meshes (``ShardPlacementResult``, torch >= 2.13)."""
    if any(case.get("param_mesh") or ()):
        try:
            from torch.distributed.fsdp._fully_shard._fsdp_common import (  # noqa: F401
                ShardPlacementResult,
            )
        except ImportError:
            return f"torch {torch.__version__} has no ShardPlacementResult (per-parameter meshes)"
    return None


def _full(t: torch.Tensor) -> torch.Tensor:
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    return full._data if isinstance(full, Gathered) else full


def _gather_grads(named: list[tuple[str, nn.Parameter]]) -> dict[str, Any]:
    """Every gradient's full tensor (collective); None, or a message if only some ranks
    hold it."""
    has = torch.tensor([float(p.grad is not None) for _, p in named])
    dist.all_reduce(has)
    ws = dist.get_world_size()
    out: dict[str, Any] = {}
    for (n, p), count in zip(named, has.tolist()):
        if count == 0:
            out[n] = None
        elif count < ws:
            out[n] = f"grad on {int(count)}/{ws} ranks"
        else:
            out[n] = _full(p.grad).detach().clone()
    return out


def _clip_full(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` for gradients on several meshes (whose norms it cannot stack):
    the total norm from every gradient's ``full_tensor()``."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    total = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(_full(g).detach()) for g in grads])
    )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0).item()
    for g in grads:
        g.detach().mul_(coef)
    return total


def _apply_ops(model: nn.Module, ops: list[tuple[str, str, str]], when: str) -> None:
    for op, name, at in ops:
        if at != when:
            continue
        module = model.get_submodule(name)
        if op in ("unshard_reshard", "unshard_keep"):
            module.unshard()
        if op in ("unshard_reshard", "reshard"):
            module.reshard()


def _async_unshard(case: dict, model: nn.Module, wait: bool, extra: int | None) -> None:
    """``unshard(async_op=True)`` on the root, and on plan entry ``extra`` (a list group by
    its first module); ``wait``: wait for the handles, else leave it to the forward."""
    modules = [model] + ([] if extra is None else [model.get_submodule(case["plan"][extra][0][0])])
    handles = [m.unshard(async_op=True) for m in modules]
    if wait:
        for handle in handles:
            if handle is not None:
                handle.wait()


def _discarded_forward(case: dict, model: nn.Module, step: int, rows: slice) -> None:
    """A forward with grad enabled whose loss is never backpropagated (logging, say)."""
    x, y = (t[rows] for t in make_batch(case, step, 0, "discard"))
    _loss(case, model(x), y).detach()


def _eval_forward(case: dict, model: nn.Module, step: int, rows: slice) -> torch.Tensor:
    """An ``eval()`` forward under ``no_grad`` or ``inference_mode`` (``eval_mode``)."""
    x = make_batch(case, step, 0, "eval")[0][rows]
    model.eval()
    inference = case.get("eval_mode") == "inference"
    with torch.inference_mode() if inference else torch.no_grad():
        out = model(x).detach().float().clone()
    model.train()
    return out


def train(case: dict, model: nn.Module, rank: int | None) -> dict:
    """Train for ``case['steps']`` steps. ``rank``: sharded, on that rank's rows of each
    batch; None: the non-sharded reference on whole batches."""
    sharded = rank is not None
    # The sharded parameters, which the optimizer holds: after a forward without backward
    # (everything before the loss frozen or skipped) a group that does not reshard after
    # forward still has its unsharded parameters registered on the modules.
    named = list(model.named_parameters())
    opt = _optimizer(case, model)
    lb, microbatches = case["local_batch"], 2 if case["accum"] or case["two_fwd"] else 1
    rows = slice(rank * lb, (rank + 1) * lb) if sharded else slice(None)
    steps: list[dict[str, Any]] = []
    saved = None
    for step in range(case["steps"]):
        CTX["step"] = step
        entry: dict[str, Any] = {"loss": []}
        if step == 0 and case.get("eval_first"):  # a sanity check before training
            entry["eval_first"] = _eval_forward(case, model, -1, rows)
        if sharded and step in case["ops"]:
            _apply_ops(model, case["ops"][step], "pre")
        if case["discard_fwd"].get(step) == "pre":
            _discarded_forward(case, model, step, rows)
        if sharded and step in case.get("async_unshard", {}):
            _async_unshard(case, model, *case["async_unshard"][step])
        # The reference scales only this step's gradients (``divide``): a parameter left
        # out of the optimizer (frozen when it was built, trained after a toggle) keeps
        # its gradient across steps, which was scaled already (seed 10568).
        before = None
        if not sharded and case.get("divide"):
            before = {n: None if p.grad is None else p.grad.clone() for n, p in named}
        losses = []
        for mb in range(microbatches):
            x, y = (t[rows] for t in make_batch(case, step, mb))
            if case["input_requires_grad"]:
                x.requires_grad_()
            if sharded and case["accum"]:
                last, mode = mb == microbatches - 1, case.get("accum_mode", "gradient_sync")
                if mode in ("gradient_sync", "both"):
                    model.set_requires_gradient_sync(last)
                if mode in ("all_reduce", "both"):
                    model.set_requires_all_reduce(last)
                if case.get("rab_accum"):  # keep gathered between microbatches
                    model.set_reshard_after_backward(last)
                if case.get("rab_accum") == "rab_last":
                    model.set_is_last_backward(last)
            if case.get("chunked") and sharded:
                mb_sync = not (
                    case["accum"]
                    and case.get("accum_mode", "gradient_sync") in ("gradient_sync", "both")
                    and mb < microbatches - 1
                )
                losses.append(_chunked_step(case, model, x, y, mb_sync))
                entry["loss"].append(losses[-1].clone())
                continue
            out = model(x)
            loss = _loss(case, out, y)
            if case.get("penalty"):
                loss = loss + _input_gradient_penalty(out, x, y)
            if not case["two_fwd"] and loss.requires_grad:  # all may be frozen or skipped
                loss.backward()
            losses.append(loss)
            entry["loss"].append(loss.detach().clone())
        if case["two_fwd"]:  # every forward first, then one backward per loss
            for loss in losses if case["two_fwd"] == "in_order" else losses[::-1]:
                if loss.requires_grad:
                    loss.backward()
        del losses
        if before is not None:  # the sharded sum over ranks / factor
            for n, p in named:
                if p.grad is not None:
                    kept = before[n]
                    if kept is None:
                        p.grad.mul_(case["ws"] / case["divide"])
                    else:
                        p.grad.sub_(kept).mul_(case["ws"] / case["divide"]).add_(kept)
        if case["discard_fwd"].get(step) == "post":
            _discarded_forward(case, model, step, rows)
        if sharded:
            entry["grads"] = _gather_grads(named)
        else:
            entry["grads"] = {
                n: None if p.grad is None else p.grad.detach().clone() for n, p in named
            }
        if case["clip"]:
            params = [p for _, p in named if p.requires_grad]
            if sharded and any(case.get("param_mesh") or []):  # gradients on several meshes
                entry["norm"] = _clip_full(params, 0.5).reshape(1)
            else:
                entry["norm"] = _full(nn.utils.clip_grad_norm_(params, 0.5)).detach().reshape(1)
        opt.step()
        opt.zero_grad(set_to_none=case["set_to_none"])
        if sharded and step + 1 in case["ops"]:
            _apply_ops(model, case["ops"][step + 1], "post")
        if case["sd_roundtrip"] and step == 0:
            saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if case["sd_roundtrip"] and step == 1 and saved is not None:
            model.load_state_dict(saved)
        entry["params"] = {n: _full(p.detach()).clone() for n, p in named}
        if step in case["eval_at"]:
            entry["eval"] = _eval_forward(case, model, step, rows)
        for name in case.get("toggle", {}).get(step, []):
            owner, _, attr = name.rpartition(".")
            param = getattr(model.get_submodule(owner), attr)  # unsharded if still gathered
            param.requires_grad_(not param.requires_grad)
        steps.append(entry)
    return {"steps": steps}


def run_impls(case: dict, impls: tuple[str, ...] = ("fsdp2", "torch")) -> dict[str, dict]:
    """Rank function: train one sharded copy per implementation. Gradients and parameters
    are kept on rank 0 only (their full tensors are the same on every rank)."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    if ws != case["ws"]:
        raise ValueError(f"case for {case['ws']} ranks run on {ws}")
    mesh = _mesh(tuple(case.get("mesh") or (ws,)))
    param_meshes = param_mesh_infos(case)  # before sharding, the same on every rank
    records = {}
    for impl in impls:
        if _meta_load(case):
            model = _meta_loaded(case, impl, mesh, param_meshes)
        else:
            model = make_model(case)
            _make_gathered(model, case)
            shard(case, model, impl, mesh, param_meshes)
        records[impl] = train(case, model, rank)
        if rank != 0:
            for entry in records[impl]["steps"]:
                del entry["grads"], entry["params"]
    return records


def run_sanitized(case: dict) -> list[str]:
    """Rank function: train fsdp2 alone on stand-in streams; the races found."""
    from _stream_sanitizer import stream_sanitizer

    with stream_sanitizer() as sanitizer:
        run_impls(case, ("fsdp2",))
    return sanitizer.races


def _meta_load(case: dict) -> bool:
    """Whether ``case`` is built through ``_meta_loaded``. Not with extensions, and not with
    the ``perm`` mesh (its ranks in another order, on the default process group): both
    implementations shard it by group rank, as its collectives run, while
    ``distribute_tensor`` sizes uneven shards by mesh coordinate (and fills them by group
    rank, so a rank can get a row of zeros): the loaded shards do not fit, and both raise
    alike (seed 7626). A DTensor inconsistency, not an FSDP one."""
    meshes = {name for names in case.get("param_mesh") or () for name in (names or {}).values()}
    return bool(case.get("meta_load")) and not case.get("ext") and "perm" not in meshes


def _meta_loaded(case: dict, impl: str, mesh: Any, param_meshes: dict[str, Any]) -> Root:
    """The case's model built on the meta device, sharded, then given the case's weights
    with ``load_state_dict(assign=True)`` from sharded ``DTensor``s (accelerate's
    ``cpu_ram_efficient_loading``); a tied head is tied again after loading, as accelerate
    does (the load gives each key its own parameter)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    weights = make_model(case).state_dict()
    with torch.device("meta"):
        model = Root(case["spec"])
    for name, p in model.named_parameters():
        if name in case["frozen"]:
            p.requires_grad_(False)
    shard(case, model, impl, mesh, param_meshes)
    sharded = {
        key: distribute_tensor(weights[key], value.device_mesh, value.placements)
        if isinstance(value, DTensor)
        else weights[key].clone()
        for key, value in model.state_dict().items()
    }
    model.load_state_dict(sharded, assign=True)
    if case["spec"]["tied"] and model.head is not None:
        model.head.weight = model.embed.weight
    return model


# Meshes of this rank process, by shape and world group: made once, so cases do not each
# create (and leak) process groups, and int ``reshard_after_forward`` subgroups are reused.
_MESHES: dict[tuple[Any, tuple[int, ...]], Any] = {}


def _mesh(shape: tuple[int, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    key = (dist.distributed_c10d._get_default_group(), shape)
    if key not in _MESHES:
        names = ("replicate", "shard") if len(shape) == 2 else None
        _MESHES[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[key]


def param_mesh_infos(case: dict) -> dict[str, tuple[Any, Any]]:
    """``{name: (mesh_info, DeviceMesh)}`` for ``case['param_meshes']`` (collective: every
    rank creates them in the same order). Made once per process like ``_mesh``; a mesh
    info is one object per mesh, as torch requires of parameters on one process group."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo

    ws = dist.get_world_size()
    out = {}
    for name in case.get("param_meshes") or ():
        key = (dist.distributed_c10d._get_default_group(), "param", name)
        if key not in _MESHES:
            ranks = PARAM_MESHES[ws][name]
            if name == "flat":  # the case default's 1-D mesh (one object per process)
                mesh = _mesh((ws,))
            elif isinstance(ranks[0], list):
                mesh = DeviceMesh("cpu", ranks, mesh_dim_names=(f"{name}_r", f"{name}_s"))
            else:
                mesh = DeviceMesh("cpu", ranks, mesh_dim_names=(name,))
            if mesh.ndim == 2:
                info: Any = HSDPMeshInfo(mesh=mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
            else:
                info = FSDPMeshInfo(mesh=mesh, shard_mesh_dim=0)
            _MESHES[key] = (info, mesh)
        out[name] = _MESHES[key]
    return out


def run_reference(case: dict) -> dict:
    """The non-sharded model on the global batches (in this process)."""
    return train(case, make_model(case), None)


# ---------------------------------------------------------------------------- comparison


def _diff(a: Any, b: Any) -> float:
    if isinstance(a, str) or isinstance(b, str) or (a is None) != (b is None):
        return math.inf
    if a is None or (a.shape == b.shape and a.numel() == 0):
        return 0.0
    if a.shape != b.shape:
        return math.inf
    d = (a.float() - b.float()).abs().max().item()
    return math.inf if math.isnan(d) else d


def _scale(t: Any) -> float:
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return 1.0
    return max(1.0, t.float().abs().max().item())


def _what(x: Any) -> str:
    return x if isinstance(x, str) else "None" if x is None else f"tensor{tuple(x.shape)}"


def compare_impls(a: list[dict], b: list[dict], tol: float = 0.0) -> list[str]:
    """Differences between two sharded runs (per-rank records of one implementation),
    above ``tol`` relative to the values' magnitude (0: bitwise)."""
    problems = []
    for rank, (ra, rb) in enumerate(zip(a, b)):
        for s, (ea, eb) in enumerate(zip(ra["steps"], rb["steps"])):
            for i, (la, lb) in enumerate(zip(ea["loss"], eb["loss"])):
                if _diff(la, lb) > tol * _scale(lb):
                    problems.append(
                        f"rank {rank} step {s} microbatch {i}: loss {la.item()!r} vs {lb.item()!r}"
                    )
            for key in ("norm", "eval", "eval_first"):
                if key in ea and _diff(ea[key], eb[key]) > tol * _scale(eb[key]):
                    problems.append(
                        f"rank {rank} step {s}: {key} differs by {_diff(ea[key], eb[key]):.3g}"
                    )
            if rank != 0:
                continue
            for key in ("grads", "params"):
                for n, va in ea[key].items():
                    vb = eb[key].get(n, "missing")
                    if _diff(va, vb) > tol * _scale(vb):
                        problems.append(
                            f"step {s}: {key[:-1]} of {n} differs by {_diff(va, vb):.3g} ({_what(va)} vs {_what(vb)})"
                        )
    return problems


def compare_reference(records: list[dict], ref: dict, case: dict) -> list[str]:
    """Differences between a sharded run and the non-sharded reference, above
    ``REF_TOL`` relative to the values' magnitude (losses: the mean over ranks)."""
    tol = REF_TOL["bf16" if case["mp"] else "fp32"]
    problems = []
    for s, eref in enumerate(ref["steps"]):
        for i, lref in enumerate(eref["loss"]):
            mean = sum(r["steps"][s]["loss"][i] for r in records) / case["ws"]
            if _diff(mean, lref) > tol * _scale(lref):
                problems.append(
                    f"step {s} microbatch {i}: loss {mean.item()!r} vs reference {lref.item()!r}"
                )
        if "norm" in eref and _diff(records[0]["steps"][s]["norm"], eref["norm"]) > tol * _scale(
            eref["norm"]
        ):
            problems.append(f"step {s}: grad norm vs reference")
        for key in ("eval", "eval_first"):
            if key not in eref:
                continue
            got = torch.cat([r["steps"][s][key] for r in records])
            if _diff(got, eref[key]) > 10 * tol * _scale(eref[key]):
                problems.append(
                    f"step {s}: {key} output differs from the reference by {_diff(got, eref[key]):.3g}"
                )
        for key in ("grads", "params"):
            for n, v in eref[key].items():
                got = records[0]["steps"][s][key].get(n, "missing")
                if _diff(got, v) > tol * _scale(v):
                    problems.append(
                        f"step {s}: {key[:-1]} of {n} differs from the reference by {_diff(got, v):.3g} ({_what(got)} vs {_what(v)})"
                    )
    return problems


def check(case: dict, timeout: float = 60.0) -> dict[str, Any]:
    """Parent side: run both implementations and the reference; every difference."""
    from _launcher import RankError, RankTimeoutError, run_ranks

    out: dict[str, Any] = {"errors": {}}
    results: dict[str, list[dict]] = {}
    impls = ("fsdp2", "torch")
    if (lacks := torch_lacks(case)) is not None:
        out["torch_unsupported"], impls = [lacks], ("fsdp2",)
    for impl in impls:  # one launch each, so a failure names its side
        try:
            results[impl] = [
                r[impl] for r in run_ranks(run_impls, case["ws"], case, (impl,), timeout=timeout)
            ]
        except RankTimeoutError as error:
            out["errors"][impl] = f"hang: {str(error)[:2000]}"
        except RankError as error:
            first = next(iter(error.remote.values()), None)
            out["errors"][impl] = f"{first[0]}: {first[1]}\n{first[2]}" if first else str(error)
    ref = run_reference(case)
    if len(results) == 2:
        out["fsdp2_vs_torch"] = compare_impls(results["fsdp2"], results["torch"], impl_tol(case))
        out["fsdp2_vs_torch_bitwise"] = compare_impls(results["fsdp2"], results["torch"])
    for impl, records in results.items():
        out[f"{impl}_vs_reference"] = compare_reference(records, ref, case)
    return out


def classify(out: dict[str, Any], case: dict | None = None) -> str:
    """A label for the outcome. ``mismatch_twice_accum``: a module called several times per
    forward, with gradient accumulation: torch reduce-scatters after each call's backward,
    fsdp2 once after the last, so the sums round differently (not a bug of either);
    ``mismatch_chunked_accum`` likewise for a chunked loss with accumulation
    (``is_chunked_accum``).
    ``torch_error_fsdp2_off_reference``: torch raised and fsdp2 differs from the reference
    (plain ``torch_error``: fsdp2 matches it); ``torch_unsupported`` (and
    ``..._fsdp2_off_reference``) likewise where this torch lacks a feature the case needs
    (``torch_lacks``) and torch was not run."""
    errors = out["errors"]
    if errors:
        # Only torch failed: fsdp2 must still match the reference.
        off = list(errors) == ["torch"] and out.get("fsdp2_vs_reference")
        return "+".join(sorted(errors)) + "_error" + ("_fsdp2_off_reference" if off else "")
    if "torch_unsupported" in out:
        off = out["fsdp2_vs_reference"]
        return "torch_unsupported" + ("_fsdp2_off_reference" if off else "")
    if out["fsdp2_vs_torch"]:
        off = [impl for impl in ("fsdp2", "torch") if out[f"{impl}_vs_reference"]]
        label = "mismatch" + "".join(f"_{impl}_off_reference" for impl in off)
        if case is not None and is_twice_accum(case):
            label += "_twice_accum"
        if case is not None and is_chunked_accum(case):
            label += "_chunked_accum"
        return label
    if out["fsdp2_vs_reference"]:
        return "reference_mismatch" + ("_torch_too" if out["torch_vs_reference"] else "")
    if out["fsdp2_vs_torch_bitwise"]:
        return "ulp"
    return "ok"


def _sanitized_races(case: dict) -> list[str]:
    from _launcher import RankError, run_ranks

    try:
        reports = run_ranks(run_sanitized, case["ws"], case, timeout=120.0)
    except RankError as error:
        return [f"fsdp2 failed under the stand-in streams: {str(error)[:2000]}"]
    return [race for report in reports for race in report]


def main(argv: list[str]) -> None:
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [here, os.path.dirname(here)]
    from _launcher import shutdown_pools

    torch.set_num_threads(1)
    start, stop = int(argv[0]), int(argv[1])
    verbose = "-v" in argv
    counts: dict[str, int] = {}
    try:
        for seed in range(start, stop):
            case = gen_case(seed)
            if "--streams" in argv:
                races = _sanitized_races(case)
                kind = "races" if races else "ok"
                counts[kind] = counts.get(kind, 0) + 1
                if races or verbose:
                    print(f"seed {seed}: {len(races)} race(s)", *races[:3], sep="\n  ")
                continue
            out = check(case)
            kind = classify(out, case)
            if (kind == "mismatch" or "fsdp2_off_reference" in kind) and case.get("mp"):
                # bf16's tolerance against the reference can hide which side is off:
                # the same case in fp32 tells (seed 8229: torch reuses stale unsharded
                # weights after a discarded forward, fsdp2 gathers the updated ones).
                fp32 = {**case, "mp": False}
                kind += "_fp32:" + classify(check(fp32), fp32)
            counts[kind] = counts.get(kind, 0) + 1
            if kind != "ok" or verbose:
                print(f"seed {seed}: {kind}", flush=True)
            if verbose:
                print(describe(case))
                for key, value in out.items():
                    for line in value.values() if key == "errors" else value:
                        print(f"  {key}: {line}")
    finally:
        shutdown_pools()
    print(counts)


if __name__ == "__main__":
    main(sys.argv[1:])
