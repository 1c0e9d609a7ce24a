"""Export of a sharded checkpoint as a Hugging Face model directory, streamed shard by shard.

[Note: Hugging Face export]
``transformers``' ``from_pretrained(directory)`` reads the weights as ``model.safetensors``, or,
when they are split, as ``model-00001-of-0000n.safetensors`` ... with an index
``model.safetensors.index.json`` = ``{"metadata": {"total_size": bytes}, "weight_map": {name:
file}}``; each file's header carries ``{"format": "pt"}``, without which transformers refuses it.
We write exactly that layout, with the split ``save_pretrained`` makes (huggingface_hub's
``split_torch_state_dict_into_shards``): tensors in state-dict order, a new shard whenever the
next tensor would push the current one over ``max_shard_size``, and a tensor larger than that in
a shard of its own. One shard's tensors are read from the checkpoint (see ``_stream`` in
consolidate.py), written with ``safetensors.torch.save_file`` and freed before the next shard is
read, so memory stays about one output shard (save_file holds a byte copy of each tensor too).

Names: a Lightning checkpoint holds the LightningModule's state dict, so a model kept as
``self.model = GPT2LMHeadModel(config)`` is saved under ``model.transformer.wte.weight`` ...
``strip_prefix`` removes such a prefix (keys outside it are left out, with a warning). By
default it is detected, but only for checkpoints a Trainer wrote: there the keys are the
LightningModule's, which is never itself the Hugging Face model, so when every key starts with
the same attribute name that attribute is the model. A checkpoint of a bare module (the engine's
own ``save_checkpoint``) is exported as it is: some Hugging Face models do have one common
prefix (``CLIPTextModel``'s ``text_model.``) that must stay.

Tied weights: safetensors files may not hold two names for one storage, and ``save_pretrained``
writes only the weight the others are tied to (GPT-2: ``transformer.wte.weight``, not
``lm_head.weight``); ``from_pretrained`` ties them again from the model's ``_tied_weights_keys``.
The checkpoint records each tie as an alias (the later state-dict key -> the first one, which is
the one ``_tied_weights_keys`` points to), so aliases are left out the same way, unless the
weight they are tied to is itself left out by ``strip_prefix`` (then the alias carries it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import math
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Any, Literal

import torch
from torch.distributed.checkpoint.metadata import Metadata

from lightning_zero.autotuning.space import parse_bytes
from lightning_zero.checkpoint.consolidate import (
    DTYPES,
    _Entry,
    _model_entries,
    _not_a_directory,
    _stream,
    check_export_target,
)
from lightning_zero.checkpoint.serialization import _atomic_output, _FreedMemory
from lightning_zero.checkpoint.sharded import (
    CheckpointError,
    CheckpointMeta,
    read_meta,
    read_metadata,
    resolve_checkpoint_path,
)

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "consolidate_hf", "exported_files", "plan_shards", "shard_names"]

log = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
# huggingface_hub's default and the Hub's recommended shard size (transformers 5's save_pretrained
# moved to "50GB"): memory during the export is about one shard, so it is kept moderate.
DEFAULT_MAX_SHARD_SIZE = "5GB"
# What save_pretrained writes and removes as stale: model.safetensors, model-00001-of-00002.safetensors.
_WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")
# Marks a checkpoint a Trainer wrote (its keys are then a LightningModule's).
_LIGHTNING_KEY = "pytorch-lightning_version"


def consolidate_hf(
    checkpoint: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32",
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    strip_prefix: str | None = None,
    hf_config: str | os.PathLike | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Writes the module weights of the sharded checkpoint at ``checkpoint`` as a Hugging Face
    model directory that ``from_pretrained(output_dir)`` loads (see [Note: Hugging Face export]).

    Args:
        checkpoint: the sharded checkpoint directory.
        output_dir: the directory to write; created if missing. If it exists it must be empty,
            unless ``overwrite``.
        dtype: the dtype of the floating-point weights of up to 32 bits (float64 ones stay).
        max_shard_size: the largest shard, in bytes or as ``"5GB"``, ``"500MB"``, ``"2GiB"``
            (GB = 10**9, GiB = 2**30). Memory stays about one shard. One shard holding everything
            is written as ``model.safetensors`` with no index, as ``save_pretrained`` does.
        strip_prefix: a key prefix to remove, e.g. ``"model."`` for a LightningModule that holds
            the Hugging Face model as ``self.model``; keys outside it are left out. ``""`` keeps
            every key as saved. ``None`` (the default) detects it for checkpoints a Trainer wrote
            (every key under one attribute), and keeps keys as saved otherwise.
        hf_config: a ``config.json`` (or a directory holding one) to copy into ``output_dir``.
            Without it, save the configuration yourself: ``model.config.save_pretrained(output_dir)``.
        overwrite: write into a non-empty ``output_dir``: its ``model*.safetensors`` files and
            index are replaced (stale shards removed), other files (tokenizer ...) are kept.
        progress: show a progress bar.

    Returns:
        ``output_dir``.

    Raises:
        ValueError: a bad ``dtype``, ``max_shard_size`` or ``strip_prefix``, or an unreadable
            ``hf_config``.
        FileExistsError: ``output_dir`` is not empty and ``overwrite`` is False.
        CheckpointError: ``checkpoint`` is not a (complete, undamaged) sharded checkpoint.
    """
    if dtype not in DTYPES:
        raise ValueError(f"consolidate_hf(dtype={dtype!r}) is not one of {', '.join(map(repr, DTYPES))}.")
    limit = parse_bytes(max_shard_size, "max_shard_size")
    if strip_prefix is not None and not isinstance(strip_prefix, str):
        raise ValueError(f"consolidate_hf(strip_prefix={strip_prefix!r}) must be a str such as 'model.', '' or None.")
    config = _config_file(Path(hf_config)) if hf_config is not None else None
    target = Path(output_dir)
    source = resolve_checkpoint_path(checkpoint)
    if not source.is_dir():
        raise CheckpointError(_not_a_directory(source))
    metadata = read_metadata(source)
    meta = read_meta(source, metadata)
    check_export_target(source, target, overwrite=True, what="a Hugging Face model directory")
    _check_output(target, overwrite)
    entries = _exported_entries(source, meta, _model_entries(source, metadata, meta, DTYPES[dtype]), strip_prefix)
    outputs = _outputs(entries)
    shards = plan_shards([(output.key, _output_bytes(output)) for output in outputs], limit)
    by_key = {output.key: output for output in outputs}
    created = not target.exists()
    target.mkdir(parents=True, exist_ok=True)
    try:
        _write(target, source, metadata, [[by_key[key] for key in shard] for shard in shards], progress, config)
    except BaseException:
        if created:
            shutil.rmtree(target, ignore_errors=True)
        raise
    if config is None and not (target / CONFIG_NAME).is_file():
        log.warning(f"{target} has no {CONFIG_NAME}, which from_pretrained needs: save it with"
                    f" model.config.save_pretrained({str(target)!r}), or pass hf_config (--hf-config).")
    return target


def plan_shards(sizes: list[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """Splits ``(name, bytes)`` pairs, in order, into shards as ``save_pretrained`` does: a new
    shard when the next tensor would push the current one over ``max_shard_size``; a tensor larger
    than that in a shard of its own."""
    shards: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name, nbytes in sizes:
        if nbytes > max_shard_size:
            shards.append([name])
            continue
        if current and size + nbytes > max_shard_size:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current or not shards:
        shards.append(current)
    return shards


def shard_names(count: int) -> list[str]:
    """Hugging Face's file names for ``count`` shards."""
    if count == 1:
        return [WEIGHTS_NAME]
    return [f"model-{number:05d}-of-{count:05d}.safetensors" for number in range(1, count + 1)]


@dataclasses.dataclass(frozen=True)
class _Output:
    """One tensor of the export: ``key``, made of the checkpoint's ``parts`` (one, or, for a GPT-2
    block converted by parallelize_hf_gpt2, its q, k and v: see [Note: tensor-parallel GPT-2])."""

    key: str
    parts: list[_Entry]
    shape: tuple[int, ...]
    dtype: torch.dtype


def _outputs(entries: list[_Entry]) -> list[_Output]:
    """GPT-2's own keys and layouts for blocks converted by parallelize_hf_gpt2 (the checkpoint
    holds the converted model: q/k/v Linears, transposed projections), which from_pretrained needs;
    every other entry as it is."""
    from lightning_zero.parallel.plans import hf_gpt2_key_plan

    by_key = {entry.key: entry for entry in entries}
    return [_Output(key, [by_key[part] for part in parts], shape, by_key[parts[0]].dtype)
            for key, parts, shape in hf_gpt2_key_plan({entry.key: entry.shape for entry in entries})]


def _output_bytes(output: _Output) -> int:
    return math.prod(output.shape) * output.dtype.itemsize


def _config_file(path: Path) -> Path:
    """The config.json ``hf_config`` names, checked to be a JSON object before any work is done."""
    file = path / CONFIG_NAME if path.is_dir() else path
    if not file.is_file():
        where = f"{path} has no {CONFIG_NAME}" if path.is_dir() else f"{path} does not exist"
        raise ValueError(f"hf_config: {where}. Pass a Hugging Face config.json (or the directory"
                         " model.config.save_pretrained wrote).")
    try:
        content = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"hf_config: {file} is not JSON ({error}); pass a Hugging Face config.json.") from error
    if not isinstance(content, dict):
        raise ValueError(f"hf_config: {file} holds a JSON {type(content).__name__}, not the object a config.json is.")
    return file


def _check_output(target: Path, overwrite: bool) -> None:
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"{target} is a file, not a directory: a Hugging Face export is a directory."
                                 " Pass a new directory.")
    if target.is_dir() and not overwrite and any(target.iterdir()):
        raise FileExistsError(f"{target} exists and is not empty: pass overwrite=True (--overwrite) to write the"
                              " model into it (its model*.safetensors files are replaced, other files kept), or"
                              " choose a new directory.")


def _detected_prefix(meta: CheckpointMeta) -> str:
    """The attribute holding the model when a Trainer wrote the checkpoint and every key is under
    one attribute; "" otherwise (see the note for why bare modules are left as they are)."""
    if _LIGHTNING_KEY not in meta.lightning or not meta.model_keys:
        return ""
    heads = {key.partition(".")[0] for key in meta.model_keys}
    if len(heads) == 1 and all("." in key for key in meta.model_keys):
        return f"{heads.pop()}."
    return ""


def _uncompiled(key: str) -> str:
    """``key`` as the module had it before torch.compile: ``torch.compile(module)`` returns a
    wrapper that holds the module as ``_orig_mod``, so a LightningModule that assigned it
    (``self.model = torch.compile(self.model)``, or a compiled block) saves that segment in its keys,
    which no Hugging Face model has: from_pretrained would match none of them."""
    return ".".join(part for part in key.split(".") if part != "_orig_mod")


def _refuse_adapter_layers(source: Path, keys: list[str]) -> None:
    """peft wraps each adapted layer, so its base weights are saved as ``...base_layer.weight``
    beside ``...lora_A.default.weight``: no Hugging Face base model has those names, and
    from_pretrained would load none of the adapted layers, initializing them at random with a log
    line only. Such a checkpoint is refused with the ways to export it; a module of the user's own
    named ``base_layer``, with no adapter beside it, is not peft's and exports as it is."""
    wrapped = [key for key in keys if ".base_layer." in f".{key}"]
    adapters = [key for key in keys if any(f".{name}" in f".{key}" for name in _ADAPTER_NAMES)]
    if not wrapped or not adapters:
        return
    raise CheckpointError(
        f"{source} holds peft adapter layers ({', '.join(repr(key) for key in (wrapped[:1] + adapters[:1]))}, ...):"
        " a Hugging Face model's from_pretrained knows none of these names and would initialize every adapted layer"
        " at random. Merge the adapters into the base weights before the checkpoint is written (peft's"
        " merge_and_unload()) and export that, save the adapters alone with peft's save_pretrained, or keep the"
        " keys as saved with `lightning-zero consolidate` to a .safetensors or .pt file."
    )


# Names peft gives its adapters' parameters and modules (LoRA, DoRA, IA3) beside ``base_layer``.
_ADAPTER_NAMES = ("lora_A.", "lora_B.", "lora_embedding_A.", "lora_embedding_B.", "lora_magnitude_vector.", "ia3_l.")


def _exported_entries(source: Path, meta: CheckpointMeta, model: dict[str, Any],
                      strip_prefix: str | None) -> list[_Entry]:
    """The tensors to write, renamed, in state-dict order: the prefix stripped, ties left out."""
    prefix = _detected_prefix(meta) if strip_prefix is None else strip_prefix
    if prefix and not prefix.endswith("."):
        prefix += "."  # "model" means the attribute model, not every key starting with "model"
    if prefix:
        inside = [key for key in model if key.startswith(prefix)]
        if not inside:
            raise ValueError(f"strip_prefix={prefix!r}: no key of {source} starts with it (its keys:"
                             f" {', '.join(list(model)[:5])}{' ...' if len(model) > 5 else ''}). Pass the attribute"
                             " that holds the Hugging Face model, or '' to keep the keys as saved.")
        outside = [key for key in model if not key.startswith(prefix)]
        if outside:
            log.warning(f"{len(outside)} key(s) of {source} are not under {prefix!r} and are left out of the export:"
                        f" {outside[:5]}{' ...' if len(outside) > 5 else ''}")
        if strip_prefix is None:
            log.info(f"stripping the prefix {prefix!r} shared by every key of {source} (pass strip_prefix='' to keep it)")
    else:
        inside = list(model)
    _refuse_adapter_layers(source, inside)
    extra = [key for key in inside if not isinstance(model[key], _Entry)]
    if extra:
        log.warning(f"the export leaves out the module's non-tensor state {extra[:5]}: safetensors stores tensors only.")
    kept = set(inside)
    entries = []
    for key in inside:
        entry = model[key]
        if not isinstance(entry, _Entry):
            continue
        if meta.aliases.get(key) in kept:
            continue  # a tied weight: written once, under the name it is tied to (see the note)
        entries.append(dataclasses.replace(entry, key=_uncompiled(key[len(prefix):])))
    if not entries:
        raise CheckpointError(f"{source} holds no tensors to export.")
    return entries


def _write(target: Path, source: Path, metadata: Metadata, shards: list[list[_Output]], progress: bool,
           config: Path | None) -> None:
    """Every shard under a temporary name first, then renamed into place, then the index: an
    interrupted export never leaves a directory that looks complete."""
    from safetensors.torch import save_file

    from lightning_zero.parallel.plans import _gpt2_to_hf, gpt2_converted_prefixes

    names = shard_names(len(shards))
    token = secrets.token_hex(6)
    temporary = [target / f".{name}.{os.getpid()}.{token}.tmp" for name in names]
    parts = [part for shard in shards for output in shard for part in output.parts]
    converted = gpt2_converted_prefixes(part.key for part in parts)
    stream = _stream(source, metadata, parts, progress, by_key=True)
    freed = _FreedMemory()
    try:
        for shard, path in zip(shards, temporary):
            read = dict(itertools.islice(stream, sum(len(output.parts) for output in shard)))
            tensors = _gpt2_to_hf(read, converted) if converted else read
            del read
            save_file(tensors, str(path), metadata={"format": "pt"})
            nbytes = sum(_output_bytes(output) for output in shard)
            del tensors  # before the next shard is read: memory stays about one shard
            freed.written(nbytes)
        stream.close()
        for path, name in zip(temporary, names):
            os.replace(path, target / name)
    except BaseException:
        stream.close()
        for path in temporary:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        raise
    if len(shards) > 1:
        weight_map = {output.key: name for shard, name in zip(shards, names) for output in shard}
        total = sum(_output_bytes(output) for shard in shards for output in shard)
        _write_text(target / INDEX_NAME, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                    indent=2, sort_keys=True) + "\n")
    if config is not None:
        _write_text(target / CONFIG_NAME, config.read_text(encoding="utf-8"))
    _remove_stale(target, set(names) | ({INDEX_NAME} if len(shards) > 1 else set()))


def _write_text(path: Path, text: str) -> None:
    with _atomic_output(path) as handle:
        handle.write(text.encode("utf-8"))


def _remove_stale(target: Path, written: set[str]) -> None:
    """Weight files and an index of an earlier export (``overwrite``) that from_pretrained would
    otherwise mix with this one."""
    for path in target.iterdir():
        stale = _WEIGHT_FILE.fullmatch(path.name) is not None or path.name == INDEX_NAME
        if stale and path.name not in written and path.is_file():
            path.unlink()


def exported_files(directory: str | os.PathLike) -> list[Path]:
    """The weight files of a Hugging Face export, in order (for reporting)."""
    return sorted(path for path in Path(directory).iterdir() if _WEIGHT_FILE.fullmatch(path.name))
