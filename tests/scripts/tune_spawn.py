"""ZeroAutotuner with ranks started by spawn (strategy="zero2_spawn"): the search ends the run in
the workers (no exit exception escapes them) or trains on with apply=True."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

from lightning_zero import SearchSpace, ZeroAutotuner  # noqa: E402
from tune_models import Blocks  # noqa: E402


class Report(Callback):
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        print(f"rank {trainer.global_rank} trained {trainer.global_step} steps at stage {trainer.strategy.config.stage}"
              f" with batches of {pl_module.seen_batch_sizes[-1]}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    output = sys.argv[1]
    for apply in (False, True):
        tuner = ZeroAutotuner(budget="200MiB", output=output, apply=apply, progress=False,
                              space=SearchSpace(micro_batch_sizes=(4, 8), stages=(1, 2), offload=("none",)))
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="zero2_spawn", max_steps=2, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[tuner, Report()])
        trainer.fit(Blocks())
        print(f"apply={apply} done", flush=True)
