"""The fused Adam on a GPU: the CUDA kernel and the Triton kernel against the CPU reference, torch's
fused AdamW, and the engine's fused device step at every stage (world size 1, one GPU).

The CPU-run reference (ops/_reference.py) is the ground truth: both kernels use only IEEE fp32
operations with the fma written out, so their results must equal it bit for bit (see [Note: the
same bits on the host and on the device] in csrc/fused_adam.cuh). Skipped without CUDA; run by
benchmarks/gpu_check.sh.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from lightning_zero.ops import fused_adam
from lightning_zero.ops._reference import reference_adam_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")
HYPER: dict[str, Any] = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
SIZES = [1, 7, 0, 1000, 2 * 65536 + 3, 33] + [257] * 40  # several tables, chunk tails, an empty one


def _shard(grad_dtype: torch.dtype, out_dtype: torch.dtype | None, seed: int) -> dict[str, list[Any]]:
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


def _step(shard: dict[str, list[Any]], backend: str, step: int, **kwargs: Any) -> str:
    return fused_adam.multi_tensor_adam_step(
        shard["masters"], shard["grads"], shard["exp_avgs"], shard["exp_avg_sqs"], step=step,
        low_precision_outs=shard["outs"], backend=backend, **{**HYPER, **kwargs},
    )  # fmt: skip


def _reference(shard: dict[str, list[Any]], step: int, grad_scale: float) -> None:
    for master, grad, exp_avg, exp_avg_sq, out in zip(*shard.values()):
        reference_adam_step(master, grad, exp_avg, exp_avg_sq, step=step, grad_scale=grad_scale,
                            low_precision_out=out, **HYPER)  # fmt: skip


def _differing(device_shard: dict[str, list[Any]], cpu_shard: dict[str, list[Any]]) -> int:
    count = 0
    for key in cpu_shard:
        for a, b in zip(device_shard[key], cpu_shard[key]):
            if b is not None:
                a = a.cpu()
                same = (a == b) | (a.isnan() & b.isnan())
                count += int((~same).sum())
    return count


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("grad_dtype,out_dtype", [(torch.float32, None), (torch.bfloat16, torch.bfloat16),
                                                   (torch.float16, torch.float16)], ids=["fp32", "bf16", "fp16"])  # fmt: skip
def test_kernel_equals_the_cpu_reference_bit_for_bit(backend: str, grad_dtype: torch.dtype,
                                                    out_dtype: torch.dtype | None) -> None:  # fmt: skip
    if backend == "triton":
        pytest.importorskip("triton")
    cpu = _shard(grad_dtype, out_dtype, seed=1)
    gpu = _to(cpu, CUDA)
    for step in (1, 2, 3):
        _reference(cpu, step, grad_scale=0.5)
        assert _step(gpu, backend, step, grad_scale=torch.tensor([0.5], device=CUDA)) == backend
        torch.cuda.synchronize()
        assert _differing(gpu, cpu) == 0, f"{backend} step {step}"


@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_found_inf_skips_on_the_device_and_an_inf_gradient_propagates_as_in_the_reference(backend: str) -> None:
    if backend == "triton":
        pytest.importorskip("triton")
    cpu = _shard(torch.bfloat16, torch.bfloat16, seed=2)
    cpu["grads"][3][10] = float("inf")
    gpu = _to(cpu, CUDA)
    before = {key: [t.clone() if t is not None else None for t in values] for key, values in gpu.items()}
    _step(gpu, backend, 1, found_inf=torch.tensor([1.0], device=CUDA))
    torch.cuda.synchronize()
    assert _differing(gpu, _to(before, torch.device("cpu"))) == 0
    _reference(cpu, 1, grad_scale=1.0)
    _step(gpu, backend, 1, found_inf=torch.tensor([0.0], device=CUDA))
    torch.cuda.synchronize()
    assert _differing(gpu, cpu) == 0


def test_cuda_kernel_tracks_torch_fused_adamw_over_20_steps() -> None:
    generator = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(n, generator=generator).to(CUDA)) for n in (5000, 70_001, 3)]
    ours = [p.detach().clone() for p in params]
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in ours]
    optimizer = torch.optim.AdamW(params, fused=True, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                                  eps=HYPER["eps"], weight_decay=HYPER["weight_decay"])  # fmt: skip
    for step in range(1, 21):
        grads = [torch.randn(p.shape, generator=generator).to(CUDA) for p in params]
        for param, grad in zip(params, grads):
            param.grad = grad
        optimizer.step()
        fused_adam.multi_tensor_adam_step(ours, grads, [m for m, _ in moments], [v for _, v in moments], step=step,
                                          backend="cuda", **HYPER)  # fmt: skip
    for param, mine in zip(params, ours):
        torch.testing.assert_close(mine, param.detach(), rtol=1e-6, atol=1e-6)


def test_auto_takes_the_cuda_kernel_and_a_forced_fallback_warns_once() -> None:
    assert fused_adam.cuda_adam_available(), fused_adam._CUDA_OP.unavailable_reason()
    assert fused_adam.resolve_backend("auto", CUDA) == "cuda"
    fused_adam._force_fallback(True)
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            fused_adam.resolve_backend("auto", CUDA)
            fused_adam.resolve_backend("auto", CUDA)
        assert len([w for w in record if w.category is fused_adam.FusedAdamFallbackWarning]) == 1
    finally:
        fused_adam._force_fallback(False)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_engine_steps_cuda_masters_with_the_kernel_at_every_stage(stage: int) -> None:
    """A Trainer on one GPU, bf16-true parameters with fp32 masters: the fused step ("auto") runs
    the CUDA kernel and trains as the optimizer's own step ("off") does."""
    import lightning.pytorch as pl

    from harness import launched_environment
    from lightning_zero import ZeroConfig, ZeroStrategy
    from models import TinyGPT, loader, params_of

    results = {}
    for choice in ("auto", "off"):
        ran: list[str] = []
        original = fused_adam.multi_tensor_adam_step

        def spy(*args: Any, **kwargs: Any) -> str:
            ran.append(original(*args, **kwargs))
            return ran[-1]

        fused_adam.multi_tensor_adam_step = spy  # type: ignore[assignment]
        try:
            pl.seed_everything(0)
            module = TinyGPT(scheduler=True)
            extra = {"min_unit_numel": 500} if stage == 3 else {"reduce_bucket_size": 700}
            strategy = ZeroStrategy(config=ZeroConfig(stage=stage, fused_adam=choice, **extra))
            with launched_environment():
                trainer = pl.Trainer(accelerator="gpu", devices=1, strategy=strategy, precision="bf16-true",
                                     max_steps=10, gradient_clip_val=0.5, logger=False, enable_checkpointing=False,
                                     enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
                trainer.fit(module, train_dataloaders=loader())
        finally:
            fused_adam.multi_tensor_adam_step = original  # type: ignore[assignment]
        results[choice] = ({k: v.float().cpu() for k, v in params_of(module).items()}, sorted(set(ran)))
    assert results["auto"][1] == ["cuda"] and results["off"][1] == []
    for key, value in results["off"][0].items():
        # bf16 parameters: the two steps' masters agree to ~1e-6, their bf16 roundings to an ulp.
        torch.testing.assert_close(results["auto"][0][key], value, rtol=1e-2, atol=1e-2)
