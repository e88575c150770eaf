"""A stream-race checker that runs fsdp2's accelerator code path on the CPU.

On the CPU fsdp2 has no streams (every stream is ``None``) and orders work by waiting on
gloo's ``Work`` handles, so its CUDA ordering (which stream waits for which event, when a
buffer may be freed) never runs in CI. ``stream_sanitizer()`` makes it run:

* ``fsdp2._stream_utils`` gets a stand-in device module for the CPU, so ``CommStreams``
  creates named stand-in streams and fsdp2 takes the same branches as on CUDA: collectives
  issued synchronously under a side stream, events recorded and waited on, buffers kept
  until their release event is waited on. (gloo still runs each collective to completion
  when it is issued: the stand-in streams order nothing in fact, they only keep score.)
* Every stream keeps a vector clock (how far it has waited for every other stream);
  ``record_event`` snapshots it, ``wait_event`` / ``wait_stream`` merge it.
* A ``TorchDispatchMode`` sees every operator (and ``resize_`` of storages, which is not
  an operator), charges it to the current stand-in stream, and records which storages it
  reads and writes (a ``DTensor`` stands for its local tensor; ``c10d`` collectives write
  their first argument). An access that is not ordered after a conflicting access from
  another stream is a *race*: on a GPU the two kernels could overlap.
* Freed memory (a storage whose last reference died, or ``resize_(0)``) goes back to the
  pool of the stream it was allocated on, as with the CUDA caching allocator, which may
  hand it to that stream's next allocation without waiting for other streams. The first
  access to such a new allocation must be ordered after every other stream's use of
  memory freed to that pool: otherwise it is a *reuse race*. This is the hazard that
  ``Tensor.record_stream`` exists for and that fsdp2 avoids by holding buffers until an
  event (see [Note: buffer lifetime across streams] in ``fsdp2/_stream_utils.py``).

The check is conservative about reuse (any freed block of the pool could serve any
allocation), and exact about operator order, which is deterministic on one rank.

What it does not see: the host side of CPU offload (on CUDA, a pinned shard's
host-to-device copy runs asynchronously while the CPU goes on; here host and device are
one), work a backend does outside the dispatcher (NCCL's own buffers), and the autograd
engine's own stream switching (it runs each backward op on its forward op's stream; here
every op runs on the stream current in Python, which is the same as long as forward
runs on one stream per step, as in every scenario of ``tests/test_stream_races.py``).
"""

from __future__ import annotations

import contextlib
import time
import traceback
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from fsdp2 import _host_buffers, _stream_utils

Epoch = tuple[int, int]  # (stream index, that stream's clock at the access)


class FakeEvent:
    def __init__(self, stream: FakeStream, clock: dict[int, int]) -> None:
        self.stream, self.clock = stream, clock

    def __repr__(self) -> str:
        return f"event@{self.stream.name}{self.clock}"


class FakeStream:
    """A stand-in stream: its vector clock says, per stream index, up to which of that
    stream's operations this stream is ordered after."""

    device = torch.device("cpu")

    def __init__(self, sanitizer: StreamSanitizer, name: str) -> None:
        self.sanitizer = sanitizer
        self.index = len(sanitizer.streams)
        self.name = name
        self.clock: dict[int, int] = {self.index: 0}
        sanitizer.streams.append(self)

    def tick(self) -> Epoch:
        self.clock[self.index] += 1
        return (self.index, self.clock[self.index])

    def ordered_after(self, epoch: Epoch) -> bool:
        return self.clock.get(epoch[0], 0) >= epoch[1]

    def _merge(self, clock: dict[int, int]) -> None:
        for index, value in clock.items():
            if self.clock.get(index, 0) < value:
                self.clock[index] = value

    def record_event(self) -> FakeEvent:
        self.tick()
        return FakeEvent(self, dict(self.clock))

    def wait_event(self, event: FakeEvent) -> None:
        self._merge(event.clock)

    def wait_stream(self, other: FakeStream) -> None:
        self._merge(other.clock)

    def __repr__(self) -> str:
        return self.name


class TimingEvent:
    """``Event(enable_timing=True)`` on a stand-in stream, for tools that time streams
    (``fsdp2.trace``): it keeps the stream it was recorded on and the host time. The
    stand-in device has passed it once ``device_caught_up`` is set (``query()``) or once
    it is synchronized; ``elapsed_time`` raises before, as CUDA's does."""

    def __init__(self, sanitizer: StreamSanitizer, enable_timing: bool = False) -> None:
        self.sanitizer = sanitizer
        self.stream: FakeStream | None = None
        self.time_ns = 0
        self.done = False

    def record(self, stream: FakeStream | None = None) -> None:
        self.stream = stream if stream is not None else self.sanitizer.current
        self.time_ns = time.perf_counter_ns()
        self.sanitizer.timing_events.append(self)

    def query(self) -> bool:
        self.done = self.done or self.sanitizer.device_caught_up
        return self.done

    def synchronize(self) -> None:
        self.sanitizer.synchronized.append(self)
        self.done = True

    def elapsed_time(self, end: TimingEvent) -> float:
        if not (self.query() and end.query()):
            raise RuntimeError("elapsed_time: an event the device has not completed")
        return (end.time_ns - self.time_ns) / 1e6


class _FakeDeviceModule:
    """What ``torch.get_device_module`` returns for a device with streams, reduced to what
    ``fsdp2._stream_utils`` calls."""

    def __init__(self, sanitizer: StreamSanitizer) -> None:
        self.sanitizer = sanitizer

    def Stream(self, priority: int = 0) -> FakeStream:  # torch's name
        return FakeStream(self.sanitizer, f"side{len(self.sanitizer.streams)}")

    def current_stream(self) -> FakeStream:
        return self.sanitizer.current

    def Event(self, enable_timing: bool = False) -> TimingEvent:  # torch's name
        return TimingEvent(self.sanitizer, enable_timing)

    @contextlib.contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        previous = self.sanitizer.current
        self.sanitizer.current = stream
        try:
            yield
        finally:
            self.sanitizer.current = previous


@dataclass
class _Block:
    """One storage's allocation and the accesses that matter for the next one."""

    alloc: FakeStream
    nbytes: int
    what: str
    fresh: bool = True  # allocated, not yet accessed (a reused block is first written)
    last_write: Epoch | None = None
    write_op: str = ""
    reads: dict[int, tuple[Epoch, str]] = field(default_factory=dict)  # stream -> last read
    last_use: dict[int, tuple[Epoch, str]] = field(default_factory=dict)  # stream -> last use


class StreamSanitizer:
    def __init__(self, max_reports: int = 20) -> None:
        self.streams: list[FakeStream] = []
        self.compute = FakeStream(self, "compute")
        self.current = self.compute
        self.module = _FakeDeviceModule(self)
        self.races: list[str] = []
        self.max_reports = max_reports
        # Timing events (``TimingEvent``): every one recorded, those synchronized, and
        # whether the stand-in device has passed the others.
        self.timing_events: list[TimingEvent] = []
        self.synchronized: list[TimingEvent] = []
        self.device_caught_up = True
        self.ops = 0
        self.ops_by_stream: dict[str, int] = {}  # accesses charged to each stream
        # Set to a list to record every access (operator, stream, epoch, buffer, write,
        # the stream's clock): a debugging aid for a reported race.
        self.trace: list[tuple] | None = None
        self._blocks: dict[int, _Block] = {}
        # Freed blocks per allocating stream whose use by other streams is not yet known
        # to be ordered before that stream's next allocation.
        self._freed: dict[int, list[_Block]] = {}

    # -- storages --------------------------------------------------------------------------
    def _key(self, tensor: torch.Tensor) -> tuple[int, torch.UntypedStorage] | None:
        if tensor.device.type != "cpu" or tensor.layout != torch.strided:
            return None
        storage = tensor.untyped_storage()
        key = id(storage)
        if key not in self._blocks:
            # First sight as an input: allocated before the checker (on the compute
            # stream, current then), or outside the dispatcher by a collective's backend
            # (gloo's reduce-scatter copies its input and splits the copy when it is
            # waited on), on the stream current now; already written.
            block = _Block(self.current, storage.nbytes(), _describe(tensor), fresh=False)
            self._track(key, storage, block)
        return key, storage

    def _track(self, key: int, storage: torch.UntypedStorage, block: _Block) -> None:
        self._blocks[key] = block
        weakref.finalize(storage, self._on_storage_death, key)

    def _on_storage_death(self, key: int) -> None:
        block = self._blocks.pop(key, None)
        if block is not None:
            self._free(block)

    def _free(self, block: _Block) -> None:
        if block.nbytes == 0:
            return
        # Memory only its allocating stream used is safe for that stream's next
        # allocation; other streams' uses must be waited for first.
        if any(index != block.alloc.index for index in block.last_use):
            self._freed.setdefault(block.alloc.index, []).append(block)

    def on_resize(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        key = id(storage)
        old = self._blocks.get(key)
        if nbytes == 0:
            if old is not None:
                self._free(old)
                old.nbytes, old.last_use, old.reads, old.last_write = 0, {}, {}, None
        elif old is None or old.nbytes == 0:
            block = _Block(self.current, nbytes, old.what if old else "resized storage")
            if old is None:
                self._track(key, storage, block)
            else:
                self._blocks[key] = block

    # -- accesses --------------------------------------------------------------------------
    def _report(self, message: str) -> None:
        if len(self.races) >= self.max_reports:
            return
        frames = [
            f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}"
            for f in traceback.extract_stack()
            if "/fsdp2/" in f.filename or "/tests/" in f.filename
        ]
        frames = [f for f in frames if "_stream_sanitizer" not in f]
        self.races.append(message + "\n    at " + " <- ".join(reversed(frames[-6:])))

    def access(self, block: _Block, op: str, write: bool) -> None:
        stream = self.current
        if block.fresh:
            block.fresh = False
            self._check_reuse(block, op, stream)
        epoch = stream.tick()
        self.ops_by_stream[stream.name] = self.ops_by_stream.get(stream.name, 0) + 1
        if self.trace is not None:
            self.trace.append((op, stream.name, epoch, block.what, write, dict(stream.clock)))
        if block.last_write is not None and not stream.ordered_after(block.last_write):
            self._report(
                f"{op} on {stream} {'writes' if write else 'reads'} {block.what} written by "
                f"{block.write_op} on {self.streams[block.last_write[0]]} without waiting"
            )
        if write:
            for index, (read, read_op) in block.reads.items():
                if index != stream.index and not stream.ordered_after(read):
                    self._report(
                        f"{op} on {stream} writes {block.what} still read by {read_op} on "
                        f"{self.streams[index]} without waiting"
                    )
            block.last_write, block.write_op, block.reads = epoch, op, {}
        else:
            block.reads[stream.index] = (epoch, op)
        block.last_use[stream.index] = (epoch, op)

    def _check_reuse(self, block: _Block, op: str, stream: FakeStream) -> None:
        pool = self._freed.get(block.alloc.index)
        if not pool:
            return
        alloc = block.alloc
        for freed in pool:
            for index, (epoch, use_op) in freed.last_use.items():
                if index != stream.index and not stream.ordered_after(epoch):
                    self._report(
                        f"{op} on {stream} is the first use of memory allocated on {alloc}, "
                        f"whose pool holds {freed.what} (freed while {use_op} on "
                        f"{self.streams[index]} was not known to be done): the caching "
                        "allocator may hand that block over"
                    )
        # Whatever the allocating stream is now ordered after can never race again.
        self._freed[alloc.index] = [
            freed
            for freed in pool
            if not all(alloc.ordered_after(e) for e, _ in freed.last_use.values())
        ]

    def on_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        self.ops += 1
        name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        schema = func._schema
        accesses: list[tuple[torch.Tensor, bool]] = []
        if schema.name.startswith("c10d::"):
            # Collectives: the first argument is the output (written, in place for
            # all-reduce), the other tensors are read.
            for position, value in enumerate(args):
                for tensor in _tensors(value):
                    accesses.append((tensor, position == 0))
        else:
            named = dict(zip((a.name for a in schema.arguments), args))
            named.update(kwargs)
            for argument in schema.arguments:
                if argument.name not in named:
                    continue
                write = argument.alias_info is not None and argument.alias_info.is_write
                for tensor in _tensors(named[argument.name]):
                    accesses.append((tensor, write))
        input_keys: set[int] = set()
        for tensor, write in accesses:
            found = self._key(tensor)
            if found is None:
                continue
            key, storage = found
            input_keys.add(key)
            block = self._blocks[key]
            if block.nbytes != storage.nbytes():
                # Resized inside an operator (an ``out=`` argument grown by the kernel).
                self._free(block)
                block = _Block(self.current, storage.nbytes(), _describe(tensor))
                self._blocks[key] = block
            self.access(block, name, write)
        allocates_only = name.startswith(("empty", "new_empty"))
        for tensor in _tensors(out):
            if tensor.device.type != "cpu" or tensor.layout != torch.strided:
                continue
            storage = tensor.untyped_storage()
            key = id(storage)
            if key in input_keys:
                continue
            block = self._blocks.get(key)
            if block is None:
                block = _Block(self.current, storage.nbytes(), _describe(tensor))
                self._track(key, storage, block)
            if not allocates_only and not _is_view_op(func):
                self.access(block, name, True)


def _is_view_op(func: Any) -> bool:
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


def _tensors(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for leaf in tree_flatten(value)[0]:
        if not isinstance(leaf, torch.Tensor):
            continue
        if isinstance(leaf, DTensor):
            found.append(leaf._local_tensor)
        elif is_traceable_wrapper_subclass(leaf):
            names, _ = leaf.__tensor_flatten__()
            found.extend(getattr(leaf, n) for n in names)
        else:
            found.append(leaf)
    return found


def _describe(tensor: torch.Tensor) -> str:
    return f"a {tensor.untyped_storage().nbytes()}-byte {tensor.dtype} buffer"


class _Mode(TorchDispatchMode):
    def __init__(self, sanitizer: StreamSanitizer) -> None:
        super().__init__()
        self.sanitizer = sanitizer

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.sanitizer.on_op(func, args, kwargs, out)
        return out


@contextlib.contextmanager
def stream_sanitizer() -> Iterator[StreamSanitizer]:
    """Run the block with stand-in streams and race checks; ``races`` lists what it found.

    fsdp2 must be lazily initialized inside the block (its streams are created then)."""
    sanitizer = StreamSanitizer()
    saved = (
        _stream_utils.device_module,
        _stream_utils._stream_context,
        _host_buffers._CAN_SWAP,
        torch.UntypedStorage.resize_,
    )
    real_resize = torch.UntypedStorage.resize_

    def device_module(device: torch.device) -> Any:
        if device.type == "cpu":
            return sanitizer.module
        return saved[0](device)

    def resize(storage: torch.UntypedStorage, nbytes: int) -> Any:
        result = real_resize(storage, nbytes)
        sanitizer.on_resize(storage, nbytes)
        return result

    _stream_utils.device_module = device_module
    _stream_utils._stream_context = sanitizer.module.stream
    _host_buffers._CAN_SWAP = False  # the host pool is CPU-only; follow the CUDA path
    torch.UntypedStorage.resize_ = resize  # type: ignore[method-assign]
    try:
        with _Mode(sanitizer):
            yield sanitizer
    finally:
        (
            _stream_utils.device_module,
            _stream_utils._stream_context,
            _host_buffers._CAN_SWAP,
            torch.UntypedStorage.resize_,
        ) = saved
