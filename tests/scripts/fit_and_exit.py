"""Fits a tied GPT with ZeRO-3 on 2 CPU ranks through Lightning's own launcher (the script is run
again for rank 1), then exits: the exit code is what a job scheduler sees."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import RichProgressBar  # noqa: E402

from lightning_zero import ZeroConfig, ZeroStrategy  # noqa: E402
from models import TiedGPT, loader  # noqa: E402

if __name__ == "__main__":
    torch.set_num_threads(1)
    pl.seed_everything(0)
    strategy = ZeroStrategy(config=ZeroConfig(stage=3, min_unit_numel=500))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=6, val_check_interval=3,
                         limit_val_batches=2, logger=False, enable_checkpointing=False, enable_model_summary=False,
                         callbacks=[RichProgressBar(refresh_rate=1)])
    trainer.fit(TiedGPT(), train_dataloaders=loader(), val_dataloaders=loader(samples=16))
    print(f"rank {trainer.global_rank} finished")
