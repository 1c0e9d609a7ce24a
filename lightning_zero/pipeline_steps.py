"""A LightningModule's steps run through pipeline stages (the Lightning edge of
:mod:`lightning_zero.parallel.pipeline`).

[Note: Lightning steps in a pipeline]
``training_step`` stays the user's: on the last stage the schedule's loss function calls it once
per micro-batch, with that micro-batch, while ``self(...)`` (the module's forward) returns the
last stage's output for it instead of running the model. Its loss, divided by the micro-batch
count (and Lightning's ``accumulate_grad_batches``, and multiplied by the fp16 loss scale), is
what the schedule backpropagates. What the step logs with ``self.log`` is recorded instead of
logged, reduced over the micro-batches (by each call's ``reduce_fx``), sent from the last stage
to every rank of its pipeline and logged there once, so progress bar, loggers, callbacks and
``ModelCheckpoint(monitor=...)`` see the same values on every rank. The step returns the mean
loss, detached (the schedule already ran the backward). Validation, test and predict run the
pipeline forward only and call the user's step once, on the last stage, with the whole batch's
output.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero.parallel.pipeline import (
    PipelineError,
    PipelineRunner,
    batch_size_of,
    default_pipeline_input,
    split_batch,
)

_REDUCERS: dict[Any, Callable[[Tensor], Tensor]] = {
    "mean": torch.mean, torch.mean: torch.mean, "avg": torch.mean,
    "sum": torch.sum, torch.sum: torch.sum,
    "max": torch.max, torch.max: torch.max,
    "min": torch.min, torch.min: torch.min,
}


class LogRecorder:
    """What a step logs with ``self.log`` (and ``log_dict``) while it runs on the last stage."""

    def __init__(self) -> None:
        self.values: dict[str, list[Tensor]] = {}
        self.kwargs: dict[str, dict[str, Any]] = {}

    @contextlib.contextmanager
    def capturing(self, module: pl.LightningModule) -> Generator[None, None, None]:
        def record(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            if args:
                raise PipelineError(
                    f"self.log({name!r}, ...) under pipeline parallelism takes its options by keyword (prog_bar=True, ...)."
                )
            if not isinstance(value, (Tensor, int, float)):
                raise PipelineError(
                    f"self.log({name!r}, <{type(value).__name__}>) under pipeline parallelism: only tensors and numbers"
                    " can be sent from the last stage to the other ranks. Log the metric's value"
                    " (e.g. `self.log(name, metric(preds, target))` or `metric.compute()` at epoch end)."
                )
            reduce_fx = kwargs.get("reduce_fx", "mean")
            if reduce_fx not in _REDUCERS:
                raise PipelineError(
                    f"self.log({name!r}, reduce_fx={reduce_fx!r}) under pipeline parallelism: the micro-batches' values"
                    " are combined with reduce_fx, which must be one of 'mean', 'sum', 'max', 'min'."
                )
            unsendable = [key for key, option in kwargs.items()
                          if key != "reduce_fx" and not isinstance(option, (bool, int, float, str, type(None)))]
            if unsendable:
                raise PipelineError(
                    f"self.log({name!r}, ..., {', '.join(f'{key}=...' for key in unsendable)}) under pipeline parallelism:"
                    " what the last stage logs is sent to the other stages, and only plain options (prog_bar,"
                    " on_step, sync_dist, batch_size, ...) can be sent. Drop those options."
                )
            if callable(reduce_fx):  # torch.mean and friends travel by name
                kwargs = {**kwargs, "reduce_fx": next(key for key, fn in _REDUCERS.items()
                                                      if isinstance(key, str) and fn is _REDUCERS[reduce_fx])}
            tensor = torch.as_tensor(value).detach().float().cpu()
            self.values.setdefault(name, []).append(tensor)
            self.kwargs[name] = kwargs

        previous = module.__dict__.get("log")
        module.log = record  # type: ignore[method-assign]
        try:
            yield
        finally:
            if previous is None:
                module.__dict__.pop("log", None)
            else:
                module.log = previous  # type: ignore[method-assign]

    def reduced(self) -> dict[str, tuple[float, dict[str, Any]]]:
        """Each name's value over the micro-batches, reduced by its ``reduce_fx``."""
        out = {}
        for name, values in self.values.items():
            kwargs = self.kwargs[name]
            reducer = _REDUCERS[kwargs.get("reduce_fx", "mean")]
            out[name] = (float(reducer(torch.stack(values))), kwargs)
        return out


@contextlib.contextmanager
def forward_returns(module: pl.LightningModule, output: Any, hook: str) -> Generator[None, None, None]:
    """Within it, the module's forward returns ``output`` (the last stage's), once."""
    calls = [0]

    def forward(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] > 1:
            raise PipelineError(
                f"{type(module).__name__}.{hook} called the model twice in one step: under pipeline parallelism the"
                " model's forward runs in the pipeline stages, once per (micro-)batch, and self(...) returns the last"
                " stage's output. Call it once per step."
            )
        return output

    module.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        module.__dict__.pop("forward", None)


@contextlib.contextmanager
def without_collectives(module: pl.LightningModule, hook: str) -> Generator[None, None, None]:
    """Within it, the module's collectives (``self.all_gather``, the strategy's ``reduce``,
    ``broadcast`` and ``barrier``) raise: the step runs on the last stage only, and a collective
    there would wait forever for the ranks of the other stages, which never call it. The error is
    raised on every rank (see ``_from_last_stage``)."""
    strategy = module._trainer.strategy if module._trainer is not None else None

    def refuse(name: str) -> Callable[..., Any]:
        def collective(*args: Any, **kwargs: Any) -> Any:
            raise PipelineError(
                f"{type(module).__name__}.{hook} called {name} under pipeline parallelism: the step runs on the last"
                " pipeline stage only, so a collective in it would wait for the other stages' ranks, which never"
                " call it. Log the value with self.log(...) (what the last stage logs reaches every rank), or run"
                " the collective in a hook every rank runs (on_validation_epoch_end, on_train_epoch_end, ...)."
            )
        return collective

    patched: list[tuple[Any, str]] = [(module, "all_gather")]
    if strategy is not None:
        patched += [(strategy, name) for name in ("reduce", "broadcast", "barrier")]
    for owner, name in patched:
        owner.__dict__[name] = refuse("self.all_gather" if owner is module else f"trainer.strategy.{name}")
    try:
        yield
    finally:
        for owner, name in patched:
            owner.__dict__.pop(name, None)


def _zero_loss(output: Any) -> Tensor:
    """A loss of zero that still reaches every output, so the backward runs through all stages."""
    tensors = [t for t in _tensor_leaves(output) if t.is_floating_point() and t.requires_grad]
    return sum((t.sum() * 0.0 for t in tensors), torch.zeros((), device=tensors[0].device if tensors else None))


def _tensor_leaves(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensor_leaves(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensor_leaves(item)]
    return []


def _loss_of(result: Any, module: pl.LightningModule) -> Tensor:
    loss = result.get("loss") if isinstance(result, dict) else result
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        raise PipelineError(
            f"{type(module).__name__}.training_step returned {type(result).__name__} under pipeline parallelism: it"
            " must return the loss (a scalar tensor, or a dict with 'loss') for every micro-batch; a step cannot be"
            " skipped by returning None, because the other stages' backward waits for it."
        )
    return loss


class PipelineSteps:
    """Runs the LightningModule's steps through this rank's pipeline stages (see the note above)."""

    def __init__(self, runner: PipelineRunner) -> None:
        self.runner = runner

    def _inputs(self, module: pl.LightningModule, batch: Any) -> Any:
        # On every rank: the others read only its shapes, so that all ranks rebuild the stages
        # for a new input shape together (see PipelineRunner.train_step).
        custom = getattr(module, "pipeline_input", None)
        return custom(batch) if callable(custom) else default_pipeline_input(batch)

    def training_step(self, module: pl.LightningModule, batch: Any, rest: tuple[Any, ...], loss_multiplier: float,
                      run: Callable[[Callable[[], None]], None]) -> dict[str, Tensor]:
        """One batch's forward and backward; ``rest`` are the step's other arguments as Lightning
        passed them (``batch_idx`` if it takes one); ``run`` wraps the schedule (the engine's no_sync)."""
        runner = self.runner
        size = batch_size_of(batch)
        microbatches = runner.microbatches_for(size, train=True)
        pieces = split_batch(batch, microbatches, size) if runner.is_last else []
        recorder = LogRecorder()
        losses: list[Tensor] = []
        failures: list[BaseException] = []

        def loss_fn(output: Any, index: int) -> Tensor:
            # An error in the user's step must not leave the other stages waiting for gradients
            # that never come: the schedule finishes with a zero loss, and every rank raises after.
            if failures:
                return _zero_loss(output)
            try:
                with forward_returns(module, output, "training_step"), recorder.capturing(module), \
                        without_collectives(module, "training_step"):
                    loss = _loss_of(module.training_step(pieces[index], *rest), module)
                if not loss.requires_grad:
                    raise PipelineError(
                        f"{type(module).__name__}.training_step returned a loss that does not require grad (computed"
                        " under no_grad, or detached from self(...)'s output): the stages' backward starts from it."
                    )
            except Exception as error:  # noqa: BLE001 - re-raised on every rank below
                failures.append(error)
                return _zero_loss(output)
            losses.append(loss.detach())
            return loss * (loss_multiplier / microbatches)

        inputs = self._inputs(module, batch)
        run(lambda: runner.train_step(inputs, size, loss_fn))
        mean = torch.stack(losses).float().mean().item() if losses else 0.0
        mean, logged = self._from_last_stage(mean, recorder, failures, "training_step")
        self._log(module, logged)
        return {"loss": torch.tensor(mean, device=runner.device)}

    def eval_step(self, module: pl.LightningModule, hook: str, batch: Any, *rest: Any) -> Any:
        """Validation/test/predict: the pipeline forward only, then the user's step on the last stage."""
        runner = self.runner
        if runner.config.schedule == "zbv_zero_bubble":
            # every rank alike, before any stage runs
            raise PipelineError(
                f"{hook} under PipelineConfig(schedule='zbv_zero_bubble'): torch has no forward-only schedule for the"
                " V placement of stages (its ZBV schedule always runs backward actions). Use"
                " schedule='interleaved_zero_bubble' (zero bubble too, with looped stages), or skip evaluation"
                " (limit_val_batches=0, num_sanity_val_steps=0)."
            )
        output = runner.eval_step(self._inputs(module, batch), batch_size_of(batch))
        recorder = LogRecorder()
        result = None
        failures: list[BaseException] = []
        if runner.is_last:
            try:
                with forward_returns(module, output, hook), recorder.capturing(module), without_collectives(module, hook):
                    result = getattr(module, hook)(batch, *rest)
            except Exception as error:  # noqa: BLE001 - re-raised on every rank below
                failures.append(error)
        _, logged = self._from_last_stage(0.0, recorder, failures, hook)
        self._log(module, logged)
        return result

    def _from_last_stage(self, loss: float, recorder: LogRecorder, failures: list[BaseException],
                         hook: str) -> tuple[float, dict[str, Any]]:
        """The last stage's loss and logged values, on every rank of the pipeline; an error the
        user's step raised there is raised on every rank."""
        runner = self.runner
        error = f"{type(failures[0]).__name__}: {failures[0]}" if failures else None
        payload = [(loss, {} if failures else recorder.reduced(), error) if runner.is_last else None]
        source = dist.get_global_rank(runner.group, runner.last_stage_rank)
        dist.broadcast_object_list(payload, src=source, group=runner.group)
        loss, logged, error = payload[0]
        if failures:
            raise failures[0]
        if error is not None:
            raise PipelineError(f"{hook} failed on the last pipeline stage (global rank {source}): {error}")
        return loss, logged

    @staticmethod
    def _log(module: pl.LightningModule, logged: dict[str, tuple[float, dict[str, Any]]]) -> None:
        for name, (value, kwargs) in logged.items():
            module.log(name, torch.tensor(value), **kwargs)


__all__ = ["LogRecorder", "PipelineSteps", "forward_returns"]
