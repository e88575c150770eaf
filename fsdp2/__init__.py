"""fsdp2: fully sharded data parallelism for PyTorch.

Drop-in for ``torch.distributed.fsdp``'s ``fully_shard`` API: switch by changing the import.
Reading order for the implementation: ``_fully_shard`` (API) -> ``_init`` (validation,
discovery) -> ``_state`` (hooks, lazy init, final callback) -> ``_param_group`` (per-group
unshard/reshard) -> ``_grad_reduce`` (per-group gradient reduction) -> ``_comm_context``
(streams and reductions shared by a tree) -> ``_param`` (one parameter's views) ->
``_collectives`` -> ``_fingerprints`` and ``_divergence`` (what ranks that run different
paths are told: the divergence checks) -> ``_stream_utils``. Above the runtime and
imported by nothing in it: ``trace`` (``trace_schedule``, the schedule trace) and ``plan``
(``plan_sharding``). ``docs/design.md`` indexes the named notes.
"""

from fsdp2._checkpoint import (
    ModelOptimizerState,
    get_full_state_dict,
    init_sharded_,
    load_checkpoint,
    load_full_state_dict,
    save_checkpoint,
)
from fsdp2._divergence import DivergenceError, set_divergence_checks
from fsdp2._fully_shard import (
    FSDPModule,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from fsdp2._policies import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ReducePolicy,
)
from fsdp2.clip_grad import clip_grad_norm_, clip_grads_with_norm_, get_total_norm
from fsdp2.optim import set_optimizer_fast_path
from fsdp2.plan import ShardingPlan, plan_sharding
from fsdp2.trace import ScheduleTrace, trace_schedule

__version__ = "0.1.0.dev0"

__all__ = [
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "DivergenceError",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "ModelOptimizerState",
    "OffloadPolicy",
    "ReducePolicy",
    "ScheduleTrace",
    "ShardingPlan",
    "UnshardHandle",
    "clip_grad_norm_",
    "clip_grads_with_norm_",
    "fully_shard",
    "get_full_state_dict",
    "get_total_norm",
    "init_sharded_",
    "load_checkpoint",
    "load_full_state_dict",
    "plan_sharding",
    "register_fsdp_forward_method",
    "save_checkpoint",
    "set_divergence_checks",
    "set_optimizer_fast_path",
    "share_comm_ctx",
    "trace_schedule",
]
