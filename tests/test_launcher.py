"""Tests of the multi-process launcher (tests/_launcher.py) that every multi-rank test uses.

If these fail, nothing else in the suite is trustworthy: fix the launcher first. Look at the
first failing test's message; it quotes each rank's traceback and stdout/stderr. A failure
in ``test_results_per_rank`` usually means the gloo rendezvous cannot start (sandbox
networking, ``GLOO_SOCKET_IFNAME``, temp dir permissions).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import _launcher
import pytest
import torch
import torch.distributed as dist
from _launcher import RankDiedError, RankError, RankTimeoutError, run_ranks

# ----------------------------------------------------------------------------- rank fns


def _identity(tag: str, *, scale: int = 1) -> dict:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "sum": t.item() * scale,
        "tag": tag,
        "pid": os.getpid(),
        "threads": torch.get_num_threads(),
        "rand": torch.rand(1).item(),
    }


def _raise_on_rank(bad_rank: int) -> int:
    print(f"hello from rank {dist.get_rank()}")
    if dist.get_rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    return dist.get_rank()


def _raise_before_collective(bad_rank: int) -> None:
    if dist.get_rank() == bad_rank:
        raise KeyError("left the others waiting")
    dist.barrier()


def _skip_collective(lonely_rank: int) -> None:
    # Every rank except `lonely_rank` skips the collective: `lonely_rank` hangs in it.
    if dist.get_rank() == lonely_rank:
        dist.all_reduce(torch.ones(1))


def _sleep_on_rank(rank: int, seconds: float) -> None:
    if dist.get_rank() == rank:
        time.sleep(seconds)


def _exit_on_rank(rank: int) -> None:
    if dist.get_rank() == rank:
        os._exit(7)
    dist.barrier()


def _crash_on_rank(rank: int, marker: str, times: int) -> int:
    """Segfault on ``rank`` the first ``times`` calls (counted in the file ``marker``)."""
    if dist.get_rank() == rank:
        calls = len(Path(marker).read_text()) if os.path.exists(marker) else 0
        Path(marker).write_text("x" * (calls + 1))
        if calls < times:
            os.kill(os.getpid(), signal.SIGSEGV)
    dist.barrier()
    return dist.get_rank()


def _unpicklable_result() -> object:
    return lambda: None


def _leak_state() -> None:
    dist.all_reduce = None  # a test that forgets to undo its monkeypatch
    torch.manual_seed(1234)
    torch.set_grad_enabled(False)


def _backward_and_parent() -> tuple[float, int]:
    x = torch.ones(3, requires_grad=True)
    (x * 2).sum().backward()
    assert x.grad is not None
    return x.grad.sum().item(), os.getppid()


def _make_groups(count: int) -> tuple[int, int]:
    from torch.distributed import distributed_c10d

    for _ in range(count):
        dist.new_group(list(range(dist.get_world_size())))
    return os.getpid(), len(distributed_c10d._world.pg_map)


def _check_state_reset() -> tuple:
    return (callable(dist.all_reduce), torch.is_grad_enabled(), torch.rand(1).item())


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_results_per_rank(world_size: int) -> None:
    results = run_ranks(_identity, world_size, "x", scale=2)
    assert [r["rank"] for r in results] == list(range(world_size))
    expected_sum = 2.0 * world_size * (world_size + 1) / 2
    for r in results:
        assert r["world_size"] == world_size
        assert r["sum"] == expected_sum
        assert r["tag"] == "x"
        assert r["threads"] == 1
    assert len({r["pid"] for r in results}) == world_size
    assert os.getpid() not in {r["pid"] for r in results}
    # Seeded identically before each task.
    assert len({r["rand"] for r in results}) == 1
    torch.manual_seed(0)
    assert results[0]["rand"] == torch.rand(1).item()


def test_pool_is_reused() -> None:
    first = run_ranks(_identity, 2, "a")
    second = run_ranks(_identity, 2, "b")
    assert [r["pid"] for r in first] == [r["pid"] for r in second]


def test_exception_on_one_rank_is_reported() -> None:
    with pytest.raises(RankError) as info:
        run_ranks(_raise_on_rank, 3, 1)
    msg = str(info.value)
    assert info.value.failed_ranks == [1]
    assert "rank 1 raised ValueError: deliberate failure on rank 1" in msg
    assert "Traceback (most recent call last)" in msg
    assert "_raise_on_rank" in msg  # the remote frame is in the traceback
    assert "hello from rank 1" in msg  # captured rank output
    assert "rank 0 raised" not in msg and "rank 2 raised" not in msg
    assert isinstance(info.value.exceptions[1], ValueError)
    # The pool was rebuilt: the next call works.
    assert [r["rank"] for r in run_ranks(_identity, 3, "after")] == [0, 1, 2]


def test_exception_while_others_wait_in_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_launcher, "FAILURE_GRACE", 1.0)
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(_raise_before_collective, 2, 0, timeout=60)
    # Reported after the short failure grace period, not after the 60 s timeout.
    assert time.monotonic() - start < 30
    msg = str(info.value)
    assert info.value.failed_ranks == [0]
    assert "rank 0 raised KeyError" in msg
    assert "left the others waiting" in msg
    assert len(run_ranks(_identity, 2, "after")) == 2


def test_hang_times_out_and_pool_recovers() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        run_ranks(_skip_collective, 2, 1, timeout=3)
    elapsed = time.monotonic() - start
    assert elapsed < 20, elapsed
    assert isinstance(info.value, RankTimeoutError)
    assert info.value.ranks == [1]
    msg = str(info.value)
    assert "rank(s) [1] did not finish within 3 s" in msg
    assert "_skip_collective" in msg  # the hung rank's stack was dumped
    results = run_ranks(_identity, 2, "after")
    assert [r["rank"] for r in results] == [0, 1]


def test_slow_rank_times_out() -> None:
    with pytest.raises(RankTimeoutError) as info:
        run_ranks(_sleep_on_rank, 3, 2, 60.0, timeout=2)
    assert info.value.ranks == [2]
    assert len(run_ranks(_identity, 3, "after")) == 3


def test_dead_rank_is_reported() -> None:
    start = time.monotonic()
    with pytest.raises(RankDiedError) as info:
        run_ranks(_exit_on_rank, 2, 1, timeout=60)
    assert time.monotonic() - start < 30
    # Rank 1 died; rank 0 either errors out of the barrier or is killed after the grace.
    assert 1 in info.value.failed_ranks
    assert "rank 1 died (exit code 7)" in str(info.value)
    assert len(run_ranks(_identity, 2, "after")) == 2


@pytest.mark.skipif(not _launcher.RETRY_NATIVE_CRASHES, reason="FSDP2_TESTS_RETRY_CRASHES=0")
def test_native_crash_runs_the_task_once_more(tmp_path: Path) -> None:
    """A rank that crashes in native code (a segfault here) gets one more run on a fresh
    pool, with a warning quoting the crash; a second crash fails the test."""
    once = str(tmp_path / "once")
    with pytest.warns(
        _launcher.NativeCrashRetried, match=r"rank 1 died \(killed by signal SIGSEGV"
    ):
        assert run_ranks(_crash_on_rank, 2, 1, once, 1, timeout=60) == [0, 1]
    assert Path(once).read_text() == "xx"
    twice = str(tmp_path / "twice")
    with pytest.warns(_launcher.NativeCrashRetried), pytest.raises(RankDiedError) as info:
        run_ranks(_crash_on_rank, 2, 1, twice, 2, timeout=60)
    assert info.value.signals == {1: signal.SIGSEGV}
    assert Path(twice).read_text() == "xx"
    assert len(run_ranks(_identity, 2, "after")) == 2


def test_unpicklable_result_is_an_error() -> None:
    with pytest.raises(RankError, match=r"rank 0 raised TypeError.*not picklable"):
        run_ranks(_unpicklable_result, 1)


def test_local_function_rejected() -> None:
    def local() -> None:
        pass

    with pytest.raises(TypeError, match="module-level"):
        run_ranks(local, 1)


def test_state_is_reset_between_tasks() -> None:
    run_ranks(_leak_state, 2)
    results = run_ranks(_check_state_reset, 2)
    torch.manual_seed(0)
    expected = torch.rand(1).item()
    assert results == [(True, True, expected)] * 2


def test_workers_holding_many_groups_are_replaced() -> None:
    """Device meshes make new process groups in every task and nothing destroys them;
    a worker that holds more than ``MAX_LIVE_GROUPS`` (each with its gloo threads and
    sockets) is replaced after the task, so resources stay bounded over the suite."""
    _launcher.shutdown_pools()
    few = _launcher.MAX_LIVE_GROUPS // 2
    first = run_ranks(_make_groups, 2, few)
    kept = run_ranks(_make_groups, 2, few)  # now over the limit: replaced afterwards
    fresh = run_ranks(_make_groups, 2, 0)
    assert [pid for pid, _ in kept] == [pid for pid, _ in first]
    assert [n for _, n in kept] == [1 + 2 * few] * 2
    assert not {pid for pid, _ in fresh} & {pid for pid, _ in kept}
    assert [n for _, n in fresh] == [1, 1]


@pytest.mark.skipif(
    "FSDP2_TESTS_START_METHOD" in os.environ, reason="tests the default start method"
)
def test_pools_start_clean_after_autograd_in_this_process() -> None:
    """Ranks forked from a process whose autograd engine runs worker threads cannot run
    backward (torch raises "Unable to handle autograd's threading in combination with
    fork-based multiprocessing"). With CUDA builds of torch 2.14 a DTensor backward in the
    test process (the fake-process-group tests) starts those threads, and every pool made
    afterwards failed every test. Pools come from a fork server instead: not children of
    this process, and able to run backward whatever it ran before."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        weight = distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)]).requires_grad_()
        (weight * 2).full_tensor().sum().backward()
    finally:
        dist.destroy_process_group()
    _launcher.shutdown_pools()  # the next call starts a new pool, after that backward
    results = run_ranks(_backward_and_parent, 2)
    assert [grad for grad, _ in results] == [6.0, 6.0]
    assert all(parent != os.getpid() for _, parent in results)


_CHILD_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {tests_dir!r})
    import _launcher
    _launcher.PRELOAD_MODULES = []  # keep this child fast
    import test_launcher
    from _launcher import run_ranks
    pids = [r["pid"] for ws in (1, 2) for r in run_ranks(test_launcher._identity, ws, "c")]
    print(" ".join(map(str, pids)), flush=True)
    if {how!r} == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)  # no atexit, no cleanup at all
    """
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "State:\tZ" not in f.read()
    except FileNotFoundError:
        return False
    except OSError:
        return True


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")
@pytest.mark.parametrize("how", ["normal_exit", "sigkill"])
def test_workers_exit_with_parent(how: str, tmp_path: Path) -> None:
    script = _CHILD_SCRIPT.format(tests_dir=os.path.dirname(os.path.abspath(__file__)), how=how)
    # A SIGKILLed parent cannot remove its pools' rendezvous folders: keep them in tmp_path.
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    lines = proc.stdout.split()
    assert len(lines) == 3, (proc.returncode, proc.stdout, proc.stderr)
    pids = [int(p) for p in lines]
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    leftover = [p for p in pids if _alive(p)]
    for p in leftover:  # do not leak them even if the test fails
        os.kill(p, 9)
    assert not leftover, f"rank processes {leftover} outlived their parent ({how})"
