"""Fused multi-tensor Adam(W) in Triton: the contract of ``csrc/fused_adam.cu``, in Python.

Same arguments, same math in the same op order (see the header of ``csrc/fused_adam.cuh``), same
multi-tensor structure (see [Note: multi-tensor launches] in ``csrc/multi_tensor_apply.cuh``):
one launch steps every tensor of a call, each Triton program one chunk of one tensor. Where the
CUDA kernel receives its table by value, here the table is three small int64 tensors on the
device (slot addresses, sizes, and per program its tensor and chunk), built on the host and
cached by the tensors' addresses, so a training loop that steps the same shards every step
builds and copies it once.

Correctly rounded ``div_rn`` / ``sqrt_rn`` and explicit ``fma`` keep it bit-equal to
``ops/_reference.py``, like the C++ kernels. ``TRITON_INTERPRET=1`` runs it on CPU tensors, which
is how the default test suite checks it without a GPU.

Importing this module does not import triton; :func:`triton_available` does, once.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import struct
from collections import OrderedDict
from typing import Any

import torch
from torch import Tensor

__all__ = ["triton_adam_", "triton_available", "triton_unavailable_reason"]

CHUNK = 65536  # elements per program, as the CUDA kernel's kChunk
BLOCK = 1024  # elements per program per loop iteration
_TABLE_CACHE_SIZE = 8
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


@functools.lru_cache(maxsize=1)
def _import_failure() -> str | None:
    try:
        importlib.import_module("triton.language")  # imports triton too
    except Exception as error:  # noqa: BLE001 - any import failure means: not available, and why
        return f"triton cannot be imported ({type(error).__name__}: {error}). `pip install triton`"
    return None


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton kernel cannot run on ``device`` here, or None when it can."""
    failure = _import_failure()
    if failure is not None:
        return failure
    if device.type == "cpu" and not _interpreting():
        return "the tensors are on the CPU; Triton runs them only with TRITON_INTERPRET=1 (for tests)"
    if device.type not in ("cpu", "cuda"):
        return f"Triton does not run on {device.type} tensors here"
    return None


def triton_available(device: torch.device) -> bool:
    return triton_unavailable_reason(device) is None


def _f32(value: float) -> float:
    """``value`` rounded to the nearest fp32, as ``static_cast<float>(double)`` does."""
    return struct.unpack("f", struct.pack("f", value))[0]


def adam_constants(
    step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, adamw_mode: bool
) -> dict[str, Any]:
    """The per-step fp32 constants of ``make_constants`` in ``csrc/fused_adam.cuh``, the same values."""
    bias_correction1 = 1.0 - beta1**step
    bias_correction2 = 1.0 - beta2**step
    weight = _f32(1.0 - beta1)
    from_grad = not abs(weight) < 0.5
    bc2_sqrt = _f32(bias_correction2**0.5)
    return {
        "lerp_coeff": _f32(weight - 1.0) if from_grad else weight,
        "LERP_FROM_GRAD": from_grad,
        "beta2": _f32(beta2),
        "one_minus_beta2": _f32(1.0 - beta2),
        "bc2_sqrt": bc2_sqrt,
        # An fp32 division; the double quotient rounded once to fp32 is that (53 >= 2 x 24 + 2 bits).
        "inv_bc2_sqrt": _f32(1.0 / bc2_sqrt),
        "eps": _f32(eps),
        "neg_step_size": _f32(-(lr / bias_correction1)),
        "decoupled_decay": _f32(1.0 - lr * weight_decay if adamw_mode else 1.0),
        "L2": (not adamw_mode) and weight_decay != 0.0,
        "weight_decay": _f32(weight_decay),
    }


def _kernel() -> Any:
    from lightning_zero.ops._triton_kernels import adam_kernel  # imports triton

    return adam_kernel


class _Tables:
    """Device tables per list of tensors, keyed by every slot's address and size (see the module
    docstring); a key holds only integers, so a cached entry never keeps a tensor alive."""

    def __init__(self) -> None:
        self._cache: OrderedDict[tuple[Any, ...], tuple[Tensor, Tensor, Tensor, Tensor]] = OrderedDict()

    def get(
        self, slots: list[list[Tensor]], device: torch.device, chunk: int
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        numels = [t.numel() for t in slots[1]]
        key = (device, chunk, tuple(numels), *(tuple(t.data_ptr() for t in slot) for slot in slots))
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        rows = [[t.data_ptr() for t in slot] or [0] * len(numels) for slot in slots]
        tensor_of: list[int] = []
        chunk_of: list[int] = []
        for index, numel in enumerate(numels):
            chunks = -(-numel // chunk)
            tensor_of += [index] * chunks
            chunk_of += range(chunks)
        entry = (
            torch.tensor(rows, dtype=torch.int64).to(device),  # [5, tensors]
            torch.tensor(numels, dtype=torch.int64).to(device),  # [tensors]
            torch.tensor(tensor_of, dtype=torch.int32).to(device),  # [programs]
            torch.tensor(chunk_of, dtype=torch.int32).to(device),  # [programs]
        )
        self._cache[key] = entry
        if len(self._cache) > _TABLE_CACHE_SIZE:
            self._cache.popitem(last=False)
        return entry


_TABLES = _Tables()


def triton_adam_(
    grads: list[Tensor],
    masters: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    low_precision_outs: list[Tensor],
    grad_scale: Tensor | None,
    found_inf: Tensor | None,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool,
    scale: float,
) -> None:
    """One step over already checked lists (one grad dtype, one out dtype or none; see
    ``lightning_zero.ops.fused_adam.multi_tensor_adam_step``), in one Triton launch."""
    if not any(t.numel() for t in masters):
        return
    device = masters[0].device
    reason = triton_unavailable_reason(device)
    if reason is not None:
        raise RuntimeError(f"the Triton Adam kernel cannot run: {reason}")
    chunk, block = CHUNK, BLOCK  # read per call: tests shrink them to run the interpreter faster
    addresses, numels, program_tensor, program_chunk = _TABLES.get(
        [grads, masters, exp_avgs, exp_avg_sqs, low_precision_outs], device, chunk
    )
    constants = adam_constants(step, lr, beta1, beta2, eps, weight_decay, adamw_mode)
    # A dummy pointer where an optional scalar is absent; the kernel never reads it.
    dummy = masters[0]
    kernel = _kernel()
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        kernel[(program_tensor.numel(),)](
            addresses, numels, program_tensor, program_chunk, len(masters),
            grad_scale if grad_scale is not None else dummy, found_inf if found_inf is not None else dummy,
            _f32(scale), constants["lerp_coeff"], constants["beta2"], constants["one_minus_beta2"],
            constants["bc2_sqrt"], constants["inv_bc2_sqrt"], constants["eps"], constants["neg_step_size"],
            constants["decoupled_decay"], constants["weight_decay"],
            GRAD_CODE=_DTYPE_CODES[grads[0].dtype],
            OUT_CODE=_DTYPE_CODES[low_precision_outs[0].dtype] if low_precision_outs else 0,
            HAS_GRAD_SCALE=grad_scale is not None, HAS_FOUND_INF=found_inf is not None,
            LERP_FROM_GRAD=constants["LERP_FROM_GRAD"], L2=constants["L2"], CHUNK=chunk, BLOCK=block,
        )  # fmt: skip
