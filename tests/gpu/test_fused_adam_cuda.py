"""The fused Adam on a GPU: the CUDA kernel and the Triton kernel against the CPU reference, torch's
fused AdamW, and the engine's fused device step at every stage (world size 1, one GPU).

The CPU-run reference (ops/_reference.py) is the ground truth: both kernels use only IEEE fp32
operations with the fma written out, so their results must equal it bit for bit (see [Note: the
same bits on the host and on the device] in csrc/fused_adam.cuh). Skipped without CUDA; run by
benchmarks/gpu_check.sh.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from fused_adam_checks import differing_from_reference, relative_error_vs_torch_fused
from lightning_zero.ops import fused_adam

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("label", ["fp32", "bf16", "fp16"])
def test_kernel_equals_the_cpu_reference_bit_for_bit(backend: str, label: str) -> None:
    """3 steps with a device-tensor scale, each followed by one with found_inf set (nothing may be
    written), an inf in one gradient: every element equal to the CPU-run reference."""
    if backend == "triton":
        pytest.importorskip("triton")
    assert differing_from_reference(backend, CUDA, label) == 0


def test_cuda_kernel_tracks_torch_fused_adamw_over_20_steps() -> None:
    assert relative_error_vs_torch_fused("cuda", CUDA) < 1e-5


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

    from harness import launched_environment, recording_fused_backends
    from lightning_zero import ZeroConfig, ZeroStrategy
    from models import TinyGPT, loader, params_of

    results = {}
    for choice in ("auto", "off"):
        with recording_fused_backends() as ran:
            pl.seed_everything(0)
            module = TinyGPT(scheduler=True)
            extra = {"min_unit_numel": 500} if stage == 3 else {"reduce_bucket_size": 700}
            strategy = ZeroStrategy(config=ZeroConfig(stage=stage, fused_adam=choice, **extra))
            with launched_environment():
                trainer = pl.Trainer(accelerator="gpu", devices=1, strategy=strategy, precision="bf16-true",
                                     max_steps=10, gradient_clip_val=0.5, logger=False, enable_checkpointing=False,
                                     enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
                trainer.fit(module, train_dataloaders=loader())
        results[choice] = ({k: v.float().cpu() for k, v in params_of(module).items()}, sorted(set(ran)))
    assert results["auto"][1] == ["cuda"] and results["off"][1] == []
    for key, value in results["off"][0].items():
        # bf16 parameters: the two steps' masters agree to ~1e-6, their bf16 roundings to an ulp.
        torch.testing.assert_close(results["auto"][0][key], value, rtol=1e-2, atol=1e-2)
