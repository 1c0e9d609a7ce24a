"""Small models and a Trainer runner shared by the distributed tests."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from harness import launched_environment

VOCAB = 32
SEQ = 8


class TinyGPT(pl.LightningModule):
    """Embedding, a transformer block and a head: several shapes, two param groups."""

    def __init__(self, width: int = 32, lr: float = 1e-2, weight_decay: float = 0.1, scheduler: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        # No biases in the block: attention's key bias has an exactly-zero true gradient, and Adam
        # turns the rounding noise in it into full-size updates that no two reductions agree on.
        self.block = nn.TransformerEncoderLayer(
            width, nhead=2, dim_feedforward=2 * width, dropout=0.0, batch_first=True, bias=False
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)
        self.lr = lr
        self.weight_decay = weight_decay
        self.scheduler = scheduler
        self.losses: list[float] = []

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.norm(self.block(self.embed(tokens))))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        tokens, targets = batch
        loss = nn.functional.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        tokens, targets = batch
        self.log("val_loss", nn.functional.cross_entropy(self(tokens).flatten(0, 1), targets.flatten()), sync_dist=True)

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self) -> Any:
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.named_parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.lr,
        )
        if not self.scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def token_data(samples: int = 256, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (samples, SEQ + 1), generator=generator)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def loader(batch_size: int = 4, samples: int = 256) -> DataLoader:
    return DataLoader(token_data(samples), batch_size=batch_size, shuffle=False)


def fit(module: pl.LightningModule, strategy: Any, world_size: int, steps: int = 20, **trainer_kwargs: Any) -> pl.Trainer:
    """Fits ``module`` inside an already launched rank and returns the Trainer."""
    with launched_environment():
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world_size,
            strategy=strategy,
            max_steps=steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            **trainer_kwargs,
        )
        trainer.fit(module, train_dataloaders=loader())
    return trainer


def params_of(module: nn.Module) -> dict[str, Tensor]:
    return {name: param.detach().clone() for name, param in module.named_parameters()}


def max_abs_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


class TiedGPT(TinyGPT):
    """TinyGPT with two blocks and the head's weight tied to the embedding (as in GPT-2)."""

    def __init__(self, width: int = 32, **kwargs: Any) -> None:
        super().__init__(width=width, **kwargs)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, nhead=2, dim_feedforward=2 * width, dropout=0.0, batch_first=True,
                                       bias=False)
            for _ in range(2)
        )
        del self.block
        self.head = nn.Linear(width, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: Tensor) -> Tensor:
        hidden = self.embed(tokens)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(self.norm(hidden))


class Adapted(nn.Module):
    """A frozen Linear (an odd-sized bias) and a trained low-rank update, registered after it as
    peft's LoRA layers are, with an odd-sized trained gate."""

    def __init__(self, features: int, out_features: int, rank: int = 3) -> None:
        super().__init__()
        self.base = nn.Linear(features, out_features).requires_grad_(False)
        self.down = nn.Parameter(torch.randn(rank, features) / features)
        self.gate = nn.Parameter(torch.ones(rank))
        self.up = nn.Parameter(torch.randn(out_features, rank) / rank)

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + (x @ self.down.t() * self.gate) @ self.up.t()
