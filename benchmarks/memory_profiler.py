"""What ZeroMemoryProfiler costs: step time without it, sampling every batch, every 10th batch.

    python benchmarks/memory_profiler.py                     # 2 gloo ranks, ZeRO-2 and ZeRO-3, about 1 minute
    python benchmarks/memory_profiler.py --stages 3 --steps 40 --repeats 3

One group of 2 spawned ranks (``tests/harness.py``'s ``run_on_ranks``, as benchmarks/parallel.py)
fits the demo GPT once per configuration, the configurations in rotating order over
``--repeats``: ``off`` (no profiler), ``every 1`` and ``every 10``
(``ZeroMemoryProfiler(every_n_steps=...)``, no plots, the logger off: sampling, the gather to
rank 0 and the CSV at the end only). Each step is timed by step_time.py's timer from batch start to batch end, the
profiler's end-of-batch work included; a step's time is the slower rank's, a row's figure the
median step; ``x off`` is the ratio to ``off`` in the same run.

What it showed on this machine (2 cores, 2026-12-01, defaults): step ms 86.2 off / 90.6 every 1
(1.05x) / 85.9 every 10 (1.00x) at ZeRO-2; 87.1 / 94.6 (1.09x) / 89.3 (1.03x) at ZeRO-3. A sampled
batch walks every parameter, gradient and optimizer-state tensor twice (device and host), counts
the forward's saved tensors and gathers one small object per rank to rank 0: about 6 ms a
sampled batch here; unsampled batches cost a modulo.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
TESTS_DIR = REPO_ROOT / "tests"
BENCHMARKS_DIR = Path(__file__).resolve().parent
if str(BENCHMARKS_DIR) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS_DIR))

from parallel import _ratio, _schedule, fit_each  # noqa: E402
from step_time import GPT_EXAMPLE_DIR, _cpu_seconds, _warn_if_shared, timed_fit, token_loader  # noqa: E402

WORLD_SIZE = 2
SETTINGS = {"off": None, "every 1": 1, "every 10": 10}


@dataclass(frozen=True)
class RunSpec:
    name: str
    stage: int
    warmup: int
    steps: int


@dataclass(frozen=True)
class RankRun:
    name: str
    stage: int
    step_times_s: list[float]
    sampling_s: float


def _fit_and_measure(spec: RunSpec, rank: int) -> RankRun:
    import lightning.pytorch as pl

    from lightning_zero import ZeroConfig, ZeroMemoryProfiler, ZeroStrategy

    if str(GPT_EXAMPLE_DIR) not in sys.path:
        sys.path.insert(0, str(GPT_EXAMPLE_DIR))
    from model import GPT  # examples/gpt/model.py

    pl.seed_everything(1234, verbose=False)
    every = SETTINGS[spec.name]
    callbacks = [] if every is None else [ZeroMemoryProfiler(every_n_steps=every, log_metrics=False, plots=False,
                                                             output_dir=Path(tempfile.gettempdir()) / "lz_memory_bench")]
    model = GPT(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128, max_steps=spec.warmup + spec.steps)
    loader = token_loader(16 * WORLD_SIZE * (spec.warmup + spec.steps + 1), 65, 64, 16)
    times, _ = timed_fit(model, ZeroStrategy(config=ZeroConfig(stage=spec.stage)), WORLD_SIZE, spec.warmup,
                         spec.steps, loader, spec.name, callbacks=callbacks)
    sampling = callbacks[0].sampling_seconds if callbacks else 0.0
    return RankRun(spec.name, spec.stage, times, sampling)


def _rank_main(specs: Sequence[RunSpec]) -> list[dict[str, Any]]:
    return fit_each(specs, _fit_and_measure)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3], choices=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    sys.path[:0] = [str(TESTS_DIR)]
    from harness import run_on_ranks

    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR), str(BENCHMARKS_DIR),
                                                *filter(None, [os.environ.get("PYTHONPATH")])])
    specs = [RunSpec(name, stage, args.warmup, args.steps)
             for stage in args.stages for name in _schedule(list(SETTINGS), args.repeats)]
    cpu_before, started = _cpu_seconds(), time.monotonic()
    per_rank = [[RankRun(**run) for run in runs] for runs in run_on_ranks(_rank_main, WORLD_SIZE, specs)]
    wall_s = time.monotonic() - started
    medians: dict[tuple[int, str], list[float]] = {}
    sampling: dict[tuple[int, str], list[float]] = {}
    for runs in zip(*per_rank, strict=True):
        key = (runs[0].stage, runs[0].name)
        per_step = [max(times) for times in zip(*(r.step_times_s for r in runs), strict=True)]
        medians.setdefault(key, []).append(statistics.median(per_step))
        sampling.setdefault(key, []).append(max(r.sampling_s for r in runs))
    print(f"\nZeroMemoryProfiler overhead, {WORLD_SIZE} gloo ranks, demo GPT (4 layers, 128 wide), "
          f"{args.steps} steps after {args.warmup}, median of {args.repeats} runs\n")
    print("| stage | profiler | step ms | x off | time in sampled hooks, s per run |")
    print("|------:|----------|--------:|------:|---------------------------------:|")
    for stage in args.stages:
        off = statistics.median(medians[(stage, "off")])
        for name in SETTINGS:
            value = statistics.median(medians[(stage, name)])
            print(f"| {stage} | {name} | {1000 * value:.1f} | {_ratio(value, off)} |"
                  f" {statistics.median(sampling[(stage, name)]):.3f} |")
    print(f"\npython benchmarks/memory_profiler.py {' '.join(argv)}   ({wall_s:.0f} s)")
    _warn_if_shared(cpu_before, _cpu_seconds(), wall_s)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
