"""ZeroMemoryProfiler on 2 gloo ranks: its model-state numbers are model_state_bytes()'s, every
rank reaches rank 0's CSV and plots, metrics reach a CSVLogger, and it only works on the sampled
batches."""

from __future__ import annotations

import csv
import os
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BaseFinetuning
import pytest
import torch
import torch.distributed as dist

from harness import launched_environment, run_on_ranks
from models import TinyGPT, loader

from lightning_zero import ZeroConfig, ZeroMemoryProfiler, ZeroStrategy

STEPS = 6


class StateBytes(pl.Callback):
    """model_state_bytes() where the profiler takes its after-step sample (it runs just before)."""

    def __init__(self) -> None:
        self.by_step: dict[int, tuple[int, int, int]] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        state = trainer.strategy.model_state_bytes()
        # keyed by the step this batch ran (the profiler labels every phase of a batch so)
        self.by_step[trainer.global_step - 1] = (state.params, state.grads, state.optimizer_states)


def _profile(tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {"rank": dist.get_rank()}
    for stage in (2, 3):
        directory = os.path.join(tmp, f"stage{stage}")
        profiler = ZeroMemoryProfiler(every_n_steps=2)
        state = StateBytes()
        torch.manual_seed(0)
        with launched_environment():
            trainer = pl.Trainer(
                accelerator="cpu", devices=dist.get_world_size(), strategy=ZeroStrategy(config=ZeroConfig(stage=stage)),
                max_steps=STEPS, default_root_dir=directory, callbacks=[profiler, state],
                logger=pl.loggers.CSVLogger(directory, name="logs"), log_every_n_steps=1, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False,
            )
            trainer.fit(TinyGPT(width=64), train_dataloaders=loader())
        out[stage] = {
            "samples": [s.as_row() for s in profiler.samples],
            "files": [str(path) for path in profiler.files],
            "state": state.by_step,
            "estimate": profiler.estimate,
            "log_dir": trainer.logger.log_dir if trainer.global_rank == 0 else None,
            "seconds": profiler.sampling_seconds,
        }
    # Fine-tuning at stage 3: embedding and block frozen, one unit per block (named by class).
    profiler, state = ZeroMemoryProfiler(plots=False, log_metrics=False, output_dir=os.path.join(tmp, "frozen")), StateBytes()
    module = TinyGPT(width=64)
    module.embed.requires_grad_(False)
    module.block.requires_grad_(False)
    with launched_environment():
        trainer = pl.Trainer(
            accelerator="cpu", devices=dist.get_world_size(), max_steps=2, callbacks=[profiler, state], logger=False,
            strategy=ZeroStrategy(config=ZeroConfig(stage=3, unit_modules=("TransformerEncoderLayer",))),
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )
        trainer.fit(module, train_dataloaders=loader())
    out["frozen"] = {"estimate": profiler.estimate, "state": state.by_step[1]}
    # Frozen after the layout, by a callback's on_fit_start: the engine still holds master
    # gradients and optimizer state for them.
    for stage in (2, 3):
        units = {"unit_modules": ("TransformerEncoderLayer",)} if stage == 3 else {}
        profiler, state = ZeroMemoryProfiler(plots=False, log_metrics=False,
                                             output_dir=os.path.join(tmp, f"frozen_later{stage}")), StateBytes()
        with launched_environment():
            trainer = pl.Trainer(
                accelerator="cpu", devices=dist.get_world_size(), max_steps=2, logger=False,
                callbacks=[FreezeAtFitStart(), profiler, state], enable_checkpointing=False,
                strategy=ZeroStrategy(config=ZeroConfig(stage=stage, **units)), enable_progress_bar=False,
                enable_model_summary=False,
            )
            module = TinyGPT(width=64)
            trainer.fit(module, train_dataloaders=loader())
        backbone = sum(p.numel() for p in [*module.embed.parameters(), *module.block.parameters()])
        out[f"frozen later {stage}"] = {"estimate": profiler.estimate, "state": state.by_step[1], "backbone": backbone}
    return out


class FreezeAtFitStart(pl.Callback):
    """Freezes the embedding and the block once the strategy has set the model up (BaseFinetuning
    freezes in setup, before: the engine then lays them out as frozen)."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        BaseFinetuning.freeze([pl_module.embed, pl_module.block])


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_on_ranks(_profile, 2, str(tmp_path_factory.mktemp("memory")))


@pytest.mark.parametrize("stage", [2, 3])
def test_model_state_numbers_are_model_state_bytes(profiled: list[dict[str, Any]], stage: int) -> None:
    for rank in profiled:
        mine = [s for s in profiled[0][stage]["samples"] if s["rank"] == rank["rank"] and s["phase"] == "step"]
        assert [s["step"] for s in mine] == [0, 2, 4]  # batches 1, 3, 5 of 6: every 2nd, the first too
        for sample in mine:
            measured = (sample["params_device"] + sample["params_host"], sample["grads_device"] + sample["grads_host"],
                        sample["optimizer_device"] + sample["optimizer_host"])
            assert measured == rank[stage]["state"][sample["step"]]


@pytest.mark.parametrize("stage", [2, 3])
def test_every_rank_and_phase_reach_the_csv_and_plots(profiled: list[dict[str, Any]], stage: int) -> None:
    files = profiled[0][stage]["files"]
    assert [os.path.basename(f) for f in files] == ["memory.csv", "memory_over_steps.png", "memory_per_rank.png"]
    with open(files[0]) as file:
        rows = list(csv.DictReader(file))
    assert len(rows) == 2 * 3 * 3  # ranks x sampled steps x phases
    assert {(row["rank"], row["phase"]) for row in rows} == {(r, p) for r in "01" for p in ("forward", "backward", "step")}
    forward = [row for row in rows if row["phase"] == "forward"]
    assert all(int(row["activations"]) > 0 for row in forward)
    assert all(int(row["peak_rss"]) >= int(row["rss"]) > 0 for row in rows)  # the mark bounds the size
    for png in files[1:]:
        with open(png, "rb") as image:
            assert image.read(8) == b"\x89PNG\r\n\x1a\n"
    assert profiled[1][stage]["files"] == []  # only rank 0 writes
    steps = [row for row in rows if row["phase"] == "step"]
    backward = [row for row in rows if row["phase"] == "backward"]
    if stage == 3:  # stage 3 gathers units for forward and backward and frees them after
        assert all(int(row["params_gathered"]) == 0 for row in steps)
    # Gradient buffers: stage 2 frees each bucket's once reduced, stage 3 each unit's; both exist
    # during backward (the last ones reduce at the step).
    assert all(int(row["grads_buffers"]) == 0 for row in steps)
    assert all(0 < int(row["grads_buffers"]) <= int(row["grads_device"]) for row in backward)


def test_metrics_reach_the_logger(profiled: list[dict[str, Any]]) -> None:
    with open(os.path.join(profiled[0][2]["log_dir"], "metrics.csv")) as file:
        rows = list(csv.DictReader(file))
    columns = set(rows[0])
    for rank in (0, 1):
        assert f"memory/rank{rank}/step/optimizer_device" in columns
        assert f"memory/rank{rank}/forward/activations" in columns
    logged = [float(row["memory/rank1/step/params_device"]) for row in rows if row["memory/rank1/step/params_device"]]
    assert len(logged) == 3 and logged[0] > 0


def test_estimate_beside_the_measurement(profiled: list[dict[str, Any]]) -> None:
    for stage in (2, 3):
        estimate = profiled[0][stage]["estimate"]
        last = [s for s in profiled[0][stage]["samples"] if s["phase"] == "step" and s["rank"] == 0][-1]
        measured = sum(last[k] for k in ("params_device", "params_host", "grads_device", "grads_host",
                                         "optimizer_device", "optimizer_host"))
        assert measured == pytest.approx(estimate.model_states, rel=0.05)


def test_estimate_of_a_fine_tuning_with_frozen_parameters(profiled: list[dict[str, Any]]) -> None:
    """Frozen parameters are held (at stage 3 with their unit's master and master gradient), not
    trained: each category of the estimate within 5% of what the rank holds; the units the
    strategy was told of size the estimate (no guessed unit size)."""
    for rank in profiled:
        estimate, state = rank["frozen"]["estimate"], rank["frozen"]["state"]
        assert estimate.frozen_params > estimate.num_params > 0
        expected = (estimate.device.params + estimate.host.params, estimate.device.grads + estimate.host.grads,
                    estimate.device.optimizer_states + estimate.host.optimizer_states)
        for measured, want in zip(state, expected):
            assert measured == pytest.approx(want, rel=0.05)
        assert not any("unit size not known" in note for note in estimate.notes)


@pytest.mark.parametrize("stage", [2, 3])
def test_estimate_of_parameters_frozen_after_the_layout_counts_what_the_engine_holds(
        profiled: list[dict[str, Any]], stage: int) -> None:
    """A backbone a callback froze in on_fit_start was frozen only after the strategy laid the
    model out: the engine still holds its masters and master gradients, and the estimate counts
    them (before, it read requires_grad and left them out). Its Adam moments are created once it
    trains again (the estimate is the peak): the ranks hold those 2 x 4 bytes per element less,
    together (which rank owns the frozen elements' chunks depends on the buckets)."""
    moments = 0
    for rank in profiled:
        run = rank[f"frozen later {stage}"]
        estimate, (params, grads, optimizer_states) = run["estimate"], run["state"]
        assert estimate.frozen_params == 0
        assert params == pytest.approx(estimate.device.params + estimate.host.params, rel=0.05)
        assert grads == pytest.approx(estimate.device.grads + estimate.host.grads, rel=0.05)
        moments += estimate.device.optimizer_states + estimate.host.optimizer_states - optimizer_states
    assert moments == pytest.approx(8 * profiled[0][f"frozen later {stage}"]["backbone"], rel=0.05)


def test_cuda_snapshot_without_cuda_warns(tmp_path: Any) -> None:
    """On a CPU run the snapshot option says it records nothing (and training goes on)."""
    profiler = ZeroMemoryProfiler(cuda_snapshot_steps=2, plots=False, log_metrics=False)
    with pytest.warns(UserWarning, match="cuda_snapshot_steps=...\\) needs CUDA"):
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, callbacks=[profiler], logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             default_root_dir=str(tmp_path))
        trainer.fit(TinyGPT(width=16), train_dataloaders=loader())
    assert len(profiler.samples) == 2 * 3  # one rank, two batches, three phases


def test_stage_3_activations_leave_out_the_gathered_units(profiled: list[dict[str, Any]]) -> None:
    """The same forward saves the same activations at stage 2 and stage 3 (stage 3's gathered
    weights are parameters, counted as params_gathered, not activations)."""
    def forward(stage: int) -> list[int]:
        return [s["activations"] for s in profiled[0][stage]["samples"] if s["phase"] == "forward"]

    assert forward(2) == forward(3)


class FailingAt(TinyGPT):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if batch_idx == 1:
            raise ValueError("boom")
        return super().training_step(batch, batch_idx)


def _fit_alone(module: pl.LightningModule, profiler: ZeroMemoryProfiler, tmp: Any, ckpt_path: str | None = None,
               **kwargs: Any) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=1, callbacks=[profiler], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp), **kwargs)
    trainer.fit(module, train_dataloaders=loader(), ckpt_path=ckpt_path)


def test_accumulated_steps_are_sampled_once_each(tmp_path: Any) -> None:
    profiler = ZeroMemoryProfiler(plots=False)
    _fit_alone(TinyGPT(width=16), profiler, tmp_path, max_steps=3, accumulate_grad_batches=2)
    assert [(s.step, s.phase) for s in profiler.samples] == [
        (step, phase) for step in range(3) for phase in ("forward", "backward", "step")]


def test_a_resumed_run_continues_the_profile_in_its_directory(tmp_path: Any) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_zero.profiling.report import read_csv

    out = tmp_path / "memory"
    first = ZeroMemoryProfiler(plots=False, output_dir=out)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    trainer = pl.Trainer(accelerator="cpu", devices=1, callbacks=[first, checkpoints], logger=False,
                         enable_progress_bar=False, enable_model_summary=False, max_steps=3)
    trainer.fit(TinyGPT(width=16), train_dataloaders=loader())
    assert sorted({s.step for s in read_csv(out / "memory.csv")}) == [0, 1, 2]
    resumed = ZeroMemoryProfiler(plots=True, output_dir=out)
    _fit_alone(TinyGPT(width=16), resumed, tmp_path, max_steps=5, ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt"))
    assert sorted({s.step for s in resumed.samples}) == [2, 3, 4]
    # The first run's steps 0 and 1, then every sample of the resumed run (its step 2 replaces the first run's).
    assert read_csv(out / "memory.csv") == [s for s in first.samples if s.step < 2] + resumed.samples
    assert {p.name for p in resumed.files} == {"memory.csv", "memory_over_steps.png", "memory_per_rank.png"}
    # A run from the start replaces the profile; a file that is not one is replaced with a warning.
    fresh = ZeroMemoryProfiler(plots=False, output_dir=out)
    _fit_alone(TinyGPT(width=16), fresh, tmp_path, max_steps=1)
    assert read_csv(out / "memory.csv") == fresh.samples
    (out / "memory.csv").write_text("step,loss\n0,1.5\n")
    stranger = ZeroMemoryProfiler(plots=False, output_dir=out)
    with pytest.warns(UserWarning, match=r"memory.csv' is not continued .*columns \['step', 'loss'\]"):
        _fit_alone(TinyGPT(width=16), stranger, tmp_path, max_steps=3, ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt"))
    assert read_csv(out / "memory.csv") == stranger.samples


def test_no_hook_outlives_a_failed_step(tmp_path: Any) -> None:
    from lightning_zero.profiling.measure import storage_key

    profiler = ZeroMemoryProfiler(plots=False)
    with pytest.raises(ValueError, match="boom"):
        _fit_alone(FailingAt(width=16), profiler, tmp_path, max_steps=3)
    assert profiler._activations is None
    seen: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(1) or t, lambda t: t):
        (torch.ones(2, requires_grad=True) * torch.ones(2)).sum().backward()
    assert seen  # ours is the only hook left: the profiler's is gone
    nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)], layout=torch.jagged)
    assert storage_key(nested) is None or isinstance(storage_key(nested), int)  # never raises


def test_bad_arguments(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="every_n_steps=0"):
        ZeroMemoryProfiler(every_n_steps=0)
    with pytest.raises(ValueError, match="cuda_snapshot_steps=-1"):
        ZeroMemoryProfiler(cuda_snapshot_steps=-1)
    with pytest.raises(ValueError, match=r"output_dir=5\) must be a directory path"):
        ZeroMemoryProfiler(output_dir=5)  # type: ignore[arg-type]
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    with pytest.raises(ValueError, match=r"a_file'\) is a file, not a directory"):
        ZeroMemoryProfiler(output_dir=a_file)
    # A directory that cannot be made stops the run before training, not after it (the profile lost).
    profiler = ZeroMemoryProfiler(output_dir=a_file / "memory", plots=False)
    with pytest.raises(ValueError, match=r"output_dir=...\): .*a_file/memory' cannot be made a directory"):
        _fit_alone(TinyGPT(width=16), profiler, tmp_path, max_steps=2)
    assert profiler.samples == [] and a_file.read_text() == "mine"


def test_host_memory_available_takes_the_tightest_cgroup_limit(tmp_path: Any) -> None:
    """MemAvailable, or less where a memory cgroup (this one or a parent, v2 or v1) leaves less;
    the reclaimable inactive page cache counts as available (what a teardown may still take)."""
    from lightning_zero.profiling.measure import host_memory_available

    MiB = 2**20
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal:  4000000 kB\nMemAvailable:   1000000 kB\n")
    # cgroup v2: the job's limit sits on the parent of this process's cgroup, which has none.
    (proc / "self" / "cgroup").write_text("0::/job/step\n")
    (root / "job" / "step").mkdir(parents=True)
    (root / "job" / "step" / "memory.max").write_text("max\n")
    (root / "job" / "step" / "memory.current").write_text("5\n")
    (root / "job" / "memory.max").write_text(f"{600 * MiB}\n")
    (root / "job" / "memory.current").write_text(f"{200 * MiB}\n")
    (root / "job" / "memory.stat").write_text(f"anon {150 * MiB}\ninactive_file {50 * MiB}\n")
    assert host_memory_available(proc, root) == 450 * MiB
    (root / "job" / "memory.max").write_text("max\n")  # no limit anywhere: MemAvailable
    assert host_memory_available(proc, root) == 1000000 * 1024
    # cgroup v1, where "no limit" is a huge number
    (proc / "self" / "cgroup").write_text("4:memory:/docker/abc\n3:cpu,cpuacct:/\n")
    (root / "memory" / "docker" / "abc").mkdir(parents=True)
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (root / "memory" / "docker" / "abc" / "memory.limit_in_bytes").write_text(f"{1024 * MiB}\n")
    (root / "memory" / "docker" / "abc" / "memory.usage_in_bytes").write_text(f"{512 * MiB}\n")
    (root / "memory" / "docker" / "abc" / "memory.stat").write_text(f"cache 1\ntotal_inactive_file {256 * MiB}\n")
    assert host_memory_available(proc, root) == 768 * MiB
    assert host_memory_available(tmp_path / "nothing", tmp_path / "nothing") is None
