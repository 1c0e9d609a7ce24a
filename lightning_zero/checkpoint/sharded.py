"""Sharded checkpoints on torch.distributed.checkpoint (DCP), loadable at any world size.

[Note: checkpoint layout]
A checkpoint is a directory written by DCP: each rank writes the elements it owns, in parallel,
and ``.metadata`` records every tensor's *global* shape and which rectangular chunks hold it.
Every ZeRO layout gives each rank one contiguous range of each flattened parameter (stages 1/2:
the part of the parameter inside the rank's chunk of its bucket; stage 3: the rank's padded
piece). A flat range of an n-d tensor is a union of at most 2n-1 boxes (a partial row, whole
rows, a partial row, recursively), each itself contiguous in memory, so it is saved as a
``ShardedTensor`` whose local shards are views of the master shard: nothing is copied to save,
and DCP reads any other layout back by intersecting boxes. That is what makes a checkpoint
written by 4 ranks at stage 3 load into 2 ranks at stage 2, or into 1 rank, with no conversion.
``.metadata`` also holds a CRC-32 of every record, verified before anything is loaded (see
[Note: checkpoint checksums] in checksums.py).

Keys of the DCP state dict:
  ``model.<state-dict key>``                      weights, fp32 master values for trained params;
                                                  buffers and params outside the optimizers whole,
                                                  from rank 0; extra state pickled
  ``optimizer_<i>.<param name>.<state key>``     per-element state with the parameter's shape,
                                                  per-parameter scalars (Adam's step) as they are
  ``lightning_zero``                              one pickled dict (:class:`CheckpointMeta` fields):
                                                  format version, param groups by parameter name,
                                                  tied-weight aliases, and the rest of Lightning's
                                                  checkpoint (loops, callbacks, schedulers, ...)

[Note: atomic save]
All ranks write into ``.<name>.partial`` next to the target; once DCP has written ``.metadata``
(after every rank's data), rank 0 swaps it into place with one ``renameat2(RENAME_EXCHANGE)``
and deletes the old one. Where the filesystem cannot exchange, the old checkpoint is first
renamed to ``.<name>.previous``; a crash between the two renames leaves it there, and
:func:`resolve_checkpoint_path` falls back to it. A crash at any other moment leaves the
previous checkpoint untouched at its name, and the partial directory is removed by the next save.
Only a checkpoint (or an empty directory) is replaced: a directory that holds anything else is the
user's (a run's root directory, a dataset), and the save refuses it on every rank before writing.
A whole checkpoint (one file, ``state_dict_type="full"``) saved where a sharded one is replaces it
the same way (:func:`commit_checkpoint`, whose exchange swaps a file with a directory as well):
Lightning's own file save would move its file into the directory and report success, leaving the
old checkpoint at the name.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import io
import logging
import math
import os
import shutil
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from lightning_zero._messages import some_of
from lightning_zero.checkpoint.checksums import (
    ChecksummingWriter,
    CheckpointError,
    NamingReader,
    agree,
    named_errors,
    reason,
    under,
    verify,
    verify_share,
)
from lightning_zero.zero.layout import Range

log = logging.getLogger(__name__)

FORMAT_NAME = "lightning_zero.sharded"
FORMAT_VERSION = 2  # 2: may record the mesh it was written on (CheckpointMeta.parallel)
# A checkpoint without a mesh record is still written as version 1, which every release reads.
_FORMAT_VERSION_WITHOUT_MESH = 1
META_KEY = "lightning_zero"
MODEL_KEY = "model"
METADATA_FILE = ".metadata"


@contextmanager
def quiet_dcp() -> Iterator[None]:
    """DCP warns that ShardedTensor is deprecated in favour of DTensor, but DTensor placements cannot
    express ZeRO's flat-range shards (see the note), and that a load without a process group
    is a single-process load, which is what we ask for."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor.*")
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
        yield


def optimizer_key(index: int) -> str:
    return f"optimizer_{index}"


@dataclass
class CheckpointMeta:
    """What a sharded checkpoint says about itself, beyond tensors (saved as one pickled object)."""

    world_size: int
    stage: int
    model_keys: list[str]  # every key of the module's state dict, aliases included, in order
    aliases: dict[str, str]  # tied weights: state-dict key -> the key its data is saved under
    param_dtypes: dict[str, str]  # the dtype each parameter is computed in (its saved value is fp32)
    # One entry per optimizer: {"class", "param_groups" (params by name), "per_element" (state
    # keys shaped like the parameter)}; empty for a weights-only checkpoint.
    optimizers: list[dict[str, Any]] = field(default_factory=list)
    lightning: dict[str, Any] = field(default_factory=dict)  # the rest of Lightning's checkpoint
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION
    # On a mesh, what wrote it (for the record: the tensors are global whatever it was): the
    # sizes {"data", "tensor", "shard"} and each tensor-parallel parameter's placement by name,
    # e.g. {"blocks.0.attn.qkv.weight": "Shard(dim=0)"} (see [Note: checkpoint layout with a mesh]).
    parallel: dict[str, Any] = field(default_factory=dict)

    def to_entry(self) -> io.BytesIO:
        entry = dict(self.__dict__)
        if not entry["parallel"]:
            # As before meshes existed, so that older readers take it; with a record, an older
            # reader says "upgrade" instead of failing on the unknown field.
            del entry["parallel"]
            entry["version"] = _FORMAT_VERSION_WITHOUT_MESH
        return object_entry(entry)

    @classmethod
    def from_dict(cls, path: Path, value: Any) -> CheckpointMeta:
        value = from_object_entry(value, path, META_KEY)
        if not isinstance(value, dict) or value.get("format") != FORMAT_NAME:
            raise CheckpointError(f"{path} is a torch.distributed.checkpoint directory but not one written by"
                                  " lightning_zero (no lightning_zero metadata). Load it with torch.distributed.checkpoint.")
        if value.get("version", 0) > FORMAT_VERSION:
            raise CheckpointError(f"{path} has lightning_zero checkpoint format {value['version']}, newer than this"
                                  f" lightning_zero reads ({FORMAT_VERSION}): upgrade lightning-zero.")
        return cls(**value)


def object_entry(value: Any) -> io.BytesIO:
    """A DCP entry holding one Python object: pre-serialized, since DCP would flatten a dict into
    one entry per key (and fill a tensor in place rather than hand it back)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return buffer


def from_object_entry(value: Any, path: Path, key: str) -> Any:
    """The object of an :func:`object_entry`, as DCP hands it back (a BytesIO) from the entry
    ``key`` of the checkpoint at ``path``."""
    if not isinstance(value, io.BytesIO):
        return value
    value.seek(0)
    try:
        return torch.load(value, map_location="cpu", weights_only=False)
    except Exception as error:  # noqa: BLE001 - whatever unpickling raises, the record is damaged
        raise CheckpointError(f"The checkpoint {path} is damaged: its entry '{key}' cannot be unpickled"
                              f" ({reason(error)}). Load an earlier checkpoint.") from error


# ---------------------------------------------------------------------------------------- layout
def flat_range_boxes(shape: Sequence[int], start: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...], Range]]:
    """Splits the elements [start, end) of a row-major tensor of ``shape`` into boxes.

    Returns (offsets, sizes, flat range) per box, in flat order; each box is contiguous in the
    flattened tensor, so its data is ``flat[range].view(sizes)``.
    """
    if start >= end:
        return []
    if len(shape) == 0:
        return [((), (), Range(start, end))]
    inner = math.prod(shape[1:])
    first_row, last_row = start // inner, (end - 1) // inner
    if first_row == last_row:
        base = first_row * inner
        if start - base == 0 and end - base == inner:
            return [((first_row,) + (0,) * (len(shape) - 1), (1, *shape[1:]), Range(start, end))]
        return [
            ((first_row, *offsets), (1, *sizes), Range(flat.start + base, flat.end + base))
            for offsets, sizes, flat in flat_range_boxes(shape[1:], start - base, end - base)
        ]
    boxes = []
    whole_from, whole_to = first_row, last_row + 1
    if start % inner:
        boxes += flat_range_boxes(shape, start, (first_row + 1) * inner)
        whole_from = first_row + 1
    tail = []
    if end % inner:
        tail = flat_range_boxes(shape, last_row * inner, end)
        whole_to = last_row
    if whole_to > whole_from:
        boxes.append(((whole_from,) + (0,) * (len(shape) - 1), (whole_to - whole_from, *shape[1:]),
                      Range(whole_from * inner, whole_to * inner)))
    return boxes + tail


@dataclass(frozen=True)
class FlatShards:
    """How one tensor's elements are split over ranks: ``ranges[r]`` is the part of the
    flattened tensor rank r holds (ranges are disjoint and cover it).

    Under tensor parallelism the tensor split by ``ranges`` is one block of a larger global tensor
    (see [Note: checkpoint layout with a mesh]): ``global_shape`` is that tensor's, and
    ``blocks`` lists, for every block, where it starts and the global rank holding each range of
    it; ``block`` is the one this rank holds. Without them the tensor is the whole one and the
    ranges' holders are the ranks of the group.
    """

    shape: tuple[int, ...]
    ranges: tuple[Range, ...]
    global_shape: tuple[int, ...] | None = None
    blocks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = ()  # (offsets, holder rank per range)
    block: int = 0

    def sharded_tensor(self, local: Tensor, rank: int, group: dist.ProcessGroup | None) -> ShardedTensor:
        """``local`` [ranges[rank].size], 1-d: this rank's elements. The result's local shards are
        views of it, so a DCP load writes straight into ``local``."""
        if local.numel() != self.ranges[rank].size:
            raise ValueError(f"rank {rank} holds {local.numel()} elements but its range is {self.ranges[rank]}")
        blocks = self.blocks
        if not blocks:
            global_ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(self.ranges)))
            blocks = (((0,) * len(self.shape), tuple(global_ranks)),)
        device = local.device
        shards_md: list[ShardMetadata] = []
        local_shards: list[Shard] = []
        for number, (origin, holders) in enumerate(blocks):
            for owner, owned in enumerate(self.ranges):
                for offsets, sizes, flat in flat_range_boxes(self.shape, owned.start, owned.end):
                    placed = [origin[d] + offsets[d] for d in range(len(offsets))]
                    md = ShardMetadata(placed, list(sizes), f"rank:{holders[owner]}/{device}")
                    shards_md.append(md)
                    if owner == rank and number == self.block:
                        piece = local[flat.start - owned.start : flat.end - owned.start].view(sizes)
                        local_shards.append(Shard(piece, md))
        properties = TensorProperties(dtype=local.dtype, layout=torch.strided, requires_grad=False,
                                      memory_format=torch.contiguous_format, pin_memory=local.is_pinned())
        shape = self.global_shape if self.global_shape is not None else self.shape
        metadata = ShardedTensorMetadata(shards_md, torch.Size(shape), properties)
        with quiet_dcp():
            return ShardedTensor._init_from_local_shards_and_global_metadata(local_shards, metadata, process_group=group)


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    return Path(path).is_dir() and (Path(path) / METADATA_FILE).is_file()


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_of(group: dist.ProcessGroup | None) -> int:
    """This process's rank in ``group``; 0 in a single process without a process group."""
    return dist.get_rank(group) if is_distributed() else 0


# ---------------------------------------------------------------------------------------- save
def _staging_path(path: Path) -> Path:
    return path.parent / f".{path.name}.partial"


def _previous_path(path: Path) -> Path:
    return path.parent / f".{path.name}.previous"


def save_sharded(path: str | os.PathLike, state: dict[str, Any], group: dist.ProcessGroup | None = None,
                 checksums: bool = True) -> None:
    """Writes ``state`` (plain tensors are taken as replicated, ShardedTensors as sharded, other
    objects are pickled) as a DCP checkpoint at ``path``, atomically (see [Note: atomic save]),
    with a checksum of every record unless ``checksums`` is False (see [Note: checkpoint checksums]
    in checksums.py).

    A collective when a process group is initialized: every rank calls it with its own shards.
    """
    target = Path(path)
    distributed = is_distributed()
    rank = rank_of(group)
    staging = _staging_path(target)
    refusal: list[str | None] = [None]
    if rank == 0:
        refusal[0] = _not_replaceable(target)
        if refusal[0] is None:
            if staging.exists():
                shutil.rmtree(staging)  # a save that crashed before its rename
            staging.mkdir(parents=True)
    if distributed:  # also the barrier before any rank writes into the staging directory
        source = 0 if group is None else dist.get_global_rank(group, 0)
        dist.broadcast_object_list(refusal, src=source, group=group)
    if refusal[0] is not None:
        raise CheckpointError(refusal[0])
    writer = (ChecksummingWriter if checksums else dcp.FileSystemWriter)(staging, sync_files=True)
    with quiet_dcp():
        dcp.save(state, storage_writer=writer, process_group=group, no_dist=not distributed)
    if rank == 0:
        commit_checkpoint(staging, target)
    if distributed:
        dist.barrier(group=group)


def _not_replaceable(target: Path, kind: str = "a sharded checkpoint") -> str | None:
    """Why a save of ``kind`` must not replace ``target`` (see [Note: atomic save]), or None."""
    if not target.is_dir() or is_sharded_checkpoint(target):
        return None
    entries = sorted(entry.name for entry in target.iterdir())
    if not entries:
        return None
    shown = some_of(entries, quoted=False)
    return (
        f"Cannot save {kind} at {target}: it is a directory that is not a checkpoint (it holds"
        f" {shown}), and the save would replace it with everything in it. Save to a path of its own, e.g."
        f" {target / 'model.ckpt'}, or remove the directory first if nothing in it is needed."
    )


def commit_checkpoint(staging: Path, target: Path) -> None:
    """Puts the complete checkpoint ``staging`` (a directory, or a whole checkpoint's file) at
    ``target``; the old one survives any crash, at ``.<name>.previous`` between two renames."""
    _commit(staging, target)
    _fsync_directory(target.parent)  # the rename itself survives a power cut


def _commit(staging: Path, target: Path) -> None:
    previous = _previous_path(target)
    if not target.exists() and not target.is_symlink():
        os.rename(staging, target)
        if previous.exists():
            _remove(previous)  # left by an interrupted replacement; superseded now
        return
    if target.is_dir() and not target.is_symlink() and _exchange(staging, target):
        shutil.rmtree(staging)  # now the old checkpoint
        return
    if previous.exists():
        _remove(previous)
    os.rename(target, previous)
    os.rename(staging, target)
    _remove(previous)


def whole_save_plan(target: Path) -> tuple[str, str | None]:
    """How a whole (one-file) checkpoint is saved at ``target``: ("write", None) where nothing or a
    file is; ("replace", None) where a sharded checkpoint or an empty directory is (write beside it,
    then :func:`commit_checkpoint`); ("refuse", why) where a directory holds anything else."""
    if not target.is_dir():
        return "write", None
    refusal = _not_replaceable(target, kind="a whole checkpoint file")
    return ("refuse", refusal) if refusal is not None else ("replace", None)


def whole_staging_path(target: Path) -> Path:
    """Where a whole checkpoint bound for the directory ``target`` is written first."""
    return target.parent / f".{target.name}.partial-file"


def _fsync_directory(directory: Path) -> None:
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # not every platform opens directories
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swaps two directory entries (Linux renameat2 RENAME_EXCHANGE); False if unsupported."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    result = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    if result == 0:
        return True
    if ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(ctypes.get_errno(), f"renameat2({a}, {b}, RENAME_EXCHANGE) failed")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def remove_checkpoint(path: str | os.PathLike) -> None:
    """Deletes a checkpoint file or directory (what ModelCheckpoint does with checkpoints it no longer keeps)."""
    target = Path(path)
    if target.exists() or target.is_symlink():
        _remove(target)


# ---------------------------------------------------------------------------------------- load
def resolve_checkpoint_path(path: str | os.PathLike) -> Path:
    """The checkpoint at ``path``, or the previous version an interrupted swap left (see the note)."""
    target = Path(path)
    if target.exists():
        return target
    previous = _previous_path(target)
    if is_sharded_checkpoint(previous):
        log.warning(f"{target} does not exist, but {previous} does: a save was interrupted while replacing it."
                    " Loading the previous checkpoint.")
        return previous
    hint = ""
    if _staging_path(target).exists():
        hint = (f" {_staging_path(target)} exists: a save to this path was interrupted before it completed, so"
                " it never became a checkpoint.")
    raise CheckpointError(f"No checkpoint at {target}: the path does not exist.{hint} Pass the path of a"
                          " checkpoint directory or file that ModelCheckpoint or trainer.save_checkpoint wrote.")


def read_metadata(path: Path) -> Metadata:
    """DCP's metadata of a checkpoint directory, after checking every data file it names is complete."""
    if not (path / METADATA_FILE).is_file():
        raise CheckpointError(_why_not_a_checkpoint(path))
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as error:  # noqa: BLE001 - any unpickling failure means the same thing here
        raise CheckpointError(f"{path / METADATA_FILE} cannot be read ({type(error).__name__}: {error}): the"
                              " checkpoint is damaged. Load an earlier checkpoint.") from error
    _check_files_complete(path, metadata)
    return metadata


def _why_not_a_checkpoint(path: Path) -> str:
    """What the directory ``path`` without DCP's metadata file is, and what to do: a DeepSpeed
    checkpoint (convert it), a folder of checkpoints (pass one), or a save that never finished."""
    entries = sorted(path.iterdir())
    deepspeed_files = [entry for entry in entries if entry.name in ("latest", "zero_to_fp32.py")
                       or (entry.is_dir() and any(entry.glob("*_model_states.pt")))]
    if deepspeed_files or any(path.glob("*_model_states.pt")):
        held = ", ".join(entry.name for entry in deepspeed_files[:3]) or "DeepSpeed model states"
        return (f"{path} is a DeepSpeed checkpoint (it holds {held}), not a lightning_zero one. Convert it to one"
                f" file first, with DeepSpeed's"
                f" {path / 'zero_to_fp32.py'} or lightning.pytorch.utilities.deepspeed."
                "convert_zero_checkpoint_to_fp32_state_dict, and load that file.")
    inner = [entry.name for entry in entries if is_sharded_checkpoint(entry) or entry.suffix in (".ckpt", ".pt")]
    if inner:
        shown = some_of(inner, shown=3, quoted=False)
        return (f"{path} is a directory that holds checkpoints ({shown}), not a checkpoint itself: pass one of them,"
                f" e.g. {path / inner[-1]}.")
    return (f"{path} is a directory but not a complete checkpoint: it has no {METADATA_FILE} file, which DCP"
            " writes last. It may be a save that was interrupted; load the previous checkpoint instead.")


def _check_files_complete(path: Path, metadata: Metadata) -> None:
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{path} is missing its data file {name}: the checkpoint is incomplete."
                                  " Load an earlier checkpoint.")
        actual = file.stat().st_size
        if actual < size:
            raise CheckpointError(f"{file} is truncated: it has {actual} bytes, the checkpoint's metadata needs"
                                  f" {size}. Load an earlier checkpoint.")


def read_meta(path: Path, metadata: Metadata | None = None) -> CheckpointMeta:
    """The checkpoint's own description (read by this process alone; no collective)."""
    metadata = metadata or read_metadata(path)
    if not isinstance(metadata.state_dict_metadata.get(META_KEY), BytesStorageMetadata):
        raise CheckpointError(f"{path} is a torch.distributed.checkpoint directory but was not written by"
                              " lightning_zero (it has no 'lightning_zero' entry).")
    holder = read_local(path, metadata, [META_KEY])
    return CheckpointMeta.from_dict(path, holder[META_KEY])


def read_local(path: Path, metadata: Metadata, keys: Sequence[str], targets: dict[str, Any] | None = None) -> dict[str, Any]:
    """Reads the DCP entries ``keys`` (into ``targets`` where given, else as objects) in this process
    alone, after verifying their checksums; no collective."""
    holder: dict[str, Any] = targets if targets is not None else dict.fromkeys(keys)
    message = verify(path, metadata, under(list(keys)))
    if message is not None:
        raise CheckpointError(message)
    with quiet_dcp(), named_errors():
        dcp.load(holder, storage_reader=NamingReader(path), no_dist=True)
    return holder


def load_sharded(path: Path, metadata: Metadata, state: dict[str, Any], group: dist.ProcessGroup | None = None,
                 verified: bool = False) -> None:
    """Reads into ``state`` (in place: ShardedTensors' local shards and plain tensors are filled,
    other entries replaced), after the ranks verified the checksums of every record it reads
    unless ``verified`` (so a damaged checkpoint loads nothing). A collective when a process group
    is initialized."""
    if not verified:
        agree(verify_share(path, metadata, under(list(state)), group), group)
    with quiet_dcp(), named_errors():
        dcp.load(state, storage_reader=NamingReader(path), process_group=group, no_dist=not is_distributed())


def saved_state_keys(metadata: Metadata, prefix: str) -> dict[str, dict[str, Any]]:
    """Of an optimizer's entries (``<prefix>.<param name>.<state key>``): per parameter name, its
    saved state keys and their storage metadata."""
    result: dict[str, dict[str, Any]] = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(prefix + "."):
            name, state_key = key[len(prefix) + 1 :].rsplit(".", 1)
            result.setdefault(name, {})[state_key] = md
    return result


def describe_mismatch(
    path: Path,
    missing: Sequence[str],
    unexpected: Sequence[str],
    wrong_shapes: Mapping[str, tuple[Sequence[int], Sequence[int]]],
    strict: bool,
) -> str | None:
    """An error message for a checkpoint that does not fit the model, or None if it fits."""
    problems = []
    if strict and missing:
        problems.append(f"missing keys (in the model, not in the checkpoint): {some_of(missing, shown=10)}")
    if strict and unexpected:
        problems.append(f"unexpected keys (in the checkpoint, not in the model): {some_of(unexpected, shown=10)}")
    if wrong_shapes:
        shapes = ", ".join(f"'{k}' checkpoint {tuple(saved)} vs model {tuple(mine)}" for k, (saved, mine) in
                           list(wrong_shapes.items())[:10])
        problems.append(f"shape mismatches: {shapes}")
    if not problems:
        return None
    fix = "Load a checkpoint of this model"
    if not wrong_shapes:
        fix += ", or set `strict_loading = False` on the LightningModule to load the keys both have"
    return f"The checkpoint {path} does not fit the model: " + "; ".join(problems) + f". {fix}. Nothing was loaded."


