"""Peak resident set of a few training steps, one implementation per launch: the memory
figure that also sees what backends allocate outside the tensors (gloo's staging buffers),
which the dispatch-level probe of ``memory.py`` cannot.

Each implementation runs in fresh processes, because the resident-set high-water mark
(``ru_maxrss``) never goes down. Set ``MALLOC_MMAP_THRESHOLD_=65536`` so that freed large
buffers leave the resident set instead of staying in glibc's heap::

    MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/resident_set.py --world-size 2

prints, per implementation, rank 0's peak resident set after the warm-up steps and at the
end, in MiB. ``fsdp2-sync-ag`` is fsdp2 with every all-gather waited on at once (no
overlap with compute), to isolate what the overlap costs on gloo.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys

IMPLS = ("fsdp2", "torch", "fsdp2-sync-ag")


def _worker(impl: str, steps: int, dim: int, layers: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed._tensor.common_dtensor import (
        ModelArgs,
        Transformer,
    )

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if impl.startswith("fsdp2"):
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import fsdp2 as api

        if impl == "fsdp2-sync-ag":
            import fsdp2._param_group as param_group

            issue = param_group.all_gather_flat

            def waited(*args, **kwargs):  # type: ignore[no-untyped-def]
                pending = issue(*args, **kwargs)
                if pending.work is not None:
                    pending.work.wait()
                return pending

            param_group.all_gather_flat = waited
    else:
        import torch.distributed.fsdp as api  # type: ignore[no-redef]
    torch.manual_seed(0)
    args = ModelArgs(
        vocab_size=1024, n_layers=layers, dim=dim, n_heads=16, max_seq_len=64, weight_tying=False
    )
    model = Transformer(args)
    for block in model.layers:
        api.fully_shard(block)
    api.fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 1024, (1, 32))

    def peak_mib() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    warm = 0.0
    for step in range(steps):
        model(tokens).sum().backward()
        optim.step()
        optim.zero_grad()
        if step == 1:
            warm = peak_mib()
    if dist.get_rank() == 0:
        print(f"{impl:14s} after 2 steps {warm:7.0f} MiB, after {steps} {peak_mib():7.0f} MiB")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--impls", default=",".join(IMPLS[:2]), help=f"comma list of {IMPLS}")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="launches per implementation")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.steps, args.dim, args.layers)
        return
    impls = args.impls.split(",")
    unknown = [impl for impl in impls if impl not in IMPLS]
    if unknown:
        parser.error(f"--impls: unknown {unknown}; choose from {', '.join(IMPLS)}")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    print(
        f"gloo, {args.world_size} ranks, MALLOC_MMAP_THRESHOLD_={env.get('MALLOC_MMAP_THRESHOLD_')}"
    )
    for _ in range(args.repeats):
        for impl in impls:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            cmd += [f"--nproc-per-node={args.world_size}", __file__, "--worker", impl]
            cmd += [
                "--steps",
                str(args.steps),
                "--dim",
                str(args.dim),
                "--layers",
                str(args.layers),
            ]
            subprocess.run(cmd, check=True, env=env, stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    main()
