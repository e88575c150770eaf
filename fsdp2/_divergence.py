"""Ranks that run different paths: what each rank issued, and errors that say so on every
rank instead of mixing data silently or hanging anonymously.

Collectives pair up by position: the n-th collective one rank issues on a process group
meets the n-th of every other rank, whatever each rank meant by it. When one rank skips a
sharded module (an MoE expert with no tokens, an ``if`` on data, an early exit), its
all-gather of the next module meets the other ranks' all-gather of the skipped one: with
equal sizes the ranks silently compute with each other's parameters; with other sizes the
backend hangs or aborts, naming no module. fsdp2 issues every collective itself, so it
can say what each one is. This module holds what the ranks compare and tell each other:

- the identity of a collective, its ``Fingerprint``: the group (its index in the tree),
  the stage (forward, backward, an explicit ``unshard()``) and the tree's sequence
  number. ``_fingerprints`` carries it inside each collective's own message ([Note:
  in-band fingerprints] there), so the ranks compare without another collective;
- a per-rank ring buffer of the last collectives issued (``Issued``: the fingerprint,
  what it was, the step, the time);
- the reports the ranks exchange through the process group's store when a check fails or
  a collective fails, and the one error every rank raises; see [Note: named timeouts];
- the switch, ``fsdp2.set_divergence_checks`` (and ``FSDP2_DIVERGENCE_CHECKS``).

[Note: named timeouts]
A collective that does not complete leaves every rank that issued it waiting, and the
backend's error at the process group's timeout names no module ("Timed out waiting
15000ms for send operation to complete"), on each rank separately. So every rank keeps
its last ``RING_SIZE`` issued collectives (``Issued``: a tuple appended to a deque at each
issue; no allocation beyond it). When something goes wrong on a rank (its fingerprint
check failed, its collective failed or timed out, a peer was found gone), the rank posts
a report to the process group's store (the ``Store`` the group was created with, which
does not go through the group's own, possibly stuck, transport): why it reports, the
collective it is in, and its ring buffer. It then collects the other ranks' reports for
at most ``FSDP2_DIVERGENCE_REPORT_TIMEOUT`` seconds (30 by default) and raises an error
listing, for every rank, where it was, which ranks are behind (the lowest sequence number
issued), and what to do; a rank that did not report is named as such (it died, or is
stuck outside fsdp2's collectives of that group).

A rank blocked in a collective must not wait for its own timeout once another rank has
reported: on the CPU each wait is a loop of one-second slices (gloo's ``Work.wait``
takes a timeout and can be called again after one expires; a slice that expires leaves
the work running, ``is_completed()`` still False), and between slices the rank looks for
another rank's report of the current incident on the group and, if there is one, reports
and raises too. A collective done within the first slice costs one plain wait. Reports
of one process group are numbered (the incident), so a later incident never reads an
earlier one's keys; the keys live in the store under the group's name.

On an accelerator the host never blocks in a collective: NCCL runs it on a stream, and
torch's watchdog aborts the communicator after the process group's timeout (with
``TORCH_NCCL_ASYNC_ERROR_HANDLING``, the process is torn down) and, with
``TORCH_FR_BUFFER_SIZE`` (formerly ``TORCH_NCCL_TRACE_BUFFER_SIZE``) > 0, its flight
recorder dumps every rank's last collectives (``TORCH_NCCL_DUMP_ON_TIMEOUT``). fsdp2 fits in before it: the one place the
host waits for fsdp2's collectives, reading the last fingerprints before an optimizer
step, polls with a deadline of ``WATCHDOG_FRACTION`` of the group's timeout and then
reports through the store as above, so the error names fsdp2's groups, phases and
sequence numbers before the watchdog fires. The flight recorder's entries carry the
process group's own collective sequence id and the torch collective (``_ALLGATHER_BASE``,
``_REDUCE_SCATTER_BASE``); fsdp2's sequence number counts the tree's collectives on all
of its groups (docs/divergence.md shows how to line the two up).
"""

from __future__ import annotations

import collections
import datetime
import gc
import json
import os
import re
import time
import weakref
from collections.abc import Callable, Sequence
from enum import IntEnum
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fsdp2._comm_records import Phase
from fsdp2._switches import read_switch

ENV_VAR = "FSDP2_DIVERGENCE_CHECKS"
# How long a rank that found a problem waits for the other ranks' reports (seconds).
REPORT_TIMEOUT_ENV_VAR = "FSDP2_DIVERGENCE_REPORT_TIMEOUT"
DEFAULT_REPORT_TIMEOUT = 30.0
RING_SIZE = 16  # collectives each rank remembers for its reports
POLL_SECONDS = 1.0  # how often a rank blocked in a collective looks for others' reports
# On an accelerator, the host's wait before an optimizer step reports at this fraction
# of the process group's timeout, before torch's watchdog aborts the communicator.
WATCHDOG_FRACTION = 0.8


class Stage(IntEnum):
    """What a collective was issued for (the part of a fingerprint that names it)."""

    FORWARD = 0
    BACKWARD = 1  # also the gradient reductions, which run in backward
    UNSHARD = 2  # ``FSDPModule.unshard()`` called by the user

    @property
    def label(self) -> str:
        return _STAGE_LABELS[self]


_STAGE_LABELS = {Stage.FORWARD: "forward", Stage.BACKWARD: "backward", Stage.UNSHARD: "unshard()"}
_STAGES = {
    Phase.FORWARD: Stage.FORWARD,
    Phase.FORWARD_PREFETCH: Stage.FORWARD,
    Phase.BACKWARD: Stage.BACKWARD,
    Phase.BACKWARD_PREFETCH: Stage.BACKWARD,
    Phase.UNSHARD: Stage.UNSHARD,
    Phase.REDUCE: Stage.BACKWARD,
}


def stage_of(phase: Phase) -> Stage:
    """A collective's stage: its phase without the prefetch (a prefetch is not part of
    what must agree: ranks on the same path agree anyway, and a false alarm is worse than
    a later one)."""
    return _STAGES[phase]


class Fingerprint(NamedTuple):
    """What the issuing rank meant by a collective: equal on every rank, or they
    diverged."""

    group: int  # the group's index in its communication context (-1: not a group's)
    stage: Stage
    seq: int  # the context's sequence number of this collective

    def describe(self, groups: Sequence[Any]) -> str:
        """The fingerprint in words; ``groups``: the context's groups, by index (each
        named by its ``where``)."""
        if 0 <= self.group < len(groups):
            group = str(getattr(groups[self.group], "where", groups[self.group]))
        else:
            group = f"group #{self.group}"
        return f"{group}, {self.stage.label}, sequence {self.seq}"


class Issued(NamedTuple):
    """One collective this rank issued, for the checks and the reports."""

    fingerprint: Fingerprint
    what: str  # e.g. "all-gather of layers.2 (Block)"
    step: int  # the tree's step (a root forward after a step that reduced starts one)
    when: float  # time.time() at issue
    process_group: Any  # the dist.ProcessGroup it was issued on
    # Its communication context, marked failed when this collective is reported: see
    # [Note: a failed step's collectives in flight].
    owner: Any = None

    def line(self) -> str:
        return _line(self.what, self.fingerprint.stage, self.fingerprint.seq, self.step, self.when)


def _line(what: str, stage: Stage, seq: int, step: int, when: float) -> str:
    stamp = time.strftime("%H:%M:%S", time.localtime(when))
    return (
        f"{what} ({stage.label}, sequence {seq}, step {step}, issued at "
        f"{stamp}.{int(when * 1000) % 1000:03d})"
    )


_ring: collections.deque[Issued] = collections.deque(maxlen=RING_SIZE)


def remember(issued: Issued) -> None:
    """Add a collective to this rank's ring buffer (at its issue)."""
    _ring.append(issued)


def last_issued() -> list[Issued]:
    return list(_ring)


# [Note: a failed step's collectives in flight]
# Once a rank raised for one of its collectives (the ranks paired different collectives,
# one did not complete, a peer vanished), what its communication context still has in
# flight belongs to that failed step and may never complete: the peers are elsewhere,
# gloo has closed the pairs, an accelerator's communicator is being aborted. Waiting for
# it later (the next optimizer step finishes every context's reductions; reset_iter_state
# finishes the tree's) would hang until the process group's timeout and repeat the old
# error, in another model's step or in the recovery itself. So the report marks the
# context failed (``mark_failed``, keyed weakly: a model that is dropped is forgotten),
# the context drops what it has in flight instead of waiting for it, and an optimizer
# step over that model's parameters raises, since the dropped reductions' gradients are
# missing (never a silently lost update); ``reset_iter_state`` clears the mark.
_failed: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def mark_failed(owner: Any, headline: str) -> None:
    """Record that ``owner`` (a communication context) had a collective reported."""
    if owner is not None:
        _failed[owner] = headline


def failure_of(owner: Any) -> str | None:
    """The headline of the report that marked ``owner`` failed, or None."""
    return _failed.get(owner) if _failed else None


def any_failed() -> bool:
    return bool(_failed)


def forget_failure(owner: Any) -> None:
    _failed.pop(owner, None)


def forget_issued() -> None:
    """Empty the ring buffer (tests, and a job that recovered from a reported divergence)."""
    _ring.clear()


# -- the switch -------------------------------------------------------------------------

_enabled: bool | None = None  # None: the environment has not been read yet
# Callables that describe what is in the middle of a step (a forward or backward under
# way, collectives in flight, gradient sums owed), or return None: registered by the
# runtime above (``_backward_hooks``), asked before the switch changes.
step_probes: list[Callable[[], str | None]] = []


def checks_enabled() -> bool:
    """Whether fsdp2's collectives carry fingerprints (``FSDP2_DIVERGENCE_CHECKS``, read
    once; on by default); ``fsdp2.set_divergence_checks`` changes it between steps."""
    global _enabled
    if _enabled is None:
        _enabled = _read_environment()
    return _enabled


def set_divergence_checks(enabled: bool) -> None:
    """Turn fsdp2's divergence checks on or off for every sharded module of this process.

    On (the default, or ``FSDP2_DIVERGENCE_CHECKS=1``), every all-gather, reduce-scatter,
    HSDP all-reduce and all-to-all fsdp2 issues carries a fingerprint of what the rank
    meant by it (16 bytes per all-gather slot, 64 per reduction chunk), each rank checks
    the others' where the runtime already waits, and a mismatch, a failed collective or a
    timeout raises on every rank with where each rank was (docs/divergence.md). Off, the
    collectives carry only the data, as torch's ``fully_shard`` does, and failures raise
    the backend's error. ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` adds the strict check (a
    blocking comparison before each collective) either way.

    Call it on every rank at the same point, between steps (not during a forward or
    backward, while collectives are in flight, or while gradient accumulation holds sums
    for a later reduction): the fingerprints change every collective's size, so ranks
    that switched at different points would pair up collectives of different sizes.
    """
    if not isinstance(enabled, bool):
        raise TypeError(
            f"fsdp2.set_divergence_checks expects a bool, got {type(enabled).__name__} {enabled!r}."
        )
    if enabled == checks_enabled():
        return
    busy = [reason for probe in step_probes if (reason := probe()) is not None]
    if busy:  # a tree of a failed step nobody holds any more is not in a step: collect it
        gc.collect()
        busy = [reason for probe in step_probes if (reason := probe()) is not None]
    if busy:
        raise RuntimeError(
            f"fsdp2.set_divergence_checks({enabled}) was called in the middle of a step: "
            f"{'; '.join(busy)}. The checks change the size of every collective fsdp2 "
            f"issues, so switching between the collectives of one step would pair messages "
            f"of different sizes across ranks (or with this rank's own collectives in "
            f"flight). Switch between steps, on every rank: after optimizer.step() and "
            f"before the next forward (after a step that raised, call reset_iter_state() "
            f"on its root module first)."
        )
    global _enabled
    _enabled = enabled


def _read_environment() -> bool:
    return read_switch(ENV_VAR, "fingerprints in every fsdp2 collective", "off")


def report_timeout() -> float:
    """Seconds a rank waits for the others' reports before raising with what it has."""
    value = os.environ.get(REPORT_TIMEOUT_ENV_VAR)
    if value is None:
        return DEFAULT_REPORT_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(
            f"{REPORT_TIMEOUT_ENV_VAR}={value!r}: expected a positive number of seconds "
            f"(how long a rank waits for the other ranks' reports)."
        )
    return seconds


# -- reports through the store -----------------------------------------------------------


def process_group_store(group: dist.ProcessGroup, what: str) -> Any:
    """The store of ``group``, through which ranks exchange reports when it fails."""
    try:
        store = dist.distributed_c10d._get_process_group_store(group)
    except (RuntimeError, ValueError, KeyError, AttributeError):
        store = None
    if store is None:
        raise RuntimeError(
            f"fully_shard: the process group of the {what} has no store (it was not created "
            f"through torch.distributed), so fsdp2's divergence checks cannot let the ranks "
            f"tell each other where they were when a collective pairs up wrongly or fails. "
            f"Create process groups with torch.distributed (init_process_group, new_group, "
            f"init_device_mesh), or turn the checks off: fsdp2.set_divergence_checks(False)."
        )
    return store


def require_stores(groups: Sequence[Any], what: str) -> None:
    """Check up front (at lazy init, with the checks on) that every process group in
    ``groups`` (None entries skipped) has a store: a clear error at the first forward
    rather than none when a report is due."""
    for group in groups:
        if group is not None:
            process_group_store(group, what)


_incidents: dict[str, int] = collections.defaultdict(int)


def _keys(group: dist.ProcessGroup, incident: int) -> list[str]:
    base = f"fsdp2/divergence/{group.group_name}/{incident}"
    return [f"{base}/{r}" for r in range(group.size())]


def post_report(group: dist.ProcessGroup, store: Any, report: dict[str, Any]) -> int:
    """Publish this rank's report of the current incident on ``group``; returns the
    incident's number."""
    incident = _incidents[group.group_name]
    store.set(_keys(group, incident)[group.rank()], json.dumps(report))
    return incident


def peer_reported(group: dist.ProcessGroup, store: Any) -> bool:
    """Whether another rank of ``group`` has reported the current incident."""
    keys = _keys(group, _incidents[group.group_name])
    try:
        return any(store.check([key]) for r, key in enumerate(keys) if r != group.rank())
    except (RuntimeError, ValueError):  # the store is gone with the job: nothing to read
        return False


def collect_reports(
    group: dist.ProcessGroup, store: Any, incident: int, timeout: float
) -> list[dict[str, Any] | None]:
    """Every rank's report of ``incident`` (None for a rank that did not report within
    ``timeout`` seconds). Ends the incident on this rank."""
    keys = _keys(group, incident)
    reports: list[dict[str, Any] | None] = [None] * len(keys)
    deadline = time.monotonic() + timeout
    pause = 0.005
    while True:
        for r, key in enumerate(keys):
            if reports[r] is None:
                try:
                    if store.check([key]):
                        reports[r] = json.loads(store.get(key))
                except (RuntimeError, ValueError):
                    pass  # not readable yet (being written, or the store busy): next round
        if all(r is not None for r in reports) or time.monotonic() >= deadline:
            break
        time.sleep(pause)
        pause = min(2 * pause, 0.1)
    _incidents[group.group_name] = incident + 1
    return reports


def _local_report(reason: str, current: Issued | None) -> dict[str, Any]:
    return {
        "reason": reason,
        "current": None if current is None else _issued_dict(current),
        "last": [_issued_dict(i) for i in last_issued()],
    }


def _issued_dict(issued: Issued) -> dict[str, Any]:
    fp = issued.fingerprint
    return {
        "what": issued.what,
        "stage": int(fp.stage),
        "seq": fp.seq,
        "step": issued.step,
        "when": issued.when,
        "group": fp.group,
    }


def _dict_line(data: dict[str, Any]) -> str:
    return _line(data["what"], Stage(data["stage"]), data["seq"], data["step"], data["when"])


ADVICE = (
    "What to do: run every sharded module's forward and backward on every rank, in the same "
    "order. Keep an MoE expert that got no tokens in the forward with an empty batch (or add "
    "its output times zero to the loss); decide a skipped step or module from a value every "
    "rank agrees on (e.g. after an all_reduce); or keep a module that some ranks skip out "
    "of fully_shard's groups (ignored_params, or shard it together with a parent that "
    "always runs). docs/divergence.md has recipes."
)


def global_ranks(group: dist.ProcessGroup) -> list[int]:
    try:
        return [dist.get_global_rank(group, r) for r in range(group.size())]
    except (RuntimeError, ValueError):
        return list(range(group.size()))


def format_reports(
    headline: str,
    group: dist.ProcessGroup,
    reports: Sequence[dict[str, Any] | None],
    behind: bool = True,
) -> str:
    """The error text: the headline, where each rank was (its collective, its recent
    history), the ranks that are behind (with ``behind``: for a collective that did not
    complete, not for collectives that paired up wrongly), and what to do."""
    ranks = global_ranks(group)
    lines = [
        headline,
        f"Where each rank of the process group {group.group_name!r} (ranks {ranks}) was, "
        f"with its last fsdp2 collectives (most recent last):",
    ]
    latest: dict[int, int] = {}
    for group_rank, report in enumerate(reports):
        rank = ranks[group_rank]
        if report is None:
            lines.append(
                f"  rank {rank}: did not report (it died, or is stuck outside fsdp2's "
                f"collectives on this process group: in compute, or in a collective of its "
                f"own)"
            )
            continue
        current = report.get("current")
        history = report.get("last", [])
        if history:
            latest[rank] = max(d["seq"] for d in history)
        where = f"in the {_dict_line(current)}" if current else "in no fsdp2 collective"
        lines.append(f"  rank {rank}: {report.get('reason', '?')}; {where}")
        lines += [f"      {_dict_line(d)}" for d in history[-4:]]
    if behind and latest and len(set(latest.values())) > 1:
        low = min(latest.values())
        last = sorted(r for r, s in latest.items() if s == low)
        lines.append(
            f"Behind: rank{'s' if len(last) > 1 else ''} {', '.join(map(str, last))} "
            f"(last sequence number issued: {low}; the furthest rank issued "
            f"{max(latest.values())})."
        )
    lines.append(ADVICE)
    return "\n".join(lines)


class DivergenceError(RuntimeError):
    """The ranks of a process group issued different collectives, or one could not
    complete: raised on every rank that can, naming where each rank was."""


def exchange_reports(
    group: dist.ProcessGroup,
    headline: str,
    reason: str,
    current: Issued | None,
    behind: bool = True,
) -> str:
    """Post this rank's report, collect the others' (bounded) and return the error text."""
    if current is not None:  # [Note: a failed step's collectives in flight]
        mark_failed(current.owner, headline)
    store = process_group_store(group, current.what if current else "collective")
    incident = post_report(group, store, _local_report(reason, current))
    reports = collect_reports(group, store, incident, report_timeout())
    return format_reports(headline, group, reports, behind)


def raise_divergence(
    group: dist.ProcessGroup,
    headline: str,
    reason: str,
    current: Issued | None,
    behind: bool = True,
) -> None:
    """Report this rank, collect the others' reports through the store, and raise a
    ``DivergenceError`` (``behind``: name the ranks that issued the fewest collectives)."""
    text = exchange_reports(group, headline, reason, current, behind)
    raise DivergenceError(text)


# -- waits -------------------------------------------------------------------------------

_SLICE = datetime.timedelta(seconds=POLL_SECONDS)


def wait_watching_peers(work: Any, issued: Issued) -> None:
    """Wait for a CPU collective's ``work`` in slices of ``POLL_SECONDS``; between them, if
    another rank of its process group has reported, report and raise instead of waiting
    for this collective's own timeout; see [Note: named timeouts]. The work's own failure
    (its timeout, a peer gone) is raised as the backend raised it."""
    try:
        work.wait(_SLICE)
        return
    except TypeError:  # a Work without a timeout argument (test process groups)
        work.wait()
        return
    except RuntimeError as error:
        if _timed_wait_unsupported(error):
            work.wait()
            return
        if _finished(work):
            raise
    group = issued.process_group
    store = process_group_store(group, issued.what)
    # The backend's own timeout normally ends the wait; a work it never starts (queued
    # behind a failed one) would not end it: the group's timeout, and a little more.
    timeout = process_group_timeout(group)
    deadline = None if timeout is None else time.monotonic() + timeout + 2 * POLL_SECONDS
    while True:
        if deadline is not None and time.monotonic() > deadline:
            raise_divergence(
                group,
                f"fully_shard: the {issued.what} did not complete within its process "
                f"group's timeout ({timeout:g} s), and the backend did not end it.",
                "its collective did not complete",
                issued,
            )
        if peer_reported(group, store):
            raise_divergence(
                group,
                f"fully_shard: another rank of the process group reported a problem while "
                f"this rank was waiting in the {issued.what}.",
                "waiting for its collective when another rank reported",
                issued,
            )
        try:
            work.wait(_SLICE)
            return
        except RuntimeError:
            if _finished(work):
                raise


_NO_TIMED_WAIT = re.compile(r"timeout.*not (implemented|supported)", re.IGNORECASE)


def _timed_wait_unsupported(error: RuntimeError) -> bool:
    """Whether ``error`` says the Work cannot wait with a finite timeout, rather than that
    the collective failed: torch's ``FutureWrappingWork`` (its ``threaded`` test process
    group, which torch's own multi-threaded FSDP tests run on) raises "wait() with finite
    timeout not implemented". Such a Work is waited on as a whole, without watching for
    peers' reports, as torch's ``fully_shard`` waits on it."""
    return _NO_TIMED_WAIT.search(str(error)) is not None


def process_group_timeout(group: Any) -> float | None:
    """Seconds of ``group``'s timeout for collectives (its backend's), or None."""
    for device in ("cpu", "cuda"):
        try:
            timeout = group._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError, ValueError, TypeError):
            continue
        return float(timeout.total_seconds())
    return None


def _finished(work: Any) -> bool:
    """Whether a wait that raised ended the work (its failure), rather than a slice."""
    is_completed = getattr(work, "is_completed", None)
    return True if is_completed is None else bool(is_completed())


def report_failure(error: BaseException, issued: Issued) -> None:
    """A collective of this rank failed (a timeout, a peer gone): report through the store,
    collect the others' reports, and add them to ``error`` as a note (its class is kept:
    launchers catch ``DistBackendError``). Python 3.10 has no notes: a ``DivergenceError``
    is raised from ``error`` instead."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    headline = (
        f"fsdp2: this rank was in the {issued.what} when the collective failed "
        f"({first}). A rank that stopped, or that issued another collective, is the "
        f"usual cause: the reports below say where each rank was. (With "
        f"TORCH_DISTRIBUTED_DEBUG=DETAIL, fsdp2 also compares every collective before "
        f"issuing it: a blocking round trip each, for debugging.)"
    )
    try:
        text = exchange_reports(
            issued.process_group, headline, f"its collective failed: {first}", issued
        )
    except RuntimeError as store_error:  # no store to report through: say so
        text = f"{headline} (No reports from the other ranks: {store_error})"
    add_note = getattr(error, "add_note", None)
    if add_note is None:
        raise DivergenceError(text) from error
    add_note(text)
