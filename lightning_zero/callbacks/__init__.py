"""Lightning callbacks over the plain functions of lightning_zero.profiling."""

from lightning_zero.callbacks.memory import ZeroMemoryProfiler

__all__ = ["ZeroMemoryProfiler"]
