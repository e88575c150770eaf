"""Debug logs of the FSDP hooks, as ``TORCH_LOGS=+fsdp`` shows them.

fsdp2 logs its hook events under torch's ``torch.distributed.fsdp`` logger with torch's
messages (``FSDP::pre_forward (<module fqn>)``...), so turning that logger to DEBUG, by
``TORCH_LOGS=+fsdp`` or by hand, traces either implementation the same way. The test
attaches a handler to that logger on each of 2 ranks, runs one step of a root with two
sharded linears, and compares the sequence of messages with the expected one.
"""

from __future__ import annotations

import logging

import pytest
import torch
from _helpers import IMPLS, get_fully_shard, require_impl
from _launcher import run_ranks
from torch import nn

EXPECTED = [
    "FSDP::root_pre_forward",
    "FSDP::pre_forward (0)",
    "FSDP::post_forward (0)",
    "FSDP::pre_forward (1)",
    "FSDP::post_forward (1)",
    "FSDP::pre_backward (1)",
    "FSDP::post_backward (1)",
    "FSDP::pre_backward (0)",
    "FSDP::root_post_backward",
    "FSDP::post_backward (0)",
]


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _hook_logs(impl: str) -> list[str]:
    fully_shard = get_fully_shard(impl)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(2)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    fsdp_logger = logging.getLogger("torch.distributed.fsdp")
    handler, level = _Collect(), fsdp_logger.level
    fsdp_logger.addHandler(handler)
    fsdp_logger.setLevel(logging.DEBUG)
    try:
        model(torch.randn(4, 4)).sum().backward()
    finally:
        fsdp_logger.removeHandler(handler)
        fsdp_logger.setLevel(level)
    return [m for m in handler.messages if m.startswith("FSDP::")]


@pytest.mark.parametrize("impl", IMPLS)
def test_hook_debug_logs(impl: str) -> None:
    require_impl(impl)
    for rank, messages in enumerate(run_ranks(_hook_logs, 2, impl)):
        assert messages == EXPECTED, f"[{impl}, rank {rank}] {messages}"
