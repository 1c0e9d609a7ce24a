"""``ZeroMemoryProfiler``: each rank's memory at each phase of sampled steps, gathered to rank 0,
logged, tabled beside the estimate, written as CSV and PNG plots."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from rich.console import Console
from typing_extensions import override

from lightning_zero._messages import unwritable_directory
from lightning_zero.profiling.estimate import MemoryEstimate, estimate_memory
from lightning_zero.profiling.measure import MemorySample, SavedActivations, sample_memory
from lightning_zero.profiling.report import comparison_table, continued, read_csv, write_csv, write_plots

log = logging.getLogger(__name__)
MiB = 2**20


class ZeroMemoryProfiler(Callback):
    """Every rank's memory at three phases of every ``every_n_steps``-th optimizer step (its last
    micro-batch under gradient accumulation): after
    forward (with the activations its forward saved for backward), after backward (on CUDA the
    allocator's peak during it), after the optimizer step. Per phase: parameters (on the device,
    on the host, stage-3 units gathered whole), gradients, optimizer state (device / host), and
    the allocator's (CUDA: allocated, peak, reserved, ``num_alloc_retries``) or the process's
    (RSS, peak RSS) totals.

    All ranks' samples are gathered to rank 0 at each sampled batch (a collective: every rank
    samples the same batches), which logs them to the Trainer's loggers as
    ``memory/rank{r}/{phase}/{category}`` (MiB) and, at the end of fit, prints a table of each
    rank beside :func:`~lightning_zero.estimate_memory`'s figures and writes ``memory.csv``,
    ``memory_over_steps.png`` and ``memory_per_rank.png`` into ``output_dir`` (by default the
    logger's directory, else ``default_root_dir``/memory). A run resumed from a checkpoint into
    the same directory continues the profile there: the CSV and plots keep the earlier run's
    samples before the step it resumed at. Between sampled batches the hooks return at once.

    Args:
        every_n_steps: sample every n-th optimizer step (the first one too).
        output_dir: where the CSV, the plots and snapshots go.
        log_metrics: log the samples to the Trainer's loggers.
        plots: write the PNG plots (needs matplotlib: ``pip install lightning-zero[profiling]``).
        cuda_snapshot_steps: on CUDA, record the allocator's history for this many batches and dump
            it with ``torch.cuda.memory._dump_snapshot`` (one pickle per rank, for
            https://pytorch.org/memory_viz); 0 turns it off.
    """

    def __init__(self, every_n_steps: int = 1, output_dir: str | Path | None = None, log_metrics: bool = True,
                 plots: bool = True, cuda_snapshot_steps: int = 0) -> None:
        for name, value, least in (("every_n_steps", every_n_steps, 1), ("cuda_snapshot_steps", cuda_snapshot_steps, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"ZeroMemoryProfiler({name}={value!r}) must be an integer >= {least}.")
        if output_dir is not None:
            if isinstance(output_dir, bool) or not isinstance(output_dir, (str, os.PathLike)):
                raise ValueError(f"ZeroMemoryProfiler(output_dir={output_dir!r}) must be a directory path (str or Path).")
            if Path(output_dir).exists() and not Path(output_dir).is_dir():
                raise ValueError(f"ZeroMemoryProfiler(output_dir={str(output_dir)!r}) is a file, not a directory: give"
                                 " the directory the CSV and plots should go into.")
        self.every_n_steps = every_n_steps
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.log_metrics = log_metrics
        self.plots = plots
        self.cuda_snapshot_steps = cuda_snapshot_steps
        self.samples: list[MemorySample] = []  # every rank's, on rank 0
        self.estimate: MemoryEstimate | None = None
        self.files: list[Path] = []
        self.sampling_seconds = 0.0  # time spent in this callback's sampled hooks, on this rank
        self._batches = 0
        self._mine: list[MemorySample] = []
        self._activations: SavedActivations | None = None
        self._snapshot_open = False
        self._out: Path | None = None
        self._step = 0  # the optimizer step the current batch runs (global_step at its start): all its phases
        self._first_step = 0  # global_step when training started: > 0 when resumed from a checkpoint
        self._sampling = False  # whether the current batch is sampled

    # ------------------------------------------------------------------ which batches
    # A sampled step is the last micro-batch of every n-th optimizer step (its forward, its
    # backward, then the step). Every rank sees the same batch indices, so all sample together.
    def _sampled(self) -> bool:
        return self._sampling

    def _record(self, trainer: pl.Trainer, pl_module: pl.LightningModule, phase: str, **extra: Any) -> None:
        strategy = trainer.strategy
        engine = getattr(strategy, "engine", None)
        self._mine.append(sample_memory(self._step, trainer.global_rank, phase, pl_module,
                                        [getattr(o, "_optimizer", o) for o in trainer.optimizers],
                                        strategy.root_device, engine, **extra))

    # ------------------------------------------------------------------ hooks
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._batches = 0
        self.samples, self._mine, self.files = [], [], []
        self.sampling_seconds = 0.0
        self._first_step = trainer.global_step
        self.estimate = self._estimate(trainer)
        self._out = self._directory(trainer)  # on every rank: trainer.log_dir is a collective
        # Before training, on every rank together: a directory that cannot be written would lose the profile at the end.
        refusal = unwritable_directory(self._out) if trainer.global_rank == 0 else None
        refusal = trainer.strategy.broadcast(refusal, src=0)
        if refusal is not None:
            raise ValueError(f"ZeroMemoryProfiler(output_dir=...): {refusal}. Give a writable directory.")
        if self.cuda_snapshot_steps:
            if trainer.strategy.root_device.type == "cuda":
                torch.cuda.memory._record_memory_history(max_entries=100_000)
                self._snapshot_open = True
            else:
                rank_zero_warn("ZeroMemoryProfiler(cuda_snapshot_steps=...) needs CUDA: no snapshot is recorded.")

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._stop_counting()
        self._batches += 1
        accumulate = trainer.accumulate_grad_batches
        last_batch = trainer.num_training_batches
        ends_window = (batch_idx + 1) % accumulate == 0 or (isinstance(last_batch, int) and batch_idx + 1 == last_batch)
        self._sampling = ends_window and trainer.global_step % self.every_n_steps == 0
        if not self._sampling:
            return
        self._step = trainer.global_step
        begin = time.perf_counter()
        self._activations = SavedActivations(pl_module, getattr(trainer.strategy, "engine", None))
        self._activations.start()
        self.sampling_seconds += time.perf_counter() - begin

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._activations is None:
            return
        begin = time.perf_counter()
        activations = self._activations.stop()
        self._activations = None
        self._record(trainer, pl_module, "forward", activations=activations)
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)
        self.sampling_seconds += time.perf_counter() - begin

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._sampled() or not self._mine or self._mine[-1].phase != "forward":
            return
        begin = time.perf_counter()
        device = trainer.strategy.root_device
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        self._record(trainer, pl_module, "backward", peak_allocated=peak)
        self.sampling_seconds += time.perf_counter() - begin

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._stop_counting()  # a step without backward (a skipped loss)
        if self._snapshot_open and self._batches >= self.cuda_snapshot_steps:
            self._dump_snapshot(trainer)
        if not self._sampled():
            return
        begin = time.perf_counter()
        self._record(trainer, pl_module, "step")
        gathered = self._gather(self._mine)
        self._mine = []
        if trainer.global_rank == 0:
            self.samples.extend(gathered)
            if self.log_metrics:
                self._log(trainer, gathered)
        self.sampling_seconds += time.perf_counter() - begin

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop_counting()
        self._stop_history()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop_counting()
        self._stop_history()

    def _stop_counting(self) -> None:
        """No saved-tensor hook outlives its batch (an exception, a skipped batch)."""
        if self._activations is not None:
            self._activations.stop()
            self._activations = None

    def _stop_history(self) -> None:
        if self._snapshot_open:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._snapshot_open = False

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._snapshot_open:
            self._dump_snapshot(trainer)
        if trainer.global_rank != 0:
            return
        if not self.samples:
            Console().print("ZeroMemoryProfiler: no training batch was sampled (no CSV or plots written).")
            return
        directory = self._out if self._out is not None else Path(trainer.default_root_dir) / "memory"
        console = Console()
        console.print(comparison_table(self.samples, self.estimate))
        if self.estimate is not None and self.estimate.notes:
            console.print("estimate: " + "; ".join(self.estimate.notes))
        profile = self._continued(directory / "memory.csv")
        try:
            self.files = [write_csv(profile, directory / "memory.csv")]
            if self.plots:
                try:
                    self.files += write_plots(profile, directory)
                except ImportError:
                    rank_zero_warn("ZeroMemoryProfiler(plots=True) needs matplotlib (pip install"
                                   " lightning-zero[profiling]): no PNG written.")
        except OSError as error:
            # The run is over: its result stays, and the samples stay on the callback (``samples``).
            rank_zero_warn(f"ZeroMemoryProfiler could not write into {str(directory)!r} ({error}); the samples are"
                           " still in the callback's `samples`. Give output_dir= a writable directory.")
            return
        console.print("memory profile: " + ", ".join(str(path) for path in self.files))

    # ------------------------------------------------------------------ helpers
    def _continued(self, path: Path) -> list[MemorySample]:
        """This run's samples, after the earlier run's when this one resumed it into the same directory."""
        if self._first_step == 0 or not path.exists():
            return self.samples
        try:
            earlier = read_csv(path)
        except (OSError, ValueError) as error:
            rank_zero_warn(f"ZeroMemoryProfiler: the earlier profile in {str(path)!r} is not continued ({error});"
                           " this run's samples replace it.")
            return self.samples
        return continued(earlier, self.samples, self._first_step)

    def _estimate(self, trainer: pl.Trainer) -> MemoryEstimate | None:
        """The estimate for this run (plain ZeRO over the world; None on a mesh or another strategy)."""
        strategy = trainer.strategy
        engine = getattr(strategy, "engine", None)
        config = getattr(strategy, "config", None)
        if engine is None or config is None or getattr(strategy, "parallel_dims", None) is not None:
            return None
        precision = str(trainer.precision)
        try:
            # The module as the user built it: stage-3 units chosen as the engine did, and as frozen
            # what the engine holds no gradient for (not what requires_grad says now: a backbone a
            # callback froze in on_fit_start, after the layout, still has its masters and gradients).
            with engine.true_shapes():
                return estimate_memory(trainer.lightning_module, trainer.world_size, config, precision,
                                       device_type="cuda" if strategy.root_device.type == "cuda" else "cpu",
                                       trained=engine.trained_params())
        except ValueError as error:
            log.warning(f"ZeroMemoryProfiler: no estimate ({error})")
            return None

    @staticmethod
    def _gather(mine: list[MemorySample]) -> list[MemorySample]:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return list(mine)
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        return [sample for rank_samples in every for sample in rank_samples]

    @staticmethod
    def _log(trainer: pl.Trainer, samples: list[MemorySample]) -> None:
        metrics: dict[str, float] = {}
        for sample in samples:
            for key, value in sample.as_row().items():
                if key in ("step", "rank", "phase") or value is None:
                    continue
                metrics[f"memory/rank{sample.rank}/{sample.phase}/{key}"] = value / MiB
        step = samples[0].step if samples else trainer.global_step
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)  # the step the samples are labelled with

    def _directory(self, trainer: pl.Trainer) -> Path:
        if self.output_dir is not None:
            return self.output_dir
        log_dir = trainer.log_dir
        return Path(log_dir if log_dir is not None else trainer.default_root_dir) / "memory"

    def _dump_snapshot(self, trainer: pl.Trainer) -> None:
        directory = self._out if self._out is not None else Path(trainer.default_root_dir) / "memory"
        path = directory / f"memory_snapshot_rank{trainer.global_rank}.pickle"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)
        self._snapshot_open = False
        print(f"rank {trainer.global_rank}: CUDA memory snapshot written to {path} (open it at https://pytorch.org/memory_viz)")


__all__ = ["ZeroMemoryProfiler"]
