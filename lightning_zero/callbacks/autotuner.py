"""``ZeroAutotuner`` and ``ZeroTuner``: the fastest ZeRO configuration that fits, found inside the
user's own launch.

The search (lightning_zero/autotuning/search.py) runs in the callback's ``setup`` hook, after the
process group exists and before the strategy builds its engine, on every rank together. Each
trial is a short ``Trainer.fit`` of a fresh copy of the module, in this process, with a
:class:`ZeroStrategy` that reuses the process group (nothing is launched) and whose collectives
are guarded (see [Note: a trial that fails on one rank]). Then the best configuration is written
as LightningCLI YAML and either applied to this run, which trains on, or the run ends there.
"""

from __future__ import annotations

import copy
import gc
import logging
import os
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import yaml
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from torch import Tensor
from typing_extensions import override

from lightning_zero.autotuning.guard import GuardedCollectives, PeerFailed, TrialGuard, is_out_of_memory
from lightning_zero.autotuning.report import TUNED_MARK, output_refusal, results_table, tuned_yaml, write_yaml
from lightning_zero.autotuning.search import Method, SearchResult, TrialRecord, TrialStatus, TuningError, search
from lightning_zero.autotuning.space import Candidate, SearchSpace, parse_bytes, size_label
from lightning_zero.config import ZeroConfig
from lightning_zero.profiling.estimate import PARAM_BYTES, estimate_memory
from lightning_zero.profiling.measure import SavedActivations, sample_memory
from lightning_zero.strategy import ZeroStrategy

log = logging.getLogger(__name__)


class TrialError(RuntimeError):
    """A trial failed on another rank with an error that is not out-of-memory: the search stops."""


class ZeroAutotuner(Callback):
    """Finds the fastest ZeRO configuration (stage, offload, micro-batch size, bucket size, stage-3
    prefetch and unit size) that fits in ``budget`` bytes per rank, by short trials in this
    process on every rank together (see [Note: how the autotuner searches]).

    Add it to a ``Trainer(strategy=ZeroStrategy(...))`` (or ``--trainer.callbacks+=lightning_zero.ZeroAutotuner``
    on a LightningCLI command line): the search runs when ``fit`` starts. The micro-batch size is
    the ``batch_arg_name`` attribute (or hyperparameter) of the LightningModule or the datamodule,
    as for Lightning's BatchSizeFinder. Trials use the run's precision, gradient accumulation and
    clipping, but none of its other callbacks, loggers or checkpoints.

    Args:
        budget: bytes per rank (``"8GiB"``, ``2e9``): on CUDA by default the device's memory, which
            the trials may not exceed (the allocator is capped there); on CPU the tensors the
            estimator counts (model state, gathered units, saved activations), by default the
            host's memory shared by its ranks.
        space: the configurations to consider (a :class:`~lightning_zero.autotuning.SearchSpace`).
        method: ``"fast"`` (the default search) or ``"grid"`` (every configuration).
        warmup_steps: optimizer steps each trial runs before measuring (its memory is sampled then).
        measure_steps: optimizer steps measured for the throughput.
        output: where the best configuration goes as LightningCLI YAML (None: not written). Run
            under LightningCLI, it is the whole config of this run with the tuned values. An
            existing file there is replaced only if an earlier tuning wrote it; any other file (the
            run's own ``--config``, say) stops the search before its first trial.
        overwrite: replace an existing ``output`` whoever wrote it.
        apply: train on with the best configuration in this run; otherwise the run ends after the search.
        batch_arg_name: the attribute that holds the micro-batch size.
        progress: show a progress display and the results table (rank 0).
        exit_on_error: a search that cannot give a configuration prints its message and exits with
            status 2 on every rank instead of raising :class:`~lightning_zero.autotuning.TuningError`
            (what ``lightning-zero tune`` sets: a message, no traceback).
    """

    def __init__(self, budget: int | float | str | None = None, space: SearchSpace | None = None,
                 method: Method = "fast", warmup_steps: int = 2, measure_steps: int = 3,
                 output: str | Path | None = "zero_tuned.yaml", apply: bool = False, batch_arg_name: str = "batch_size",
                 progress: bool = True, exit_on_error: bool = False, overwrite: bool = False) -> None:
        self.budget = parse_bytes(budget) if budget is not None else None
        if isinstance(space, dict):  # a mapping from YAML
            space = SearchSpace(**space)
        if space is not None and not isinstance(space, SearchSpace):
            raise ValueError(f"ZeroAutotuner(space={space!r}) must be a SearchSpace (or a mapping of its fields).")
        self.space = space if space is not None else SearchSpace()
        if method not in ("fast", "grid"):
            raise ValueError(f"ZeroAutotuner(method={method!r}) must be 'fast' or 'grid'.")
        for name, value, least in (("warmup_steps", warmup_steps, 1), ("measure_steps", measure_steps, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"ZeroAutotuner({name}={value!r}) must be an integer >= {least}.")
        self.method = method
        self.warmup_steps = warmup_steps
        self.measure_steps = measure_steps
        self.output = Path(output) if output is not None else None
        self.overwrite = overwrite
        self.apply = apply
        self.batch_arg_name = batch_arg_name
        self.progress = progress
        self.exit_on_error = exit_on_error
        self.result: SearchResult | None = None
        self.best_config: ZeroConfig | None = None
        self.written: Path | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self.result is not None:
            return
        try:
            self._tune(trainer, pl_module)
        except TuningError as error:
            if not self.exit_on_error:
                raise
            if trainer.global_rank == 0:
                print(f"lightning-zero tune: error: {error}", file=sys.stderr)
            raise SystemExit(2) from None
        if not self.apply:
            _exit_fit(trainer)

    def _tune(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, ZeroStrategy):
            raise TuningError(
                f"ZeroAutotuner needs Trainer(strategy=ZeroStrategy(...)) (or 'zero1' ... 'zero3_offload'), but the"
                f" strategy is {type(strategy).__name__}."
            )
        if not strategy.config.parallel.is_trivial or strategy.config.pipeline.enabled:
            raise TuningError(
                "ZeroAutotuner searches plain ZeRO over every rank, but the strategy has a tensor-parallel, hybrid or"
                " pipeline layout (ZeroConfig.parallel / pipeline). Tune without it, then add the layout back."
            )
        if self.output is not None:
            # Before any trial: a search whose result could not be written would be lost.
            refusal = output_refusal(self.output, self.overwrite) if trainer.global_rank == 0 else None
            refusal = strategy.broadcast(refusal, src=0)
            if refusal is not None:
                raise TuningError(f"ZeroAutotuner(output=...): {refusal}")
        batch = _BatchSize.find(trainer, pl_module, self.batch_arg_name, self.space)
        budget = self.budget if self.budget is not None else _default_budget(strategy)
        runner = _TrialRunner(trainer, pl_module, batch, budget, self.warmup_steps, self.measure_steps)
        display = _Display(trainer.global_rank == 0 and self.progress)
        try:
            with display, runner:
                backend = str(torch.distributed.get_backend()) if torch.distributed.is_initialized() else None
                result = search(self.space, strategy.config, runner.numel, runner, budget, self.method,
                                on_start=display.start, on_record=display.record, backend=backend)
        except BaseException:
            batch.restore()  # nothing half-applied: the run keeps its own batch size and strategy
            raise
        best_config = result.best.candidate.zero_config(strategy.config)
        self.result, self.best_config = result, best_config
        if trainer.global_rank == 0 and self.progress:
            display.console.print(results_table(result))
            display.console.print(f"best: {result.best.candidate.label}: {result.best.samples_per_sec:.1f} samples/s"
                                  f" in {result.trials} trial(s)")
        if self.output is not None:
            failure = None
            if trainer.global_rank == 0:
                try:
                    self.written = self._write(trainer, result, best_config, batch)
                except OSError as error:
                    failure = f"ZeroAutotuner could not write {self.output}: {error}. Give output= a writable path."
            else:
                self.written = self.output
            failure = strategy.broadcast(failure, src=0)  # every rank stops, or none: no rank left waiting
            if failure is not None:
                batch.restore()
                raise TuningError(failure)
        if self.apply:
            strategy.config = best_config
            batch.set(result.best.candidate.micro_batch_size)
        else:
            batch.restore()

    def _write(self, trainer: pl.Trainer, result: SearchResult, config: ZeroConfig, batch: _BatchSize) -> Path:
        assert self.output is not None
        base = _cli_config(trainer)
        content = tuned_yaml(result, config, batch.section, self.batch_arg_name, base)
        best = result.best
        header = (f"{TUNED_MARK} on {date.today().isoformat()}: {best.candidate.label},"
                  f" {best.samples_per_sec:.1f} samples/s over every rank, peak {_mib(best.peak_bytes)} of the"
                  f" {_mib(result.budget)} budget per rank ({result.trials} trial(s), {result.method} search).")
        if base is None:
            header += "\nMerge these keys into the run's LightningCLI config (or pass this file after it with --config)."
        path = write_yaml(self.output, content, header)
        if self.progress:
            Console().print(f"wrote {path}")
        return path


class ZeroTuner:
    """Lightning's ``Tuner`` for ZeRO: ``ZeroTuner(trainer).tune(model, datamodule=dm, budget="8GiB")``
    runs :class:`ZeroAutotuner` through ``trainer.fit`` (launching the ranks as ``fit`` does, or on
    the ranks already started) and returns its :class:`~lightning_zero.autotuning.SearchResult`
    (on rank 0 under a spawn launcher: read the written YAML elsewhere)."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer

    def tune(self, model: pl.LightningModule, train_dataloaders: Any = None, datamodule: Any = None,
             **autotuner: Any) -> SearchResult | None:
        tuner = ZeroAutotuner(**{**autotuner, "apply": False})
        self.trainer.callbacks = [tuner] + [c for c in self.trainer.callbacks if not isinstance(c, ZeroAutotuner)]
        try:
            self.trainer.fit(model, train_dataloaders=train_dataloaders, datamodule=datamodule)
        finally:
            self.trainer.callbacks = [c for c in self.trainer.callbacks if c is not tuner]
        return tuner.result


def _exit_fit(trainer: pl.Trainer) -> None:
    """Ends the run after the search as Lightning's own Tuner does (its exit exception, which
    ``fit`` catches around its launcher). Ranks started by spawn/fork run ``fit``'s body inside
    the launcher, where nothing would catch it: there the run trains on no batch instead."""
    from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
    from lightning.pytorch.utilities.exceptions import _TunerExitException

    if isinstance(trainer.strategy.launcher, _MultiProcessingLauncher):
        trainer.limit_train_batches = trainer.limit_val_batches = 0
        trainer.num_sanity_val_steps = 0
        return
    raise _TunerExitException()


# ---------------------------------------------------------------------- where the micro-batch lives
@dataclass
class _BatchSize:
    """The micro-batch size of the run: an attribute (or hyperparameter) of the module or the
    datamodule, set for each trial and restored (or applied) after the search."""

    module: pl.LightningModule
    name: str
    section: Literal["model", "data"]  # its LightningCLI section
    original: int
    datamodule: Any
    loader: Any  # the DataLoader passed to fit, when neither module nor datamodule makes one
    settable: bool = True  # False: the data's own size, the only one searched

    @classmethod
    def find(cls, trainer: pl.Trainer, module: pl.LightningModule, name: str, space: SearchSpace) -> _BatchSize:
        datamodule = trainer.datamodule
        loader = None
        if datamodule is None and not is_overridden("train_dataloader", module):
            loader = getattr(getattr(trainer.fit_loop, "_data_source", None), "instance", None)
        if loader is not None or not lightning_hasattr(module, name):
            fixed = getattr(loader, "batch_size", None)
            if len(space.micro_batch_sizes) == 1 and (fixed is None or fixed == space.micro_batch_sizes[0]):
                return cls(module, name, "model", space.micro_batch_sizes[0], datamodule, loader, settable=False)
            where = "a DataLoader passed to fit" if loader is not None else "the module and the datamodule"
            raise TuningError(
                f"ZeroAutotuner cannot change the micro-batch size: {where} has no {name!r} attribute to set. Give the"
                f" LightningModule or LightningDataModule a `{name}` attribute (or hyperparameter) that"
                f" train_dataloader() reads, pass batch_arg_name=..., or search one size only"
                f" (SearchSpace(micro_batch_sizes=({fixed or 'N'},)))."
            )
        value = lightning_getattr(module, name)
        # The datamodule makes the loaders when there is one: its attribute is the one read.
        on_data = datamodule is not None and (hasattr(datamodule, name) or name in getattr(datamodule, "hparams", {}))
        return cls(module, name, "data" if on_data else "model", int(value), datamodule, None)

    def set(self, value: int) -> None:
        if self.settable:
            lightning_setattr(self.module, self.name, value)

    def restore(self) -> None:
        self.set(self.original)

    def trial_data(self, copy_of_module: pl.LightningModule, value: int) -> Any:
        """What the trial's ``fit`` gets as ``train_dataloaders`` (None: the copy's own
        ``train_dataloader()``), with the batch size ``value`` set where it is read."""
        if self.loader is not None:
            return self.loader
        self.set(value)
        if self.settable and self.section == "model":
            lightning_setattr(copy_of_module, self.name, value)
        if self.datamodule is not None:
            return self.datamodule.train_dataloader()
        return None


# ---------------------------------------------------------------------- trials
class _AttachedEnvironment(ClusterEnvironment):
    """The ranks of the run being tuned: a trial's strategy reuses its process group and
    launches nothing (the processes already exist), and tears nothing of it down."""

    def __init__(self, world_size: int, global_rank: int, local_rank: int, node_rank: int) -> None:
        self._world_size, self._global_rank = world_size, global_rank
        self._local_rank, self._node_rank = local_rank, node_rank

    @property
    @override
    def creates_processes_externally(self) -> bool:
        return True

    @property
    @override
    def main_address(self) -> str:
        return "127.0.0.1"

    @property
    @override
    def main_port(self) -> int:
        return 0

    @staticmethod
    @override
    def detect() -> bool:
        return False

    @override
    def world_size(self) -> int:
        return self._world_size

    @override
    def set_world_size(self, size: int) -> None:
        pass  # fixed by the run being tuned

    @override
    def global_rank(self) -> int:
        return self._global_rank

    @override
    def set_global_rank(self, rank: int) -> None:
        pass

    @override
    def local_rank(self) -> int:
        return self._local_rank

    @override
    def node_rank(self) -> int:
        return self._node_rank

    @override
    def teardown(self) -> None:
        pass  # the environment variables belong to the run being tuned


class _TrialStrategy(ZeroStrategy):
    """A trial's ZeroStrategy: every collective, its own and Lightning's, first checks the trial
    guard (see [Note: a trial that fails on one rank]), and teardown drops the engine instead of
    handing the module back (the module is a copy, thrown away)."""

    def __init__(self, guard: TrialGuard, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._guard = guard

    @property
    @override
    def collectives(self) -> GuardedCollectives:
        if self._collectives is None:
            self._collectives = GuardedCollectives(self._guard)
        assert isinstance(self._collectives, GuardedCollectives)
        return self._collectives

    @override
    def model_to_device(self) -> None:
        super().model_to_device()
        self._guard.check()  # before the broadcast of rank 0's weights: the move is what may run out of memory

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._guard.check()
        super().barrier(*args, **kwargs)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self._guard.check()
        return super().broadcast(obj, src)

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        if isinstance(tensor, Tensor):
            self._guard.check()
        return super().reduce(tensor, group, reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        self._guard.check()
        return super().all_gather(tensor, group, sync_grads)

    @override
    def teardown(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.remove_hooks()
            # A forward cut short (an OOM here, a peer's there) leaves an autograd graph that is never
            # run; its gradient hooks (held by C++ graph nodes, which Python's gc cannot see) refer to
            # the engine, and through it to the module copy and the graph's own activations: a cycle
            # nothing frees. The engine is thrown away with the copy, so its references go now.
            vars(engine).clear()
        super().teardown()


@dataclass(frozen=True)
class _RankResult:
    """One rank's side of a trial, exchanged after it."""

    status: Literal["ok", "oom", "error", "peer"]
    samples_per_sec: float | None = None
    peak_bytes: int | None = None
    activation_bytes_per_sample: float | None = None
    message: str = ""


class _TrialMeter(Callback):
    """Times the measured steps with Lightning's ``Throughput`` and samples memory during the
    warm-up steps (CUDA: the allocator's peak over the whole trial)."""

    def __init__(self, warmup_steps: int, measure_steps: int, world_size: int, device: torch.device,
                 guard: TrialGuard, guard_latency: float) -> None:
        self.warmup_steps, self.measure_steps, self.device = warmup_steps, measure_steps, device
        self.guard, self.guard_latency = guard, guard_latency
        self._exchanges_at_start = 0
        self.world_size = world_size
        self.throughput: Throughput | None = None
        self.peak_bytes = 0
        self.activation_bytes_per_sample: float | None = None
        self.batch_size: int | None = None
        self._activations: SavedActivations | None = None
        self._start: float | None = None
        self._batches = self._samples = 0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _warming(self, trainer: pl.Trainer) -> bool:
        return trainer.global_step < self.warmup_steps

    def _sample(self, trainer: pl.Trainer, module: pl.LightningModule, phase: str, activations: int | None = None) -> None:
        if self.device.type == "cuda":
            return  # the allocator's peak covers everything
        optimizers = [getattr(o, "_optimizer", o) for o in trainer.optimizers]
        sample = sample_memory(trainer.global_step, trainer.global_rank, phase, module, optimizers, self.device,
                               getattr(trainer.strategy, "engine", None), activations=activations)
        held = sample.params_device + sample.grads_device + sample.optimizer_device + (activations or 0)
        self.peak_bytes = max(self.peak_bytes, held)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Its rates need a full window: every measured batch and the start.
        batches = self.measure_steps * trainer.accumulate_grad_batches
        self.throughput = Throughput(world_size=self.world_size, window_size=batches + 1)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        size = extract_batch_size(batch)
        if self.batch_size is None:
            self.batch_size = size
        if self._warming(trainer):
            self._activations = SavedActivations(pl_module, getattr(trainer.strategy, "engine", None))
            self._activations.start()

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self._activations is not None:
            activations = self._activations.stop()
            self._activations = None
            if self.batch_size:
                per_sample = activations / self.batch_size
                self.activation_bytes_per_sample = max(self.activation_bytes_per_sample or 0.0, per_sample)
            self._sample(trainer, pl_module, "forward", activations)

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._warming(trainer):
            self._sample(trainer, pl_module, "backward")

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._stop_counting()
        assert self.throughput is not None
        if self._start is None:
            self._sample(trainer, pl_module, "step")
            if trainer.global_step >= self.warmup_steps:  # the last warm-up batch: the clock starts
                self._sync()
                self._start = time.perf_counter()
                self._exchanges_at_start = self.guard.exchanges
                self.throughput.update(time=0.0, batches=0, samples=0)
            return
        self._sync()
        self._batches += 1
        self._samples += extract_batch_size(batch)
        elapsed = time.perf_counter() - self._start
        # The guard's own exchanges are not the configuration's (see [Note: a trial that fails on one rank]).
        guarded = (self.guard.exchanges - self._exchanges_at_start) * self.guard_latency
        self.throughput.update(time=max(elapsed - guarded, 0.5 * elapsed), batches=self._batches,
                               samples=self._samples)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop_counting()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop_counting()

    def _stop_counting(self) -> None:
        if self._activations is not None:
            self._activations.stop()
            self._activations = None

    def samples_per_sec(self) -> float | None:
        """Every rank together (this rank's rate times the world size), over the measured steps."""
        if self.throughput is None or self._batches == 0:
            return None
        metrics = self.throughput.compute()
        rate = metrics.get("samples_per_sec", metrics.get("device/samples_per_sec"))
        return float(rate) if rate is not None else None

    def peak(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return self.peak_bytes


class _TrialRunner:
    """Runs one candidate on every rank together and agrees on what it gave (the search's
    :class:`~lightning_zero.autotuning.search.Runner`)."""

    def __init__(self, trainer: pl.Trainer, module: pl.LightningModule, batch: _BatchSize, budget: int,
                 warmup_steps: int, measure_steps: int) -> None:
        self.outer = trainer
        self.batch = batch
        self.budget = budget
        self.warmup_steps, self.measure_steps = warmup_steps, measure_steps
        strategy = trainer.strategy
        assert isinstance(strategy, ZeroStrategy)
        self.strategy = strategy
        self.base = strategy.config
        self.device = strategy.root_device
        self.precision = str(trainer.precision)
        self.pristine = _detached_copy(module)
        # What the estimate counts: the copy, or for layers built in configure_model a copy built on meta.
        self.sized, why_unsized = _with_parameters(self.pristine)
        if self.sized is None and trainer.global_rank == 0:
            warnings.warn(f"ZeroAutotuner: no memory estimate ({why_unsized}), so none of the candidates is skipped"
                          " as too large: each runs as a trial, and bucket and unit sizes are searched around their"
                          " defaults.", stacklevel=2)
        self.numel = sum(p.numel() for p in self.sized.parameters() if p.requires_grad) if self.sized is not None else 0
        self.activation_bytes_per_sample: float | None = None
        self._state_estimates: dict[ZeroConfig, int] = {}  # without activations, per configuration
        self.guard: TrialGuard | None = None
        self.guard_latency = 0.0

    def __enter__(self) -> _TrialRunner:
        self.guard = TrialGuard()
        self.guard_latency = self.guard.measure_latency()
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, self.budget / total), self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)
        self.pristine = self.sized = None  # type: ignore[assignment]
        _release_memory(self.device)

    # ------------------------------------------------------------------ estimate
    def estimate(self, candidate: Candidate) -> int | None:
        if not self.numel or self.precision not in PARAM_BYTES:
            return None
        config = candidate.zero_config(self.base)
        if config not in self._state_estimates:  # the search asks again and again: the model's part is fixed
            estimate = estimate_memory(self.sized, self.strategy.world_size, config, self.precision,
                                       device_type="cpu" if self.device.type == "cpu" else "cuda")
            self._state_estimates[config] = estimate.device.total + (
                estimate.host.total if self.device.type == "cpu" else 0)
        total = self._state_estimates[config]
        if self.activation_bytes_per_sample is not None:
            total += int(self.activation_bytes_per_sample * candidate.micro_batch_size)
        return total

    # ------------------------------------------------------------------ one trial
    def run(self, candidate: Candidate) -> TrialRecord:
        guard = self.guard
        assert guard is not None
        guard.arm()
        begin = time.perf_counter()
        error: BaseException | None = None
        try:
            mine = self._fit(candidate)
            guard.check()  # meets a late failure of another rank (after its last collective)
        except PeerFailed:
            mine = _RankResult("peer")
        except BaseException as failure:  # noqa: BLE001 - every rank must hear of it before anything is raised
            guard.fail()
            if is_out_of_memory(failure):
                mine = _RankResult("oom", message=_first_line(failure))
            else:
                mine, error = _RankResult("error", message=f"{type(failure).__name__}: {_first_line(failure)}"), failure
            del failure
        _release_memory(self.device)
        every: list[_RankResult] = guard.gather(mine)
        seconds = time.perf_counter() - begin
        errors = [(rank, r) for rank, r in enumerate(every) if r.status == "error"]
        ooms = [(rank, r) for rank, r in enumerate(every) if r.status == "oom"]
        if errors and not ooms:
            if error is not None:
                raise error
            rank, result = errors[0]
            raise TrialError(f"the autotuner's trial of {candidate.label} failed on rank {rank}: {result.message}")
        if ooms:
            rank, result = ooms[0]
            return TrialRecord(candidate, TrialStatus.OOM, message=f"rank {rank}: {result.message}", seconds=seconds)
        rates = [r.samples_per_sec for r in every]
        if any(rate is None for rate in rates):
            raise TuningError(
                f"the trial of {candidate.label} measured no step: the train dataloader ran out before"
                f" {self.warmup_steps + self.measure_steps} optimizer steps. Give it more batches, or lower"
                " ZeroAutotuner(warmup_steps=..., measure_steps=...)."
            )
        per_sample = [r.activation_bytes_per_sample for r in every if r.activation_bytes_per_sample is not None]
        if per_sample:
            self.activation_bytes_per_sample = max(per_sample + [self.activation_bytes_per_sample or 0.0])
        peak = max(r.peak_bytes or 0 for r in every)
        # The ranks step together: the slowest one's rate is the run's.
        return TrialRecord(candidate, TrialStatus.FITS, samples_per_sec=min(r for r in rates if r is not None),
                           peak_bytes=peak, seconds=seconds)

    def _fit(self, candidate: Candidate) -> _RankResult:
        guard = self.guard
        assert guard is not None
        outer, strategy = self.outer, self.strategy
        module = copy.deepcopy(self.pristine)
        data = self.batch.trial_data(module, candidate.micro_batch_size)
        trial_strategy = _TrialStrategy(
            guard, config=candidate.zero_config(self.base), precision_plugin=copy.deepcopy(strategy.precision_plugin),
            cluster_environment=_AttachedEnvironment(strategy.world_size, strategy.global_rank, strategy.local_rank,
                                                     strategy.node_rank),
            process_group_backend=strategy.process_group_backend, timeout=strategy._timeout,
            state_dict_type=strategy.state_dict_type,
        )
        meter = _TrialMeter(self.warmup_steps, self.measure_steps, strategy.world_size, self.device, guard,
                            self.guard_latency)
        devices: Any = [d.index for d in strategy.parallel_devices] if self.device.type == "cuda" \
            else len(strategy.parallel_devices)
        with _quiet_trials():
            trainer = pl.Trainer(
                accelerator=type(outer.accelerator)(), devices=devices, num_nodes=strategy.num_nodes,
                strategy=trial_strategy, max_steps=self.warmup_steps + self.measure_steps, max_epochs=-1,
                limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, callbacks=[meter],
                accumulate_grad_batches=outer.accumulate_grad_batches, gradient_clip_val=outer.gradient_clip_val,
                gradient_clip_algorithm=outer.gradient_clip_algorithm, default_root_dir=outer.default_root_dir,
                use_distributed_sampler=outer._accelerator_connector.use_distributed_sampler,
            )
            try:
                trainer.fit(module, train_dataloaders=data)
            finally:
                module._trainer = None
        if meter.batch_size is not None and self.batch.settable and meter.batch_size != candidate.micro_batch_size:
            raise TuningError(
                f"ZeroAutotuner set {self.batch_arg_description} to {candidate.micro_batch_size}, but the train"
                f" dataloader's batches hold {meter.batch_size} samples: train_dataloader() must read that attribute"
                " (or pass batch_arg_name=... naming the one it reads)."
            )
        return _RankResult("ok", meter.samples_per_sec(), meter.peak(), meter.activation_bytes_per_sample)

    @property
    def batch_arg_description(self) -> str:
        where = "the LightningModule" if self.batch.section == "model" else "the datamodule"
        return f"{where}'s {self.batch.name!r}"


def _detached_copy(module: pl.LightningModule) -> pl.LightningModule:
    """A copy of the module as it is before setup, not attached to the run's Trainer (whose state
    it would otherwise copy along)."""
    trainer = module._trainer
    module._trainer = None
    try:
        return copy.deepcopy(module)
    finally:
        module._trainer = trainer


def _with_parameters(module: pl.LightningModule) -> tuple[pl.LightningModule | None, str]:
    """``module`` if it has parameters; for one whose layers ``configure_model`` builds, a copy with
    them built on the meta device (shapes only, no memory); None, and why, when neither has any."""
    if next(module.parameters(), None) is not None:
        return module, ""
    if not is_overridden("configure_model", module, pl.LightningModule):
        return None, "the LightningModule has no parameters"
    probe = copy.deepcopy(module)
    try:
        with torch.device("meta"):
            probe.configure_model()
    except Exception as error:  # noqa: BLE001 - the hook may need the Trainer, files, ...: then no estimate
        return None, f"the model's layers come from configure_model(), which failed on the meta device: {_first_line(error)}"
    if next(probe.parameters(), None) is None:
        return None, "the LightningModule has no parameters, even after configure_model()"
    return probe, ""


def _release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@contextmanager
def _quiet_trials() -> Iterator[None]:
    """Each trial's Trainer would print its device summary and data warnings again."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PossibleUserWarning)
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _default_budget(strategy: ZeroStrategy) -> int:
    device = strategy.root_device
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return int(pages * size // max(1, strategy.num_processes))


def _cli_config(trainer: pl.Trainer) -> dict[str, Any] | None:
    """This run's LightningCLI config, as its SaveConfigCallback holds it (None outside LightningCLI)."""
    for callback in trainer.callbacks:
        if isinstance(callback, SaveConfigCallback):
            try:
                return yaml.safe_load(callback.parser.dump(callback.config, skip_none=False))
            except Exception as error:  # noqa: BLE001 - the YAML is then the tuned keys only
                log.warning("ZeroAutotuner could not read the LightningCLI config (%s): writing the tuned keys only.",
                            error)
    return None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _mib(value: int | None) -> str:
    return "-" if value is None else size_label(value)


class _Display:
    """The rich progress display on rank 0 (nothing elsewhere)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.console = Console()
        if not self.console.is_terminal:  # a log file or a pipe: rich's 80 columns would wrap the table
            self.console = Console(width=120)
        self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                                  console=self.console, transient=True) if enabled else None
        self._task: Any = None
        self._count = 0

    def __enter__(self) -> _Display:
        if self._progress is not None:
            self._progress.start()
            self._task = self._progress.add_task("autotuning", total=None)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def start(self, candidate: Candidate) -> None:
        self._count += 1
        if self._progress is not None:
            self._progress.update(self._task, description=f"autotuning: trial {self._count}: {candidate.label}")

    def record(self, record: TrialRecord) -> None:
        if self._progress is None or not record.ran:
            return
        rate = f"{record.samples_per_sec:.1f} samples/s, peak {_mib(record.peak_bytes)}" if record.fits \
            else f"{record.status.value} {record.message}"
        self._progress.console.print(f"trial {self._count}: {record.candidate.label}: {rate}", markup=False,
                                     highlight=False)


__all__ = ["TrialError", "ZeroAutotuner", "ZeroTuner"]
