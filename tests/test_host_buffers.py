"""The CPU buffer pool ([Note: host buffer pool] in ``fsdp2/_host_buffers.py``).

Unit checks of its contract (reuse, storage identity, eviction, a miss frees what is kept,
a returned tensor is left empty), then training with every buffer pooled: the same
numbers as without the pool (bitwise) and as the non-sharded reference, buffers actually
reused, and peak live tensor memory no higher than with the pool off.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _helpers import ParityCase, assert_parity, run_parity
from _launcher import run_ranks

import fsdp2._fingerprints as fingerprints
import fsdp2._host_buffers as host_buffers
from fsdp2._host_buffers import HostBufferPool

CPU = torch.device("cpu")
needs_swap = pytest.mark.skipif(
    not host_buffers._CAN_SWAP, reason="this torch has no UntypedStorage._swap_data_ptr_"
)


def _pool(**kwargs: int) -> HostBufferPool:
    return HostBufferPool(CPU, min_bytes=0, **kwargs)


@needs_swap
def test_released_buffer_is_reused_and_left_empty() -> None:
    pool = _pool()
    pool.allow_slack(16 * 4)  # one rank's padded gradient flags (64 bytes), set at lazy init
    a = pool.empty(1000, torch.float32, CPU)
    a.fill_(3.0)
    address = a.data_ptr()
    pool.release(a)
    assert a.untyped_storage().nbytes() == 0  # a stale user cannot share memory
    b = pool.empty(1000, torch.float32, CPU)
    assert b.data_ptr() == address and pool.reused == 1
    assert b.shape == (1000,) and torch.equal(b, torch.full((1000,), 3.0))
    # A slightly larger request (a reduce-scatter input with its flags) fits too.
    pool.release(b)
    c = pool.empty(1000 + 16, torch.float32, CPU)
    assert c.data_ptr() == address and pool.reused == 2


@needs_swap
def test_fill_and_drain_keep_the_storage_and_its_views() -> None:
    pool = _pool()
    flat = torch.empty(64)
    view = flat[8:16].view(2, 4)  # like an unsharded parameter
    storage = flat.untyped_storage()
    storage.resize_(0)
    spare = pool.empty(64, torch.float32, CPU)
    address = spare.data_ptr()
    pool.release(spare)
    pool.fill(storage, 64 * 4)
    assert flat.untyped_storage()._cdata == storage._cdata  # the same StorageImpl
    assert flat.data_ptr() == address
    flat.copy_(torch.arange(64.0))
    assert torch.equal(view, torch.arange(8.0, 16.0).view(2, 4))
    pool.drain(storage)
    assert storage.nbytes() == 0 and pool.pooled_bytes >= 64 * 4


@needs_swap
def test_full_pool_evicts_oldest_and_a_miss_frees_everything() -> None:
    pool = _pool(max_buffers=1, slack_bytes=0)
    small, large = pool.empty(10, torch.float32, CPU), pool.empty(1000, torch.float32, CPU)
    pool.release(small)
    pool.release(large)  # evicts ``small``
    assert pool.pooled_bytes == 4000
    fresh = pool.empty(10, torch.float32, CPU)  # a miss: ``large`` is freed, not kept
    assert pool.reused == 0 and pool.pooled_bytes == 0 and fresh.numel() == 10


def test_disabled_off_the_cpu_and_below_the_threshold() -> None:
    assert not HostBufferPool(torch.device("meta")).enabled
    pool = HostBufferPool(CPU, min_bytes=1 << 20)
    t = pool.empty(16, torch.float32, CPU)
    pool.release(t)
    assert pool.pooled_bytes == 0 and t.untyped_storage().nbytes() == 64


def _train_pooled(case: ParityCase, pooled: bool) -> dict:
    """Rank function: parity run with every buffer pooled (or none), plus pool counters."""
    host_buffers.MIN_POOLED_BYTES = 0 if pooled else 1 << 62
    created: list[HostBufferPool] = []
    init = HostBufferPool.__init__

    def recording_init(self: HostBufferPool, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        created.append(self)

    HostBufferPool.__init__ = recording_init  # type: ignore[method-assign]
    try:
        report = run_parity(case)
    finally:
        HostBufferPool.__init__ = init  # type: ignore[method-assign]
        host_buffers.MIN_POOLED_BYTES = 8 << 20
    report["reused"] = sum(p.reused for p in created)
    report["rank_world"] = (dist.get_rank(), dist.get_world_size())
    return report


@needs_swap
@pytest.mark.parametrize("reshard", [True, False])
def test_training_with_every_buffer_pooled(reshard: bool) -> None:
    case = ParityCase(impl="fsdp2", reshard_after_forward=reshard, n_layers=3, steps=3)
    pooled = run_ranks(_train_pooled, 2, case, True, timeout=90)
    assert_parity(pooled, case)
    assert all(r["reused"] > 0 for r in pooled)
    plain = run_ranks(_train_pooled, 2, case, False, timeout=90)
    assert all(r["reused"] == 0 for r in plain)
    for a, b in zip(pooled, plain):  # bitwise: the pool changes where bytes live, only
        assert [s["loss_fsdp"] for s in a["steps"]] == [s["loss_fsdp"] for s in b["steps"]]
        assert [s["param_worst"] for s in a["steps"]] == [s["param_worst"] for s in b["steps"]]


def _peak_bytes(tmp_path, name: str) -> int:  # type: ignore[no-untyped-def]
    from benchmarks import compare

    out = tmp_path / f"{name}.json"
    argv = ["--inprocess", "--config", "large-few", "--layers", "2", "--dim", "256"]
    argv += ["--fake-world-size", "2", "--steps", "1", "--warmup", "1", "--ttfs-repeats", "1"]
    argv += ["--impls", "fsdp2", "--json", str(out)]
    assert compare.main(argv) == 0
    import json

    (entry,) = json.loads(out.read_text())["runs"]
    return entry["results"]["fsdp2"]["memory"]["peak_bytes"]


@needs_swap
def test_pool_does_not_raise_peak_memory(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Kept buffers are live memory (the benchmark probe follows ``_swap_data_ptr_``): the
    pool may cost at most its slack per buffer alive at the peak, never a whole buffer.
    The slack is the largest group's gradient flags: 2 ranks x 9 block parameters x 4
    bytes, padded to 64 bytes per rank (a fixed 64 KiB slack, as before, fails this), and
    the divergence checks' fingerprints: a 64-byte block per rank's reduction chunk and
    at most 32 bytes of tail per rank's all-gather slot."""
    pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    without = _peak_bytes(tmp_path, "without")
    monkeypatch.setattr(host_buffers, "MIN_POOLED_BYTES", 0)
    pooled = _peak_bytes(tmp_path, "pooled")
    flag_bytes = 2 * 64  # 9 flags x 4 bytes = 36, padded to 64 per rank
    fingerprint_bytes = 2 * (fingerprints.BLOCK_BYTES + 2 * fingerprints.TAIL_BYTES)
    assert pooled <= without + 4 * (flag_bytes + fingerprint_bytes), (pooled, without)
