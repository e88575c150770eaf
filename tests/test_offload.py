"""``CPUOffloadPolicy``: sharded parameters and gradients kept in CPU memory.

On this CPU-only test machine the compute device is the CPU as well, so these tests check
the contract rather than the copies: with ``CPUOffloadPolicy(pin_memory=False)`` and with
the default (``pin_memory=True``, which fsdp2 accepts without CUDA; torch raises), training matches
the unsharded reference within 1e-5, every sharded parameter's, gradient's and optimizer
state's local tensor is on the CPU, and fsdp2 and torch's FSDP2 with the same policy
produce equal losses and parameters. Mixed precision on top of offload is covered once as well.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
import torch.distributed as dist
from _control_helpers import (
    TOL,
    adamw,
    api,
    build_net,
    clone_model,
    global_batch,
    max_param_diff,
    mse,
    rank_slice,
    reference_step,
    shard_net,
)
from _helpers import IMPLS, full, require_impl
from _launcher import run_ranks
from test_grad_accumulation import exec_doc_example, first_python_block


def offload_policy(impl: str, pin_memory: bool | None):
    cls = api(impl, "CPUOffloadPolicy")
    return cls() if pin_memory is None else cls(pin_memory=pin_memory)


def offload_training(impl: str, pin_memory: bool | None) -> dict:
    """Rank function: 3 steps vs the reference; devices of shards and gradients."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    ref = build_net()
    model = shard_net(clone_model(ref), impl, offload_policy=offload_policy(impl, pin_memory))
    ref_opt, opt = adamw(ref), adamw(model)
    devices: set[tuple[str, str]] = set()
    steps = []
    for step in range(3):
        batch = global_batch(step, 2 * ws)
        reference_step(ref, ref_opt, batch)
        mse(model, rank_slice(batch, rank, ws)).backward()
        for p in model.parameters():
            devices.add(("param", p.to_local().device.type))
            devices.add(("grad", p.grad.to_local().device.type))
        opt.step()
        opt.zero_grad()
        for state in opt.state.values():  # the optimizer steps on the CPU shards
            for name, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    devices.add((f"optim.{name}", value.to_local().device.type))
        steps.append(max_param_diff(ref, model))
    return {"steps": steps, "devices": sorted(devices)}


@pytest.mark.parametrize(
    ("impl", "pin_memory"),
    # torch + the default pin_memory=True on a machine without an accelerator:
    # "RuntimeError: Cannot access accelerator device when none is available" (pinning
    # needs one); fsdp2 pins only when CUDA is available.
    [("fsdp2", False), ("torch", False), ("fsdp2", None)],
    ids=["fsdp2-pin_memory_False", "torch-pin_memory_False", "fsdp2-default"],
)
def test_offload_parity(impl: str, pin_memory: bool | None) -> None:
    require_impl(impl)
    for rank, report in enumerate(run_ranks(offload_training, 2, impl, pin_memory)):
        expected = ["grad", "optim.exp_avg", "optim.exp_avg_sq", "param"]
        assert report["devices"] == [(k, "cpu") for k in expected], report["devices"]
        for step, (name, diff) in enumerate(report["steps"]):
            assert diff <= TOL, f"[{impl}, rank {rank}, step {step}] {name} differs by {diff:.3g}"


def offload_cross_impl(mixed_precision: bool) -> dict:
    """Rank function: fsdp2 and torch with the same offload (and mixed precision) policy."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    base = build_net()
    models, opts = {}, {}
    for impl in IMPLS:
        kwargs = {"offload_policy": offload_policy(impl, False)}
        if mixed_precision:
            mp = api(impl, "MixedPrecisionPolicy")(param_dtype=torch.bfloat16)
            kwargs["mp_policy"] = mp
        models[impl] = shard_net(clone_model(base), impl, **kwargs)
        opts[impl] = adamw(models[impl])
    mismatches = []
    for step in range(3):
        batch = rank_slice(global_batch(step, 2 * ws), rank, ws)
        losses = {}
        for impl, model in models.items():
            loss = torch.nn.functional.mse_loss(model(batch[0]).float(), batch[1])
            loss.backward()
            losses[impl] = loss.detach()
            opts[impl].step()
            opts[impl].zero_grad()
        if not torch.equal(losses["fsdp2"], losses["torch"]):
            mismatches.append(f"step {step}: loss {losses['fsdp2']} vs {losses['torch']}")
        ours = dict(models["fsdp2"].named_parameters())
        for name, p in models["torch"].named_parameters():
            if not torch.equal(full(ours[name].detach()), full(p.detach())):
                mismatches.append(f"step {step}: {name}")
    return {"mismatches": mismatches}


@pytest.mark.parametrize("mixed_precision", [False, True], ids=["fp32", "bf16"])
def test_offload_equal_to_torch(mixed_precision: bool) -> None:
    for impl in IMPLS:
        require_impl(impl)
    for rank, report in enumerate(run_ranks(offload_cross_impl, 2, mixed_precision)):
        assert not report["mismatches"], f"rank {rank}: {report['mismatches']}"


def test_docs_example() -> None:
    """The first ```python block of docs/offload.md runs on 2 ranks."""
    require_impl("fsdp2")
    doc = pathlib.Path(__file__).resolve().parent.parent / "docs" / "offload.md"
    assert all(run_ranks(exec_doc_example, 2, first_python_block(doc), str(doc)))


def rank_meta_init_then_load(impl: str, how: str) -> list[float]:
    """A meta-device model, sharded with offload, then given CPU shards by
    ``load_state_dict(assign=True)`` or ``to_empty(device="cpu")``; returns
    the loss and the gradients' global sums of one step."""
    from torch.distributed.tensor import distribute_tensor

    torch.manual_seed(0)
    with torch.device("meta"):
        model = torch.nn.Sequential(
            torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False)
        )
    fully_shard = api(impl, "fully_shard")
    for module in (model[0], model[1], model):
        fully_shard(module, offload_policy=offload_policy(impl, False))
    values = {name: torch.full(p.shape, 0.5) for name, p in model.named_parameters()}
    if how == "assign":
        sd = {
            name: distribute_tensor(values[name], p.device_mesh, p.placements)
            for name, p in model.named_parameters()
        }
        model.load_state_dict(sd, assign=True)
    else:
        model.to_empty(device="cpu")
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(distribute_tensor(values[name], p.device_mesh, p.placements))
    loss = model(torch.ones(2, 4)).sum()
    loss.backward()
    return [loss.item()] + [full(p.grad).sum().item() for p in model.parameters()]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("how", ["assign", "to_empty"])
def test_meta_init_then_cpu_shards(impl: str, how: str) -> None:
    """Offloaded shards materialized on the CPU after a meta-device init: compute runs on
    the mesh's device. fsdp2 kept computing on the meta device (the forward returned a
    meta loss, the backward failed: "expected device meta but got cpu")."""
    require_impl(impl)
    for result in run_ranks(rank_meta_init_then_load, 2, impl, how):
        # Hidden values 4 * 0.5 = 2, outputs 4 * 0.5 * 2 = 4, loss 2 x 4 outputs of 4;
        # each weight's gradient elements are 2 rows x 2 = 4, 16 of them.
        assert result == [32.0, 64.0, 64.0], result


def offloaded_shard_reported_off_the_cpu() -> str:
    """Rank function: a group sharded with CPU offload whose first shard claims to live
    on an accelerator (a stand-in: a CPU-only build has no second device type; the real
    move is checked on CUDA by ``tests/_device_checks.py``). Returns the error raised."""
    import types

    from torch import nn

    import fsdp2

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fsdp2.fully_shard(model, offload_policy=fsdp2.CPUOffloadPolicy(pin_memory=False))
    group = model._fsdp_state.groups[0]
    param = group.params[0]
    param.local_tensor = lambda: types.SimpleNamespace(device=torch.device("cuda", 0))
    try:
        group._check_offloaded_shards_on_cpu()
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_offloaded_shards_moved_off_the_cpu_are_an_error() -> None:
    """CPU offload with shards on an accelerator would silently stop offloading; torch
    raises at lazy init with this wording, so does fsdp2 (also after a later move)."""
    (message,) = run_ranks(offloaded_shard_reported_off_the_cpu, 1)
    assert "Found following parameters on non-CPU device: [('0.weight'" in message, message
    assert "CPUOffloadPolicy" in message, message


def offload_on_a_mesh_of_another_device_type() -> dict:
    """Rank function: CPU offload on an accelerator's mesh, with a stand-in (a CPU-only
    build has no second device type): the mesh reports device type ``meta`` while
    compute stays on the CPU. ``DTensor.from_local`` copies a local tensor of another
    device type than the mesh's to the mesh's device, which left every offloaded shard
    off the CPU (on CUDA: on the GPU, and the first forward raised "Found following
    parameters on non-CPU device"). DTensor ops cannot run on the stand-in mesh, so the
    steps are SGD on the local tensors, and the gradients are compared shard by shard
    with the reference's. Returns the worst difference and where shards live."""
    from types import SimpleNamespace
    from unittest import mock

    from torch.distributed.device_mesh import init_device_mesh

    import fsdp2
    import fsdp2._fully_shard

    rank, ws = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (ws,))
    mesh._device_type = "meta"  # what the DTensors see; compute and collectives: CPU
    ref = build_net()
    policy = offload_policy("fsdp2", False)
    # torch >= 2.14 prices redistributions by the mesh's devices per host, read from the
    # device type's module (``torch.<type>``), which ``meta`` lacks.
    handle = SimpleNamespace(device_count=lambda: ws)
    with (
        mock.patch.object(fsdp2._fully_shard, "mesh_device", lambda _: torch.device("cpu")),
        mock.patch.object(torch, "meta", handle, create=True),
    ):
        model = shard_net(clone_model(ref), "fsdp2", mesh=mesh, offload_policy=policy)
    states = [m._fsdp_state for m in model.modules() if isinstance(m, fsdp2.FSDPModule)]
    bound = all(
        p.points_into(group.flat_shard)
        for state in states
        for group in state.groups
        for p in group.params
    )
    worst, devices = 0.0, set()
    params, ref_params = dict(model.named_parameters()), dict(ref.named_parameters())
    for step in range(2):
        batch = global_batch(step, 2 * ws)
        mse(ref, batch).backward()
        mse(model, rank_slice(batch, rank, ws)).backward()
        with torch.no_grad():
            for name, p in params.items():
                local, grad = p.to_local(), p.grad.to_local()
                devices |= {local.device.type, grad.device.type}
                rows = torch.chunk(ref_params[name], ws)[rank]
                ref_rows = torch.chunk(ref_params[name].grad, ws)[rank]
                worst = max(worst, (grad - ref_rows).abs().max().item())
                worst = max(worst, (local - rows).abs().max().item())
                local.sub_(0.1 * grad)
                ref_params[name].sub_(0.1 * ref_params[name].grad)
                ref_params[name].grad = p.grad = None
    return {"bound": bound, "devices": sorted(devices), "worst": worst}


def test_offloaded_shards_stay_on_the_cpu_on_an_accelerator_mesh() -> None:
    for report in run_ranks(offload_on_a_mesh_of_another_device_type, 2):
        assert report["bound"], "a sharded parameter's local tensor left the flat shard"
        assert report["devices"] == ["cpu"], report["devices"]
        assert report["worst"] <= TOL, report["worst"]
