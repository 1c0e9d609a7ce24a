"""Lightning callbacks over the plain functions of lightning_zero.profiling and lightning_zero.autotuning."""

from lightning_zero.callbacks.autotuner import ZeroAutotuner, ZeroTuner
from lightning_zero.callbacks.memory import ZeroMemoryProfiler

__all__ = ["ZeroAutotuner", "ZeroMemoryProfiler", "ZeroTuner"]
