"""Training checks that run unchanged on the CPU (gloo) and on a CUDA device (NCCL).

Run as a fresh process, one phase per run, so that CUDA is never initialized in the pytest
process (whose rank pools fork) and each phase gets a clean process group::

    python tests/_device_checks.py --device cuda --phase one-rank
    python tests/_device_checks.py --device cuda --phase fake-4
    python tests/_device_checks.py --device cuda --phase optim

It prints one JSON object on its last line. ``tests/test_device.py`` runs both phases on the
CPU in every suite (so this script cannot rot on machines without a GPU) and on CUDA when a
GPU is visible (marked ``gpu``).

* ``one-rank``: a real 1-rank process group (NCCL on CUDA). fsdp2, torch's ``fully_shard``
  and a non-sharded copy train the same Llama-style model for a few steps with the same
  batches, in fp32 and with a bf16 policy; an explicit ``unshard()`` right after the
  optimizer step (the all-gather must wait for the optimizer's writes on the compute
  stream) and an inference pass sit between steps. Reported: the worst parameter
  difference against the reference (fp32) and against torch (bf16), and on CUDA the
  allocated memory after every step (it must not grow) and each implementation's peak.
* ``optim``: the optimizer fast path on the device, 1-rank process group: every
  optimizer the fast path takes, in each implementation the device has (for-loop,
  ``foreach``, ``fused``) and with ``capturable=True`` where the device supports it
  (CUDA: torch raises for it on the CPU), fp32 and bf16 parameters. Each run is compared
  bitwise with the same optimizer replayed on plain tensors holding the same initial
  values and gradients, and with torch's ``DTensor`` path where that path runs; the
  fast path's ``step()`` must dispatch no ``DTensor`` op. Reported: the cases run and
  every mismatch, by name.
* ``fake-4``: torch's fake process group of 4 ranks, so the multi-rank paths (copy-out
  from the rank-major all-gather output, reduce-scatter input, the side streams) run on
  the device; the collectives move no data, so only completion and counts are reported.
  The counting wrappers fill each output as if every rank held this rank's data: the
  fake collectives leave their outputs as allocated, and a step on whatever memory held
  before could make the loss non-finite at random (it did, once in a full run).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import fsdp2  # noqa: E402
from examples.llama import ModelArgs, Transformer, loss_fn, parallelize  # noqa: E402

STEPS = 4
ARGS = ModelArgs(vocab_size=128, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=32)


def _batches(device: torch.device) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [
        torch.randint(0, ARGS.vocab_size, (2, 32), generator=gen).to(device) for _ in range(STEPS)
    ]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(
        (_full(p.detach()).float() - _full(q.detach()).float()).abs().max().item()
        for p, q in zip(a.parameters(), b.parameters())
    )


def _shard(model: torch.nn.Module, fully_shard: Any, policy_cls: Any, bf16: bool, mesh) -> None:
    kwargs: dict[str, Any] = {"mesh": mesh}
    if bf16:
        kwargs["mp_policy"] = policy_cls(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    parallelize(model, fully_shard, **kwargs)


def one_rank(device: torch.device) -> dict[str, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    cuda = device.type == "cuda"
    backend = "nccl" if cuda else "gloo"
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=0, world_size=1)
        mesh = init_device_mesh(device.type, (1,))
        report: dict[str, Any] = {}
        for bf16 in (False, True):
            torch.manual_seed(0)
            base = Transformer(ARGS)
            base.init_weights(0)
            models = {"plain": copy.deepcopy(base).to(device)}
            for name, shard_fn, policy in (
                ("fsdp2", fsdp2.fully_shard, fsdp2.MixedPrecisionPolicy),
                ("torch", torch_fully_shard, TorchPolicy),
            ):
                model = copy.deepcopy(base).to(device)
                _shard(model, shard_fn, policy, bf16, mesh)
                models[name] = model
            optims = {
                name: torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False)
                for name, m in models.items()
            }
            memory: dict[str, list[int]] = {name: [] for name in models}
            peaks: dict[str, int] = {}
            for tokens in _batches(device):
                for name, model in models.items():
                    if name == "plain" and bf16:
                        continue  # the bf16 comparison is fsdp2 against torch
                    if cuda:
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                        start = torch.cuda.memory_allocated()
                    loss_fn(model(tokens), tokens).backward()
                    optims[name].step()
                    optims[name].zero_grad()
                    if name != "plain":
                        model.unshard()  # right after the optimizer: must see its writes
                        model.reshard()
                    with torch.no_grad():
                        model(tokens)  # inference between steps
                    if cuda:
                        torch.cuda.synchronize()
                        peaks[name] = max(
                            peaks.get(name, 0), torch.cuda.max_memory_allocated() - start
                        )
                        memory[name].append(torch.cuda.memory_allocated())
            for name, model in models.items():
                if name != "plain":
                    model.reshard()  # torch keeps the root unsharded after a no_grad forward
            key = "bf16" if bf16 else "fp32"
            if not bf16:
                report[f"{key}_fsdp2_vs_plain"] = _max_diff(models["fsdp2"], models["plain"])
                report[f"{key}_torch_vs_plain"] = _max_diff(models["torch"], models["plain"])
            report[f"{key}_fsdp2_vs_torch"] = _max_diff(models["fsdp2"], models["torch"])
            if cuda:
                report[f"{key}_allocated_per_step"] = {n: m for n, m in memory.items() if m}
                report[f"{key}_step_peak_bytes"] = peaks
            del models, optims
        report["offload"] = _offload(device, mesh)
        dist.destroy_process_group()
    return report


def _offload(device: torch.device, mesh) -> dict[str, Any]:
    """CPU offload on the device's mesh: one training step (the shards, gradients and
    optimizer state must stay on the CPU while compute runs on the device), a full state
    dict (gathered on the device: NCCL cannot gather host memory), then the module moved
    to the device: on an accelerator its next forward must raise (torch's wording)
    instead of silently keeping the shards there; on the CPU the move changes nothing."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    plain = copy.deepcopy(model).to(device)
    for layer in model:
        fsdp2.fully_shard(layer, mesh=mesh, offload_policy=fsdp2.CPUOffloadPolicy(False))
    fsdp2.fully_shard(model, mesh=mesh, offload_policy=fsdp2.CPUOffloadPolicy(False))
    report: dict[str, Any] = {}
    x = torch.randn(2, 8, device=device)
    try:
        model(x).sum().backward()
        plain(x).sum().backward()
        report["grad_diff"] = max(
            (p.grad.full_tensor().to(device) - q.grad).abs().max().item()
            for p, q in zip(model.parameters(), plain.parameters())
        )
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        report["devices"] = sorted(
            {p.to_local().device.type for p in model.parameters()}
            | {p.grad.to_local().device.type for p in model.parameters()}
        )
        full = fsdp2.get_full_state_dict(model)
        report["full_state_dict"] = sorted({value.device.type for value in full.values()})
    except RuntimeError as error:
        report["error"] = str(error)
        return report
    model.to(device)
    try:
        model(x).sum().backward()
    except RuntimeError as error:
        moved = "Found following parameters on non-CPU device" in str(error)
        report["moved_to_device"] = "raised" if moved else str(error)
        return report
    report["moved_to_device"] = "ran"
    return report


def fake_four(device: torch.device) -> dict[str, Any]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    mesh = init_device_mesh(device.type, (4,))
    counts = {"all_gather": 0, "reduce_scatter": 0}
    originals = {}
    for kind, names in (
        ("all_gather", ("all_gather_single", "all_gather_into_tensor")),
        ("reduce_scatter", ("reduce_scatter_single", "reduce_scatter_tensor")),
    ):
        for name in names:
            original = getattr(dist, name, None)
            if original is None:
                continue
            originals[name] = original

            def counted(*args: Any, _kind: str = kind, _orig: Any = original, **kwargs: Any):
                counts[_kind] += 1
                work = _orig(*args, **kwargs)
                output, input = args[0], args[1]
                with torch.no_grad():  # the fake collectives wrote nothing
                    if _kind == "all_gather":
                        output.view(4, -1).copy_(input.view(1, -1).expand(4, -1))
                    else:
                        output.copy_(input.view(4, -1)[0].view_as(output))
                return work

            setattr(dist, name, counted)
    try:
        torch.manual_seed(0)
        model = Transformer(ARGS).to(device)
        parallelize(model, fsdp2.fully_shard, mesh=mesh)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for tokens in _batches(device)[:2]:
            loss = loss_fn(model(tokens), tokens)
            loss.backward()
            optim.step()
            optim.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        finite = bool(torch.isfinite(loss).item())
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
        dist.destroy_process_group()
    return {"counts": counts, "steps": 2, "groups": ARGS.n_layers + 1, "loss_finite": finite}


# The optimizers of the ``optim`` phase, with settings that exercise their state.
OPTIMIZERS: list[tuple[type, dict[str, Any]]] = [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    (torch.optim.Adam, {"lr": 0.01, "amsgrad": True}),
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    (torch.optim.Adagrad, {"lr": 0.1}),
    (torch.optim.RMSprop, {"lr": 0.01, "centered": True, "momentum": 0.5}),
    (torch.optim.NAdam, {"lr": 0.01, "decoupled_weight_decay": True, "weight_decay": 0.1}),
    (torch.optim.RAdam, {"lr": 0.01}),
    (torch.optim.Adamax, {"lr": 0.01}),
    (torch.optim.Adadelta, {"lr": 1.0}),
    (torch.optim.ASGD, {"lr": 0.01, "t0": 1.0}),
    (torch.optim.Rprop, {"lr": 0.01}),
]


def _optim_cases(device: torch.device) -> list[tuple[str, type, dict[str, Any], torch.dtype]]:
    """(label, class, keyword arguments, parameter dtype) for the ``optim`` phase."""
    import inspect

    from torch.optim.optimizer import _get_capturable_supported_devices

    capturable_here = device.type in _get_capturable_supported_devices()
    cases = []
    for cls, kwargs in OPTIMIZERS:
        accepts = inspect.signature(cls.__init__).parameters
        impls: list[dict[str, Any]] = [{"foreach": False}, {"foreach": True}]
        if "fused" in accepts:
            impls.append({"fused": True})
        if "capturable" in accepts and capturable_here:
            impls += [{"foreach": False, "capturable": True}, {"foreach": True, "capturable": True}]
        for impl in impls:
            label = f"{cls.__name__} {impl}"
            cases.append((label, cls, {**kwargs, **impl}, torch.float32))
    for impl in ({"foreach": True}, {"fused": True}):
        cases.append(
            (f"AdamW bf16 {impl}", torch.optim.AdamW, {"lr": 0.01, **impl}, torch.bfloat16)
        )
    return cases


class _DTensorOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops dispatched with a ``DTensor`` argument while active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        from torch.distributed.tensor import DTensor
        from torch.utils._pytree import tree_flatten

        if any(isinstance(t, DTensor) for t in tree_flatten((args, kwargs or {}))[0]):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _optim_run(
    device: torch.device,
    mesh: Any,
    cls: type,
    kwargs: dict[str, Any],
    dtype: torch.dtype,
    fast: bool,
) -> dict[str, Any]:
    """Three steps of a sharded MLP with ``cls(**kwargs)``; what the comparisons need."""
    fsdp2.set_optimizer_fast_path(fast)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)
    ).to(device=device, dtype=dtype)
    fsdp2.fully_shard(model[0], mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    initial = [p.to_local().detach().clone() for p in params]
    optimizer = cls(params, **kwargs)
    grads, dispatches = [], 0
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        x = torch.randn(4, 16, generator=gen).to(device=device, dtype=dtype)
        model(x).float().square().mean().backward()
        grads.append([p.grad.to_local().detach().clone() for p in params])
        counter = _DTensorOps()
        with counter:
            optimizer.step()
        dispatches += counter.count
        optimizer.zero_grad()
    return {
        "params": [p.to_local().detach() for p in params],
        "state": [_local_state(optimizer.state[p]) for p in params],
        "initial": initial,
        "grads": grads,
        "dispatches": dispatches,
    }


def _local_state(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.to_local() if hasattr(v, "to_local") else v for k, v in state.items()}


def _optim_replay(run: dict[str, Any], cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The same optimizer on plain tensors with the run's initial values and gradients."""
    params = [torch.nn.Parameter(t.clone()) for t in run["initial"]]
    optimizer = cls(params, **kwargs)
    for grads in run["grads"]:
        for param, grad in zip(params, grads):
            param.grad = grad
        optimizer.step()
    return {
        "params": [p.detach() for p in params],
        "state": [_local_state(optimizer.state[p]) for p in params],
    }


def _optim_mismatches(label: str, a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    bad = [
        f"{label}: param {i}"
        for i, (x, y) in enumerate(zip(a["params"], b["params"]))
        if not torch.equal(x, y)
    ]
    for i, (sa, sb) in enumerate(zip(a["state"], b["state"])):
        if sa.keys() != sb.keys():
            bad.append(f"{label}: state {i} keys {sorted(sa)} vs {sorted(sb)}")
            continue
        for key, value in sa.items():
            other = sb[key]
            same = (
                torch.equal(torch.as_tensor(value).cpu(), torch.as_tensor(other).cpu())
                if isinstance(value, torch.Tensor) or isinstance(other, torch.Tensor)
                else value == other
            )
            if not same:
                bad.append(f"{label}: state {i}/{key}")
    return bad


def optim_paths(device: torch.device) -> dict[str, Any]:
    backend = "nccl" if device.type == "cuda" else "gloo"
    ran: list[str] = []
    dtensor_path_raised: list[str] = []
    unsupported: list[str] = []  # both paths raise: the device has no such kernel
    bad: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=0, world_size=1)
        mesh = init_device_mesh(device.type, (1,))
        try:
            for label, cls, kwargs, dtype in _optim_cases(device):
                ran.append(label)
                try:
                    fast = _optim_run(device, mesh, cls, kwargs, dtype, fast=True)
                except (RuntimeError, ValueError) as error:
                    # The device may lack a kernel (a fused one): then torch's own path
                    # must refuse the same way, and so must a plain replay.
                    message = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
                    try:
                        _optim_run(device, mesh, cls, kwargs, dtype, fast=False)
                    except type(error):
                        unsupported.append(f"{label}: {message}")
                        continue
                    bad.append(f"{label}: the fast path raised {message}; torch's path runs")
                    continue
                if fast["dispatches"]:
                    bad.append(f"{label}: {fast['dispatches']} DTensor ops in step()")
                bad += _optim_mismatches(
                    f"{label} vs plain", fast, _optim_replay(fast, cls, kwargs)
                )
                try:
                    slow = _optim_run(device, mesh, cls, kwargs, dtype, fast=False)
                except (RuntimeError, NotImplementedError, AssertionError) as error:
                    # torch's DTensor path lacks some kernels (fused SGD/Adagrad, Rprop):
                    # the plain replay is the reference.
                    dtensor_path_raised.append(f"{label}: {str(error).splitlines()[0][:120]}")
                    continue
                bad += _optim_mismatches(f"{label} vs DTensor path", fast, slow)
        finally:
            fsdp2.set_optimizer_fast_path(True)
            dist.destroy_process_group()
    return {
        "cases": ran,
        "mismatches": bad,
        "dtensor_path_raised": dtensor_path_raised,
        "unsupported": unsupported,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--phase", choices=("one-rank", "fake-4", "optim"), required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    phases = {"one-rank": one_rank, "fake-4": fake_four, "optim": optim_paths}
    result = phases[args.phase](device)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
