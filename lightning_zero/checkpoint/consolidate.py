"""Export of a sharded checkpoint to one file, streamed tensor by tensor.

A checkpoint of a model larger than one host's RAM must still become one file: each tensor is
read from the shards (DCP reads just the boxes it needs), cast, written to the output and freed
before the next is read, so peak memory is about the largest tensor, not the model. Works on a
machine without GPUs or a process group.
"""

from __future__ import annotations

import logging
import math
import os
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from lightning_zero.checkpoint.serialization import (
    TensorRef,
    read_safetensors_header,
    save_safetensors_streamed,
    save_torch_streamed,
)
from lightning_zero.checkpoint.sharded import (
    MODEL_KEY,
    CheckpointError,
    CheckpointMeta,
    from_object_entry,
    is_sharded_checkpoint,
    optimizer_key,
    read_local,
    read_meta,
    read_metadata,
    resolve_checkpoint_path,
    saved_state_keys,
)
from lightning_zero.checkpoint.state import AVERAGE_KEY, AVERAGE_MARK, SWA_MARK, swa_average_key

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# What a weights-only export keeps of Lightning's checkpoint besides the weights.
_WEIGHTS_ONLY_KEYS = ("epoch", "global_step", "pytorch-lightning_version", "hparams_name", "hyper_parameters",
                      "hparams_type", "datamodule_hparams_name", "datamodule_hyper_parameters")


@dataclass(frozen=True)
class _Entry:
    """One tensor to read from the checkpoint (``source``, its DCP key) and write (``key``)."""

    key: str
    source: str
    shape: tuple[int, ...]
    saved_dtype: torch.dtype
    dtype: torch.dtype  # in the output

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.saved_dtype.itemsize


def consolidate(
    checkpoint: str | os.PathLike,
    output: str | os.PathLike,
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32",
    weights_only: bool = False,
    progress: bool = True,
    overwrite: bool = False,
) -> Path:
    """Writes the sharded checkpoint at ``checkpoint`` as one file, streamed shard by shard.

    ``output`` ending in ``.safetensors``: the module's state dict (weights only, tied weights
    written under each name). Otherwise a Lightning checkpoint for ``torch.load``,
    ``LightningModule.load_from_checkpoint`` and ``trainer.fit(ckpt_path=...)`` with any strategy:
    the weights, and unless ``weights_only`` the optimizer states in torch's format, LR
    schedulers, loops and callbacks. ``dtype`` casts the floating-point weights of up to 32 bits
    (float64 ones, and the optimizer state, stay as saved). Returns the output path.

    An existing ``output`` file is replaced only with ``overwrite`` (FileExistsError otherwise), and
    never a file inside a sharded checkpoint (the source's own files included): a CheckpointError.

    A run with a weight-averaging callback exports its average where Lightning puts it under any
    other strategy: EMAWeightAveraging's as ``state_dict`` (the trained weights as
    ``current_model_state``), StochasticWeightAveraging's in its callback state. A ``.safetensors``
    or ``weights_only`` export holds the trained weights (the module's state), never an average.
    """
    if dtype not in DTYPES:
        raise ValueError(f"consolidate(dtype={dtype!r}) is not one of {', '.join(map(repr, DTYPES))}.")
    source = resolve_checkpoint_path(checkpoint)
    if not source.is_dir():
        raise CheckpointError(_not_a_directory(source))
    metadata = read_metadata(source)
    meta = read_meta(source, metadata)
    target = Path(output)
    check_export_target(source, target, overwrite, what="a file")
    out_dtype = DTYPES[dtype]
    model = _model_entries(source, metadata, meta, out_dtype)
    if target.suffix == ".safetensors":
        extra = [k for k, v in model.items() if not isinstance(v, _Entry)]
        if extra:
            log.warning(f"{target} leaves out the module's non-tensor state {extra[:5]}: safetensors stores tensors"
                        " only. Export to a .pt file to keep it.")
        entries = [v for v in model.values() if isinstance(v, _Entry)]
        specs = {e.key: (e.dtype, e.shape) for e in entries}  # type: ignore[union-attr]
        info = {"format": "pt", "lightning_zero_source": str(source), "global_step": str(meta.lightning.get("global_step"))}
        save_safetensors_streamed(target, specs, _stream(source, metadata, entries, progress, by_key=True), metadata=info)
        return target
    structure: dict[str, Any]
    if weights_only or not meta.optimizers:
        structure = {k: v for k, v in meta.lightning.items() if k in _WEIGHTS_ONLY_KEYS}
        optimizer_entries: list[_Entry] = []
    else:
        structure = dict(meta.lightning)
        states, optimizer_entries = _optimizer_states(source, metadata, meta)
        structure["optimizer_states"] = states
    structure["state_dict"] = _refs(model)
    tensors = {e.source: e for e in model.values() if isinstance(e, _Entry)}
    tensors.update({e.source: e for e in optimizer_entries})
    swa_keys = structure.pop(SWA_MARK, [])
    if structure.pop(AVERAGE_MARK, False):
        # WeightAveraging's layout, as it saves under any other strategy: the average as the
        # module's state dict, the trained weights beside it.
        average = _average_entries(source, metadata, meta, AVERAGE_KEY, out_dtype)
        structure["current_model_state"], structure["state_dict"] = structure["state_dict"], _refs(average)
        tensors.update({e.source: e for e in average.values() if isinstance(e, _Entry)})
    if swa_keys and "callbacks" in structure:
        structure["callbacks"] = callbacks = dict(structure["callbacks"])
        for index, key in enumerate(swa_keys):  # StochasticWeightAveraging keeps its average in its own state
            average = _average_entries(source, metadata, meta, swa_average_key(index), out_dtype)
            callbacks[key] = {**callbacks[key], "average_model_state": _refs(average)}
            tensors.update({e.source: e for e in average.values() if isinstance(e, _Entry)})
    save_torch_streamed(target, structure, _stream(source, metadata, list(tensors.values()), progress, by_key=False))
    return target


def check_export_target(source: Path, target: Path, overwrite: bool, what: str) -> None:
    """Refuses an export target that would damage a checkpoint (the source or a file inside any
    sharded checkpoint) or, without ``overwrite``, replace an existing file."""
    resolved = target.resolve()
    # The source is a sharded checkpoint itself (its metadata was read), so this finds it too.
    inside = next((parent for parent in (resolved, *resolved.parents) if is_sharded_checkpoint(parent)), None)
    if inside is not None:
        raise CheckpointError(
            f"{target} is inside the sharded checkpoint {inside}: writing there would damage it. Write the export"
            f" ({what}) outside any checkpoint directory, e.g. {source.parent / (source.stem + '.pt')}."
        )
    if not overwrite and target.is_file():
        raise FileExistsError(f"{target} exists: pass overwrite=True (--overwrite) to replace it, or choose a new name.")


def _not_a_directory(path: Path) -> str:
    """Why a file cannot be consolidated: part of a checkpoint, one file already (torch or
    safetensors), or no checkpoint at all."""
    if is_sharded_checkpoint(path.parent):
        return (f"{path} is a file inside the sharded checkpoint {path.parent}, not the checkpoint: pass the"
                f" directory {path.parent}.")
    if zipfile.is_zipfile(path):
        return (f"{path} is a single torch file, not a sharded checkpoint directory: there is nothing to consolidate."
                " It loads as it is (torch.load, load_from_checkpoint, trainer.fit(ckpt_path=...)).")
    try:
        read_safetensors_header(path)
    except (ValueError, OSError):
        pass
    else:
        return f"{path} is a safetensors file, not a sharded checkpoint directory: there is nothing to consolidate."
    return (f"{path} is not a checkpoint: a sharded checkpoint is a directory (with a .metadata file) written by"
            " trainer.save_checkpoint or ModelCheckpoint under a ZeroStrategy. Pass that directory.")


def _model_entries(path: Path, metadata: Metadata, meta: CheckpointMeta, dtype: torch.dtype) -> dict[str, Any]:
    """The module's state dict in order: an _Entry per tensor, the value itself for extra state."""
    return _entries(path, metadata, [(key, f"{MODEL_KEY}.{meta.aliases.get(key, key)}") for key in meta.model_keys],
                    dtype, "in the model")


def _entries(path: Path, metadata: Metadata, sources: list[tuple[str, str]], dtype: torch.dtype,
             where: str) -> dict[str, Any]:
    """Per (key, DCP key) of ``sources``, in order: an _Entry for a tensor, the value itself for an
    object; ``where`` names the listing in the error for a key with no data."""
    result: dict[str, Any] = {}
    objects: list[tuple[str, str]] = []
    for key, source in sources:
        md = metadata.state_dict_metadata.get(source)
        if isinstance(md, TensorStorageMetadata):
            saved = md.properties.dtype
            # A float64 tensor is one the model trains in float64 (its master is float64 too):
            # casting it to the export's dtype would round what training kept.
            cast = saved.is_floating_point and saved.itemsize <= 4
            result[key] = _Entry(key, source, tuple(md.size), saved, dtype if cast else saved)
        elif isinstance(md, BytesStorageMetadata):
            result[key] = None
            objects.append((key, source))
        else:
            raise CheckpointError(f"{path} lists '{key}' {where} but holds no data for it: the checkpoint is damaged.")
    if objects:
        values = _read_objects(path, metadata, [source for _, source in objects])
        for key, source in objects:
            result[key] = values[source]
    return result


def _refs(entries: dict[str, Any]) -> dict[str, Any]:
    """A state dict of placeholders for the tensors streamed in later."""
    return {key: TensorRef(entry.source, entry.dtype, entry.shape) if isinstance(entry, _Entry) else entry
            for key, entry in entries.items()}


def _average_entries(path: Path, metadata: Metadata, meta: CheckpointMeta, namespace: str,
                     dtype: torch.dtype) -> dict[str, Any]:
    """A weight average saved under ``namespace`` (see [Note: weight averages in a checkpoint] in
    state.py), keyed and ordered like the module's state dict, whole."""
    prefix = namespace + "."
    saved = [fqn[len(prefix):] for fqn in metadata.state_dict_metadata if fqn.startswith(prefix)]
    order = {key: index for index, key in enumerate(meta.model_keys)}
    keys = sorted(saved, key=lambda key: order.get(key, len(order)))
    return _entries(path, metadata, [(key, prefix + key) for key in keys], dtype, f"in {namespace}")


def _optimizer_states(path: Path, metadata: Metadata, meta: CheckpointMeta) -> tuple[list[dict[str, Any]], list[_Entry]]:
    """Torch-format optimizer states (parameters numbered in param-group order) with TensorRefs."""
    states: list[dict[str, Any]] = []
    entries: list[_Entry] = []
    objects: dict[str, tuple[int, int, str]] = {}
    for number, saved in enumerate(meta.optimizers):
        prefix = optimizer_key(number)
        index = {}
        for group in saved["param_groups"]:
            for name in group["params"]:
                index[name] = len(index)
        state: dict[int, dict[str, Any]] = {}
        for name, saved_keys in saved_state_keys(metadata, prefix).items():
            if name not in index:
                raise CheckpointError(f"{path} holds optimizer state for '{name}', which no param group lists: the"
                                      " checkpoint is damaged.")
            for state_key, md in saved_keys.items():
                fqn = f"{prefix}.{name}.{state_key}"
                if isinstance(md, TensorStorageMetadata):
                    entry = _Entry(fqn, fqn, tuple(md.size), md.properties.dtype, md.properties.dtype)
                    entries.append(entry)
                    state.setdefault(index[name], {})[state_key] = TensorRef(fqn, entry.dtype, entry.shape)
                else:
                    objects[fqn] = (number, index[name], state_key)
                    state.setdefault(index[name], {})[state_key] = None
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[n] for n in g["params"]]}
                  for g in saved["param_groups"]]
        states.append({"state": dict(sorted(state.items())), "param_groups": groups})
    if objects:
        values = _read_objects(path, metadata, list(objects))
        for fqn, (number, param_index, state_key) in objects.items():
            states[number]["state"][param_index][state_key] = values[fqn]
    return states, entries


def _read_objects(path: Path, metadata: Metadata, keys: list[str]) -> dict[str, Any]:
    holder = read_local(path, metadata, keys)
    return {key: from_object_entry(value, path, key) for key, value in holder.items()}


def _stream(path: Path, metadata: Metadata, entries: list[_Entry], progress: bool,
            by_key: bool) -> Iterator[tuple[str, Tensor]]:
    """Reads the entries in batches of at most the largest tensor's bytes (so small tensors do not
    each cost a DCP call) and yields each as (output key if ``by_key`` else its source, tensor).
    Each batch's records are verified against their checksums first; the writers are atomic, so a
    damaged record leaves no output file."""
    budget = max([e.nbytes for e in entries] + [1 << 20])
    total = sum(e.nbytes for e in entries)
    bar = _Bar(path, total) if progress else None
    try:
        batch: list[_Entry] = []
        size = 0
        for entry in entries + [None]:  # type: ignore[list-item]
            if entry is not None and (not batch or size + entry.nbytes <= budget):
                batch.append(entry)
                size += entry.nbytes
                continue
            if batch:
                loaded = _read_batch(path, metadata, batch)
                for item in batch:
                    # Counted as read before it is handed over: a writer that takes the last tensor
                    # and closes the stream never resumes it, and the bar would end short.
                    if bar is not None:
                        bar.advance(item.nbytes)
                    yield (item.key if by_key else item.source), loaded[item.source].to(item.dtype)
                del loaded
            batch, size = ([entry], entry.nbytes) if entry is not None else ([], 0)
    finally:
        if bar is not None:
            bar.close()


def _read_batch(path: Path, metadata: Metadata, batch: list[_Entry]) -> dict[str, Tensor]:
    """Whole tensors for one batch (DCP fills each from every shard that overlaps it)."""
    targets: dict[str, Tensor] = {}
    for item in batch:
        if item.source not in targets:
            targets[item.source] = torch.empty(item.shape, dtype=item.saved_dtype)
    return read_local(path, metadata, list(targets), targets)


class _Bar:
    def __init__(self, path: Path, total: int) -> None:
        from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

        self._progress = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                                  TransferSpeedColumn(), TimeRemainingColumn())
        self._task = self._progress.add_task(f"consolidating {path.name}", total=total)
        self._progress.start()

    def advance(self, nbytes: int) -> None:
        self._progress.advance(self._task, nbytes)

    def close(self) -> None:
        self._progress.stop()
