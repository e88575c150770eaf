"""Deferred initialization: build on the meta device, ``fully_shard``, materialize only the
shards, and initialize them as if the full model had been initialized and then sharded.

* ``init_sharded_`` gives exactly the values of a full-model reference initialized with the
  same seed (both with a per-parameter ``init_fn`` and with ``reset_parameters``), keeps
  parameter identity and fsdp2's flat shard buffers, and trains like the reference.
* Peak memory while initializing a model 8x one rank's share (8 ranks) stays near the
  share: live tensor bytes are counted by a ``TorchDispatchMode``.
* Why the helper exists: on the CPU, ``nn.init`` on a DTensor parameter does not give the
  full-tensor values (DTensor's RNG tracker supports CUDA-like devices only): every rank
  draws its shard from the same RNG state, so all shards are equal.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from _helpers import fsdp_groups, make_mesh, make_optimizer, memory_regions
from _launcher import run_ranks
from torch import nn
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

import fsdp2
from examples.llama import ModelArgs, Transformer, loss_fn, parallelize, rotary_tables

SEED = 1234


class LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of live storages produced by any op run under it (the local
    tensors of DTensor outputs included); ``peak`` is the maximum of their sum, checked
    after every op, and ``largest`` the largest single storage. A storage lying inside
    another (fsdp2's shard aliases of its flat buffer) is not counted again."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int, int]] = {}
        self.peak = 0
        self.largest = 0

    def live_bytes(self) -> int:
        spans = sorted((ptr, -(ptr + n)) for _, n, ptr in self.live.values() if n)
        total, end = 0, -1
        for ptr, neg_end in spans:
            if -neg_end <= end:
                continue  # inside the previous outer storage
            total += -neg_end - ptr
            end = -neg_end
        return total

    def _track(self, t: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            for name in names:
                inner = getattr(t, name)
                if isinstance(inner, torch.Tensor):
                    self._track(inner)
            return
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        entry = self.live.get(storage._cdata)
        if entry is None or entry[0].expired() or entry[1] != storage.nbytes():
            nbytes = storage.nbytes()
            self.live[storage._cdata] = (StorageWeakRef(storage), nbytes, storage.data_ptr())
            self.largest = max(self.largest, nbytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, self.live_bytes())
        return out


def llama_init(name: str, t: torch.Tensor) -> None:
    """A per-parameter init using the global RNG (seeded by ``init_sharded_(seed=...)``)."""
    if name.endswith("norm.weight"):
        t.fill_(1.0)
    else:
        t.normal_(0.0, 1.0 / math.sqrt(t.shape[-1]))


def _llama_args(tied: bool) -> ModelArgs:
    # At 3 ranks: vocab 64, dim 32 and the GQA k/v projections (16 rows) split unevenly.
    return ModelArgs(
        vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16,
        tie_embeddings=tied,
    )  # fmt: skip


def _reference(args: ModelArgs, mode: str) -> Transformer:
    ref = Transformer(args)
    torch.manual_seed(SEED)
    with torch.no_grad():
        if mode == "init_fn":
            for name, p in ref.named_parameters():
                llama_init(name, p)
        else:
            for m in ref.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
    return ref


def _storages_per_group(model: nn.Module) -> list[int]:
    """Distinct local storages per FSDP group: 1 each when the shards view one buffer."""
    return [
        len(memory_regions([p for _, p in params]))
        for params in fsdp_groups(model, "fsdp2").values()
        if params
    ]


def rank_meta_init_matches_reference(mode: str, tied: bool) -> dict:
    rank, ws = dist.get_rank(), dist.get_world_size()
    args = _llama_args(tied)
    with torch.device("meta"):
        model = Transformer(args)
    parallelize(model, fsdp2.fully_shard, mesh=make_mesh())
    ids = {n: id(p) for n, p in model.named_parameters()}
    rng_before = torch.get_rng_state()
    fsdp2.init_sharded_(model, llama_init if mode == "init_fn" else None, seed=SEED)
    rng_after = torch.get_rng_state()
    with torch.no_grad():  # a buffer: not a parameter, recomputed by the user
        model.rope.copy_(rotary_tables(args.dim // args.n_heads, args.max_seq_len))
    ref = _reference(args, mode)
    report: dict = {
        "identity_kept": ids == {n: id(p) for n, p in model.named_parameters()},
        "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
        "devices": sorted({str(p.to_local().device) for p in model.parameters()}),
        "storages_per_group": _storages_per_group(model),
        "tied": model.output.weight is model.tok_embeddings.weight,
        # seed=... must not disturb the caller's RNG
        "rng_restored": torch.equal(rng_before, rng_after),
    }
    ref_params = dict(ref.named_parameters())
    report["value_diff"] = {
        n: (p.full_tensor() - ref_params[n]).abs().max().item() for n, p in model.named_parameters()
    }
    # One training step on the global batch: the shards must be wired into the runtime.
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, args.vocab_size, (2 * ws, 16), generator=gen)
    local = tokens[2 * rank : 2 * rank + 2]
    opt, ref_opt = make_optimizer(model, 1e-2), make_optimizer(ref, 1e-2)
    loss = loss_fn(model(local), local)
    loss.backward()
    opt.step()
    ref_loss = loss_fn(ref(tokens), tokens)
    ref_loss.backward()
    ref_opt.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    report["loss_diff"] = abs(mean.item() / ws - ref_loss.item())
    report["trained_diff"] = max(
        (p.full_tensor() - ref_params[n]).abs().max().item() for n, p in model.named_parameters()
    )
    return report


@pytest.mark.parametrize(
    "mode,tied,world_size",
    [("init_fn", False, 3), ("reset_parameters", True, 2)],
    ids=["init_fn-ws3", "reset_parameters-tied-ws2"],
)
def test_meta_init_matches_reference(mode: str, tied: bool, world_size: int) -> None:
    for rep in run_ranks(rank_meta_init_matches_reference, world_size, mode, tied):
        assert rep["identity_kept"], "init_sharded_ replaced parameter objects"
        assert rep["all_dtensor"]
        assert rep["devices"] == ["cpu"]
        assert rep["storages_per_group"] == [1] * len(rep["storages_per_group"]), (
            f"local shards of a group do not view one flat buffer: {rep['storages_per_group']}"
        )
        assert rep["tied"] == tied
        assert rep["rng_restored"], "init_sharded_(seed=...) changed the global RNG state"
        worst = max(rep["value_diff"].items(), key=lambda kv: kv[1])
        assert worst[1] == 0.0, f"{worst[0]} differs from the reference init by {worst[1]:.3g}"
        assert rep["loss_diff"] <= 1e-5, rep["loss_diff"]
        assert rep["trained_diff"] <= 1e-5, rep["trained_diff"]


class Stack(nn.Module):
    """16 equal Linear layers (each its own FSDP group), 66 KiB of fp32 parameters."""

    def __init__(self, layers: int = 16, dim: int = 32) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def rank_init_memory(mode: str) -> dict:
    rank, ws = dist.get_rank(), dist.get_world_size()
    mesh = make_mesh()
    with torch.device("meta"):
        model = Stack()
    for layer in model.layers:
        fsdp2.fully_shard(layer, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    tracker = LiveTensorBytes()
    with tracker:
        if mode == "init_fn":
            fsdp2.init_sharded_(model, lambda name, t: t.normal_(), seed=SEED)
        else:
            fsdp2.init_sharded_(model, seed=SEED)
    shard_bytes = sum(p.to_local().nbytes for p in model.parameters())
    group_bytes = max(sum(p.to_local().nbytes for p in m.parameters()) for m in model.layers)
    module_bytes = max(
        sum(p.numel() * p.element_size() for p in m.parameters()) for m in model.layers
    )
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    largest_param = max(p.numel() * p.element_size() for p in model.parameters())
    # Values: this rank's rows of a reference initialized in full with the same seed.
    ref = Stack()
    torch.manual_seed(SEED)
    with torch.no_grad():
        for m in ref.modules():
            if mode == "init_fn":
                for p in m.parameters(recurse=False):
                    p.normal_()
            elif hasattr(m, "reset_parameters"):
                m.reset_parameters()
    ref_params = dict(ref.named_parameters())
    mismatched = [
        n
        for n, p in model.named_parameters()
        if not torch.equal(p.to_local(), ref_params[n].detach().chunk(ws)[rank])
    ]
    return {
        "peak": tracker.peak,
        "largest": tracker.largest,
        "shard_bytes": shard_bytes,
        "full_bytes": full_bytes,
        "largest_param": largest_param,
        "group_bytes": group_bytes,
        "module_bytes": module_bytes,
        "mismatched": mismatched,
    }


@pytest.mark.parametrize("mode", ["init_fn", "reset_parameters"])
def test_init_memory_stays_near_the_shard(mode: str) -> None:
    reports = run_ranks(rank_init_memory, 8, mode)
    for rank, rep in enumerate(reports):
        assert not rep["mismatched"], f"rank {rank}: values differ from the reference"
        share = rep["shard_bytes"]
        assert rep["full_bytes"] >= 8 * share * 0.99, rep  # the model is 8 shares
        # The shards, plus while one group is re-pointed into its flat buffer its old
        # local tensors, plus one full module (weight + bias) being initialized and this
        # rank's chunk of it.
        bound = share + share / len(reports) + 2 * (rep["largest_param"] + 32 * 4)
        assert rep["peak"] <= bound, (
            f"rank {rank}: peak {rep['peak']} B while initializing, bound {bound:.0f} B "
            f"(shard {share} B, full model {rep['full_bytes']} B)"
        )
        assert rep["peak"] < rep["full_bytes"] / 3
        assert rep["largest"] <= max(rep["largest_param"], share), rep


def rank_dtensor_random_init_on_cpu() -> dict:
    """What happens without the helper: ``reset_parameters()`` on DTensor parameters."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Linear(16, 4 * ws)
    fsdp2.fully_shard(model, mesh=make_mesh())
    torch.manual_seed(SEED)
    model.reset_parameters()  # nn.init.kaiming_uniform_ / uniform_ on DTensors
    full = model.weight.full_tensor()
    ref = nn.Linear(16, 4 * ws)
    torch.manual_seed(SEED)
    ref.reset_parameters()
    chunks = full.chunk(ws)
    return {
        "rank": rank,
        "equal_to_full_init": torch.equal(full, ref.weight.detach()),
        "shards_all_equal": all(torch.equal(c, chunks[0]) for c in chunks),
    }


def test_dtensor_random_init_on_cpu_is_not_full_init() -> None:
    """Documents why ``init_sharded_`` exists (docs/deferred_init.md). If this starts
    failing, torch's DTensor RNG now supports the CPU: update the docs."""
    for rep in run_ranks(rank_dtensor_random_init_on_cpu, 2):
        assert not rep["equal_to_full_init"]
        assert rep["shards_all_equal"], "every rank draws its shard from the same RNG state"


def rank_to_empty(op: str) -> str | None:
    """``model.to_empty()`` / ``model.to()`` directly; returns the error, if any."""
    mesh = make_mesh()
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 5))
    fsdp2.fully_shard(model[0], mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    try:
        model.to_empty(device="cpu")
        if op == "to_empty_then_to":
            fsdp2.init_sharded_(model, seed=SEED)
            model.to("cpu")
            model.to(torch.float64)
    except RuntimeError as error:
        cause = f" (caused by: {error.__cause__})" if error.__cause__ else ""
        return f"{error}{cause}"
    ids_ok = all(isinstance(p, DTensor) for p in model.parameters())
    storages = _storages_per_group(model)
    return None if ids_ok and storages == [1, 1] else f"storages per group {storages}"


@pytest.mark.parametrize("op", ["to_empty", "to_empty_then_to"])
def test_to_empty_on_sharded_module(op: str) -> None:
    errors = run_ranks(rank_to_empty, 2, op)
    assert errors == [None, None], errors[0]


class _CountingLinear(nn.Linear):
    resets = 0

    def reset_parameters(self) -> None:
        type(self).resets += 1
        super().reset_parameters()


def rank_reset_through_checkpoint_wrapper() -> dict:
    """``init_sharded_`` with ``reset_parameters`` on blocks wrapped in ``CheckpointWrapper``,
    which forwards unknown attributes (``reset_parameters`` too) to the block: each block
    is reset once, with the values of the reference."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(SEED)
    ref = nn.Sequential(_CountingLinear(8, 8), _CountingLinear(8, 4))
    with torch.device("meta"):
        model = nn.Sequential(*(checkpoint_wrapper(_CountingLinear(*s)) for s in [(8, 8), (8, 4)]))
    for wrapper in model:
        fsdp2.fully_shard(wrapper)
    fsdp2.fully_shard(model)
    _CountingLinear.resets = 0
    torch.manual_seed(SEED)
    fsdp2.init_sharded_(model)
    values = [p.full_tensor() for p in model.parameters()]
    return {
        "resets": _CountingLinear.resets,
        "diff": max((v - q).abs().max().item() for v, q in zip(values, ref.parameters())),
    }


def test_reset_parameters_through_checkpoint_wrapper() -> None:
    """The wrapper forwarded ``reset_parameters``, so each block was reset twice (once as
    the wrapper's, on its sharded parameters, where the CPU draws the same values on every
    rank), and the reference's random stream was consumed twice."""
    for rep in run_ranks(rank_reset_through_checkpoint_wrapper, 2):
        assert rep == {"resets": 2, "diff": 0.0}, rep


def rank_init_errors() -> list[str]:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))

    mesh = make_mesh()
    messages = []
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Scale())
    fsdp2.fully_shard(model, mesh=mesh)
    try:
        fsdp2.init_sharded_(model)  # Scale has no reset_parameters
    except ValueError as error:
        messages.append(str(error))
    try:
        fsdp2.init_sharded_(model, lambda name, t: torch.zeros(3))
    except ValueError as error:
        messages.append(str(error))
    # A returned tensor is used as the value.
    fsdp2.init_sharded_(model, lambda name, t: torch.full(t.shape, 2.0))
    messages.append(str(model[1].scale.full_tensor().tolist()))
    return messages


def test_init_sharded_errors() -> None:
    messages = run_ranks(rank_init_errors, 2)[0]
    assert "1 (Scale)" in messages[0], messages
    assert "init_fn" in messages[0]
    assert "returned shape (3,) for '0.weight'" in messages[1], messages
    assert messages[2] == str([2.0] * 4)
