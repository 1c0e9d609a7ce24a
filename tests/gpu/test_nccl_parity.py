"""ZeRO-1/2/3 and offload on CUDA with NCCL equal DDP (run where at least 2 GPUs are present; skipped otherwise)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from harness import launched_environment, run_on_ranks
from lightning_zero import ZeroConfig, ZeroStrategy
from models import TinyGPT, loader, max_abs_diff, params_of

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


def _train_on_gpus(world_size: int) -> dict[str, Any]:
    out = {}
    for name, strategy in (
        ("ddp", "ddp"),
        ("zero1", ZeroStrategy(stage=1)),
        ("zero2", ZeroStrategy(config=ZeroConfig(stage=2, reduce_bucket_size=700))),
        ("zero3", ZeroStrategy(config=ZeroConfig(stage=3, min_unit_numel=500))),
        # pinned CPU buffers and the device<->CPU copies only really happen with a GPU
        ("zero2_offload", "zero2_offload"),
        ("zero3_offload", "zero3_offload"),
    ):
        pl.seed_everything(0)
        module = TinyGPT()
        with launched_environment():
            trainer = pl.Trainer(accelerator="gpu", devices=world_size, strategy=strategy, max_steps=20,
                                 gradient_clip_val=0.5, logger=False, enable_checkpointing=False,
                                 enable_progress_bar=False, enable_model_summary=False, deterministic=True)
            trainer.fit(module, train_dataloaders=loader())
        out[name] = {k: v.cpu() for k, v in params_of(module).items()}
    return out


def test_nccl_matches_ddp() -> None:
    result = run_on_ranks(_train_on_gpus, 2, 2, backend="nccl")[0]
    for stage in ("zero1", "zero2", "zero3", "zero2_offload", "zero3_offload"):
        assert max_abs_diff(result[stage], result["ddp"]) <= 1e-4


def _sharded_resume_on_gpus(directory: str) -> dict[str, Any]:
    """A sharded checkpoint on NCCL (pinned offloaded state included): the resumed run equals the
    uninterrupted one."""
    import os

    out = {}
    for name in ("zero2", "zero3_offload"):
        runs = {}
        for label, epochs, ckpt in (("whole", 4, None), ("first", 2, None), ("resumed", 4, "saved")):
            pl.seed_everything(0)
            module = TinyGPT()
            with launched_environment():
                trainer = pl.Trainer(accelerator="gpu", devices=2, strategy=name, max_epochs=epochs, logger=False,
                                     enable_checkpointing=False, enable_progress_bar=False,
                                     enable_model_summary=False, deterministic=True)
                path = os.path.join(directory, f"{name}.ckpt")
                trainer.fit(module, train_dataloaders=loader(samples=64), ckpt_path=path if ckpt else None)
                if label == "first":
                    trainer.save_checkpoint(path)
            runs[label] = {k: v.cpu() for k, v in params_of(module).items()}
        out[name] = max_abs_diff(runs["whole"], runs["resumed"])
    return out


def test_nccl_sharded_checkpoint_resumes_exactly(tmp_path: Any) -> None:
    result = run_on_ranks(_sharded_resume_on_gpus, 2, str(tmp_path), backend="nccl")[0]
    assert result == {"zero2": 0.0, "zero3_offload": 0.0}
