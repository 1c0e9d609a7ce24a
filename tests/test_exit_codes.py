"""Every finished run exits 0: ZeRO-3 through Lightning's subprocess launcher, and the engine's
collectives on two ranks, each in a loop.

A job scheduler counts an abort at exit (``terminate called without an active exception``, rc
134) as a failed job. LIGHTNING_ZERO_EXIT_RUNS=N runs the loop N times (a soak; 2 by default, to
keep the suite short: each run starts two processes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from harness import free_port, rank_environment

SCRIPT = Path(__file__).parent / "scripts" / "fit_and_exit.py"
RUNS = int(os.environ.get("LIGHTNING_ZERO_EXIT_RUNS", "2"))


def test_a_finished_zero3_run_exits_0_every_time() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK",
                                                           "MASTER_ADDR", "MASTER_PORT")}
    for run in range(RUNS):
        done = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"run {run}: exit code {done.returncode}\n{output[-3000:]}"
        assert "rank 0 finished" in output and "terminate called" not in output


COLLECTIVES_SCRIPT = Path(__file__).parent / "scripts" / "collectives_and_exit.py"


def _two_ranks(script: Path, *args: str, port: int) -> list[subprocess.CompletedProcess[str]]:
    ranks = [subprocess.Popen([sys.executable, str(script), *args], env={**os.environ, **rank_environment(rank, 2, port)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    done = []
    for rank, process in enumerate(ranks):
        output, _ = process.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(process.args, process.returncode, output, ""))
    return done


def test_every_collective_form_on_temporaries_then_an_immediate_exit_exits_0() -> None:
    """The engine's collectives on tensors Python lets go of at once, the process exiting right
    after the last wait (see [Note: tensors outlive the gloo worker]): without the holder, about 1
    run in 10 aborted here."""
    for run in range(RUNS):
        for rank, done in enumerate(_two_ranks(COLLECTIVES_SCRIPT, port=free_port())):
            assert done.returncode == 0, f"run {run}, rank {rank}: exit code {done.returncode}\n{done.stdout[-3000:]}"
            assert "terminate called" not in done.stdout


def test_torch_object_collectives_then_an_immediate_exit_exits_0() -> None:
    """all_gather_object and broadcast_object_list (the strategy's broadcast, Lightning's own calls)
    hand gloo tensors nothing holds; a script ending right after them aborted in 8 of 20 runs before
    the exit grace (see [Note: tensors outlive the gloo worker])."""
    for run in range(RUNS):
        for rank, done in enumerate(_two_ranks(COLLECTIVES_SCRIPT, "--objects", port=free_port())):
            assert done.returncode == 0, f"run {run}, rank {rank}: exit code {done.returncode}\n{done.stdout[-3000:]}"
            assert "terminate called" not in done.stdout
