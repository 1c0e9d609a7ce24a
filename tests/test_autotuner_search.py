"""The autotuner's plain parts without ranks: the search against a model of memory and speed, the
search space's checks, byte sizes, the guard on one rank, the YAML it writes, and (one process)
data whose batch size cannot be set."""

from __future__ import annotations

import itertools
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from harness import run_on_ranks
from lightning_zero import ZeroConfig
from lightning_zero.autotuning import (
    Candidate,
    SearchSpace,
    TrialGuard,
    TrialRecord,
    TrialStatus,
    TuningError,
    is_out_of_memory,
    parse_bytes,
    search,
)
from lightning_zero.autotuning.report import results_table, tuned_yaml, zero_config_fields

MiB = 2**20
NUMEL = 8_000_000
STATE = {1: 100 * MiB, 2: 70 * MiB, 3: 40 * MiB}  # model state per rank by stage
OFFLOAD_SAVES = {"none": 0, "optimizer": 25 * MiB, "params": 35 * MiB}
SPEED = {(1, "none"): 1.0, (2, "none"): 0.95, (3, "none"): 0.8, (1, "optimizer"): 0.5, (2, "optimizer"): 0.48,
         (3, "optimizer"): 0.4, (3, "params"): 0.3}


class ModelRunner:
    """Memory = state + 5 MiB per sample (+ a bucket's worth); speed saturates with the micro-batch.
    ``estimate_error`` scales what the estimate says against what a trial measures."""

    def __init__(self, estimate_error: float = 1.0, oom_above: int | None = None, noise: float = 0.0) -> None:
        self.estimate_error, self.oom_above, self.noise = estimate_error, oom_above, noise
        self.runs: list[Candidate] = []

    def memory(self, c: Candidate) -> int:
        bucket = 4 * min(c.reduce_bucket_size, NUMEL) if c.stage < 3 else 4 * c.min_unit_numel * (1 + c.prefetch_units)
        return STATE[c.stage] - OFFLOAD_SAVES[c.offload] + 5 * MiB * c.micro_batch_size + bucket

    def estimate(self, c: Candidate) -> int | None:
        return int(self.memory(c) * self.estimate_error)

    def run(self, c: Candidate) -> TrialRecord:
        self.runs.append(c)
        if self.oom_above is not None and c.micro_batch_size > self.oom_above:
            return TrialRecord(c, TrialStatus.OOM, message="rank 1: CUDA out of memory")
        knob = 1.0 + (0.05 if c.reduce_bucket_size == 4_000_000 else 0.0) + 0.02 * c.prefetch_units
        rate = SPEED[(c.stage, c.offload)] * knob * 100 * c.micro_batch_size / (c.micro_batch_size + 32)
        rate *= 1.0 + self.noise * (hash(c) % 7 - 3) / 3
        return TrialRecord(c, TrialStatus.FITS, samples_per_sec=rate, peak_bytes=self.memory(c))


SPACE = SearchSpace(micro_batch_sizes=(1, 2, 4, 8, 16, 32, 64), reduce_bucket_sizes=(1_000_000, 4_000_000, 25_000_000))


def _fits(runner: ModelRunner, budget: int) -> dict[Candidate, TrialRecord]:
    grid = search(SPACE, ZeroConfig(), NUMEL, ModelRunner(), budget, method="grid")
    return {r.candidate: r for r in grid.records}


@pytest.mark.parametrize("budget_mib", [200, 300, 420, 700])
@pytest.mark.parametrize("estimate_error", [0.8, 1.0, 1.25])
def test_the_search_finds_the_grids_best_with_far_fewer_trials(budget_mib: int, estimate_error: float) -> None:
    budget = budget_mib * MiB
    runner = ModelRunner(estimate_error)
    fast = search(SPACE, ZeroConfig(), NUMEL, runner, budget)
    grid = search(SPACE, ZeroConfig(), NUMEL, ModelRunner(), budget, method="grid")
    assert fast.best.fits and fast.best.peak_bytes <= budget
    assert fast.best.samples_per_sec >= 0.9 * grid.best.samples_per_sec
    assert fast.trials <= grid.trials // 4
    assert len(runner.runs) == fast.trials == len(set(runner.runs))  # no configuration twice


def test_the_search_starts_from_the_backends_default_bucket() -> None:
    """With the process group's backend, the first trial's bucket is what training without the
    autotuner would use there (gloo's floor for a small model: see [Note: bucket size])."""
    space = SearchSpace(micro_batch_sizes=(8,), stages=(1,), offload=("none",))
    for backend, default in ((None, 1_000_000), ("nccl", 1_000_000), ("gloo", 2_000_000)):
        runner = ModelRunner()
        search(space, ZeroConfig(), 3_200_000, runner, 10_000 * MiB, backend=backend)
        assert runner.runs[0].reduce_bucket_size == default == ZeroConfig().bucket_size_for(3_200_000, backend)


def test_a_budget_that_excludes_large_micro_batches_at_stage_1_moves_to_a_sharded_stage() -> None:
    budget = 420 * MiB  # stage 1 fits up to 32; stage 2 (with small buckets) and 3 fit 64
    result = search(SPACE, ZeroConfig(), NUMEL, ModelRunner(), budget)
    assert result.best.candidate.micro_batch_size == 64 and result.best.candidate.stage in (2, 3)
    assert not any(r.candidate.stage == 1 and r.candidate.micro_batch_size == 64 and r.ran for r in result.records)
    assert any(r.status is TrialStatus.SKIPPED for r in result.records)


def test_trials_that_run_out_of_memory_are_searched_around() -> None:
    runner = ModelRunner(estimate_error=0.5, oom_above=8)  # the estimate says everything fits
    result = search(SPACE, ZeroConfig(), NUMEL, runner, 10_000 * MiB)
    assert result.best.candidate.micro_batch_size == 8
    assert any(r.status is TrialStatus.OOM for r in result.records)
    assert result.trials <= 126 // 8  # the grid runs 126


def test_a_measured_peak_over_the_budget_is_rejected_even_though_it_ran() -> None:
    runner = ModelRunner(estimate_error=0.5)
    result = search(SearchSpace(micro_batch_sizes=(8, 16), stages=(1,), offload=("none",),
                                reduce_bucket_sizes=(1_000_000,)), ZeroConfig(), NUMEL, runner, 170 * MiB)
    statuses = {r.candidate.micro_batch_size: r.status for r in result.records}
    assert statuses[16] is TrialStatus.OVER_BUDGET and result.best.candidate.micro_batch_size == 8
    assert "budget" in next(r.message for r in result.records if r.status is TrialStatus.OVER_BUDGET)


def test_nothing_fits_gives_a_message_naming_the_budget() -> None:
    with pytest.raises(TuningError, match=r"budget of 10.0 MiB per rank is smaller than every configuration"):
        search(SPACE, ZeroConfig(), NUMEL, ModelRunner(), 10 * MiB)
    with pytest.raises(TuningError, match=r"no configuration fits in .* OOM"):
        search(SPACE, ZeroConfig(), NUMEL, ModelRunner(estimate_error=0.1, oom_above=0), 10_000 * MiB)


def test_the_search_space_checks_itself() -> None:
    with pytest.raises(ValueError, match="micro_batch_sizes is empty"):
        SearchSpace(micro_batch_sizes=())
    with pytest.raises(ValueError, match=r"stages=\[4\] may only hold 1, 2 and 3"):
        SearchSpace(stages=(4,))
    with pytest.raises(ValueError, match="holds no configuration: parameter offload"):
        SearchSpace(stages=(1, 2), offload=("params",))
    with pytest.raises(ValueError, match="offload="):
        SearchSpace(offload=("disk",))
    space = SearchSpace(micro_batch_sizes=[16, 4, 4], stages=[3, 1], offload="optimizer")
    assert space.micro_batch_sizes == (4, 16) and space.layouts() == [(1, "optimizer"), (3, "optimizer")]
    assert SearchSpace().layouts()[:3] == [(1, "none"), (2, "none"), (3, "none")]
    # The base's bucket (sized from the model by default: 80M / 8) and fractions of the model.
    assert SearchSpace().bucket_sizes(ZeroConfig(), 80_000_000) == (5_000_000, 10_000_000, 20_000_000)
    # A small model: the backend's floor (gloo's is higher, see [Note: bucket size]) and fractions.
    assert SearchSpace().bucket_sizes(ZeroConfig(), 3_200_000) == (200_000, 800_000, 1_000_000)
    assert SearchSpace().bucket_sizes(ZeroConfig(), 3_200_000, "gloo") == (200_000, 800_000, 2_000_000)
    assert SearchSpace().bucket_sizes(ZeroConfig(reduce_bucket_size=25_000_000), 80_000_000) == (
        5_000_000, 20_000_000, 25_000_000)


@pytest.mark.parametrize("text,expected", [("8GiB", 8 * 2**30), ("512 MB", 512 * 10**6), ("1.5e9", 1_500_000_000),
                                           (2048, 2048), ("3 kib", 3072)])
def test_byte_sizes(text: object, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["lots", "-1GiB", 0, True, "1 parsec"])
def test_bad_byte_sizes_name_the_value(bad: object) -> None:
    with pytest.raises(ValueError, match="budget="):
        parse_bytes(bad)


def test_the_guard_on_one_rank_and_what_counts_as_out_of_memory() -> None:
    guard = TrialGuard()
    guard.arm()
    guard.check()
    assert guard.gather("x") == ["x"] and not guard.tripped
    guard.fail()
    assert guard.tripped
    guard.arm()
    assert not guard.tripped
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 GB"))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def _guard_timeouts(init_file: str) -> tuple[Any, Any, Any]:
    import torch.distributed as dist

    from lightning_zero.zero.comm import _timeout_of

    # The run's own timeout, as ZeroStrategy(timeout=...) gives the world group.
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=42))
    return (_timeout_of(TrialGuard()._group), _timeout_of(None),
            _timeout_of(TrialGuard(timeout=timedelta(seconds=7))._group))


def test_the_guards_group_waits_as_long_as_the_users(tmp_path: Path) -> None:
    """It took torch's default timeout of a new group (30 min), not the one the user gave the run."""
    default, world, given = run_on_ranks(_guard_timeouts, 2, str(tmp_path / "init"))[0]
    assert world == default == timedelta(seconds=42) and given == timedelta(seconds=7)


@pytest.mark.parametrize("stage,offload", [(1, "none"), (2, "optimizer"), (3, "params")])
def test_the_tuned_config_round_trips_through_yaml_fields(stage: int, offload: str) -> None:
    base = ZeroConfig(reduce_dtype="bf16")
    config = Candidate(stage, offload, 8, 1_000_000, 2, 500_000).zero_config(base)
    assert ZeroConfig.from_dict(zero_config_fields(config)) == config
    assert config.reduce_dtype == "bf16"


def test_the_yaml_keeps_the_run_and_drops_the_tuner() -> None:
    result = search(SPACE, ZeroConfig(), NUMEL, ModelRunner(), 300 * MiB)
    config = result.best.candidate.zero_config(ZeroConfig())
    base = {"trainer": {"strategy": {"class_path": "lightning_zero.ZeroStrategy",
                                     "init_args": {"stage": 2, "state_dict_type": "full", "collectives": None}},
                        "callbacks": [{"class_path": "lightning_zero.ZeroAutotuner", "init_args": {}},
                                      {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint"}]},
            "data": {"class_path": "my.Data", "init_args": {"batch_size": 2, "root": "x"}}, "model": {"n_layer": 4}}
    tuned = tuned_yaml(result, config, "data", "batch_size", base)
    strategy = tuned["trainer"]["strategy"]["init_args"]
    # stage null: the config's stage wins over a stage an earlier --config file gives
    assert strategy["state_dict_type"] == "full" and strategy["stage"] is None and "collectives" not in strategy
    assert strategy["config"]["stage"] == result.best.candidate.stage
    assert tuned["trainer"]["callbacks"] == [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint"}]
    assert tuned["data"]["init_args"] == {"batch_size": result.best.candidate.micro_batch_size, "root": "x"}
    assert tuned["model"] == {"n_layer": 4} and base["data"]["init_args"]["batch_size"] == 2  # base untouched
    fragment = tuned_yaml(result, config, "model", "batch_size", None)
    assert fragment["model"] == {"batch_size": result.best.candidate.micro_batch_size}
    assert fragment["trainer"]["strategy"]["init_args"]["stage"] is None
    assert tuned_yaml(result, config, "data", "batch_size", {"trainer": {"strategy": "zero3_spawn"}})[
        "trainer"]["strategy"]["init_args"]["start_method"] == "spawn"
    table = results_table(result)
    assert table.row_count == result.trials and "skipped" in str(table.caption)


def test_candidates_name_each_configuration_once() -> None:
    assert len({c.label for c in itertools.starmap(Candidate, [(1, "none", 8, 10**6, 1, 10**6),
                                                                 (3, "none", 8, 10**6, 1, 10**6)])}) == 2


def test_data_whose_batch_size_cannot_be_set_is_tuned_at_its_own_size_only() -> None:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from harness import launched_environment
    from lightning_zero import ZeroStrategy, ZeroTuner
    from tune_models import DataBlocks, data

    class NoBatchSize(DataBlocks):
        def __init__(self) -> None:
            super().__init__()
            del self.batch_size

    def tune(sizes: tuple[int, ...]) -> Any:
        trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=ZeroStrategy(stage=2), max_steps=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        with launched_environment():
            return ZeroTuner(trainer).tune(NoBatchSize(), DataLoader(data(64, 256), batch_size=4), budget="1GiB",
                                           output=None, progress=False,
                                           space=SearchSpace(micro_batch_sizes=sizes, stages=(1,), offload=("none",)))

    import torch.distributed as dist

    try:
        assert tune((4,)).best.candidate.micro_batch_size == 4
        with pytest.raises(TuningError, match="cannot change the micro-batch size: a DataLoader passed to fit"):
            tune((4, 8))
    finally:  # the one-rank Trainer made a process group in this (pytest's) process: other tests expect none
        if dist.is_initialized():
            dist.destroy_process_group()
