"""ZeroAutotuner on 2 gloo ranks: a budget that excludes the large micro-batches at stage 1, the
default search against the exhaustive grid, an OOM on one rank (in forward at stages 2 and 3, in
backward), another error on one rank, a budget too small, the best configuration applied in the
same run, memory released between trials, and the YAML it writes trained by LightningCLI."""

from __future__ import annotations

import gc
import os
import warnings
import weakref
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import yaml
from lightning.pytorch.cli import LightningCLI

from harness import launched_environment, run_on_ranks
from tune_models import Blocks, BlocksData, DataBlocks, HFGPT2, LazyBlocks

from lightning_zero import ZeroConfig, ZeroStrategy
from lightning_zero.autotuning import SearchSpace, TuningError
from lightning_zero.callbacks.autotuner import TrialError, ZeroAutotuner, ZeroTuner
from lightning_zero.profiling import estimate_memory

WORLD = 2


def _trainer(tuner: ZeroAutotuner, steps: int = 1, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=WORLD, strategy=ZeroStrategy(stage=2), max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[tuner], **kwargs)


def _rows(tuner: ZeroAutotuner) -> list[dict[str, Any]]:
    assert tuner.result is not None
    return [{"candidate": r.candidate, "status": r.status.value, "rate": r.samples_per_sec, "peak": r.peak_bytes,
             "estimate": r.estimate_bytes, "message": r.message} for r in tuner.result.records]


def _budget_at_stage_1() -> int:
    """Halfway between stage 1's estimate at micro-batches 8 and 16: 16 does not fit at stage 1."""
    model = DataBlocks()
    batch = lambda size: (torch.randn(size, 16, 256),)  # noqa: E731
    at = {size: estimate_memory(model, WORLD, ZeroConfig(stage=1), sample_batch=batch(size), device_type="cpu")
          for size in (8, 16)}
    return (at[8].device.total + at[16].device.total) // 2


SEARCH = SearchSpace(micro_batch_sizes=(4, 8, 16), stages=(1, 2, 3), offload=("none",),
                     reduce_bucket_sizes=(500_000, 25_000_000), prefetch_units=(1,), min_unit_numels=(300_000, 1_000_000))


def _budget_scenario(tmp: str) -> dict[str, Any]:
    budget = _budget_at_stage_1()
    out: dict[str, Any] = {"budget": budget}
    if dist.get_rank() == 0:  # an earlier tuning's output: replaced without asking
        Path(tmp, "fast.yaml").write_text("# Tuned by lightning_zero's ZeroAutotuner on 2000-01-01: old\nold: 1\n")
    dist.barrier()
    for method in ("fast", "grid"):
        tuner = ZeroAutotuner(budget=budget, space=SEARCH, method=method, measure_steps=8,
                              output=os.path.join(tmp, f"{method}.yaml"))
        torch.manual_seed(0)
        with launched_environment():
            _trainer(tuner).fit(Blocks())
        out[method] = {"rows": _rows(tuner), "best": tuner.result.best.candidate, "trials": tuner.result.trials,
                       "written": str(tuner.written), "content": Path(tmp, f"{method}.yaml").read_text()}
    return out


def _output_scenario(tmp: str) -> dict[str, Any]:
    """An output file the tuning did not write (here the run's own config) is kept: the search
    stops before its first trial, unless overwrite=True."""
    mine = Path(tmp, "mine.yaml")
    if dist.get_rank() == 0:
        mine.write_text("# my run\ntrainer:\n  max_steps: 7\n")
    dist.barrier()
    space = SearchSpace(micro_batch_sizes=(4,), stages=(2,), offload=("none",), reduce_bucket_sizes=(25_000_000,))
    out: dict[str, Any] = {}
    for overwrite in (False, True):
        tuner = ZeroAutotuner(budget="4GiB", space=space, output=mine, overwrite=overwrite, progress=False)
        try:
            with launched_environment():
                _trainer(tuner).fit(Blocks())
            out[overwrite] = {"type": None}
        except TuningError as error:
            out[overwrite] = {"type": "TuningError", "message": str(error)}
        out[overwrite].update(content=mine.read_text(), result=tuner.result is not None)
        dist.barrier()
    return out


def _lazy_scenario(tmp: str) -> dict[str, Any]:
    """Layers built in configure_model: the estimate sizes a copy built on the meta device."""
    tuner = ZeroAutotuner(budget="4GiB", output=None, progress=False, space=SearchSpace(
        micro_batch_sizes=(4,), stages=(2, 3), offload=("none",), reduce_bucket_sizes=(25_000_000,),
        prefetch_units=(1,), min_unit_numels=(1_000_000,)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with launched_environment():
            _trainer(tuner).fit(LazyBlocks())
    return {"estimates": [r.estimate_bytes for r in tuner.result.records],
            "warned": [str(w.message) for w in caught if "no memory estimate" in str(w.message)],
            "eager": [estimate_memory(Blocks(), WORLD, r.candidate.zero_config(ZeroConfig(stage=2)), device_type="cpu")
                      .model_states for r in tuner.result.records]}


def _oom_scenario(tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    space = SearchSpace(micro_batch_sizes=(2, 4, 8, 16), stages=(2, 3), offload=("none",), reduce_bucket_sizes=(25_000_000,),
                        prefetch_units=(1,), min_unit_numels=(300_000,))
    for where in ("forward", "backward"):
        tuner = ZeroAutotuner(budget="4GiB", space=space, output=None, progress=where == "forward")
        with launched_environment():
            _trainer(tuner).fit(Blocks(fault="oom", fault_at=8, fault_where=where))
        out[where] = {"rows": _rows(tuner), "best": tuner.result.best.candidate}
    return out


def _error_scenario(tmp: str) -> dict[str, Any]:
    tuner = ZeroAutotuner(budget="4GiB", space=SearchSpace(micro_batch_sizes=(4, 8), stages=(2,), offload=("none",)),
                          output=os.path.join(tmp, "error.yaml"))
    module = Blocks(fault="value", fault_at=8)
    trainer = _trainer(tuner)
    try:
        with launched_environment():
            trainer.fit(module)
    except Exception as error:  # noqa: BLE001 - the test compares what each rank raised
        return {"type": type(error).__name__, "message": str(error), "written": os.path.exists(tuner.output),
                "batch_size": module.batch_size, "stage": trainer.strategy.config.stage}
    return {"type": None}


def _small_budget_scenario(tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, budget, fault in (("tiny", "1MiB", None), ("all_oom", "4GiB", "oom"), ("unwritable", "4GiB", None)):
        path = os.path.join(tmp, f"{name}.yaml") if name != "unwritable" else "/proc/no-such-dir/tuned.yaml"
        tuner = ZeroAutotuner(budget=budget, space=SearchSpace(micro_batch_sizes=(8, 16), stages=(1, 3),
                                                               offload=("none",)), output=path)
        module = Blocks(fault=fault, fault_at=1, batch_size=4)
        trainer = _trainer(tuner)
        try:
            with launched_environment():
                trainer.fit(module)
            out[name] = {"type": None}
        except TuningError as error:
            out[name] = {"type": "TuningError", "message": str(error), "written": os.path.exists(path),
                         "batch_size": module.batch_size, "config": trainer.strategy.config}
    return out


def _apply_scenario(tmp: str) -> dict[str, Any]:
    tuner = ZeroAutotuner(budget="4GiB", apply=True, output=None, space=SearchSpace(
        micro_batch_sizes=(4, 8), stages=(2, 3), offload=("none",), reduce_bucket_sizes=(25_000_000,),
        prefetch_units=(1,), min_unit_numels=(1_000_000,)))
    module, data = DataBlocks(), BlocksData(batch_size=2)
    trainer = _trainer(tuner, steps=3)
    with launched_environment():
        trainer.fit(module, datamodule=data)
    return {"best": tuner.result.best.candidate, "config": trainer.strategy.config, "steps": trainer.global_step,
            "data_batch_size": data.batch_size, "seen": module.seen_batch_sizes}


class _Tracked(Blocks):
    """Every trial's module copy, weakly."""

    copies: list[weakref.ref] = []

    def configure_optimizers(self) -> Any:
        type(self).copies.append(weakref.ref(self))
        return super().configure_optimizers()


def _released_scenario(tmp: str) -> dict[str, Any]:
    _Tracked.copies.clear()
    tuner = ZeroAutotuner(budget="4GiB", output=None, progress=False, space=SearchSpace(
        micro_batch_sizes=(4, 8, 16), stages=(2, 3), offload=("none",), prefetch_units=(1,), min_unit_numels=(300_000,)))
    with launched_environment():
        _trainer(tuner).fit(_Tracked(fault="oom", fault_at=16))
    gc.collect()
    return {"trials": tuner.result.trials, "copies": len(_Tracked.copies),
            "alive": sum(ref() is not None for ref in _Tracked.copies)}


def _cli_scenario(tmp: str) -> dict[str, Any]:
    base = Path(tmp) / "base.yaml"
    best = Path(tmp) / "cli_best.yaml"
    if dist.get_rank() == 0:
        base.write_text(yaml.safe_dump({
            "trainer": {"accelerator": "cpu", "devices": WORLD, "strategy": "zero2", "max_steps": 2, "logger": False,
                        "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False,
                        "default_root_dir": tmp},
            "data": {"batch_size": 2},
        }))
    dist.barrier()
    args = ["fit", "--config", str(base), "--trainer.callbacks+=lightning_zero.ZeroAutotuner",
            "--trainer.callbacks.budget=4GiB", f"--trainer.callbacks.output={best}",
            "--trainer.callbacks.space.micro_batch_sizes=[2,4]", "--trainer.callbacks.space.stages=[1,3]",
            "--trainer.callbacks.space.offload=[none]"]
    with launched_environment():
        tuning = LightningCLI(DataBlocks, BlocksData, args=args, save_config_kwargs={"overwrite": True})
    tuner = next(c for c in tuning.trainer.callbacks if isinstance(c, ZeroAutotuner))
    dist.barrier()
    with launched_environment():
        trained = LightningCLI(DataBlocks, BlocksData, args=["fit", "--config", str(best)],
                               save_config_kwargs={"overwrite": True})
    return {"best": tuner.result.best.candidate, "written": best.read_text(), "config": trained.trainer.strategy.config,
            "steps": trained.trainer.global_step, "batch_size": trained.datamodule.batch_size,
            "seen": trained.model.seen_batch_sizes, "tuning_steps": tuning.trainer.global_step}


def _hugging_face_scenario(tmp: str) -> dict[str, Any]:
    """ZeroTuner (the Tuner-like entry point) over a Hugging Face model, stages 2 and 3."""
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy="zero2", max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with launched_environment():
        result = ZeroTuner(trainer).tune(HFGPT2(), budget="4GiB", output=os.path.join(tmp, "hf.yaml"), progress=False,
                                         space=SearchSpace(micro_batch_sizes=(2, 4), stages=(2, 3), offload=("none",)))
    assert result is not None
    return {"rows": [(r.candidate, r.status.value) for r in result.records], "best": result.best.candidate,
            "rates": {r.candidate: r.samples_per_sec for r in result.records if r.fits},
            "callbacks": [type(c).__name__ for c in trainer.callbacks], "steps": trainer.global_step}


def _scenarios(tmp: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {name: scenario(tmp) for name, scenario in (
        ("budget", _budget_scenario), ("oom", _oom_scenario), ("error", _error_scenario),
        ("small", _small_budget_scenario), ("apply", _apply_scenario), ("released", _released_scenario),
        ("cli", _cli_scenario), ("hf", _hugging_face_scenario), ("output", _output_scenario), ("lazy", _lazy_scenario),
    )}


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_on_ranks(_scenarios, WORLD, str(tmp_path_factory.mktemp("autotuner")))


def test_every_rank_records_the_same_trials(tuned: list[dict[str, Any]]) -> None:
    for name in ("fast", "grid"):
        assert tuned[0]["budget"][name]["rows"] == tuned[1]["budget"][name]["rows"]
    for where in ("forward", "backward"):
        assert tuned[0]["oom"][where]["rows"] == tuned[1]["oom"][where]["rows"]


def test_budget_excludes_large_micro_batches_at_stage_1_and_both_searches_pick_what_fits(
        tuned: list[dict[str, Any]]) -> None:
    result = tuned[0]["budget"]
    fast, grid = result["fast"], result["grid"]
    budget = result["budget"]
    by_candidate = {row["candidate"]: row for row in grid["rows"]}
    # Stage 1 at micro-batch 16 does not fit the budget (in the grid it ran and exceeded it).
    stage1_16 = [row for row in grid["rows"] if row["candidate"].stage == 1 and row["candidate"].micro_batch_size == 16]
    assert stage1_16 and all(row["status"] == "over budget" and row["peak"] > budget for row in stage1_16)
    # Everything the grid says fits is within the budget, and the tuner's pick fits.
    assert all(row["peak"] <= budget for row in grid["rows"] if row["status"] == "fits")
    pick = fast["best"]
    assert by_candidate[pick]["status"] == "fits"
    assert not (pick.stage == 1 and pick.micro_batch_size == 16)
    # The grid's pick is the fastest configuration it measured that fits. How close the fast
    # search's pick comes to it in throughput is a timing question (one trial varies by about
    # +-15% on 2 shared cores, and a paired remeasurement here still missed 10% in CI):
    # benchmarks/autotuner.py measures it, tests/test_autotuner_search.py checks it on a model.
    fits = [row for row in grid["rows"] if row["status"] == "fits"]
    grid_best = max(fits, key=lambda row: row["rate"])["candidate"]
    assert grid["best"] == grid_best
    assert by_candidate[pick]["rate"] > 0
    assert fast["trials"] < grid["trials"] == len(grid["rows"]) == 3 * 2 * 3
    print(f"\nautotuner: {fast['trials']} trials (fast) vs {grid['trials']} (grid); pick {pick.label},"
          f" grid best {grid_best.label}")


def test_oom_on_one_rank_is_recorded_on_both_and_the_search_goes_on(tuned: list[dict[str, Any]]) -> None:
    for where in ("forward", "backward"):
        rows = tuned[0]["oom"][where]["rows"]
        ooms = [row for row in rows if row["status"] == "OOM"]
        assert ooms and all(row["candidate"].micro_batch_size >= 8 for row in ooms)
        assert all(row["message"].startswith("rank 1: CUDA out of memory") for row in ooms)
        # Both stages were searched (stage 3 gathers in forward: the other rank stopped before its next gather).
        assert {row["candidate"].stage for row in rows if row["status"] == "OOM"} == {2, 3} or where == "backward"
        assert tuned[0]["oom"][where]["best"].micro_batch_size == 4
        assert any(row["status"] == "fits" and row["candidate"].micro_batch_size == 4 for row in rows)


def test_another_error_on_one_rank_stops_the_search_on_every_rank(tuned: list[dict[str, Any]]) -> None:
    failing, other = tuned[1]["error"], tuned[0]["error"]
    assert failing["type"] == "ValueError" and "injected failure at micro-batch 8" in failing["message"]
    assert other["type"] == TrialError.__name__
    assert "rank 1" in other["message"] and "ValueError: injected failure" in other["message"]
    for rank in tuned:
        assert not rank["error"]["written"]
        assert rank["error"]["batch_size"] == 4 and rank["error"]["stage"] == 2  # nothing applied


def test_a_budget_below_every_configuration_a_model_that_never_fits_and_an_unwritable_output(tuned: list[dict[str, Any]]) -> None:
    for rank in tuned:
        tiny, all_oom = rank["small"]["tiny"], rank["small"]["all_oom"]
        assert tiny["type"] == "TuningError" and "smaller than every configuration's estimated memory" in tiny["message"]
        assert "1.0 MiB" in tiny["message"]
        assert all_oom["type"] == "TuningError" and "no configuration fits" in all_oom["message"]
        assert "OOM" in all_oom["message"]
        unwritable = rank["small"]["unwritable"]  # refused before the first trial, on every rank
        assert unwritable["type"] == "TuningError" and "'/proc/no-such-dir/tuned.yaml' cannot be written" \
            in unwritable["message"]
        for case in (tiny, all_oom, unwritable):
            assert not case["written"] and case["batch_size"] == 4 and case["config"] == ZeroConfig(stage=2)


def test_the_best_configuration_is_applied_and_training_goes_on(tuned: list[dict[str, Any]]) -> None:
    for rank in tuned:
        applied = rank["apply"]
        best = applied["best"]
        assert applied["config"] == best.zero_config(ZeroConfig(stage=2))
        assert applied["data_batch_size"] == best.micro_batch_size
        assert applied["steps"] == 3 and applied["seen"] == [best.micro_batch_size] * 3


def test_trials_release_their_module_copies(tuned: list[dict[str, Any]]) -> None:
    for rank in tuned:
        released = rank["released"]
        assert released["copies"] == released["trials"] >= 3
        assert released["alive"] == 0


def test_the_written_yaml_trains_when_passed_back_to_lightning_cli(tuned: list[dict[str, Any]]) -> None:
    cli = tuned[0]["cli"]
    best = cli["best"]
    written = yaml.safe_load(cli["written"])
    assert written["trainer"]["strategy"]["class_path"] == "lightning_zero.ZeroStrategy"
    assert written["trainer"]["strategy"]["init_args"]["config"]["stage"] == best.stage
    assert written["data"]["batch_size"] == best.micro_batch_size
    assert "ZeroAutotuner" not in cli["written"].split("\n", 1)[1]  # the header names it; the config does not
    assert cli["tuning_steps"] == 0  # the tuning run stopped after the search
    for rank in tuned:
        assert rank["cli"]["config"] == best.zero_config(ZeroConfig(stage=2))
        assert rank["cli"]["steps"] == 2 and rank["cli"]["batch_size"] == best.micro_batch_size
        assert rank["cli"]["seen"] == [best.micro_batch_size] * 2


def test_zero_tuner_tunes_a_hugging_face_model(tuned: list[dict[str, Any]]) -> None:
    hf = tuned[0]["hf"]
    assert hf["rows"] == tuned[1]["hf"]["rows"]
    assert all(status == "fits" for _, status in hf["rows"])
    # Micro-batch 4 fits the budget and is tried first; whether 2 runs faster on 2 shared cores is
    # a timing question (it did once in CI): the pick is the fastest configuration measured.
    assert 4 in {candidate.micro_batch_size for candidate, _ in hf["rows"]}
    assert hf["best"] == max(hf["rates"], key=lambda candidate: hf["rates"][candidate])
    assert "ZeroAutotuner" not in hf["callbacks"] and hf["steps"] == 0  # the tuner's callback is gone again


def test_an_output_the_tuning_did_not_write_is_kept_unless_overwrite(tuned: list[dict[str, Any]]) -> None:
    for rank in tuned:
        kept, replaced = rank["output"][False], rank["output"][True]
        assert kept["type"] == "TuningError" and "is not an earlier tuning's output: it is kept" in kept["message"]
        assert "overwrite=True" in kept["message"] and not kept["result"]  # stopped before any trial
        assert kept["content"] == "# my run\ntrainer:\n  max_steps: 7\n"
        assert replaced["type"] is None and replaced["result"]
        assert replaced["content"].startswith("# Tuned by lightning_zero's ZeroAutotuner")
        # an earlier tuning's output is replaced without overwrite
        assert "old: 1" not in rank["budget"]["fast"]["content"]
        assert rank["budget"]["fast"]["content"].startswith("# Tuned by lightning_zero's ZeroAutotuner")


def test_a_model_built_in_configure_model_is_estimated(tuned: list[dict[str, Any]]) -> None:
    for rank in tuned:
        lazy = rank["lazy"]
        assert lazy["warned"] == []
        assert lazy["estimates"] and all(estimate is not None for estimate in lazy["estimates"])
        # the meta-built copy weighs what the eagerly built model does (plus activations)
        assert all(estimate >= eager > 0 for estimate, eager in zip(lazy["estimates"], lazy["eager"]))
