"""Checksums of every record of a sharded checkpoint, written with it and verified before use.

[Note: checkpoint checksums]
DCP writes each item of the state dict (a tensor box, serialized by ``torch.save``, or a pickled
object) as one record: a byte range of a rank's ``__<rank>_0.distcp`` file. Each record gets a
CRC-32 of its stored bytes. The writer reads each record back right after writing it (from the
page cache) rather than hashing while DCP writes, because DCP's writing goes through private
stream helpers; re-reading needs only the (file, offset, length) DCP reports for each record.
The ranks' checksums travel to the coordinator with DCP's own write results, and the table is
pickled inside ``.metadata`` itself (an attribute of DCP's ``Metadata``, plain builtins only, so
torch alone still reads the checkpoint): the table exists exactly when the checkpoint is
complete, and no file can be lost apart from it.

CRC-32 (zlib) rather than a cryptographic hash: it runs at memory speed (about 4 GB/s on one
core, against 0.9 GB/s for blake2b), and finds every burst of up to 32 flipped bits and any other
accidental damage but for a 2**-32 chance. It does not defend against a forger, which nothing
here could: the checkpoint's pickled entries are unpickled, so it must come from someone trusted.

On load, every record that will be read is verified *before* DCP copies anything, so a
mismatch loads nothing: the ranks split the records between them by bytes (the checkpoint is
read once in all, however many ranks), agree on the outcome with one ``all_gather_object``
(together with the checks of the model and the optimizers that come before it: see
:func:`agree`), and each raises the same :class:`CheckpointError`. Memory stays bounded:
records are hashed in chunks of ``_CHUNK_BYTES``. Checkpoints written before checksums existed
have no table; they load as before, after a one-time note.
"""

from __future__ import annotations

import io
import logging
import pickle
import zipfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

log = logging.getLogger(__name__)

CHECKSUMS_ATTRIBUTE = "lightning_zero_checksums"
ALGORITHM = "crc32"
_CHUNK_BYTES = 16 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as asked; the message names the path, the keys and the fix."""


@dataclass(frozen=True)
class Record:
    """One stored item: where its bytes are and what they belong to."""

    file: str  # relative to the checkpoint directory
    offset: int
    length: int
    key: str  # the DCP key, e.g. "model.embed.weight"
    box: tuple[int, ...] | None  # a tensor piece's offsets in the whole tensor

    def describe(self) -> str:
        """'entry ..., bytes a..b of file': enough to find the record with a hex editor."""
        where = f" (its piece at offsets {self.box})" if self.box else ""
        return f"entry '{self.key}'{where}, bytes {self.offset}..{self.offset + self.length} of {self.file}"


def records(metadata: Metadata, wanted: Callable[[str], bool] = lambda key: True) -> list[Record]:
    """The stored records of the DCP keys ``wanted`` accepts, in file and offset order."""
    found = [_record_of(metadata, index, info) for index, info in (metadata.storage_data or {}).items()
             if wanted(index.fqn)]
    return sorted(found, key=lambda r: (r.file, r.offset))


def _record_of(metadata: Metadata, index: MetadataIndex, info: Any) -> Record:
    # A piece's offsets only say something when the tensor was saved in several pieces.
    chunks = getattr(metadata.state_dict_metadata.get(index.fqn), "chunks", ())
    box = tuple(index.offset) if index.offset is not None and len(chunks) > 1 else None
    return Record(info.relative_path, info.offset, info.length, index.fqn, box)


def under(keys: Sequence[str]) -> Callable[[str], bool]:
    """Accepts the DCP keys at or below any of ``keys`` (DCP joins nested keys with dots)."""
    prefixes = tuple(key + "." for key in keys)
    exact = set(keys)
    return lambda key: key in exact or key.startswith(prefixes)


def checksum_table(path: Path, metadata: Metadata) -> dict[str, dict[int, int]] | None:
    """{file: {offset: crc32}}, or None for a checkpoint written before checksums."""
    table = getattr(metadata, CHECKSUMS_ATTRIBUTE, None)
    if table is None:
        return None
    if table.get("algorithm") != ALGORITHM:
        raise CheckpointError(f"{path} records checksums of kind {table.get('algorithm')!r}, which this lightning_zero"
                              f" does not know (it knows {ALGORITHM!r}): upgrade lightning-zero.")
    return table["records"]


# ---------------------------------------------------------------------------------------- save
class ChecksummingWriter(dcp.FileSystemWriter):
    """DCP's file writer, and a CRC-32 of every record it wrote recorded in ``.metadata``."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        written = super().write_data(plan, planner).wait()  # FileSystemWriter writes before returning
        crcs = record_crcs(Path(self.path), [(r.storage_data.relative_path, r.storage_data.offset,
                                           r.storage_data.length) for r in written])
        # The coordinator gathers these results for finish(): the checksum rides along with each.
        results = [WriteResult(r.index, r.size_in_bytes, (r.storage_data, crc)) for r, crc in zip(written, crcs)]
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        table: dict[str, dict[int, int]] = {}
        plain = []
        for rank_results in results:
            plain.append([WriteResult(r.index, r.size_in_bytes, r.storage_data[0]) for r in rank_results])
            for r in rank_results:
                info, crc = r.storage_data
                table.setdefault(info.relative_path, {})[info.offset] = crc
        setattr(metadata, CHECKSUMS_ATTRIBUTE, {"algorithm": ALGORITHM, "records": table})
        super().finish(metadata, plain)


def record_crcs(directory: Path, spans: Sequence[tuple[str, int, int]]) -> list[int]:
    """CRC-32 of each (file, offset, length), each file opened once."""
    result: dict[tuple[str, int], int] = {}
    by_file: dict[str, list[tuple[int, int]]] = {}
    for file, offset, length in spans:
        by_file.setdefault(file, []).append((offset, length))
    for file, pieces in by_file.items():
        with open(directory / file, "rb") as handle:
            for offset, length in sorted(pieces):
                result[(file, offset)] = _crc(handle, offset, length)
    return [result[(file, offset)] for file, offset, _ in spans]


def _crc(handle: Any, offset: int, length: int) -> int:
    handle.seek(offset)
    crc = 0
    left = length
    while left > 0:
        chunk = handle.read(min(left, _CHUNK_BYTES))
        if not chunk:
            break  # shorter than recorded: the CRC cannot match
        crc = zlib.crc32(chunk, crc)
        left -= len(chunk)
    return crc


# ---------------------------------------------------------------------------------------- load
_noted: set[str] = set()


def verify(path: Path, metadata: Metadata, wanted: Callable[[str], bool], share: tuple[int, int] = (0, 1)) -> str | None:
    """Checks this process's share ``(rank, world)`` of the records ``wanted`` accepts against the
    checksum table; the error message of the first mismatch, or None. No collective."""
    table = checksum_table(path, metadata)
    if table is None:
        _note_unverified(path)
        return None
    mine = _my_share(records(metadata, wanted), *share)
    by_file: dict[str, list[Record]] = {}
    for record in mine:
        by_file.setdefault(record.file, []).append(record)
    for file, file_records in by_file.items():
        with open(path / file, "rb") as handle:
            for record in file_records:
                expected = table.get(record.file, {}).get(record.offset)
                if expected is None:
                    return (f"The checkpoint {path} records no checksum for {record.describe()}: its .metadata is"
                            " damaged or was edited. Load an earlier checkpoint. Nothing was loaded.")
                actual = _crc(handle, record.offset, record.length)
                if actual != expected:
                    return (f"The checkpoint {path} is damaged: {record.describe()} does not hold what was saved"
                            f" (CRC-32 {actual:#010x}, saved {expected:#010x}). {record.file} changed after it was"
                            " written (a disk, copy or transfer error). Load an earlier checkpoint, or copy this one"
                            " again. Nothing was loaded.")
    return None


def _note_unverified(path: Path) -> None:
    """Once per checkpoint and process, from the first rank only (every rank reads the table)."""
    first_rank = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    if first_rank and str(path) not in _noted:
        _noted.add(str(path))
        log.warning(f"{path} was written by an older lightning_zero and has no checksums: its data is loaded"
                    " unverified. Resume from it and save again to add them.")


def _my_share(all_records: list[Record], rank: int, world: int) -> list[Record]:
    """Greedy by bytes, largest first, so the ranks read about equal amounts (deterministic: every
    rank computes the same split from the same metadata)."""
    if world == 1:
        return all_records
    loads = [0] * world
    mine = []
    for record in sorted(all_records, key=lambda r: (-r.length, r.file, r.offset)):
        owner = loads.index(min(loads))
        loads[owner] += record.length
        if owner == rank:
            mine.append(record)
    return sorted(mine, key=lambda r: (r.file, r.offset))


def verify_share(path: Path, metadata: Metadata, wanted: Callable[[str], bool], group: dist.ProcessGroup | None) -> str | None:
    """:func:`verify` of this rank's share of the records (all of them without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return verify(path, metadata, wanted)
    rank = dist.get_rank(group)
    try:
        return verify(path, metadata, wanted, (rank, dist.get_world_size(group)))
    except CheckpointError as error:  # this rank must still join the agreement, or the others wait in it forever
        return str(error)
    except OSError as error:
        return f"The checkpoint {path} cannot be read on rank {rank}: {error}. Nothing was loaded."


def agree(message: str | None, group: dist.ProcessGroup | None) -> None:
    """Raises CheckpointError(message) on every rank if any rank has one (the lowest rank's), so
    that the ranks fail together or go on together; a collective when a process group is
    initialized. A rank that raised alone would leave the others waiting in the next collective."""
    if dist.is_available() and dist.is_initialized():
        messages: list[str | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(messages, message, group=group)
        message = next((m for m in messages if m is not None), None)
    if message is not None:
        raise CheckpointError(message)


class NamingReader(dcp.FileSystemReader):
    """DCP's file reader; a record torch cannot read becomes a CheckpointError naming its file and
    entry (torch's own error names neither, and may advise ``weights_only=False``)."""

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._metadata = metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        try:
            return super().read_data(plan, planner)
        except UNREADABLE_ERRORS as error:
            raise self._damaged(plan, error) from error

    def _damaged(self, plan: LoadPlan, error: BaseException) -> CheckpointError:
        # Slow path, only after a failure: find the first record of the plan torch cannot read.
        directory = Path(self.path)
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            record = _record_of(self._metadata, item.storage_index, info)
            try:
                with open(directory / info.relative_path, "rb") as handle:
                    handle.seek(info.offset)
                    data = handle.read(info.length)
                if item.type != LoadItemType.BYTE_IO:  # pickled objects are unpickled later, by from_object_entry
                    torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            except UNREADABLE_ERRORS as found:
                return damaged_record(directory, record, found)
        return CheckpointError(f"The checkpoint {directory} cannot be read: {reason(error)}. Load an earlier checkpoint.")


# What torch.load raises on bytes that are not what torch.save wrote (OSError: a zip directory
# pointing before the record's start makes it seek to a negative offset; OverflowError and
# MemoryError: a pickle frame whose length field is noise).
UNREADABLE_ERRORS = (RuntimeError, pickle.UnpicklingError, EOFError, ValueError, zipfile.BadZipFile, KeyError,
                     AttributeError, ImportError, IndexError, TypeError, OSError, OverflowError, MemoryError)


def damaged_record(directory: Path, record: Record, error: BaseException) -> CheckpointError:
    return CheckpointError(
        f"The checkpoint {directory} is damaged: {record.describe()} cannot be read ({reason(error)})."
        f" {record.file} changed after it was written, or was cut short. Load an earlier checkpoint, or copy this"
        " one again."
    )


def reason(error: BaseException) -> str:
    """The first line of torch's message, unless it is the advice to unpickle with
    ``weights_only=False``, which is wrong for a damaged file (and unsafe)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    if "weights_only" in text.lower() or "weights only" in text.lower():
        text = "its pickled data is not valid"
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


@contextmanager
def named_errors() -> Iterator[None]:
    """DCP wraps each rank's exception in a CheckpointException (a BaseException, with every rank's
    traceback in its message); the CheckpointError inside is what the user should see."""
    try:
        yield
    except CheckpointException as error:
        for _, (inner, _trace) in sorted(error.failures.items()):
            if isinstance(inner, CheckpointError):
                raise CheckpointError(str(inner)) from None
        raise
