"""The fused Adam's GPU checks as figures: tests/gpu/test_fused_adam_cuda.py asserts them and
benchmarks/gpu_check.py prints them. Each takes the device, so ``gpu_check.py --cpu-rehearsal``
runs them on the CPU (with the host build and interpreted Triton in place of the GPU kernels)."""

from __future__ import annotations

from typing import Any

import torch

from lightning_zero.ops import fused_adam
from lightning_zero.ops._reference import reference_adam_step

HYPER: dict[str, Any] = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
# Several tables of the launcher, chunk tails, an empty tensor.
SIZES = [1, 7, 0, 1000, 2 * 65536 + 3, 33] + [257] * 40
DTYPES = {"fp32": (torch.float32, None), "bf16": (torch.bfloat16, torch.bfloat16), "fp16": (torch.float16, torch.float16)}


def make_shard(grad_dtype: torch.dtype, out_dtype: torch.dtype | None, seed: int) -> dict[str, list[Any]]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "masters": [torch.randn(n, generator=generator) for n in SIZES],
        "grads": [(torch.randn(n, generator=generator) * 3).to(grad_dtype) for n in SIZES],
        "exp_avgs": [torch.randn(n, generator=generator) * 0.1 for n in SIZES],
        "exp_avg_sqs": [torch.rand(n, generator=generator) * 0.01 for n in SIZES],
        "outs": [torch.empty(n, dtype=out_dtype) if out_dtype is not None else None for n in SIZES],
    }


def _to(shard: dict[str, list[Any]], device: torch.device) -> dict[str, list[Any]]:
    return {key: [t.to(device) if t is not None else None for t in values] for key, values in shard.items()}


def _differing(device_shard: dict[str, list[Any]], cpu_shard: dict[str, list[Any]]) -> int:
    """Elements that differ (NaN equals NaN), over every tensor of every slot."""
    count = 0
    for key in cpu_shard:
        for a, b in zip(device_shard[key], cpu_shard[key]):
            if b is not None:
                a = a.cpu()
                count += int((~((a == b) | (a.isnan() & b.isnan()))).sum())
    return count


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def differing_from_reference(backend: str, device: torch.device, label: str) -> int:
    """Elements where ``backend`` on ``device`` differs from the CPU-run reference after 3 steps,
    each followed by a step with found_inf set (which must write nothing), with a device-tensor
    scale and an inf in one gradient (which propagates as in the reference). 0 is bit for bit."""
    grad_dtype, out_dtype = DTYPES[label]
    cpu = make_shard(grad_dtype, out_dtype, seed=1)
    cpu["grads"][3][10] = float("inf")
    on_device = _to(cpu, device)
    lists = (on_device["masters"], on_device["grads"], on_device["exp_avgs"], on_device["exp_avg_sqs"])
    differing = 0
    for step in (1, 2, 3):
        for master, grad, exp_avg, exp_avg_sq, out in zip(*cpu.values()):
            reference_adam_step(master, grad, exp_avg, exp_avg_sq, step=step, grad_scale=0.5, low_precision_out=out,
                                **HYPER)  # fmt: skip
        ran = fused_adam.multi_tensor_adam_step(*lists, step=step, grad_scale=torch.tensor([0.5], device=device),
                                                low_precision_outs=on_device["outs"], backend=backend, **HYPER)  # fmt: skip
        assert ran == backend
        fused_adam.multi_tensor_adam_step(*lists, step=step + 1, found_inf=torch.tensor([1.0], device=device),
                                          low_precision_outs=on_device["outs"], backend=backend, **HYPER)  # fmt: skip
        _synchronize(device)
        differing += _differing(on_device, cpu)
    return differing


def relative_error_vs_torch_fused(backend: str, device: torch.device, steps: int = 20) -> float:
    """The largest relative difference between ``backend`` and ``torch.optim.AdamW(fused=True)``
    after ``steps`` steps on fp32 parameters and gradients."""
    generator = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(n, generator=generator).to(device)) for n in (5000, 70_001, 3)]
    ours = [p.detach().clone() for p in params]
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in ours]
    optimizer = torch.optim.AdamW(params, fused=True, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                                  eps=HYPER["eps"], weight_decay=HYPER["weight_decay"])  # fmt: skip
    for step in range(1, steps + 1):
        grads = [torch.randn(p.shape, generator=generator).to(device) for p in params]
        for param, grad in zip(params, grads):
            param.grad = grad
        optimizer.step()
        fused_adam.multi_tensor_adam_step(ours, grads, [m for m, _ in moments], [v for _, v in moments], step=step,
                                          backend=backend, **HYPER)  # fmt: skip
    return max(float(((a - b.detach()).abs() / b.detach().abs().clamp_min(1e-6)).max()) for a, b in zip(ours, params))
