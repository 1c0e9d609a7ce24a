"""Every finished run exits 0: ZeRO-3 through Lightning's subprocess launcher, in a loop.

A job scheduler counts an abort at exit (``terminate called without an active exception``, rc
134) as a failed job. LIGHTNING_ZERO_EXIT_RUNS=N runs the loop N times (a soak)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent / "scripts" / "fit_and_exit.py"
RUNS = int(os.environ.get("LIGHTNING_ZERO_EXIT_RUNS", "3"))


def test_a_finished_zero3_run_exits_0_every_time() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK",
                                                           "MASTER_ADDR", "MASTER_PORT")}
    for run in range(RUNS):
        done = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"run {run}: exit code {done.returncode}\n{output[-3000:]}"
        assert "rank 0 finished" in output and "terminate called" not in output
