"""Count collectives by wrapping the public ``torch.distributed`` functions at call time.

While a :class:`CollectiveCounter` is active, every name in :data:`WRAPPED` is replaced, in both
``torch.distributed`` and ``torch.distributed.distributed_c10d`` (so ``dist.X(...)`` and
``from torch.distributed.distributed_c10d import X`` resolved at call time are both caught), by
a wrapper that records the call and forwards it. Nested calls (``all_gather_into_tensor``
delegates to ``all_gather_single`` in recent torch) are counted once, at the outermost call.

Per call it records the kind (all_gather / reduce_scatter / all_reduce / other), the API name,
the dtype, the local input and output bytes, and the wall time inside the call (``timing``). ``payload`` is the unsharded size moved by the
collective: the output of an all-gather, the input of a reduce-scatter, the tensor of an
all-reduce (the sum over the list for list-based APIs).

A function imported by value before the counter starts (``from torch.distributed import
all_gather_into_tensor`` at module import time) is not seen here; :class:`benchmarks.memory.
StepProbe` counts the ``c10d::*`` dispatcher ops as a cross-check that catches every path.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from benchmarks.memory import local_nbytes

# name -> (kind, index/name of the output argument, index/name of the input argument)
WRAPPED: dict[str, tuple[str, tuple[int, str], tuple[int, str]]] = {
    "all_gather_single": ("all_gather", (0, "output_tensor"), (1, "input_tensor")),
    "all_gather_into_tensor": ("all_gather", (0, "output_tensor"), (1, "input_tensor")),
    "_all_gather_base": ("all_gather", (0, "output_tensor"), (1, "input_tensor")),
    "all_gather": ("all_gather", (0, "tensor_list"), (1, "tensor")),
    "all_gather_coalesced": ("all_gather", (0, "output_tensor_lists"), (1, "input_tensor_list")),
    "reduce_scatter_single": ("reduce_scatter", (0, "output"), (1, "input")),
    "reduce_scatter_tensor": ("reduce_scatter", (0, "output"), (1, "input")),
    "_reduce_scatter_base": ("reduce_scatter", (0, "output"), (1, "input")),
    "reduce_scatter": ("reduce_scatter", (0, "output"), (1, "input_list")),
    "all_reduce": ("all_reduce", (0, "tensor"), (0, "tensor")),
    "all_reduce_coalesced": ("all_reduce", (0, "tensors"), (0, "tensors")),
    "broadcast": ("other", (0, "tensor"), (0, "tensor")),
    "all_to_all_single": ("other", (0, "output"), (1, "input")),
    "barrier": ("other", (-1, ""), (-1, "")),
}


def _arg(args: tuple, kwargs: dict, spec: tuple[int, str]) -> Any:
    idx, name = spec
    if name and name in kwargs:
        return kwargs[name]
    if 0 <= idx < len(args):
        return args[idx]
    return None


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return local_nbytes(obj)
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return 0


def _dtype(obj: Any) -> str:
    if isinstance(obj, torch.Tensor):
        return str(obj.dtype).replace("torch.", "")
    if isinstance(obj, (list, tuple)) and obj:
        return _dtype(obj[0])
    return "-"


class CollectiveCounter:
    """Context manager counting collectives issued through the ``torch.distributed`` API."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self._saved: list[tuple[Any, str, Any]] = []
        self._tls = threading.local()

    def __enter__(self) -> CollectiveCounter:
        for name, spec in WRAPPED.items():
            orig = getattr(c10d, name, None) or getattr(dist, name, None)
            if orig is None:
                continue
            wrapper = self._wrap(name, spec, orig)
            for mod in (dist, c10d):
                if hasattr(mod, name):
                    self._saved.append((mod, name, getattr(mod, name)))
                    setattr(mod, name, wrapper)
        return self

    def __exit__(self, *exc: object) -> None:
        for mod, name, orig in reversed(self._saved):
            setattr(mod, name, orig)
        self._saved.clear()

    def _wrap(self, name: str, spec: tuple, orig: Any) -> Any:
        kind, out_spec, in_spec = spec

        @functools.wraps(orig)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._tls, "depth", 0)
            if depth == 0:
                out_obj, in_obj = _arg(args, kwargs, out_spec), _arg(args, kwargs, in_spec)
                out_b, in_b = _nbytes(out_obj), _nbytes(in_obj)
                payload = in_b if kind == "reduce_scatter" else out_b
                self.calls.append(
                    {
                        "api": name,
                        "kind": kind,
                        "dtype": _dtype(in_obj if in_obj is not None else out_obj),
                        "in_bytes": in_b,
                        "out_bytes": out_b,
                        "payload_bytes": payload,
                    }
                )
            self._tls.depth = depth + 1
            start = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                self._tls.depth = depth
                if depth == 0:
                    self.calls[-1]["seconds"] = time.perf_counter() - start

        return wrapper

    def timing(self) -> dict[str, Any]:
        """Wall time spent inside the collective calls, in total and per kind. Kept apart
        from ``summary`` (which is deterministic). Meaningful where a call returns only
        when the collective is done: the fake process group (synchronous). On real ranks
        an ``async_op`` call returns at once and the wait happens elsewhere."""
        by_kind: dict[str, float] = defaultdict(float)
        for c in self.calls:
            by_kind[c["kind"]] += c.get("seconds", 0.0)
        return {"call_s": sum(by_kind.values()), "by_kind": dict(by_kind)}

    def summary(self) -> dict[str, Any]:
        """Per kind: count, payload bytes, dtypes; plus per API name counts."""
        by_kind: dict[str, dict[str, Any]] = defaultdict(
            lambda: {"count": 0, "payload_bytes": 0, "in_bytes": 0, "out_bytes": 0, "dtypes": {}}
        )
        by_api: dict[str, int] = defaultdict(int)
        for c in self.calls:
            k = by_kind[c["kind"]]
            k["count"] += 1
            k["payload_bytes"] += c["payload_bytes"]
            k["in_bytes"] += c["in_bytes"]
            k["out_bytes"] += c["out_bytes"]
            k["dtypes"][c["dtype"]] = k["dtypes"].get(c["dtype"], 0) + 1
            by_api[c["api"]] += 1
        return {
            "by_kind": {k: dict(v) for k, v in by_kind.items()},
            "by_api": dict(by_api),
            "total_count": len(self.calls),
            "total_payload_bytes": sum(c["payload_bytes"] for c in self.calls),
        }
