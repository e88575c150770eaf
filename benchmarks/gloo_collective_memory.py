"""How much hidden memory and time each gloo collective costs for one reduce-scatter's worth
of data: the measurement behind the large-few memory figure on real gloo ranks.

gloo implements ``reduce_scatter_tensor`` as an all-reduce on a private copy of the whole
input, and copies this rank's chunk out when the work is waited on. That copy is allocated
in C++ on a gloo thread, so a dispatch-mode tracker sees it only when ``Work.wait()`` splits
it. Its size is the whole input, and it lives from the start of the collective until the
wait. Each variant runs in fresh processes, because the resident-set high-water mark
(``ru_maxrss``) never goes down::

    python benchmarks/gloo_collective_memory.py --world-size 2 --mib 96

The first figure is the growth of the resident-set high-water mark over three collectives,
in MiB. The second is the time per collective.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time

VARIANTS = ("reduce_scatter_tensor", "reduce_scatter_list", "all_reduce", "all_gather_into_tensor")


def _worker(variant: str, mib: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ws, rank = dist.get_world_size(), dist.get_rank()
    chunk = mib * 2**20 // 4 // ws  # the input is ``mib`` MiB of fp32, ``ws`` chunks
    full = torch.randn(ws * chunk)
    part = torch.zeros(chunk)
    calls = {
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(part, full),
        "reduce_scatter_list": lambda: dist.reduce_scatter(part, list(full.view(ws, chunk))),
        "all_reduce": lambda: dist.all_reduce(full),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(full, part),
    }
    call = calls[variant]
    dist.barrier()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    for _ in range(3):
        call()
    seconds = (time.perf_counter() - start) / 3
    growth_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    if rank == 0:
        print(f"{variant:24s} {growth_mib:8.1f} MiB {seconds * 1e3:9.1f} ms", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--mib", type=int, default=96, help="input size of the reduction")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.mib)
        return
    print(f"gloo, {args.world_size} ranks, {args.mib} MiB fp32 input: peak RSS growth, time")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for variant in VARIANTS:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc-per-node={args.world_size}", __file__]
        cmd += ["--worker", variant, "--mib", str(args.mib)]
        subprocess.run(cmd, check=True, env=env, stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    main()
