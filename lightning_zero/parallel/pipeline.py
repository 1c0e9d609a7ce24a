"""Pipeline stages and schedules from ``torch.distributed.pipelining``, under ZeRO.

[Note: pipeline stages]
The model hands over its layers in order (``pipeline_layers()``: e.g. the embedding, each block,
the head), such that running them one after the other is its forward. A layer is a registered
submodule, or a small wrapper over registered ones (token + position embedding), named after them. They are split into
``size * stages_per_rank`` contiguous stages (at ``split_points``, or by parameter count), and
every rank keeps only the layers of its own stages: the others are replaced by ``nn.Identity`` in
the module, so parameter names (and checkpoint keys) stay those of the whole model, and the ZeRO
engine, the optimizers and checkpoints see just this rank's part. A stage runs as a torch
``PipelineStage`` over a :class:`StageModule` that calls its layers in order; the schedule (1F1B,
interleaved, zero bubble) is torch's too.

Which rank runs stage ``s``: rank ``s % size`` (looped, for gpipe/1f1b/interleaved), or for the V
of ``zbv_zero_bubble`` rank ``s`` on the way down and ``2 * size - 1 - s`` on the way back.

Gradients: every micro-batch's backward accumulates locally, in the engine's buckets (the engine
is in ``no_sync`` for the whole schedule), and the step's ``finish_grad_sync`` reduces each bucket
once over the stage's data-parallel ranks: one reduction per optimizer step, not per micro-batch.
Zero-bubble schedules compute weight gradients with ``torch.autograd.grad`` and add them to
``.grad`` themselves, which no gradient hook sees: the engine takes them in after the schedule
(:meth:`~lightning_zero.zero.flat.FlatEngine.absorb_param_grads`).

The loss: the last stage's schedule calls ``loss_fn(output, target)`` per micro-batch; the
target here is the micro-batch's sample indices, from which the caller finds the micro-batch it
belongs to and computes the loss from the output (the Lightning edge runs the user's
``training_step`` there, see strategy.py). Before the first step torch infers the shapes that
pass between stages by running each stage on empty tensors, and the last one calls ``loss_fn``
too: that call gets :func:`_inference_loss`, so no user code sees uninitialized values.
"""

from __future__ import annotations

import difflib
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage

from lightning_zero.config import PipelineConfig

# PipelineConfig.schedule -> the torch.distributed.pipelining class, looked up when a pipeline is
# built: an older torch without one of them still imports lightning_zero.
SCHEDULE_CLASSES: dict[str, str] = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv_zero_bubble": "ScheduleZBVZeroBubble",
}
_SINGLE_STAGE = ("gpipe", "1f1b")


def schedule_class(name: str) -> type:
    import torch.distributed.pipelining as pipelining

    found = getattr(pipelining, SCHEDULE_CLASSES[name], None)
    if found is None:
        raise PipelineError(
            f"PipelineConfig.schedule={name!r} needs torch.distributed.pipelining.{SCHEDULE_CLASSES[name]}, which torch"
            f" {torch.__version__} does not have; upgrade torch or choose another schedule."
        )
    return found


class PipelineError(ValueError):
    """A model, split or batch that the pipeline cannot run; raised before any stage runs."""


# ------------------------------------------------------------------------------------ the split
def pipeline_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The module's layers in order, with their names in ``module`` (see [Note: pipeline stages])."""
    declare = getattr(module, "pipeline_layers", None)
    if not callable(declare):
        raise PipelineError(
            f"{type(module).__name__} has no pipeline_layers(): under pipeline parallelism the module must list its"
            " layers in order, such that calling them one after the other is its forward, e.g."
            " `def pipeline_layers(self): return [self.embed, *self.blocks, self.head]`."
        )
    layers = list(declare())
    names = {}
    for name, submodule in module.named_modules():
        names.setdefault(id(submodule), name)
    named: list[tuple[str, nn.Module]] = []
    for index, layer in enumerate(layers):
        if isinstance(layer, (nn.ModuleList, nn.Sequential)) and not isinstance(layer, nn.Sequential):
            raise PipelineError(
                f"{type(module).__name__}.pipeline_layers()[{index}] is an nn.ModuleList: list its layers one by one"
                " (e.g. `*self.blocks`)."
            )
        name = names.get(id(layer)) if isinstance(layer, nn.Module) else None
        if not name and isinstance(layer, nn.Module):
            # A wrapper made for the pipeline (e.g. token + position embedding) over registered
            # modules: named by them, and those are what a rank without it drops.
            parts = _registered_parts(layer, names)
            name = "+".join(parts) if parts else None
        if not name:
            raise PipelineError(
                f"{type(module).__name__}.pipeline_layers()[{index}] ({type(layer).__name__}) is not a submodule of"
                " the module: each layer must be registered on it (an attribute or an entry of an nn.ModuleList),"
                " or wrap modules that are, so that its parameters keep their names."
            )
        named.append((name, layer))
    if len({name for name, _ in named}) != len(named):
        raise PipelineError(f"{type(module).__name__}.pipeline_layers() lists a layer twice.")
    return named


def _registered_parts(layer: nn.Module, names: dict[int, str]) -> list[str]:
    """The names of an unregistered wrapper's children that are registered in the module; []
    unless every parameter of the wrapper lies in them."""
    parts = [(names[id(child)], child) for child in layer.children() if id(child) in names]
    inside = {param for _, child in parts for param in child.parameters()}
    return [name for name, _ in parts] if parts and all(p in inside for p in layer.parameters()) else []


def _numel(layer: nn.Module) -> int:
    return sum(p.numel() for p in layer.parameters())


def split_layers(layers: Sequence[tuple[str, nn.Module]], config: PipelineConfig) -> list[list[tuple[str, nn.Module]]]:
    """The layers of each stage, in stage order: at ``config.split_points``, or contiguous
    stages of about equal parameter counts. A PipelineError names a split that cannot work."""
    stages = config.num_stages
    names = [name for name, _ in layers]
    if stages > len(layers):
        raise PipelineError(
            f"PipelineConfig asks for {stages} stages (size={config.size} x stages_per_rank={config.stages_per_rank})"
            f" but the model has only {len(layers)} pipeline layers ({', '.join(names)}): every stage needs at"
            f" least one. Use at most {len(layers)} stages."
        )
    if config.split_points is not None:
        starts = []
        for point in config.split_points:
            if point not in names:
                close = difflib.get_close_matches(point, names, n=3)
                hint = f" Did you mean {', '.join(map(repr, close))}?" if close else f" The layers are {names}."
                raise PipelineError(f"PipelineConfig.split_points names {point!r}, which is not a pipeline layer.{hint}")
            starts.append(names.index(point))
        bounds = [0, *starts, len(layers)]
        for stage, (begin, end) in enumerate(zip(bounds, bounds[1:])):
            if end <= begin:
                raise PipelineError(
                    f"PipelineConfig.split_points={list(config.split_points)} leaves stage {stage} empty: the split"
                    " points must be distinct layers in model order, after the first layer."
                )
        return [list(layers[begin:end]) for begin, end in zip(bounds, bounds[1:])]
    return [list(layers[begin:end]) for begin, end in _balanced_bounds([_numel(m) for _, m in layers], stages)]


def _balanced_bounds(sizes: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """Contiguous ``parts`` of ``sizes``, none empty, minimizing the largest part's sum (exact,
    by dynamic programming over the split points; models have at most a few hundred layers)."""
    count = len(sizes)
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    inf = float("inf")
    # best[k][i]: the smallest possible largest part when the first i layers make k parts
    best = [[inf] * (count + 1) for _ in range(parts + 1)]
    cut = [[0] * (count + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, count - (parts - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds = []
    end = count
    for k in range(parts, 0, -1):
        begin = cut[k][end]
        bounds.append((begin, end))
        end = begin
    return bounds[::-1]


def stage_indices(rank: int, config: PipelineConfig) -> list[int]:
    """The stages pipeline rank ``rank`` runs, in order (see [Note: pipeline stages])."""
    if config.schedule == "zbv_zero_bubble":
        return [rank, 2 * config.size - 1 - rank]
    return [rank + k * config.size for k in range(config.stages_per_rank)]


class StageModule(nn.Module):
    """One stage: its layers, called in order (a layer's tuple output is the next one's arguments).

    ``own_outputs``: outputs that are views are copied, because torch's zero-bubble input backward
    detaches a stage's outputs in place, which a view does not allow."""

    def __init__(self, layers: Sequence[nn.Module], own_outputs: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.own_outputs = own_outputs

    def forward(self, *args: Any) -> Any:
        value: Any = args
        for layer in self.layers:
            value = layer(*value) if isinstance(value, tuple) else layer(value)
        if isinstance(value, Mapping):
            # torch's stage fails on it with its own metadata error, on this rank only: name the fix.
            raise PipelineError(
                f"The pipeline stage ending at layer {type(self.layers[-1]).__name__} returned a"
                f" {type(value).__name__}: torch.distributed.pipelining passes only tensors and tuples of tensors"
                " between stages and to the loss. Return a tuple (e.g. `return out['y'], out['h']`; a Hugging Face"
                " model takes return_dict=False)."
            )
        if self.own_outputs:
            if isinstance(value, Tensor) and value._is_view():
                return value.clone()
            if isinstance(value, tuple):
                return tuple(v.clone() if isinstance(v, Tensor) and v._is_view() else v for v in value)
        return value


def _replace(module: nn.Module, name: str, replacement: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = module.get_submodule(parent_name) if parent_name else module
    parent._modules[child] = replacement  # works for attributes and ModuleList/Sequential entries alike


def check_parameters_in_one_stage(module: nn.Module, stages: Sequence[Sequence[tuple[str, nn.Module]]]) -> None:
    """Every parameter belongs to exactly one stage: tied weights across stages, or parameters
    outside every layer, would need a reduction between stages that the pipeline does not do."""
    stage_of: dict[nn.Parameter, int] = {}
    for index, layers in enumerate(stages):
        for layer_name, layer in layers:
            for param_name, param in layer.named_parameters():
                previous = stage_of.setdefault(param, index)
                if previous != index:
                    raise PipelineError(
                        f"Parameter {layer_name}.{param_name} is used by stage {previous} and stage {index} (tied"
                        " weights, e.g. an embedding shared with the output head): pipeline stages hold disjoint"
                        " parameters. Untie them (give the head its own weight), or choose split_points that keep"
                        " both layers in one stage."
                    )
    for index, layers in enumerate(stages):
        if not any(param.requires_grad for _, layer in layers for param in layer.parameters()):
            raise PipelineError(
                f"Pipeline stage {index} ({', '.join(name for name, _ in layers)}) has no trainable parameter: its"
                " ranks would have nothing to optimize. Choose split_points that give every stage a layer with"
                " parameters, or fewer stages."
            )
    outside = [name for name, param in module.named_parameters() if param not in stage_of]
    if outside:
        raise PipelineError(
            f"Parameters {outside[:5]} belong to no layer of pipeline_layers(): under pipeline parallelism every"
            " parameter must live in one of the layers, or it would be trained on no stage. Move them into a"
            " layer, or list the module that holds them in pipeline_layers()."
        )


# ------------------------------------------------------------------------------------ batches
def default_pipeline_input(batch: Any) -> Any:
    """What the first stage takes from a batch: the batch itself (a tensor), its first element
    (a tuple or list, as ``x, y = batch``), or ``batch["input_ids"]``."""
    if isinstance(batch, Tensor):
        return batch
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], Tensor):
        return batch[0]
    if isinstance(batch, dict) and isinstance(batch.get("input_ids"), Tensor):
        return batch["input_ids"]
    raise PipelineError(
        f"Cannot tell the first stage's input in a batch of type {type(batch).__name__}: define"
        " `pipeline_input(self, batch)` on the LightningModule to return the tensor(s) the first layer takes."
    )


def batch_size_of(batch: Any) -> int:
    for value in _tensors(batch):
        if value.dim() > 0:
            return value.shape[0]
    raise PipelineError(f"The batch ({type(batch).__name__}) holds no tensor with a batch dimension to split.")


def _tensors(batch: Any) -> Iterator[Tensor]:
    if isinstance(batch, Tensor):
        yield batch
    elif isinstance(batch, (tuple, list)):
        for value in batch:
            yield from _tensors(value)
    elif isinstance(batch, dict):
        for value in batch.values():
            yield from _tensors(value)


def split_batch(batch: Any, parts: int, size: int) -> list[Any]:
    """``batch`` in ``parts`` micro-batches: tensors with ``size`` rows are split along dim 0, the
    rest (scalars, strings, other shapes) is given to every micro-batch as it is."""
    if isinstance(batch, Tensor) and batch.dim() > 0 and batch.shape[0] == size:
        return list(batch.tensor_split(parts))
    if isinstance(batch, (tuple, list)):
        columns = [split_batch(value, parts, size) for value in batch]
        rows = [list(row) for row in zip(*columns)] if columns else [[] for _ in range(parts)]
        if isinstance(batch, tuple):
            return [type(batch)(*row) if hasattr(batch, "_fields") else tuple(row) for row in rows]
        return rows
    if isinstance(batch, dict):
        split = {key: split_batch(value, parts, size) for key, value in batch.items()}
        return [type(batch)({key: split[key][i] for key in batch}) if type(batch) is not dict
                else {key: split[key][i] for key in batch} for i in range(parts)]
    return [batch] * parts


def check_microbatches(batch_size: int, microbatches: int, where: str,
                       accepts: Callable[[int], bool] = lambda count: True) -> None:
    """Raises unless ``microbatches`` divides ``batch_size``, naming the counts that would
    (those the schedule ``accepts``)."""
    if batch_size % microbatches:
        divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0 and accepts(d)]
        counts = f"Use microbatches in {divisors}, or" if divisors else (
            "No count the schedule accepts divides it (1f1b needs at least as many micro-batches as stages;"
            " schedule='gpipe' takes any): use")
        raise PipelineError(
            f"PipelineConfig.microbatches={microbatches} does not divide the {where} batch size {batch_size}:"
            f" micro-batches must be equal. {counts} a batch size that is a multiple of {microbatches} (with"
            " drop_last=True if the last batch is smaller)."
        )


def _inference_loss(output: Any) -> Tensor:
    """The loss torch's shape inference backpropagates before the first step: it only needs
    gradients of the output's shape (see [Note: pipeline stages])."""
    tensors = [t for t in _tensors(output) if t.is_floating_point()]
    return sum((t.sum() * 0.0 for t in tensors), torch.zeros(()))


# ------------------------------------------------------------------------------------ running
@dataclass
class ActionTiming:
    """The compute actions a rank ran in its last schedule step, timed (for the bubble)."""

    start: float = 0.0
    end: float = 0.0
    actions: list[tuple[str, float, float]] = field(default_factory=list)

    @property
    def busy(self) -> float:
        return sum(end - begin for _, begin, end in self.actions)

    @property
    def idle_fraction(self) -> float:
        """The share of the step's wall time this rank computed nothing."""
        wall = self.end - self.start
        return 1.0 - self.busy / wall if wall > 0 else 0.0


class _TimedStage(PipelineStage):
    """torch's PipelineStage, timing its compute actions and telling its runner when torch's
    shape inference calls the loss."""

    runner: PipelineRunner

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with self.runner._timed("F"):
            return super().forward_one_chunk(*args, **kwargs)

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        full = kwargs.get("full_backward", args[2] if len(args) > 2 else True)
        with self.runner._timed("B" if full else "I"):
            return super().backward_one_chunk(*args, **kwargs)

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with self.runner._timed("W"):
            return super().backward_weight_one_chunk(*args, **kwargs)

    def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> Any:
        self.runner.inferring = True
        try:
            return super()._prepare_backward_infra(*args, **kwargs)
        finally:
            self.runner.inferring = False


LossFn = Callable[[Any, int], Tensor]  # (last stage's output of a micro-batch, its index) -> loss to backward


class PipelineRunner:
    """This rank's stages of one pipeline and the schedules that run them.

    Args:
        stages: the layers of every stage of the model, in stage order (:func:`split_layers`).
        config: the pipeline's settings.
        group: the ranks of this pipeline, one per stage (``ParallelGroups.pipeline_group``).
        device: where the stages compute.
    """

    def __init__(self, stages: dict[int, Sequence[tuple[str, nn.Module]]], config: PipelineConfig,
                 group: dist.ProcessGroup, device: torch.device) -> None:
        self.config = config
        self.group = group
        self.device = device
        self.rank = dist.get_rank(group)
        self.indices = stage_indices(self.rank, config)
        if sorted(stages) != sorted(self.indices):
            raise PipelineError(f"Pipeline rank {self.rank} runs stages {self.indices} but was given {sorted(stages)}.")
        self.stages = {index: list(stages[index]) for index in self.indices}
        zero_bubble = "zero_bubble" in config.schedule
        self.modules = [StageModule([layer for _, layer in stages[index]],
                                    own_outputs=zero_bubble and index != config.num_stages - 1)
                        for index in self.indices]
        self.key_order: tuple[str, ...] = ()  # the whole model's state-dict keys, in its order (build_pipeline)
        self.layer_names = {name for index in self.indices for name, _ in stages[index]}
        self.is_first = 0 in self.indices
        self.is_last = config.num_stages - 1 in self.indices
        self.inferring = False
        self.timing = ActionTiming()
        self._record = False
        self._built: dict[tuple[Any, ...], tuple[list[_TimedStage], Any]] = {}
        self._loss_fn: LossFn | None = None
        self._microbatch_size = 1
        self._largest_training_batch = 0  # so far: a batch shorter than it is a short last batch

    # ---------------------------------------------------------------- schedules
    def microbatches_for(self, batch_size: int, train: bool) -> int:
        """How many micro-batches a batch of ``batch_size`` runs as: the configured count, or for a
        batch it does not divide that is shorter than one seen before (a short last batch), or any
        evaluation batch, the largest smaller count that divides it and that the schedule accepts.
        A full training batch the count does not divide is a PipelineError naming the counts that
        would (running every batch with another count than the one configured would change the
        pipeline without a word). Every rank of a pipeline reads the same batch, so they agree."""
        wanted = self.config.num_microbatches
        where = "training" if train else "evaluation"
        largest = self._largest_training_batch
        if train:
            self._largest_training_batch = max(largest, batch_size)
        if batch_size % wanted == 0 and self._accepts(wanted, train):
            return wanted
        # Evaluation runs forward only, so another count changes no result: a batch the count does
        # not divide runs as the largest that does, even the first (a validation set smaller than
        # one batch). Training refuses a full batch the count does not divide.
        if train and batch_size >= largest:
            check_microbatches(batch_size, wanted, where, lambda count: self._accepts(count, train))
        for count in range(min(wanted, batch_size), 0, -1):
            if batch_size % count == 0 and self._accepts(count, train):
                return count
        check_microbatches(batch_size, wanted, where)
        raise PipelineError(
            f"No micro-batch count up to {wanted} splits the {'training' if train else 'evaluation'} batch of"
            f" {batch_size} into equal parts that schedule {self.config.schedule!r} accepts (1f1b needs at least"
            f" {self.config.num_stages}). Use a batch size that is a multiple of {wanted}, or drop_last=True."
        )

    def _accepts(self, count: int, train: bool) -> bool:
        schedule = self._schedule_name(train)
        if schedule == "1f1b":
            return count >= self.config.num_stages
        if schedule.startswith("interleaved"):
            return count % max(1, count // self.config.size) == 0
        return True

    def _schedule_name(self, train: bool) -> str:
        # Forward only, one stage per rank: GPipe, which takes any micro-batch count (1F1B needs
        # one per stage) and runs the same forwards.
        if not train and self.config.schedule in _SINGLE_STAGE:
            return "gpipe"
        return self.config.schedule

    def _schedule(self, key: tuple[Any, ...], microbatches: int, train: bool) -> tuple[list[_TimedStage], Any]:
        """The stages and schedule for micro-batches of this shape (torch fixes the shapes that
        pass between stages at the first step: a new shape gets new stages)."""
        built = self._built.get((key, microbatches, train))
        if built is not None:
            return built
        stages = []
        for module, index in zip(self.modules, self.indices):
            stage = _TimedStage(module, index, self.config.num_stages, self.device, group=self.group)
            stage.runner = self
            stages.append(stage)
        schedule_cls = schedule_class(self._schedule_name(train))
        loss_fn = self._schedule_loss if train else None
        try:
            if self.config.schedule in _SINGLE_STAGE:
                schedule = schedule_cls(stages[0], microbatches, loss_fn=loss_fn, scale_grads=False)
            else:
                schedule = schedule_cls(stages, microbatches, loss_fn=loss_fn, scale_grads=False)
        except (ValueError, AssertionError) as error:
            raise PipelineError(
                f"torch's {schedule_cls.__name__} refuses PipelineConfig(size={self.config.size},"
                f" microbatches={microbatches}, stages_per_rank={self.config.stages_per_rank}): {error}"
            ) from error
        self._built[(key, microbatches, train)] = (stages, schedule)
        return stages, schedule

    @property
    def last_stage_rank(self) -> int:
        """The pipeline-group rank that runs the last stage (which computes the loss)."""
        last = self.config.num_stages - 1
        return next(rank for rank in range(self.config.size) if last in stage_indices(rank, self.config))

    def _schedule_loss(self, output: Any, target: Tensor) -> Tensor:
        if self.inferring or self._loss_fn is None:
            return _inference_loss(output)
        index = int(target.reshape(-1)[0]) // self._microbatch_size
        with self._timed("L"):  # the last stage's loss (the user's step) is compute too
            return self._loss_fn(output, index)

    # ---------------------------------------------------------------- steps
    def train_step(self, inputs: Any, batch_size: int, loss_fn: LossFn) -> None:
        """Forward and backward of one batch through every micro-batch (a collective over the
        pipeline group): ``inputs`` is the first stage's input, given on every rank (the others
        only read its shapes: a new shape makes every rank build new stages together), and
        ``loss_fn`` runs on the last stage, once per micro-batch (``microbatches_for`` of them),
        in micro-batch order."""
        microbatches = self.microbatches_for(batch_size, train=True)
        _, schedule = self._schedule(_shape_key(inputs, batch_size), microbatches, train=True)
        self._loss_fn = loss_fn
        self._microbatch_size = batch_size // microbatches
        args = _as_args(inputs) if self.is_first else ()
        target = torch.arange(batch_size, device=self.device) if self.is_last else None
        self._begin_timing()
        try:
            schedule.step(*args, target=target, return_outputs=False)
        finally:
            self._loss_fn = None
            self.timing.end = time.perf_counter()

    def eval_step(self, inputs: Any, batch_size: int) -> Any:
        """Forward only (``inputs`` as for :meth:`train_step`); the last stage's output for the
        whole batch on the last stage, None elsewhere."""
        microbatches = self.microbatches_for(batch_size, train=False)
        _, schedule = self._schedule(_shape_key(inputs, batch_size), microbatches, train=False)
        args = _as_args(inputs) if self.is_first else ()
        self._begin_timing()
        try:
            with torch.no_grad():
                return schedule.step(*args)
        finally:
            self.timing.end = time.perf_counter()

    # ---------------------------------------------------------------- timing
    def record_actions(self, enabled: bool = True) -> None:
        """Time every compute action of the following steps (see :class:`ActionTiming`)."""
        self._record = enabled

    def _begin_timing(self) -> None:
        self.timing = ActionTiming(start=time.perf_counter())

    def _timed(self, kind: str) -> Any:
        return _ActionTimer(self, kind)


class _ActionTimer:
    def __init__(self, runner: PipelineRunner, kind: str) -> None:
        self.runner, self.kind, self.begin = runner, kind, 0.0

    def __enter__(self) -> None:
        self.begin = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        if self.runner._record and not self.runner.inferring:
            self.runner.timing.actions.append((self.kind, self.begin, time.perf_counter()))


def _as_args(inputs: Any) -> tuple[Any, ...]:
    return tuple(inputs) if isinstance(inputs, tuple) else (inputs,)


def _shape_key(inputs: Any, batch_size: int) -> tuple[Any, ...]:
    # Only the first stage has the inputs; every rank knows the batch size (the same batch).
    return (batch_size, *((tuple(t.shape), t.dtype) for t in _tensors(inputs)))


# Modules split by an earlier run, with the split: their other layers are gone, so a new split
# (another fit, validate) must reuse this one.
_SPLIT: weakref.WeakKeyDictionary[
    nn.Module, tuple[PipelineConfig, int, dict[int, list[tuple[str, nn.Module]]], tuple[str, ...]]
] = weakref.WeakKeyDictionary()


def build_pipeline(module: nn.Module, config: PipelineConfig, group: dist.ProcessGroup,
                   device: torch.device) -> PipelineRunner:
    """Splits ``module`` into stages, keeps this rank's layers in it (the others become
    ``nn.Identity``, see [Note: pipeline stages]) and returns the runner of its stages. Every
    check runs before the module changes, so a PipelineError leaves it whole. A module split by
    an earlier run keeps that split."""
    rank = dist.get_rank(group)
    previous = _SPLIT.get(module)
    if previous is not None:
        old_config, old_rank, mine, key_order = previous
        if old_config != config or old_rank != rank:
            raise PipelineError(
                f"This {type(module).__name__} was split for {old_config} (as pipeline rank {old_rank}) by an earlier"
                f" run and holds only that rank's layers; it cannot run as {config} (pipeline rank {rank}). Build a"
                " new module (and load a checkpoint into it) for another pipeline layout."
            )
        runner = PipelineRunner(mine, config, group, device)
        runner.key_order = key_order
        return runner
    layers = pipeline_layers(module)
    stages = split_layers(layers, config)
    check_parameters_in_one_stage(module, stages)
    mine = {index: stages[index] for index in stage_indices(rank, config)}
    runner = PipelineRunner(mine, config, group, device)
    # Before the split: checkpoints list keys and parameters in the whole model's order.
    runner.key_order = tuple(module.state_dict(keep_vars=True))
    for name, _ in layers:
        if name not in runner.layer_names:
            for part in name.split("+"):  # a wrapper's registered modules (see pipeline_layers)
                _replace(module, part, nn.Identity())
    _SPLIT[module] = (config, rank, mine, runner.key_order)
    return runner


def is_split(module: nn.Module) -> bool:
    """Whether an earlier run split ``module`` into pipeline stages (it holds one rank's layers)."""
    return module in _SPLIT


__all__ = [
    "ActionTiming",
    "PipelineError",
    "PipelineRunner",
    "SCHEDULE_CLASSES",
    "schedule_class",
    "StageModule",
    "build_pipeline",
    "is_split",
    "check_microbatches",
    "default_pipeline_input",
    "pipeline_layers",
    "split_batch",
    "split_layers",
    "stage_indices",
]
