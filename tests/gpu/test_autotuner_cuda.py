"""ZeroAutotuner on one CUDA device: real allocator OOMs under the capped budget are recorded and
searched around, the peak is the allocator's, and the cap is lifted after the search."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from tune_models import Blocks

from lightning_zero import SearchSpace, ZeroStrategy, ZeroTuner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GiB = 2**30


def test_a_capped_budget_turns_large_micro_batches_into_ooms_that_the_search_goes_around() -> None:
    # ~0.6 MB of activations per sample at width 256: 4096 samples need ~2.4 GiB, more than the budget.
    trainer = pl.Trainer(accelerator="cuda", devices=1, strategy=ZeroStrategy(stage=2), max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    space = SearchSpace(micro_batch_sizes=(64, 512, 4096), stages=(1, 3), offload=("none", "optimizer"))
    result = ZeroTuner(trainer).tune(Blocks(samples=16384), budget=1 * GiB, space=space, output=None)
    assert result is not None and result.best.fits and result.best.peak_bytes <= GiB
    assert result.best.candidate.micro_batch_size == 512
    # The estimate or a real OOM ruled out 4096: no trial of it fitted.
    assert not any(r.fits and r.candidate.micro_batch_size == 4096 for r in result.records)
    # The cap is gone after the search: 2 GiB can be allocated again.
    block = torch.empty(2 * GiB, dtype=torch.uint8, device="cuda")
    del block
