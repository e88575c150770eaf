"""Real models from libraries users train with fsdp2 (diffusers, transformers), where those
libraries are installed; they are not dependencies, so CI skips these tests.

Each case builds a tiny configuration, shards each block then the root, and trains three
AdamW steps (with norm clipping) on 2 gloo ranks under fsdp2 and under torch's
``fully_shard``, and a non-sharded copy on the global batch. fsdp2's parameters must be
bitwise torch's and within 1e-5 of the non-sharded model. docs/integrations.md lists
what else was checked by hand.

diffusers' DiT runs ``transformer_blocks[0].norm1.emb`` from its root after the blocks, when
block 0 has resharded: fsdp2 must name that submodule (torch lets DTensor's "mixed
torch.Tensor and DTensor" through), and sharding each block's ``norm1.emb`` on its own, as
that error suggests, must train like torch with the same wrapping.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _helpers import full, get_fully_shard
from _launcher import run_ranks
from torch import nn

TOL = 1e-5


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


needs_diffusers = pytest.mark.skipif(not _installed("diffusers"), reason="diffusers")
needs_transformers = pytest.mark.skipif(not _installed("transformers"), reason="transformers")


def _diffusers_model(kind: str) -> tuple[nn.Module, list[nn.Module], Any]:
    """(model, modules to shard before the root, batch of n from a generator)."""
    import diffusers

    torch.manual_seed(0)
    if kind == "unet":
        model = diffusers.UNet2DConditionModel(
            sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
            block_out_channels=(32, 64), cross_attention_dim=16, attention_head_dim=8,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), norm_num_groups=8,
        )  # fmt: skip
        blocks = [*model.down_blocks, model.mid_block, *model.up_blocks]

        def batch(g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
            return {
                "sample": torch.randn(n, 4, 8, 8, generator=g),
                "timestep": torch.randint(0, 1000, (n,), generator=g),
                "encoder_hidden_states": torch.randn(n, 5, 16, generator=g),
            }

        return model, blocks, batch
    model = diffusers.DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=3,
        sample_size=8, patch_size=2, num_embeds_ada_norm=10, norm_num_groups=4,
    )  # fmt: skip
    blocks = list(model.transformer_blocks)
    if kind == "dit_emb_sharded":
        blocks = [block.norm1.emb for block in blocks] + blocks

    def dit_batch(g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
        return {
            "hidden_states": torch.randn(n, 4, 8, 8, generator=g),
            "timestep": torch.randint(0, 1000, (n,), generator=g),
            "class_labels": torch.randint(0, 10, (n,), generator=g),
        }

    return model, blocks, dit_batch


def _transformers_model(kind: str) -> tuple[nn.Module, list[nn.Module], Any]:
    import transformers as hf

    torch.manual_seed(0)
    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4}
    sizes |= {"num_hidden_layers": 2, "vocab_size": 97, "num_key_value_heads": 2}
    if kind == "llama_tied":
        model = hf.LlamaForCausalLM(hf.LlamaConfig(tie_word_embeddings=True, **sizes))
    else:
        config = hf.Qwen2MoeConfig(
            num_experts=4, num_experts_per_tok=1, moe_intermediate_size=16,
            shared_expert_intermediate_size=16, **sizes,
        )  # fmt: skip
        model = hf.Qwen2MoeForCausalLM(config)
    model.config.use_cache = False

    def batch(g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 97, (n, 8), generator=g)
        return {"input_ids": ids, "labels": ids}

    return model, list(model.model.layers), batch


def _loss(kind: str, model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    out = model(**inputs)
    return out.loss if hasattr(out, "loss") and out.loss is not None else out.sample.pow(2).mean()


def _train(kind: str, impl: str, clip: str = "torch", **kwargs: Any) -> dict[str, Any]:
    """Rank function: three steps of ``impl`` ("ref": non-sharded, on one rank, on the
    global batch of 2 ranks' 2 rows each), clipping with torch's ``clip_grad_norm_`` or
    (``clip="fsdp2"``) fsdp2's."""
    rank = dist.get_rank()
    build = _transformers_model if kind in ("llama_tied", "qwen2moe") else _diffusers_model
    model, blocks, batch = build(kind)
    model.eval()  # no dropout (DiT's class-label dropout draws per sample)
    if impl != "ref":
        fully_shard = get_fully_shard(impl)
        for block in blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
    # eps bounds AdamW's amplification of rounding noise in ~0 gradients (see _helpers).
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-3)
    try:
        for step in range(3):
            inputs = batch(torch.Generator().manual_seed(100 + step), 4)
            if impl != "ref":
                inputs = {k: v[2 * rank : 2 * rank + 2] for k, v in inputs.items()}
            _loss(kind, model, inputs).backward()
            if clip == "fsdp2":
                import fsdp2

                fsdp2.clip_grad_norm_(model.parameters(), 1.0)
            else:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    except RuntimeError as error:
        return {"error": str(error)}
    return {"params": {n: full(p.detach()) for n, p in model.named_parameters()}}


def _check(kind: str, **kwargs: Any) -> None:
    ref = run_ranks(_train, 1, kind, "ref", timeout=300)[0]["params"]
    ours = run_ranks(_train, 2, kind, "fsdp2", timeout=300, **kwargs)
    theirs = run_ranks(_train, 2, kind, "torch", timeout=300, **kwargs)
    for rank, (mine, other) in enumerate(zip(ours, theirs)):
        for name, value in mine["params"].items():
            diff = (value - ref[name]).abs().max().item()
            assert diff <= TOL, f"rank {rank}: {name} is {diff:.3g} off the non-sharded model"
            assert torch.equal(value, other["params"][name]), f"rank {rank}: {name} vs torch"


@needs_diffusers
@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("kind", ["unet", "dit_emb_sharded"])
def test_diffusers_models_train_like_torch(kind: str, reshard: bool) -> None:
    _check(kind, reshard_after_forward=reshard)


@needs_diffusers
def test_diffusers_dit_names_the_submodule_run_outside_its_block() -> None:
    for report in run_ranks(_train, 2, "dit", "fsdp2", timeout=300):
        assert report["error"].startswith(
            "fully_shard: FSDPDiTTransformer2DModel.forward() ran "
            "'transformer_blocks.0.norm1.emb' (CombinedTimestepLabelEmbeddings)"
        ), report["error"]


@needs_transformers
@pytest.mark.parametrize("kind", ["llama_tied", "qwen2moe"])
def test_transformers_models_train_like_torch(kind: str) -> None:
    _check(kind)


@needs_transformers
@pytest.mark.parametrize("kind", ["llama_tied", "qwen2moe"])
def test_transformers_models_with_fsdp2_clipping(kind: str) -> None:
    """fsdp2's ``clip_grad_norm_`` and optimizer fast path on real models: within 1e-5 of
    the non-sharded model (its norm sums in another order than torch's, so not bitwise
    torch's run)."""
    ref = run_ranks(_train, 1, kind, "ref", timeout=300)[0]["params"]
    for rank, mine in enumerate(run_ranks(_train, 2, kind, "fsdp2", "fsdp2", timeout=300)):
        assert "error" not in mine, mine
        for name, value in mine["params"].items():
            diff = (value - ref[name]).abs().max().item()
            assert diff <= TOL, f"rank {rank}: {name} is {diff:.3g} off the non-sharded model"


def _generate(impl: str) -> tuple[int, ...]:
    """Sampled generation with a per-rank seed and the default ``synced_gpus``: the
    ranks' sequences end at different steps (a 6-token vocabulary with an end token)."""
    import transformers as hf

    fully_shard = get_fully_shard(impl)
    torch.manual_seed(0)
    config = hf.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=6, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = hf.LlamaForCausalLM(config)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    torch.manual_seed(100 + dist.get_rank())
    out = model.generate(torch.tensor([[1, 3, 4]]), max_new_tokens=40, do_sample=True)
    return tuple(out.shape)


@needs_transformers
@pytest.mark.parametrize("impl", ["fsdp2", "torch"])
def test_transformers_generate_keeps_the_ranks_in_step(impl: str) -> None:
    """transformers turns ``synced_gpus`` on for modules flagged as FSDP-managed ([Note:
    modules flagged as FSDP-managed]): a rank whose sequence ended keeps running
    forwards until every rank's has. Without the flags fsdp2's run hung here."""
    shapes = run_ranks(_generate, 2, impl, timeout=120)
    assert len(shapes) == 2, shapes
