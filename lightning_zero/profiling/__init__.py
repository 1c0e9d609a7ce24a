"""Memory estimation and accounting: plain functions, no Lightning (see [Note: memory of one rank])."""

from lightning_zero.profiling.estimate import MemoryBreakdown, MemoryEstimate, estimate_memory, measure_activations

__all__ = ["MemoryBreakdown", "MemoryEstimate", "estimate_memory", "measure_activations"]
