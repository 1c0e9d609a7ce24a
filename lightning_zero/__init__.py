"""lightning_zero: ZeRO data parallelism as a native PyTorch Lightning strategy.

Importing the package registers the strategy names ``zero1``, ``zero2``, ``zero3``,
``zero2_offload`` and ``zero3_offload`` (and ``*_spawn`` variants) with Lightning's Trainer and
Fabric, so ``Trainer(strategy="zero2")`` and ``Fabric(strategy="zero3_offload")`` work. Importing
never builds anything.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_zero.autotuning import SearchSpace, TuningError
from lightning_zero.callbacks import ZeroAutotuner, ZeroMemoryProfiler, ZeroTuner
from lightning_zero.checkpoint import CheckpointError, consolidate, consolidate_hf
from lightning_zero.config import ParallelConfig, PipelineConfig, ZeroConfig
from lightning_zero.deepspeed_config import DeepSpeedConfigWarning, DeepSpeedSettings, read_deepspeed_config
from lightning_zero.zero.stage3.partition import SmallUnitsWarning
from lightning_zero.offload import CPUOffloadPolicy
from lightning_zero.loss_scaler import LossScaleAtMinimumError, LossScaleConfig, LossScaler
from lightning_zero.precision import FrozenRoundingWarning, ZeroPrecision
from lightning_zero.profiling import MemoryBreakdown, MemoryEstimate, estimate_memory
from lightning_zero.fabric import ZeroFabricPrecision, ZeroFabricStrategy
from lightning_zero.strategy import ZeroStrategy, gather_after_error, grad_norm
from lightning_zero.zero.consistency import RanksDisagreeError
from lightning_zero.zero.layout import DataWriteWarning
from lightning_zero.zero import (
    Collectives,
    CountingCollectives,
    ModelStateBytes,
    ZeroOptimizer,
    model_state_bytes,
)

__version__ = "0.1.0"


def _register_strategies() -> None:
    if "zero2" not in StrategyRegistry:
        ZeroStrategy.register_strategies(StrategyRegistry)
    if "zero2" not in FABRIC_STRATEGY_REGISTRY:
        ZeroFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)


_register_strategies()

__all__ = [
    "CheckpointError",
    "CPUOffloadPolicy",
    "Collectives",
    "CountingCollectives",
    "DataWriteWarning",
    "DeepSpeedConfigWarning",
    "FrozenRoundingWarning",
    "SmallUnitsWarning",
    "DeepSpeedSettings",
    "LossScaleAtMinimumError",
    "LossScaleConfig",
    "LossScaler",
    "MemoryBreakdown",
    "MemoryEstimate",
    "ModelStateBytes",
    "ParallelConfig",
    "PipelineConfig",
    "RanksDisagreeError",
    "SearchSpace",
    "TuningError",
    "ZeroAutotuner",
    "ZeroConfig",
    "ZeroFabricPrecision",
    "ZeroFabricStrategy",
    "ZeroMemoryProfiler",
    "ZeroOptimizer",
    "ZeroPrecision",
    "ZeroStrategy",
    "ZeroTuner",
    "consolidate",
    "consolidate_hf",
    "estimate_memory",
    "gather_after_error",
    "grad_norm",
    "model_state_bytes",
    "read_deepspeed_config",
]
