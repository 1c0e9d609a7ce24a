"""Character-level data: one text file, a character vocabulary, windows of block_size + 1.

The vocabulary is built in ``__init__`` (not ``setup``) because LightningCLI links
``data.vocab_size`` into ``model.vocab_size`` right after instantiating the data module,
before any hook runs. Every rank reads the same file and sorts the same characters, so every
rank gets the same token ids without a broadcast.
"""

from __future__ import annotations

from pathlib import Path

import make_corpus
import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset


class CharWindows(Dataset[tuple[Tensor, Tensor]]):
    """Windows over a token stream; item ``i`` starts at ``starts[i]``.

    Returns (x, y) with y shifted by one: each position predicts the next character.
    """

    def __init__(self, tokens: Tensor, block_size: int, starts: Tensor) -> None:
        self.tokens = tokens
        self.block_size = block_size
        self.starts = starts

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = int(self.starts[index])
        chunk = self.tokens[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class CharDataModule(LightningDataModule):
    """Text corpus -> character tokens -> train / val windows.

    Args:
        path: UTF-8 text file. ``None`` uses ``data/corpus.txt`` next to this file and, if that
            file is missing, generates the same text in memory with ``make_corpus.generate``.
        block_size: characters of context per sample; keep equal to ``model.block_size``.
        batch_size: samples per rank per step.
        val_fraction: tail of the corpus held out for validation (a contiguous tail, so no
            validation window overlaps a training one).
        num_workers: DataLoader workers; 0 keeps the 2-core demo from oversubscribing.
    """

    def __init__(
        self,
        path: str | None = None,
        block_size: int = 64,
        batch_size: int = 32,
        val_fraction: float = 0.1,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"CharDataModule.val_fraction={val_fraction!r}: must be in (0, 1)")
        self.save_hyperparameters()
        self.block_size = block_size
        self.batch_size = batch_size
        self.num_workers = num_workers
        text = self._read_text(path)
        self.chars: list[str] = sorted(set(text))
        self.stoi: dict[str, int] = {ch: i for i, ch in enumerate(self.chars)}
        self.tokens = torch.tensor([self.stoi[ch] for ch in text], dtype=torch.long)
        split = int(len(self.tokens) * (1.0 - val_fraction))
        self.train_tokens = self.tokens[:split]
        self.val_tokens = self.tokens[split:]
        for name, part in (("train", self.train_tokens), ("val", self.val_tokens)):
            if len(part) <= block_size + 1:
                raise ValueError(
                    f"CharDataModule: the {name} split has {len(part)} characters, not more than "
                    f"block_size + 1 = {block_size + 1}: use a longer corpus or a smaller block_size"
                )

    @staticmethod
    def _read_text(path: str | None) -> str:
        if path is not None:
            return Path(path).read_text(encoding="utf-8")
        if make_corpus.DEFAULT_PATH.exists():
            return make_corpus.DEFAULT_PATH.read_text(encoding="utf-8")
        return make_corpus.generate()

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> Tensor:
        return torch.tensor([self.stoi[ch] for ch in text], dtype=torch.long)

    def decode(self, ids: Tensor) -> str:
        return "".join(self.chars[i] for i in ids.tolist())

    def train_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        block = self.block_size
        # Every start position is a sample; shuffle=True makes the windows random, and under
        # a multi-rank strategy Lightning swaps in a DistributedSampler (seeded, shuffling) so
        # each rank draws different windows.
        starts = torch.arange(len(self.train_tokens) - block - 1)
        return DataLoader(
            CharWindows(self.train_tokens, block, starts),
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        block = self.block_size
        # Non-overlapping windows in a fixed order: the same val_loss for the same weights, so
        # numbers from two runs (or two strategies) compare.
        starts = torch.arange(0, len(self.val_tokens) - block - 1, block)
        return DataLoader(
            CharWindows(self.val_tokens, block, starts),
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=self.num_workers,
        )
