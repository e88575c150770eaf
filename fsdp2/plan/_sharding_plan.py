"""``ShardingPlan``: what ``plan_sharding`` decided and predicted, and how to apply it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from fsdp2._fully_shard import fully_shard
from fsdp2._policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from fsdp2.plan._simulate import CATEGORIES

# Display names of the breakdown's categories.
CATEGORY_NAMES = {
    "sharded_params": "sharded parameters",
    "gradients": "gradients (unsharded until reduced, then sharded)",
    "optimizer_state": "optimizer state",
    "unsharded_params": "unsharded parameters in flight (prefetch included)",
    "comm_buffers": "communication buffers",
    "activations": "activations (saved by forward)",
    "temporaries": "temporaries (backward, loss, optimizer step)",
    "buffers": "module buffers",
}


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class GroupPlan:
    """One ``fully_shard`` call: its module(s) and what it costs per rank and per step."""

    modules: tuple[str, ...]  # FQNs under the model ("" is the model itself)
    reshard_after_forward: bool | int
    num_params: int  # parameters it manages
    sharded_bytes: int  # per rank, padding included (its flat shard)
    unsharded_bytes: int  # while gathered, alignment gaps included
    all_gather_count: int  # per optimizer step
    all_gather_bytes: int  # payload per step (the all-gather outputs)
    reduce_scatter_count: int
    reduce_scatter_bytes: int  # payload per step (the reduce-scatter inputs)
    all_reduce_count: int = 0  # HSDP: across replicas
    all_reduce_bytes: int = 0

    @property
    def target(self) -> str | tuple[str, ...]:
        """What to pass to ``fully_shard``: one FQN, or several for one call."""
        return self.modules[0] if len(self.modules) == 1 else self.modules

    def to_dict(self) -> dict[str, Any]:
        return {
            "modules": list(self.modules),
            "reshard_after_forward": self.reshard_after_forward,
            "num_params": self.num_params,
            "sharded_bytes": self.sharded_bytes,
            "unsharded_bytes": self.unsharded_bytes,
            "all_gather": {"count": self.all_gather_count, "bytes": self.all_gather_bytes},
            "reduce_scatter": {
                "count": self.reduce_scatter_count,
                "bytes": self.reduce_scatter_bytes,
            },
            "all_reduce": {"count": self.all_reduce_count, "bytes": self.all_reduce_bytes},
        }


@dataclass
class ShardingPlan:
    """A planned sharding of one model: the ``fully_shard`` calls in order, and the
    predicted per-rank peak memory and per-step communication.

    ``peak_bytes`` is rank 0's peak of live tensor memory over one optimizer step, counted
    by storage range as ``benchmarks/memory.py`` measures it; ``breakdown`` splits it by
    category (the keys of ``CATEGORY_NAMES``) at that moment. ``apply(model)`` makes the
    calls. ``report()`` is a table; ``to_dict()`` the same as plain data.
    """

    model: str  # the model's class
    group_plans: list[GroupPlan]
    peak_bytes: int
    breakdown: dict[str, int]
    peak_phase: str  # forward, backward or optimizer
    peak_at: str
    world_size: int
    mesh_shape: tuple[int, ...]  # (shard,) or (replicate, shard)
    device_type: str
    mp_policy: MixedPrecisionPolicy
    offload_policy: OffloadPolicy
    optimizer: str
    memory_budget: int | None = None
    assumptions: list[str] = field(default_factory=list)
    ignored_params: tuple[str, ...] = ()
    planning_seconds: float = 0.0
    # CPU offload from an accelerator: the peak of host memory (shards, sharded
    # gradients, optimizer state and step), which ``peak_bytes`` leaves out.
    host_peak_bytes: int = 0

    @property
    def groups(self) -> list[str | tuple[str, ...]]:
        """The groups in ``fully_shard`` order (bottom-up, the root last): an FQN per call,
        or a tuple of FQNs for a call on several modules."""
        return [g.target for g in self.group_plans]

    @property
    def dominant(self) -> str:
        """The category that holds the most memory at the peak."""
        return max(CATEGORIES, key=lambda c: self.breakdown.get(c, 0))

    def totals(self) -> dict[str, tuple[int, int]]:
        """Per collective kind: (count, payload bytes) per optimizer step, all groups."""
        return {
            "all_gather": (
                sum(g.all_gather_count for g in self.group_plans),
                sum(g.all_gather_bytes for g in self.group_plans),
            ),
            "reduce_scatter": (
                sum(g.reduce_scatter_count for g in self.group_plans),
                sum(g.reduce_scatter_bytes for g in self.group_plans),
            ),
            "all_reduce": (
                sum(g.all_reduce_count for g in self.group_plans),
                sum(g.all_reduce_bytes for g in self.group_plans),
            ),
        }

    # -- output --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        mp = self.mp_policy
        return {
            "model": self.model,
            "world_size": self.world_size,
            "mesh_shape": list(self.mesh_shape),
            "device_type": self.device_type,
            "mp_policy": {
                "param_dtype": str(mp.param_dtype) if mp.param_dtype else None,
                "reduce_dtype": str(mp.reduce_dtype) if mp.reduce_dtype else None,
                "output_dtype": str(mp.output_dtype) if mp.output_dtype else None,
                "cast_forward_inputs": mp.cast_forward_inputs,
            },
            "cpu_offload": isinstance(self.offload_policy, CPUOffloadPolicy),
            "optimizer": self.optimizer,
            "memory_budget": self.memory_budget,
            "peak_bytes": self.peak_bytes,
            "host_peak_bytes": self.host_peak_bytes,
            "peak_phase": self.peak_phase,
            "peak_at": self.peak_at,
            "breakdown": dict(self.breakdown),
            "groups": [g.to_dict() for g in self.group_plans],
            "totals": {k: {"count": c, "bytes": b} for k, (c, b) in self.totals().items()},
            "ignored_params": list(self.ignored_params),
            "assumptions": list(self.assumptions),
            "planning_seconds": self.planning_seconds,
        }

    def report(self) -> str:
        """A readable table: the assumptions, the peak and its breakdown, one row per
        group, and the totals per step."""
        mp = self.mp_policy
        mesh = (
            f"{self.world_size} ranks"
            if len(self.mesh_shape) == 1
            else f"{self.world_size} ranks (HSDP: {self.mesh_shape[0]} replicas x "
            f"{self.mesh_shape[1]} shards)"
        )
        dtypes = (
            f"param_dtype {_dtype(mp.param_dtype)}, reduce_dtype {_dtype(mp.reduce_dtype)}"
            if mp.param_dtype or mp.reduce_dtype
            else "parameters' own dtypes"
        )
        lines = [
            f"fsdp2 sharding plan for {self.model}: {mesh} on {self.device_type}, {dtypes}, "
            f"optimizer {self.optimizer}",
            "Assumptions:",
            *[f"  - {a}" for a in self.assumptions],
            "",
        ]
        budget = ""
        if self.memory_budget is not None:
            fits = "fits" if self.peak_bytes <= self.memory_budget else "DOES NOT FIT"
            budget = f"  [budget {format_bytes(self.memory_budget)}: {fits}]"
        lines.append(
            f"Predicted peak per rank: {format_bytes(self.peak_bytes)} "
            f"({self.peak_phase}, at {self.peak_at}){budget}"
        )
        width = max(len(n) for n in CATEGORY_NAMES.values())
        for cat in CATEGORIES:
            nbytes = self.breakdown.get(cat, 0)
            share = 100.0 * nbytes / self.peak_bytes if self.peak_bytes else 0.0
            lines.append(
                f"  {CATEGORY_NAMES[cat]:<{width}}  {format_bytes(nbytes):>12}  {share:5.1f}%"
            )
        if self.host_peak_bytes:
            lines.append(
                f"  host memory (CPU offload: shards, sharded gradients, optimizer), peak "
                f"{format_bytes(self.host_peak_bytes)}, not in the device peak above"
            )
        lines.append("")
        header = (
            f"{'#':>4}  {'modules':<32} {'params':>6} {'reshard':>7} {'sharded/rank':>13} "
            f"{'unsharded':>12} {'AG/step':>7} {'AG bytes':>12} {'RS/step':>7} {'RS bytes':>12}"
        )
        if len(self.mesh_shape) > 1:
            header += f" {'AR/step':>7} {'AR bytes':>12}"
        lines += [
            "Groups, in fully_shard order (bytes per rank; collective payloads per step):",
            header,
        ]
        for i, g in enumerate(self.group_plans):
            names = ", ".join(n or "<root>" for n in g.modules)
            if len(names) > 32:
                names = names[:29] + "..."
            row = (
                f"{i:>4}  {names:<32} {g.num_params:>6} {g.reshard_after_forward!s:>7} "
                f"{format_bytes(g.sharded_bytes):>13} {format_bytes(g.unsharded_bytes):>12} "
                f"{g.all_gather_count:>7} {format_bytes(g.all_gather_bytes):>12} "
                f"{g.reduce_scatter_count:>7} {format_bytes(g.reduce_scatter_bytes):>12}"
            )
            if len(self.mesh_shape) > 1:
                row += f" {g.all_reduce_count:>7} {format_bytes(g.all_reduce_bytes):>12}"
            lines.append(row)
        lines.append("Per step:")
        for kind, (count, nbytes) in self.totals().items():
            if count or kind != "all_reduce":
                lines.append(f"  {kind.replace('_', '-')}: {count} calls, {format_bytes(nbytes)}")
        if self.ignored_params:
            lines.append(f"Ignored (not sharded): {', '.join(self.ignored_params)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.report()

    # -- applying ------------------------------------------------------------------------
    def apply(self, model: nn.Module, *, mesh: Any = None) -> nn.Module:
        """Call ``fully_shard`` on ``model``'s modules in the planned order with the
        planned arguments, and return ``model``. ``mesh``: the ``DeviceMesh`` to shard
        over (default: ``fully_shard``'s, all ranks); its size must be the planned one."""
        if mesh is not None:
            size = mesh.size()
            if size != self.world_size:
                raise ValueError(
                    f"ShardingPlan.apply: the plan is for {self.world_size} ranks, the mesh "
                    f"has {size}; plan again with plan_sharding(model, mesh=mesh)."
                )
        named = dict(model.named_modules())
        params = dict(model.named_parameters())
        missing = [n for g in self.group_plans for n in g.modules if n not in named]
        if missing:
            raise ValueError(
                f"ShardingPlan.apply: {type(model).__name__} has no submodule(s) "
                f"{', '.join(repr(n) for n in missing)}; apply the plan to the model it was "
                f"made for ({self.model})."
            )
        ignored = {params[n] for n in self.ignored_params if n in params}
        for g in self.group_plans:
            targets = [named[n] for n in g.modules]
            fully_shard(
                targets if len(targets) > 1 else targets[0],
                mesh=mesh,
                reshard_after_forward=g.reshard_after_forward,
                mp_policy=self.mp_policy,
                offload_policy=self.offload_policy,
                ignored_params=ignored or None,
            )
        return model


def _dtype(dtype: Any) -> str:
    return str(dtype).replace("torch.", "") if dtype is not None else "-"
