"""How long ``plan_sharding`` takes: an 80-layer, dim-8192 Llama (70B parameters) on the
meta device, planned for 1,024 ranks, sequence 4,096, batch 1 (target: <= 30 s).

    python benchmarks/plan_speed.py                 # timed in this process, with the report
    python -m fsdp2.plan benchmarks.plan_speed:llama_70b --world-size 1024 --batch 1 \\
        --seq 4096 --mp bf16 --device cuda --loss cross-entropy      # the same, from the CLI

The factories here are what the CLI examples in docs/planning.md use.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from examples.llama import ModelArgs, Transformer  # noqa: E402


def llama_70b() -> Transformer:
    """Llama-3-70B's shapes: 80 layers, dim 8192, 64 heads with 8 KV heads, SwiGLU hidden
    28672, vocabulary 128256 (70.6B parameters). ``multiple_of`` is set so that
    ``examples/llama.py``'s hidden-size rule gives 28672."""
    return Transformer(
        ModelArgs(
            vocab_size=128256,
            dim=8192,
            n_layers=80,
            n_heads=64,
            n_kv_heads=8,
            multiple_of=28672,
            max_seq_len=4096,
        )
    )


def llama_8b() -> Transformer:
    """Llama-3-8B's shapes (hidden 14336)."""
    return Transformer(
        ModelArgs(
            vocab_size=128256,
            dim=4096,
            n_layers=32,
            n_heads=32,
            n_kv_heads=8,
            multiple_of=14336,
            max_seq_len=8192,
        )
    )


def llama_small() -> Transformer:
    """A 4-layer, dim-128 Llama: the CLI's smoke test."""
    return Transformer(ModelArgs(vocab_size=512, dim=128, n_layers=4, n_heads=4, max_seq_len=256))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=1024)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--device", default="cuda", help="device type planned for")
    args = p.parse_args(argv)
    from fsdp2 import MixedPrecisionPolicy, plan_sharding

    t0 = time.perf_counter()
    with torch.device("meta"):
        model = llama_70b()
    built = time.perf_counter() - t0
    tokens = torch.zeros(args.batch, args.seq, dtype=torch.long)

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        flat = logits.flatten(0, 1).float()
        return F.cross_entropy(flat, torch.zeros(flat.shape[0], dtype=torch.long))

    t1 = time.perf_counter()
    plan = plan_sharding(
        model,
        world_size=args.world_size,
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        example_inputs=tokens,
        loss_fn=loss_fn,
        device_type=args.device,
    )
    planned = time.perf_counter() - t1
    print(plan.report())
    params = sum(p.numel() for p in model.parameters())
    print(
        f"\n{params / 1e9:.1f}B parameters; model built on meta in {built:.1f} s; "
        f"plan_sharding took {planned:.1f} s (target <= 30 s: "
        f"{'met' if planned <= 30 else 'NOT met'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
