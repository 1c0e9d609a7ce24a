"""Exporting a sharded checkpoint to one file: the engine's own save/load without a Trainer,
bounded memory (measured in a subprocess), the console command, bad input, and the atomic
replacement of a checkpoint directory."""

from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import sys
import tempfile
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import run_on_ranks
from lightning_zero import CheckpointError, Collectives, ZeroConfig, ZeroOptimizer, consolidate
from lightning_zero.checkpoint import load_checkpoint, save_checkpoint
from lightning_zero.checkpoint import sharded
from lightning_zero.cli import main
from lightning_zero.zero.stage3 import Zero3Engine, Zero3Optimizer

REPO_ROOT = Path(__file__).resolve().parents[1]
LAYERS, WIDTH = 24, 1024  # 24 weights of 4 MiB: 96 MiB of weights, 288 MiB with Adam's state


def _big_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])


class Counter(nn.Module):
    """Counts its forwards and keeps the count as extra state (get/set_extra_state)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return x

    def get_extra_state(self) -> dict[str, int]:
        return {"count": self.count}

    def set_extra_state(self, state: dict[str, int]) -> None:
        self.count = state["count"]


def _small_model() -> nn.Module:
    torch.manual_seed(0)
    # BatchNorm statistics differ between ranks (each sees its own data): the checkpoint keeps rank 0's.
    return nn.Sequential(nn.Linear(6, 10), nn.BatchNorm1d(10), Counter(), nn.Tanh(), nn.Linear(10, 3))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def _step(model: nn.Module, optimizer: Any) -> None:
    data = torch.randn(4, next(model.parameters()).shape[1], generator=torch.Generator().manual_seed(dist.get_rank()))
    model(data).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _engine_round_trip(directory: str) -> dict[str, Any]:
    """Without a Trainer: ZeRO-2 saves; ZeRO-3 loads it, steps on; and the big checkpoint."""
    out: dict[str, Any] = {}
    model = _small_model()
    optimizer = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1), model, Collectives(), ZeroConfig(stage=2, reduce_bucket_size=16))
    for _ in range(3):
        _step(model, optimizer)
    save_checkpoint(os.path.join(directory, "small.ckpt"), model, [optimizer], extra={"note": "engine"})
    optimizer.consolidate_state_dict()
    out["saved_optimizer"] = optimizer.state_dict() if dist.get_rank() == 0 else None
    out["saved_params"] = copy.deepcopy(model.state_dict())

    other = _small_model()
    for param in other.parameters():
        param.data.mul_(0)
    engine = Zero3Engine(other, Collectives(), ZeroConfig(stage=3, min_unit_numel=1, param_persistence_threshold=0, prefetch_units=1,
                                                 prefetch_bytes=0), param_dtype=None, device=torch.device("cpu"))
    engine.shard()
    engine.install_hooks()
    zero3 = Zero3Optimizer(torch.optim.AdamW(other.parameters(), lr=0.1), engine, ZeroConfig(stage=3))
    out["extra"] = load_checkpoint(os.path.join(directory, "small.ckpt"), other, [zero3], engine=engine)
    zero3.consolidate_state_dict()
    out["loaded_optimizer"] = zero3.state_dict() if dist.get_rank() == 0 else None
    out["loaded_params"] = engine.full_state_dict()
    engine.remove_hooks()
    out["loaded_running_mean"] = other[1].running_mean.clone()
    out["loaded_count"] = other[2].count
    if dist.get_rank() == 0:
        consolidate(os.path.join(directory, "small.ckpt"), os.path.join(directory, "small.pt"), progress=False)
    dist.barrier()
    out["consolidated"] = torch.load(os.path.join(directory, "small.pt"), weights_only=False)["state_dict"]

    big = _big_model()
    big_optimizer = ZeroOptimizer(torch.optim.AdamW(big.parameters()), big, Collectives(), ZeroConfig(stage=2))
    _step(big, big_optimizer)
    save_checkpoint(os.path.join(directory, "big.ckpt"), big, [big_optimizer])
    return out


_MEMORY_SCRIPT = r"""
import json, os, resource, shutil, sys, torch
from lightning_zero import consolidate
from lightning_zero.checkpoint import consolidate_hf

def reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:  # Linux: "5" resets the peak RSS (VmHWM)
            f.write("5")
        return True
    except OSError:
        return False

def peak():
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

def current():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

source, small, out = sys.argv[1], sys.argv[2], sys.argv[3]
if out.endswith("-hf"):  # a Hugging Face directory of 8 MiB shards (two of the 4 MiB weights each)
    export = lambda src, dst: consolidate_hf(src, dst, max_shard_size="8MiB", progress=False)
    size = lambda path: sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))
else:
    export = lambda src, dst: consolidate(src, dst, progress=False)
    size = os.path.getsize
warmup = out + ".warmup" + os.path.splitext(out)[1]
export(small, warmup)  # code paths, imports
shutil.rmtree(warmup) if os.path.isdir(warmup) else os.remove(warmup)
reset = reset_peak()
before = current()
export(source, out)
print(json.dumps({"before": before, "peak": peak(), "reset": reset, "size": size(out)}))
"""


@pytest.fixture(scope="module")
def exported() -> Any:
    with tempfile.TemporaryDirectory() as directory:
        ranks = run_on_ranks(_engine_round_trip, 2, directory)
        yield {"directory": Path(directory), "engine": ranks[0], "ranks": ranks}


def test_engine_checkpoint_loads_into_another_stage_without_a_trainer(exported: Any) -> None:
    engine = exported["engine"]
    assert engine["extra"] == {"note": "engine"}
    saved, loaded = engine["saved_params"], engine["loaded_params"]
    assert saved.keys() == loaded.keys() and all(_same(saved[k], loaded[k]) for k in saved)
    assert saved["2._extra_state"] == {"count": 3}  # three training forwards
    assert [rank["loaded_count"] for rank in exported["ranks"]] == [3, 3]
    a, b = engine["saved_optimizer"], engine["loaded_optimizer"]
    assert a["param_groups"] == b["param_groups"]
    assert all(torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i])


def test_buffers_that_differ_between_ranks_are_saved_from_rank_0(exported: Any) -> None:
    rank0, rank1 = exported["ranks"]
    assert not torch.equal(rank0["saved_params"]["1.running_mean"], rank1["saved_params"]["1.running_mean"])
    for rank in (rank0, rank1):
        assert torch.equal(rank["loaded_running_mean"], rank0["saved_params"]["1.running_mean"])
    consolidated = rank0["consolidated"]
    assert all(_same(consolidated[k], v) for k, v in rank0["saved_params"].items())


@pytest.mark.parametrize("suffix", [".pt", ".safetensors", "-hf"])
def test_export_memory_is_bounded_by_the_largest_tensor_not_the_model(exported: Any, suffix: str) -> None:
    """One file: about the largest tensor. A Hugging Face directory (-hf): about one 8 MiB shard,
    which safetensors.torch.save_file holds twice (the tensors and a byte copy of each)."""
    directory = exported["directory"]
    out = directory / f"big{suffix}"
    result = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT, str(directory / "big.ckpt"), str(directory / "small.ckpt"), str(out)],
        capture_output=True, text=True, timeout=300, check=False, cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr
    numbers = json.loads(result.stdout.strip().splitlines()[-1])
    mib = 2**20
    largest = WIDTH * WIDTH * 4
    model_bytes = LAYERS * largest
    growth = numbers["peak"] - numbers["before"]
    shard = 2 * (8 * mib) if suffix == "-hf" else 0
    bound = 4 * largest + shard + 32 * mib
    report = (f"{suffix}: peak {numbers['peak'] / mib:.1f} MiB over {numbers['before'] / mib:.1f} MiB resident before"
              f" (+{growth / mib:.1f} MiB; bound {bound / mib:.0f} MiB = 4 x largest tensor{' + 2 x shard' if shard else ''}"
              " + 32 MiB) writing"
              f" {numbers['size'] / mib:.0f} MiB; weights alone {model_bytes / mib:.0f} MiB; peak reset: {numbers['reset']}")
    print(report)
    assert numbers["size"] >= model_bytes, report
    assert growth < bound < model_bytes, report
    # and the export is right: it equals what the two ranks trained
    if suffix == ".pt":
        state = torch.load(out, mmap=True, weights_only=True)
        assert len(state["optimizer_states"][0]["state"]) == LAYERS
        weights = state["state_dict"]
    elif suffix == ".safetensors":
        from safetensors.torch import load_file

        weights = load_file(out)
    else:
        from safetensors.torch import load_file

        index = json.loads((out / "model.safetensors.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        assert len(files) == LAYERS // 2 and index["metadata"]["total_size"] == model_bytes
        weights = {key: value for name in files for key, value in load_file(out / name).items()}
    reference = _big_model()
    assert set(weights) == {f"{i}.weight" for i in range(LAYERS)}
    # one Adam step of lr 1e-3 moves every weight by about 1e-3
    assert all((weights[k] - v).abs().max() <= 1.1e-3 for k, v in reference.state_dict().items())
    assert any(not torch.equal(weights[k], v) for k, v in reference.state_dict().items())


def test_the_progress_bar_ends_at_its_total(exported: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each tensor is counted when it is read: a writer that stops at the last tensor ended short."""
    import importlib

    from lightning_zero import consolidate_hf

    bars: list[Any] = []

    class RecordingBar:
        def __init__(self, path: Path, total: int) -> None:
            self.total, self.done, self.closed = total, 0, False
            bars.append(self)

        def advance(self, nbytes: int) -> None:
            self.done += nbytes

        def close(self) -> None:
            self.closed = True

    monkeypatch.setattr(importlib.import_module("lightning_zero.checkpoint.consolidate"), "_Bar", RecordingBar)
    source = exported["directory"] / "small.ckpt"
    consolidate(source, tmp_path / "small.pt")
    consolidate(source, tmp_path / "small.safetensors")
    consolidate_hf(source, tmp_path / "hf")
    assert len(bars) == 3
    assert [(bar.done, bar.closed) for bar in bars] == [(bar.total, True) for bar in bars]
    assert all(bar.total > 0 for bar in bars)


def test_console_command_exports_bf16_safetensors_with_a_progress_bar(exported: Any) -> None:
    directory = exported["directory"]
    out = directory / "small.safetensors"
    result = subprocess.run(
        [sys.executable, "-m", "lightning_zero.cli", "consolidate", str(directory / "small.ckpt"), str(out), "--dtype", "bf16"],
        capture_output=True, text=True, timeout=120, check=False, cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert "consolidating small.ckpt" in result.stdout and f"wrote {out}" in result.stdout
    from safetensors.torch import load_file

    weights = load_file(out)
    saved = {k: v for k, v in exported["engine"]["saved_params"].items() if isinstance(v, torch.Tensor)}
    cast = {k: v.bfloat16() if v.is_floating_point() else v for k, v in saved.items()}
    assert {k: v.dtype for k, v in weights.items()} == {k: v.dtype for k, v in cast.items()}
    assert all(torch.equal(weights[k], cast[k]) for k in cast)
    assert "leaves out the module's non-tensor state ['2._extra_state']" in result.stderr


def test_console_command_is_installed() -> None:
    scripts = {entry.name: entry.value for entry in entry_points(group="console_scripts")}
    assert scripts.get("lightning-zero") == "lightning_zero.cli:main"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["nowhere.ckpt", "out.pt"], "No checkpoint at"),
        (["small.ckpt/.metadata", "out.pt"], "is a file inside the sharded checkpoint"),
        (["empty", "out.pt"], "not a complete checkpoint"),
        (["notes.txt", "out.pt"], "notes.txt is not a checkpoint: a sharded checkpoint is a directory"),
        (["one_file.pt", "out.pt"], "one_file.pt is a single torch file, not a sharded checkpoint directory: there is nothing"
                                 " to consolidate"),
        (["deepspeed.ckpt", "out.pt"], "deepspeed.ckpt is a DeepSpeed checkpoint (it holds checkpoint, latest,"
                                       " zero_to_fp32.py), not a lightning_zero one. Convert it"),
        ([".", "out.pt"], "), not a checkpoint itself: pass one of them, e.g."),
    ],
)
def test_console_command_reports_bad_input_without_a_traceback(
    exported: Any, arguments: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # In this process (a console run costs seconds of imports each): an exception that is no
    # message would fail the test. The exit code and stderr of a real console run: the test below.
    directory = _bad_inputs(exported["directory"])
    assert main(["consolidate", *[str(directory / a) for a in arguments]]) == 2
    assert message in capsys.readouterr().err
    assert not (directory / "out.pt").exists()


def test_console_command_exits_2_on_bad_input_without_a_traceback(exported: Any) -> None:
    directory = _bad_inputs(exported["directory"])
    result = subprocess.run(
        [sys.executable, "-m", "lightning_zero.cli", "consolidate", str(directory / "empty"), str(directory / "out.pt")],
        capture_output=True, text=True, timeout=120, check=False, cwd=REPO_ROOT,
    )
    assert result.returncode == 2
    assert "not a complete checkpoint" in result.stderr and "Traceback" not in result.stderr
    assert not (directory / "out.pt").exists()


def _bad_inputs(directory: Path) -> Path:
    """Beside the exported checkpoint: things that are not one, each of which the command refuses."""
    (directory / "empty").mkdir(exist_ok=True)
    (directory / "notes.txt").write_text("not a checkpoint\n")
    torch.save({"state_dict": {}}, directory / "one_file.pt")
    deepspeed = directory / "deepspeed.ckpt"  # the layout of Lightning's DeepSpeedStrategy
    (deepspeed / "checkpoint").mkdir(parents=True, exist_ok=True)
    (deepspeed / "latest").write_text("checkpoint")
    (deepspeed / "zero_to_fp32.py").write_text("")
    torch.save({}, deepspeed / "checkpoint" / "mp_rank_00_model_states.pt")
    return directory


def test_bad_dtype_is_refused(exported: Any) -> None:
    with pytest.raises(ValueError, match="consolidate\\(dtype='int8'\\) is not one of 'fp32', 'bf16', 'fp16'"):
        consolidate(exported["directory"] / "small.ckpt", exported["directory"] / "x.pt", dtype="int8")  # type: ignore[arg-type]


def test_an_export_never_writes_into_a_checkpoint_or_over_a_file_unasked(tmp_path: Path) -> None:
    """OUT inside the source (one of its shards, its .metadata) or inside another checkpoint damaged
    that checkpoint, and an existing OUT was replaced without a word; --overwrite replaces it."""
    source, other = tmp_path / "run.ckpt", tmp_path / "other.ckpt"
    _complete_checkpoint(source, "source")
    _complete_checkpoint(other, "other")
    before = {path: path.read_bytes() for directory in (source, other) for path in directory.iterdir()}
    shard = next(source.glob("*.distcp"))
    for out in (shard, source / ".metadata", source / "new.pt", other / "new.pt"):
        with pytest.raises(CheckpointError, match="is inside the sharded checkpoint .*: writing there would damage it"):
            consolidate(source, out, progress=False, overwrite=True)
    from lightning_zero import consolidate_hf

    for out_dir in (source, source / "hf"):
        with pytest.raises(CheckpointError, match="is inside the sharded checkpoint"):
            consolidate_hf(source, out_dir, overwrite=True, progress=False)
    assert {path: path.read_bytes() for directory in (source, other) for path in directory.iterdir()} == before

    kept = tmp_path / "kept.pt"
    kept.write_bytes(b"someone's file")
    command = [sys.executable, "-m", "lightning_zero.cli", "consolidate", str(source), str(kept), "--no-progress"]
    refused = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False, cwd=REPO_ROOT)
    assert refused.returncode == 2 and "kept.pt exists: pass overwrite=True (--overwrite)" in refused.stderr
    assert kept.read_bytes() == b"someone's file"
    replaced = subprocess.run([*command, "--overwrite"], capture_output=True, text=True, timeout=120, check=False,
                              cwd=REPO_ROOT)
    assert replaced.returncode == 0, replaced.stderr
    assert set(torch.load(kept, weights_only=False)["state_dict"]) == {"weight", "bias"}


# ------------------------------------------------------------------------------ atomic replacement
def _complete_checkpoint(path: Path, marker: str) -> None:
    """A tiny but real checkpoint directory (single process)."""
    model = nn.Linear(2, 2)
    meta = sharded.CheckpointMeta(world_size=1, stage=2, model_keys=list(model.state_dict()), aliases={},
                                  param_dtypes={}, lightning={"marker": marker})
    sharded.save_sharded(path, {"model": {k: v.detach() for k, v in model.state_dict().items()},
                                sharded.META_KEY: meta.to_entry()})


def test_save_replaces_a_checkpoint_and_leaves_nothing_behind(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    _complete_checkpoint(path, "first")
    _complete_checkpoint(path, "second")
    assert sharded.read_meta(path).lightning == {"marker": "second"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_save_refuses_a_directory_that_is_not_a_checkpoint_and_keeps_its_files(tmp_path: Path) -> None:
    # trainer.save_checkpoint(default_root_dir) replaced the run's directory, logs and data included
    root = tmp_path / "run"
    (root / "lightning_logs" / "version_0").mkdir(parents=True)
    (root / "my_dataset.csv").write_text("precious")
    with pytest.raises(CheckpointError, match=r"run: it is a directory that is not a checkpoint \(it holds"
                                              r" lightning_logs, my_dataset.csv\).*e.g. .*run/model.ckpt"):
        _complete_checkpoint(root, "first")
    assert sorted(p.name for p in root.iterdir()) == ["lightning_logs", "my_dataset.csv"]
    assert (root / "my_dataset.csv").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no partial directory left either
    # an empty directory holds nothing to lose: it becomes the checkpoint
    (tmp_path / "empty").mkdir()
    _complete_checkpoint(tmp_path / "empty", "second")
    assert sharded.read_meta(tmp_path / "empty").lightning == {"marker": "second"}


def test_crash_between_the_two_renames_falls_back_to_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "last.ckpt"
    _complete_checkpoint(path, "first")
    monkeypatch.setattr(sharded, "_exchange", lambda a, b: False)  # a filesystem without RENAME_EXCHANGE
    real_rename = os.rename

    def rename_then_crash(src: Any, dst: Any) -> None:
        if Path(dst) == path:  # the old one was moved aside; the new one is not in place yet
            raise KeyboardInterrupt("killed between the renames")
        real_rename(src, dst)

    monkeypatch.setattr(sharded.os, "rename", rename_then_crash)
    with pytest.raises(KeyboardInterrupt):
        _complete_checkpoint(path, "second")
    monkeypatch.setattr(sharded.os, "rename", real_rename)
    assert not path.exists()
    with caplog.at_level(logging.WARNING):
        found = sharded.resolve_checkpoint_path(path)
    assert found == tmp_path / ".last.ckpt.previous" and "interrupted" in caplog.text
    assert sharded.read_meta(found).lightning == {"marker": "first"}
    # The next save completes normally and cleans up.
    _complete_checkpoint(path, "third")
    assert sharded.read_meta(path).lightning == {"marker": "third"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_an_interrupted_first_save_is_reported_as_such(tmp_path: Path) -> None:
    (tmp_path / ".last.ckpt.partial").mkdir()
    with pytest.raises(CheckpointError, match="a save to this path was interrupted before it completed"):
        sharded.resolve_checkpoint_path(tmp_path / "last.ckpt")


def test_flat_ranges_become_boxes_of_the_true_shape() -> None:
    for shape in [(5, 7), (3, 4, 5), (13,), (), (2, 3, 4, 5)]:
        flat = torch.arange(max(1, int(torch.tensor(shape).prod()))).reshape(shape)
        numel = flat.numel()
        for start in range(numel + 1):
            for end in range(start, numel + 1):
                covered = []
                boxes = sharded.flat_range_boxes(shape, start, end)
                assert len(boxes) <= max(1, 2 * len(shape) - 1)
                for offsets, sizes, flat_range in boxes:
                    box = flat[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
                    assert torch.equal(box.reshape(-1), flat.reshape(-1)[flat_range.start : flat_range.end])
                    covered.extend(range(flat_range.start, flat_range.end))
                assert covered == list(range(start, end))
