"""``lightning-zero tune`` on the demo's LightningCLI script (2 CPU ranks started by Lightning's own
launcher): a budget too small exits 2 with a message and no traceback; a search writes the run's
config with the tuned strategy and micro-batch, which the script then trains."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_zero.cli import main

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "gpt" / "train.py"
CONFIG = ROOT / "examples" / "gpt" / "configs" / "zero2_cpu.yaml"


def _env() -> dict[str, str]:
    # A rank's variables left by another test would make Lightning think the ranks already exist.
    return {k: v for k, v in os.environ.items()
            if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")}


def _tune(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "lightning_zero.cli", "tune", *args, str(SCRIPT), "--config", str(CONFIG)]
    return subprocess.run(command, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600)


def test_a_budget_below_every_configuration_is_a_message_and_exit_2(tmp_path: Path) -> None:
    done = _tune(tmp_path, "--budget", "1MiB", "--output", "tuned.yaml")
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-3000:]
    assert "lightning-zero tune: error: the budget of 1.0 MiB per rank is smaller than every configuration" \
        in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "tuned.yaml").exists()


def test_bad_tune_arguments_are_messages_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # A console run, for its exit code and stderr; the other refusals in this process (each console
    # run costs seconds of imports), where an exception that is no message would fail the test.
    done = _tune(tmp_path, "--stages", "1,2", "--offload", "params")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "holds no configuration: parameter offload ('params') needs stage 3" in done.stderr
    monkeypatch.chdir(tmp_path)
    for args, message in (
        (("--budget", "lots"), "--budget='lots' is not a number of bytes"),
        (("--micro-batch-sizes", "8,x"), "'8,x' is not a comma-separated list of integers"),
        (("--micro-batch-sizes", ","), "SearchSpace.micro_batch_sizes is empty"),  # refused, not the defaults
        (("--output", str(CONFIG)), "is not an earlier tuning's output: it is kept"),  # the run's own config
    ):
        try:
            code = main(["tune", *args, str(SCRIPT), "--config", str(CONFIG)])
        except SystemExit as exit:  # argparse's own refusals
            code = exit.code
        error = capsys.readouterr().err
        assert code == 2 and message in error, error[-2000:]
    assert "--overwrite" in error


def test_tune_writes_a_config_the_script_trains(tmp_path: Path) -> None:
    done = _tune(tmp_path, "--budget", "2GiB", "--micro-batch-sizes", "8,16", "--stages", "1,2", "--offload", "none",
                 "--measure-steps", "2", "--output", "tuned.yaml")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "lightning_zero autotuner (fast)" in done.stdout and "wrote tuned.yaml" in done.stdout
    tuned = yaml.safe_load((tmp_path / "tuned.yaml").read_text())
    config = tuned["trainer"]["strategy"]["init_args"]["config"]
    assert tuned["trainer"]["strategy"]["class_path"] == "lightning_zero.ZeroStrategy"
    assert config["stage"] in (1, 2) and tuned["data"]["batch_size"] in (8, 16)
    assert not any("ZeroAutotuner" in str(c) for c in tuned["trainer"]["callbacks"])
    assert tuned["model"]["n_layer"] == 4  # the rest of the run's config is kept
    train = subprocess.run([sys.executable, str(SCRIPT), "fit", "--config", "tuned.yaml", "--trainer.max_steps=2",
                            "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1"],
                           cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=2` reached." in train.stdout + train.stderr


def test_ranks_started_by_spawn_tune_and_end_or_train_on(tmp_path: Path) -> None:
    output = tmp_path / "spawn.yaml"
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "scripts" / "tune_spawn.py"), str(output)],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-3000:]
    assert "apply=False done" in log and "apply=True done" in log and "Traceback" not in log
    tuned = yaml.safe_load(output.read_text())
    stage, size = tuned["trainer"]["strategy"]["init_args"]["config"]["stage"], tuned["model"]["batch_size"]
    # Only the applied run trains (2 steps on each rank, with the tuned stage and micro-batch).
    for rank in (0, 1):
        assert log.count(f"rank {rank} trained") == 1
        assert f"rank {rank} trained 2 steps at stage {stage} with batches of {size}" in log
