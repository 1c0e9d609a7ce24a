"""Ground truth for the fused Adam kernels: plain PyTorch, one op at a time.

Every kernel in ``csrc/`` (and its fallback) is tested against :func:`reference_adam_step`. The
math is torch.optim.AdamW's single-tensor path (``torch/optim/adam.py``, ``_single_tensor_adam``)
op for op, in the same order and with the same Python-float constants, with one exception: its
sqrt is correctly rounded, where torch's CPU sqrt is not always (see :func:`_ieee_sqrt`). So
every op is an IEEE fp32 op (or torch's fma in ``lerp_``/``addcmul_``/``add(alpha=)``) and the
C++ kernel, which does the same ops, equals it bit for bit; ``torch.optim.AdamW`` itself agrees
to about 1e-7 relative. What torch.optim does not have is folded in front (the gradient's dtype
and ``grad_scale``) and behind (the low-precision copy). It is slow (about a dozen passes over
memory) and meant to be.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _ieee_sqrt(x: Tensor) -> Tensor:
    """Correctly rounded fp32 sqrt. torch's own CPU sqrt (MKL's vsSqrt on x86) is off by one ulp
    on about 0.6% of fp32 inputs; the sqrt of an fp32 value taken in fp64 and rounded once to
    fp32 is exact (fp64 holds more than twice fp32's 24 bits, so the double rounding is
    harmless)."""
    return x.double().sqrt_().float()


def reference_adam_step(
    master: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool = True,
    grad_scale: float = 1.0,
    low_precision_out: Tensor | None = None,
) -> None:
    """One Adam(W) step on fp32 ``master``, ``exp_avg`` and ``exp_avg_sq``, in place.

    Same signature and meaning as :func:`lightning_zero.ops.fused_adam_step`: ``step`` is the
    step number after the increment (1 on the first step), ``grad_scale`` multiplies the
    gradient first (the combined unscale x clip coefficient), ``adamw_mode=False`` adds
    ``weight_decay * master`` to the gradient (Adam's L2) instead of decaying the weights, and
    ``low_precision_out`` (bf16 or fp16) receives the updated master rounded to nearest even.
    """
    with torch.no_grad():
        # fp32 math whatever the gradient's dtype; bf16/fp16 -> fp32 is exact.
        g = grad.to(torch.float32) * grad_scale
        if weight_decay != 0:
            if adamw_mode:
                master.mul_(1 - lr * weight_decay)
            else:
                g = g.add(master, alpha=weight_decay)
        exp_avg.lerp_(g, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)

        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2**0.5
        denom = (_ieee_sqrt(exp_avg_sq) / bias_correction2_sqrt).add_(eps)
        master.addcdiv_(exp_avg, denom, value=-step_size)
        if low_precision_out is not None:
            low_precision_out.copy_(master)
