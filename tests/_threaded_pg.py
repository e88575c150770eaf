"""fsdp2 on torch's in-process ``threaded`` process group (two threads as two ranks), the
backend torch's multi-threaded FSDP tests and some users' unit tests run on. Its Work
objects cannot wait with a finite timeout, which the divergence checks' watching wait
asks for ([Note: named timeouts] in ``fsdp2/_divergence.py``).

Run as a fresh process (the backend changes process-wide state):
``python tests/_threaded_pg.py``. Prints one JSON object: per rank, the largest
difference from a non-sharded model after two AdamW steps, or the error.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import threading

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fsdp2

WORLD = 2
_INIT = threading.Lock()


def _worker(rank: int, store: dist.Store, results: dict[int, object]) -> None:
    try:
        dist.init_process_group(backend="threaded", rank=rank, world_size=WORLD, store=store)
        with _INIT:  # the global RNG is shared by the threads: one model at a time
            torch.manual_seed(0)
            reference = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        model = copy.deepcopy(reference)
        fsdp2.fully_shard(model[0])
        fsdp2.fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.1)
        for step in range(2):
            batch = torch.randn(2 * WORLD, 4, generator=torch.Generator().manual_seed(step))
            model(batch[2 * rank : 2 * rank + 2]).square().mean().backward()
            reference(batch).square().mean().backward()
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        results[rank] = max(
            (p.full_tensor() - q).abs().max().item()
            for p, q in zip(model.parameters(), reference.parameters())
        )
    except Exception as error:  # reported, not raised: the other thread may be waiting
        results[rank] = f"{type(error).__name__}: {error}"


def main() -> None:
    from torch.testing._internal.distributed.multi_threaded_pg import _install_threaded_pg

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    store = dist.HashStore()
    results: dict[int, object] = {}
    threads = [threading.Thread(target=_worker, args=(r, store, results)) for r in range(WORLD)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    print(json.dumps({str(rank): results.get(rank, "did not finish") for rank in range(WORLD)}))
    sys.stdout.flush()
    os._exit(0)  # a thread still waiting must not keep the process alive


if __name__ == "__main__":
    main()
