"""Typed, frozen configuration for ZeRO that validates itself at construction.

A bad value raises ``ValueError`` naming the field, the value and what would work, so that a
YAML typo fails before any process is started rather than deep inside a training step.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from lightning_zero.offload import CPUOffloadPolicy

SUPPORTED_STAGES = (1, 2, 3)
REST = -1  # a ParallelConfig size that takes whatever the other sizes leave of the world
REDUCE_DTYPES = ("fp32", "bf16", "fp16")
# ZeroConfig.fused_adam: "auto", "off", or a backend of lightning_zero.ops.fused_adam.BACKENDS (a test keeps
# the two in step; config.py stays free of the ops).
FUSED_ADAM_CHOICES = ("auto", "off", "cuda", "triton", "cpu", "torch", "host")
# PipelineConfig.schedule names -> torch.distributed.pipelining schedule classes (parallel/pipeline.py)
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble")
# Schedules that run one stage per rank; the others take several (interleaved, V-shaped).
SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class ParallelConfig:
    """How the ranks are laid out on one :class:`~torch.distributed.device_mesh.DeviceMesh`
    (see [Note: one mesh] in lightning_zero/parallel/mesh.py).

    Attributes:
        data: data-parallel ranks: ZeRO shards over them and the data is split between them.
            ``-1`` (the default) takes the rest of the world: ``world_size // tensor``.
        tensor: tensor-parallel ranks: the model's blocks are split between them by a plan applied
            in ``configure_model`` (``lightning_zero.parallel.parallelize_gpt`` and friends). They
            are the fastest-varying (adjacent) ranks, so they stay inside one node.
        shard_size: hybrid sharding: ZeRO shards within groups of this many data-parallel ranks
            (one node's worth) and replicates across the groups, whose gradients are all-reduced,
            as FSDP's HYBRID_SHARD and DeepSpeed's MiCS do. ``None`` (the default) shards over every
            data-parallel rank; ``-1`` takes the data-parallel ranks of one node.
    """

    data: int = REST
    tensor: int = 1
    shard_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("data", "tensor"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or (value < 1 and value != REST):
                raise ValueError(
                    f"ParallelConfig.{name}={value!r} must be a positive number of ranks, or -1 for the rest of the"
                    " world."
                )
        if self.data == REST and self.tensor == REST:
            raise ValueError("ParallelConfig: only one of data and tensor may be -1 (the rest of the world).")
        if self.shard_size is not None and (
            not isinstance(self.shard_size, int) or isinstance(self.shard_size, bool)
            or (self.shard_size < 1 and self.shard_size != REST)
        ):
            raise ValueError(
                f"ParallelConfig.shard_size={self.shard_size!r} must be a positive number of data-parallel ranks"
                " (e.g. the processes of one node), -1 for one node's worth, or None to shard over all of them."
            )

    @property
    def is_trivial(self) -> bool:
        """Plain ZeRO over every rank: no tensor parallelism and no hybrid sharding."""
        return self.tensor == 1 and self.data == REST and self.shard_size is None


@dataclass(frozen=True)
class PipelineConfig:
    """Pipeline parallelism with ``torch.distributed.pipelining`` (see [Note: pipeline stages] in
    lightning_zero/parallel/pipeline.py).

    Attributes:
        size: pipeline ranks: the model's layers are split into ``size * stages_per_rank`` stages,
            each rank runs its own, and activations pass between neighbours. ZeRO shards each
            stage over its data-parallel ranks. 1 (the default) turns pipelining off.
        schedule: ``"gpipe"``, ``"1f1b"`` (the default), ``"interleaved_1f1b"``,
            ``"interleaved_zero_bubble"`` or ``"zbv_zero_bubble"`` (torch's ScheduleGPipe,
            Schedule1F1B, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble).
        microbatches: how many micro-batches each batch is split into (it must divide the batch
            size). More micro-batches mean a smaller bubble, (size - 1) / (microbatches + size - 1)
            of each step for 1F1B. ``None`` takes ``size * stages_per_rank``.
        stages_per_rank: stages each rank runs: 1 for gpipe/1f1b, 2 or more for the interleaved
            schedules (the zero-bubble V schedule needs exactly 2).
        split_points: names of the layers (as in ``named_modules()``, e.g. ``"blocks.4"``) that each
            start a new stage; ``len(split_points) + 1`` must be the number of stages. ``None``
            (the default) splits the module's ``pipeline_layers()`` into stages of about equal
            parameter counts.
    """

    size: int = 1
    schedule: str = "1f1b"
    microbatches: int | None = None
    stages_per_rank: int = 1
    split_points: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("size", "stages_per_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PipelineConfig.{name}={value!r} must be a positive integer.")
        if self.microbatches is not None and (
            not isinstance(self.microbatches, int) or isinstance(self.microbatches, bool) or self.microbatches < 1
        ):
            raise ValueError(
                f"PipelineConfig.microbatches={self.microbatches!r} must be a positive integer that divides the batch"
                " size, or None for size * stages_per_rank."
            )
        if self.schedule not in PIPELINE_SCHEDULES:
            raise ValueError(
                f"PipelineConfig.schedule={self.schedule!r} is not a schedule we know: use one of"
                f" {', '.join(map(repr, PIPELINE_SCHEDULES))}."
            )
        if self.schedule in SINGLE_STAGE_SCHEDULES and self.stages_per_rank != 1:
            raise ValueError(
                f"PipelineConfig.schedule={self.schedule!r} runs one stage per rank, but stages_per_rank="
                f"{self.stages_per_rank}; use schedule='interleaved_1f1b' (or another interleaved schedule), or"
                " stages_per_rank=1."
            )
        if self.schedule == "zbv_zero_bubble" and self.stages_per_rank != 2:
            raise ValueError(
                f"PipelineConfig.schedule='zbv_zero_bubble' places exactly 2 stages on each rank (a V), but"
                f" stages_per_rank={self.stages_per_rank}; set stages_per_rank=2."
            )
        if self.schedule == "1f1b" and self.num_microbatches < self.num_stages:
            raise ValueError(
                f"PipelineConfig(schedule='1f1b', microbatches={self.num_microbatches}) needs at least one micro-batch"
                f" per stage ({self.num_stages}): set microbatches >= {self.num_stages}, or use schedule='gpipe'."
            )
        if self.schedule.startswith("interleaved"):
            rounds = max(1, self.num_microbatches // self.size)
            if self.num_microbatches % rounds:
                raise ValueError(
                    f"PipelineConfig(schedule={self.schedule!r}, microbatches={self.num_microbatches}, size={self.size}):"
                    f" the interleaved schedules run the micro-batches in rounds of {self.size}; use a multiple of"
                    f" {self.size} (e.g. {self.size * max(1, rounds)})."
                )
        if self.split_points is not None:
            points = (self.split_points,) if isinstance(self.split_points, str) else self.split_points
            if not isinstance(points, (tuple, list)) or not all(isinstance(p, str) and p for p in points):
                raise ValueError(
                    f"PipelineConfig.split_points={self.split_points!r} must be module names, e.g. ('blocks.2',)."
                )
            if len(points) != self.num_stages - 1:
                raise ValueError(
                    f"PipelineConfig.split_points={list(points)} gives {len(points) + 1} stages, but size={self.size}"
                    f" x stages_per_rank={self.stages_per_rank} = {self.num_stages}; give {self.num_stages - 1}"
                    " split point(s), or None to split by parameter count."
                )
            object.__setattr__(self, "split_points", tuple(points))

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @property
    def num_stages(self) -> int:
        return self.size * self.stages_per_rank

    @property
    def num_microbatches(self) -> int:
        return self.microbatches if self.microbatches is not None else self.num_stages


# [Note: bucket size]
# Without an explicit reduce_bucket_size, stages 1/2 cut an optimizer's trainable elements into
# about AUTO_BUCKET_SPLIT buckets, none smaller than AUTO_BUCKET_MIN nor larger than
# AUTO_BUCKET_MAX elements. Why these bounds:
# - Split: a bucket's reduction starts when its last gradient arrives, so the last bucket of
#   backward (what is left to reduce once backward ends) is 1/8 of the gradients instead of all of
#   them, as one fixed 25M bucket makes it for any model under 25M parameters.
# - Floor: every bucket costs one reduce-scatter and one all-gather per step, and each collective
#   has a fixed latency (about 0.6 ms on gloo here, where 16K elements cost what 4K do: see
#   benchmarks/comm.py); from 1M elements (4 MB of fp32) the bytes dominate on gloo and NCCL alike.
# - Cap: the memory of the buckets in flight (2 x 25M x 4 bytes = 200 MB of fp32 gradients), the
#   fixed size before; larger models get more buckets, and with them more overlap.
# - gloo floor: on gloo (CPU ranks) buckets hold at least AUTO_BUCKET_MIN_GLOO elements. gloo's
#   threads share the cores that compute, so overlap buys little there while every collective
#   costs its latency and its threads' wake-ups (a launch can stall the rank's main thread for a
#   scheduler slice, 2-4 ms, measured in profiles). On 2 gloo ranks of this project's CPU machine,
#   demo GPT (3.2M parameters, bf16-mixed), three runs of 4-6 alternating pairs: 2 buckets (2M
#   floor) against 4 (1M) took 0.93-0.97x the step at stages 1 and 2, 0.94-1.01x with offload; one
#   bucket of 3.2M was in between, 250K-element buckets 1.02-1.05x slower. The split is for
#   accelerators, where overlap does pay.
AUTO_BUCKET_SPLIT = 8
AUTO_BUCKET_MIN = 1_000_000
AUTO_BUCKET_MIN_GLOO = 2_000_000
AUTO_BUCKET_MAX = 25_000_000


@dataclass(frozen=True)
class ZeroConfig:
    """How ZeRO shards and communicates.

    Attributes:
        stage: 1 shards the optimizer state (and the fp32 master weights) across data-parallel
            ranks; 2 also shards the gradients, which are reduce-scattered bucket by bucket
            during backward so no rank keeps the full gradient after a step's reduction.
        reduce_bucket_size: elements per gradient bucket. A bucket's reduce-scatter is launched
            as soon as every gradient in it is ready, overlapping the rest of backward; larger
            buckets mean fewer, more efficient collectives but less overlap and more memory. The
            updated parameters are all-gathered after the step in the same buckets, because each
            rank owns 1/N of every bucket. ``None`` (the default) sizes them from the model: an
            eighth of the optimizer's trainable elements, at least 1M (2M on gloo, CPU ranks) and
            at most 25M (see :meth:`bucket_size_for` and [Note: bucket size]).
        reduce_every_micro_step: with gradient accumulation, the default reduces once per
            optimizer step (no communication on non-boundary micro-steps, at the price of a full
            local gradient buffer). ``True`` reduce-scatters every micro-step into the rank's
            shard instead: more communication, but stage 2 then never holds full gradients.
        reduce_dtype: the dtype gradients are accumulated and reduced in: ``"fp32"`` (the
            default, also for fp16/bf16 training: no precision lost in the sum over ranks), or
            ``"bf16"``/``"fp16"`` to halve gradient memory and traffic.
        allow_unknown_optimizer: ZeRO steps each rank's flat shard independently, which is only
            correct for optimizers whose update is elementwise (SGD, Adam, AdamW, ...). Known
            non-elementwise optimizers are always refused; set this to ``True`` to accept an
            optimizer class we do not know, once you have checked its update is elementwise.
        unit_modules: stage 3: class names of the modules gathered as one unit each (e.g.
            ``("Block",)`` for every transformer block; one name may be given as a string).
            Empty: units are chosen by size.
        min_unit_numel: stage 3, without ``unit_modules``: a module becomes a unit once the
            parameters under it that no smaller unit took reach this many elements, so small
            modules are grouped into their parent's unit.
        param_persistence_threshold: stage 3: parameters with fewer elements stay whole on every
            rank (no gather latency for biases and norms), at the cost of their full memory.
        prefetch_units: stage 3: how many units ahead (in the order recorded on the first step)
            are gathered while the current one computes, in forward and in backward.
        prefetch_bytes: stage 3: prefetch by bytes instead: gather ahead while the units fit in
            this many bytes (0 turns prefetch off). Overrides ``prefetch_units``.
        offload_optimizer: keep the fp32 master shards and optimizer state in CPU memory (all of it,
            or ``ratio`` of it); gradients are copied there as each reduction finishes and Adam/AdamW
            steps there in one fused pass.
        offload_params: stage 3: keep the parameter shards in CPU memory too; each moves to the
            device for its gather.
        check_gather_order: stage 3: before each all-gather the ranks exchange which unit it is for
            (16 bytes, over gloo), so ranks that run different units (a rank-dependent branch) get an
            error naming them instead of a hang or an abort inside the collective. ``False`` saves
            that round trip per gather once the model's control flow is known to agree across ranks.
        parallel: how the ranks split into data- and tensor-parallel groups, and hybrid sharding
            (see :class:`ParallelConfig`); the default is plain ZeRO over every rank.
        pipeline: pipeline parallelism (see :class:`PipelineConfig`): the pipeline ranks are the
            outermost mesh dimension, data and tensor parallelism live within each stage.
        fused_adam: which kernel steps the masters that stay on the device (not offloaded) when
            the optimizer is ``torch.optim.Adam``/``AdamW``: ``"auto"`` (the default) is the
            one-pass CUDA kernel for CUDA masters (Triton's, or torch's fused AdamW plus separate
            passes, with one warning, where it cannot be built), the one-pass C++ CPU Adam for
            CPU masters (the optimizer's own step, silently, where that op cannot be built or
            ``LIGHTNING_ZERO_DISABLE_CPP_OPS=1``), and the optimizer's own step elsewhere;
            ``"off"`` is always the optimizer's own step; ``"cuda"``, ``"triton"``,
            ``"cpu"``, ``"torch"`` or ``"host"`` force that backend (see [Note: backends of the
            fused Adam op] in lightning_zero/ops/fused_adam.py). Offloaded masters always take
            the C++ CPU Adam.
        overlap_step: stages 1/2, when every master can be stepped bucket by bucket (a fused kernel
            steps it: offloaded Adam/AdamW, or ``fused_adam`` on the device; or the optimizer is one
            of torch.optim's own elementwise classes, not a subclass, with no step hooks) and
            nothing needs the whole gradient first (no fp16 loss scaler, no clipping, no
            ``on_before_optimizer_step`` hook): each bucket steps and starts its all-gather as soon
            as its reduction lands, while later reductions are still in flight. Bit-identical to
            the plain step; ``False`` waits for every reduction first (see [Note: overlapped step]
            in zero/optimizer.py).
    """

    stage: int = 2
    reduce_bucket_size: int | None = None
    reduce_every_micro_step: bool = False
    reduce_dtype: str = "fp32"
    allow_unknown_optimizer: bool = False
    unit_modules: tuple[str, ...] | str = ()  # one name as a string: made a tuple (in YAML too)
    min_unit_numel: int = 1_000_000
    param_persistence_threshold: int = 0
    prefetch_units: int = 1
    prefetch_bytes: int | None = None
    offload_optimizer: CPUOffloadPolicy | None = None
    offload_params: CPUOffloadPolicy | None = None
    check_gather_order: bool = True
    parallel: ParallelConfig = ParallelConfig()
    pipeline: PipelineConfig = PipelineConfig()
    fused_adam: str = "auto"
    overlap_step: bool = True

    def __post_init__(self) -> None:
        _check_type("stage", self.stage, int)
        if self.stage not in SUPPORTED_STAGES:
            raise ValueError(
                f"ZeroConfig.stage={self.stage!r} is not supported: use 1 (optimizer state sharded), 2"
                " (optimizer state and gradients sharded) or 3 (parameters sharded too)."
            )
        if self.reduce_bucket_size is not None:
            _check_positive("reduce_bucket_size", self.reduce_bucket_size,
                            "25_000_000 (about 100 MB of fp32 gradients per bucket), or None to size buckets from"
                            " the model")
        _check_type("reduce_every_micro_step", self.reduce_every_micro_step, bool)
        _check_type("allow_unknown_optimizer", self.allow_unknown_optimizer, bool)
        _check_type("check_gather_order", self.check_gather_order, bool)
        _check_type("overlap_step", self.overlap_step, bool)
        # YAML gives a list; one class name given as a string is that name, not its letters.
        names = (self.unit_modules,) if isinstance(self.unit_modules, str) else self.unit_modules
        if not isinstance(names, (tuple, list)) or not all(isinstance(name, str) and name for name in names):
            raise ValueError(f"ZeroConfig.unit_modules={self.unit_modules!r} must be module class names, e.g. ('Block',).")
        object.__setattr__(self, "unit_modules", tuple(names))
        _check_positive("min_unit_numel", self.min_unit_numel,
                        "1_000_000 (modules of fewer parameter elements join their parent's unit)")
        _check_type("param_persistence_threshold", self.param_persistence_threshold, int)
        if self.param_persistence_threshold < 0:
            raise ValueError(
                f"ZeroConfig.param_persistence_threshold={self.param_persistence_threshold!r} must be >= 0"
                " (0 shards every parameter)."
            )
        _check_type("prefetch_units", self.prefetch_units, int)
        if self.prefetch_units < 0:
            raise ValueError(f"ZeroConfig.prefetch_units={self.prefetch_units!r} must be >= 0 (0 turns prefetch off).")
        if self.prefetch_bytes is not None:
            _check_type("prefetch_bytes", self.prefetch_bytes, int)
            if self.prefetch_bytes < 0:
                raise ValueError(
                    f"ZeroConfig.prefetch_bytes={self.prefetch_bytes!r} must be a number of bytes >= 0, e.g."
                    " 200_000_000 (0 turns prefetch off), or None to prefetch prefetch_units units ahead."
                )
        if self.stage != 3 and (self.unit_modules or self.param_persistence_threshold):
            raise ValueError(
                f"ZeroConfig.unit_modules / param_persistence_threshold apply to stage 3 only, but stage={self.stage}."
                " Set stage=3 or drop them."
            )
        for name in ("offload_optimizer", "offload_params"):
            value = getattr(self, name)
            if isinstance(value, dict):  # YAML / LightningCLI give a mapping
                object.__setattr__(self, name, CPUOffloadPolicy(**value))
            elif value is not None and not isinstance(value, CPUOffloadPolicy):
                raise ValueError(f"ZeroConfig.{name}={value!r} must be a CPUOffloadPolicy (or None for no offload).")
        if self.offload_params is not None and self.stage != 3:
            raise ValueError(
                f"ZeroConfig.offload_params needs stage 3 (parameters are only sharded there), but stage={self.stage}."
                " Use stage=3, or offload only the optimizer with offload_optimizer."
            )
        if self.offload_params is not None and self.offload_optimizer is None:
            raise ValueError(
                "ZeroConfig.offload_params without offload_optimizer would move every shard to the device for the"
                " optimizer step; offload the optimizer too (offload_optimizer=CPUOffloadPolicy())."
            )
        _nested(self, "parallel", ParallelConfig, "ParallelConfig(tensor=2) (in YAML: parallel: {tensor: 2})")
        _nested(self, "pipeline", PipelineConfig,
                "PipelineConfig(size=2) (in YAML: pipeline: {size: 2, schedule: 1f1b, microbatches: 8})")
        if self.pipeline.enabled and self.stage == 3:
            raise ValueError(
                f"ZeroConfig(stage=3) cannot be combined with pipeline parallelism (pipeline.size={self.pipeline.size}):"
                " stage 3 gathers every layer's parameters for each forward and backward, and a pipeline runs each"
                " layer once per micro-batch, so it would all-gather every parameter 2 x microbatches times per step."
                " A pipeline stage already holds only 1/size of the model: use stage=1 or stage=2 (with"
                " offload_optimizer for the optimizer state), or stage 3 without a pipeline."
            )
        if self.fused_adam not in FUSED_ADAM_CHOICES:
            raise ValueError(
                f"ZeroConfig.fused_adam={self.fused_adam!r} is not one of {', '.join(map(repr, FUSED_ADAM_CHOICES))}:"
                " 'auto' (the fused CUDA kernel for CUDA masters), 'off' (the optimizer's own step), or a backend."
            )
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(
                f"ZeroConfig.reduce_dtype={self.reduce_dtype!r} is not one of {', '.join(map(repr, REDUCE_DTYPES))}."
            )

    def bucket_size_for(self, numel: int, backend: str | None = None) -> int:
        """Elements per gradient bucket for an optimizer over ``numel`` trainable elements, reduced
        over a process group of ``backend`` (None: not known, NCCL's rule): ``reduce_bucket_size``
        when set, else the rule of [Note: bucket size]."""
        if self.reduce_bucket_size is not None:
            return self.reduce_bucket_size
        floor = AUTO_BUCKET_MIN_GLOO if backend is not None and "gloo" in backend else AUTO_BUCKET_MIN
        return min(AUTO_BUCKET_MAX, max(floor, -(-numel // AUTO_BUCKET_SPLIT)))

    @property
    def reduce_torch_dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.reduce_dtype]

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ZeroConfig:
        """Builds a config from plain values, naming any key that is not a field."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"Unknown ZeroConfig field(s) {unknown}; valid fields are {sorted(known)}.")
        return cls(**values)


def _nested(config: ZeroConfig, name: str, cls: type, example: str) -> None:
    """A nested config field: YAML / LightningCLI give a mapping, which becomes ``cls`` (naming any
    key that is not one of its fields); anything else but a ``cls`` is refused."""
    value = getattr(config, name)
    if isinstance(value, dict):
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"Unknown ZeroConfig.{name} field(s) {unknown}; valid fields are {sorted(known)}.")
        object.__setattr__(config, name, cls(**value))
    elif not isinstance(value, cls):
        raise ValueError(f"ZeroConfig.{name}={value!r} must be a {cls.__name__}, e.g. {example}.")


def _check_type(name: str, value: Any, expected: type) -> None:
    # bool is an int subclass: a stage of True would otherwise pass as 1.
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        raise ValueError(f"ZeroConfig.{name}={value!r} must be of type {expected.__name__}.")


def _check_positive(name: str, value: Any, example: str) -> None:
    _check_type(name, value, int)
    if value <= 0:
        raise ValueError(f"ZeroConfig.{name}={value!r} must be a positive number of elements, e.g. {example}.")
