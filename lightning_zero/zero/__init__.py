"""The ZeRO engine: plain PyTorch, usable and testable without a Trainer."""

from lightning_zero.zero.accounting import ModelStateBytes, model_state_bytes
from lightning_zero.zero.comm import Collectives, CountingCollectives
from lightning_zero.zero.flat_buffer import Bucket, FlatParamBuffer, GradState, Range
from lightning_zero.zero.optimizer import ShardedOptimizer, ZeroOptimizer, check_shardable, no_sync

__all__ = [
    "Bucket",
    "Collectives",
    "CountingCollectives",
    "FlatParamBuffer",
    "GradState",
    "ModelStateBytes",
    "Range",
    "ShardedOptimizer",
    "ZeroOptimizer",
    "check_shardable",
    "model_state_bytes",
    "no_sync",
]
