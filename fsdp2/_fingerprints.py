"""Fingerprints inside fsdp2's collectives: how they are written into the messages, and
how each rank checks the others' after the collective.

What a fingerprint identifies, the ring buffer and the reports are ``_divergence``'s; the
groups' code (``_all_gather``, ``_grad_reduce``, ``_replica_sum``, ``_reduction``) lays
its messages out with room for them and calls the functions here.

[Note: in-band fingerprints]
Checking that every rank issues the same collective with another collective (what
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` does) costs a blocking round trip each time. Instead
each collective carries a fingerprint of what the issuing rank meant by it (the group's
index, the stage and the tree's sequence number, ``Fingerprint``), and the ranks compare
them in the result:

- All-gather: every rank sees every rank's input, so each rank's slot ends with a
  16-byte tail after its data, padded to a multiple of 16 bytes: two float64 values, the
  group and stage (``8 * (group + 2) + stage``, never 0, so that a slot a shorter message
  left as it was does not read as a fingerprint) and the sequence number, exact
  integers. One
  ``fill_`` of the tail viewed as one complex128 writes both: a kernel whose argument is
  the value, so on an accelerator it needs no host-to-device copy and no
  synchronization. After the collective each rank reads the ``world_size`` tails: all
  equal to its own, or the ranks diverged and the tails say how.
- Reductions (reduce-scatter, HSDP's all-reduce): a sum shows no single rank's input, and
  a mismatch must not cancel out (one rank one above and another one below the expected
  value sum to the expected total). Each rank's chunk ends with one ``BLOCK_BYTES``
  (64-byte) block of ``n`` elements, after the padded flags region, which keeps the
  chunk's length modulo the backends' segment counts ([Note: padded gradient flags] in
  ``_grad_pack``). A digest of the fingerprint picks one of the ``C(n, n/2)`` sets of
  ``n/2`` positions; the rank writes 1 there and 0 elsewhere. Every contribution is 0 or
  1, never negative, so a reduced element is zero exactly when every rank wrote zero
  there, in any order of summation, any float dtype and any rounding (round-to-nearest
  never takes a positive sum to zero; an average divides by the world size, far above
  the smallest subnormal of any float dtype; a pre-division by a power of two likewise).
  A rank checks only the positions where it wrote 0: each must still be 0. Two ranks
  with different fingerprints chose two different sets of the same size, and neither
  contains the other, so each of the two wrote 1 somewhere the other wrote 0: both see a
  nonzero where they expect zero, and so does every rank, since every rank differs from
  one of the two. The only miss is two fingerprints whose digests pick the same set:
  a chance of ``1 / C(n, n/2)`` per collective (1 in 12,870 in fp32, 16 elements; 1 in
  601 million in bf16 and fp16; 1 in 70 in fp64), and ranks that diverged differ again
  at their next collectives. (Sets of equal size are the largest family in which no set
  contains another, Sperner's theorem: complementary bit pairs, the obvious code, give 256
  codes in the same 16 fp32 elements.) HSDP's all-reduce of a reduce-scatter's output
  writes the block afresh, with its own fingerprint, before it is issued.
- All-to-all (a ``ReducePolicy`` that sums locally): every rank receives every rank's
  chunk unsummed, each with its sender's block, so each rank compares each received
  block's zero pattern with its own and names the senders that differ.

When a check runs: on the CPU the host waits for each collective anyway (gloo's
``Work``), and the check runs right after that wait, before anything uses the result:
nothing is ever computed from mixed data. On an accelerator the host does not wait: the
few fingerprint bytes are copied into host memory behind the collective on its own
stream, with an event, and read where the host already stands: every later wait on a
collective polls the events that have completed (``Event.query()``, no synchronization),
as does the end of backward; fsdp2's optimizer step pre-hook reads what is left,
waiting for the device if it must, and raises there, before the optimizer applies
anything computed from mixed data. That wait is the cost on accelerators: the host
starts the optimizer step once the device has finished the last reduction, where
without the checks it could queue the step's kernels while the device finishes backward.
"""

from __future__ import annotations

import abc
import collections
import math
import struct
import time
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from fsdp2._divergence import (
    POLL_SECONDS,
    WATCHDOG_FRACTION,
    Fingerprint,
    Issued,
    Stage,
    global_ranks,
    peer_reported,
    process_group_store,
    raise_divergence,
)
from fsdp2._stream_utils import Stream, queryable_event

TAIL_BYTES = 16  # an all-gather slot's fingerprint: two float64 values
BLOCK_BYTES = 64  # a reduction chunk's fingerprint block


# -- all-gather tails --------------------------------------------------------------------


def tail_numel(dtype: torch.dtype) -> int:
    """Elements of ``dtype`` that hold the 16-byte tail (and the unit it is aligned to)."""
    return max(1, TAIL_BYTES // dtype.itemsize)


def tailed_numel(numel: int, dtype: torch.dtype) -> int:
    """Elements of one rank's all-gather slot that carries ``numel`` elements of data and
    a tail: the data padded to a multiple of 16 bytes, then 16 bytes."""
    unit = tail_numel(dtype)
    return -(-numel // unit) * unit + unit


def _tail_values(fingerprint: Fingerprint) -> tuple[float, float]:
    # Never (0, 0): a slot that a shorter message left as it was does not read as one.
    return float(8 * (fingerprint.group + 2) + int(fingerprint.stage)), float(fingerprint.seq)


def write_tail(tail: torch.Tensor, fingerprint: Fingerprint) -> None:
    """Write ``fingerprint`` into ``tail`` (the last ``tail_numel`` elements of this rank's
    slot), on the current stream, without a host-to-device copy where it is aligned."""
    code, seq = _tail_values(fingerprint)
    try:
        wide = tail.view(torch.complex128)
    except RuntimeError:  # not at a 16-byte boundary of its storage: write the bytes
        _copy_bytes(tail, struct.pack("<dd", code, seq))
        return
    wide.fill_(complex(code, seq))


def _copy_bytes(target: torch.Tensor, raw: bytes) -> None:
    source = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    if target.device.type != "cpu":
        source = _staging(target.device).to_device(source)
    target.view(torch.uint8).copy_(source)


def _describe_tail(code: float, seq: float, groups: Sequence[Any]) -> str:
    unreadable = "no fsdp2 fingerprint (a message of another size or kind)"
    if not (math.isfinite(code) and math.isfinite(seq)) or code != int(code) or seq != int(seq):
        return unreadable
    group, stage = divmod(int(code), 8)
    if group < 1 or stage > 2:
        return unreadable
    return Fingerprint(group - 2, Stage(stage), int(seq)).describe(groups)


# -- reduction blocks ----------------------------------------------------------------------


def block_numel(dtype: torch.dtype) -> int:
    """Elements of ``dtype`` in a reduction chunk's fingerprint block (even)."""
    return max(2, BLOCK_BYTES // dtype.itemsize)


def block_ones(fingerprint: Fingerprint, numel: int) -> tuple[int, ...]:
    """The ``numel // 2`` positions of the block where this fingerprint writes 1: the
    set of that size numbered by a digest of the fingerprint (combinatorial number
    system); see [Note: in-band fingerprints]."""
    global _last_ones
    if _last_ones[0] == (fingerprint, numel):  # the same collective's write, then check
        return _last_ones[1]
    chosen = numel // 2
    digest = _mix(_mix(_mix(fingerprint.group) ^ int(fingerprint.stage)) ^ fingerprint.seq)
    index = digest % math.comb(numel, chosen)
    ones = []
    for position in range(numel):
        if chosen == 0:
            break
        without = math.comb(numel - position - 1, chosen)  # sets that skip this position
        if index >= without:
            ones.append(position)
            index -= without
            chosen -= 1
    _last_ones = ((fingerprint, numel), tuple(ones))
    return _last_ones[1]


_last_ones: tuple[Any, tuple[int, ...]] = (None, ())
_MASK = (1 << 64) - 1


def _mix(value: int) -> int:
    """A 64-bit mix of ``value`` (splitmix64's finalizer): equal on every rank, and
    neighbouring sequence numbers far apart."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK
    return value ^ (value >> 31)


_ONE_BYTES: dict[torch.dtype, bytes] = {}


def block_tensor(
    fingerprint: Fingerprint | None, numel: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The ``numel``-element block this rank writes for ``fingerprint`` (zeros for None:
    room kept for a later collective's block), a 1-D ``dtype`` tensor on ``device``
    (staged through pinned host memory on an accelerator: no synchronization). 0 and 1
    are exact in every dtype, so the block may be built in the flags' dtype and cast."""
    if fingerprint is None:
        return torch.zeros(numel, dtype=dtype, device=device)
    one = _ONE_BYTES.get(dtype)
    if one is None:
        one = _ONE_BYTES[dtype] = bytes(torch.ones(1, dtype=dtype).view(torch.uint8).tolist())
    zero = bytes(len(one))
    ones = block_ones(fingerprint, numel)
    raw = bytearray(b"".join(one if i in ones else zero for i in range(numel)))
    block = torch.frombuffer(raw, dtype=torch.uint8)
    if device.type != "cpu":
        block = _staging(device).to_device(block)
    return block.view(dtype)


# Custom collective objects (``set_custom_all_gather`` / ``set_custom_reduce_scatter``)
# whose buffers could not carry fingerprints, with the groups they failed for.
_REFUSED: weakref.WeakKeyDictionary[Any, set[tuple[str, str]]] = weakref.WeakKeyDictionary()


def custom_refused(custom: Any, where: str, api: str) -> bool:
    """Whether ``custom`` was found unable to carry fingerprints for the group ``where``
    (its collectives then go without them)."""
    try:
        return (where, api) in _REFUSED.get(custom, ())
    except TypeError:  # not weakly referenceable: never remembered
        return False


def allocate_with_room(
    custom: Any, numel: int, dtype: torch.dtype, device: torch.device, where: str, api: str
) -> torch.Tensor | None:
    """``custom.allocate`` of ``numel`` elements, room for fingerprints included; None when
    it refuses (raises) or returns another size. Then, once, a warning that the checks
    are off for this group's collectives of that kind, remembered (``custom_refused``):
    the caller allocates again without the room."""
    try:
        buffer = custom.allocate((numel,), dtype=dtype, device=device)
        got = f"allocated {buffer.numel()} elements" if buffer.numel() != numel else ""
    except (RuntimeError, ValueError, TypeError, MemoryError) as error:
        buffer, got = None, f"refused ({type(error).__name__}: {error})"
    if not got:
        return buffer
    kind = api.removeprefix("set_custom_").replace("_", "-")
    warnings.warn(
        f"fully_shard: {where}: its custom {kind} ({api}) {got} when asked for {numel} "
        f"elements with room for the fingerprints of fsdp2's divergence checks, so the "
        f"checks are off for this group's {kind}s (ranks that run different paths may pair "
        f"them up unnoticed). Make the allocate() of {type(custom).__name__} serve any size "
        f"asked for, or turn the checks off everywhere (fsdp2.set_divergence_checks(False)).",
        stacklevel=4,
    )
    try:
        _REFUSED.setdefault(custom, set()).add((where, api))
    except TypeError:  # no weak references to it: nothing to remember it by, so the
        pass  # warning comes again at its next refusal (still correct, only louder)
    return None


# -- checks --------------------------------------------------------------------------------

# Above this many ranks, a check compares every rank's fingerprint in one torch op
# instead of reading them into Python (whose cost grows with the world size).
_FEW_RANKS = 16

# Checks whose fingerprints are on their way to host memory (accelerators), oldest first.
pending_checks: collections.deque[FingerprintCheck] = collections.deque()


class FingerprintCheck(abc.ABC):
    """The check of one collective's fingerprints: ``region`` is where they land in its
    result. On the CPU ``verify()`` reads it right after the wait; on an accelerator
    ``read_back`` copies it to host memory behind the collective first."""

    __slots__ = ("event", "groups", "host", "issued", "region", "stream")

    def __init__(self, issued: Issued, region: torch.Tensor, groups: Sequence[Any]) -> None:
        self.issued = issued
        self.region: torch.Tensor | None = region
        self.groups = groups  # the context's groups by index, to name others' fingerprints
        self.host: torch.Tensor | None = None
        self.event: Any = None
        self.stream: Stream = None

    def read_back(self, stream: Stream) -> None:
        """Queue the copy of the fingerprints to host memory on ``stream`` (current, right
        after the collective) and register the check for ``poll``/``settle``."""
        region = self.region
        if region is None:
            raise AssertionError("a fingerprint check read back twice")
        pinned = region.device.type != "cpu"
        host = torch.empty(region.shape, dtype=region.dtype, pin_memory=pinned)
        host.copy_(region, non_blocking=True)
        # The result's memory is not kept for the check: only these few bytes are.
        self.host, self.region, self.stream = host, None, stream
        self.event = queryable_event(stream, region.device)
        pending_checks.append(self)

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())

    def _source(self) -> torch.Tensor:
        source = self.host if self.host is not None else self.region
        if source is None:
            raise AssertionError("a fingerprint check without its region")
        return source

    def values(self) -> list[Any]:
        return self._source().tolist()

    @abc.abstractmethod
    def verify(self) -> None:
        """Raise ``DivergenceError`` on every rank if the fingerprints differ."""

    def _fail(self, headline: str, reason: str) -> None:
        pending_checks.clear()  # the step is lost: older checks would only repeat the news
        issued = self.issued
        raise_divergence(issued.process_group, headline, reason, issued, behind=False)

    def _consequence(self, result: str) -> str:
        """What became of the collective's result: checked at its wait on the CPU, unused;
        on an accelerator read later, but before the optimizer step."""
        if self.host is None:
            return f"{result} were not used."
        return (
            f"{result} may have been computed with (an accelerator's fingerprints are read "
            f"where the host waits), but no optimizer step has applied them."
        )

    def _where(self) -> str:
        issued = self.issued
        return (
            f"{issued.what} ({issued.fingerprint.stage.label}, sequence "
            f"{issued.fingerprint.seq}, step {issued.step})"
        )


class GatheredTails(FingerprintCheck):
    """An all-gather: ``region`` is the ``(ranks, 2)`` float64 view of every slot's tail."""

    __slots__ = ()

    def verify(self) -> None:
        own = _tail_values(self.issued.fingerprint)
        source = self._source()
        if source.shape[0] > _FEW_RANKS:
            # One comparison in torch: reading every rank's tail into Python costs about
            # 0.3 us per rank, 80 us per all-gather at 256 ranks.
            if bool(source.eq(source.new_tensor(own)).all()):
                return
        elif all(tuple(row) == own for row in source.tolist()):
            return
        rows = [tuple(row) for row in source.tolist()]
        ranks = global_ranks(self.issued.process_group)
        meant = "; ".join(
            f"rank {ranks[r]}: {_describe_tail(code, seq, self.groups)}"
            for r, (code, seq) in enumerate(rows)
        )
        self._fail(
            f"fully_shard: the ranks paired up different collectives: this rank's "
            f"{self._where()} met other ranks' messages. What each rank sent (its tail: "
            f"group, phase, sequence): {meant}. They ran different paths through the "
            f"sharded modules; {self._consequence('the gathered parameters')}",
            "its all-gather's tails differ",
        )


class SummedBlock(FingerprintCheck):
    """A reduce-scatter or all-reduce: ``region`` is this rank's reduced block; every
    position where this rank wrote 0 must still be 0."""

    __slots__ = ("ones",)

    def __init__(self, issued: Issued, region: torch.Tensor, groups: Sequence[Any]) -> None:
        super().__init__(issued, region, groups)
        self.ones = frozenset(block_ones(issued.fingerprint, region.numel()))

    def verify(self) -> None:
        values = self.values()
        if all(v == 0 for i, v in enumerate(values) if i not in self.ones):
            return
        self._fail(
            f"fully_shard: the ranks paired up different collectives: the fingerprints "
            f"summed by this rank's {self._where()} are not all its own, so at least one "
            f"other rank issued another collective here (below: what each was in); "
            f"{self._consequence('the reduced gradients')}",
            "its reduction's fingerprints differ",
        )


class ExchangedBlocks(FingerprintCheck):
    """An all-to-all: ``region`` is the ``(ranks, n)`` blocks received from each rank,
    each with the sender's zero pattern."""

    __slots__ = ("ones",)

    def __init__(self, issued: Issued, region: torch.Tensor, groups: Sequence[Any]) -> None:
        super().__init__(issued, region, groups)
        self.ones = frozenset(block_ones(issued.fingerprint, region.shape[-1]))

    def verify(self) -> None:
        source = self._source()
        if source.shape[0] > _FEW_RANKS:  # one comparison in torch, as for the tails
            pattern = torch.zeros(source.shape[-1], dtype=torch.bool, device=source.device)
            pattern[list(self.ones)] = True
            if bool(source.ne(0).eq(pattern).all()):
                return
        differ = [
            r
            for r, row in enumerate(source.tolist())
            if {i for i, v in enumerate(row) if v != 0} != self.ones
        ]
        if not differ:
            return
        ranks = global_ranks(self.issued.process_group)
        named = ", ".join(str(ranks[r]) for r in differ)
        self._fail(
            f"fully_shard: the ranks paired up different collectives: in this rank's "
            f"{self._where()}, the chunks from rank(s) {named} carry another collective's "
            f"fingerprint; {self._consequence('the exchanged gradients')}",
            "its all-to-all's fingerprints differ",
        )


def summed_block_check(
    issued: Issued | None, output: torch.Tensor, block: int, groups: Sequence[Any]
) -> SummedBlock | None:
    """The check of a reduction into ``output`` whose last ``block`` elements are the
    fingerprint block (None without a fingerprint)."""
    if issued is None or not block:
        return None
    return SummedBlock(issued, output[output.numel() - block :], groups)


def poll() -> None:
    """Verify the checks whose fingerprints have reached host memory (no waiting)."""
    while pending_checks and pending_checks[0].ready():
        pending_checks.popleft().verify()


def settle() -> None:
    """Verify every check still pending (before an optimizer step), waiting for the device
    where needed: for the newest pending event of each stream only, since a stream's
    events complete in order (at most one wait per communication stream, usually just the
    reduce-scatter stream's last). See [Note: named timeouts] in ``_divergence`` for the
    deadline of that wait."""
    global host_waits
    poll()
    newest = {id(check.stream): check for check in pending_checks}
    for check in newest.values():
        if not check.ready():
            host_waits += 1
            _wait_for(check)
    while pending_checks:
        pending_checks.popleft().verify()


# Waits for the device in ``settle`` so far (tests count them: the checks' one cost on an
# accelerator's hot path, one per stream with pending fingerprints at an optimizer step).
host_waits = 0


def discard_pending() -> None:
    """Forget the checks of collectives still on their way (a step abandoned by
    ``reset_iter_state``: its results are dropped, and so are their checks)."""
    pending_checks.clear()


def _wait_for(check: FingerprintCheck) -> None:
    """Wait for ``check``'s event: with a deadline before torch's watchdog where the
    process group's timeout is known (NCCL), polling for other ranks' reports."""
    event = check.event
    issued = check.issued
    timeout = _watchdog_timeout(issued.process_group)
    if timeout is None:
        event.synchronize()
        return
    deadline = time.monotonic() + WATCHDOG_FRACTION * timeout
    next_look = time.monotonic() + POLL_SECONDS
    store = process_group_store(issued.process_group, issued.what)
    pause = 0.0005
    while not event.query():
        now = time.monotonic()
        if now >= deadline:
            pending_checks.clear()
            raise_divergence(
                issued.process_group,
                f"fully_shard: the {issued.what} did not complete within "
                f"{WATCHDOG_FRACTION:.0%} of its process group's timeout ({timeout:g} s): "
                f"a rank is behind or issued another collective.",
                "its collective did not complete",
                issued,
            )
        if now >= next_look:
            next_look = now + POLL_SECONDS
            if peer_reported(issued.process_group, store):
                pending_checks.clear()
                raise_divergence(
                    issued.process_group,
                    f"fully_shard: another rank reported a problem while this rank waited "
                    f"for the {issued.what}.",
                    "waiting for its collective when another rank reported",
                    issued,
                )
        time.sleep(pause)
        pause = min(2 * pause, 0.05)


def _watchdog_timeout(group: Any) -> float | None:
    """Seconds of ``group``'s NCCL timeout (after which torch's watchdog aborts), or None
    for backends without a watchdog."""
    try:
        backend = group._get_backend(torch.device("cuda"))
        timeout = backend.options._timeout
    except (RuntimeError, AttributeError, ValueError, TypeError):
        return None
    if type(backend).__name__ != "ProcessGroupNCCL":
        return None
    return float(timeout.total_seconds())


# -- host staging on accelerators ------------------------------------------------------------


class _HostStaging:
    """Pinned host slots for the few bytes fsdp2 writes into device messages (a
    reduction's block): a non-blocking host-to-device copy from a slot, reused only once
    the event recorded after its last copy has passed (long before, normally)."""

    SLOTS = 64
    SLOT_BYTES = 256

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffer = torch.empty((self.SLOTS, self.SLOT_BYTES), dtype=torch.uint8).pin_memory()
        self.events: list[Any] = [None] * self.SLOTS
        self.next = 0

    def to_device(self, source: torch.Tensor) -> torch.Tensor:
        if source.numel() > self.SLOT_BYTES:
            raise AssertionError("staged fingerprint larger than a slot")
        i = self.next
        self.next = (i + 1) % self.SLOTS
        if self.events[i] is not None:
            self.events[i].synchronize()
        slot = self.buffer[i, : source.numel()]
        slot.copy_(source)
        out = torch.empty(source.numel(), dtype=torch.uint8, device=self.device)
        out.copy_(slot, non_blocking=True)
        module = torch.get_device_module(self.device.type)
        event = module.Event()
        event.record()
        self.events[i] = event
        return out


_STAGING: dict[torch.device, _HostStaging] = {}


def _staging(device: torch.device) -> _HostStaging:
    staging = _STAGING.get(device)
    if staging is None:
        staging = _STAGING[device] = _HostStaging(device)
    return staging
