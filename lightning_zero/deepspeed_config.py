"""DeepSpeed JSON configs, read into our typed configuration (plain Python: no Lightning here).

[Note: DeepSpeed config import]
A user moving from DeepSpeed (or from Lightning's ``DeepSpeedStrategy``) has a JSON config that
says what they want; :func:`read_deepspeed_config` turns it into a :class:`ZeroConfig`, a precision
and the loop settings DeepSpeed keeps in the same file, without making them rewrite it:

* ``zero_optimization`` maps field by field (``stage``, ``reduce_bucket_size``, the ``stage3_*``
  sizes, ``mics_shard_size`` as hybrid sharding, ``offload_optimizer`` / ``offload_param``).
  ``stage3_prefetch_bucket_size`` and ``stage3_max_live_parameters`` count elements; our
  ``prefetch_bytes`` counts bytes, so the smaller of the two is multiplied by the parameter
  dtype's size (2 under fp16/bf16, else 4). The ``stage3_*`` keys are read at stage 3 only, as
  DeepSpeed does; elsewhere they are listed as unused.
* ``fp16`` / ``bf16`` give ``"16-mixed"`` / ``"bf16-mixed"`` (DeepSpeed keeps fp32 masters, as our
  -mixed precisions do), with every DeepSpeed loss-scale key in a :class:`LossScaleConfig`
  (``loss_scale: 0`` is DeepSpeed's "dynamic").
* ``gradient_clipping``, ``gradient_accumulation_steps``, ``train_micro_batch_size_per_gpu`` and
  ``train_batch_size`` belong to the Trainer and the DataLoader under Lightning: they are not
  applied behind the user's back but checked against them once those exist
  (:meth:`DeepSpeedSettings.check_trainer`, :meth:`DeepSpeedSettings.check_micro_batch_size`);
  a mismatch is an error naming both values.
* ``"auto"`` (Hugging Face's convention) takes our default for a size and the Trainer's or the
  DataLoader's value for the rest; nothing is checked then.
* Keys that DeepSpeed knows and we do not implement (the ``optimizer`` and ``scheduler`` sections,
  NVMe buffer settings, logging switches, ...) are returned in ``unused`` with the reason, for one
  warning; keys nobody knows (a typo) are returned in ``unknown``. What would change the training
  silently if dropped (NVMe offload, stage 0, both fp16 and bf16) is an error.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_zero.config import ParallelConfig, ZeroConfig
from lightning_zero.loss_scaler import LossScaleConfig
from lightning_zero.offload import CPUOffloadPolicy

AUTO = "auto"
DeepSpeedSource = str | os.PathLike[str] | Mapping[str, Any]

# DeepSpeed's own defaults where ours differ and the key's presence asks for DeepSpeed's behaviour.
_DS_PREFETCH_BUCKET_SIZE = 50_000_000
# DeepSpeed's offload sections pin by default (DeepSpeedZeroOffload*Config.pin_memory, 0.19).
_DS_PIN_MEMORY = True

# Top-level keys DeepSpeed knows that we do not use, and why (what takes their place here).
_UNUSED_TOP_LEVEL: dict[str, str] = {
    "optimizer": "configure_optimizers returns the optimizer",
    "scheduler": "configure_optimizers returns the LR scheduler",
    "steps_per_print": "Lightning's loggers and progress bar report",
    "wall_clock_breakdown": "use Lightning's profiler (Trainer(profiler=...))",
    "dump_state": "not needed",
    "flops_profiler": "not implemented",
    "activation_checkpointing": "use torch.utils.checkpoint in the model",
    "tensorboard": "use Lightning's loggers",
    "wandb": "use Lightning's loggers",
    "csv_monitor": "use Lightning's loggers",
    "comet": "use Lightning's loggers",
    "comms_logger": "use lightning_zero.CountingCollectives",
    "prescale_gradients": "gradients are averaged over the ranks in the reduction",
    "gradient_predivide_factor": "gradients are averaged over the ranks in the reduction",
    "sparse_gradients": "not implemented",
    "zero_force_ds_cpu_optimizer": "offloaded Adam/AdamW always takes our C++ CPU Adam",
    "amp": "use fp16 / bf16 (or Trainer(precision=...))",
    "elasticity": "not implemented",
    "aio": "NVMe offload is not implemented",
    "compression_training": "not implemented",
    "data_efficiency": "not implemented",
    "curriculum_learning": "not implemented",
    "autotuning": "use lightning_zero.ZeroAutotuner",
    "checkpoint": "checkpoints are torch.distributed.checkpoint directories (see the README)",
    "memory_breakdown": "use lightning_zero.ZeroMemoryProfiler",
    "seq_parallel_communication_data_type": "sequence parallelism is not implemented",
    "fp32_allreduce": "gradients are reduced in fp32 by default (reduce_dtype)",
    "disable_allgather": "not needed",
    "gradient_accumulation_dtype": "gradients accumulate in reduce_dtype",
    "data_types": "gradients accumulate in reduce_dtype (communication_data_type sets it)",
    "graph_harvesting": "not implemented",
    "use_data_before_expert_parallelism": "expert parallelism is not implemented",
    "pipeline": "use ZeroConfig(pipeline=PipelineConfig(...))",
}
_USED_TOP_LEVEL = frozenset({
    "zero_optimization", "fp16", "bf16", "bfloat16", "gradient_clipping", "gradient_accumulation_steps",
    "train_micro_batch_size_per_gpu", "train_batch_size", "zero_allow_untested_optimizer",
    "communication_data_type",
})
# zero_optimization keys we do not use, and why.
_UNUSED_ZERO: dict[str, str] = {
    "sub_group_size": "the optimizer steps each bucket's shard as it is",
    "round_robin_gradients": "not needed: each bucket's reduction goes to its owners' shards",
    "stage3_max_reuse_distance": "units are freed after use and prefetched in recorded order",
    "stage3_gather_16bit_weights_on_model_save": "checkpoints are sharded; export one file with `lightning-zero"
                                                 " consolidate` (or ZeroStrategy(state_dict_type='full'))",
    "stage3_gather_fp16_weights_on_model_save": "checkpoints are sharded; export one file with `lightning-zero"
                                                " consolidate` (or ZeroStrategy(state_dict_type='full'))",
    "elastic_checkpoint": "sharded checkpoints load at any world size already",
    "load_from_fp32_weights": "sharded checkpoints hold the fp32 masters and load from them",
    "ignore_unused_parameters": "unused parameters are handled as DDP's find_unused_parameters",
    "legacy_stage1": "not needed",
    "zero_hpz_partition_size": "not implemented (mics_shard_size gives hybrid sharding)",
    "zero_quantized_weights": "not implemented",
    "zero_quantized_nontrainable_weights": "not implemented",
    "zero_quantized_gradients": "not implemented",
    "mics_hierarchical_params_gather": "not needed",
    "memory_efficient_linear": "not needed",
    "stage3_model_persistence_threshold": "not implemented",
    "stage3_module_granularity_threshold": "use unit_modules / min_unit_numel",
    "use_multi_rank_bucket_allreduce": "not needed",
    "pipeline_loading_checkpoint": "not needed",
    "override_module_apply": "not needed",
    "log_trace_cache_warnings": "not needed",
}
# zero_optimization switches that are always on here: true is accepted silently, false is listed.
_ALWAYS_ON = ("overlap_comm", "contiguous_gradients", "reduce_scatter", "allgather_partitions")
# zero_optimization keys read at every stage, and the stage3_* ones read at stage 3.
_ZERO_READ = frozenset({
    "stage", "reduce_bucket_size", "allgather_bucket_size", "mics_shard_size", "offload_optimizer", "offload_param",
    "cpu_offload", "cpu_offload_params", "cpu_offload_use_pin_memory", *_ALWAYS_ON})
_STAGE3_READ = ("stage3_param_persistence_threshold", "stage3_prefetch_bucket_size", "stage3_max_live_parameters")
_ZERO_KEYS = frozenset({*_ZERO_READ, *_STAGE3_READ, *_UNUSED_ZERO})  # every key DeepSpeed knows there
_OFFLOAD_UNUSED = {
    "buffer_count": "not needed (no NVMe)", "buffer_size": "not needed (no NVMe)",
    "max_in_cpu": "not needed (no NVMe)", "fast_init": "not needed", "nvme_path": "NVMe offload is not implemented",
    "pipeline": "not needed", "pipeline_read": "not needed", "pipeline_write": "not needed",
}
_LOSS_SCALE_KEYS = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                    "consecutive_hysteresis", "min_loss_scale")
# Every key DeepSpeed knows in these sections (0.19): any other is a typo, reported as one with the
# nearest known key, not as a feature "not implemented" (its value would fall back to the default).
_FP16_KEYS = frozenset({"enabled", "auto_cast", "fp16_master_weights_and_grads", *_LOSS_SCALE_KEYS})
_BF16_KEYS = frozenset({"enabled", "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
                        "bf16_optimizer_states"})
_OFFLOAD_KEYS = frozenset({"device", "pin_memory", "ratio", "super_offload", "cpuadam_cores_perc", *_OFFLOAD_UNUSED})
_OFFLOAD_UNUSED.update({"super_offload": "not implemented", "cpuadam_cores_perc": "the C++ CPU Adam uses torch's threads"})
_REDUCE_DTYPES = {"fp32": "fp32", "float32": "fp32", "fp16": "fp16", "float16": "fp16", "half": "fp16",
                  "bf16": "bf16", "bfloat16": "bf16"}


class DeepSpeedConfigWarning(UserWarning):
    """A DeepSpeed config has keys lightning_zero does not use."""


@dataclass(frozen=True)
class DeepSpeedSettings:
    """What a DeepSpeed config asks for (see [Note: DeepSpeed config import]).

    Attributes:
        source: where the config came from (a path, or ``"a dict"``), for messages.
        zero: the ZeRO configuration.
        precision: ``"16-mixed"`` or ``"bf16-mixed"``; ``None`` when neither fp16 nor bf16 is enabled
            (or they are ``"auto"``): the Trainer's precision then holds.
        loss_scale: fp16's loss scaling (``None`` without fp16). With ``"enabled": "auto"`` and
            loss-scale keys, the scaling a Trainer (or Fabric) whose precision is fp16 takes.
        gradient_clipping: the gradient-norm bound (0 for none); ``None``: not given or ``"auto"``.
        gradient_accumulation_steps: ``None``: not given or ``"auto"``.
        micro_batch_size: ``train_micro_batch_size_per_gpu``; ``None``: not given or ``"auto"``.
        train_batch_size: micro-batch x accumulation x data-parallel ranks; ``None``: not given or ``"auto"``.
        unused: DeepSpeed keys (dotted) we do not use, and why.
        unknown: keys DeepSpeed does not know either (typos, most likely).
    """

    source: str
    zero: ZeroConfig
    precision: str | None = None
    loss_scale: LossScaleConfig | None = None
    gradient_clipping: float | None = None
    gradient_accumulation_steps: int | None = None
    micro_batch_size: int | None = None
    train_batch_size: int | None = None
    unused: dict[str, str] = field(default_factory=dict)
    unknown: tuple[str, ...] = ()

    def ignored_keys_message(self) -> str | None:
        """One message listing every key that is not used, or None when all of them are."""
        if not self.unused and not self.unknown:
            return None
        lines = [f"The DeepSpeed config {self.source} has keys lightning_zero does not use:"]
        lines += [f"  {key}: {why}" if why else f"  {key}" for key, why in sorted(self.unused.items())]
        if self.unknown:
            lines.append(f"  and keys DeepSpeed does not know either (a typo?): {', '.join(self.unknown)}")
        return "\n".join(lines)

    def check_trainer(self, gradient_clip_val: float | None, gradient_clip_algorithm: str | None,
                      accumulate_grad_batches: int) -> None:
        """Raises when the config's clipping or accumulation disagrees with the Trainer's."""
        if self.gradient_clipping is not None:
            trainer_clip = float(gradient_clip_val or 0.0)
            if trainer_clip != self.gradient_clipping:
                raise ValueError(
                    f"The DeepSpeed config {self.source} has gradient_clipping={self.gradient_clipping:g} but the"
                    f" Trainer has gradient_clip_val={gradient_clip_val!r}: under Lightning the Trainer clips. Pass"
                    f" Trainer(gradient_clip_val={self.gradient_clipping:g}), or set gradient_clipping to"
                    " \"auto\" in the config."
                )
            if trainer_clip and gradient_clip_algorithm not in (None, "norm"):
                raise ValueError(
                    f"The DeepSpeed config {self.source} clips by norm (gradient_clipping={self.gradient_clipping:g})"
                    f" but the Trainer has gradient_clip_algorithm={gradient_clip_algorithm!r}: use 'norm', or set"
                    " gradient_clipping to \"auto\" in the config."
                )
        if self.gradient_accumulation_steps is not None and self.gradient_accumulation_steps != accumulate_grad_batches:
            raise ValueError(
                f"The DeepSpeed config {self.source} has gradient_accumulation_steps={self.gradient_accumulation_steps}"
                f" but the Trainer has accumulate_grad_batches={accumulate_grad_batches}: under Lightning the Trainer"
                f" accumulates. Pass Trainer(accumulate_grad_batches={self.gradient_accumulation_steps}), or set"
                " gradient_accumulation_steps to \"auto\" in the config."
            )

    def check_micro_batch_size(self, batch_size: int | None, accumulate_grad_batches: int, data_parallel_size: int) -> None:
        """Raises when the training DataLoader's batch size disagrees with the config's sizes.
        ``batch_size`` None (a loader with a custom batch sampler) is not checked."""
        if batch_size is None:
            return
        if self.micro_batch_size is not None and batch_size != self.micro_batch_size:
            raise ValueError(
                f"The DeepSpeed config {self.source} has train_micro_batch_size_per_gpu={self.micro_batch_size} but"
                f" the training DataLoader has batch_size={batch_size}: under Lightning the DataLoader batches. Build"
                f" it with batch_size={self.micro_batch_size}, or set train_micro_batch_size_per_gpu to \"auto\"."
            )
        if self.train_batch_size is not None:
            total = batch_size * accumulate_grad_batches * data_parallel_size
            if total != self.train_batch_size:
                raise ValueError(
                    f"The DeepSpeed config {self.source} has train_batch_size={self.train_batch_size}, but the"
                    f" DataLoader's batch_size={batch_size} x accumulate_grad_batches={accumulate_grad_batches} x"
                    f" {data_parallel_size} data-parallel ranks = {total}. Make them agree, or set train_batch_size"
                    " to \"auto\"."
                )


def read_deepspeed_config(source: DeepSpeedSource) -> DeepSpeedSettings:
    """Reads a DeepSpeed config (a JSON file's path, or the dict) into :class:`DeepSpeedSettings`.

    Raises ``ValueError`` naming the key, its value and what would work for anything that cannot be
    honoured (see [Note: DeepSpeed config import]).
    """
    values, where = _load(source)
    reader = _Reader(where)
    precision, loss_scale = reader.precision(values)
    itemsize = 2 if precision is not None else 4
    if "zero_optimization" not in values:
        raise ValueError(
            f"The DeepSpeed config {where} has no zero_optimization section, so DeepSpeed would run ZeRO stage 0 (plain"
            f" data parallelism).{_typo_of('zero_optimization', values)} Add \"zero_optimization\": {{\"stage\": 1, 2 or 3}}, or use"
            " Trainer(strategy='ddp')."
        )
    zero_values = reader.section(values, "zero_optimization")
    reduce_dtype = reader.reduce_dtype(values.get("communication_data_type"))
    kwargs = reader.zero(zero_values, itemsize)
    if reduce_dtype is not None:
        kwargs["reduce_dtype"] = reduce_dtype
    untested = values.get("zero_allow_untested_optimizer")
    if untested is not None:
        kwargs["allow_unknown_optimizer"] = reader.boolean("zero_allow_untested_optimizer", untested)
    try:
        zero = ZeroConfig(**kwargs)
    except ValueError as error:
        raise ValueError(f"The DeepSpeed config {where} maps to an invalid ZeroConfig: {error}") from error
    for key in values:
        if key in _USED_TOP_LEVEL:
            continue
        if values[key] is False:
            continue  # a feature switched off asks for nothing
        if key in _UNUSED_TOP_LEVEL:
            reader.unused[key] = _UNUSED_TOP_LEVEL[key]
        else:
            reader.note_unknown(key, {*_USED_TOP_LEVEL, *_UNUSED_TOP_LEVEL})
    clipping = reader.number("gradient_clipping", values.get("gradient_clipping"), minimum=0.0)
    return DeepSpeedSettings(
        source=where, zero=zero, precision=precision, loss_scale=loss_scale,
        gradient_clipping=None if clipping is None else float(clipping),
        gradient_accumulation_steps=reader.count("gradient_accumulation_steps", values.get("gradient_accumulation_steps")),
        micro_batch_size=reader.count("train_micro_batch_size_per_gpu", values.get("train_micro_batch_size_per_gpu")),
        train_batch_size=reader.count("train_batch_size", values.get("train_batch_size")),
        unused=dict(reader.unused), unknown=tuple(reader.unknown),
    )


def _typo_of(wanted: str, values: Mapping[str, Any]) -> str:
    """A sentence naming the key of ``values`` closest to the missing ``wanted`` (a likely typo), or ""."""
    near = difflib.get_close_matches(wanted, [str(key) for key in values], n=1, cutoff=0.6)
    return f" It has {near[0]!r}: a typo of {wanted!r}?" if near else ""


class _DuplicateKeys(Exception):
    pass


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        raise _DuplicateKeys(", ".join(map(repr, repeated)))
    return dict(pairs)


def _load(source: DeepSpeedSource) -> tuple[dict[str, Any], str]:
    if isinstance(source, Mapping):
        return dict(source), "(a dict)"
    if not isinstance(source, (str, os.PathLike)):
        raise ValueError(
            f"deepspeed_config={source!r} must be the path of a DeepSpeed JSON config or the config as a dict."
        )
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"deepspeed_config={str(source)!r} is not a file: give the path of a DeepSpeed JSON config"
                         " (e.g. ds_config.json), or the config as a dict.")
    try:
        values = json.loads(path.read_text(), object_pairs_hook=_refuse_duplicates)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"The DeepSpeed config {path} could not be read as JSON: {error}") from error
    except _DuplicateKeys as error:
        raise ValueError(f"The DeepSpeed config {path} gives {error} more than once (JSON would keep the last one"
                         " silently; DeepSpeed refuses it too): keep one.") from None
    if not isinstance(values, dict):
        raise ValueError(f"The DeepSpeed config {path} holds a {type(values).__name__}, not a JSON object.")
    return values, str(path)


@dataclass
class _Reader:
    """Reads values by dotted key, collecting what is not used; its errors name the key."""

    where: str
    unused: dict[str, str] = field(default_factory=dict)
    unknown: list[str] = field(default_factory=list)

    def error(self, key: str, value: Any, fix: str) -> ValueError:
        return ValueError(f"The DeepSpeed config {self.where} has {key}={value!r}: {fix}")

    def note_unknown(self, key: str, known: Any) -> None:
        """``key`` (dotted) is not a DeepSpeed key: reported with the nearest of ``known`` (names)."""
        prefix, _, name = key.rpartition(".")
        near = difflib.get_close_matches(name, [str(k) for k in known], n=1, cutoff=0.6)
        hint = f" ({(prefix + '.' if prefix else '') + near[0]}?)" if near else ""
        self.unknown.append(key + hint)

    def section(self, values: Mapping[str, Any], key: str) -> dict[str, Any]:
        value = values.get(key, {})
        if not isinstance(value, Mapping):
            raise self.error(key, value, "it must be a JSON object.")
        return dict(value)

    def boolean(self, key: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise self.error(key, value, "it must be true or false.")
        return value

    def number(self, key: str, value: Any, minimum: float) -> float | None:
        """A number, or None for absent / "auto"."""
        if value is None or value == AUTO:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
            raise self.error(key, value, f"it must be a number >= {minimum:g}, or \"auto\".")
        return value

    def count(self, key: str, value: Any, minimum: int = 1) -> int | None:
        """A whole number (JSON's 5e8 is a float), or None for absent / "auto"."""
        if value is None or value == AUTO:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < minimum:
            raise self.error(key, value, f"it must be a whole number >= {minimum}, or \"auto\".")
        return int(value)

    def precision(self, values: Mapping[str, Any]) -> tuple[str | None, LossScaleConfig | None]:
        fp16 = self.section(values, "fp16")
        bf16 = self.section(values, "bf16") or self.section(values, "bfloat16")
        fp16_on = self._enabled("fp16", fp16)
        bf16_on = self._enabled("bf16", bf16)
        if fp16_on and bf16_on:
            raise ValueError(f"The DeepSpeed config {self.where} enables both fp16 and bf16: enable one.")
        bf16_name = "bf16" if "bf16" in values else "bfloat16"
        for key in sorted(set(bf16) - {"enabled"}):
            if key not in _BF16_KEYS:
                self.note_unknown(f"{bf16_name}.{key}", _BF16_KEYS)
            elif bf16[key] is not False:
                self.unused[f"{bf16_name}.{key}"] = "not needed: bf16 keeps fp32 masters, gradients are reduced in reduce_dtype"
        for key in sorted(set(fp16) - {"enabled", *_LOSS_SCALE_KEYS}):
            if key not in _FP16_KEYS:
                self.note_unknown(f"fp16.{key}", _FP16_KEYS)
            elif fp16[key] is not False:
                self.unused[f"fp16.{key}"] = "not implemented: fp16 keeps fp32 masters and autocasts"
        if fp16.get("enabled") == AUTO and not bf16_on and set(fp16) & set(_LOSS_SCALE_KEYS):
            # Hugging Face's "auto": the Trainer's precision decides, and under fp16 its loss scale is
            # the section's (see DeepSpeedSettings.loss_scale); DeepSpeed's defaults are ours too.
            scale = self._loss_scale(fp16)
            return None, (scale if scale != LossScaleConfig() else None)
        if not fp16_on:
            return ("bf16-mixed" if bf16_on else None), None
        return "16-mixed", self._loss_scale(fp16)

    def _loss_scale(self, fp16: Mapping[str, Any]) -> LossScaleConfig:
        kwargs: dict[str, Any] = {}
        scale = self.number("fp16.loss_scale", fp16.get("loss_scale"), minimum=0.0)
        if scale:  # 0 is DeepSpeed's "dynamic"
            kwargs["loss_scale"] = float(scale)
        for key in ("initial_scale_power", "loss_scale_window", "hysteresis"):
            value = self.count(f"fp16.{key}", fp16.get(key), minimum=0 if key == "initial_scale_power" else 1)
            if value is not None:
                kwargs[key] = value
        if "consecutive_hysteresis" in fp16:
            kwargs["consecutive_hysteresis"] = self.boolean("fp16.consecutive_hysteresis", fp16["consecutive_hysteresis"])
        min_scale = self.number("fp16.min_loss_scale", fp16.get("min_loss_scale"), minimum=0.0)
        if min_scale is not None:
            kwargs["min_loss_scale"] = min_scale
        try:
            return LossScaleConfig(**kwargs)
        except ValueError as error:
            raise ValueError(f"The DeepSpeed config {self.where} has an invalid fp16 loss scale: {error}") from error

    def _enabled(self, name: str, section: Mapping[str, Any]) -> bool:
        value = section.get("enabled", False)
        if value == AUTO:
            return False  # the Trainer's precision decides
        return self.boolean(f"{name}.enabled", value)

    def reduce_dtype(self, value: Any) -> str | None:
        if value is None:
            return None
        if not isinstance(value, str) or value.lower() not in _REDUCE_DTYPES:
            raise self.error("communication_data_type", value, "use \"fp32\", \"bf16\" or \"fp16\".")
        return _REDUCE_DTYPES[value.lower()]

    def zero(self, values: Mapping[str, Any], itemsize: int) -> dict[str, Any]:
        """ZeroConfig's keyword arguments for a ``zero_optimization`` section."""
        if "stage" not in values:
            raise ValueError(
                f"The DeepSpeed config {self.where} sets no zero_optimization.stage, which DeepSpeed takes as 0 (plain"
                f" data parallelism).{_typo_of('stage', values)} Set zero_optimization.stage to 1, 2 or 3, or use Trainer(strategy='ddp')."
            )
        stage = values["stage"]
        if stage == 0:
            raise self.error(
                "zero_optimization.stage", stage,
                "stage 0 is plain data parallelism: use Trainer(strategy='ddp'), or set stage 1, 2 or 3.")
        if isinstance(stage, bool) or stage not in (1, 2, 3):
            raise self.error("zero_optimization.stage", stage, "use 1, 2 or 3.")
        kwargs: dict[str, Any] = {"stage": int(stage)}
        bucket = self.count("zero_optimization.reduce_bucket_size", values.get("reduce_bucket_size"))
        if bucket is not None:
            kwargs["reduce_bucket_size"] = bucket
        gather_bucket = self.count("zero_optimization.allgather_bucket_size", values.get("allgather_bucket_size"))
        if gather_bucket is not None and gather_bucket != kwargs.get("reduce_bucket_size"):
            self.unused["zero_optimization.allgather_bucket_size"] = (
                "the all-gathers use the reduce buckets (reduce_bucket_size)")
        for key in _ALWAYS_ON:
            if key in values and not self.boolean(f"zero_optimization.{key}", values[key]):
                self.unused[f"zero_optimization.{key}"] = "always on here"
        mics = self.count("zero_optimization.mics_shard_size", values.get("mics_shard_size"), minimum=-1)
        if mics is not None and mics > 0:
            kwargs["parallel"] = ParallelConfig(shard_size=mics)
        kwargs["offload_optimizer"] = self.offload("zero_optimization.offload_optimizer",
                                                   self._legacy_offload(values, "offload_optimizer", "cpu_offload"))
        kwargs["offload_params"] = self.offload("zero_optimization.offload_param",
                                                self._legacy_offload(values, "offload_param", "cpu_offload_params"))
        if kwargs["offload_params"] is not None and stage != 3:
            raise self.error("zero_optimization.offload_param.device", "cpu",
                             f"parameter offload needs stage 3, but zero_optimization.stage={stage}. Set stage 3, or"
                             " remove offload_param.")
        stage3_keys = sorted(key for key in values if key.startswith("stage3_") and key not in _UNUSED_ZERO)
        if stage == 3:
            kwargs.update(self._stage3(values, itemsize))
        else:
            for key in stage3_keys:
                self.unused[f"zero_optimization.{key}"] = f"applies to stage 3 only (stage={stage})"
        known = {*_ZERO_READ, *stage3_keys}
        for key in values:
            if key in known:
                continue
            if values[key] is False:
                continue
            if key in _UNUSED_ZERO:
                self.unused[f"zero_optimization.{key}"] = _UNUSED_ZERO[key]
            else:
                self.note_unknown(f"zero_optimization.{key}", _ZERO_KEYS)
        return {key: value for key, value in kwargs.items() if value is not None}

    def _legacy_offload(self, values: Mapping[str, Any], key: str, legacy: str) -> Any:
        """DeepSpeed's older switches (``cpu_offload: true``) mean the section with device cpu."""
        if key in values or legacy not in values or not self.boolean(f"zero_optimization.{legacy}", values[legacy]):
            return values.get(key)
        return {"device": "cpu", "pin_memory": values.get("cpu_offload_use_pin_memory", _DS_PIN_MEMORY)}

    def _stage3(self, values: Mapping[str, Any], itemsize: int) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        persistence = self.count("zero_optimization.stage3_param_persistence_threshold",
                                 values.get("stage3_param_persistence_threshold"), minimum=0)
        if persistence is not None:
            kwargs["param_persistence_threshold"] = persistence
        prefetch = self.count("zero_optimization.stage3_prefetch_bucket_size",
                              values.get("stage3_prefetch_bucket_size"), minimum=0)
        live = self.count("zero_optimization.stage3_max_live_parameters", values.get("stage3_max_live_parameters"),
                          minimum=0)
        if prefetch is not None or live is not None:
            elements = prefetch if prefetch is not None else _DS_PREFETCH_BUCKET_SIZE
            if live is not None:
                elements = min(elements, live)
            kwargs["prefetch_bytes"] = elements * itemsize
        for key in values:
            if key.startswith("stage3_") and key not in _UNUSED_ZERO and key not in _STAGE3_READ:
                self.note_unknown(f"zero_optimization.{key}", _ZERO_KEYS)
        return kwargs

    def offload(self, key: str, value: Any) -> CPUOffloadPolicy | None:
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise self.error(key, value, "it must be a JSON object, e.g. {\"device\": \"cpu\"}.")
        device = value.get("device", "none")
        if device == "nvme":
            raise self.error(f"{key}.device", device,
                             "NVMe offload is not supported by lightning_zero. Use \"cpu\" (the optimizer state, or"
                             " the parameters too, in CPU memory), or \"none\".")
        if device not in ("cpu", "none", None):
            raise self.error(f"{key}.device", device, "use \"cpu\" or \"none\".")
        for extra in sorted(set(value) - {"device", "pin_memory", "ratio"}):
            if extra in _OFFLOAD_UNUSED:
                self.unused[f"{key}.{extra}"] = _OFFLOAD_UNUSED[extra]
            else:
                self.note_unknown(f"{key}.{extra}", _OFFLOAD_KEYS)
        if device in ("none", None):
            return None
        pin = value.get("pin_memory", _DS_PIN_MEMORY)
        ratio = self.number(f"{key}.ratio", value.get("ratio"), minimum=0.0)
        try:
            return CPUOffloadPolicy(pin_memory=self.boolean(f"{key}.pin_memory", pin),
                                    ratio=1.0 if ratio is None else float(ratio))
        except ValueError as error:
            raise ValueError(f"The DeepSpeed config {self.where} has an invalid {key}: {error}") from error


__all__ = ["AUTO", "DeepSpeedConfigWarning", "DeepSpeedSettings", "DeepSpeedSource", "read_deepspeed_config"]
