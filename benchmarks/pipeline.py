"""Step time, memory per rank and bubble of pipeline schedules under ZeRO-1, against plain data parallelism.

    python benchmarks/pipeline.py                          # defaults: pp2 and pp4, about 1.5-2 min on 2 cores
    python benchmarks/pipeline.py --world-sizes 2 --schedules 1f1b zbv_zero_bubble --microbatches 4 8 16
    python benchmarks/pipeline.py --n-layer 14 --n-embd 256 --global-batch 64 --steps 10 --json /tmp/pipeline.json

For every world size W (``--world-sizes``, default 2 and 4) one group of W gloo ranks on the CPU
runs, one ``Trainer.fit`` after another, with ``ZeroStrategy(config=ZeroConfig(stage=1, ...))``
on the same global batch (``--global-batch``) of random tokens:

- the baseline, ``dp{W}``: ``PipelineConfig()`` (no pipeline), plain ZeRO-1 over the W ranks,
  ``--global-batch / W`` samples per rank, every rank running the whole model.
- for every schedule (``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``zbv_zero_bubble``; the last two
  with ``stages_per_rank=2``) and micro-batch count m (``--microbatches``, default 4 and 8):
  ``PipelineConfig(size=W, schedule=..., microbatches=m)``, W pipeline ranks with one data-
  parallel rank per stage (``--data-parallel D`` puts D ranks in each stage, pp = W / D), the
  model's layers split by parameter count. Each pipeline reads the whole global batch (/ D) and
  splits it into m micro-batches, so every rank does the same share of the batch's arithmetic as
  at dp{W}: what differs is who waits (the bubble), what travels (activations between neighbours
  instead of ZeRO's gradient reduce-scatter and parameter all-gather over the whole model) and
  what each rank holds.

The model is the demo GPT (examples/gpt/model.py: its ``pipeline_layers()`` list the token +
position embedding as one layer, ``--n-layer`` pre-LN blocks, final norm + head as one layer),
with ``tie_embeddings=False`` (a pipeline cannot tie weights across stages). AdamW with the demo's
schedule, fp32.

What the table shows, per row:

- step ms: each optimizer step timed on every rank with ``time.perf_counter`` from
  ``on_train_batch_start`` to ``on_train_batch_end`` (``step_time.timed_fit``: the schedule's
  forwards and backwards, the gradient reduction, the optimizer step); a step's time is its
  slowest rank's, and the figure is the median over the ``--steps`` steps after ``--warmup``
  (with ``--repeats R``, the median of the R runs' figures). ``x dp`` is the ratio to the
  baseline of the same world size, from the same run.
- peak RSS: the largest rank's ``VmHWM`` from ``/proc/self/status`` over the fit, after writing
  ``5`` to ``/proc/self/clear_refs`` (which resets it) before the fit and returning freed heap
  with ``malloc_trim``: all fits of a world size share their rank processes, whose
  ``ru_maxrss`` would only ever grow. It includes the interpreter, torch and lightning (a few
  hundred MiB every row pays alike) and the activations the schedule keeps alive, which model
  state does not count.
- state: :func:`lightning_zero.model_state_bytes` (params + grads + optimizer states, ZeRO's
  fp32 master shard included) at ``on_train_end``, the largest rank's own total.
- idle: ``PipelineRunner.timing.idle_fraction`` after every measured step (the share of the
  schedule's wall time in which the rank ran no forward or backward action, so it also counts
  the time activations take to arrive), each rank's median over the steps; the mean over the
  ranks, with the smallest and largest rank in brackets.
- 1F1B theory: ``(p - 1) / (m + p - 1)``, the bubble of 1F1B (and GPipe) with p stages and m
  micro-batches, as the yardstick for every row. The interleaved schedules' bubble is smaller in
  theory (``(p - 1) / (v m + p - 1)`` with v stages per rank), ZB-V's near zero when forward,
  input-backward and weight-backward take equally long.

What it showed on CPU with gloo (defaults, 2026-12-01, 2 cores, the demo GPT at 1.61 M parameters):

- Model state per rank: pp2 0.75x of dp2, pp4 0.51x of dp4, not 0.5x and 0.25x: ZeRO-1 at dp2 /
  dp4 already shards the optimizer state, and a stage with one data-parallel rank still keeps
  ZeRO's fp32 master shard and fp32 gradient shard, each as large as the stage's parameters.
  ZB-V's first rank holds the embedding and the head (its V), +0.2 MiB.
- Peak RSS is 0.90x-0.98x of dp: the interpreter, torch and lightning are most of it.
- Idle fractions at pp2: 1F1B 0.17 at m=4 (theory 0.20) and 0.14 at m=8 (0.11), interleaved
  0.15 / 0.14, ZB-V 0.08 / 0.08, GPipe 0.24 / 0.21: zero bubble roughly halves 1F1B's. At pp4 (4
  ranks on 2 cores) 0.30-0.45, the cores' scheduling more than the schedule's.
- Step times: pp2 1.14x-1.36x of dp2 (this model is too small for the pipeline's compute to
  outweigh its per-action overhead on a CPU), pp4 0.92x-1.33x of dp4; another run of the same
  command moved single rows by up to +-30%.

Ranks are started as in ``benchmarks/parallel.py``: ``tests/harness.py``'s ``run_on_ranks``
(spawned processes that see torchrun's variables, one thread each). With 4 ranks on 2 cores, a
rank that waits for its turn on a core counts as busy and a rank blocked on a receive as idle:
pp4's idle fractions on such a machine say more about the scheduler than about the schedule.
Like the other benchmarks, the run warns when other processes used the CPU meanwhile. This is
a measurement, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
TESTS_DIR = REPO_ROOT / "tests"
BENCHMARKS_DIR = Path(__file__).resolve().parent
if str(BENCHMARKS_DIR) not in sys.path:  # already there when run as a script; not when imported
    sys.path.insert(0, str(BENCHMARKS_DIR))

# Neither imports torch at the top: the parent stays light until it starts the ranks.
from parallel import _mib, _positive_int, _ratio, _schedule, fit_each  # noqa: E402
from step_time import GPT_EXAMPLE_DIR, _cpu_seconds, _one_line, _warn_if_shared, timed_fit, token_loader  # noqa: E402

MiB = 2**20

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv_zero_bubble")
# Schedules that run several stages on each rank; ZB-V needs exactly 2 (its V), interleaved any >= 2.
MULTI_STAGE = ("interleaved_1f1b", "zbv_zero_bubble")
STAGES_PER_RANK = 2
BASELINE = "dp"


# ---------------------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class RunSpec:
    """What every rank needs to run one fit (picklable: it crosses the spawn)."""

    schedule: str
    """A pipeline schedule, or ``BASELINE``: plain ZeRO-1 over every rank."""
    world_size: int
    pipeline: int
    """Pipeline ranks (1 for the baseline)."""
    microbatches: int
    """Micro-batches per batch (0 for the baseline)."""
    warmup: int
    steps: int
    global_batch: int
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    vocab_size: int

    @property
    def label(self) -> str:
        return BASELINE if self.schedule == BASELINE else f"{self.schedule}:m{self.microbatches}"

    @property
    def stages_per_rank(self) -> int:
        return STAGES_PER_RANK if self.schedule in MULTI_STAGE else 1

    @property
    def data_size(self) -> int:
        """Data-parallel ranks: those that read distinct samples."""
        return self.world_size // self.pipeline

    @property
    def per_rank_batch(self) -> int:
        return self.global_batch // self.data_size


@dataclass(frozen=True)
class RankRun:
    """One rank's measurements of one fit (or the PipelineError that refused it)."""

    label: str
    rank: int
    step_times_s: list[float] = field(default_factory=list)
    idle_fractions: list[float] = field(default_factory=list)
    """The measured steps' idle fractions (empty without a pipeline)."""
    peak_rss_bytes: int = 0
    params: int = 0
    grads: int = 0
    optimizer_states: int = 0
    num_params: int = 0
    stages: list[int] = field(default_factory=list)
    """The pipeline stages this rank ran."""
    error: str | None = None


@dataclass
class Row:
    """One table row: one fit's rank runs reduced to the worst rank, and the median of the repeats."""

    spec: RunSpec
    run_medians_s: list[float] = field(default_factory=list)
    peak_rss_bytes: int = 0
    state_total: int = 0
    idle_per_rank: list[float] = field(default_factory=list)
    error: str | None = None
    refused: bool = False
    """Not run: the parent saw that PipelineConfig (or the batch, or the split) refuses it."""

    @property
    def median_step_s(self) -> float | None:
        return statistics.median(self.run_medians_s) if self.run_medians_s else None


# ---------------------------------------------------------------------------------------- rank side
def _rank_main(specs: Sequence[RunSpec]) -> list[dict[str, Any]]:
    """Runs on every rank (inside ``run_on_ranks``, process group already up): one fit per spec."""
    return fit_each(specs, _fit_and_measure)


def _fit_and_measure(spec: RunSpec, rank: int) -> RankRun:
    import lightning.pytorch as pl

    from lightning_zero import PipelineConfig, ZeroConfig, ZeroStrategy
    from lightning_zero.parallel.pipeline import PipelineError

    pl.seed_everything(1234, workers=True, verbose=False)
    model = _model_class()(spec.vocab_size, spec.block_size, spec.n_layer, spec.n_head, spec.n_embd, spec.warmup)
    num_params = sum(p.numel() for p in model.parameters())  # before the split drops the other stages' layers
    pipeline = PipelineConfig() if spec.schedule == BASELINE else PipelineConfig(
        size=spec.pipeline, schedule=spec.schedule, microbatches=spec.microbatches,
        stages_per_rank=spec.stages_per_rank)
    strategy = ZeroStrategy(config=ZeroConfig(stage=1, pipeline=pipeline))
    _reset_peak_rss()
    try:
        step_times_s, (params, grads, optimizer_states) = timed_fit(
            model, strategy, spec.world_size, spec.warmup, spec.steps, _build_loader(spec), spec.label)
    except PipelineError as error:
        # Raised on every rank alike before any stage runs (e.g. torch refusing a schedule for
        # these sizes), so no rank is left waiting: the row says why and the next fit runs.
        return RankRun(label=spec.label, rank=rank, num_params=num_params, error=_one_line(error))
    runner = strategy.pipeline
    return RankRun(
        label=spec.label,
        rank=rank,
        step_times_s=step_times_s,
        idle_fractions=model.idle_fractions,
        peak_rss_bytes=_peak_rss(),
        params=params,
        grads=grads,
        optimizer_states=optimizer_states,
        num_params=num_params,
        stages=list(runner.indices) if runner is not None else [],
    )


def _reset_peak_rss() -> None:
    """Starts a new high-water mark of this process's RSS (Linux; elsewhere the next fit's peak
    also covers the earlier fits)."""
    import ctypes
    import gc

    gc.collect()
    try:
        # The previous fit's freed heap back to the OS, so that this fit starts from what is live.
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc
    try:
        Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak RSS (VmHWM) to the current RSS
    except OSError:
        pass


def _peak_rss() -> int:
    """VmHWM since the last ``_reset_peak_rss``, in bytes; ru_maxrss where /proc is missing."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _build_loader(spec: RunSpec) -> Any:
    # Enough windows that no data-parallel rank runs out before max_steps; Lightning adds the
    # DistributedSampler over the data-parallel ranks (the ranks of one pipeline share theirs).
    samples = spec.global_batch * (spec.warmup + spec.steps + 1)
    return token_loader(samples, spec.vocab_size, spec.block_size, spec.per_rank_batch)


def _model_class() -> type:
    """The demo GPT (examples/gpt/model.py: its ``pipeline_layers()`` list the token + position
    embedding, the blocks and the head), untied, and recording the pipeline's idle fraction."""
    if str(GPT_EXAMPLE_DIR) not in sys.path:
        sys.path.insert(0, str(GPT_EXAMPLE_DIR))
    from model import GPT  # examples/gpt/model.py

    class PipeGPT(GPT):
        def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int,
                     warmup: int) -> None:
            # A pipeline cannot tie the head to the embedding on the first stage. max_steps: the
            # LR schedule's length, the same for every fit.
            super().__init__(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head,
                             n_embd=n_embd, tie_embeddings=False, max_steps=1000)
            self.warmup = warmup
            self.idle_fractions: list[float] = []
            self._steps_seen = 0

        # The module's own hooks, not a callback: step_time.timed_fit takes no extra callbacks.
        def on_train_start(self) -> None:
            runner = self.trainer.strategy.pipeline
            if runner is not None:
                runner.record_actions()

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            runner = self.trainer.strategy.pipeline
            self._steps_seen += 1
            # The same steps as timed_fit's: the first ones pay for shape inference and lazy allocation.
            if runner is not None and self._steps_seen > self.warmup:
                self.idle_fractions.append(runner.timing.idle_fraction)

    return PipeGPT


# ---------------------------------------------------------------------------------------- parent side
def _specs(args: argparse.Namespace, world_size: int) -> list[RunSpec]:
    """One world size's fits, each once (the baseline first), before the repeats' rotation."""
    common = dict(world_size=world_size, warmup=args.warmup, steps=args.steps, global_batch=args.global_batch,
                  n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size,
                  vocab_size=args.vocab_size)
    specs = [RunSpec(BASELINE, pipeline=1, microbatches=0, **common)]
    for schedule in SCHEDULES:
        if schedule not in args.schedules:
            continue
        for m in args.microbatches:
            specs.append(RunSpec(schedule, pipeline=world_size // args.data_parallel, microbatches=m, **common))
    return specs


def _refusal(spec: RunSpec) -> str | None:
    """Why PipelineConfig (in the parent, before any rank starts) or the split refuses ``spec``."""
    from lightning_zero import PipelineConfig

    if spec.schedule == BASELINE:
        return None
    try:
        config = PipelineConfig(size=spec.pipeline, schedule=spec.schedule, microbatches=spec.microbatches,
                                stages_per_rank=spec.stages_per_rank)
    except ValueError as error:
        return _one_line(error)
    if config.num_stages > spec.n_layer + 2:  # embedding + blocks + head
        return f"{config.num_stages} stages but {spec.n_layer + 2} layers: raise --n-layer"
    if (spec.global_batch // spec.data_size) % spec.microbatches:
        return f"m={spec.microbatches} does not divide the batch of {spec.global_batch // spec.data_size} per pipeline"
    return None


def _reduce(specs: Sequence[RunSpec], per_rank: Sequence[Sequence[RankRun]]) -> dict[str, Row]:
    rows = {spec.label: Row(spec=spec) for spec in specs}
    # per_rank[r][i] is rank r's i-th fit; the ranks ran the same fits in the same order.
    for runs in zip(*per_rank, strict=True):
        row = rows[runs[0].label]
        errors = [r.error for r in runs if r.error]
        if errors:
            row.error = errors[0]
            continue
        # A step ends when its slowest rank ends: the others wait for it in the next collective.
        per_step = [max(times) for times in zip(*(r.step_times_s for r in runs), strict=True)]
        row.run_medians_s.append(statistics.median(per_step))
        # Memory and idle time of the last repeat are kept (model state does not change between them).
        row.peak_rss_bytes = max(r.peak_rss_bytes for r in runs)
        row.state_total = max(r.params + r.grads + r.optimizer_states for r in runs)
        row.idle_per_rank = [statistics.median(r.idle_fractions) for r in runs if r.idle_fractions]
    return rows


def _markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub markdown table, columns padded so that it also reads as plain text."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]

    def line(cells: Sequence[str]) -> str:
        # Text left, numbers right, as a reader scans them.
        padded = [cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(cells, widths))]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(["-" * (widths[0] + 2)] + ["-" * (w + 1) + ":" for w in widths[1:]]) + "|"
    return "\n".join([line(header), rule, *(line(row) for row in rows)])


def _table_rows(rows: Sequence[Row], repeats: int) -> tuple[list[list[str]], list[str]]:
    """The table's cells, and the notes that say why the rows marked [n] have no numbers."""
    out = []
    notes: list[str] = []
    baselines = {row.spec.world_size: row for row in rows if row.spec.schedule == BASELINE and row.error is None}
    for row in rows:
        spec = row.spec
        is_baseline = spec.schedule == BASELINE
        name = f"dp{spec.world_size} (no pipeline)" if is_baseline else spec.schedule
        if spec.stages_per_rank > 1:
            name += f" (v={spec.stages_per_rank})"
        pp = str(spec.pipeline) + ("" if spec.data_size == 1 or is_baseline else f" x dp{spec.data_size}")
        m = "—" if is_baseline else str(spec.microbatches)
        if row.error is not None or row.median_step_s is None:
            # The reason goes under the table: in a cell it would stretch the whole column.
            notes.append(f"[{len(notes) + 1}] {name}, pp {pp}, m {m}: {row.error}")
            verb = "not run" if row.refused else "failed"
            out.append([name, pp, m, f"{verb} [{len(notes)}]", *["—"] * (7 + (repeats > 1))])
            continue
        base = baselines.get(spec.world_size)
        p = spec.pipeline
        idle = "—"
        if row.idle_per_rank:
            idle = (f"{statistics.mean(row.idle_per_rank):.2f}"
                    f" ({min(row.idle_per_rank):.2f}–{max(row.idle_per_rank):.2f})")
        cells = [
            name,
            pp,
            m,
            f"{row.median_step_s * 1e3:.0f}",
            _ratio(row.median_step_s, base.median_step_s if base else None),
            f"{row.peak_rss_bytes / MiB:.0f}",
            _ratio(row.peak_rss_bytes, base.peak_rss_bytes if base else None),
            _mib(row.state_total),
            _ratio(row.state_total, base.state_total if base else None),
            idle,
            "—" if is_baseline else f"{(p - 1) / (spec.microbatches + p - 1):.2f}",
        ]
        if repeats > 1:
            # Every run's median step, in the order they ran: the spread the median hides.
            cells.append(" ".join(f"{t * 1e3:.0f}" for t in row.run_medians_s))
        out.append(cells)
    return out, notes


def print_table(rows: Sequence[Row], args: argparse.Namespace, num_params: int, command: str, wall_s: float) -> None:
    header = ["schedule", "pp", "m", "step ms", "x dp", "peak RSS MiB", "x dp", "state MiB", "x dp",
              "idle (min–max rank)", "1F1B theory"] + (["runs ms"] if args.repeats > 1 else [])
    print()
    print(f"ZeRO-1 on gloo CPU ranks: median step of {args.steps} after {args.warmup} warm-up, median of"
          f" {args.repeats} run(s); ratios to dp on the same number of ranks, in this run")
    print()
    cells, notes = _table_rows(rows, args.repeats)
    print(_markdown(header, cells))
    print()
    if notes:
        print("\n".join(notes))
        print()
    print(f"GPT n_layer={args.n_layer} n_head={args.n_head} n_embd={args.n_embd} block_size={args.block_size}"
          f" vocab={args.vocab_size}, untied head: {num_params / 1e6:.2f} M parameters; AdamW, fp32; global batch"
          f" {args.global_batch}.")
    print("step: the slowest rank's; peak RSS and state (params + grads + optimizer states): the largest rank's;"
          " idle: the mean over ranks of each rank's median idle fraction; 1F1B theory: (p-1)/(m+p-1).")
    print(f"{command}   ({wall_s:.0f} s)")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-sizes", nargs="+", type=_positive_int, default=[2, 4],
                        help="ranks of each group; each runs dp over all of them and every pipeline on them")
    parser.add_argument("--data-parallel", type=_positive_int, default=1,
                        help="ranks per pipeline stage: pp = world size / this (1: a pure pipeline)")
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    parser.add_argument("--microbatches", nargs="+", type=_positive_int, default=[4, 8],
                        help="micro-batch counts m (each must divide the global batch / data-parallel size)")
    parser.add_argument("--steps", type=_positive_int, default=6, help="measured optimizer steps per fit")
    parser.add_argument("--warmup", type=int, default=2, help="steps run first in each fit and not measured")
    parser.add_argument("--repeats", type=_positive_int, default=1, help="runs of each fit, in rotating order")
    parser.add_argument("--global-batch", type=_positive_int, default=32,
                        help="samples per optimizer step over all ranks")
    # 8 blocks: every default split (pp2, pp4, 1 or 2 stages per rank, looped or V) then gives
    # each rank as many blocks; with 6, ZB-V on pp2 puts 4 of them on rank 1 and 2 on rank 0.
    parser.add_argument("--n-layer", type=_positive_int, default=8,
                        help="transformer blocks (the pipeline layers are these + embedding + head)")
    parser.add_argument("--n-head", type=_positive_int, default=4)
    parser.add_argument("--n-embd", "--width", dest="n_embd", type=_positive_int, default=128)
    parser.add_argument("--block-size", type=_positive_int, default=64)
    parser.add_argument("--vocab-size", type=_positive_int, default=65)
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds to wait for a world size's ranks to return all their fits")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here as JSON")
    args = parser.parse_args(argv)
    if args.n_embd % args.n_head:
        parser.error(f"--n-embd {args.n_embd} must be a multiple of --n-head {args.n_head}")
    if args.warmup < 0:
        parser.error(f"--warmup {args.warmup} must be 0 or more")
    for world_size in args.world_sizes:
        if world_size % args.data_parallel or world_size // args.data_parallel < 2:
            parser.error(f"--world-sizes {world_size}: needs a pipeline of 2 or more stages of"
                         f" --data-parallel {args.data_parallel} rank(s) each")
        if args.global_batch % world_size:
            parser.error(f"--global-batch {args.global_batch} must be a multiple of {world_size}: dp{world_size}"
                         " splits it that many ways")
    return args


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    # The launcher is the tests' harness, as in parallel.py.
    sys.path.insert(0, str(TESTS_DIR))
    import harness

    # A world size's ranks return once, after all their fits: harness's per-result wait must cover them all.
    harness.RANK_TIMEOUT_S = args.timeout
    # Inherited by the spawned ranks: also caps the OpenMP pools torch.set_num_threads does not reach.
    os.environ["OMP_NUM_THREADS"] = "1"
    # Spawned ranks import this file as __mp_main__ and need tests/ (harness) and benchmarks/
    # (step_time's fit and loader) on their path too.
    os.environ["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR), str(BENCHMARKS_DIR),
                                                *filter(None, [os.environ.get("PYTHONPATH")])])
    cpu_before = _cpu_seconds()
    started = time.monotonic()
    rows: list[Row] = []
    payload_ranks: dict[int, Any] = {}
    num_params = 0
    for world_size in args.world_sizes:
        specs = _specs(args, world_size)
        refused = {spec.label: _refusal(spec) for spec in specs}
        runnable = [spec for spec in specs if refused[spec.label] is None]
        by_label = {spec.label: spec for spec in runnable}
        order = [by_label[label] for label in _schedule([spec.label for spec in runnable], args.repeats)]
        print(f"running {len(order)} fits on {world_size} gloo ranks: {' '.join(s.label for s in order)} ...",
              flush=True)
        reduced: dict[str, Row] = {}
        try:
            per_rank = [[RankRun(**run) for run in runs] for runs in harness.run_on_ranks(_rank_main, world_size, order)]
            reduced = _reduce(runnable, per_rank)
            payload_ranks[world_size] = [[asdict(run) for run in runs] for runs in per_rank]
            num_params = num_params or per_rank[0][0].num_params
        except RuntimeError as error:
            # A rank failed outside what the fits catch: every fit of this world size is lost.
            reason = str(error).strip().splitlines()[-1][:200]
            print(f"world size {world_size} failed:\n{error}", file=sys.stderr)
            reduced = {spec.label: Row(spec=spec, error=reason) for spec in runnable}
        for spec in specs:
            rows.append(reduced[spec.label] if refused[spec.label] is None
                        else Row(spec=spec, error=refused[spec.label], refused=True))
    wall_s = time.monotonic() - started
    command = " ".join(["python benchmarks/pipeline.py", *argv])
    print_table(rows, args, num_params, command, wall_s)
    if args.json is not None:
        payload = {
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "num_params": num_params,
            "wall_s": wall_s,
            "rows": [{**asdict(row), "median_step_s": row.median_step_s} for row in rows],
            "ranks": payload_ranks,
        }
        args.json.write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.json}")
    _warn_if_shared(cpu_before, _cpu_seconds(), wall_s)
    # A combination the options ask for that cannot run is the caller's to fix, not a failure.
    return 1 if any(row.error and not row.refused for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
