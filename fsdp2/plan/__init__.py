"""Plan a sharding before running it: per-rank memory, per-step communication, groups.

``plan_sharding(model, world_size=...)`` returns a ``ShardingPlan``; ``python -m
fsdp2.plan MODULE:FACTORY ...`` prints its report. This package sits above the runtime:
it imports the runtime's layout rules and ``fully_shard``, and nothing in the runtime
imports it. See docs/planning.md.

Reading order: ``_plan_sharding`` (the entry point) -> ``_grouping`` (automatic groups,
``reshard_after_forward``) -> ``_evaluate`` (one candidate plan) -> ``_sharding_plan``
(the result) -> ``_simulate`` (the runtime's schedule replayed with sizes) -> ``_trace``
(activations from one fake forward and backward) -> ``_optimizer`` -> ``_model`` ->
``_layout`` (one group's buffer sizes).
"""

from fsdp2.plan._plan_sharding import plan_sharding
from fsdp2.plan._sharding_plan import GroupPlan, ShardingPlan

__all__ = ["GroupPlan", "ShardingPlan", "plan_sharding"]
