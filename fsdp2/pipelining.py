"""``PipelineStage`` for stage modules sharded with fsdp2 (``torch.distributed.pipelining``).

torch's pipeline schedules give FSDP modules special treatment, chosen by
``isinstance(stage.submod, torch.distributed.fsdp.FSDPModule)``: every microbatch's
backward runs without gradient sync and without resharding, and once all microbatches
are done the stage reduce-scatters the summed gradients (one collective per group per
step), reshards, and only then divides by the number of microbatches.

fsdp2's modules are not instances of torch's class, so with torch's ``PipelineStage`` a
schedule drives them like plain modules. That is still correct, since fsdp2's own hooks
reduce and reshard after each microbatch's backward: the sum of the microbatches' reduced
shards is the step's gradient, up to rounding. But it costs a reduce-scatter per group
per *microbatch*, all-gathers the stage again for every microbatch, and rounds
differently than torch (with more than one data-parallel rank, not bitwise equal).

This ``PipelineStage`` gives fsdp2 modules torch's treatment through fsdp2's public
switches (``set_requires_gradient_sync``, ``set_reshard_after_backward``,
``set_is_last_backward``) plus the deferred reduction of ``reduce_unsynced_grads``.
Import it instead of torch's: ``from fsdp2.pipelining import PipelineStage``. Stage
modules sharded with torch's ``fully_shard`` (or not sharded) behave exactly as with
torch's class. See docs/pipelining.md.

This module imports ``torch.distributed.pipelining`` (which itself imports torch's FSDP);
``import fsdp2`` does not import it.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage

from fsdp2._fully_shard import FSDPModule

__all__ = ["PipelineStage"]


class PipelineStage(_TorchPipelineStage):
    """torch's ``PipelineStage``, with torch's FSDP gradient handling for fsdp2 modules.

    The stage module itself must be the fsdp2 root (``fully_shard`` applied to it, after
    its blocks), as torch requires of its own ``fully_shard``.
    """

    def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> Any:
        """The schedule's first step infers the backward metadata with a real backward of
        the stage (input gradients only). fsdp2 reduce-scatters a group after any backward
        (zeros where a rank has no gradient, so that ranks never disagree on collectives),
        where torch's ``fully_shard`` issues nothing without gradients: skip the sync, so
        the first step issues torch's collectives. A private hook of torch's stage; if a
        torch version renames it, the only cost is that one extra reduction of zeros."""
        module = self.submod
        if not isinstance(module, FSDPModule):
            return super()._prepare_backward_infra(*args, **kwargs)
        module.set_requires_gradient_sync(False)
        try:
            return super()._prepare_backward_infra(*args, **kwargs)
        finally:
            module.set_requires_gradient_sync(True)

    def backward_maybe_with_nosync(
        self, backward_type: Any, bwd_kwargs: dict, last_backward: bool = False
    ) -> Any:
        """Every microbatch's backward (the last one too): accumulate the unsharded
        gradients locally and keep the parameters unsharded for the next microbatch;
        ``perform_reduce_grad`` reduces once at the end."""
        module = self.submod
        if isinstance(module, FSDPModule):
            module.set_is_last_backward(False)
            module.set_reshard_after_backward(False)
            module.set_requires_gradient_sync(False)
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        """After the step's last backward: reduce-scatter the accumulated gradients and
        reshard, then let torch divide them by the number of microbatches (the division
        must come after the reduction, as for torch's modules, to round the same)."""
        module = self.submod
        if isinstance(module, FSDPModule):
            module.set_is_last_backward(True)
            module.set_reshard_after_backward(True)
            module.set_requires_gradient_sync(True)
            module._fsdp_state.reduce_unsynced_grads()
        super().perform_reduce_grad(grad_scale_factor)
