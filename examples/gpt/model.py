"""A small nanoGPT-style language model as a LightningModule.

Token + position embedding, ``n_layer`` pre-LayerNorm blocks (causal self-attention through
``scaled_dot_product_attention``, then a GELU MLP), a final LayerNorm and an ``lm_head`` whose
weight IS the token embedding's (tied). The tie matters to ZeRO: the same ``nn.Parameter``
shows up under two names, so the optimizer must see it exactly once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import Tensor, nn


@dataclass(frozen=True)
class GPTConfig:
    """Architecture of the network; the optimizer settings live on ``GPT`` itself."""

    vocab_size: int
    """Distinct tokens; linked from ``CharDataModule.vocab_size`` by the CLI."""
    block_size: int = 64
    """Longest context in tokens; sizes the position embedding."""
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    """Width of the residual stream; must divide evenly into ``n_head`` heads."""
    dropout: float = 0.0
    tie_embeddings: bool = True
    """``lm_head`` reuses the token embedding's weight; a pipeline puts them on different
    stages, which cannot share a parameter: set False there."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"GPTConfig.{name}={value!r}: must be a positive integer")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd={self.n_embd} is not divisible by n_head={self.n_head}: "
                f"pick n_embd as a multiple of n_head"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout={self.dropout!r}: must be in [0, 1)")


class CausalSelfAttention(nn.Module):
    """Causal self-attention with one fused q/k/v projection laid out head by head.

    [Note: per-head qkv layout]
    ``qkv`` is one ``nn.Linear(C, 3C)`` (one matmul instead of three) whose output rows are
    grouped by head: ``[head 0: q, k, v | head 1: q, k, v | ...]``, i.e. the output viewed as
    ``(B, T, n_head, 3, head_dim)``. A plain split layout ``[all q | all k | all v]`` would be
    the same network (the rows are a permutation of freshly initialised ones), but only the
    per-head layout survives contiguous row sharding: tensor parallelism's ``ColwiseParallel``
    (``Shard(0)`` on the weight) then gives each rank whole heads with their own q, k and v,
    and ``proj`` takes the matching input columns with ``RowwiseParallel`` (see
    ``lightning_zero.parallel.plans.parallelize_gpt``). For that reason ``forward`` never
    uses the global head or channel count: it views with ``-1`` heads and ``head_dim``, so it
    reads the local head count off whatever slice of ``qkv`` this rank holds. A checkpoint
    saved with the split layout has the same keys and shapes but not the same row order.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head  # informational; forward reads the head count off qkv's output
        self.head_dim = config.n_embd // config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)  # rows: see [Note: per-head qkv layout]
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        batch, time, _ = x.shape
        # (B, T, 3 * heads * head_dim) -> (B, T, heads, 3, head_dim) -> three (B, heads, T, head_dim):
        # SDPA attends over the last two dims per head. `heads` is local under tensor parallelism.
        qkv = self.qkv(x).view(batch, time, -1, 3, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=3))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(batch, time, -1)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LN: normalise before each sublayer so the residual path stays an identity."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TokenAndPositionEmbedding(nn.Module):
    """The pipeline's first layer: token + position embedding, over the GPT's own ``wte``,
    ``wpe`` and ``drop`` (a wrapper made for ``pipeline_layers``, not registered on the GPT, so
    parameter names stay ``wte.weight``...)."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Dropout) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, idx: Tensor) -> Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))


class OutputHead(nn.Module):
    """The pipeline's last layer: the final LayerNorm and ``lm_head``."""

    def __init__(self, ln_f: nn.LayerNorm, lm_head: nn.Linear) -> None:
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, x: Tensor) -> Tensor:
        return self.lm_head(self.ln_f(x))


class GPT(LightningModule):
    """Character-level GPT trained with AdamW and a warmup + cosine learning-rate schedule.

    Args:
        vocab_size: distinct tokens; the CLI links it from the data module.
        block_size, n_layer, n_head, n_embd, dropout, tie_embeddings: see ``GPTConfig``.
        lr: peak learning rate, reached at the end of warmup.
        weight_decay: applied to the >=2-D weights only (see ``configure_optimizers``).
        betas: AdamW's moment decay rates.
        warmup_steps: optimizer steps of linear warmup from 0 to ``lr``.
        max_steps: length of the cosine decay; ``None`` takes the trainer's step budget.
        min_lr_ratio: the cosine ends at ``lr * min_lr_ratio``, not at zero.
    """

    def __init__(
        self,
        vocab_size: int,
        block_size: int = 64,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        tie_embeddings: bool = True,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.99),
        warmup_steps: int = 20,
        max_steps: int | None = None,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()  # for the logger and checkpoints; code reads the typed fields
        self.lr = lr
        self.weight_decay = weight_decay
        self.betas = (float(betas[0]), float(betas[1]))  # YAML gives a list
        self.warmup_steps = warmup_steps
        self.max_steps = max_steps
        self.min_lr_ratio = min_lr_ratio
        self.config = GPTConfig(
            vocab_size=vocab_size,
            block_size=block_size,
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_embd,
            dropout=dropout,
            tie_embeddings=tie_embeddings,
        )
        self._init_layers(self.config)
        self._init_weights()

    def _init_layers(self, config: GPTConfig) -> None:
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying: one Parameter, two modules. Fewer parameters and, for a small model,
        # a better loss; also the case a ZeRO flat buffer must not count twice.
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    def _init_weights(self) -> None:
        # GPT-2 init. Runs in __init__, after seed_everything, so every rank builds the same
        # weights without a broadcast and two runs with one seed match.
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
        # Residual projections scaled by 1/sqrt(2 * n_layer): each block adds two of them to the
        # residual stream, so its variance stays put as depth grows.
        for block in self.modules():
            if not isinstance(block, Block):
                continue
            for proj in (block.attn.proj, block.mlp.proj):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))

    def configure_model(self) -> None:
        """Under tensor parallelism (``ZeroConfig(parallel={tensor: N})``) the strategy's mesh has a
        ``tensor`` dimension: every block is split over it (embeddings and head stay whole).
        Lightning calls this hook at every fit/validate/test; splitting blocks already split over
        the same mesh changes nothing."""
        mesh = self.device_mesh
        if mesh is not None and "tensor" in (mesh.mesh_dim_names or ()) and mesh["tensor"].size() > 1:
            from lightning_zero.parallel import parallelize_gpt

            parallelize_gpt(self, mesh["tensor"])

    def forward(self, idx: Tensor) -> Tensor:
        """idx: (B, T) token ids, T <= block_size -> logits (B, T, vocab_size)."""
        _, time = idx.shape
        if time > self.config.block_size:
            raise ValueError(
                f"GPT.forward got a sequence of {time} tokens, longer than block_size="
                f"{self.config.block_size}: crop the input or raise model.block_size"
            )
        pos = torch.arange(time, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def pipeline_layers(self) -> list[nn.Module]:
        """The layers in forward order, for pipeline parallelism (``ZeroConfig(pipeline=...)``)."""
        return [TokenAndPositionEmbedding(self.wte, self.wpe, self.drop), *self.blocks,
                OutputHead(self.ln_f, self.lm_head)]

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0) -> Tensor:
        """Append ``max_new_tokens`` sampled tokens to idx (B, T); context is cropped to block_size."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config.block_size :])[:, -1, :] / temperature
            next_token = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, next_token), dim=1)
        return idx

    def param_groups(self) -> list[dict[str, Any]]:
        """Two AdamW groups of the trainable parameters: decay for >=2-D weights (matmuls,
        embeddings), none for the rest.

        Biases and LayerNorm gains are 1-D; decaying them toward zero only hurts. Parameters
        are deduplicated by identity because the tied embedding / lm_head weight is one
        Parameter reachable under two names, and an optimizer (and a ZeRO flat buffer) that
        saw it twice would step it twice.
        """
        seen: set[int] = set()
        decay: list[nn.Parameter] = []
        no_decay: list[nn.Parameter] = []
        for _, param in self.named_parameters(remove_duplicate=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            (decay if param.dim() >= 2 else no_decay).append(param)
        groups = [
            {"params": decay, "weight_decay": self.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        # A group left empty by freezing (only adapters train) is dropped: DeepSpeed drops it too,
        # and its schedulers then see fewer groups than they were made for.
        return [group for group in groups if group["params"]]

    def _schedule_steps(self) -> int:
        if self.max_steps is not None:
            return self.max_steps
        # The trainer knows the budget (max_steps, or epochs x batches) once fit has started.
        return int(self.trainer.estimated_stepping_batches)

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        optimizer = torch.optim.AdamW(self.param_groups(), lr=self.lr, betas=self.betas)
        warmup = self.warmup_steps
        total = max(self._schedule_steps(), warmup + 1)
        min_ratio = self.min_lr_ratio

        def lr_factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / (total - warmup))
            return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
