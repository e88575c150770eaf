"""Ranks that run different paths through the sharded modules, with fsdp2's divergence
checks (on by default): every rank raises, naming where each rank was (group, phase,
sequence), before anything computed from mixed data is applied; and the happy path is
unchanged by the checks. See [Note: in-band fingerprints] in ``fsdp2/_fingerprints.py``
and [Note: named timeouts] in ``fsdp2/_divergence.py``; docs/divergence.md.

Each divergent run uses process groups of its own with a timeout of a few seconds (a
rank left waiting raises then, not after the launcher's ten minutes) and a short
``FSDP2_DIVERGENCE_REPORT_TIMEOUT``. Rank functions catch their error and return it, so
a rank that did not raise shows up as a wrong message, not as a timeout. When a test
fails, look first at the ``error`` of each rank in the assertion message.

Without the checks, the equal-size runs here finish without an error after mixing two
modules' parameters, and the others hang until the process group's timeout with gloo's
message naming no module (or abort a rank).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import os
import time
import warnings
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import _launcher
import pytest
import torch
import torch.distributed as dist
from _helpers import divergence_checks
from _launcher import RankDiedError, run_ranks
from _stream_sanitizer import stream_sanitizer
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import fsdp2
import fsdp2._divergence as divergence
import fsdp2._fingerprints as fingerprints
from benchmarks.comm import CollectiveCounter

PG_TIMEOUT = 4.0  # seconds: the process groups of the divergent runs
REPORT_TIMEOUT = "2"  # seconds a rank waits for the others' reports


class Blocks(nn.Module):
    """Four blocks; ``wide`` makes that one larger (its all-gather another size)."""

    def __init__(self, wide: int = -1) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 24), nn.Linear(24, 8)) if i == wide else nn.Linear(8, 8)
            for i in range(4)
        )

    def forward(
        self, x: torch.Tensor, skip: int = -1, detach: int = -1, order: tuple[int, ...] = ()
    ) -> torch.Tensor:
        for i in order or range(len(self.blocks)):
            block = self.blocks[i]
            if i == skip:
                continue
            y = torch.relu(block(x))
            x = x + (y.detach() if i == detach else y)
        return x.sum()


def _mesh(hsdp: bool) -> DeviceMesh:
    """A mesh over every rank on process groups of its own, with ``PG_TIMEOUT``: 1-D, or
    2 replicas x ``world_size / 2`` shards."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    timeout = timedelta(seconds=PG_TIMEOUT)
    if not hsdp:
        return DeviceMesh.from_group(dist.new_group(list(range(ws)), timeout=timeout), "cpu")
    shard = ws // 2
    shards = [
        dist.new_group([r * shard + i for i in range(shard)], timeout=timeout) for r in (0, 1)
    ]
    replicas = [dist.new_group([i, shard + i], timeout=timeout) for i in range(shard)]
    return DeviceMesh.from_group(
        [replicas[rank % shard], shards[rank // shard]],
        "cpu",
        mesh=torch.arange(ws).view(2, shard),
        mesh_dim_names=("replicate", "shard"),
    )


@contextlib.contextmanager
def _short_reports() -> Iterator[None]:
    before = os.environ.get(divergence.REPORT_TIMEOUT_ENV_VAR)
    os.environ[divergence.REPORT_TIMEOUT_ENV_VAR] = REPORT_TIMEOUT
    divergence.forget_issued()  # the rank processes serve many tests
    # An earlier test's model left mid-step (reductions on its broken process group in
    # flight) must not be finished by this test's optimizer step: free it first.
    gc.collect()
    fingerprints.discard_pending()  # (the accelerator path's, from a step that failed)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(divergence.REPORT_TIMEOUT_ENV_VAR, None)
        else:
            os.environ[divergence.REPORT_TIMEOUT_ENV_VAR] = before


def _sharded(hsdp: bool = False, wide: int = -1) -> tuple[Blocks, torch.optim.Optimizer]:
    mesh = _mesh(hsdp)
    torch.manual_seed(0)
    model = Blocks(wide)
    for block in model.blocks:
        fsdp2.fully_shard(block, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _message(error: BaseException) -> str:
    notes = "".join(f"\n{note}" for note in getattr(error, "__notes__", []))
    return f"{type(error).__name__}: {error}{notes}"


def diverge(
    kind: str, hsdp: bool = False, wide: int = -1, diverging: tuple[int, ...] = (1,)
) -> dict[str, Any]:
    """Rank function: one step on the same path everywhere, then one in which the ranks in
    ``diverging`` do ``kind`` ("skip": leave ``blocks.2`` out of the forward; "detach":
    leave it out of backward; "unshard": call ``blocks.1.unshard()`` first). Returns the
    error, whether every local shard is as before the second step, and how long it took."""
    with _short_reports():
        model, optim = _sharded(hsdp, wide)
        model(torch.randn(2, 8)).backward()
        optim.step()
        optim.zero_grad()
        params = list(model.parameters())  # the sharded DTensors (a failed step may
        before = [p.to_local().clone() for p in params]  # leave others registered)
        mine = dist.get_rank() in diverging
        start = time.monotonic()
        try:
            if mine and kind == "unshard":
                model.blocks[1].unshard()
            forward = {"skip": {"skip": 2}, "detach": {"detach": 2}}.get(kind, {}) if mine else {}
            model(torch.randn(2, 8), **forward).backward()
            optim.step()
            error = "no error"
        except RuntimeError as raised:
            error = _message(raised)
        seconds = time.monotonic() - start
        unchanged = all(torch.equal(a, p.to_local()) for a, p in zip(before, params))
        return {"error": error, "unchanged": unchanged, "seconds": seconds}


def _check_every_rank(results: list[dict[str, Any]], *expected: str) -> None:
    for rank, result in enumerate(results):
        error = result["error"]
        assert result["unchanged"], f"rank {rank} updated parameters: {result}"
        assert error.startswith(("DivergenceError", "RuntimeError", "DistBackendError")), (
            rank,
            error,
        )
        for text in expected:
            assert text in error, f"rank {rank}: {text!r} not in:\n{error}"
        assert "What to do: run every sharded module's forward and backward" in error, error
        assert result["seconds"] < PG_TIMEOUT + 4 * float(REPORT_TIMEOUT), result


@pytest.mark.parametrize("ws", [2, 4])
def test_module_skipped_with_equal_sizes(ws: int) -> None:
    """Rank 1 skips ``blocks.2`` (equal sizes everywhere): its all-gather of another block
    pairs with the others' all-gather of ``blocks.2``, which without the checks mixes the
    two blocks' parameters silently. Every rank sees every rank's tail and raises at
    once, listing them."""
    results = run_ranks(diverge, ws, "skip", timeout=60)
    _check_every_rank(
        results,
        "DivergenceError: fully_shard: the ranks paired up different collectives",
        "rank 0: blocks.2 (Linear), backward, sequence ",
        "rank 1: blocks.1 (Linear), backward, sequence ",
        "different paths through the sharded modules",
    )
    for result in results:  # found in-band, no timeout needed
        assert result["error"].startswith("DivergenceError"), result["error"]
        assert result["seconds"] < PG_TIMEOUT, result


def diverge_and_raise(kind: str, wide: int) -> None:
    """Rank function for runs in which gloo aborts a rank: each survivor raises its error
    (with the notes in the message, so that the launcher reports them)."""
    result = diverge(kind, wide=wide)
    raise RuntimeError(
        f"unchanged={result['unchanged']} seconds={result['seconds']:.1f}\n{result['error']}"
    )


@pytest.mark.parametrize("ws", [2, 4])
def test_module_skipped_with_unequal_sizes(ws: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 skips the wide ``blocks.2``: its all-gather of ``blocks.3`` pairs with the
    others' larger one, and gloo aborts the rank that receives a message larger than it
    expects (``SIGABRT`` in gloo, before anything fsdp2 could check). Every other rank
    raises promptly (its collective failed as the peer vanished, or a peer reported),
    naming where each rank was and the one that did not report, and nothing is updated."""
    monkeypatch.setattr(_launcher, "RETRY_NATIVE_CRASHES", False)  # the abort is expected
    with pytest.raises(RankDiedError) as died:
        run_ranks(diverge_and_raise, ws, "skip", 2, timeout=60)
    crash = died.value
    assert set(crash.signals.values()) == {6}, crash  # SIGABRT, from gloo
    dead = set(crash.signals)
    survivors = set(range(ws)) - dead
    assert survivors and set(crash.remote) == survivors, crash
    for rank in survivors:
        _, text, _ = crash.remote[rank]
        assert text.startswith("unchanged=True"), text
        assert "was, with its last fsdp2 collectives" in text, text
        for gone in dead:
            assert f"rank {gone}: did not report" in text, text
        assert f"rank {rank}: " in text and ", sequence " in text, text
        seconds = float(text.split("seconds=")[1].split()[0])
        assert seconds < PG_TIMEOUT + 3 * float(REPORT_TIMEOUT), text


@pytest.mark.parametrize("ws", [2, 4])
def test_rank_skips_backward_for_one_group(ws: int) -> None:
    """Rank 1's loss does not reach ``blocks.2``: its backward neither gathers nor reduces
    that block, so its collectives pair with other kinds on the other ranks and gloo
    waits until the process group's timeout. Every rank then raises with every rank's
    report instead of gloo's bare timeout."""
    results = run_ranks(diverge, ws, "detach", timeout=60)
    _check_every_rank(
        results, "was, with its last fsdp2 collectives", "blocks.2 (Linear) (backward, sequence "
    )
    for rank, result in enumerate(results):
        error = result["error"]
        # Its own collective timed out, or (a rank whose collective could still complete)
        # it stopped waiting when another rank reported.
        assert (
            "when the collective failed" in error
            or "another rank of the process group reported" in error
        ), error
        for other in range(ws):
            assert f"  rank {other}: " in error, (rank, error)


@pytest.mark.parametrize("ws", [2, 4])
def test_extra_unshard_on_one_rank(ws: int) -> None:
    """Rank 1 calls ``blocks[1].unshard()`` before the forward; the others do not: its
    extra all-gather meets the others' forward all-gather of ``blocks.0``."""
    results = run_ranks(diverge, ws, "unshard", timeout=60)
    _check_every_rank(
        results,
        "DivergenceError: fully_shard: the ranks paired up different collectives",
        "rank 1: blocks.1 (Linear), unshard(), sequence ",
        "rank 0: blocks.0 (Linear), forward, sequence ",
    )


@pytest.mark.parametrize("ws", [2, 4])
def test_one_hsdp_replica_diverges(ws: int) -> None:
    """HSDP (2 replicas): every rank of replica 1 skips ``blocks.2``. The ranks of each
    replica agree with each other, so the all-gathers and reduce-scatters within a
    replica pass; the all-reduce over replicas pairs different blocks, and its
    fingerprint block (a sum) shows it on both sides of every pair."""
    shard = ws // 2
    replica_1 = tuple(range(shard, ws))
    results = run_ranks(diverge, ws, "skip", True, -1, replica_1, timeout=60)
    _check_every_rank(
        results,
        "DivergenceError: fully_shard: the ranks paired up different collectives",
        "all-reduce of the gradients of blocks.",
        "reduction's fingerprints differ",
    )
    for rank, result in enumerate(results):
        partner = (rank + shard) % ws
        assert f"  rank {partner}: its reduction's fingerprints differ" in result["error"], result


def recover(kind: str) -> dict[str, Any]:
    """Rank function: a divergent step (as ``diverge``), then what a job that caught the
    error may do next. The failed step left collectives in flight on a process group whose
    ranks are out of step: they must be dropped, not waited for."""
    with _short_reports():
        model, optim = _sharded()
        model(torch.randn(2, 8)).backward()
        optim.step()
        optim.zero_grad()
        forward = {"skip": {"skip": 2}, "detach": {"detach": 2}}[kind]
        try:
            model(torch.randn(2, 8), **(forward if dist.get_rank() == 1 else {})).backward()
            optim.step()
            return {"first": "no error"}
        except RuntimeError as raised:
            first = _message(raised)
        params = list(model.parameters())
        before = [p.to_local().clone() for p in params]
        start = time.monotonic()
        try:  # the same model's step again, without a reset
            optim.step()
            again = "no error"
        except RuntimeError as raised:
            again = str(raised)
        unchanged = all(torch.equal(a, p.to_local()) for a, p in zip(before, params))
        # Another model, on the default process group: its step finishes every context's
        # reductions, which must not wait for the failed ones.
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        other = nn.Linear(8, 8)
        fsdp2.fully_shard(other, mesh=mesh)
        other_optim = torch.optim.SGD(other.parameters(), lr=0.1)
        other(torch.randn(2, 8)).sum().backward()
        other_optim.step()
        full = [p.full_tensor() for p in other.parameters()]
        model.reset_iter_state()
        optim.zero_grad()
        optim.step()  # allowed again after the reset (nothing to apply)
        return {
            "first": first,
            "again": again,
            "unchanged": unchanged,
            "full": all(t.isfinite().all() for t in full),
            "seconds": time.monotonic() - start,
        }


@pytest.mark.parametrize("kind", ["skip", "detach"])
def test_after_a_divergence_nothing_waits_for_the_failed_step(kind: str) -> None:
    """After the error, the failed model's optimizer step refuses (the dropped reductions
    left its gradients partial) and changes nothing; another model trains and its
    parameters gather at once; ``reset_iter_state`` returns at once and re-allows the
    step. Without dropping the failed step's collectives, each of these waited for the
    process group's timeout and raised the old error again."""
    for rank, result in enumerate(run_ranks(recover, 4, kind, timeout=90)):
        assert result["first"].startswith(("DivergenceError", "RuntimeError")), result
        assert "after their model's step failed" in result["again"], (rank, result)
        assert "Call reset_iter_state() on the model's root" in result["again"], result
        assert result["unchanged"] and result["full"], result
        assert result["seconds"] < PG_TIMEOUT, result


# -- the happy path ------------------------------------------------------------------------


def _config_model(config: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    ws = dist.get_world_size()
    hsdp = config.startswith("hsdp")
    shape, names = ((2, ws // 2), ("replicate", "shard")) if hsdp else ((ws,), None)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(0)
    model = Blocks(wide=1)
    kwargs: dict[str, Any] = {"mesh": mesh}
    if "raf2" in config:
        kwargs["reshard_after_forward"] = 2
    if "bf16" in config:
        kwargs["mp_policy"] = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    if "policy" in config:
        kwargs["reduce_policy"] = fsdp2.ReducePolicy(
            comm_dtype=torch.bfloat16, accumulate_dtype=torch.float32
        )
    for block in model.blocks:
        fsdp2.fully_shard(block, **kwargs)
    fsdp2.fully_shard(model, **kwargs)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def train_on_and_off(config: str) -> dict[str, Any]:
    """Rank function: the same three steps (two microbatches each, HSDP ones without the
    all-reduce in the first) with the checks on and off."""
    runs = {}
    for enabled in (True, False):
        with divergence_checks(enabled):
            model, optim = _config_model(config)
            torch.manual_seed(dist.get_rank())
            with CollectiveCounter() as counter:
                for _ in range(3):
                    for micro in range(2):
                        if config.startswith("hsdp"):
                            model.set_requires_all_reduce(micro == 1)
                        model(torch.randn(2, 8)).backward()
                    optim.step()
                    optim.zero_grad()
            counts = collections.Counter(call["api"] for call in counter.calls)
            runs[enabled] = ([p.to_local().clone() for p in model.parameters()], dict(counts))
    (on, on_counts), (off, off_counts) = runs[True], runs[False]
    return {
        "equal": all(torch.equal(a, b) for a, b in zip(on, off, strict=True)),
        "on": on_counts,
        "off": off_counts,
    }


@pytest.mark.parametrize("config", ["fsdp", "fsdp-raf2-bf16", "hsdp", "hsdp-policy", "fsdp-policy"])
def test_checks_change_neither_results_nor_collectives(config: str) -> None:
    """With the checks on, training gives bitwise the parameters of the same run without
    them, and issues the same collectives: the fingerprints ride in the messages."""
    for result in run_ranks(train_on_and_off, 4, config, timeout=90):
        assert result["equal"], result
        assert result["on"] == result["off"], result
        assert sum(result["on"].values()) > 0


# -- the accelerator path, on the CPU ----------------------------------------------------------


def lazily_checked(diverge_step: bool) -> dict[str, Any]:
    """Rank function: fsdp2's CUDA code path under the stream sanitizer (stand-in
    streams and events, a device that passes no event while steps run): the fingerprints
    are read back behind each collective, checked only where the host already waits, and
    settled before the optimizer step."""
    with _short_reports(), stream_sanitizer() as sanitizer:
        sanitizer.device_caught_up = False
        model, optim = _sharded()
        params = list(model.parameters())
        waits_before = fingerprints.host_waits
        error = "no error"
        for step in range(3):
            # Rank 1 runs blocks.3 before blocks.2: every collective meets one of the same
            # kind and size, so nothing fails and only the fingerprints can tell.
            swap = diverge_step and step == 2 and dist.get_rank() == 1
            before = [p.to_local().clone() for p in params]
            try:
                model(torch.randn(2, 8), order=(0, 1, 3, 2) if swap else ()).backward()
                pending_after_backward = len(fingerprints.pending_checks)
                optim.step()
            except RuntimeError as raised:
                error = _message(raised)
                break
            optim.zero_grad()
        unchanged = all(torch.equal(a, p.to_local()) for a, p in zip(before, params))
        return {
            "error": error,
            "races": list(sanitizer.races),
            "pending_after_backward": pending_after_backward if error == "no error" else -1,
            "host_waits": fingerprints.host_waits - waits_before,
            "left": len(fingerprints.pending_checks),
            "unchanged": unchanged,
        }


def test_accelerator_path_checks_lazily_and_before_the_step() -> None:
    """On the accelerator path nothing is checked while the device lags: the checks wait
    in the queue through backward, the optimizer step's pre-hook reads them with one wait
    per communication stream, and no stream race is introduced."""
    for result in run_ranks(lazily_checked, 2, False, timeout=60):
        assert result["error"] == "no error", result
        assert result["races"] == [], result["races"]
        assert result["pending_after_backward"] > 0, result
        assert result["left"] == 0, result
        assert 0 < result["host_waits"] <= 3 * 2, result  # steps x (all-gather, reduce-scatter)


def test_accelerator_path_raises_before_the_optimizer_applies_mixed_data() -> None:
    """A divergence in the third step on the accelerator path (rank 1 runs two blocks in
    the other order: equal sizes throughout, so the collectives all complete and mix the
    blocks): backward finishes (the device has not passed the events), the step's
    pre-hook reads the fingerprints and raises on every rank, and the optimizer changes
    nothing."""
    for result in run_ranks(lazily_checked, 2, True, timeout=60):
        assert result["error"].startswith("DivergenceError"), result
        assert "paired up different collectives" in result["error"], result
        assert result["unchanged"], result
        assert result["races"] == [], result["races"]


# -- the switch and bad input ------------------------------------------------------------------


def test_switch_validates_and_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TypeError, match=r"set_divergence_checks expects a bool, got int"):
        fsdp2.set_divergence_checks(1)  # type: ignore[arg-type]
    monkeypatch.setenv(divergence.ENV_VAR, "sometimes")
    with pytest.raises(ValueError, match=r"FSDP2_DIVERGENCE_CHECKS='sometimes': expected 1"):
        divergence._read_environment()
    monkeypatch.setenv(divergence.ENV_VAR, "0")
    assert divergence._read_environment() is False
    monkeypatch.setenv(divergence.REPORT_TIMEOUT_ENV_VAR, "-1")
    with pytest.raises(ValueError, match="FSDP2_DIVERGENCE_REPORT_TIMEOUT='-1'"):
        divergence.report_timeout()


class SwitchingBlock(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fsdp2.set_divergence_checks(not divergence.checks_enabled())
        return super().forward(x)


def switch_mid_step() -> str:
    with divergence_checks(True):
        mesh = _mesh(False)
        model = nn.Sequential(nn.Linear(8, 8), SwitchingBlock(8, 8))
        for layer in model:
            fsdp2.fully_shard(layer, mesh=mesh)
        fsdp2.fully_shard(model, mesh=mesh)
        try:
            model(torch.randn(2, 8)).sum().backward()
        except RuntimeError as error:
            return str(error)
        return "no error"


def test_switch_flipped_in_the_middle_of_a_step() -> None:
    for message in run_ranks(switch_mid_step, 2, timeout=60):
        assert "set_divergence_checks(False) was called in the middle of a step" in message
        assert "is in a forward" in message
        assert "Switch between steps, on every rank" in message


class RegisteredSizesAllGather:
    """A custom all-gather whose buffers come from memory registered for the sizes of the
    model's all-gathers without fingerprints (as a pool of symmetric memory could be):
    any other size is refused."""

    def __init__(self, sizes: set[int]) -> None:
        self.sizes = sizes

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if size[0] not in self.sizes:
            raise ValueError(f"no registered buffer of {size[0]} elements")
        return torch.empty(size[0], dtype=dtype, device=device)

    def __call__(
        self, output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool = False
    ) -> Any:
        return dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)


def custom_all_gather_without_room() -> dict[str, Any]:
    with _short_reports(), divergence_checks(True), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, optim = _sharded()
        model.blocks[1].set_custom_all_gather(RegisteredSizesAllGather({2 * 36}))
        for _ in range(2):
            model(torch.randn(2, 8)).backward()
            optim.step()
            optim.zero_grad()
        return {"warnings": [str(w.message) for w in caught if "divergence" in str(w.message)]}


def test_custom_all_gather_that_cannot_carry_fingerprints() -> None:
    """A custom all-gather whose buffers are not the size asked for: one warning that
    the checks are off for that group (its all-gathers run without tails)."""
    for result in run_ranks(custom_all_gather_without_room, 2, timeout=60):
        (message,) = result["warnings"]
        assert "blocks.1 (Linear): its custom all-gather (set_custom_all_gather)" in message
        assert "the checks are off for this group's all-gathers" in message


def lazy_init_without_store() -> str:
    real = dist.distributed_c10d._get_process_group_store

    def missing(group: Any) -> Any:
        raise KeyError(group)

    dist.distributed_c10d._get_process_group_store = missing
    try:
        model, _ = _sharded()
        model(torch.randn(2, 8))
    except RuntimeError as error:
        return str(error)
    finally:
        dist.distributed_c10d._get_process_group_store = real
    return "no error"


def test_process_group_without_a_store() -> None:
    for message in run_ranks(lazy_init_without_store, 2, timeout=60):
        assert "has no store" in message, message
        assert "blocks.0 (Linear)" in message, message
        assert "fsdp2.set_divergence_checks(False)" in message, message


def test_process_group_whose_work_cannot_wait_with_a_timeout() -> None:
    """torch's in-process ``threaded`` backend (two threads as two ranks; torch's own
    multi-threaded FSDP tests run on it) raises "wait() with finite timeout not
    implemented" from ``Work.wait(timeout)``. The watching wait must then wait on the
    work as a whole, as torch's ``fully_shard`` does; it raised that error from the
    first all-gather. Run in a fresh process: the backend changes process-wide state."""
    import json
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_threaded_pg.py")
    done = subprocess.run(
        [sys.executable, script], capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for rank, diff in results.items():
        assert isinstance(diff, float) and diff <= 1e-5, f"rank {rank}: {diff}"


# -- the encodings -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_reduction_blocks_cannot_cancel(dtype: torch.dtype) -> None:
    """Sums (and averages) of the blocks of ranks whose fingerprints differ never pass
    every rank's check, whatever the summation order; equal ones always do."""
    n = fingerprints.block_numel(dtype)
    assert n * dtype.itemsize == fingerprints.BLOCK_BYTES
    fps = [
        divergence.Fingerprint(g, divergence.Stage(s), q)
        for g in range(3)
        for s in range(3)
        for q in range(40)
    ]
    sets = {fingerprints.block_ones(fp, n) for fp in fps}
    assert all(len(ones) == n // 2 for ones in sets)
    generator = torch.Generator().manual_seed(0)
    for trial in range(200):
        ws = 2 + trial % 7
        picks = torch.randint(len(fps), (ws,), generator=generator).tolist()
        if trial % 3 == 0:
            picks = [picks[0]] * ws
        blocks = torch.stack(
            [fingerprints.block_tensor(fps[i], n, dtype, torch.device("cpu")) for i in picks]
        )
        order = torch.randperm(ws, generator=generator)
        total = blocks[order].sum(0, dtype=dtype) / (ws if trial % 2 else 1)
        agree = len({fingerprints.block_ones(fps[i], n) for i in picks}) == 1
        for i in picks:
            ones = set(fingerprints.block_ones(fps[i], n))
            passes = all(total[j].item() == 0 for j in range(n) if j not in ones)
            assert passes == agree, (dtype, picks)


def test_tails_round_trip_at_16_byte_boundaries() -> None:
    for dtype in (torch.uint8, torch.bfloat16, torch.float32, torch.float64):
        for numel in (1, 7, 16, 33):
            row = fingerprints.tailed_numel(numel, dtype)
            assert row * dtype.itemsize % 16 == 0 and row >= numel + 16 // dtype.itemsize
            assert (row - numel) * dtype.itemsize <= 31  # bytes added per rank
            buffer = torch.zeros(3 * row, dtype=dtype)
            fp = divergence.Fingerprint(5, divergence.Stage.UNSHARD, 123456789)
            unit = fingerprints.tail_numel(dtype)
            for r in range(3):
                fingerprints.write_tail(buffer[r * row + row - unit : (r + 1) * row], fp)
            tails = buffer.view(3, row)[:, row - unit :].view(torch.float64).tolist()
            assert tails == [[8.0 * (5 + 2) + 2, 123456789.0]] * 3


@pytest.mark.parametrize("ranks", [4, 32])
def test_checks_of_many_ranks_compare_in_one_op(
    ranks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Above a few ranks the tails and all-to-all blocks are compared in one torch op
    (reading 256 ranks' fingerprints into Python cost 80 us per all-gather); both paths
    pass equal fingerprints and name every rank whose fingerprint differs."""
    failures: list[str] = []
    monkeypatch.setattr(
        fingerprints, "raise_divergence", lambda _g, headline, *_a, **_k: failures.append(headline)
    )
    monkeypatch.setattr(fingerprints, "global_ranks", lambda _group: list(range(ranks)))
    mine = divergence.Fingerprint(3, divergence.Stage.FORWARD, 41)
    other = divergence.Fingerprint(3, divergence.Stage.FORWARD, 42)
    issued = divergence.Issued(mine, "all-gather of blocks.3 (Linear)", 0, time.time(), None)
    unit = fingerprints.tail_numel(torch.float32)
    for odd in (None, ranks - 1):
        slots = torch.zeros(ranks, 8 + unit)
        for r in range(ranks):
            fingerprints.write_tail(slots[r, 8:], other if r == odd else mine)
        tails = slots[:, 8:].view(torch.float64)
        fingerprints.GatheredTails(issued, tails, []).verify()
        n = fingerprints.block_numel(torch.float32)
        blocks = torch.stack(
            [
                fingerprints.block_tensor(
                    other if r == odd else mine, n, torch.float32, torch.device("cpu")
                )
                for r in range(ranks)
            ]
        )
        fingerprints.ExchangedBlocks(issued, blocks, []).verify()
    assert len(failures) == 2, failures  # the tails, then the blocks, of the odd rank only
    assert f"rank {ranks - 1}: group #3, forward, sequence 42" in failures[0], failures[0]
    assert f"the chunks from rank(s) {ranks - 1} carry another" in failures[1], failures[1]
