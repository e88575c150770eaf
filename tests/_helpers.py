"""Reusable pieces for the multi-rank tests: implementation selection, test models with
deterministic initialization, the parity training loop (FSDP vs. a single-process reference
trained on the same global batch), and parameter comparison.

Everything that runs inside a rank is a module-level function of this module, so it can be
sent to the rank processes by ``_launcher.run_ranks``.

Parity contract (what ``run_parity`` checks):

* every rank takes its slice of the global batch (global batch = concatenation of the
  per-rank batches, ``local_batch`` rows each), its loss is the mean over its local batch,
  and FSDP averages gradients over ranks; the reference model (same initial weights, not
  sharded, run on every rank) is trained on the mean loss over the *global* batch, which is
  mathematically the same objective;
* after every optimizer step each parameter's ``full_tensor()`` must match the reference
  within ``tol``; the mean of the local losses (all-reduced) must match the reference loss;
  gradients (sharded ``full_tensor()`` vs. reference) are compared too, including which
  parameters have ``grad is None``, to point at backward vs. optimizer problems.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import importlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from examples.llama import ModelArgs, Transformer, parallelize
from examples.llama import loss_fn as llama_loss_fn

IMPLS = ("fsdp2", "torch")
DEFAULT_TOL = 1e-5


# ------------------------------------------------------------------ implementation switch


def get_fully_shard(impl: str):
    """``fully_shard`` of the implementation under test (``"fsdp2"`` or ``"torch"``)."""
    if impl == "fsdp2":
        return importlib.import_module("fsdp2").fully_shard
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard

        return fully_shard
    raise ValueError(f"unknown impl {impl!r}")


def get_fsdp_module_cls(impl: str) -> type:
    """``FSDPModule`` of the implementation under test."""
    if impl == "fsdp2":
        return importlib.import_module("fsdp2").FSDPModule
    if impl == "torch":
        from torch.distributed.fsdp import FSDPModule

        return FSDPModule
    raise ValueError(f"unknown impl {impl!r}")


def require_impl(impl: str) -> None:
    """Fail fast in the pytest process (instead of inside every rank) when the
    implementation cannot be imported."""
    get_fully_shard(impl)
    get_fsdp_module_cls(impl)


def torch_fsdp_has(module: str, qualname: str) -> bool:
    """Whether torch's ``torch.distributed.fsdp.<module>`` (``""``: the package itself)
    defines ``qualname`` (dotted: ``torch_fsdp_has("", "FSDPModule.reset_iter_state")``):
    feature detection for what older torch's FSDP2 lacks."""
    try:
        obj: Any = importlib.import_module(
            ".".join(filter(None, ("torch.distributed.fsdp", module)))
        )
    except ImportError:
        return False
    for name in qualname.split("."):
        if not hasattr(obj, name):
            return False
        obj = getattr(obj, name)
    return True


def require_impl_feature(impl: str, torch_has_it: bool, feature: str) -> None:
    """``require_impl``, and skip the ``torch`` variant of a test when this torch's FSDP2
    lacks ``feature`` (``torch_has_it``: a feature check such as ``torch_fsdp_has``). The
    ``fsdp2`` variant always runs: only the comparison with torch is lost."""
    require_impl(impl)
    if impl == "torch" and not torch_has_it:
        import pytest

        pytest.skip(f"torch {torch.__version__}'s FSDP2 lacks {feature}")


def make_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


@contextlib.contextmanager
def divergence_checks(enabled: bool) -> Iterator[None]:
    """fsdp2's divergence checks on or off for the block (the switch is per process, and
    the launcher's rank processes serve many tests: restored afterwards)."""
    import fsdp2._divergence as divergence

    before = divergence.checks_enabled()
    divergence.set_divergence_checks(enabled)
    try:
        yield
    finally:
        divergence._enabled = before  # also after a failed step, which the switch refuses


def is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def memory_span(t: torch.Tensor) -> tuple[int, int]:
    """``[start, end)`` addresses of the storage behind ``t`` (a DTensor: its local tensor)."""
    if is_dtensor(t):
        t = t.to_local()
    st = t.untyped_storage()
    return st.data_ptr(), st.data_ptr() + st.nbytes()


def memory_regions(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """The outermost storage spans behind ``tensors``: one per buffer, however many tensors
    live in it (fsdp2's local shards are offset-0 aliases of slots of one flat buffer, so
    they have storages of their own that lie inside the buffer's)."""
    spans = sorted({memory_span(t) for t in tensors}, key=lambda s: (s[0], -s[1]))
    spans = [(start, end) for start, end in spans if end > start]
    regions: list[tuple[int, int]] = []
    for start, end in spans:
        if regions and start >= regions[-1][0] and end <= regions[-1][1]:
            continue
        regions.append((start, end))
    return regions


def lies_inside(span: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
    return any(start <= span[0] and span[1] <= end for start, end in spans)


def full(t: torch.Tensor) -> torch.Tensor:
    """Unsharded value of a (possibly DTensor) tensor. Collective for DTensors."""
    if is_dtensor(t):
        return t.full_tensor()
    return t


# ------------------------------------------------------------------ models


def deterministic_init(model: nn.Module, seed: int) -> None:
    """Seeded init independent of construction order or RNG state: weights ~ N(0, 1/fan_in),
    1-D params ~ N(0, 0.1^2) except ``*scale``/``*norm.weight`` (around 1)."""
    if hasattr(model, "init_weights"):
        model.init_weights(seed)
        return
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() >= 2:
                p.copy_(noise / math.sqrt(p.shape[-1]))
            elif name.endswith("scale") or name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.1 * noise)


class Scale(nn.Module):
    """Elementwise scale by a 1-D parameter (broadcast over the last dim)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def mlp_and_sharded_copy(impl: str, reshard: bool) -> tuple[nn.Module, nn.Module]:
    """A small MLP (4 -> 6 -> 3) and a copy sharded by ``impl`` as two groups (first layer,
    root) with ``reshard_after_forward=reshard``: (reference, sharded)."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    model = copy.deepcopy(reference)
    fully_shard = get_fully_shard(impl)
    fully_shard(model[0], reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    return reference, model


def make_mlp_stack() -> nn.Sequential:
    """Tiny, uneven shapes: weights (7,5), (3,7), (9,3), (4,9); biases 7/3/9/4; a 1-element
    1-D ``scale``. At world size 4, dim 0 of size 3 and 1 leaves empty shards on the last
    ranks; 7 and 9 split unevenly."""
    return nn.Sequential(
        nn.Linear(5, 7),
        nn.ReLU(),
        nn.Linear(7, 3),
        nn.ReLU(),
        nn.Linear(3, 9),
        nn.ReLU(),
        nn.Linear(9, 4),
        Scale(1),
    )


class TwoBranch(nn.Module):
    """The root calls ``branch_a`` on even steps and ``branch_b`` on odd steps (so in every
    step one FSDP child is not called), never calls ``never_used`` (an FSDP child), and
    holds ``unused_root_param`` in the root group without using it."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(6, 8)
        self.branch_a = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.branch_b = nn.Sequential(nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 8))
        self.never_used = nn.Linear(8, 8)
        self.unused_root_param = nn.Parameter(torch.zeros(3))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, use_b: bool = False) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        h = self.branch_b(h) if use_b else self.branch_a(h)
        return self.head(h)


class CalledTwice(nn.Module):
    """``block`` (its own FSDP group) is applied twice in one forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = self.block(h)
        h = self.block(0.5 * h + 0.1)
        return self.out(h)


class CheckpointedTransformer(Transformer):
    """examples.llama.Transformer whose blocks run under ``torch.utils.checkpoint`` (the
    FSDP-wrapped block is the checkpointed function)."""

    use_reentrant: bool = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = checkpoint(layer, h, self.rope, use_reentrant=self.use_reentrant)
        return self.output(self.norm(h))


# ------------------------------------------------------------------ parity case


@dataclass
class ParityCase:
    impl: str = "torch"
    model: str = "llama"  # "llama" | "mlp" | "two_branch" | "called_twice"
    reshard_after_forward: bool | None = None
    # Llama shape (small on purpose: a parity test should take ~1 s).
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None
    vocab_size: int = 64
    seq_len: int = 16
    tie_embeddings: bool = False
    # With tie_embeddings: shard an untied copy and tie ``output.weight`` to
    # ``tok_embeddings.weight`` afterwards, as torchtitan does. "root": both in the root
    # group; "groups": torchtitan's wrapping (embeddings, each block, [norm, output], root).
    tie_after_shard: str | None = None
    # None: plain blocks; "reentrant" / "non_reentrant": torch.utils.checkpoint per block.
    checkpoint: str | None = None
    # fnmatch patterns of parameter names to freeze (requires_grad_(False)) before sharding.
    freeze: tuple[str, ...] = ()
    clip_max_norm: float | None = None
    # Compare model.eval() + no_grad outputs with the reference after every step.
    eval_every_step: bool = False
    steps: int = 3
    lr: float = 1e-2
    local_batch: int = 2
    seed: int = 0
    tol: float = DEFAULT_TOL
    # eval outputs (logits of magnitude ~5) accumulate the ~1e-7 parameter differences
    # through the network; observed diffs are <= 4e-6 for torch's implementation.
    eval_tol: float = 1e-4
    extra: dict = field(default_factory=dict)


def build_model(case: ParityCase) -> nn.Module:
    if case.model == "llama":
        args = ModelArgs(
            vocab_size=case.vocab_size,
            dim=case.dim,
            n_layers=case.n_layers,
            n_heads=case.n_heads,
            n_kv_heads=case.n_kv_heads,
            max_seq_len=max(case.seq_len, 16),
            tie_embeddings=case.tie_embeddings,
        )
        if case.checkpoint is not None:
            model = CheckpointedTransformer(args)
            model.use_reentrant = case.checkpoint == "reentrant"
        else:
            model = Transformer(args)
    elif case.model == "mlp":
        model = make_mlp_stack()
    elif case.model == "two_branch":
        model = TwoBranch()
    elif case.model == "called_twice":
        model = CalledTwice()
    else:
        raise ValueError(f"unknown model {case.model!r}")
    deterministic_init(model, case.seed)
    return model


def shard_model(model: nn.Module, case: ParityCase, impl: str, mesh) -> nn.Module:
    """Wrap the children that form their own FSDP groups, then the root."""
    fully_shard = get_fully_shard(impl)
    kw = {"mesh": mesh, "reshard_after_forward": case.reshard_after_forward}
    if impl == "fsdp2":  # fsdp2-only arguments, e.g. {"reduce_policy": ReducePolicy(...)}
        kw.update(case.extra.get("fsdp2_kwargs", {}))
    if case.model == "llama" and case.tie_after_shard is not None:
        return _shard_then_tie(model, case.tie_after_shard, fully_shard, kw)
    if case.model == "llama":
        return parallelize(model, fully_shard, **kw)
    if case.model == "mlp":
        for child in model:
            if isinstance(child, nn.Linear):
                fully_shard(child, **kw)
    elif case.model == "two_branch":
        for child in (model.branch_a, model.branch_b, model.never_used):
            fully_shard(child, **kw)
    elif case.model == "called_twice":
        fully_shard(model.block, **kw)
    fully_shard(model, **kw)
    return model


def _shard_then_tie(model: nn.Module, wrapping: str, fully_shard, kw: dict) -> nn.Module:
    """torchtitan's weight tying: shard the model with an untied output projection (same
    values), then make ``output.weight`` the sharded embedding weight."""
    model.output.weight = nn.Parameter(model.tok_embeddings.weight.detach().clone())
    if wrapping == "groups":
        fully_shard(model.tok_embeddings, **kw)
    for block in model.layers:
        fully_shard(block, **kw)
    if wrapping == "groups":
        fully_shard([model.norm, model.output], **{**kw, "reshard_after_forward": False})
    elif wrapping != "root":
        raise ValueError(f"unknown tie_after_shard {wrapping!r}")
    fully_shard(model, **kw)
    model.output.weight = model.tok_embeddings.weight
    return model


def make_global_batch(case: ParityCase, step: int, world_size: int) -> tuple:
    gen = torch.Generator().manual_seed(10_000 + 97 * case.seed + step)
    gb = case.local_batch * world_size
    if case.model == "llama":
        return (torch.randint(0, case.vocab_size, (gb, case.seq_len), generator=gen),)
    in_dim, out_dim = {"mlp": (5, 4), "two_branch": (6, 2), "called_twice": (6, 2)}[case.model]
    return (torch.randn(gb, in_dim, generator=gen), torch.randn(gb, out_dim, generator=gen))


def local_slice(batch: tuple, rank: int, local_batch: int) -> tuple:
    return tuple(t[rank * local_batch : (rank + 1) * local_batch] for t in batch)


def forward(model: nn.Module, case: ParityCase, batch: tuple, step: int) -> torch.Tensor:
    if case.model == "two_branch":
        return model(batch[0], use_b=step % 2 == 1)
    return model(batch[0])


def loss_of(model: nn.Module, case: ParityCase, batch: tuple, step: int) -> torch.Tensor:
    out = forward(model, case, batch, step)
    if case.model == "llama":
        return llama_loss_fn(out, batch[0])
    return F.mse_loss(out, batch[1])


def apply_freeze(model: nn.Module, patterns: tuple[str, ...]) -> list[str]:
    frozen = []
    for name, p in model.named_parameters():
        if any(fnmatch.fnmatchcase(name, pat) for pat in patterns):
            p.requires_grad_(False)
            frozen.append(name)
    if patterns and not frozen:
        raise ValueError(f"freeze patterns {patterns} matched no parameter")
    return frozen


# AdamW's update g / (sqrt(v) + eps) amplifies gradient rounding noise by up to lr / eps for
# elements whose gradient is ~0 (the first step is lr * sign(g) for |g| >> eps). With the
# default eps=1e-8, a 1e-8 difference in a 1e-8-sized gradient element (pure summation-order
# noise between the sharded and the reference reduction) moves a parameter by ~lr, so exact
# parity is ill-posed. eps=1e-3 bounds the amplification to lr * noise / 1e-3 (~1e-6) while
# keeping Adam's normalization for normal-sized gradients. Gradients are compared directly.
ADAM_EPS = 1e-3


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, eps=ADAM_EPS)


# ------------------------------------------------------------------ comparison


def compare_params(ref: nn.Module, sharded: nn.Module) -> tuple[str, float]:
    """(name, max abs diff) of the worst parameter; every rank must call it (collective)."""
    ref_params = dict(ref.named_parameters())
    sh_params = dict(sharded.named_parameters())
    if ref_params.keys() != sh_params.keys():
        raise AssertionError(
            f"parameter names differ: only in reference {sorted(ref_params.keys() - sh_params.keys())}, "
            f"only in sharded {sorted(sh_params.keys() - ref_params.keys())}"
        )
    worst = ("", 0.0)
    for name, rp in ref_params.items():
        sp = full(sh_params[name].detach())
        if sp.shape != rp.shape:
            return (f"{name} (shape {tuple(sp.shape)} vs reference {tuple(rp.shape)})", math.inf)
        diff = (sp - rp.detach()).abs().max().item() if rp.numel() else 0.0
        if not diff <= worst[1]:  # also catches NaN
            worst = (name, diff)
    return worst


def compare_grads(ref: nn.Module, sharded: nn.Module) -> tuple[str, float, list[str]]:
    """(worst name, max abs diff, names whose grad is None on exactly one side)."""
    sh_params = dict(sharded.named_parameters())
    names = [n for n, _ in ref.named_parameters()]
    # How many ranks hold a gradient for each parameter: an inconsistent answer must not
    # make some ranks call full_tensor() (a collective) while the others skip it.
    has_grad = torch.tensor([float(sh_params[n].grad is not None) for n in names])
    dist.all_reduce(has_grad)
    ws = dist.get_world_size()
    worst = ("", 0.0)
    none_mismatch = []
    for name, count, (_, rp) in zip(names, has_grad.tolist(), ref.named_parameters()):
        sg = sh_params[name].grad
        if 0 < count < ws:
            none_mismatch.append(f"{name}: sharded grad set on only {int(count)} of {ws} ranks")
            continue
        if (rp.grad is None) != (sg is None):
            none_mismatch.append(
                f"{name}: reference grad {'None' if rp.grad is None else 'set'}, "
                f"sharded grad {'None' if sg is None else 'set'}"
            )
            continue
        if sg is None:
            continue
        sg = full(sg)
        diff = (sg - rp.grad).abs().max().item() if rp.numel() else 0.0
        if not diff <= worst[1]:
            worst = (name, diff)
    return worst[0], worst[1], none_mismatch


def non_dtensor_params(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if not is_dtensor(p)]


def eval_diff(
    ref: nn.Module, sharded: nn.Module, case: ParityCase, local: tuple, step: int
) -> float:
    """Max abs diff of ``model.eval()`` + ``no_grad`` outputs on the local batch."""
    ref.eval()
    sharded.eval()
    with torch.no_grad():
        expected = forward(ref, case, local, step)
        got = forward(sharded, case, local, step)
    ref.train()
    sharded.train()
    got = full(got)
    if got.shape != expected.shape:
        return math.inf
    return (got - expected).abs().max().item()


# ------------------------------------------------------------------ rank functions


def run_parity(case: ParityCase) -> dict:
    """Rank function: train the sharded model and the reference side by side."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    mesh = make_mesh()
    ref = build_model(case)
    frozen = apply_freeze(ref, case.freeze)
    model = copy.deepcopy(ref)
    initial_frozen = {n: p.detach().clone() for n, p in ref.named_parameters() if n in frozen}
    shard_model(model, case, case.impl, mesh)

    report: dict[str, Any] = {
        "rank": rank,
        "non_dtensor_params": non_dtensor_params(model),
        "frozen": frozen,
        "requires_grad_lost": [
            n for n, p in model.named_parameters() if (n in frozen) == p.requires_grad
        ],
        "steps": [],
    }
    ref_opt = make_optimizer(ref, case.lr)
    opt = make_optimizer(model, case.lr)
    for step in range(case.steps):
        batch = make_global_batch(case, step, ws)
        local = local_slice(batch, rank, case.local_batch)

        ref_loss = loss_of(ref, case, batch, step)
        ref_loss.backward()
        loss = loss_of(model, case, local, step)
        loss.backward()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss /= ws

        g_name, g_diff, g_none = compare_grads(ref, model)
        entry: dict[str, Any] = {
            "step": step,
            "loss_ref": ref_loss.item(),
            "loss_fsdp": mean_loss.item(),
            "grad_worst": (g_name, g_diff),
            "grad_none_mismatch": g_none,
        }
        if case.clip_max_norm is not None:
            ref_norm = nn.utils.clip_grad_norm_(ref.parameters(), case.clip_max_norm)
            norm = nn.utils.clip_grad_norm_(model.parameters(), case.clip_max_norm)
            entry["norm_ref"] = ref_norm.item()
            entry["norm_fsdp"] = full(norm).item()
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
        entry["param_worst"] = compare_params(ref, model)
        if case.eval_every_step:
            entry["eval_diff"] = eval_diff(ref, model, case, local, step)
        report["steps"].append(entry)

    # Frozen parameters must be bit-identical to their initial value.
    sh_params = dict(model.named_parameters())
    report["frozen_changed"] = [
        n
        for n, init in initial_frozen.items()
        if not torch.equal(full(sh_params[n].detach()), init)
    ]
    batch = make_global_batch(case, case.steps, ws)
    report["final_eval_diff"] = eval_diff(
        ref, model, case, local_slice(batch, rank, case.local_batch), case.steps
    )
    return report


def assert_parity(reports: list[dict], case: ParityCase) -> None:
    """Check the per-rank reports of ``run_parity`` (in the pytest process)."""
    tol = case.tol
    for rep in reports:
        where = f"[{case.impl}, {case.model}, rank {rep['rank']}/{len(reports)}]"
        assert not rep["non_dtensor_params"], (
            f"{where} parameters not converted to DTensor: {rep['non_dtensor_params']}"
        )
        assert not rep["requires_grad_lost"], (
            f"{where} requires_grad changed by sharding: {rep['requires_grad_lost']}"
        )
        for e in rep["steps"]:
            s = e["step"]
            assert not e["grad_none_mismatch"], (
                f"{where} step {s}: grad None-ness differs from the reference: "
                f"{e['grad_none_mismatch']}"
            )
            assert abs(e["loss_fsdp"] - e["loss_ref"]) <= tol * max(1.0, abs(e["loss_ref"])), (
                f"{where} step {s}: loss {e['loss_fsdp']!r} vs reference {e['loss_ref']!r}"
            )
            g_name, g_diff = e["grad_worst"]
            assert g_diff <= tol, f"{where} step {s}: grad of {g_name} differs by {g_diff:.3g}"
            if "norm_ref" in e:
                assert abs(e["norm_fsdp"] - e["norm_ref"]) <= tol * max(1.0, e["norm_ref"]), (
                    f"{where} step {s}: clip_grad_norm_ total norm {e['norm_fsdp']!r} "
                    f"vs reference {e['norm_ref']!r}"
                )
            p_name, p_diff = e["param_worst"]
            assert p_diff <= tol, (
                f"{where} after step {s}: parameter {p_name} differs from the reference by "
                f"{p_diff:.3g} (tol {tol:g})"
            )
            if "eval_diff" in e:
                assert e["eval_diff"] <= case.eval_tol, (
                    f"{where} after step {s}: eval/no_grad output differs by {e['eval_diff']:.3g}"
                )
        assert not rep["frozen_changed"], (
            f"{where} frozen parameters changed: {rep['frozen_changed']}"
        )
        assert rep["final_eval_diff"] <= case.eval_tol, (
            f"{where} final eval/no_grad output differs from the reference by "
            f"{rep['final_eval_diff']:.3g}"
        )


def run_cross_impl(case: ParityCase) -> dict:
    """Rank function: the same case under fsdp2 and torch; compare them with each other."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    mesh = make_mesh()
    base = build_model(case)
    apply_freeze(base, case.freeze)
    models = {impl: shard_model(copy.deepcopy(base), case, impl, mesh) for impl in IMPLS}
    opts = {impl: make_optimizer(m, case.lr) for impl, m in models.items()}
    steps = []
    for step in range(case.steps):
        local = local_slice(make_global_batch(case, step, ws), rank, case.local_batch)
        losses = {}
        for impl in IMPLS:
            loss = loss_of(models[impl], case, local, step)
            loss.backward()
            losses[impl] = loss.item()
            opts[impl].step()
            opts[impl].zero_grad()
        a = {n: full(p.detach()) for n, p in models["fsdp2"].named_parameters()}
        worst = ("", 0.0)
        for n, p in models["torch"].named_parameters():
            if n not in a:
                worst = (f"{n} (missing in fsdp2)", math.inf)
                continue
            d = (a[n] - full(p.detach())).abs().max().item() if p.numel() else 0.0
            if not d <= worst[1]:
                worst = (n, d)
        steps.append({"step": step, "losses": losses, "param_worst": worst})
    return {"rank": rank, "steps": steps}


# ------------------------------------------------------------------ FSDP structure


def fsdp_groups(model: nn.Module, impl: str) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """For every module that ``fully_shard`` was applied to (an ``FSDPModule``), the
    parameters it manages: its parameters minus those of nested FSDP modules."""
    cls = get_fsdp_module_cls(impl)
    fsdp_names = [n for n, m in model.named_modules() if isinstance(m, cls)]
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {n: [] for n in fsdp_names}
    for pname, p in model.named_parameters():
        owner = max(
            (m for m in fsdp_names if m == "" or pname.startswith(m + ".")),
            key=len,
            default=None,
        )
        if owner is not None:
            groups[owner].append((pname, p))
    return groups
