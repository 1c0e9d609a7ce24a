"""The Triton kernel of :mod:`lightning_zero.ops.triton_adam` (which documents it). A module of its
own because ``@triton.jit`` functions find each other through module globals, and importing
triton must wait until the kernel is first used."""

from typing import Any

import triton
import triton.language as tl


@triton.jit
def _load_ptr(table: Any, row: Any, t: Any, n_tensors: Any, code: tl.constexpr) -> Any:
    address = tl.load(table + row * n_tensors + t)
    if code == 0:
        return address.to(tl.pointer_type(tl.float32))
    elif code == 1:
        return address.to(tl.pointer_type(tl.bfloat16))
    else:
        return address.to(tl.pointer_type(tl.float16))

@triton.jit
def _to_bfloat16(x: Any) -> Any:
    """fp32 -> bf16 rounded to nearest even, NaN kept quiet, as c10::BFloat16(float) and
    tensor.to(torch.bfloat16) do. Written out in integer ops because Triton's interpreter
    truncates (or rounds half up) where the GPU rounds to nearest even."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, (bits >> 16) | 0x40, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def adam_kernel(
    addresses, numels, program_tensor, program_chunk, n_tensors, grad_scale_ptr, found_inf_ptr,
    scale, lerp_coeff, beta2, one_minus_beta2, bc2_sqrt, inv_bc2_sqrt, eps, neg_step_size,
    decoupled_decay, weight_decay,
    GRAD_CODE: tl.constexpr, OUT_CODE: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr, LERP_FROM_GRAD: tl.constexpr, L2: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    t = tl.load(program_tensor + pid)
    chunk = tl.load(program_chunk + pid).to(tl.int64)
    numel = tl.load(numels + t)
    skip = False
    if HAS_FOUND_INF:
        skip = tl.load(found_inf_ptr) != 0.0
    if HAS_GRAD_SCALE:
        scale = tl.load(grad_scale_ptr)
    if not skip:
        grad = _load_ptr(addresses, 0, t, n_tensors, GRAD_CODE)
        master = _load_ptr(addresses, 1, t, n_tensors, 0)
        exp_avg = _load_ptr(addresses, 2, t, n_tensors, 0)
        exp_avg_sq = _load_ptr(addresses, 3, t, n_tensors, 0)
        start = chunk * CHUNK
        # Up to the tensor's end, not the chunk's: a program for a short tensor (a bias, a norm)
        # runs the few iterations it needs.
        length = tl.minimum(numel - start, CHUNK)
        for offset in range(0, length, BLOCK):
            index = start + offset + tl.arange(0, BLOCK)
            mask = index < numel
            g = tl.load(grad + index, mask=mask, other=0.0).to(tl.float32) * scale
            p = tl.load(master + index, mask=mask, other=0.0)
            m = tl.load(exp_avg + index, mask=mask, other=0.0)
            v = tl.load(exp_avg_sq + index, mask=mask, other=0.0)
            if L2:
                g = tl.fma(p, weight_decay, g)
            p = p * decoupled_decay
            if LERP_FROM_GRAD:
                m = tl.fma(lerp_coeff, g - m, g)
            else:
                m = tl.fma(lerp_coeff, g - m, m)
            v = tl.fma(one_minus_beta2 * g, g, v * beta2)
            root = tl.sqrt_rn(v)
            q = root * inv_bc2_sqrt
            r = tl.fma(-q, bc2_sqrt, root)
            scaled = tl.where(r != r, q, tl.fma(r, inv_bc2_sqrt, q))
            p = p + tl.div_rn(neg_step_size * m, scaled + eps)
            tl.store(master + index, p, mask=mask)
            tl.store(exp_avg + index, m, mask=mask)
            tl.store(exp_avg_sq + index, v, mask=mask)
            if OUT_CODE == 1:
                out = _load_ptr(addresses, 4, t, n_tensors, OUT_CODE)
                tl.store(out + index, _to_bfloat16(p), mask=mask)
            elif OUT_CODE == 2:
                out = _load_ptr(addresses, 4, t, n_tensors, OUT_CODE)
                tl.store(out + index, p.to(tl.float16, fp_downcast_rounding="rtne"), mask=mask)
