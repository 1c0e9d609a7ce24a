"""Fused optimizer kernels and their ground truth.

- :func:`fused_adam_step`: one Adam(W) step over a flat fp32 shard on the CPU in one pass over
  memory (gradient unscale x clip, moments, master, bf16/fp16 copy), from ``csrc/cpu_adam.cpp``.
- :class:`CPUAdam`: a ``torch.optim.Optimizer`` on top of it, state-dict compatible with
  ``torch.optim.AdamW``.
- :func:`cpu_adam_available`: whether the C++ op is in use (builds it on the first call).
- :func:`multi_tensor_adam_step`: the same step over lists of shards on one device, one launch
  per table of tensors: the CUDA kernel ``csrc/fused_adam.cu``, its Triton twin, or a fallback
  (see [Note: backends of the fused Adam op] in :mod:`lightning_zero.ops.fused_adam`).
- :func:`reference_adam_step`: the pure-PyTorch ground truth every kernel is tested against.

Importing this package builds and loads nothing (it registers the op's schema); see
:mod:`lightning_zero.ops.cpu_adam` for when the ops are built, where they are cached, and the
fallback (``LIGHTNING_ZERO_DISABLE_CPP_OPS=1`` forces it for every compiled op).
"""

from lightning_zero.ops._reference import reference_adam_step
from lightning_zero.ops.cpu_adam import (
    CPUAdam,
    CPUAdamFallbackWarning,
    cpu_adam_available,
    fused_adam_step,
)
from lightning_zero.ops.fused_adam import (
    FusedAdamFallbackWarning,
    cuda_adam_available,
    multi_tensor_adam_step,
)

__all__ = [
    "CPUAdam",
    "CPUAdamFallbackWarning",
    "FusedAdamFallbackWarning",
    "cpu_adam_available",
    "cuda_adam_available",
    "fused_adam_step",
    "multi_tensor_adam_step",
    "reference_adam_step",
]
