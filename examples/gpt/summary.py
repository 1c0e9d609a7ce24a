"""End-of-fit summary: losses, steps, wall time and each rank's model-state memory.

Model state = parameters + gradients + optimizer state, the three things ZeRO stages shard
(stage 1: optimizer state, stage 2: + gradients, stage 3: + parameters). One row per rank
makes the saving visible: under DDP every rank holds all three in full.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from rich.console import Console
from rich.table import Table
from torch.optim import Optimizer

from lightning_zero import ZeroStrategy

_MIB = float(1 << 20)


class ModelStateLike(Protocol):
    """What the table reads: ``lightning_zero.ModelStateBytes`` and ``LocalModelStateBytes`` both fit."""

    @property
    def params(self) -> int: ...

    @property
    def grads(self) -> int: ...

    @property
    def optimizer_states(self) -> int: ...

    @property
    def total(self) -> int: ...


@dataclass(frozen=True)
class LocalModelStateBytes:
    """Same fields as ``lightning_zero.ModelStateBytes``, measured here for non-ZeRO strategies."""

    params: int
    grads: int
    optimizer_states: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer_states


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def measure_model_state(module: torch.nn.Module, optimizers: Sequence[Optimizer]) -> LocalModelStateBytes:
    """This rank's model-state bytes when nothing is sharded (DDP, single device).

    Gradients are counted as one gradient per trainable parameter, not read from ``p.grad``:
    between steps Lightning may have zeroed them to ``None``, yet the memory is needed again at
    the next backward, so the steady-state figure is the honest one. (DDP's own bucket copies,
    with ``gradient_as_bucket_view=False``, come on top and are not counted.)
    """
    # module.parameters() yields a tied Parameter once, so the shared embedding counts once.
    params = list(module.parameters())
    param_bytes = sum(_tensor_bytes(p) for p in params)
    grad_bytes = sum(_tensor_bytes(p) for p in params if p.requires_grad)
    optimizer_bytes = sum(
        _tensor_bytes(value)
        for optimizer in optimizers
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )
    return LocalModelStateBytes(params=param_bytes, grads=grad_bytes, optimizer_states=optimizer_bytes)


def _gather_local(local: LocalModelStateBytes) -> list[LocalModelStateBytes]:
    """Collective: every rank must call it. One entry per rank, in rank order."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [local]  # single process: nothing to gather
    gathered: list[LocalModelStateBytes | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, local)
    return [state for state in gathered if state is not None]


class TrainingSummary(Callback):
    """Print a rich table on rank 0 when fit ends.

    Memory is measured in ``on_train_end``, not ``on_fit_end``: the Trainer tears the strategy
    down between the two, and a ZeRO strategy may free its sharded buffers in teardown. Both
    hooks run on every rank, so the collective in ``on_train_end`` is safe.
    """

    def __init__(self) -> None:
        super().__init__()
        self._start: float | None = None
        self._first_train_loss: float | None = None
        self._per_rank: Sequence[ModelStateLike] = ()

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._first_train_loss is None and isinstance(outputs, dict) and "loss" in outputs:
            self._first_train_loss = float(outputs["loss"])

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, ZeroStrategy):
            # The strategy owns the shards and knows what each rank holds.
            self._per_rank = strategy.all_ranks_model_state_bytes()
        else:
            self._per_rank = _gather_local(measure_model_state(pl_module, trainer.optimizers))

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        wall = time.perf_counter() - self._start if self._start is not None else float("nan")
        console = Console()
        console.print(self._run_table(trainer, wall))
        if self._per_rank:
            console.print(self._memory_table(type(trainer.strategy).__name__))

    def _run_table(self, trainer: Trainer, wall_seconds: float) -> Table:
        metrics = trainer.callback_metrics
        table = Table(title="Training summary", show_header=False)
        table.add_column("what", style="bold")
        table.add_column("value", justify="right")
        first = f"{self._first_train_loss:.4f} -> " if self._first_train_loss is not None else ""
        table.add_row("train loss (first -> last, rank 0)", first + _fmt_metric(metrics.get("train_loss")))
        table.add_row("val loss (last, mean over ranks)", _fmt_metric(metrics.get("val_loss")))
        table.add_row("optimizer steps", str(trainer.global_step))
        table.add_row("wall time (fit)", f"{wall_seconds:.1f} s")
        table.add_row("strategy / ranks", f"{type(trainer.strategy).__name__} / {trainer.world_size}")
        return table

    def _memory_table(self, strategy_name: str) -> Table:
        table = Table(title=f"Model-state memory per rank, MiB ({strategy_name})")
        table.add_column("rank", justify="right")
        for name in ("parameters", "gradients", "optimizer state", "total"):
            table.add_column(name, justify="right")
        for rank, state in enumerate(self._per_rank):
            table.add_row(str(rank), *_mib_cells(state))
        summed = LocalModelStateBytes(
            params=sum(s.params for s in self._per_rank),
            grads=sum(s.grads for s in self._per_rank),
            optimizer_states=sum(s.optimizer_states for s in self._per_rank),
        )
        table.add_section()
        table.add_row("sum", *_mib_cells(summed), style="dim")
        return table


def _mib_cells(state: ModelStateLike) -> list[str]:
    return [f"{b / _MIB:.2f}" for b in (state.params, state.grads, state.optimizer_states, state.total)]


def _fmt_metric(value: torch.Tensor | float | None) -> str:
    return "n/a" if value is None else f"{float(value):.4f}"
