"""Named benchmark configurations and the implementations under comparison."""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch


@dataclass(frozen=True)
class BenchConfig:
    name: str
    description: str
    n_layers: int = 8
    dim: int = 256
    n_heads: int = 4
    vocab_size: int = 512
    mixed_precision: bool = False  # MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    reshard_after_forward: bool = True
    grad_accum: int = 1  # microbatches per optimizer step; sync only on the last one
    cpu_offload: bool = False
    batch: int | None = None  # sequences per rank per microbatch (None: --batch)
    seq: int | None = None  # sequence length (None: --seq)
    # Sized for an accelerator: left out of --all-configs / --full on the CPU.
    accelerator_only: bool = False

    def with_overrides(self, **kw: Any) -> BenchConfig:
        kw = {k: v for k, v in kw.items() if v is not None}
        return dataclasses.replace(self, **kw)

    @property
    def param_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.mixed_precision else torch.float32


CONFIGS: dict[str, BenchConfig] = {
    c.name: c
    for c in (
        BenchConfig(
            "small-many",
            "64 small blocks: per-group hook/bookkeeping cost dominates",
            n_layers=64,
            dim=64,
            vocab_size=256,
        ),
        BenchConfig(
            "large-few",
            "4 large blocks: copy-in/out and collective payload dominate",
            n_layers=4,
            dim=1024,
            n_heads=16,
            vocab_size=1024,
            batch=1,  # 53M parameters: keep one CPU step near a second
            seq=32,
        ),
        BenchConfig(
            "bf16",
            "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)",
            mixed_precision=True,
        ),
        BenchConfig("no-reshard", "reshard_after_forward=False", reshard_after_forward=False),
        BenchConfig(
            "grad-accum",
            "4 microbatches, set_requires_gradient_sync(False) except the last",
            grad_accum=4,
        ),
        BenchConfig("cpu-offload", "CPUOffloadPolicy()", cpu_offload=True),
        BenchConfig(
            "gpu-1b",
            "~0.94B-parameter Llama, bf16 policy, sequence 2048: the GPU step-time target",
            n_layers=16,
            dim=2048,
            n_heads=16,
            vocab_size=32000,
            mixed_precision=True,
            batch=1,
            seq=2048,
            accelerator_only=True,
        ),
    )
}


def default_config_names(device: str) -> list[str]:
    """What --all-configs / --full run on ``device``: accelerator-sized configs on a GPU only."""
    return [n for n, c in CONFIGS.items() if device != "cpu" or not c.accelerator_only]


def quick_version(cfg: BenchConfig) -> BenchConfig:
    """Shrunk shapes for the smoke run (same features)."""
    return dataclasses.replace(
        cfg,
        n_layers=min(cfg.n_layers, 4),
        dim=min(cfg.dim, 128),
        n_heads=min(cfg.n_heads, 4),
        vocab_size=min(cfg.vocab_size, 256),
        batch=None,
        seq=None,
    )


TRACED = "+trace"  # "fsdp2+trace": the same implementation, stepped under its schedule trace


def load_impl(label: str) -> SimpleNamespace:
    """``fully_shard`` and its policies for ``label`` ("torch", "fsdp2"; "torch#2" = torch again;
    "fsdp2+trace" = fsdp2 stepped inside ``fsdp2.trace_schedule``).

    Any ``module`` exposing ``fully_shard``, ``MixedPrecisionPolicy`` and ``CPUOffloadPolicy``
    can be named too (e.g. ``mypkg.fsdp``).
    """
    name = label.split("#")[0]
    traced = name.endswith(TRACED)
    name = name.removesuffix(TRACED)
    module = "torch.distributed.fsdp" if name == "torch" else name
    mod = importlib.import_module(module)
    missing = [
        n
        for n in ("fully_shard", "MixedPrecisionPolicy", "CPUOffloadPolicy")
        if not hasattr(mod, n)
    ]
    if missing:
        raise ImportError(
            f"cannot import name(s) {', '.join(missing)} from {module!r} "
            f"({getattr(mod, '__file__', None) or 'namespace package'})"
        )
    if traced and not hasattr(mod, "trace_schedule"):
        raise ImportError(
            f"{label}: {module!r} has no trace_schedule (only fsdp2 records its schedule)"
        )
    return SimpleNamespace(
        name=label,
        module=module,
        trace_schedule=getattr(mod, "trace_schedule", None) if traced else None,
        fully_shard=mod.fully_shard,
        MixedPrecisionPolicy=mod.MixedPrecisionPolicy,
        CPUOffloadPolicy=mod.CPUOffloadPolicy,
    )


def shard_kwargs(cfg: BenchConfig, impl: SimpleNamespace, device: torch.device) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    if cfg.mixed_precision:
        kw["mp_policy"] = impl.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if not cfg.reshard_after_forward:
        kw["reshard_after_forward"] = False
    if cfg.cpu_offload:
        # Pinned memory needs an accelerator; on a CPU-only run the policy keeps pageable memory.
        kw["offload_policy"] = impl.CPUOffloadPolicy(pin_memory=device.type == "cuda")
    return kw
