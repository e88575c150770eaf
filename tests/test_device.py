"""The same training checks on the CPU and, when a GPU is visible, on CUDA (NCCL).

Each case runs ``tests/_device_checks.py`` in a fresh process (see its docstring for what
the phases do). On the CPU the streams are absent and ordering comes from gloo's work
handles, so the CUDA cases are the ones that can catch a missing stream wait or a buffer
freed while another stream still uses it; the CPU cases keep the script itself working.

If a CUDA case fails and its CPU twin passes, suspect stream ordering first (an
all-gather that does not wait for the optimizer, a buffer released without its event);
if both fail, suspect the script or the shared training path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_device_checks.py")
TOL = 1e-5

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


def _run(device: str, phase: str) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        [sys.executable, SCRIPT, "--device", device, "--phase", phase],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert done.returncode == 0, f"{phase} on {device} failed:\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("device", DEVICES)
def test_one_rank_training(device: str) -> None:
    report = _run(device, "one-rank")
    assert report["fp32_fsdp2_vs_plain"] <= TOL, report
    assert report["fp32_torch_vs_plain"] <= TOL, report
    assert report["fp32_fsdp2_vs_torch"] <= TOL, report
    # Same casts, same kernels, one rank: the bf16 runs agree with torch to the bit.
    assert report["bf16_fsdp2_vs_torch"] == 0.0, report
    # CPU offload trains with shards, gradients and a full state dict in CPU memory;
    # moving the shards to an accelerator raises at the next forward (as torch), on the
    # CPU nothing moves.
    offload = report["offload"]
    assert "error" not in offload, offload
    assert offload["grad_diff"] <= TOL, offload
    assert offload["devices"] == ["cpu"], offload
    assert offload["full_state_dict"] == ["cpu"], offload
    assert offload["moved_to_device"] == ("raised" if device == "cuda" else "ran"), offload
    if device == "cuda":
        for key in ("fp32", "bf16"):
            # No memory kept across steps: once every model has its optimizer state (from
            # the second step on), the allocated total after each fsdp2 step is the same.
            allocated = report[f"{key}_allocated_per_step"]["fsdp2"]
            assert len(set(allocated[1:])) == 1, (key, allocated)
            # Peak growth within a step at most torch's; 1% for the caching allocator's
            # block rounding, far below one extra buffer of a group.
            peaks = report[f"{key}_step_peak_bytes"]
            assert peaks["fsdp2"] <= 1.01 * peaks["torch"], (key, peaks)


@pytest.mark.parametrize("device", DEVICES)
def test_fake_four_ranks_run_on_the_device(device: str) -> None:
    report = _run(device, "fake-4")
    assert report["loss_finite"], report
    steps, groups = report["steps"], report["groups"]
    # Root kept unsharded after forward: every block gathers twice, the root once.
    assert report["counts"]["all_gather"] == steps * (2 * (groups - 1) + 1), report
    assert report["counts"]["reduce_scatter"] == steps * groups, report


@pytest.mark.parametrize("device", DEVICES)
def test_optimizer_fast_path_on_the_device(device: str) -> None:
    """The fast path with the device's own kernels: CUDA's multi-tensor and fused
    kernels and ``capturable=True`` run only there."""
    report = _run(device, "optim")
    assert report["mismatches"] == [], report["mismatches"][:10]
    capturable = [case for case in report["cases"] if "capturable" in case]
    # 11 optimizers x (for-loop, foreach), fused for 4, 2 bf16 cases; capturable on CUDA.
    assert len(report["cases"]) - len(capturable) == 28, report["cases"]
    assert bool(capturable) == (device == "cuda"), report["cases"]
    # Cases the device has no kernel for (both paths raise): none on the CPU.
    assert device == "cuda" or report["unsupported"] == [], report["unsupported"]
