"""Bounded-memory writers (and a reader) for checkpoint files, one tensor at a time.

Why this exists: exporting a ZeRO-sharded checkpoint as one consolidated file means gathering
parameters that, all together, may be larger than the RAM of the host doing the export.
``torch.save`` (and ``safetensors.torch.save_file``) need the whole object in memory at once.
Both file formats, however, separate the *layout* (small metadata: names, dtypes, shapes) from
the *bytes*, so the layout can be written from a skeleton up front and each tensor's bytes
streamed as it is gathered, then freed. Peak memory is then about the largest tensor, not the
model.

Two formats:

* :func:`save_torch_streamed` writes a file that plain ``torch.load`` reads (also with
  ``mmap=True`` and ``weights_only=True``). The caller passes the checkpoint ``structure`` with
  :class:`TensorRef` placeholders where tensors go, and an iterable yielding ``(key, tensor)``.
* :func:`save_safetensors_streamed` writes one safetensors file, streamed: the header (names,
  dtypes, shapes and offsets) is known up front, so each tensor's bytes go to their offset as
  they arrive. ``safetensors.torch.save_file`` cannot do that (it takes every tensor at once and
  copies each to bytes), which is why this writer stays; :func:`load_safetensors` and
  :func:`read_safetensors_header` read through ``safetensors.safe_open`` (memory-mapped), with
  errors that name the file and say what is wrong with it.

Both writers are atomic: they write a temporary file in the destination directory and
``os.replace`` it onto ``path`` only once every tensor was written and checked, so a crash or a
validation error never leaves a half-written file at ``path`` (nor touches a file already there).

Torch internals relied on (all stable since torch 2.6 and used by ``torch.save`` itself):

* ``torch._C.PyTorchFileWriter(buffer, compute_crc32)`` with ``write_record(name, bytes |
  UntypedStorage, size)`` and ``write_end_of_file()``: the zip writer behind ``torch.save``;
  ``torch.serialization.get_crc32_options()`` and ``location_tag()``.
* ``UntypedStorage[begin:end]``: a zero-copy alias of part of a storage (``torch.load`` builds
  its mmap storages this way).
* ``torch._utils._rebuild_tensor_v2`` / ``_rebuild_tensor_v3``: the reducers ``torch.save``
  pickles for tensors (v3, with an ``UntypedStorage`` and an explicit dtype, for dtypes that
  have no legacy typed storage class, e.g. float8); ``torch.load`` allows both under
  ``weights_only``.
* ``torch.storage._dtype_to_storage_type_map()``: the legacy storage class name (``FloatStorage``
  ...) that ``torch.save`` pickles for a dtype.
* the persistent id ``('storage', storage_type, key, location, numel)`` resolved by
  ``torch.serialization._load`` to the record ``data/<key>``.
* for real tensors left inline in ``structure``: ``TypedStorage._untyped_storage`` / ``_size()``
  / ``_pickle_storage_type()`` and ``UntypedStorage._cdata``, as ``torch.serialization._save``
  uses them.

The file differs from ``torch.save``'s in one way: it has no ``.format_version`` (nor
``.storage_alignment``) record, because tensors are written in arrival order, not in key order
(see ``_write_torch_records``). Bounded memory also needs the heap to give freed tensors back;
see :class:`_FreedMemory` for why glibc's ``malloc_trim`` is called.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import io
import json
import math
import os
import pickle
import secrets
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch
from torch import Tensor

__all__ = [
    "TensorRef",
    "load_safetensors",
    "read_safetensors_header",
    "save_safetensors_streamed",
    "save_torch_streamed",
]

# (dtype, shape) of one tensor, as the writers expect it.
TensorSpec = tuple[torch.dtype, tuple[int, ...]]

# torch.save's pickle protocol (torch.serialization.DEFAULT_PROTOCOL); older readers expect 2.
_PICKLE_PROTOCOL = 2

# Hand freed heap memory back to the OS after this many streamed bytes (see _FreedMemory).
_RELEASE_FREED_EVERY_BYTES = 16 << 20

# How many keys an error message lists before eliding the rest.
_MAX_KEYS_IN_MESSAGE = 8

_QUANTIZED_DTYPES: frozenset[torch.dtype] = frozenset(
    getattr(torch, name)
    for name in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
    if hasattr(torch, name)
)


def _safetensors_dtype_names() -> dict[torch.dtype, str]:
    # The dtype strings of the safetensors spec; float8 / unsigned variants only where this torch
    # has them.
    names = {
        "float64": "F64",
        "float32": "F32",
        "float16": "F16",
        "bfloat16": "BF16",
        "int64": "I64",
        "int32": "I32",
        "int16": "I16",
        "int8": "I8",
        "uint8": "U8",
        "bool": "BOOL",
        "uint16": "U16",
        "uint32": "U32",
        "uint64": "U64",
        "complex64": "C64",
        "float8_e4m3fn": "F8_E4M3",
        "float8_e5m2": "F8_E5M2",
        "float8_e4m3fnuz": "F8_E4M3FNUZ",
        "float8_e5m2fnuz": "F8_E5M2FNUZ",
        "float8_e8m0fnu": "F8_E8M0",
    }
    return {getattr(torch, attr): code for attr, code in names.items() if hasattr(torch, attr)}


_SAFETENSORS_DTYPES: dict[torch.dtype, str] = _safetensors_dtype_names()
_SAFETENSORS_DTYPES_BY_NAME: dict[str, torch.dtype] = {v: k for k, v in _SAFETENSORS_DTYPES.items()}


# --------------------------------------------------------------------------------------------
# Shared helpers: spec validation, the stream validator, atomic output
# --------------------------------------------------------------------------------------------


def _normalize_shape(shape: Any, what: str) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative ints, or ValueError naming ``what``."""
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Iterable):
        # ValueError, not TypeError: a bad spec is a bad value (DESIGN habit 3).
        raise ValueError(  # noqa: TRY004
            f"{what}: shape must be a sequence of non-negative ints such as (4096, 1024) "
            f"or () for a scalar, got {shape!r}"
        )
    dims: list[int] = []
    for dim in shape:
        # bool is an int subclass but a shape of (True,) is certainly a mistake.
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
            raise ValueError(
                f"{what}: shape must be a sequence of non-negative ints such as (4096, 1024) "
                f"or () for a scalar, got {shape!r}"
            )
        dims.append(int(dim))
    return tuple(dims)


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


def _describe(dtype: torch.dtype, shape: tuple[int, ...]) -> str:
    return f"dtype {dtype} and shape {shape}"


def _list_keys(keys: Iterable[str]) -> str:
    keys = list(keys)
    shown = ", ".join(repr(k) for k in keys[:_MAX_KEYS_IN_MESSAGE])
    if len(keys) > _MAX_KEYS_IN_MESSAGE:
        shown += f", ... ({len(keys) - _MAX_KEYS_IN_MESSAGE} more)"
    return shown


class _StreamValidator:
    """Checks the ``(key, tensor)`` stream against the expected specs, one pair at a time.

    Each key must come exactly once with the expected dtype and shape; :meth:`finish` reports the
    keys that never came. Errors name the key and the expected/actual dtype and shape.
    """

    def __init__(self, expected: Mapping[str, TensorSpec]) -> None:
        self._expected = expected
        self._seen: set[str] = set()

    def accept(self, item: Any) -> tuple[str, Tensor]:
        """Validate one yielded item; return its key and its bytes as a contiguous CPU tensor."""
        if not isinstance(item, tuple) or len(item) != 2:
            raise TypeError(
                f"the tensors iterable must yield (key, tensor) pairs, got {type(item).__name__} "
                f"{_short_repr(item)}"
            )
        key, tensor = item
        if not isinstance(key, str):
            raise TypeError(f"tensor keys must be str, got {type(key).__name__} {key!r}")
        if not isinstance(tensor, Tensor):
            raise TypeError(f"tensor {key!r}: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.layout != torch.strided or not (
            type(tensor) is Tensor or isinstance(tensor, torch.nn.Parameter)
        ):
            # Sparse tensors and subclasses (DTensor ...) have no single dense buffer to write.
            raise TypeError(
                f"tensor {key!r}: expected a plain dense tensor, got {type(tensor).__name__} with "
                f"layout {tensor.layout}; convert it first (.to_dense(), DTensor.full_tensor())"
            )
        if tensor.is_meta:
            raise ValueError(
                f"tensor {key!r} is on the meta device and has no data; yield a materialized tensor"
            )
        actual: TensorSpec = (tensor.dtype, tuple(tensor.shape))
        if key not in self._expected:
            raise ValueError(
                f"tensor {key!r} ({_describe(*actual)}) was yielded but is not expected; "
                f"expected keys include {_list_keys(self._expected)}. "
                "Yield only keys that appear in the structure/specs."
            )
        expected = self._expected[key]
        if key in self._seen:
            raise ValueError(
                f"tensor {key!r} was yielded twice (expected {_describe(*expected)}, this time "
                f"got {_describe(*actual)}); yield each key exactly once."
            )
        if actual != expected:
            raise ValueError(
                f"tensor {key!r}: expected {_describe(*expected)} but got {_describe(*actual)}; "
                "yield a tensor matching its spec (cast with .to(dtype), reshape, or fix the spec)."
            )
        self._seen.add(key)
        return key, _contiguous_cpu_bytes(tensor)

    def finish(self) -> None:
        """Raise if some expected key was never yielded."""
        missing = [k for k in self._expected if k not in self._seen]
        if missing:
            details = "; ".join(
                f"{k!r} ({_describe(*self._expected[k])})" for k in missing[:_MAX_KEYS_IN_MESSAGE]
            )
            if len(missing) > _MAX_KEYS_IN_MESSAGE:
                details += f"; ... ({len(missing) - _MAX_KEYS_IN_MESSAGE} more)"
            raise ValueError(
                f"{len(missing)} expected tensor(s) were never yielded: {details}. "
                "Yield every key exactly once."
            )


def _short_repr(obj: Any, limit: int = 80) -> str:
    text = repr(obj)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _contiguous_cpu_bytes(tensor: Tensor) -> Tensor:
    """A CPU tensor whose memory holds exactly ``tensor``'s values in row-major order."""
    # resolve_conj/resolve_neg: lazily conjugated/negated views would otherwise be written
    # with the un-conjugated bytes. All of these return ``tensor`` itself when nothing is to do,
    # so an already contiguous CPU tensor costs no copy.
    data = tensor.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
    return data


def _byte_view(data: Tensor) -> memoryview:
    """A zero-copy view of a contiguous CPU tensor's bytes (``data`` must outlive it)."""
    # ctypes rather than .numpy(): numpy is not a dependency and has no bfloat16.
    nbytes = data.numel() * data.element_size()
    return memoryview((ctypes.c_ubyte * nbytes).from_address(data.data_ptr())).cast("B")


@contextlib.contextmanager
def _atomic_output(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """Yield a file in ``path``'s directory that replaces ``path`` only if the body succeeds.

    On any exception (including KeyboardInterrupt) the temporary file is removed and ``path``
    is untouched. On success the data is fsynced before the rename, so after a crash ``path``
    holds either the old file or the complete new one.
    """
    final = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(final))
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            f"cannot write {final!r}: its directory {directory!r} does not exist; create it first"
        )
    if os.path.isdir(final):
        raise IsADirectoryError(f"cannot write {final!r}: it is a directory; pass a file path")
    # Same directory as the target so os.replace is a rename, not a cross-device copy.
    # O_EXCL + a random suffix: never clobber someone else's temporary file.
    tmp = os.path.join(
        directory, f".{os.path.basename(final)}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
    )
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_directory(directory)


def _fsync_directory(directory: str) -> None:
    # Makes the rename itself durable on POSIX; directories cannot be opened this way on Windows.
    if os.name != "posix":
        return
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # the file is already in place and synced; failing now would be misleading
    try:
        os.fsync(dir_fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the data itself is already synced
    finally:
        os.close(dir_fd)


def _iterate(tensors: Iterable[tuple[str, Tensor]]) -> Iterator[Any]:
    if isinstance(tensors, Mapping):
        # A dict would iterate its keys, and each "pair" would be a string: a confusing failure.
        raise TypeError(
            "tensors must be an iterable of (key, tensor) pairs; for a dict pass dict.items()"
        )
    return iter(tensors)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where there is none (macOS, Windows, musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:
        return None


class _FreedMemory:
    """Returns the memory of already-written tensors to the OS every few MiB.

    Why: streamed tensors are typically allocated one after another with the same size
    (``posix_memalign``, as torch's CPU allocator does). glibc cannot place the next one in the
    hole the previous one left (an aligned request needs a few bytes more than the hole), and
    small long-lived allocations made in between (the zip writer's record index, our own
    bookkeeping) stop the holes from merging. Every tensor then lands on fresh pages and RSS
    grows by the whole file although almost all of it is free: without this, 4 of 6 runs of the
    torch-format memory test grew RSS by 250 MiB writing 256 MiB. ``malloc_trim(0)`` gives free
    pages inside the heap back to the OS, which bounds RSS again. Elsewhere this is a no-op.
    """

    def __init__(self) -> None:
        self._pending = 0
        self._trim = _malloc_trim()

    def written(self, nbytes: int) -> None:
        """Note that ``nbytes`` were written (and are being freed); trim when enough piled up."""
        self._pending += nbytes
        if self._trim is not None and self._pending >= _RELEASE_FREED_EVERY_BYTES:
            self._trim(0)
            self._pending = 0


# --------------------------------------------------------------------------------------------
# torch.save-compatible streamed writer
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorRef:
    """Placeholder for a tensor whose data is written later (key names its storage).

    Several refs with the same key load as tensors sharing one storage (tied weights); they
    must then agree on dtype and shape.
    """

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not self.key:
            raise ValueError(f"TensorRef.key must be a non-empty str, got {self.key!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(  # noqa: TRY004 (a bad spec is a bad value, DESIGN habit 3)
                f"TensorRef {self.key!r}: dtype must be a torch.dtype such as torch.float32, "
                f"got {self.dtype!r}"
            )
        if self.dtype in _QUANTIZED_DTYPES:
            raise ValueError(
                f"TensorRef {self.key!r}: quantized dtype {self.dtype} is not supported (it "
                "needs scale/zero-point metadata); store the integer representation instead"
            )
        # Accept lists / torch.Size for convenience but store a tuple so refs hash and compare.
        object.__setattr__(self, "shape", _normalize_shape(self.shape, f"TensorRef {self.key!r}"))


@dataclass
class _PendingStorage:
    """A storage whose bytes are streamed later; pickled as a persistent id, never by value."""

    record: str  # name of the zip record, "data/<record>"
    storage_type: Any  # legacy typed storage class (torch.FloatStorage ...) or UntypedStorage
    numel: int  # in units of storage_type (bytes for UntypedStorage)
    spec: TensorSpec


@dataclass
class _TorchPlan:
    """What pickling the structure found: the refs' storages and the real tensors inline."""

    pickled: bytes
    pending: dict[str, _PendingStorage]  # TensorRef key -> storage
    inline: dict[str, torch.UntypedStorage]  # record -> storage of a real tensor in structure


class _StructurePickler(pickle.Pickler):
    """Pickles ``structure`` like torch.save would, with TensorRefs as not-yet-written storages.

    ``reducer_override`` turns a TensorRef into the reduce tuple torch.save emits for a
    contiguous tensor, with a :class:`_PendingStorage` in place of the storage; ``persistent_id``
    turns that (and any real storage) into torch's ``('storage', ...)`` id, so the file only
    carries metadata here and the bytes are written afterwards as ``data/<record>``.
    """

    def __init__(self, file: BinaryIO) -> None:
        super().__init__(file, protocol=_PICKLE_PROTOCOL)
        self.pending: dict[str, _PendingStorage] = {}
        self.inline: dict[str, torch.UntypedStorage] = {}
        self._inline_records: dict[int, str] = {}  # storage _cdata -> record
        self._inline_dtypes: dict[int, torch.dtype] = {}

    def _next_record(self) -> str:
        # torch's convention: records are named by consecutive integers.
        return str(len(self.pending) + len(self.inline))

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, TensorRef):
            return NotImplemented
        storage = self._pending_storage(obj)
        # Contiguous strides exactly as torch computes them (zero-size dims included).
        stride = torch.empty(obj.shape, dtype=obj.dtype, device="meta").stride()
        # Same argument tuples as Tensor._reduce_ex_internal: offset 0, no grad, no hooks.
        args: tuple[Any, ...] = (storage, 0, obj.shape, stride, False, OrderedDict())
        if storage.storage_type is torch.UntypedStorage:
            return (torch._utils._rebuild_tensor_v3, args + (obj.dtype,))
        return (torch._utils._rebuild_tensor_v2, args)

    def _pending_storage(self, ref: TensorRef) -> _PendingStorage:
        spec: TensorSpec = (ref.dtype, ref.shape)
        known = self.pending.get(ref.key)
        if known is not None:
            if known.spec != spec:
                raise ValueError(
                    f"TensorRefs sharing key {ref.key!r} disagree: one has "
                    f"{_describe(*known.spec)}, another {_describe(*spec)}; tied refs must "
                    "have the same dtype and shape"
                )
            return known
        type_name = torch.storage._dtype_to_storage_type_map().get(ref.dtype)
        if type_name is None:
            # Dtypes newer than the legacy storage classes (float8 ...): torch.save stores them
            # as an UntypedStorage counted in bytes, with the dtype passed to _rebuild_tensor_v3.
            storage_type: Any = torch.UntypedStorage
            numel = _nbytes(ref.dtype, ref.shape)
        else:
            storage_type = getattr(torch, type_name)
            numel = math.prod(ref.shape)
        pending = _PendingStorage(self._next_record(), storage_type, numel, spec)
        self.pending[ref.key] = pending
        return pending

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _PendingStorage):
            return ("storage", obj.storage_type, obj.record, "cpu", obj.numel)
        if isinstance(obj, torch.storage.TypedStorage) or torch.is_storage(obj):
            return self._inline_storage_id(obj)
        return None

    def _inline_storage_id(self, obj: Any) -> tuple[Any, ...]:
        # A real tensor left in the structure (e.g. an optimizer's 0-d ``step``): mirror
        # torch.serialization._save so it loads exactly as with torch.save. Its bytes are
        # written right after data.pkl; the caller already holds them in memory.
        if isinstance(obj, torch.storage.TypedStorage):
            storage = obj._untyped_storage
            dtype = obj.dtype
            storage_type: Any = getattr(torch, obj._pickle_storage_type())
            numel = obj._size()
        else:
            storage = obj
            dtype = torch.uint8
            storage_type = torch.UntypedStorage
            numel = storage.nbytes()
        if storage.device.type == "meta":
            raise ValueError(
                "structure contains a tensor on the meta device, which has no data to write; "
                "replace it with a TensorRef and yield its data"
            )
        identity = storage._cdata
        known_dtype = self._inline_dtypes.setdefault(identity, dtype)
        if known_dtype != dtype and storage.data_ptr() != 0:
            raise ValueError(
                f"structure contains tensors viewing the same memory as {known_dtype} and "
                f"{dtype}; torch.load cannot rebuild that, clone one of them"
            )
        record = self._inline_records.get(identity)
        if record is None:
            record = self._next_record()
            self._inline_records[identity] = record
            self.inline[record] = storage
        location = torch.serialization.location_tag(storage)
        return ("storage", storage_type, record, location, numel)


def _plan_torch_file(structure: Any) -> _TorchPlan:
    buffer = io.BytesIO()
    pickler = _StructurePickler(buffer)
    try:
        pickler.dump(structure)
    except (pickle.PicklingError, TypeError, AttributeError) as error:
        raise ValueError(
            f"structure cannot be pickled ({type(error).__name__}: {error}); it must be "
            "picklable like anything passed to torch.save"
        ) from error
    return _TorchPlan(buffer.getvalue(), pickler.pending, pickler.inline)


def _write_torch_record(writer: Any, name: str, data: Tensor) -> None:
    nbytes = data.numel() * data.element_size()
    if nbytes == 0:
        writer.write_record(name, b"", 0)  # empty tensors still get their (empty) record
        return
    # write_record writes a storage from its start, and passing a raw data pointer is
    # deprecated; ``data`` may be a contiguous view into a larger buffer (a flat ZeRO shard),
    # so hand it a storage aliasing exactly its bytes: slicing an UntypedStorage copies nothing.
    start = data.storage_offset() * data.element_size()
    writer.write_record(name, data.untyped_storage()[start : start + nbytes], nbytes)


def save_torch_streamed(
    path: str | os.PathLike[str],
    structure: Any,
    tensors: Iterable[tuple[str, Tensor]],
) -> None:
    """Write ``structure`` as a ``torch.save`` file, streaming tensor data from ``tensors``.

    ``structure`` is any picklable object in which some leaves are :class:`TensorRef`. Each
    ref's bytes come from the ``(key, tensor)`` pair with its key; pairs may arrive in any
    order, each key exactly once, and each tensor may be freed by the caller once the next pair
    is requested, so peak memory is about one tensor. ``torch.load(path)`` returns ``structure``
    with every ref replaced by a contiguous CPU tensor (refs sharing a key share one storage).

    Raises:
        ValueError: a yielded key is unknown, repeated, never yielded, or its tensor's
            dtype/shape differs from its ref; or tied refs disagree; or ``structure`` cannot
            be pickled. No file is left at ``path`` (an existing one is untouched).
        TypeError: ``tensors`` yields something other than ``(str, Tensor)`` pairs.
    """
    # Pickle first: structure errors surface before any file is created, and data.pkl (metadata
    # only) is the first record, as torch.save writes it.
    plan = _plan_torch_file(structure)
    validator = _StreamValidator({key: p.spec for key, p in plan.pending.items()})
    items = _iterate(tensors)
    with _atomic_output(path) as handle:
        # The buffer constructor (not the file-name one) names the archive folder "archive"
        # rather than after our temporary file, and lets _atomic_output own the file.
        writer = torch._C.PyTorchFileWriter(handle, torch.serialization.get_crc32_options())
        try:
            _write_torch_records(writer, plan, validator, items)
        except BaseException:
            # Finalize while the file is still open: the writer's destructor would otherwise
            # finalize into a closed file, and an exception in a C++ destructor aborts Python.
            # The temporary file is deleted anyway.
            with contextlib.suppress(Exception):
                writer.write_end_of_file()
            raise
        writer.write_end_of_file()
        del writer


def _write_torch_records(
    writer: Any, plan: _TorchPlan, validator: _StreamValidator, items: Iterator[Any]
) -> None:
    writer.write_record("data.pkl", plan.pickled, len(plan.pickled))
    # No ".format_version" record, unlike torch.save: version >= 1 promises that data records
    # appear in the order of their integer keys, which lets torch.load compute offsets instead
    # of reading them (meta/fake loads, config.load.calculate_storage_offsets). Ours follow the
    # order tensors arrive in, so readers must look each record up, as for version-0 files.
    # ".storage_alignment" is only consumed by that offset calculation, so it is omitted too;
    # the writer still aligns every record to its default 64 bytes, so mmap-loaded tensors are
    # aligned.
    writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
    for record, storage in plan.inline.items():
        cpu_storage = storage.cpu()
        writer.write_record(f"data/{record}", cpu_storage, cpu_storage.nbytes())
    freed = _FreedMemory()
    for item in items:
        key, data = validator.accept(item)
        _write_torch_record(writer, f"data/{plan.pending[key].record}", data)
        nbytes = data.numel() * data.element_size()
        # Drop our references before asking for the next pair so that at most one tensor
        # (plus the caller's next one) is alive at a time.
        del item, data
        freed.written(nbytes)
    validator.finish()


# --------------------------------------------------------------------------------------------
# safetensors streamed writer and reader
# --------------------------------------------------------------------------------------------


def _check_little_endian(what: str) -> None:
    if sys.byteorder != "little":
        raise NotImplementedError(
            f"{what}: safetensors data is little-endian and this host is {sys.byteorder}-endian; "
            "byte swapping is not implemented"
        )


def _validate_specs(specs: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
    if not isinstance(specs, Mapping):
        raise TypeError(
            f"specs must be a mapping name -> (dtype, shape), got {type(specs).__name__}"
        )
    checked: dict[str, TensorSpec] = {}
    for name, spec in specs.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ValueError(
                f"safetensors tensor names must be non-empty str other than '__metadata__', "
                f"got {name!r}"
            )
        if not isinstance(spec, tuple) or len(spec) != 2:
            raise ValueError(f"specs[{name!r}] must be a (dtype, shape) pair, got {spec!r}")
        dtype, shape = spec
        if dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(
                f"specs[{name!r}]: dtype {dtype!r} has no safetensors encoding; supported: "
                f"{', '.join(str(d) for d in _SAFETENSORS_DTYPES)}"
            )
        checked[name] = (dtype, _normalize_shape(shape, f"specs[{name!r}]"))
    return checked


def _validate_metadata(metadata: Mapping[str, str] | None) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a mapping str -> str, got {type(metadata).__name__}")
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ValueError(  # noqa: TRY004 (a bad spec is a bad value, DESIGN habit 3)
                f"safetensors metadata must map str to str, got {key!r}: {value!r}; "
                "convert values with str() or json.dumps()"
            )
    return dict(metadata)


def _safetensors_layout(specs: Mapping[str, TensorSpec]) -> dict[str, tuple[int, int]]:
    """Byte range of each tensor inside the data buffer, with no holes."""
    # Largest element size first (as safetensors itself does): all sizes are powers of two and
    # the buffer starts 8-aligned, so every tensor starts aligned to its own element size and
    # a reader can view it in place.
    order = sorted(specs, key=lambda name: (-specs[name][0].itemsize, name))
    offsets: dict[str, tuple[int, int]] = {}
    position = 0
    for name in order:
        dtype, shape = specs[name]
        end = position + _nbytes(dtype, shape)
        offsets[name] = (position, end)
        position = end
    return offsets


def _safetensors_header(
    specs: Mapping[str, TensorSpec],
    offsets: Mapping[str, tuple[int, int]],
    metadata: Mapping[str, str] | None,
) -> bytes:
    header: dict[str, Any] = {}
    if metadata is not None:
        header["__metadata__"] = dict(metadata)
    for name, (begin, end) in offsets.items():
        dtype, shape = specs[name]
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [begin, end],
        }
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    # Pad with spaces so the data buffer starts 8-byte aligned (8-byte length + header).
    return encoded + b" " * (-len(encoded) % 8)


def save_safetensors_streamed(
    path: str | os.PathLike[str],
    specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    tensors: Iterable[tuple[str, Tensor]],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write a safetensors file whose tensors are streamed from ``tensors``, one at a time.

    ``specs`` maps each tensor name to its ``(dtype, shape)``; the header is written from it up
    front, so ``(name, tensor)`` pairs may arrive in any order (each is written at its offset).
    Each name must be yielded exactly once with its spec's dtype and shape. ``metadata`` becomes
    the header's ``__metadata__`` (str -> str).

    Raises:
        ValueError: invalid specs/metadata, or a yielded name that is unknown, repeated, never
            yielded, or whose tensor does not match its spec. No file is left at ``path`` (an
            existing one is untouched).
        TypeError: ``tensors`` yields something other than ``(str, Tensor)`` pairs.
    """
    _check_little_endian(f"writing {os.fspath(path)!r}")
    checked = _validate_specs(specs)
    checked_metadata = _validate_metadata(metadata)
    offsets = _safetensors_layout(checked)
    header = _safetensors_header(checked, offsets, checked_metadata)
    data_start = 8 + len(header)
    data_size = max((end for _, end in offsets.values()), default=0)
    validator = _StreamValidator(checked)
    items = _iterate(tensors)
    with _atomic_output(path) as handle:
        handle.write(len(header).to_bytes(8, "little"))
        handle.write(header)
        # Size the file now: tensors arriving out of order are written at their offsets, and
        # a zero-size tail tensor still needs the file to end at data_size.
        handle.truncate(data_start + data_size)
        freed = _FreedMemory()
        for item in items:
            name, data = validator.accept(item)
            begin, end = offsets[name]
            if end > begin:
                handle.seek(data_start + begin)
                view = _byte_view(data)
                handle.write(view)
                view.release()
            # Release our references before the next pair is produced (bounded memory).
            del item, data
            freed.written(end - begin)
        validator.finish()


def _not_safetensors(path: str, reason: str) -> ValueError:
    return ValueError(f"{path!r} is not a valid safetensors file: {reason}")


@contextlib.contextmanager
def _safe_open(path: str | os.PathLike[str]) -> Iterator[Any]:
    """``safetensors.safe_open(path, framework="pt")``, its refusal turned into a ValueError that
    names the path and the reason (see :func:`_size_problem`)."""
    from safetensors import SafetensorError, safe_open

    name = os.fspath(path)
    try:
        handle = safe_open(name, framework="pt")
    except SafetensorError as error:
        reason = _size_problem(name) or str(error).removeprefix("Error while deserializing header: ")
        raise _not_safetensors(name, reason) from error
    with handle as opened:
        yield opened


def _size_problem(path: str) -> str | None:
    """Why a file that safetensors refused does not add up, where its sizes tell: safetensors says
    "incomplete metadata, file not fully covered" both for a file cut short and for trailing
    bytes, and "invalid header length" for a header cut short; an interrupted copy is by far the
    commonest cause, so the message should say so. Only explains, never validates (safetensors
    did that); None when the sizes are not the problem."""
    try:
        with open(path, "rb") as handle:
            file_size = os.fstat(handle.fileno()).st_size
            if file_size < 8:
                return f"it has {file_size} bytes, fewer than the 8-byte header length field"
            header_size = int.from_bytes(handle.read(8), "little")
            if header_size > file_size - 8:
                return (f"its header length field says {header_size} bytes but only {file_size - 8} follow: "
                        "the file is truncated (or not safetensors)")
            header = json.loads(handle.read(header_size))
        header.pop("__metadata__", None)
        expected = max((int(entry["data_offsets"][1]) for entry in header.values()), default=0)
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None  # the header itself is what is wrong: safetensors' own reason says how
    actual = file_size - 8 - header_size
    if actual < expected:
        return f"header says {expected} bytes of data but the file has {actual}: the file is truncated"
    if actual > expected:
        return (f"header says {expected} bytes of data but the file has {actual}: "
                f"{actual - expected} unexplained trailing bytes")
    return None


def read_safetensors_header(
    path: str | os.PathLike[str],
) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], dict[str, str]]:
    """Return ``(specs, metadata)`` of a safetensors file without reading its tensor data.

    ``specs`` maps each tensor name to ``(dtype, shape)``; ``metadata`` is the header's
    ``__metadata__`` (empty if absent). Read with ``safetensors.safe_open``, which validates the
    header against the file size.

    Raises:
        ValueError: the file is truncated or is not safetensors (the message names the path).
    """
    name = os.fspath(path)
    with _safe_open(name) as handle:
        specs: dict[str, TensorSpec] = {}
        for key in handle.keys():
            view = handle.get_slice(key)
            code = view.get_dtype()
            dtype = _SAFETENSORS_DTYPES_BY_NAME.get(code)
            if dtype is None:
                raise _not_safetensors(name, f"tensor {key!r} has dtype {code!r}, which this torch cannot hold")
            specs[key] = (dtype, tuple(view.get_shape()))
        return specs, dict(handle.metadata() or {})


def load_safetensors(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """Load every tensor of a safetensors file as a CPU tensor backed by a memory map.

    Read with ``safetensors.safe_open``: nothing is copied up front, pages are read from disk when
    a tensor is touched. The map is private (copy-on-write), so writing to a returned tensor never
    modifies the file. Each tensor has its own storage, so saving one does not drag the whole file
    along.

    Raises:
        ValueError: the file is truncated or is not safetensors (the message names the path).
    """
    _check_little_endian(f"reading {os.fspath(path)!r}")
    with _safe_open(path) as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}
