"""A small Llama-style decoder: token embedding, RMSNorm, grouped-query attention with
rotary embeddings, SwiGLU MLP, and a tied or untied output head.

It is shared by the example trainer, the tests and the benchmarks so that all three
exercise the same module tree. It is deliberately plain PyTorch: nothing in it knows
about sharding. ``parallelize`` shows the recommended wrapping: each block, then the root.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelArgs:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None
    multiple_of: int = 32
    norm_eps: float = 1e-5
    max_seq_len: int = 128
    tie_embeddings: bool = False


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = x.float().pow(2).mean(-1, keepdim=True).add(self.eps).rsqrt()
        return (x.float() * norm).type_as(x) * self.weight


def rotary_tables(head_dim: int, seq_len: int, theta: float = 10000.0) -> torch.Tensor:
    """cos/sin tables of shape (seq_len, head_dim // 2, 2), computed in fp32."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rotary(x: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    # x: (batch, seq, heads, head_dim); rotate consecutive pairs of channels.
    pairs = x.float().unflatten(-1, (-1, 2))
    cos = tables[: x.shape[1], None, :, 0]
    sin = tables[: x.shape[1], None, :, 1]
    real = pairs[..., 0] * cos - pairs[..., 1] * sin
    imag = pairs[..., 0] * sin + pairs[..., 1] * cos
    return torch.stack((real, imag), dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads or args.n_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, self.n_heads, self.head_dim)
        k = self.wk(x).view(bsz, seq, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(bsz, seq, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        repeats = self.n_heads // self.n_kv_heads
        if repeats > 1:
            k = k.repeat_interleave(repeats, dim=2)
            v = v.repeat_interleave(repeats, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, multiple_of: int) -> None:
        super().__init__()
        hidden = int(2 * (4 * dim) / 3)
        hidden = multiple_of * ((hidden + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.multiple_of)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # A buffer, not a parameter: fully_shard leaves buffers replicated.
        self.register_buffer(
            "rope", rotary_tables(args.dim // args.n_heads, args.max_seq_len), persistent=False
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.rope)
        return self.output(self.norm(h))

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Deterministic initialization from ``seed``, independent of the device."""
        gen = torch.Generator().manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                std = 1.0 / math.sqrt(param.shape[-1])
                param.copy_(torch.randn(param.shape, generator=gen) * std)


def parallelize(model: Transformer, shard: Callable[..., object], **kwargs: object) -> Transformer:
    """Apply ``shard`` (``fsdp2.fully_shard`` or torch's) to each block, then the root."""
    for block in model.layers:
        shard(block, **kwargs)
    shard(model, **kwargs)
    return model


def loss_fn(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, averaged over the local tokens."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
