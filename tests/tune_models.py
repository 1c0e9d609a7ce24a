"""Models for the autotuner tests: activations grow with the micro-batch, parameters do not, and
a fault can be injected on one rank (importable by LightningCLI by class path)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

TOKENS = 16


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: Tensor) -> Tensor:
        return h.view_as(h)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (injected in backward)")


class Fault(nn.Module):
    """Raises on ``rank`` once a micro-batch has ``at`` samples or more: ``kind`` "oom" (in
    forward, or in backward with ``where="backward"``) or "value" (a ValueError)."""

    def __init__(self, kind: str | None = None, rank: int = 1, at: int = 8, where: str = "forward") -> None:
        super().__init__()
        self.kind, self.rank, self.at, self.where = kind, rank, at, where

    def forward(self, h: Tensor) -> Tensor:
        if self.kind is None or h.shape[0] < self.at or dist.get_rank() != self.rank:
            return h
        if self.kind == "value":
            raise ValueError(f"injected failure at micro-batch {h.shape[0]}")
        if self.where == "backward":
            return _RaiseInBackward.apply(h)
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 1.00 GiB (injected at {h.shape[0]})")


class DataBlocks(pl.LightningModule):
    """An MLP over short sequences (about 2.1M parameters; about 0.6 MB of activations per sample),
    fed by a datamodule (which holds the batch size)."""

    def __init__(self, width: int = 256, hidden: int = 1024, depth: int = 4, batch_size: int = 4, samples: int = 512,
                 fault: str | None = None, fault_at: int = 8, fault_where: str = "forward") -> None:
        super().__init__()
        blocks: list[nn.Module] = [nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width))
                                   for _ in range(depth)]
        blocks.insert(depth // 2, Fault(fault, at=fault_at, where=fault_where))
        self.blocks = nn.Sequential(*blocks)
        self.width, self.batch_size, self.samples = width, batch_size, samples
        self.seen_batch_sizes: list[int] = []

    def forward(self, x: Tensor) -> Tensor:
        return self.blocks(x)

    def training_step(self, batch: tuple[Tensor], batch_idx: int) -> Tensor:
        self.seen_batch_sizes.append(batch[0].shape[0])
        return self(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Blocks(DataBlocks):
    """The same model with a dataloader of its own, of its ``batch_size``."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(data(self.samples, self.width), batch_size=self.batch_size)


class LazyBlocks(Blocks):
    """Blocks whose layers configure_model() builds (the stage-3 pattern): none before setup."""

    def __init__(self, depth: int = 4, hidden: int = 1024, **kwargs: Any) -> None:
        super().__init__(depth=depth, hidden=hidden, **kwargs)
        self.depth, self.hidden = depth, hidden
        self.blocks = nn.Sequential()

    def configure_model(self) -> None:
        if len(self.blocks) == 0:
            self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(self.width, self.hidden), nn.ReLU(),
                                                        nn.Linear(self.hidden, self.width)) for _ in range(self.depth)])


class BlocksData(pl.LightningDataModule):
    def __init__(self, batch_size: int = 4, samples: int = 512, width: int = 256) -> None:
        super().__init__()
        self.batch_size, self.samples, self.width = batch_size, samples, width

    def train_dataloader(self) -> DataLoader:
        return DataLoader(data(self.samples, self.width), batch_size=self.batch_size)


def data(samples: int, width: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(samples, TOKENS, width, generator=generator))


class HFGPT2(pl.LightningModule):
    """A Hugging Face GPT-2 (built from a small config) as users wrap one."""

    def __init__(self, batch_size: int = 2, samples: int = 128) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        self.model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=128, n_positions=32))
        self.batch_size, self.samples = batch_size, samples

    def training_step(self, batch: tuple[Tensor], batch_idx: int) -> Tensor:
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 128, (self.samples, 32), generator=generator)
        return DataLoader(TensorDataset(tokens), batch_size=self.batch_size)
