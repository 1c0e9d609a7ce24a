"""Streamed checkpoint writers: round trips, every validation error, and bounded memory.

The reference for the torch format is ``torch.save`` of the materialized structure (what
``torch.load`` returns must be the same); for safetensors it is the ``safetensors`` package.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from lightning_zero.checkpoint.serialization import (
    TensorRef,
    load_safetensors,
    read_safetensors_header,
    save_safetensors_streamed,
    save_torch_streamed,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------------
# Fixtures: tensors with awkward dtypes, shapes and layouts, and a Lightning-like checkpoint
# --------------------------------------------------------------------------------------------


def _source_tensors() -> dict[str, Tensor]:
    """Tensors as a caller would yield them: mixed dtypes, 0-d, empty, non-contiguous, views."""
    gen = torch.Generator().manual_seed(0)
    flat = torch.randn(64, generator=gen)
    return {
        "model.embed.weight": torch.randn(7, 5, generator=gen).to(torch.bfloat16).t(),  # non-contig
        "model.linear.weight": torch.randn(6, 8, generator=gen)[:, ::2],  # strided slice
        "model.linear.bias": flat.narrow(0, 10, 4),  # contiguous view with a storage offset
        "model.norm.weight": torch.randn(3, generator=gen).half(),
        "model.scale": torch.tensor(1.5),  # 0-d
        "model.empty": torch.zeros(0, 3),  # zero elements
        "model.position_ids": torch.arange(9, dtype=torch.int64).reshape(3, 3),
        "model.mask": torch.tensor([[True, False], [False, True]]),
        "model.fp8": torch.randn(4, generator=gen).to(torch.float8_e4m3fn),
        "optim.exp_avg": torch.randn(2, 2, generator=gen, dtype=torch.float64),
    }


def _ref(key: str, tensor: Tensor) -> TensorRef:
    return TensorRef(key, tensor.dtype, tuple(tensor.shape))


def _lightning_checkpoint(refs: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint shaped like Lightning's, with ``refs[name]`` where tensors go.

    ``lm_head.weight`` is tied to the embedding (same key), as in many language models.
    """
    state_dict = OrderedDict((name, refs[name]) for name in refs if name.startswith("model."))
    state_dict["lm_head.weight"] = refs["model.embed.weight"]
    return {
        "epoch": 3,
        "global_step": 1200,
        "pytorch-lightning_version": "2.4.0",
        "state_dict": state_dict,
        "optimizer_states": [
            {
                "state": {0: {"step": 1200, "exp_avg": refs["optim.exp_avg"]}},
                "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}],
            }
        ],
        "lr_schedulers": [],
        "hyper_parameters": {"hidden": 5, "name": "tiny", "dropout": 0.0, "tags": ["a", "b"]},
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 3, "completed": 3}}}},
    }


def _assert_same(actual: Any, expected: Any, where: str = "root") -> None:
    """Recursive equality; tensors must match bitwise in dtype, shape and values."""
    assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
    if isinstance(expected, Tensor):
        assert actual.dtype == expected.dtype, f"{where}: {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{where}: {actual.shape} != {expected.shape}"
        assert actual.device.type == "cpu" and not actual.requires_grad, where
        # Compare bytes: float8 has no equality kernel and NaNs would defeat torch.equal.
        assert torch.equal(_as_bytes(actual), _as_bytes(expected)), f"{where}: values differ"
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{where}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            _assert_same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{where}: length differs"
        for i, (a, e) in enumerate(zip(actual, expected)):
            _assert_same(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def _as_bytes(tensor: Tensor) -> Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _entries(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


# --------------------------------------------------------------------------------------------
# torch.save-compatible writer
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def torch_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """One streamed file (tensors yielded in reverse order) and the structure it must load as."""
    sources = _source_tensors()
    structure = _lightning_checkpoint({k: _ref(k, t) for k, t in sources.items()})
    path = tmp_path_factory.mktemp("torch") / "model.ckpt"
    save_torch_streamed(path, structure, reversed(list(sources.items())))
    expected = _lightning_checkpoint({k: t.contiguous() for k, t in sources.items()})
    return path, expected


@pytest.mark.parametrize(
    "load_kwargs",
    [{}, {"mmap": True}, {"weights_only": True}, {"mmap": True, "weights_only": True}],
    ids=["plain", "mmap", "weights_only", "mmap+weights_only"],
)
def test_torch_round_trip(
    torch_checkpoint: tuple[Path, dict[str, Any]], load_kwargs: dict[str, Any]
) -> None:
    path, expected = torch_checkpoint
    loaded = torch.load(path, **load_kwargs)
    _assert_same(loaded, expected)
    state_dict = loaded["state_dict"]
    for name, tensor in state_dict.items():
        assert tensor.is_contiguous(), name
    # Tied refs come back as one storage, written once.
    tied, embed = state_dict["lm_head.weight"], state_dict["model.embed.weight"]
    assert tied.untyped_storage().data_ptr() == embed.untyped_storage().data_ptr()


def test_torch_file_matches_torch_save(
    torch_checkpoint: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """What torch.save of the materialized structure loads as is what our file loads as."""
    path, expected = torch_checkpoint
    reference = tmp_path / "reference.ckpt"
    torch.save(expected, reference)
    _assert_same(torch.load(path, weights_only=True), torch.load(reference, weights_only=True))
    # Data written once for the tied key: our file is not bigger than torch.save's.
    assert path.stat().st_size <= reference.stat().st_size + 4096


def test_torch_inline_tensors_and_shared_refs(tmp_path: Path) -> None:
    """Real tensors left in the structure load like torch.save; one ref object used twice too."""
    base = torch.arange(6.0)
    ref = TensorRef("w", torch.float32, [2, 3])  # type: ignore[arg-type]  # list -> tuple
    structure = {
        "a": ref,
        "b": ref,  # the same ref object
        "c": TensorRef("w", torch.float32, (2, 3)),  # an equal ref object, same key
        "step": torch.tensor(5),
        "param": torch.nn.Parameter(torch.ones(2)),
        "views": [base[:3], base[3:]],  # two views of one storage
    }
    path = tmp_path / "inline.pt"
    weights = torch.randn(2, 3)
    save_torch_streamed(path, structure, [("w", weights)])
    loaded = torch.load(path, weights_only=True)
    for name in "abc":
        assert torch.equal(loaded[name], weights), name
    pointers = {loaded[name].untyped_storage().data_ptr() for name in "abc"}
    assert len(pointers) == 1
    assert loaded["step"].item() == 5
    assert isinstance(loaded["param"], torch.nn.Parameter) and loaded["param"].requires_grad
    first, second = loaded["views"]
    assert torch.equal(torch.cat([first, second]), base)
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
    # A bare ref as the whole structure works too.
    save_torch_streamed(
        tmp_path / "bare.pt", TensorRef("x", torch.int64, ()), [("x", torch.tensor(7))]
    )
    assert torch.load(tmp_path / "bare.pt", weights_only=True).item() == 7


def _torch_writer(path: Path, pairs: list[tuple[str, Tensor]]) -> None:
    structure = {"a": TensorRef("a", torch.float32, (2, 3)), "b": TensorRef("b", torch.int64, (4,))}
    save_torch_streamed(path, structure, iter(pairs))


def _safetensors_writer(path: Path, pairs: list[tuple[str, Tensor]]) -> None:
    specs = {"a": (torch.float32, (2, 3)), "b": (torch.int64, (4,))}
    save_safetensors_streamed(path, specs, iter(pairs), metadata={"format": "pt"})


WRITERS: dict[str, Callable[[Path, list[tuple[str, Tensor]]], None]] = {
    "torch": _torch_writer,
    "safetensors": _safetensors_writer,
}


@pytest.mark.parametrize("writer", list(WRITERS))
def test_non_ascii_path_and_meta_load(tmp_path: Path, writer: str) -> None:
    """Non-ASCII names work (torch's own file-name writer needs ASCII); meta loads find data."""
    path = tmp_path / "modèle-权重.bin"
    WRITERS[writer](path, [("b", torch.arange(4)), ("a", torch.ones(2, 3))])
    if writer == "torch":
        # Without .format_version torch.load looks records up instead of computing offsets,
        # which would be wrong here since "b" was written before "a".
        meta = torch.load(path, map_location="meta", weights_only=True)
        assert meta["a"].is_meta and meta["a"].shape == (2, 3)
        loaded = torch.load(path, weights_only=True)
    else:
        loaded = load_safetensors(path)
    assert torch.equal(loaded["a"], torch.ones(2, 3))
    assert torch.equal(loaded["b"], torch.arange(4))


_A = torch.zeros(2, 3)
_B = torch.zeros(4, dtype=torch.int64)

# (pairs yielded, regex the ValueError must match)
STREAM_ERRORS: dict[str, tuple[list[tuple[str, Tensor]], str]] = {
    "wrong_dtype": (
        [("a", _A.double()), ("b", _B)],
        (
            r"'a': expected dtype torch\.float32 and shape \(2, 3\) but got dtype torch\.float64 "
            r"and shape \(2, 3\)"
        ),
    ),
    "wrong_shape": (
        [("a", _A), ("b", _B[:3])],
        (
            r"'b': expected dtype torch\.int64 and shape \(4,\) but got dtype torch\.int64 "
            r"and shape \(3,\)"
        ),
    ),
    "unknown_key": (
        [("a", _A), ("zzz", _B), ("b", _B)],
        r"'zzz' \(dtype torch\.int64 and shape \(4,\)\) was yielded but is not expected",
    ),
    "duplicate_key": (
        [("a", _A), ("a", _A), ("b", _B)],
        r"'a' was yielded twice \(expected dtype torch\.float32 and shape \(2, 3\)",
    ),
    "missing_key": (
        [("a", _A)],
        r"never yielded: 'b' \(dtype torch\.int64 and shape \(4,\)\)",
    ),
}


@pytest.mark.parametrize("writer", list(WRITERS))
@pytest.mark.parametrize("case", list(STREAM_ERRORS))
@pytest.mark.parametrize("preexisting", [False, True], ids=["fresh", "existing"])
def test_stream_errors_leave_no_file(
    tmp_path: Path, writer: str, case: str, preexisting: bool
) -> None:
    pairs, message = STREAM_ERRORS[case]
    path = tmp_path / "out.bin"
    if preexisting:
        path.write_bytes(b"previous checkpoint")
    with pytest.raises(ValueError, match=message):
        WRITERS[writer](path, pairs)
    if preexisting:
        assert path.read_bytes() == b"previous checkpoint"
        assert _entries(tmp_path) == ["out.bin"]  # and no temporary file left beside it
    else:
        assert _entries(tmp_path) == []


@pytest.mark.parametrize("writer", list(WRITERS))
def test_exception_in_caller_generator_leaves_no_file(tmp_path: Path, writer: str) -> None:
    def pairs() -> Iterator[tuple[str, Tensor]]:
        yield "a", _A
        raise RuntimeError("gather failed on rank 3")

    path = tmp_path / "out.bin"
    with pytest.raises(RuntimeError, match="gather failed"):
        WRITERS[writer](path, pairs())  # type: ignore[arg-type]
    assert _entries(tmp_path) == []


@pytest.mark.parametrize("writer", list(WRITERS))
def test_malformed_stream_items(tmp_path: Path, writer: str) -> None:
    path = tmp_path / "out.bin"
    with pytest.raises(TypeError, match=r"\(key, tensor\) pairs"):
        WRITERS[writer](path, ["a"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="'a': expected a torch.Tensor, got list"):
        WRITERS[writer](path, [("a", [1, 2])])  # type: ignore[list-item]
    with pytest.raises(
        TypeError, match="'a': expected a plain dense tensor, got Tensor with layout"
    ):
        WRITERS[writer](path, [("a", _A.to_sparse())])
    with pytest.raises(ValueError, match="'a' is on the meta device"):
        WRITERS[writer](path, [("a", _A.to("meta"))])
    # A dict would iterate its keys; the error says to pass .items().
    with pytest.raises(TypeError, match=r"dict\.items\(\)"):
        as_dict: Any = {"a": _A}
        if writer == "torch":
            save_torch_streamed(path, {"a": TensorRef("a", torch.float32, (2, 3))}, as_dict)
        else:
            save_safetensors_streamed(path, {"a": (torch.float32, (2, 3))}, as_dict)
    assert _entries(tmp_path) == []


def test_writer_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _torch_writer(tmp_path / "nope" / "x.pt", [("a", _A), ("b", _B)])


def test_tensor_ref_validation(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"TensorRef 'w': shape must be .* got \(2, -1\)"):
        TensorRef("w", torch.float32, (2, -1))
    with pytest.raises(ValueError, match=r"TensorRef 'w': dtype must be a torch.dtype"):
        TensorRef("w", "float32", (2,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty str"):
        TensorRef("", torch.float32, (2,))
    with pytest.raises(ValueError, match="quantized dtype"):
        TensorRef("q", torch.qint8, (2,))
    structure = [TensorRef("w", torch.float32, (2,)), TensorRef("w", torch.float16, (2,))]
    with pytest.raises(ValueError, match=r"TensorRefs sharing key 'w' disagree"):
        save_torch_streamed(tmp_path / "x.pt", structure, [])
    with pytest.raises(ValueError, match="cannot be pickled"):
        save_torch_streamed(tmp_path / "x.pt", {"f": lambda: 0}, [])
    assert _entries(tmp_path) == []


# --------------------------------------------------------------------------------------------
# safetensors writer and reader (the reader is safetensors.safe_open behind our errors)
# --------------------------------------------------------------------------------------------


def test_safetensors_round_trip(tmp_path: Path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    sources = _source_tensors()
    specs = {name: (t.dtype, tuple(t.shape)) for name, t in sources.items()}
    path = tmp_path / "model.safetensors"
    metadata = {"format": "pt", "note": "streamed"}
    save_safetensors_streamed(path, specs, reversed(list(sources.items())), metadata=metadata)

    expected = {name: t.contiguous() for name, t in sources.items()}
    ours = load_safetensors(path)
    reference = safetensors_torch.load_file(str(path))
    assert set(ours) == set(reference) == set(expected)
    for name, tensor in expected.items():
        _assert_same(ours[name], tensor, name)
        _assert_same(reference[name], tensor, name)
    assert read_safetensors_header(path) == (specs, metadata)

    # Our data buffer is aligned per tensor, so the package can also view it in place.
    with open(path, "rb") as handle:
        header_size = int.from_bytes(handle.read(8), "little")
    assert (8 + header_size) % 8 == 0
    for entry in json.loads(path.read_bytes()[8 : 8 + header_size]).values():
        if "data_offsets" in entry:
            itemsize = safetensors_torch._TYPES[entry["dtype"]].itemsize
            assert entry["data_offsets"][0] % itemsize == 0


def test_load_safetensors_reads_package_files(tmp_path: Path) -> None:
    """Our reader on files the safetensors package wrote (the reference writer)."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    expected = {name: t.contiguous() for name, t in _source_tensors().items()}
    path = tmp_path / "package.safetensors"
    safetensors_torch.save_file(expected, str(path), metadata={"k": "v"})
    loaded = load_safetensors(path)
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        _assert_same(loaded[name], tensor, name)
    specs, metadata = read_safetensors_header(path)
    assert metadata == {"k": "v"}
    assert specs == {name: (t.dtype, tuple(t.shape)) for name, t in expected.items()}


def test_load_safetensors_is_private_mmap(tmp_path: Path) -> None:
    """Tensors are separate storages over a copy-on-write map: edits never reach the file."""
    path = tmp_path / "x.safetensors"
    tensors = {"a": torch.arange(4.0), "b": torch.arange(3, dtype=torch.int64)}
    save_safetensors_streamed(
        path, {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}, tensors.items()
    )
    before = path.read_bytes()
    loaded = load_safetensors(path)
    assert loaded["a"].untyped_storage().nbytes() == 16  # its own storage, not the whole file
    loaded["a"].zero_()
    assert path.read_bytes() == before
    assert torch.equal(load_safetensors(path)["a"], tensors["a"])


def test_safetensors_spec_validation(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    with pytest.raises(ValueError, match=r"specs\['q'\]: dtype torch.qint8 has no safetensors"):
        save_safetensors_streamed(path, {"q": (torch.qint8, (2,))}, [])
    with pytest.raises(ValueError, match="other than '__metadata__'"):
        save_safetensors_streamed(path, {"__metadata__": (torch.float32, (2,))}, [])
    with pytest.raises(ValueError, match=r"specs\['w'\]: shape must be"):
        fractional: Any = (2.5,)
        save_safetensors_streamed(path, {"w": (torch.float32, fractional)}, [])
    with pytest.raises(ValueError, match="metadata must map str to str, got 'epoch': 3"):
        save_safetensors_streamed(path, {}, [], metadata={"epoch": 3})  # type: ignore[dict-item]
    assert _entries(tmp_path) == []
    # No tensors at all is a valid (header-only) file.
    save_safetensors_streamed(path, {}, [])
    assert load_safetensors(path) == {}


def _valid_safetensors(path: Path) -> bytes:
    tensors = {"a": torch.arange(4.0), "b": torch.arange(3, dtype=torch.int64)}
    save_safetensors_streamed(
        path, {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}, tensors.items()
    )
    return path.read_bytes()


def _with_header(header: Any, data: bytes) -> bytes:
    encoded = json.dumps(header).encode()
    return len(encoded).to_bytes(8, "little") + encoded + data


# name -> (bytes derived from a valid file, regex the ValueError must match)
CORRUPT_FILES: dict[str, tuple[Callable[[bytes], bytes], str]] = {
    "truncated": (
        lambda ok: ok[:-5],
        r"header says 40 bytes of data but the file has 35: the file is truncated",
    ),
    "trailing_bytes": (lambda ok: ok + b"xyz", r"3 unexplained trailing bytes"),
    "tiny": (lambda ok: b"abc", r"3 bytes, fewer than the 8-byte header length field"),
    "header_cut": (lambda ok: ok[:20], r"header length field says \d+ bytes but only 12 follow"),
    "torch_save_file": (
        lambda ok: b"PK\x03\x04" + b"\x00" * 200,
        r"header length field says \d+ bytes but only \d+ follow: the file is truncated",
    ),
    # From here on the reason is safetensors' own (it reads the file, see safe_open): before the
    # switch our parser worded these itself ("not UTF-8 JSON", "header is JSON list", "needs 8
    # bytes but its data_offsets span 4", "overlaps the previous tensor", "leaves a gap").
    "not_json": (lambda ok: (16).to_bytes(8, "little") + b"\xff" * 16, r"invalid UTF-8 in header"),
    "json_list": (lambda ok: _with_header([], b""), r"invalid JSON in header"),
    "bad_dtype": (
        lambda ok: _with_header(
            {"a": {"dtype": "F7", "shape": [1], "data_offsets": [0, 4]}}, b"0000"
        ),
        r"unknown variant `F7`",
    ),
    "size_mismatch": (
        lambda ok: _with_header(
            {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"0000"
        ),
        r"invalid shape, data type, or offset for tensor",
    ),
    "overlap": (
        lambda ok: _with_header(
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
            },
            b"0" * 8,
        ),
        r"invalid offset for tensor `b`",
    ),
    "gap": (
        lambda ok: _with_header(
            {"a": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}}, b"0000"
        ),
        r"invalid offset for tensor `a`",
    ),
}


@pytest.mark.parametrize("case", list(CORRUPT_FILES))
def test_reading_corrupt_safetensors(tmp_path: Path, case: str) -> None:
    make, message = CORRUPT_FILES[case]
    ok = _valid_safetensors(tmp_path / "ok.safetensors")
    path = tmp_path / "bad.safetensors"
    path.write_bytes(make(ok))
    for reader in (load_safetensors, read_safetensors_header):
        with pytest.raises(ValueError, match=message) as info:
            reader(path)
        assert str(path) in str(info.value)


def test_a_truncated_safetensors_checkpoint_is_a_checkpoint_error_when_loaded(tmp_path: Path) -> None:
    """What the strategy sees when asked to load a damaged full .safetensors checkpoint."""
    from lightning_zero.checkpoint import CheckpointError
    from lightning_zero.checkpoint.full import load_full_checkpoint

    path = tmp_path / "cut.safetensors"
    path.write_bytes(_valid_safetensors(tmp_path / "ok.safetensors")[:-5])
    with pytest.raises(CheckpointError, match="the file is truncated. Use an earlier checkpoint") as info:
        load_full_checkpoint(path)
    assert str(path) in str(info.value)
    assert torch.equal(load_full_checkpoint(tmp_path / "ok.safetensors")["state_dict"]["a"], torch.arange(4.0))


# --------------------------------------------------------------------------------------------
# Bounded memory: a 256 MiB file written with a peak RSS growth of a few tensors
# --------------------------------------------------------------------------------------------

_MEMORY_SCRIPT = textwrap.dedent(
    """
    import json, os, resource, sys
    import torch
    from lightning_zero.checkpoint.serialization import (
        TensorRef, load_safetensors, save_safetensors_streamed, save_torch_streamed,
    )

    fmt, path = sys.argv[1], sys.argv[2]
    count, numel = 64, 1 << 20  # 64 float32 tensors of 4 MiB: a 256 MiB file
    names = [f"layer{i}.weight" for i in range(count)]

    def pairs(keys):
        # Each tensor exists only while it is being written: no local keeps it alive.
        for i, name in enumerate(keys):
            yield name, torch.full((numel,), float(i))

    def write(target, keys):
        if fmt == "torch":
            structure = {"state_dict": {k: TensorRef(k, torch.float32, (numel,)) for k in keys},
                         "epoch": 1}
            save_torch_streamed(target, structure, pairs(keys))
        else:
            specs = {k: (torch.float32, (numel,)) for k in keys}
            save_safetensors_streamed(target, specs, pairs(keys))

    def reset_peak():
        # Linux: writing "5" resets the peak RSS (VmHWM), so the peak left by imports does not
        # count against (or hide) the write's own peak.
        try:
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")
        except OSError:
            pass

    def peak_rss():
        try:
            with open("/proc/self/status") as status:
                for line in status:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, else KiB
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale

    # Warm up imports, allocator and code paths with a small file first.
    write(path + ".warmup", names[:2])
    os.remove(path + ".warmup")
    def current_rss():
        # The peak may stem from importing Lightning; the current RSS is the stricter baseline.
        try:
            with open("/proc/self/statm") as statm:
                return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            return peak_rss()

    reset_peak()
    now = current_rss()
    before = peak_rss()
    write(path, names)
    after_write = peak_rss()
    # A zero-copy load must not read the file into memory either (measured before touching).
    if fmt == "torch":
        state = torch.load(path, mmap=True, weights_only=True)["state_dict"]
    else:
        state = load_safetensors(path)
    after_load = peak_rss()
    spot = {i: [state[names[i]][0].item(), state[names[i]][-1].item()] for i in (0, 37, 63)}
    numbers = {"now": now, "before": before, "after_write": after_write,
               "after_load": after_load, "file_size": os.path.getsize(path),
               "tensor_bytes": numel * 4, "spot": spot}
    print(json.dumps(numbers))
    """
)


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_peak_memory_is_bounded_by_a_few_tensors(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / f"big.{fmt}"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT, fmt, str(path)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    numbers = json.loads(result.stdout.strip().splitlines()[-1])
    mib = 1 << 20
    tensor_bytes, file_size = numbers["tensor_bytes"], numbers["file_size"]
    write_growth = numbers["after_write"] - numbers["before"]
    # Peak during the write over what was actually resident before it (the peak before it may
    # come from imports and would hide part of the growth).
    strict_growth = numbers["after_write"] - numbers["now"]
    load_growth = numbers["after_load"] - numbers["after_write"]
    limit = 4 * tensor_bytes + 32 * mib
    report = (
        f"{fmt}: peak RSS (VmHWM, reset before the write) {numbers['before'] / mib:.1f} -> "
        f"{numbers['after_write'] / mib:.1f} MiB (growth {write_growth / mib:.1f} MiB; "
        f"{strict_growth / mib:.1f} MiB over the {numbers['now'] / mib:.1f} MiB resident before; "
        f"limit {limit / mib:.0f} MiB) writing a {file_size / mib:.0f} MiB file of "
        f"{tensor_bytes / mib:.0f} MiB tensors; mmap load grew the peak by "
        f"{load_growth / mib:.1f} MiB"
    )
    print(report)
    assert file_size >= 64 * tensor_bytes, report
    assert write_growth < limit, report
    assert strict_growth < limit, report
    assert load_growth < 32 * mib, report
    # The content is right too (first and last element of a few tensors).
    assert numbers["spot"] == {str(i): [float(i), float(i)] for i in (0, 37, 63)}, report
