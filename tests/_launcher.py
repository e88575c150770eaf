"""Multi-process launcher for the test suite: ``run_ranks(fn, world_size, *args, **kwargs)``.

Every multi-rank test goes through :func:`run_ranks`. It runs ``fn(*args, **kwargs)`` on
``world_size`` real OS processes that share a gloo process group, and returns the list of
per-rank return values (rank order).

Design
------
* One *persistent pool* of worker processes per world size, started lazily on first use
  (``forkserver`` start method where available, ``spawn`` otherwise; see "Why not plain
  fork" below). Each worker sets
  ``torch.set_num_threads(1)``, joins a gloo process group through a fresh file-store
  rendezvous (``file://`` in a private temp dir, so no port races) once, then serves tasks
  forever. A parity test then costs well under a second instead of several seconds.
* ``fn`` is pickled *by reference*, so it must be a module-level function of an importable
  module (a test module or ``_helpers``); arguments and return values must be picklable.
* Before every task a worker resets global state that tests tend to leak: RNG seeds
  (``torch.manual_seed(0)``, ``random.seed(0)``), grad mode, default dtype, thread count,
  and any attribute of ``torch.distributed`` that a test monkeypatched and forgot to restore.
* Each task's stdout/stderr (Python *and* C level, via fd redirection) go to a per-task,
  per-rank log file. On failure they are included in the exception message.
* Failure handling:

  - a rank raises: once every rank has answered, or ``FAILURE_GRACE`` seconds after the first
    error (the others are then typically blocked in a collective the failed rank never
    reached), :class:`RankError` is raised with the failing rank(s), full remote
    traceback(s), and the captured output;
  - ranks do not finish within ``timeout``: the stuck ranks are asked to dump their Python
    stacks (``faulthandler`` on ``SIGUSR1``), killed, and :class:`RankTimeoutError`
    (a ``TimeoutError``) is raised naming them, with their stacks and output;
  - a rank process dies (segfault, ``os._exit``): :class:`RankDiedError` (a ``RankError``)
    with its exit code or signal, reported as soon as the others answer or after the grace.
    A death by a native-crash signal (segfault, abort, bus error) is first retried once
    on a fresh pool with a :class:`NativeCrashRetried` warning (``NATIVE_CRASH_SIGNALS``):
    torch's and gloo's native code crash very rarely on their own, and one such crash
    should not fail a CI run of hundreds of tests; a crash that recurs still fails.

  After *any* failure the pool of that world size is killed and rebuilt on next use, so a
  bad test cannot poison the following ones.
* Pools are preloaded: ``PRELOAD_MODULES`` (DTensor, FSDP, dynamo) are imported once in
  the fork server (or, with ``fork``, in the parent) before it forks the ranks, so the
  ranks do not each pay ~1 s of imports on first use. ``FSDP2_TESTS_START_METHOD=fork``
  or ``=spawn`` picks another start method.
* Why not plain ``fork``: a child forked from a process whose autograd engine has started
  its worker threads cannot run backward at all ("Unable to handle autograd's threading
  in combination with fork-based multiprocessing"). The pytest process runs models itself
  (fake-process-group tests), and with some torch builds (CUDA builds of torch 2.14 on a
  machine without a GPU, for one) a DTensor backward there starts those threads; every
  pool forked afterwards (a new world size, or one rebuilt after a failure) would then be
  unusable. The fork server is a fresh interpreter that never runs autograd, so its
  children are clean whatever the test process did before.
* Device meshes create process groups in every task, and nothing destroys them (torch's
  DTensor caches keep meshes across tasks, so their groups must stay valid). A worker that
  holds more than ``MAX_LIVE_GROUPS`` is replaced after its task, so the gloo threads and
  sockets each group keeps stay bounded over the suite.
* Workers are daemonic (a rank function cannot start its own ``multiprocessing`` children).
* Workers exit on their own if the pytest process dies (pipe EOF plus a ``getppid``
  watchdog thread), and all pools are shut down at interpreter exit (``atexit``) and at the
  end of the pytest session (see ``conftest.py``).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import importlib
import io
import multiprocessing
import multiprocessing.connection
import os
import pickle
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import types
import warnings
from datetime import timedelta
from typing import Any

__all__ = [
    "NativeCrashRetried",
    "RankDiedError",
    "RankError",
    "RankTimeoutError",
    "run_ranks",
    "shutdown_pools",
]

MAX_WORLD_SIZE = 8
# Seconds to wait for the remaining ranks once one rank has raised or died.
FAILURE_GRACE = 5.0
# Seconds allowed for starting a pool (process start + process-group rendezvous).
STARTUP_TIMEOUT = 120.0
# Modules imported in the parent before forking a pool, so the ranks do not each import
# them (in parallel, on few cores) during their first task. Extend it from conftest.py.
PRELOAD_MODULES: list[str] = [
    "torch.distributed.device_mesh",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch._dynamo",  # imported lazily by the optimizers / DTensor dispatch on first use
    "torch.utils.checkpoint",
]
# A worker holding more process groups than this is replaced after its task. Device
# meshes make new groups in every task and nothing destroys them (torch's DTensor caches
# hold meshes across tasks, so destroying their groups would break later tasks); each
# gloo group keeps its own threads and sockets, so a worker that served the whole suite
# held thousands of both. A fresh pool costs about a second.
MAX_LIVE_GROUPS = 64
# A task whose rank died of one of these signals (a crash in native code: torch, gloo) is
# run once more on a fresh pool, with a ``NativeCrashRetried`` warning that quotes the
# crash; a second crash fails the test. FSDP2_TESTS_RETRY_CRASHES=0 turns this off.
NATIVE_CRASH_SIGNALS = frozenset(
    getattr(signal, name)
    for name in ("SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGABRT")
    if hasattr(signal, name)
)
RETRY_NATIVE_CRASHES = os.environ.get("FSDP2_TESTS_RETRY_CRASHES", "1") != "0"
# Cap on the captured output quoted per rank in an error message (the tail is kept).
MAX_LOG_CHARS = 20_000


class RankError(RuntimeError):
    """One or more ranks raised. ``failed_ranks`` lists them; ``remote`` maps each failing
    rank to ``(exception type name, str(exception), formatted traceback)``; ``exceptions``
    holds the unpickled exception objects where they could be transferred."""

    def __init__(
        self,
        message: str,
        failed_ranks: list[int] | None = None,
        remote: dict[int, tuple[str, str, str]] | None = None,
        exceptions: dict[int, BaseException] | None = None,
    ) -> None:
        super().__init__(message)
        self.failed_ranks = failed_ranks or []
        self.remote = remote or {}
        self.exceptions = exceptions or {}


class RankDiedError(RankError):
    """A rank process exited without answering (crash, ``os._exit``, killed).
    ``signals`` maps each rank that a signal ended to the signal's number."""

    def __init__(self, *args: Any, signals: dict[int, int] | None = None) -> None:
        super().__init__(*args)
        self.signals = signals or {}


class NativeCrashRetried(UserWarning):
    """A rank crashed in native code and the task was run again (the message quotes the
    crash). Rare crashes inside torch or gloo should not fail CI; an fsdp2 crash that
    recurs still fails the test, on its second crash."""


class RankTimeoutError(TimeoutError):
    """Ranks did not finish within the timeout. ``ranks`` lists the unfinished ranks."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


# --------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------


def _start_parent_watchdog(parent_pid: int) -> None:
    """Exit this worker promptly if the process that started it goes away, even while the
    main thread is blocked in a collective."""
    # A worker made by ``fork`` or ``spawn`` is the test process's child: it is re-parented
    # when that process dies. One made by the fork server is the server's child: ask the
    # system whether the test process is still there instead.
    direct_child = os.getppid() == parent_pid

    def parent_gone() -> bool:
        if direct_child:
            return os.getppid() != parent_pid
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return True  # the pid now belongs to another user's process
        return False

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if parent_gone():
                os._exit(3)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def _redirect_std_fds(path: str) -> None:
    """Point fds 1 and 2 at ``path`` (append mode)."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _reset_state(dist_snapshot: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    # Undo monkeypatches of torch.distributed that a previous task did not restore.
    current = vars(dist)
    for name, value in dist_snapshot.items():
        if current.get(name, _MISSING) is not value:
            setattr(dist, name, value)
    for name in [n for n in current if n not in dist_snapshot]:
        # New attributes are leaked patches, except submodules imported since the snapshot.
        if not isinstance(current[name], types.ModuleType):
            delattr(dist, name)

    # DTensor's sharding-propagation cache treats meshes of equal layout as one, whatever
    # their process groups: an op on a DTensor could come back on the mesh of an earlier
    # task (over a process group that task broke on purpose, or destroyed).
    propagator = getattr(
        getattr(_dtensor_class(), "_op_dispatcher", None), "sharding_propagator", None
    )
    cache_clear = getattr(getattr(propagator, "propagate_op_sharding", None), "cache_clear", None)
    if cache_clear is not None:
        cache_clear()
    native_clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if native_clear is not None:  # the C++ dispatch's cache (torch >= 2.13)
        native_clear()

    torch.set_num_threads(1)
    torch.set_grad_enabled(True)
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(0)
    random.seed(0)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(0)


def _dtensor_class() -> Any:
    from torch.distributed.tensor import DTensor

    return DTensor


_MISSING = object()
# Parent-side ends of all live worker pipes (closed in freshly forked workers).
_PARENT_CONNS: set[Any] = set()


def _send_error(conn: Any, task_id: int, exc: BaseException) -> None:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        pickled: bytes | None = pickle.dumps(exc)
        pickle.loads(pickled)
    except Exception:
        pickled = None
    conn.send(("err", task_id, type(exc).__name__, str(exc), tb, pickled))


def _worker_main(
    rank: int, world_size: int, init_file: str, log_dir: str, conn: Any, parent_pid: int
) -> None:
    # A forked worker inherits the parent's ends of every other worker's pipe; drop them so
    # a parent crash shows up as EOF everywhere (the watchdog is the backstop).
    for other in _PARENT_CONNS:
        with contextlib.suppress(Exception):
            other.close()
    _PARENT_CONNS.clear()
    # Own stdout/stderr: after fork, sys.stdout may be pytest's capture object.
    _redirect_std_fds(os.path.join(log_dir, f"worker-rank{rank}.log"))
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is handled by the parent.
    _start_parent_watchdog(parent_pid)

    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        names = {n for _, n in _socket_if_names()}
        if "GLOO_SOCKET_IFNAME" not in os.environ:
            for lo in ("lo", "lo0"):
                if lo in names:
                    os.environ["GLOO_SOCKET_IFNAME"] = lo
                    break
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(minutes=10),
        )
        dist_snapshot = dict(vars(dist))
    except BaseException as exc:
        _send_error(conn, -1, exc)
        os._exit(1)
    conn.send(("ready", -1, os.getpid()))

    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            os._exit(0)  # parent went away
        kind, task_id, log_path, payload = pickle.loads(msg)
        if kind == "stop":
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        _redirect_std_fds(log_path)
        try:
            _reset_state(dist_snapshot)
            fn, args, kwargs = pickle.loads(payload)
            result = fn(*args, **kwargs)
            try:
                reusable = dist.is_initialized() and _live_groups() <= MAX_LIVE_GROUPS
                data = pickle.dumps(("ok", task_id, result, reusable))
            except Exception as exc:
                raise TypeError(
                    f"the return value of {_fn_name(fn)} on rank {rank} is not picklable: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
        except BaseException as exc:
            sys.stdout.flush()
            sys.stderr.flush()
            _send_error(conn, task_id, exc)
        else:
            sys.stdout.flush()
            sys.stderr.flush()
            conn.send_bytes(data)
        _redirect_std_fds(os.path.join(log_dir, f"worker-rank{rank}.log"))


def _live_groups() -> int:
    """How many process groups this process holds (the default one included)."""
    from torch.distributed import distributed_c10d

    return len(distributed_c10d._world.pg_map)


def _socket_if_names() -> list[tuple[int, str]]:
    import socket

    try:
        return socket.if_nameindex()
    except (OSError, AttributeError):
        return []


# --------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------


def _mp_context() -> Any:
    # FSDP2_TESTS_START_METHOD=fork or =spawn overrides the default (for debugging).
    method = os.environ.get("FSDP2_TESTS_START_METHOD")
    if not method:
        available = multiprocessing.get_all_start_methods()
        method = "forkserver" if "forkserver" in available else "spawn"
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        # Takes effect when the server starts (first pool); later calls change nothing.
        ctx.set_forkserver_preload([*PRELOAD_MODULES, __name__])
    return ctx


def _read_tail(path: str, limit: int = MAX_LOG_CHARS) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, io.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - limit))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    if size > limit:
        text = f"[... {size - limit} earlier bytes cut ...]\n" + text
    return text


def _trim_stack_dumps(text: str) -> str:
    """Shorten faulthandler dumps in rank output: drop the frames below ``_worker_main``
    (the fork/pytest frames inherited from the parent) and the launcher's watchdog thread."""
    out: list[str] = []
    skipping = False
    for block in text.split("\n\n"):
        if "(most recent call first)" in block and " in watch\n" in block + "\n":
            continue  # the parent-watchdog thread
        lines = []
        skipping = False
        for line in block.split("\n"):
            if skipping and line.startswith("  File "):
                continue
            skipping = False
            lines.append(line)
            if line.startswith("  File ") and line.endswith(" in _worker_main"):
                skipping = True
        out.append("\n".join(lines))
    return "\n\n".join(out)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class _Pool:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.tmpdir = tempfile.mkdtemp(prefix=f"fsdp2-tests-ws{world_size}-")
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.task_counter = 0
        ctx = _mp_context()
        if ctx.get_start_method() == "fork":
            for mod in PRELOAD_MODULES:
                with contextlib.suppress(ImportError):
                    importlib.import_module(mod)
        init_file = os.path.join(self.tmpdir, "rendezvous")
        try:
            for rank in range(world_size):
                parent_conn, child_conn = ctx.Pipe(duplex=True)
                proc = ctx.Process(
                    target=_worker_main,
                    args=(rank, world_size, init_file, self.tmpdir, child_conn, os.getpid()),
                    name=f"fsdp2-test-ws{world_size}-rank{rank}",
                    daemon=True,
                )
                proc.start()
                child_conn.close()
                self.procs.append(proc)
                self.conns.append(parent_conn)
                _PARENT_CONNS.add(parent_conn)
            self._wait_ready()
        except BaseException:
            self.kill()
            raise

    def _worker_log(self, rank: int) -> str:
        return _read_tail(os.path.join(self.tmpdir, f"worker-rank{rank}.log"))

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        pending = set(range(self.world_size))
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                ranks = sorted(pending)
                logs = "".join(f"\n--- rank {r} output ---\n{self._worker_log(r)}" for r in ranks)
                raise RankTimeoutError(
                    f"world_size={self.world_size}: ranks {ranks} did not finish starting "
                    f"(process group init) within {STARTUP_TIMEOUT:.0f} s{logs}",
                    ranks,
                )
            by_obj = {self.conns[r]: r for r in pending}
            by_obj.update({self.procs[r].sentinel: r for r in pending})
            for obj in multiprocessing.connection.wait(list(by_obj), timeout=remaining):
                rank = by_obj[obj]
                if rank not in pending:
                    continue
                try:
                    msg = self.conns[rank].recv()
                except (EOFError, OSError):
                    self.procs[rank].join(1.0)
                    raise RankDiedError(
                        f"world_size={self.world_size}: rank {rank} died while starting "
                        f"({_describe_exit(self.procs[rank].exitcode)})\n"
                        f"--- rank {rank} output ---\n{self._worker_log(rank)}",
                        [rank],
                    ) from None
                if msg[0] == "err":
                    _, _, type_name, text, tb, _ = msg
                    raise RankError(
                        f"world_size={self.world_size}: rank {rank} failed to start: "
                        f"{type_name}: {text}\n{tb}",
                        [rank],
                    )
                pending.discard(rank)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                with contextlib.suppress(Exception):
                    proc.kill()
        for proc in self.procs:
            with contextlib.suppress(Exception):
                proc.join(5.0)
        for conn in self.conns:
            _PARENT_CONNS.discard(conn)
            with contextlib.suppress(Exception):
                conn.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        self.procs, self.conns = [], []

    def stop(self) -> None:
        """Graceful shutdown: ask workers to exit, kill what is left."""
        msg = pickle.dumps(("stop", -1, None, None))
        for conn in self.conns:
            with contextlib.suppress(Exception):
                conn.send_bytes(msg)
        deadline = time.monotonic() + 2.0
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def _dump_stacks(self, ranks: list[int], log_paths: list[str]) -> None:
        """Ask stuck ranks to write their Python stacks (faulthandler) into their task log,
        and wait (briefly) until they have."""
        if not hasattr(signal, "SIGUSR1"):
            return
        waiting = []
        for r in ranks:
            pid = self.procs[r].pid
            if pid is not None and self.procs[r].is_alive():
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGUSR1)
                    waiting.append(r)
        deadline = time.monotonic() + 3.0
        while waiting and time.monotonic() < deadline:
            time.sleep(0.05)
            waiting = [
                r for r in waiting if "most recent call first" not in _read_tail(log_paths[r])
            ]
        time.sleep(0.05)  # let the other threads' stacks finish too

    def run(self, fn: Any, payload: bytes, timeout: float, fn_name: str) -> tuple[list[Any], bool]:
        """Returns (results, reusable): ``reusable`` is false when a rank's process group
        is gone or it holds more than ``MAX_LIVE_GROUPS`` groups. Raises on any failure
        (the caller tears down)."""
        __tracebackhide__ = True  # pytest: show the test and the remote traceback, not this
        ws = self.world_size
        self.task_counter += 1
        task_id = self.task_counter
        log_paths = [os.path.join(self.tmpdir, f"task{task_id}-rank{r}.log") for r in range(ws)]
        for r in range(ws):
            self.conns[r].send_bytes(pickle.dumps(("task", task_id, log_paths[r], payload)))

        start = time.monotonic()
        deadline = start + timeout
        results: dict[int, Any] = {}
        errors: dict[int, tuple[str, str, str]] = {}
        exceptions: dict[int, BaseException] = {}
        died: dict[int, str] = {}
        signals: dict[int, int] = {}
        reusable = True
        first_failure: float | None = None
        pending = set(range(ws))
        while pending:
            now = time.monotonic()
            limit = deadline
            if first_failure is not None:
                limit = min(deadline, first_failure + FAILURE_GRACE)
            if now >= limit:
                break
            by_obj = {self.conns[r]: r for r in pending}
            by_obj.update({self.procs[r].sentinel: r for r in pending})
            for obj in multiprocessing.connection.wait(list(by_obj), timeout=limit - now):
                rank = by_obj[obj]
                if rank not in pending:
                    continue
                try:
                    if not self.conns[rank].poll():
                        raise EOFError  # sentinel fired: process exited without replying
                    msg = self.conns[rank].recv()
                except (EOFError, OSError):
                    self.procs[rank].join(1.0)
                    code = self.procs[rank].exitcode
                    died[rank] = _describe_exit(code)
                    if code is not None and code < 0:
                        signals[rank] = -code
                    pending.discard(rank)
                    first_failure = first_failure or time.monotonic()
                    continue
                pending.discard(rank)
                if msg[0] == "ok":
                    results[rank] = msg[2]
                    reusable = reusable and bool(msg[3])
                else:
                    _, _, type_name, text, tb, pickled = msg
                    errors[rank] = (type_name, text, tb)
                    if pickled is not None:
                        with contextlib.suppress(Exception):
                            exceptions[rank] = pickle.loads(pickled)
                    first_failure = first_failure or time.monotonic()

        elapsed = time.monotonic() - start
        stuck = sorted(pending)
        if stuck:
            self._dump_stacks(stuck, log_paths)
        if not stuck and not errors and not died:
            for path in log_paths:
                with contextlib.suppress(OSError):
                    os.remove(path)
            return [results[r] for r in range(ws)], reusable

        header = f"run_ranks({fn_name}, world_size={ws})"
        sections: list[str] = []
        for r in sorted(died):  # first: a dead rank is usually the root cause
            sections.append(f"=== rank {r} died ({died[r]}) without returning ===")
        for r in sorted(errors):
            type_name, text, tb = errors[r]
            sections.append(f"=== rank {r} raised {type_name}: {text} ===\n{tb}")
        for r in stuck:
            sections.append(
                f"=== rank {r} did not finish (killed after {elapsed:.1f} s); "
                "its Python stack at kill time is at the end of its output below ==="
            )
        for r in range(ws):
            out = _trim_stack_dumps(_read_tail(log_paths[r]))
            if out.strip():
                sections.append(f"--- rank {r} stdout/stderr ---\n{out.rstrip()}")
        body = "\n\n".join(sections)

        if errors or died:
            failed = sorted(set(errors) | set(died))
            what = []
            if died:
                what.append(f"rank(s) {sorted(died)} died")
            if errors:
                what.append(f"rank(s) {sorted(errors)} raised")
            if stuck:
                what.append(f"rank(s) {stuck} were still running {FAILURE_GRACE:.0f} s later")
            msg = f"{header}: {'; '.join(what)}\n\n{body}"
            if not died:
                raise RankError(msg, failed, errors, exceptions)
            raise RankDiedError(msg, failed, errors, exceptions, signals=signals)
        raise RankTimeoutError(
            f"{header}: rank(s) {stuck} did not finish within {timeout:g} s "
            f"(finished: {sorted(results)})\n\n{body}",
            stuck,
        )


_POOLS: dict[int, _Pool] = {}
_LOCK = threading.RLock()
_OWNER_PID = os.getpid()


def shutdown_pools() -> None:
    """Stop every pool (safe to call repeatedly; pools restart lazily on next use)."""
    if os.getpid() != _OWNER_PID:
        return  # never act from a forked child
    with _LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
        for pool in pools:
            with contextlib.suppress(Exception):
                pool.stop()


atexit.register(shutdown_pools)


def _fn_name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def run_ranks(fn: Any, world_size: int, *args: Any, timeout: float = 120.0, **kwargs: Any) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` processes with an initialized gloo
    process group; return the per-rank results in rank order.

    Raises :class:`RankError` (a ``RuntimeError``) naming the failing rank(s) with their
    remote traceback and output if any rank raises, :class:`RankDiedError` if a rank
    process dies, and :class:`RankTimeoutError` (a ``TimeoutError``) naming the unfinished
    ranks if the ranks do not all finish within ``timeout`` seconds. After any of these the
    pool of that world size is discarded and rebuilt on the next call. A rank that
    crashes in native code (``NATIVE_CRASH_SIGNALS``) gets the task one more run on a
    fresh pool, with a :class:`NativeCrashRetried` warning.
    """
    __tracebackhide__ = True
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"world_size must be in [1, {MAX_WORLD_SIZE}], got {world_size}")
    name = _fn_name(fn)
    if "<locals>" in name or "<lambda>" in name:
        raise TypeError(
            f"run_ranks needs a module-level function (it is pickled by reference), got {name}"
        )
    try:
        payload = pickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise TypeError(f"run_ranks({name}): fn/args/kwargs are not picklable: {exc}") from exc

    try:
        return _run_on_pool(fn, world_size, payload, timeout, name)
    except RankDiedError as crash:
        if not (RETRY_NATIVE_CRASHES and set(crash.signals.values()) & NATIVE_CRASH_SIGNALS):
            raise
        warnings.warn(
            NativeCrashRetried(f"run_ranks ran the task once more after this crash:\n{crash}"),
            stacklevel=2,
        )
    return _run_on_pool(fn, world_size, payload, timeout, name)


def _run_on_pool(fn: Any, world_size: int, payload: bytes, timeout: float, name: str) -> list:
    __tracebackhide__ = True
    with _LOCK:
        pool = _POOLS.get(world_size)
        if pool is not None and not pool.alive():
            pool.kill()
            pool = None
        if pool is None:
            pool = _Pool(world_size)
            _POOLS[world_size] = pool
        try:
            results, reusable = pool.run(fn, payload, timeout, name)
        except BaseException:
            # Failure, timeout, or an interrupt in the parent (Ctrl-C, pytest-timeout):
            # the ranks may be mid-collective, so the pool cannot be trusted any more.
            _POOLS.pop(world_size, None)
            pool.kill()
            raise
        if not reusable:  # fn destroyed the default process group, or groups piled up
            _POOLS.pop(world_size, None)
            pool.stop()
        return results
