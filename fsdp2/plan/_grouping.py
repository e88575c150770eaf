"""Automatic grouping (``groups="auto"``) and the choice of ``reshard_after_forward``.

[Note: automatic grouping]
1. **Units.** The repeated blocks come first, as torchtitan wraps by hand: the outermost
   runs of sibling modules of one class with the same parameter shapes (``layers.0``,
   ``layers.1``...). In a layer stack (a ``ModuleList`` or ``ModuleDict``) one class is
   enough: its layers are blocks even where their parameters differ, as T5's first block
   holds the relative position bias and DeepSeek's first layers are dense where the
   rest are mixture-of-experts; torchtitan and accelerate wrap each of them, and
   descending into them would group their projections instead. Not when the layers
   hold layer stacks of their own, as a vision model's stages of different widths hold
   their repeated layers (ConvNeXt, Swin, ResNet): those inner layers are the blocks,
   finer units that merging can still join. Every other module with parameters that holds no block is a unit
   too, the largest such (``tok_embeddings``, ``norm``, ``output``); a unit whose forward
   never runs (a container) gives way to its children. Units that share a parameter
   (tied weights) are one unit: fully_shard refuses a parameter in two groups.
2. **Groups.** Each block is a group. A unit outside the blocks gets a group of its own
   when it is at least ``min_group_bytes``; smaller ones stay in the root's group. Runs of
   consecutive blocks (in forward order) below ``min_group_bytes`` are merged into list
   groups (``fully_shard([layers.0, layers.1])``) of as many blocks as fit in
   ``min_group_bytes`` (the last group of a run may hold fewer), halving that size until
   the plan fits (step 4), down to one block per group.
3. **Size.** A collective costs a fixed time (launch, hooks, synchronization: the
   latency ``a``) plus its bytes over the bandwidth ``b``. A group of ``n`` bytes spends
   the share ``a / (a + n / b)`` of its collective time on the fixed part; merging
   groups divides that part, and holds more parameters at once. Groups are merged up to
   the size where the fixed part is ``LATENCY_SHARE`` (10%) of the time:
   ``min_group_bytes = a * b * (1 - share) / share`` (9 ``a * b``), from
   ``COLLECTIVE_COSTS`` for the device type, or given.
4. **Budget.** The plan is the fastest that fits ``memory_budget``, or without one the
   peak of one group per block with the runtime's default ``reshard_after_forward`` plus
   ``PEAK_ALLOWANCE`` (5%): the merged grouping if it fits, else smaller merges,
   else one group per block; then as many of the last groups in forward order (the first
   ones backward needs) as fit keep their parameters after forward
   (``reshard_after_forward=False``), which saves their backward all-gathers. If even one
   group per block resharding everything (the root too) exceeds a budget, the error gives
   that plan's peak and what dominates it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from torch import nn

from fsdp2.plan._evaluate import Evaluation, Planner, Reshard
from fsdp2.plan._model import Group, ModelInfo
from fsdp2.plan._sharding_plan import CATEGORY_NAMES, format_bytes
from fsdp2.plan._simulate import CATEGORIES

# (latency in seconds, bandwidth in bytes per second) of one collective, per device type.
# cpu: gloo between processes of one host, ``benchmarks/plan_auto.py --calibrate`` on the
# 2-core development machine: all-gather 0.20 ms and 1.25 GB/s, reduce-scatter 0.30 ms and
# 0.56 GB/s (docs/planning.md). cuda: NCCL, a conservative middle of launches of 10-50 us
# and 25-200 GB/s per rank over NVLink and InfiniBand.
COLLECTIVE_COSTS: dict[str, tuple[float, float]] = {
    "cpu": (2.5e-4, 1.0e9),
    "cuda": (5e-5, 1e11),
}
DEFAULT_COSTS = COLLECTIVE_COSTS["cuda"]
# A group of min_group_bytes spends this share of its collective time on the fixed cost.
LATENCY_SHARE = 0.1
# Without a budget, the plan may raise the predicted peak this much over one group per
# block with the runtime's default reshard_after_forward (merging, keeping parameters).
PEAK_ALLOWANCE = 0.05


def default_min_group_bytes(device_type: str) -> int:
    """``a * b * (1 - LATENCY_SHARE) / LATENCY_SHARE``: see [Note: automatic grouping]."""
    latency, bandwidth = COLLECTIVE_COSTS.get(device_type, DEFAULT_COSTS)
    return int(latency * bandwidth * (1 - LATENCY_SHARE) / LATENCY_SHARE)


# -- units -----------------------------------------------------------------------------------
def _signature(info: ModelInfo, m: int, shapes: bool) -> tuple[object, ...]:
    if not shapes:
        return (type(info.modules[m]),)
    found = tuple(
        info.params[p].shape for sub in info.subtree(m) for _, p in info.local_params[sub]
    )
    return (type(info.modules[m]), found)


def _has_run(info: ModelInfo, m: int) -> bool:
    """Whether container ``m`` holds two children with parameters of one class and
    parameter shapes."""
    kids = [c for c in info.children[m] if info.subtree_param_count(c)]
    return len(set(_signature(info, c, shapes=True) for c in kids)) < len(kids)


def _holds_a_layer_stack(info: ModelInfo, m: int) -> bool:
    """Whether ``m``'s subtree holds a container of repeated layers (a ``ModuleList``,
    ``ModuleDict`` or ``Sequential`` with a run): a vision model's stage holding its
    layers, unlike a transformer layer, whose repeated projections are attributes."""
    containers = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
    return any(
        isinstance(info.modules[sub], containers) and _has_run(info, sub)
        for sub in info.subtree(m)
        if sub != m
    )


def repeated_blocks(info: ModelInfo) -> list[int]:
    """The outermost runs of sibling modules of one class and parameter shapes (of one
    class in a layer stack whose layers hold no layer stack: see [Note: automatic
    grouping])."""
    blocks: list[int] = []

    def visit(m: int) -> None:
        kids = [c for c in info.children[m] if info.subtree_param_count(c)]
        relaxed = isinstance(info.modules[m], (nn.ModuleList, nn.ModuleDict)) and not any(
            _holds_a_layer_stack(info, c) for c in kids
        )
        counts = Counter(_signature(info, c, shapes=not relaxed) for c in kids)
        for c in info.children[m]:
            if c in kids and counts[_signature(info, c, shapes=not relaxed)] >= 2:
                blocks.append(c)
            else:
                visit(c)

    visit(0)
    return blocks


def find_units(info: ModelInfo, blocks: Sequence[int]) -> list[int]:
    """Blocks, and the largest modules with parameters that hold no block."""
    block_set = set(blocks)
    holds_block = set()
    for b in blocks:
        m = info.parent[b]
        while m >= 0:
            holds_block.add(m)
            m = info.parent[m]
    units: list[int] = []

    def visit(m: int) -> None:
        for c in info.children[m]:
            if c in block_set:
                units.append(c)
            elif c in holds_block:
                visit(c)
            elif info.subtree_param_count(c):
                units.append(c)

    visit(0)
    return units


class _Units:
    """The candidate groups in forward order with their sizes: blocks, and the other
    units of at least ``threshold`` bytes; tied units joined. Units below ``threshold``
    outside the blocks stay in the root's group and are not traced as groups, so that
    every grouping built from these candidates hooks the same modules (one trace)."""

    def __init__(self, planner: Planner, threshold: int) -> None:
        info = planner.info
        dtype = planner.mp_policy.param_dtype

        def params_of(members: Sequence[int]) -> set[int]:
            return {
                p
                for m in members
                for s in info.subtree(m)
                for _, p in info.local_params[s]
                if p not in planner.ignored
            }

        def size(members: Sequence[int]) -> int:
            return sum(
                info.params[p].numel * (dtype or info.params[p].dtype).itemsize
                for p in params_of(members)
            )

        blocks = set(repeated_blocks(info))
        units = find_units(info, sorted(blocks))
        # Tied units (a parameter used in two units) are one unit; parameters of the
        # model itself keep every unit that uses them in the root's group.
        joined: list[list[int]] = []
        for u in units:
            mine = params_of([u])
            for members in joined:
                if mine & params_of(members):
                    members.append(u)
                    break
            else:
                joined.append([u])
        outside = {p for _, p in info.local_params[0]}
        candidates = [
            tuple(members)
            for members in joined
            if not params_of(members) & outside
            and ((len(members) == 1 and members[0] in blocks) or size(members) >= threshold)
        ]
        trace = planner.trace(candidates, (0,))
        if trace.traced:
            # A container whose forward never runs gives way to its children (found
            # again as units); a leaf that never runs leaves its parameters to the root.
            silent = [g for g in candidates if not all(trace.forward_calls(m) for m in g)]
            for group in silent:
                candidates.remove(group)
                for m in group:
                    for child in info.children[m]:
                        if info.subtree_param_count(child):
                            candidates.append((child,))
            if silent:
                trace = planner.trace(candidates, (0,))
                candidates = [g for g in candidates if all(trace.forward_calls(m) for m in g)]
            first: dict[int, int] = {}
            for i, e in enumerate(trace.events):
                if e.kind == "fwd_pre" and not e.in_backward:
                    first.setdefault(e.target, i)
            candidates.sort(key=lambda g: min(first[m] for m in g))
        self.groups: list[tuple[int, ...]] = candidates
        self.is_block = [len(g) == 1 and g[0] in blocks for g in candidates]
        self.bytes = [size(g) for g in candidates]


def _grouping(units: _Units, merge_bytes: int | None) -> list[Group]:
    """Groups from the candidates: each block alone, or (``merge_bytes``) each run of
    consecutive blocks below it cut into groups of as many blocks as fit; the other
    candidates alone; the root's group last."""
    out: list[Group] = []
    run: list[int] = []  # consecutive small blocks (indices into units)

    def flush() -> None:
        if not run:
            return
        per_group = 1
        if merge_bytes is not None:
            per_group = max(1, merge_bytes // max(units.bytes[i] for i in run))
        for start in range(0, len(run), per_group):
            chunk = run[start : start + per_group]
            out.append(tuple(m for i in chunk for m in units.groups[i]))
        run.clear()

    for i, group in enumerate(units.groups):
        if units.is_block[i] and merge_bytes is not None and units.bytes[i] < merge_bytes:
            run.append(i)
            continue
        flush()
        out.append(group)
    flush()
    out.append((0,))  # units never nest, so any order of them is bottom-up
    return out


# -- reshard_after_forward ---------------------------------------------------------------------
def default_reshard(groups: Sequence[Group]) -> list[Reshard]:
    """The runtime's default: reshard every group but the root."""
    return [0 not in g for g in groups]


def _forward_order(planner: Planner, ev: Evaluation) -> list[int]:
    """Non-root groups by their first forward (fully_shard order without a trace)."""
    trace = planner.trace(ev.groups, (0,)) if planner.example_inputs is not None else None
    first: dict[int, int] = {}
    of_module = {m: g for g, group in enumerate(ev.groups) for m in group}
    if trace is not None and trace.traced:
        for i, e in enumerate(trace.events):
            g = of_module.get(e.target)
            if e.kind == "fwd_pre" and g is not None and g not in first:
                first[g] = i
    order = [g for g, group in enumerate(ev.groups) if 0 not in group]
    return sorted(order, key=lambda g: first.get(g, g))


def fit_reshard(
    planner: Planner,
    groups: Sequence[Group],
    reshard: Reshard | None,
    budget: int | None,
    *,
    cast_inputs: Sequence[int] = (0,),
) -> Evaluation:
    """Evaluate ``groups`` with ``reshard`` for every call, or (``None``) with the
    runtime's default; with a budget, keep the parameters of as many of the last
    groups in forward order as fit, or reshard the root too if nothing else fits."""
    groups = list(groups)
    if reshard is not None:
        return planner.evaluate(groups, [reshard] * len(groups), cast_inputs=cast_inputs)
    base = planner.evaluate(groups, default_reshard(groups), cast_inputs=cast_inputs)
    if budget is None:
        return base
    if base.result.peak_bytes > budget:
        everything = planner.evaluate(groups, [True] * len(groups), cast_inputs=cast_inputs)
        return min(base, everything, key=lambda ev: ev.result.peak_bytes)
    order = _forward_order(planner, base)

    def keeping(k: int) -> Evaluation:
        setting = default_reshard(groups)
        for g in order[len(order) - k :] if k else []:
            setting[g] = False
        return planner.evaluate(groups, setting, cast_inputs=cast_inputs)

    low, high, best = 0, len(order), base  # the largest k that fits (peak grows with k)
    while low < high:
        mid = (low + high + 1) // 2
        ev = keeping(mid)
        if ev.result.peak_bytes <= budget:
            low, best = mid, ev
        else:
            high = mid - 1
    return best


# -- automatic grouping ------------------------------------------------------------------------
def auto_groups(
    planner: Planner,
    *,
    reshard: Reshard | None,
    budget: int | None,
    min_group_bytes: int | None,
) -> Evaluation:
    """See [Note: automatic grouping]."""
    threshold = min_group_bytes or default_min_group_bytes(planner.mesh.device_type)
    units = _Units(planner, threshold)
    per_block = _grouping(units, None)
    base = fit_reshard(planner, per_block, reshard, budget)
    # Without a budget, the runtime's default with one group per block sets one, plus the
    # allowance: the fastest plan within it is chosen the same way.
    allowed = budget
    if allowed is None:
        allowed = int(base.result.peak_bytes * (1 + PEAK_ALLOWANCE))
    candidate = fit_reshard(planner, per_block, reshard, allowed) if budget is None else base
    limit = threshold
    while limit >= 1:
        merged = _grouping(units, limit)
        if merged == per_block:
            break
        ev = fit_reshard(planner, merged, reshard, allowed)
        if ev.result.peak_bytes <= allowed:
            candidate = ev
            break
        limit //= 2
    if budget is not None and candidate.result.peak_bytes > budget:
        raise smallest_peak_error(planner.info, budget, candidate)
    return candidate


def smallest_peak_error(info: ModelInfo, budget: int, best: Evaluation) -> ValueError:
    """The error for a budget below every plan: the smallest peak and what dominates it."""
    result = best.result
    top = sorted(CATEGORIES, key=lambda c: -result.breakdown.get(c, 0))[:3]
    parts = ", ".join(
        f"{CATEGORY_NAMES[c]} {format_bytes(result.breakdown[c])} "
        f"({100 * result.breakdown[c] / result.peak_bytes:.0f}%)"
        for c in top
    )
    advice = {
        "activations": "a smaller batch or sequence per rank, or activation checkpointing",
        "temporaries": "a smaller batch or sequence per rank, or a loss computed in chunks",
        "sharded_params": "more ranks, or CPUOffloadPolicy()",
        "optimizer_state": "more ranks, CPUOffloadPolicy(), or an optimizer with less state",
        "gradients": "more ranks, or smaller groups",
        "unsharded_params": "smaller groups (shard the submodules of the largest blocks)",
        "comm_buffers": "smaller groups",
        "buffers": "fewer or smaller module buffers",
    }[top[0]]
    return ValueError(
        f"plan_sharding: no plan of {info.label} fits memory_budget={format_bytes(budget)} per "
        f"rank; the smallest predicted peak is {format_bytes(result.peak_bytes)} "
        f"({result.peak_phase}), dominated by {parts}. Try {advice}."
    )
