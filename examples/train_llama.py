"""Train a small Llama-style model with fully sharded data parallelism (FSDP2).

This is the project's end-to-end example. It shows the usual FSDP2 recipe:

1. Build the model (``examples/llama.py``) on every rank with the same deterministic
   initialization.
2. Optionally wrap each transformer block for activation checkpointing.
3. Shard it with ``fully_shard``: each transformer block first, then the root module
   (``llama.parallelize``), over a 1-D ``DeviceMesh`` of all ranks. Each rank now holds
   only its shard of every parameter, as a ``DTensor``.
4. Build the optimizer *after* sharding, so that it sees (and keeps state for) only the
   local shards.
5. Train with a plain ``loss.backward(); optimizer.step()`` loop: FSDP all-gathers the
   parameters before each block's forward and backward, and reduce-scatters the
   gradients afterwards.

The data is a synthetic, deterministic token stream that is easy to learn, so the loss
visibly goes down within a few dozen steps. Every step draws one global batch; each rank
trains on its own slice of it.

Run it with::

    torchrun --standalone --nproc-per-node 2 examples/train_llama.py
    torchrun --standalone --nproc-per-node 2 examples/train_llama.py --impl torch
    torchrun --standalone --nproc-per-node 2 examples/train_llama.py --mixed-precision bf16
    torchrun --standalone --nproc-per-node 2 examples/train_llama.py --checkpoint-dir ckpt
    torchrun --standalone --nproc-per-node 4 examples/train_llama.py --checkpoint-dir ckpt --resume
    torchrun --standalone --nproc-per-node 2 examples/train_llama.py --steps 10 --trace out

With ``--checkpoint-dir`` the model, the optimizer and the step are saved with
``fsdp2.save_checkpoint`` (sharded ``torch.distributed.checkpoint``, crash-safe: a killed
save never replaces the previous checkpoint) every ``--checkpoint-every`` steps and at the
end; ``--resume`` loads the latest one, at any world size, and continues from its step.

With ``--trace DIR`` the training loop runs inside ``fsdp2.trace_schedule(model)``, and
rank 0 writes what it recorded across the ranks into DIR: ``summary.txt`` (per group and
phase: collectives, communication, exposed wait, overlap; the step's exposed
communication first), ``trace.json`` (Chrome trace events: open it in Perfetto) and
``schedule.png`` (the last step across ranks). See docs/trace.md.

``--impl torch`` runs the same script with PyTorch's own
``torch.distributed.fsdp.fully_shard`` for comparison. It runs on CPU with the gloo
backend by default and on CUDA with NCCL (one GPU per rank, chosen by ``LOCAL_RANK``)
when a GPU is available. Started with plain ``python`` it runs as a single process.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from llama import ModelArgs, Transformer, loss_fn, parallelize
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from tqdm import tqdm

# ----------------------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--impl",
        choices=["fsdp2", "torch"],
        default="fsdp2",
        help="fsdp2: this library; torch: torch.distributed.fsdp, for comparison",
    )
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps to run")
    # Model.
    parser.add_argument("--dim", type=int, default=128, help="model width")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--vocab", type=int, default=256, help="vocabulary size")
    parser.add_argument(
        "--tie-embeddings", action="store_true", help="share the embedding and output weights"
    )
    # Data.
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    # Optimization.
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument(
        "--grad-clip",
        type=float,
        default=1.0,
        help="clip the global gradient norm to this value (0 disables)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for the model and the data")
    # FSDP.
    parser.add_argument(
        "--mixed-precision",
        choices=["none", "bf16"],
        default="none",
        help="bf16: compute in bfloat16, reduce gradients in float32",
    )
    parser.add_argument(
        "--reshard-after-forward",
        choices=["default", "true", "false"],
        default="default",
        help="free the all-gathered parameters after forward (true) or keep "
        "them until backward (false); default: fully_shard's default",
    )
    parser.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each block's activations in backward",
    )
    # Checkpointing.
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        help="save {model, optimizer, TrainState} here (fsdp2.save_checkpoint); a directory "
        "every rank can see",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="also save every N steps (0: only after the last step)",
    )
    parser.add_argument(
        "--checkpoint-keep",
        type=int,
        default=2,
        help="keep the newest K checkpoints, delete older ones",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint in --checkpoint-dir (start from step 0 "
        "if there is none yet), at any world size; keep --batch-size times the world size "
        "to continue on the same global batches",
    )
    parser.add_argument(
        "--trace",
        default=None,
        metavar="DIR",
        help="record fsdp2's schedule (fsdp2.trace_schedule) and write summary.txt, "
        "trace.json (Perfetto) and schedule.png into DIR (needs matplotlib)",
    )
    args = parser.parse_args(argv)

    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.dim % args.heads != 0:
        parser.error(f"--dim ({args.dim}) must be divisible by --heads ({args.heads})")
    if (args.dim // args.heads) % 2 != 0:
        parser.error("--dim / --heads must be even (rotary embeddings rotate channel pairs)")
    if args.seq_len < 2:
        parser.error("--seq-len must be at least 2")
    if args.checkpoint_every < 0:
        parser.error("--checkpoint-every must be >= 0")
    if args.checkpoint_keep < 1:
        parser.error("--checkpoint-keep must be at least 1")
    if (args.resume or args.checkpoint_every) and args.checkpoint_dir is None:
        parser.error("--resume and --checkpoint-every need --checkpoint-dir")
    if args.trace is not None:
        if args.impl != "fsdp2":
            parser.error("--trace needs --impl fsdp2: torch's fully_shard records no schedule")
        try:
            import matplotlib  # noqa: F401  (the PNG; checked before training, not after)
        except ImportError:
            parser.error("--trace writes a PNG and needs matplotlib: pip install 'fsdp2[plot]'")
    return args


# --------------------------------------------------------------------------- distributed


def init_distributed() -> tuple[torch.device, DeviceMesh]:
    """Initialize the process group and a 1-D data-parallel mesh over all ranks.

    CUDA + NCCL when a GPU is available (device picked by LOCAL_RANK), else CPU + gloo.
    Without torchrun's environment it sets up a single-process group.
    """
    if "RANK" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )

    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group(backend="gloo")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))
    return device, mesh


def load_fsdp(impl: str) -> tuple[Callable[..., Any], type]:
    """Return (fully_shard, MixedPrecisionPolicy) from this library or from torch."""
    if impl == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    else:
        from fsdp2 import MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy


# --------------------------------------------------------------------------------- model


def build_model(args: argparse.Namespace) -> Transformer:
    """The full, unsharded model, identically initialized on every rank (on CPU)."""
    model_args = ModelArgs(
        vocab_size=args.vocab,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        max_seq_len=args.seq_len,
        tie_embeddings=args.tie_embeddings,
    )
    model = Transformer(model_args)
    model.init_weights(seed=args.seed)
    return model


def apply_activation_checkpointing(model: Transformer) -> None:
    """Wrap each block so that its activations are recomputed during backward.

    Done before sharding, so that ``fully_shard`` is applied to the wrappers.
    ``CheckpointWrapper`` keeps the state-dict keys of the wrapped module.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, block in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(block)


def parallelize_model(model: Transformer, mesh: DeviceMesh, args: argparse.Namespace) -> nn.Module:
    """Shard each block, then the root, with the chosen implementation and options."""
    fully_shard, MixedPrecisionPolicy = load_fsdp(args.impl)
    kwargs: dict[str, Any] = {"mesh": mesh}
    if args.mixed_precision == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if args.reshard_after_forward != "default":
        kwargs["reshard_after_forward"] = args.reshard_after_forward == "true"
    if args.activation_checkpointing:
        apply_activation_checkpointing(model)
    return parallelize(model, fully_shard, **kwargs)


def build_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """AdamW over the (already sharded) parameters: its state is sharded too."""
    return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)


# ---------------------------------------------------------------------------------- data


class SyntheticTokens:
    """A deterministic, learnable random token stream.

    Each sequence walks a fixed random cycle through the vocabulary (so the same pattern
    keeps repeating), except that with probability ``noise`` the next token is drawn
    uniformly at random and the walk continues from there. A model can learn the cycle
    and bring the loss from ``log(vocab)`` down toward the noise floor.

    ``batch(step)`` depends only on the seed and the step: every rank builds the same
    global batch of ``batch_size * world_size`` sequences and keeps its own rows. So the
    data needs no state of its own to resume from a step.
    """

    def __init__(
        self,
        vocab: int,
        seq_len: int,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        device: torch.device,
        noise: float = 0.1,
    ) -> None:
        self.vocab, self.seq_len, self.batch_size = vocab, seq_len, batch_size
        self.rank, self.world_size = rank, world_size
        self.seed, self.device, self.noise = seed, device, noise
        gen = torch.Generator().manual_seed(seed)
        cycle = torch.randperm(vocab, generator=gen)
        self.successor = torch.empty_like(cycle)
        self.successor[cycle] = cycle.roll(-1)

    def batch(self, step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step + 1)
        rows = self.batch_size * self.world_size
        tokens = torch.empty(rows, self.seq_len, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab, (rows,), generator=gen)
        jumps = torch.rand(rows, self.seq_len, generator=gen) < self.noise
        random = torch.randint(self.vocab, (rows, self.seq_len), generator=gen)
        for t in range(1, self.seq_len):
            nxt = self.successor[tokens[:, t - 1]]
            tokens[:, t] = torch.where(jumps[:, t], random[:, t], nxt)
        mine = tokens[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
        return mine.to(self.device, non_blocking=True)


# --------------------------------------------------------------------------------- train


@dataclass
class TrainState:
    """Progress that a checkpoint must save next to the model and optimizer state.

    It follows ``torch.distributed.checkpoint.stateful.Stateful``, so ``--checkpoint-dir``
    / ``--resume`` save and load it with torch.distributed.checkpoint together with the
    model and optimizer; the training loop starts at ``step``. The data needs no state:
    a batch is a function of the step.
    """

    step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])


def checkpoint_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: TrainState
) -> dict[str, Any]:
    """What a checkpoint holds: sharded model and optimizer state (any world size can
    load it) and the progress."""
    from fsdp2 import ModelOptimizerState

    return {"app": ModelOptimizerState(model, optimizer), "train": state}


def save(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: TrainState, args: argparse.Namespace
) -> str:
    """Save atomically (a new directory, then the ``latest`` pointer); collective."""
    from fsdp2 import save_checkpoint

    return save_checkpoint(
        checkpoint_state(model, optimizer, state),
        args.checkpoint_dir,
        step=state.step,
        keep=args.checkpoint_keep,
    )


def resume(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: TrainState, args: argparse.Namespace
) -> int | None:
    """Load the latest checkpoint into model, optimizer and state in place; its step, or
    None when the directory has none yet (a first run started with --resume)."""
    from fsdp2 import load_checkpoint

    return load_checkpoint(checkpoint_state(model, optimizer, state), args.checkpoint_dir)


def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float) -> float:
    """Clip the global gradient norm (computed across all shards); return it."""
    norm = torch.nn.utils.clip_grad_norm_(list(params), max_norm)
    if hasattr(norm, "full_tensor"):  # a DTensor when the gradients are DTensors
        norm = norm.full_tensor()
    return float(norm)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    tokens: torch.Tensor,
    args: argparse.Namespace,
) -> tuple[torch.Tensor, float | None]:
    """One forward/backward/step; returns the local loss (detached) and the grad norm."""
    logits = model(tokens)
    loss = loss_fn(logits.float(), tokens)
    loss.backward()
    grad_norm = clip_grad_norm(model.parameters(), args.grad_clip) if args.grad_clip > 0 else None
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach(), grad_norm


def global_mean(value: torch.Tensor) -> float:
    """Average a scalar over all ranks (SUM then divide: gloo has no AVG)."""
    value = value.detach().float().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value.item() / dist.get_world_size()


@dataclass
class TrainResult:
    final_loss: float
    mean_tokens_per_s: float


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: SyntheticTokens,
    state: TrainState,
    args: argparse.Namespace,
) -> TrainResult:
    """The training loop, from ``state.step`` up to ``args.steps``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens_per_step = args.batch_size * args.seq_len * world
    model.train()
    loss = math.nan
    timed_tokens, timed_seconds = 0, 0.0
    first_step = state.step
    bar = tqdm(
        total=args.steps,
        initial=state.step,
        desc="train",
        unit="step",
        disable=rank != 0,
        dynamic_ncols=True,
    )
    while state.step < args.steps:
        tokens = data.batch(state.step)
        start = time.perf_counter()
        local_loss, grad_norm = train_step(model, optimizer, tokens, args)
        loss = global_mean(local_loss)  # also waits for the step to finish on the device
        elapsed = time.perf_counter() - start
        state.step += 1
        state.tokens_seen += tokens_per_step
        # The first step pays for one-time setup (allocations, lazy init): leave it out of
        # the mean throughput unless it is the only step.
        if state.step > first_step + 1 or args.steps - first_step == 1:
            timed_tokens += tokens_per_step
            timed_seconds += elapsed
        postfix = {"loss": f"{loss:.4f}", "tok/s": f"{tokens_per_step / elapsed:,.0f}"}
        if grad_norm is not None:
            postfix["gnorm"] = f"{grad_norm:.3f}"
        bar.set_postfix(postfix, refresh=False)
        bar.update(1)
        if args.checkpoint_dir is not None and (
            state.step == args.steps
            or (args.checkpoint_every and state.step % args.checkpoint_every == 0)
        ):
            path = save(model, optimizer, state, args)
            if rank == 0:
                bar.write(f"saved checkpoint at step {state.step} to {path}")
    bar.close()
    mean_tps = timed_tokens / timed_seconds if timed_seconds > 0 else math.nan
    return TrainResult(final_loss=loss, mean_tokens_per_s=mean_tps)


# ---------------------------------------------------------------------------------- main


def write_trace(trace: Any, directory: str) -> None:
    """Rank 0: the schedule of every rank, as a table, Chrome trace JSON and a PNG."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    summary = trace.summary()
    (out / "summary.txt").write_text(summary + "\n")
    trace.save_chrome_trace(out / "trace.json")
    trace.plot(out / "schedule.png")
    print(summary, flush=True)
    print(f"wrote {out / 'summary.txt'}, {out / 'trace.json'}, {out / 'schedule.png'}", flush=True)


def peak_memory_gib(device: torch.device) -> float | None:
    """The largest peak CUDA memory allocated on any rank, or None on CPU."""
    if device.type != "cuda":
        return None
    peak = torch.tensor(float(torch.cuda.max_memory_allocated(device)), device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return peak.item() / 2**30


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device, mesh = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()

    model = build_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    model = parallelize_model(model, mesh, args)
    optimizer = build_optimizer(model, args)
    data = SyntheticTokens(
        args.vocab, args.seq_len, args.batch_size, rank, world, args.seed, device
    )
    state = TrainState()
    if args.resume:
        # Training continues from state.step on the same data: a batch is a function of
        # the step. The checkpoint may come from another world size.
        loaded = resume(model, optimizer, state, args)
        if rank == 0:
            print(
                f"resumed from step {loaded} ({args.checkpoint_dir})"
                if loaded is not None
                else f"no checkpoint in {args.checkpoint_dir}; starting from step 0",
                flush=True,
            )

    if rank == 0:
        print(
            f"impl={args.impl} world_size={world} device={device.type} "
            f"params={n_params / 1e6:.2f}M layers={args.layers} dim={args.dim} "
            f"mixed_precision={args.mixed_precision} "
            f"reshard_after_forward={args.reshard_after_forward} "
            f"activation_checkpointing={args.activation_checkpointing} "
            f"global_batch={args.batch_size * world}x{args.seq_len} tokens",
            flush=True,
        )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    if args.trace is None:
        result = train(model, optimizer, data, state, args)
    else:
        import fsdp2

        with fsdp2.trace_schedule(model) as trace:
            result = train(model, optimizer, data, state, args)
        if rank == 0:
            write_trace(trace, args.trace)

    peak = peak_memory_gib(device)
    if rank == 0:
        line = (
            f"done: {state.step} steps, final loss {result.final_loss:.4f}, "
            f"mean {result.mean_tokens_per_s:,.0f} tokens/s"
        )
        if peak is not None:
            line += f", peak memory {peak:.2f} GiB"
        print(line, flush=True)
    # Let every rank finish its last collective before any of them tears the group down.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
