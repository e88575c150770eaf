"""Training parity on the module types of real models beyond transformer blocks.

Each case builds a small model from ``torch.nn`` building blocks that reach their
parameters in their own ways: recurrent layers (a flat weight list refreshed in forward),
``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` (fused ``in_proj_weight``,
fast paths in eval), convolutions in channels-last memory format, weight normalization
(parametrizations and the legacy hook), ``nn.EmbeddingBag`` and a padding index,
transposed convolutions, ``nn.Bilinear`` and ``nn.PReLU``, complex parameters, and
batch normalization (buffers updated in forward). Three SGD steps on 2 ranks:

* against the non-sharded model on the global batch, within 1e-5 (batch normalization
  is left out: each rank normalizes with its own batch statistics, by design);
* against torch's ``fully_shard`` on the same ranks, bitwise (complex parameters are left
  out: torch's ``fully_shard`` refuses a group that mixes them with real ones).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _helpers import get_fully_shard, require_impl
from _launcher import run_ranks
from torch import nn

TOL = 1e-5


class Recurrent(nn.Module):
    def __init__(self, kind: type[nn.RNNBase]) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16, padding_idx=0)
        self.rnn = kind(16, 24, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(48, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.emb(x))
        return self.head(h[:, -1])


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True) for _ in range(2)
        )
        self.cross = nn.MultiheadAttention(32, 4, batch_first=True, kdim=16, vdim=16)
        self.kv = nn.Linear(32, 16)
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        kv = self.kv(h)
        h, _ = self.cross(h, kv, kv)
        return self.head(h.mean(1))


class ConvNet(nn.Module):
    def __init__(self, batch_norm: bool) -> None:
        super().__init__()

        def norm(c: int) -> nn.Module:
            return nn.BatchNorm2d(c) if batch_norm else nn.GroupNorm(2, c)

        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(3 if i == 0 else 8, 8, 3, padding=1), norm(8), nn.ReLU())
            for i in range(3)
        )
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous(memory_format=torch.channels_last)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((2, 3)))


class WeightNormed(nn.Module):
    def __init__(self, legacy: bool) -> None:
        super().__init__()
        if legacy:
            wn: Callable[[nn.Module], nn.Module] = torch.nn.utils.weight_norm
        else:
            wn = torch.nn.utils.parametrizations.weight_norm
        self.blocks = nn.ModuleList(
            nn.Sequential(wn(nn.Linear(12, 12)), nn.Tanh()) for _ in range(2)
        )
        self.head = nn.Linear(12, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Bags(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(60, 16, mode="mean")
        self.emb = nn.Embedding(60, 16, padding_idx=0)
        self.head = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.bag(x), self.emb(x).sum(1)], -1))


class Transposed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 6, 3)
        self.deconv = nn.ConvTranspose1d(6, 4, 3)  # weight (in, out, k): dim 0 = 6
        self.norm = nn.LayerNorm(4)
        self.prelu = nn.PReLU(4)
        self.bilinear = nn.Bilinear(4, 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.deconv(F.relu(self.conv(x)))
        h = self.prelu(self.norm(h.transpose(1, 2)).transpose(1, 2))
        return self.bilinear(h.mean(2), h.amax(2))


class Complex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Parameter(torch.randn(6, 6, dtype=torch.cfloat))
        self.head = nn.Linear(12, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.complex(x[:, :6], x[:, 6:]) @ self.mix
        return self.head(torch.cat([z.real, z.imag], -1))


def _tokens(gen: torch.Generator, n: int) -> torch.Tensor:
    return torch.randint(0, 50, (n, 7), generator=gen)


# name -> (model factory, submodules sharded before the root, input maker)
CASES: dict[str, tuple[Callable[[], nn.Module], list[str], Callable]] = {
    "lstm": (lambda: Recurrent(nn.LSTM), ["rnn"], _tokens),
    "gru": (lambda: Recurrent(nn.GRU), ["rnn"], _tokens),
    "attention": (Attention, ["layers.0", "layers.1", "cross"], _tokens),
    "conv_channels_last": (
        lambda: ConvNet(batch_norm=False),
        ["blocks.0", "blocks.1", "blocks.2"],
        lambda g, n: torch.randn(n, 3, 8, 8, generator=g),
    ),
    "conv_batch_norm": (
        lambda: ConvNet(batch_norm=True),
        ["blocks.0", "blocks.1", "blocks.2"],
        lambda g, n: torch.randn(n, 3, 8, 8, generator=g),
    ),
    "weight_norm": (
        lambda: WeightNormed(legacy=False),
        ["blocks.0", "blocks.1"],
        lambda g, n: torch.randn(n, 12, generator=g),
    ),
    "weight_norm_legacy": (
        lambda: WeightNormed(legacy=True),
        ["blocks.0", "blocks.1"],
        lambda g, n: torch.randn(n, 12, generator=g),
    ),
    "embedding_bag": (Bags, ["head"], lambda g, n: torch.randint(0, 60, (n, 5), generator=g)),
    "transposed_bilinear": (
        Transposed,
        ["conv", "deconv"],
        lambda g, n: torch.randn(n, 4, 9, generator=g),
    ),
    "complex": (Complex, [], lambda g, n: torch.randn(n, 12, generator=g)),
}
NOT_AGAINST_REFERENCE = {"conv_batch_norm"}  # per-rank batch statistics
NOT_AGAINST_TORCH = {"complex"}  # torch: "FSDP expects uniform original parameter dtype"


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = CASES[name][0]()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def train(name: str, impl: str | None, steps: int = 3) -> dict[str, torch.Tensor]:
    """Rank function body: ``steps`` SGD steps of the case, sharded with ``impl`` (None:
    the non-sharded model on the global batch); returns the final full state dict and
    the eval outputs on a fixed batch."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    _, wrap, make_input = CASES[name]
    model = _build(name)
    if impl is not None:
        fully_shard = get_fully_shard(impl)
        for path in wrap:
            fully_shard(model.get_submodule(path))
        fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    n = 4
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        x, y = make_input(gen, n * ws), torch.randint(0, 5, (n * ws,), generator=gen)
        if impl is not None:
            x, y = x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        out = model(make_input(torch.Generator().manual_seed(999), 3))
    state = {k: _full(v) for k, v in model.state_dict().items()}
    return state | {"<eval output>": out}


def compare(name: str) -> dict[str, tuple[list[str], float]]:
    """Rank function: fsdp2 against the reference and against torch's fully_shard."""
    fsdp2_state = train(name, "fsdp2")
    others = {}
    if name not in NOT_AGAINST_REFERENCE:
        others["non-sharded"] = train(name, None)
    if name not in NOT_AGAINST_TORCH:
        others["torch"] = train(name, "torch")
    report = {}
    for label, state in others.items():
        keys_differ = sorted(set(state) ^ set(fsdp2_state))
        diff = max(
            ((fsdp2_state[k] - v).abs().max().item() for k, v in state.items() if v.numel()),
            default=0.0,
        )
        report[label] = (keys_differ, diff)
    return report


@pytest.mark.parametrize("name", sorted(CASES))
def test_module_zoo_parity(name: str) -> None:
    require_impl("torch")
    report = run_ranks(compare, 2, name)[0]
    for label, (keys_differ, diff) in report.items():
        assert not keys_differ, f"{name}: state-dict keys differ from {label}'s: {keys_differ}"
        limit = 0.0 if label == "torch" else TOL
        assert diff <= limit, f"{name}: fsdp2 is {diff:.3g} off {label} (limit {limit})"
