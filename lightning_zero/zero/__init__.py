"""The ZeRO engine: plain PyTorch, usable and testable without a Trainer."""

from lightning_zero.zero.accounting import ModelStateBytes, model_state_bytes
from lightning_zero.zero.comm import Collectives, CountingCollectives
from lightning_zero.zero.engine import ZeroEngine, make_engine
from lightning_zero.zero.flat import Bucket, FlatEngine, FlatParamBuffer
from lightning_zero.zero.layout import ParamPiece, Range, ShardTile
from lightning_zero.zero.reduce import GradState, ReduceSchedule, Reduction
from lightning_zero.zero.optimizer import ShardedOptimizer, ZeroOptimizer, check_shardable, no_sync

__all__ = [
    "Bucket",
    "FlatEngine",
    "ParamPiece",
    "ReduceSchedule",
    "Reduction",
    "ShardTile",
    "ZeroEngine",
    "make_engine",
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
