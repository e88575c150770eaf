"""Checkpointing sharded models: sharded state dicts, ``torch.distributed.checkpoint`` (DCP),
resuming at another world size, crash-safe saves, and rank-0 full state dicts.

* ``model.state_dict()`` / ``optimizer.state_dict()`` (AdamW) hold ``DTensor`` shards and,
  like ``load_state_dict()``, run no collective: every c10d / functional-collective op is
  recorded by a ``TorchDispatchMode`` (which does see ``full_tensor()``, a control).
* DCP round trips at the same world size, both with the plain sharded dicts
  (``dcp.save``/``dcp.load``) and with ``fsdp2.ModelOptimizerState``
  (``get_state_dict``/``set_state_dict``) through ``save_checkpoint``/``load_checkpoint``,
  for fsdp2 and for torch's ``fully_shard``, and across the two: the loaded parameters and
  optimizer state and the next training step are bitwise equal to the saved run's.
* Resume at another world size (4 -> 2, 2 -> 3): train K steps, save, load into a fresh
  meta-initialized model in new processes, train K more; losses and parameters match one
  unsharded model trained on the same global batches (1e-5: the world size changes the
  reduction order, so bitwise equality is not expected).
* A failing save (one rank's writer raises after writing its files; a crash between the
  rename and the ``latest`` update) raises on every rank, and leaves ``latest`` naming the
  previous checkpoint, which still loads; the next successful save cleans up.
* ``load_full_state_dict`` / ``get_full_state_dict``: only rank 0 holds the full dict, the
  other ranks pass ``None`` and get ``{}``; the values equal the full model's and torch's
  ``set_model_state_dict``/``get_model_state_dict`` (``full_state_dict=True``); other
  ranks' peak memory stays near their shard; bad input raises a ``ValueError`` naming the
  keys on every rank (no rank is left waiting in a broadcast).
* ``examples/train_llama.py --checkpoint-dir/--resume`` under ``torchrun`` resumes at the
  saved step (``slow``: two ``torchrun`` starts), and the docs examples run.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _helpers import (
    IMPLS,
    ParityCase,
    build_model,
    fsdp_groups,
    get_fully_shard,
    make_mesh,
    make_optimizer,
    require_impl,
    shard_model,
)
from _helpers import full as full_value
from _launcher import run_ranks
from test_deferred_init import LiveTensorBytes
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp2
import fsdp2._checkpoint as ckpt_module
from examples.llama import Transformer, loss_fn, rotary_tables

REPO = pathlib.Path(__file__).resolve().parent.parent
TOL = 1e-5
LR = 1e-2
GLOBAL_BATCH = 12  # divisible by 2, 3 and 4: every world size trains on the same batch
SEQ_LEN = 16


def _case(impl: str = "fsdp2", seed: int = 0, tied: bool = False) -> ParityCase:
    # vocab 64, dim 32 and the GQA k/v rows (16) split unevenly over 3 ranks.
    return ParityCase(impl=impl, n_kv_heads=2, seed=seed, tie_embeddings=tied)


def _sharded(impl: str, seed: int = 0, tied: bool = False) -> nn.Module:
    case = _case(impl, seed, tied)
    return shard_model(build_model(case), case, impl, make_mesh())


def _meta_sharded(impl: str = "fsdp2", tied: bool = False) -> Transformer:
    """Built on the meta device and sharded: no parameter holds values yet."""
    case = _case(impl, tied=tied)
    with torch.device("meta"):
        model = build_model(case)
    return shard_model(model, case, impl, make_mesh())


def _global_batch(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(5000 + step)
    return torch.randint(0, _case().vocab_size, (GLOBAL_BATCH, SEQ_LEN), generator=gen)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    """Train on each step's global batch (this rank's rows); the mean loss over ranks.
    Without a process group: the whole batch (the unsharded reference)."""
    sharded = dist.is_initialized()
    rank, ws = (dist.get_rank(), dist.get_world_size()) if sharded else (0, 1)
    rows = GLOBAL_BATCH // ws
    losses = []
    for step in steps:
        tokens = _global_batch(step)[rank * rows : (rank + 1) * rows]
        loss = loss_fn(model(tokens), tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        if sharded:
            dist.all_reduce(mean)
        losses.append(mean.item() / ws)
    return losses


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded parameters (collective for DTensors)."""
    return {
        n: p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
        for n, p in model.named_parameters()
    }


def _full_optim_state(opt: torch.optim.Optimizer) -> list[dict[str, torch.Tensor]]:
    """Unsharded AdamW state per parameter, in parameter order (collective)."""
    return [
        {k: v.full_tensor() if isinstance(v, DTensor) else v.clone() for k, v in st.items()}
        for st in (opt.state[p] for group in opt.param_groups for p in group["params"])
    ]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[str, float]:
    assert a.keys() == b.keys(), (sorted(a.keys() ^ b.keys()),)
    return max(((k, (a[k] - b[k]).abs().max().item()) for k in a), key=lambda kv: kv[1])


def _unequal(a: object, b: object) -> list[str]:
    """Paths where two nests of dicts/lists of tensors are not bitwise equal."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return [] if a.dtype == b.dtype and torch.equal(a, b) else ["<tensor>"]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"keys {sorted(map(str, a.keys() ^ b.keys()))}"]
        return [f"{k}/{p}" for k in a for p in _unequal(a[k], b[k])]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [f"{i}/{p}" for i, (x, y) in enumerate(zip(a, b)) for p in _unequal(x, y)]
    return [] if a == b else [f"{a!r} != {b!r}"]


class CollectiveRecorder(TorchDispatchMode):
    """Records every c10d op (``dist.*``, object collectives) and functional collective
    (DTensor redistribution) dispatched while active."""

    NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in self.NAMESPACES:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


# ------------------------------------------------------------- sharded state dicts


def rank_sharded_state_dict_no_comm(impl: str) -> dict:
    model = _sharded(impl)
    opt = make_optimizer(model, LR)
    _train(model, opt, range(2))
    ids = [id(p) for p in model.parameters()]
    storages = [p.to_local().untyped_storage().data_ptr() for p in model.parameters()]
    rec = CollectiveRecorder()
    with rec:
        msd = model.state_dict()
        osd = opt.state_dict()
        model.load_state_dict(msd)
        opt.load_state_dict(osd)
    # Loading different values (computed outside the recorder) copies them in place.
    shifted = {k: v.detach() + 1.0 for k, v in msd.items()}
    before = _full_params(model)
    with rec:
        model.load_state_dict(shifted)
    after = _full_params(model)
    control = CollectiveRecorder()
    with control:
        next(iter(msd.values())).full_tensor()
    return {
        "ops": rec.ops,
        "control_ops": len(control.ops),
        "model_non_dtensor": [k for k, v in msd.items() if not isinstance(v, DTensor)],
        "model_keys": sorted(msd),
        "optim_state_kinds": sorted(
            {f"{k}:{type(v).__name__}" for st in osd["state"].values() for k, v in st.items()}
        ),
        "loaded_shift": _unequal(after, {k: v + 1.0 for k, v in before.items()}),
        "identity_kept": ids == [id(p) for p in model.parameters()],
        "storage_kept": storages
        == [p.to_local().untyped_storage().data_ptr() for p in model.parameters()],
    }


@pytest.mark.parametrize("impl", ["fsdp2", "torch"])
def test_sharded_state_dict_without_communication(impl: str) -> None:
    require_impl(impl)
    reports = run_ranks(rank_sharded_state_dict_no_comm, 2, impl)
    expected_keys = sorted(n for n, _ in build_model(_case()).named_parameters())
    for rank, rep in enumerate(reports):
        assert rep["control_ops"] > 0, "the recorder does not see collectives"
        assert rep["ops"] == [], f"[{impl} rank {rank}] state_dict/load_state_dict ran {rep['ops']}"
        assert rep["model_keys"] == expected_keys
        assert rep["model_non_dtensor"] == []
        assert rep["optim_state_kinds"] == [
            "exp_avg:DTensor",
            "exp_avg_sq:DTensor",
            "step:Tensor",
        ], rep["optim_state_kinds"]
        assert rep["loaded_shift"] == [], "load_state_dict did not copy the values"
        assert rep["identity_kept"] and rep["storage_kept"], "load_state_dict replaced shards"


# ------------------------------------------------------------------ DCP round trips


def rank_dcp_round_trip(save_impl: str, load_impl: str, method: str, path: str) -> dict:
    """Save after 2 steps, load into a differently initialized model (and optimizer),
    compare, then train one more step on both."""
    model = _sharded(save_impl)
    opt = make_optimizer(model, LR)
    _train(model, opt, range(2))
    other = _sharded(load_impl, seed=1)
    other_opt = make_optimizer(other, 2 * LR)  # param_groups must be loaded too
    if method == "plain":
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)
        # dcp.load fills existing tensors in place: the optimizer needs its state first.
        _train(other, other_opt, range(7, 8))
        sd = {"model": other.state_dict(), "optim": other_opt.state_dict()}
        dcp.load(sd, checkpoint_id=path)
        other.load_state_dict(sd["model"])
        other_opt.load_state_dict(sd["optim"])
        loaded_step = None
    else:
        fsdp2.save_checkpoint({"app": fsdp2.ModelOptimizerState(model, opt)}, path, step=2)
        loaded_step = fsdp2.load_checkpoint(
            {"app": fsdp2.ModelOptimizerState(other, other_opt)}, path
        )
    report = {
        "loaded_step": loaded_step,
        "params": _unequal(_full_params(model), _full_params(other)),
        "optim": _unequal(_full_optim_state(opt), _full_optim_state(other_opt)),
        "lr": other_opt.param_groups[0]["lr"],
    }
    losses = _train(model, opt, range(2, 3)), _train(other, other_opt, range(2, 3))
    report["next_loss"] = losses
    report["next_params"] = _unequal(_full_params(model), _full_params(other))
    return report


@pytest.mark.parametrize(
    "save_impl,load_impl,method",
    [
        ("fsdp2", "fsdp2", "plain"),
        ("torch", "torch", "plain"),
        ("fsdp2", "fsdp2", "stateful"),
        ("torch", "torch", "stateful"),
        ("fsdp2", "torch", "stateful"),
        ("torch", "fsdp2", "stateful"),
    ],
)
def test_dcp_round_trip(save_impl: str, load_impl: str, method: str, tmp_path) -> None:
    require_impl(save_impl)
    require_impl(load_impl)
    reports = run_ranks(rank_dcp_round_trip, 2, save_impl, load_impl, method, str(tmp_path))
    for rank, rep in enumerate(reports):
        where = f"[{save_impl}->{load_impl} {method} rank {rank}]"
        assert rep["loaded_step"] == (None if method == "plain" else 2), where
        assert rep["params"] == [], f"{where} parameters differ after loading: {rep['params']}"
        assert rep["optim"] == [], f"{where} optimizer state differs: {rep['optim']}"
        assert rep["lr"] == LR
        saved, loaded = rep["next_loss"]
        assert saved == loaded, f"{where} next step's loss {loaded} != {saved}"
        assert rep["next_params"] == [], f"{where} next step differs: {rep['next_params']}"


# ------------------------------------------------- resume at another world size

K = 3  # steps before and after the checkpoint


class Progress:
    """A ``Stateful`` next to the model: the step to resume from."""

    def __init__(self, step: int = 0) -> None:
        self.step = step

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])


def rank_train_and_save(path: str) -> dict:
    model = _sharded("fsdp2")
    opt = make_optimizer(model, LR)
    losses = _train(model, opt, range(K))
    state = {"app": fsdp2.ModelOptimizerState(model, opt), "progress": Progress(K)}
    fsdp2.save_checkpoint(state, path, step=K)
    losses += _train(model, opt, range(K, 2 * K))  # the uninterrupted run
    params = _full_params(model)
    return {"losses": losses, "params": params if dist.get_rank() == 0 else None}


def rank_load_and_resume(path: str) -> dict:
    model = _meta_sharded()
    fsdp2.init_sharded_(model, seed=99)  # values the checkpoint must overwrite
    with torch.no_grad():  # a non-persistent buffer: not in any checkpoint
        model.rope.copy_(rotary_tables(model.args.dim // model.args.n_heads, 16))
    opt = make_optimizer(model, LR)
    progress = Progress()
    state = {"app": fsdp2.ModelOptimizerState(model, opt), "progress": progress}
    loaded = fsdp2.load_checkpoint(state, path)
    losses = _train(model, opt, range(progress.step, 2 * K))
    params = _full_params(model)
    return {
        "loaded": loaded,
        "progress": progress.step,
        "losses": losses,
        "params": params if dist.get_rank() == 0 else None,
        "opt_step": [float(opt.state[p]["step"]) for p in model.parameters()],
    }


def _reference_run() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build_model(_case())
    opt = make_optimizer(model, LR)
    losses = _train(model, opt, range(2 * K))
    return losses, {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("ws_save,ws_load", [(4, 2), (2, 3)])
def test_resume_at_another_world_size(ws_save: int, ws_load: int, tmp_path) -> None:
    require_impl("fsdp2")
    ref_losses, ref_params = _reference_run()
    saved = run_ranks(rank_train_and_save, ws_save, str(tmp_path))
    resumed = run_ranks(rank_load_and_resume, ws_load, str(tmp_path))
    assert (tmp_path / "latest").read_text().strip() == f"step_{K}"
    for name, losses in (("uninterrupted", saved[0]["losses"]), ("resumed", resumed[0]["losses"])):
        expected = ref_losses[-len(losses) :]
        worst = max(abs(a - b) for a, b in zip(losses, expected))
        assert worst <= TOL, f"{name} losses {losses} vs reference {expected}"
    for rep in resumed:
        assert rep["loaded"] == K and rep["progress"] == K
        assert len(rep["losses"]) == K
        assert rep["opt_step"] == [2.0 * K] * len(rep["opt_step"]), "AdamW step not restored"
    for name, params in (("uninterrupted", saved[0]["params"]), ("resumed", resumed[0]["params"])):
        key, diff = _max_diff(params, ref_params)
        assert diff <= TOL, f"{name} ({ws_save}->{ws_load}): {key} differs by {diff:.3g}"


# ------------------------------------------------------------------- failed saves


class _FailingWriter(dcp.FileSystemWriter):
    """Rank 1 writes its files, then fails like a full disk would."""

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        future.wait()
        if dist.get_rank() == 1:
            raise OSError("No space left on device (simulated)")
        return future


def rank_failed_save(path: str) -> dict:
    model = _sharded("fsdp2")
    opt = make_optimizer(model, LR)
    state = {"app": fsdp2.ModelOptimizerState(model, opt)}
    _train(model, opt, range(1))
    fsdp2.save_checkpoint(state, path, step=1)
    at_step_1 = _full_params(model)
    _train(model, opt, range(1, 2))
    report: dict = {"errors": []}

    real_save = dcp.save
    dcp.save = lambda sd, checkpoint_id, process_group=None: real_save(
        sd, storage_writer=_FailingWriter(checkpoint_id), process_group=process_group
    )
    try:
        fsdp2.save_checkpoint(state, path, step=2)
    except Exception as error:
        report["errors"].append(type(error).__name__ + ": " + str(error))
    finally:
        dcp.save = real_save
    dist.barrier()
    report["after_failed_write"] = sorted(os.listdir(path))
    report["tmp_files"] = sorted(os.listdir(os.path.join(path, "step_2.tmp")))
    report["latest_1"] = open(os.path.join(path, "latest")).read().strip()
    dist.barrier()  # every rank has looked before the next save recreates step_2.tmp

    real_write_latest = ckpt_module._write_latest

    def crash(*args: object) -> None:
        raise RuntimeError("killed before latest was written (simulated)")

    ckpt_module._write_latest = crash
    try:
        fsdp2.save_checkpoint(state, path, step=2)
    except Exception as error:
        report["errors"].append(type(error).__name__ + ": " + str(error))
    finally:
        ckpt_module._write_latest = real_write_latest
    report["latest_2"] = open(os.path.join(path, "latest")).read().strip()

    fresh = _sharded("fsdp2", seed=1)
    fresh_opt = make_optimizer(fresh, LR)
    report["loaded"] = fsdp2.load_checkpoint(
        {"app": fsdp2.ModelOptimizerState(fresh, fresh_opt)}, path
    )
    report["loaded_params"] = _unequal(at_step_1, _full_params(fresh))

    fsdp2.save_checkpoint(state, path, step=3, keep=1)
    dist.barrier()
    report["after_good_save"] = sorted(os.listdir(path))
    report["loaded_3"] = fsdp2.load_checkpoint(
        {"app": fsdp2.ModelOptimizerState(fresh, fresh_opt)}, path
    )
    return report


def test_failed_save_keeps_the_previous_checkpoint(tmp_path) -> None:
    require_impl("fsdp2")
    for rank, rep in enumerate(run_ranks(rank_failed_save, 2, str(tmp_path), timeout=60)):
        assert len(rep["errors"]) == 2, f"rank {rank}: a failed save must raise everywhere"
        # DCP's CheckpointException is a BaseException: save_checkpoint re-raises it as a
        # RuntimeError (which `except Exception` catches), with the failing rank's error.
        assert rep["errors"][0].startswith("RuntimeError: save_checkpoint: writing"), rep["errors"]
        assert "No space left on device (simulated)" in rep["errors"][0], rep["errors"]
        assert "killed before latest" in rep["errors"][1], rep["errors"]
        # The failed write left files behind, in a directory nothing loads from.
        assert rep["after_failed_write"] == ["latest", "step_1", "step_2.tmp"]
        assert rep["tmp_files"] and ".metadata" not in rep["tmp_files"], rep["tmp_files"]
        assert rep["latest_1"] == rep["latest_2"] == "step_1"
        assert rep["loaded"] == 1
        assert rep["loaded_params"] == [], rep["loaded_params"]
        assert rep["after_good_save"] == ["latest", "step_3"], rep["after_good_save"]
        assert rep["loaded_3"] == 3


# ------------------------------------------------- copying and pickling state dicts


def rank_copy_and_save_state_dict(impl: str) -> dict:
    """What users do to snapshot weights: deepcopy or torch.save the sharded state dict."""
    import copy
    import io

    model = _sharded(impl)
    opt = make_optimizer(model, LR)
    _train(model, opt, range(1))
    msd = model.state_dict()
    local = {k: v.to_local().clone() for k, v in msd.items()}
    copied = copy.deepcopy(msd)
    buffer = io.BytesIO()
    torch.save({"model": msd, "optim": opt.state_dict()}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)["model"]
    param = next(iter(model.parameters()))
    return {
        "copied_unequal": [k for k, v in copied.items() if not torch.equal(v.to_local(), local[k])],
        "copied_is_dtensor": all(isinstance(v, DTensor) for v in copied.values()),
        "loaded_unequal": [k for k, v in loaded.items() if not torch.equal(v.to_local(), local[k])],
        "loaded_placements": sorted({str(v.placements) for v in loaded.values()}),
        "param_copy_equal": torch.equal(copy.deepcopy(param).to_local(), param.to_local()),
        # Copies are independent of the live parameters.
        "copy_detached": all(
            v.to_local().data_ptr() != p.to_local().data_ptr()
            for v, p in zip(copied.values(), model.parameters())
            if p.to_local().numel()
        ),
    }


@pytest.mark.parametrize("impl", ["fsdp2", "torch"])
def test_state_dict_deepcopy_and_torch_save(impl: str) -> None:
    """Fails with shard views at a nonzero storage offset (see [Note: shard aliases at
    offset 0]): deepcopy and torch.save then read the DTensor wrapper's storage."""
    require_impl(impl)
    for rank, rep in enumerate(run_ranks(rank_copy_and_save_state_dict, 2, impl)):
        assert rep["copied_unequal"] == [], (rank, rep["copied_unequal"])
        assert rep["copied_is_dtensor"], rank
        assert rep["loaded_unequal"] == [], (rank, rep["loaded_unequal"])
        assert rep["loaded_placements"] == ["(Shard(dim=0),)"], rep["loaded_placements"]
        assert rep["param_copy_equal"] and rep["copy_detached"], rep


def rank_state_dict_after_forward(impl: str, reshard_after_forward: bool | None) -> dict:
    """A forward that keeps parameters unsharded (no reshard, or the root by default), then
    state_dict() / load_state_dict(), as after a validation step with grad enabled."""
    fully_shard = get_fully_shard(impl)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model[0], reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    x = torch.randn(2, 4)
    model(x)
    msd = model.state_dict()
    kinds = sorted({type(v).__name__ for v in msd.values()})
    model(x)
    zeros = {k: torch.zeros_like(v) for k, v in msd.items()}
    model.load_state_dict(zeros)
    with torch.no_grad():
        out = model(x)
    return {"kinds": kinds, "loaded_zeros": bool((out == 0).all())}


@pytest.mark.parametrize("reshard_after_forward", [False, None], ids=["keep", "default"])
@pytest.mark.parametrize("impl", ["fsdp2", "torch"])
def test_state_dict_after_forward_is_sharded(impl: str, reshard_after_forward: bool | None) -> None:
    require_impl(impl)
    for rep in run_ranks(rank_state_dict_after_forward, 2, impl, reshard_after_forward):
        assert rep == {"kinds": ["DTensor"], "loaded_zeros": True}, rep


def rank_load_with_assign(impl: str) -> dict:
    """load_state_dict(assign=True) with sharded DTensors: on a meta-device model (the
    parameters become the loaded shards) and on a trained one (the loaded values win)."""
    from torch.distributed.tensor import distribute_tensor

    fully_shard = get_fully_shard(impl)
    mesh = make_mesh()
    torch.manual_seed(0)
    full = {"0.weight": torch.randn(4, 4), "1.weight": torch.randn(4, 4)}
    x = torch.randn(2, 4)
    expected = x @ full["0.weight"].T @ full["1.weight"].T

    def sharded_sd(model: nn.Module) -> dict:
        return {
            k: distribute_tensor(full[k], p.device_mesh, p.placements)
            for k, p in model.named_parameters()
        }

    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    for layer in meta:
        fully_shard(layer, mesh=mesh)
    fully_shard(meta, mesh=mesh)
    meta.load_state_dict(sharded_sd(meta), assign=True)
    meta_out = meta(x)

    torch.manual_seed(1)
    trained = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    for layer in trained:
        fully_shard(layer, mesh=mesh)
    fully_shard(trained, mesh=mesh)
    trained(x).sum().backward()  # lazy init done, buffers built
    trained.load_state_dict(sharded_sd(trained), assign=True)
    trained_out = trained(x)
    return {
        "meta_diff": (meta_out - expected).abs().max().item(),
        "trained_diff": (trained_out - expected).abs().max().item(),
        "devices": sorted({str(p.device) for p in meta.parameters()}),
    }


@pytest.mark.parametrize("impl", ["fsdp2", "torch"])
def test_load_state_dict_with_assign(impl: str) -> None:
    require_impl(impl)
    for rep in run_ranks(rank_load_with_assign, 2, impl):
        assert rep["meta_diff"] <= 1e-6 and rep["trained_diff"] <= 1e-6, rep
        assert rep["devices"] == ["cpu"], rep


class _TinyLM(nn.Module):
    """Embedding, a layer, a norm and an output head, optionally tied to the embedding."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layer = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.layer(self.embed(x))))


def _meta_lm_with_a_module_group(impl: str, tied: bool) -> nn.Module:
    """accelerate's layout for a tied model: one call for the layer, one for the modules
    around it (the group's first parameter, ``norm``'s, is loaded after ``embed``'s)."""
    fully_shard = get_fully_shard(impl)
    mesh = make_mesh()
    with torch.device("meta"):
        model = _TinyLM(tied)
    fully_shard(model.layer, mesh=mesh)
    fully_shard([model.norm, model.embed, model.head], mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh)
    return model


def rank_load_with_assign_into_a_module_group(impl: str, tied: bool) -> dict:
    """A model built on the meta device, sharded with a group of several modules, loaded
    with ``load_state_dict(assign=True)`` (accelerate's ``cpu_ram_efficient_loading``),
    re-tied, then trained: it must train like the unsharded model."""
    from torch.distributed.tensor import distribute_tensor

    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = _TinyLM(tied)
    full = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    model = _meta_lm_with_a_module_group(impl, tied)
    model.load_state_dict(
        {
            k: distribute_tensor(full[k], p.device_mesh, p.placements)
            for k, p in model.state_dict().items()
        },
        assign=True,
    )
    if tied:
        model.head.weight = model.embed.weight  # accelerate ties again after loading
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        tokens = torch.randint(0, 16, (2 * ws, 5), generator=gen)
        model(tokens[2 * rank : 2 * rank + 2]).logsumexp(-1).mean().backward()
        ref(tokens).logsumexp(-1).mean().backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    params = {n: full_value(p).detach() for n, p in model.named_parameters()}
    return {
        "diff": max((params[n] - q).abs().max().item() for n, q in ref.named_parameters()),
        "params": params if rank == 0 else None,
        "still_tied": model.head.weight is model.embed.weight,
    }


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_load_with_assign_into_a_group_of_modules(tied: bool) -> None:
    """Each module's load post-hook re-binds its group as soon as that module is loaded;
    with the group's first parameter still on the meta device, fsdp2 laid the flat buffer
    out on the meta device and dropped the loaded values (the tied embedding trained from
    zeros, silently)."""
    reports = {}
    for impl in IMPLS:
        require_impl(impl)
        reports[impl] = run_ranks(rank_load_with_assign_into_a_module_group, 2, impl, tied)
        for rep in reports[impl]:
            assert rep["diff"] <= 1e-5, (impl, rep["diff"])
            assert rep["still_tied"] is tied, (impl, rep)
    if len(reports) == 2:
        ours, theirs = reports["fsdp2"][0]["params"], reports["torch"][0]["params"]
        assert ours.keys() == theirs.keys()
        for name in ours:
            assert torch.equal(ours[name], theirs[name]), name


def rank_partly_loaded_group() -> str:
    """Only some of a group's modules loaded (``strict=False``): the rest stay on the meta
    device, and the first forward must say so rather than compute with zeros."""
    from torch.distributed.tensor import distribute_tensor

    model = _meta_lm_with_a_module_group("fsdp2", tied=False)
    loaded = {
        k: distribute_tensor(torch.ones(p.shape), p.device_mesh, p.placements)
        for k, p in model.state_dict().items()
        if not k.startswith("head.")
    }
    model.load_state_dict(loaded, assign=True, strict=False)
    try:
        model(torch.zeros(2, 5, dtype=torch.long))
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_partly_loaded_group_is_a_clear_error() -> None:
    for message in run_ranks(rank_partly_loaded_group, 2):
        assert "still on meta device: ['head.weight']" in message, message
        assert "next to materialized ones: " in message, message
        assert "norm.weight" in message and "embed.weight" in message, message


def rank_assign_plain_tensor() -> str:
    model = nn.Sequential(nn.Linear(4, 4))
    fsdp2.fully_shard(model, mesh=make_mesh())
    try:
        model.load_state_dict(
            {k: torch.zeros(v.shape) for k, v in model.state_dict().items()}, assign=True
        )
    except ValueError as e:
        return str(e)
    return "no error"


def test_assign_plain_tensor_is_a_clear_error() -> None:
    for message in run_ranks(rank_assign_plain_tensor, 2):
        assert "parameter '0.weight' was replaced by a Parameter of shape (4, 4)" in message, (
            message
        )
        assert "DTensor shards" in message, message


def rank_load_plain_full_tensors() -> str:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fsdp2.fully_shard(model[0], mesh=make_mesh())
    fsdp2.fully_shard(model, mesh=make_mesh())
    try:
        model.load_state_dict(full)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_load_plain_full_tensors_says_how() -> None:
    """A full state dict passed to ``load_state_dict`` (without ``assign``) names the first
    plain entry and the loaders that take full weights, instead of DTensor's "got mixed
    torch.Tensor and DTensor" for every entry."""
    for message in run_ranks(rank_load_plain_full_tensors, 2):
        assert message.startswith(
            "load_state_dict: '0.weight' is a plain tensor of shape (4, 4), but fully_shard "
            "made that parameter a DTensor (global shape (4, 4), this rank's shard (2, 4))"
        ), message
        assert "fsdp2.load_full_state_dict(model, state_dict)" in message, message
        assert "mixed torch.Tensor and DTensor" not in message, message


# ------------------------------------------------------------- full state dicts


def rank_full_state_dict(impl: str) -> dict:
    rank = dist.get_rank()
    ref = build_model(_case(tied=True)) if rank == 0 else None
    full_sd = ref.state_dict() if ref is not None else None
    model = _meta_sharded(impl, tied=True)
    tracker = LiveTensorBytes()
    with tracker:
        result = fsdp2.load_full_state_dict(model, full_sd)
    shard_bytes = sum(p.to_local().nbytes for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    group_bytes = max(
        sum(p.to_local().nbytes for _, p in params) for params in fsdp_groups(model, impl).values()
    )
    gathered = fsdp2.get_full_state_dict(model)
    everywhere = fsdp2.get_full_state_dict(model, rank0_only=False, cpu_offload=False)

    # torch's own API on a torch-sharded model, from the same rank-0 dict.
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, cpu_offload=True)
    torch_model = _sharded("torch", seed=1, tied=True)
    set_model_state_dict(torch_model, full_sd if full_sd is not None else {}, options=options)
    torch_gathered = get_model_state_dict(torch_model, options=options)
    return {
        "result": tuple(result),
        "vs_torch_load": _unequal(_full_params(model), _full_params(torch_model)),
        "gathered_keys": sorted(gathered),
        "gathered_vs_ref": _unequal(gathered, ref.state_dict()) if ref is not None else None,
        "gathered_vs_torch": _unequal(gathered, torch_gathered),
        "gathered_devices": sorted({str(v.device) for v in gathered.values()}),
        "tied_shared": rank != 0 or gathered["output.weight"] is gathered["tok_embeddings.weight"],
        "everywhere_vs_model": _unequal(
            everywhere, {k: v.full_tensor() for k, v in model.state_dict().items()}
        ),
        "peak": tracker.peak,
        "shard_bytes": shard_bytes,
        "largest_param": largest,
        "group_bytes": group_bytes,
        "full_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }


@pytest.mark.parametrize("impl", ["fsdp2", "torch"])
def test_full_state_dict_round_trip(impl: str) -> None:
    require_impl(impl)
    require_impl("torch")
    reports = run_ranks(rank_full_state_dict, 3, impl)
    keys = sorted(build_model(_case(tied=True)).state_dict())
    for rank, rep in enumerate(reports):
        assert rep["result"] == ([], []), rep["result"]
        assert rep["vs_torch_load"] == [], f"rank {rank}: {rep['vs_torch_load']}"
        assert rep["gathered_keys"] == (keys if rank == 0 else []), rank
        assert rep["gathered_vs_torch"] == [], f"rank {rank}: {rep['gathered_vs_torch']}"
        assert rep["tied_shared"], "tied parameters must map to one tensor"
        assert rep["everywhere_vs_model"] == [], rep["everywhere_vs_model"]
        if rank == 0:
            assert rep["gathered_vs_ref"] == [], rep["gathered_vs_ref"]
            assert rep["gathered_devices"] == ["cpu"]
        else:
            # The shards, plus one group's old local tensors while ``to_empty`` re-points
            # them into its flat buffer (fsdp2), plus the one full tensor being broadcast
            # and this rank's chunk of it: never the model.
            bound = rep["shard_bytes"] + rep["group_bytes"] + 2 * rep["largest_param"]
            assert rep["peak"] <= bound, (rank, rep["peak"], bound, rep["full_bytes"])
            assert rep["peak"] < rep["full_bytes"] / 1.5, (rank, rep["peak"], rep["full_bytes"])


def _error(fn, *args, **kwargs) -> str:
    """``"<type>: <message>"`` of what ``fn`` raises (every rank must get the same)."""
    try:
        fn(*args, **kwargs)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "<no error>"


def rank_full_state_dict_errors() -> dict:
    rank = dist.get_rank()
    ref = build_model(_case())
    model = _sharded("fsdp2", seed=1)
    good = ref.state_dict() if rank == 0 else None
    bad_keys = None
    bad_shape = None
    if rank == 0:
        bad_keys = dict(good)
        del bad_keys["norm.weight"]
        bad_keys["norm.bias"] = torch.zeros(3)
        bad_shape = dict(good, **{"output.weight": torch.zeros(2, 2)})
    before = _full_params(model)
    report = {
        "keys": _error(fsdp2.load_full_state_dict, model, bad_keys),
        "shape": _error(fsdp2.load_full_state_dict, model, bad_shape),
        "none_on_rank0": _error(fsdp2.load_full_state_dict, model, None),
        # Only rank 0 could fail to read a meta tensor: it must not strand the others.
        "meta_on_rank0": _error(
            fsdp2.load_full_state_dict,
            model,
            dict(good, **{"norm.weight": torch.empty(32, device="meta")}) if rank == 0 else None,
        ),
        "untouched": _unequal(before, _full_params(model)),
    }
    result = fsdp2.load_full_state_dict(model, bad_keys, strict=False)
    report["non_strict"] = tuple(result)
    loaded = _full_params(model)
    expected = {n: p.detach() for n, p in ref.named_parameters()}
    expected["norm.weight"] = before["norm.weight"]  # missing: left as it was
    report["non_strict_values"] = _unequal(loaded, expected)
    return report


def test_full_state_dict_errors_are_raised_on_every_rank() -> None:
    require_impl("fsdp2")
    for rank, rep in enumerate(run_ranks(rank_full_state_dict_errors, 2, timeout=60)):
        for kind in ("keys", "shape", "none_on_rank0", "meta_on_rank0"):
            assert rep[kind].startswith("ValueError: load_full_state_dict: "), (rank, rep[kind])
        assert "missing key(s): 'norm.weight'" in rep["keys"], (rank, rep["keys"])
        assert "unexpected key(s): 'norm.bias'" in rep["keys"], (rank, rep["keys"])
        assert "size mismatch for 'output.weight'" in rep["shape"], (rank, rep["shape"])
        assert "(2, 2)" in rep["shape"] and "(64, 32)" in rep["shape"], rep["shape"]
        assert "got NoneType" in rep["none_on_rank0"], (rank, rep["none_on_rank0"])
        assert "'norm.weight' is on the meta device" in rep["meta_on_rank0"], rep["meta_on_rank0"]
        assert rep["untouched"] == [], "a rejected state dict must load nothing"
        assert rep["non_strict"] == (["norm.weight"], ["norm.bias"]), rep["non_strict"]
        assert rep["non_strict_values"] == [], rep["non_strict_values"]


# ------------------------------------------------------------ the example trainer

SMALL = ["--dim", "32", "--layers", "1", "--heads", "2", "--vocab", "64", "--seq-len", "16",
         "--batch-size", "2"]  # fmt: skip


def _torchrun(*flags: str) -> str:
    """Run examples/train_llama.py on 2 ranks; its stdout and stderr together."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # This checkout's fsdp2, not whichever one is installed.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(REPO / "examples" / "train_llama.py"), *SMALL, *flags]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{output[-4000:]}"
    return output


def _final_loss(output: str) -> str:
    match = re.search(r"done: (\d+) steps, final loss (\S+),", output)
    assert match, output[-2000:]
    return f"{match.group(1)} steps, loss {match.group(2)}"


@pytest.mark.slow
def test_example_trainer_resumes(tmp_path) -> None:
    """``--checkpoint-dir`` then ``--resume`` through torchrun: the second run starts at
    the saved step (the numerics of resuming are checked by the tests above; a third
    ``torchrun`` for an uninterrupted run would add ~15 s)."""
    ckpt = str(tmp_path / "ckpt")
    first = _torchrun("--steps", "4", "--checkpoint-dir", ckpt, "--checkpoint-every", "2")
    assert "saved checkpoint at step 2" in first and "saved checkpoint at step 4" in first
    assert _final_loss(first).startswith("4 steps")
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_4"
    resumed = _torchrun("--steps", "8", "--checkpoint-dir", ckpt, "--resume")
    assert "resumed from step 4" in resumed, resumed[-2000:]
    assert "train:  50%" in resumed, "the progress bar must start at step 4 of 8"
    assert "saved checkpoint at step 8" in resumed
    assert sorted(os.listdir(ckpt)) == ["latest", "step_4", "step_8"]  # --checkpoint-keep 2
    assert _final_loss(resumed).startswith("8 steps")


# ------------------------------------------------------------------ docs examples


def exec_doc_example(source: str, filename: str, workdir: str) -> bool:
    """Rank function: run a docs example as a script in ``workdir`` (it asserts its own
    result)."""
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        exec(compile(source, filename, "exec"), {"__name__": "__main__"})
    finally:
        os.chdir(cwd)
    return True


@pytest.mark.parametrize("page", ["checkpoint.md", "deferred_init.md"])
def test_docs_example(page: str, tmp_path) -> None:
    require_impl("fsdp2")
    doc = REPO / "docs" / page
    match = re.search(r"```python\n(.*?)```", doc.read_text(), re.DOTALL)
    assert match, f"no ```python block in {doc}"
    assert all(run_ranks(exec_doc_example, 2, match.group(1), str(doc), str(tmp_path)))


def rank_checkpoint_input_errors(path: str) -> dict:
    model = _sharded("fsdp2")
    opt = make_optimizer(model, LR)
    state = {"app": fsdp2.ModelOptimizerState(model, opt)}
    report = {
        "empty_dir": fsdp2.load_checkpoint(state, os.path.join(path, "nothing-here")),
        "state_type": _error(fsdp2.save_checkpoint, [model], path, step=1),
        "step_type": _error(fsdp2.save_checkpoint, state, path, step=-1),
        "keep_type": _error(fsdp2.save_checkpoint, state, path, step=1, keep=0),
        "load_step_type": _error(fsdp2.load_checkpoint, state, path, step="1"),
        "model_type": _error(fsdp2.ModelOptimizerState, opt),
        "optim_type": _error(fsdp2.ModelOptimizerState, model, [model]),
    }
    fsdp2.save_checkpoint(state, path, step=1)
    report["missing_step"] = _error(fsdp2.load_checkpoint, state, path, step=2)
    return report


def test_checkpoint_input_errors(tmp_path) -> None:
    require_impl("fsdp2")
    for rep in run_ranks(rank_checkpoint_input_errors, 2, str(tmp_path), timeout=60):
        assert rep["empty_dir"] is None, "no checkpoint yet: load_checkpoint returns None"
        assert rep["state_type"].startswith("TypeError: save_checkpoint(state=...)"), rep
        assert rep["step_type"] == (
            "ValueError: save_checkpoint(step=...) expects an int >= 0, got -1."
        )
        assert rep["keep_type"].startswith("ValueError: save_checkpoint(keep=...)"), rep
        assert rep["load_step_type"].startswith("ValueError: load_checkpoint(step=...)"), rep
        assert rep["model_type"].startswith("TypeError: ModelOptimizerState(model=...)"), rep
        assert rep["optim_type"].startswith("TypeError: ModelOptimizerState(optimizer=...)")
        assert rep["missing_step"].startswith("FileNotFoundError: load_checkpoint: no complete"), (
            rep["missing_step"]
        )
        assert "available steps: [1]" in rep["missing_step"]
