"""Step time and model-state bytes per rank of three layouts of 4 ranks: dp4, dp2 x tp2, hybrid 2 x 2.

    python benchmarks/parallel.py                          # defaults: ZeRO-3, about 1-2 min on 2 idle cores
    python benchmarks/parallel.py --stage 1 --steps 10 --repeats 1
    python benchmarks/parallel.py --n-layer 8 --n-embd 256 --global-batch 64 --json /tmp/parallel.json

Every layout trains the demo GPT (``examples/gpt/model.py``, its own AdamW and schedule, fp32)
on the same global batch of random tokens, with ``ZeroStrategy(config=ZeroConfig(stage=--stage,
parallel=...))`` on 4 gloo ranks on the CPU:

- dp4: ``ParallelConfig()``, plain ZeRO over all 4 ranks, ``--global-batch / 4`` samples per rank.
  It is the baseline of every ratio.
- dp2 x tp2: ``ParallelConfig(tensor=2)``; ``configure_model`` applies
  ``lightning_zero.parallel.parallelize_gpt`` over the mesh's ``"tensor"`` dim (column-parallel
  ``qkv`` / ``fc``, row-parallel ``proj``s; embeddings, ``ln_f`` and the tied head replicated).
  ZeRO shards over the 2 data-parallel ranks, each of which reads ``--global-batch / 2`` samples
  (its two tensor ranks read the same ones).
- hybrid 2 x 2: ``ParallelConfig(shard_size=2)``, ZeRO shards within pairs of ranks and the two
  pairs all-reduce their gradients; ``--global-batch / 4`` samples per rank.

Stage 3 gathers one transformer block (``Block``) at a time, as in ``benchmarks/step_time.py``.

What the table shows, per layout:

- step ms: each optimizer step (one batch, no accumulation) is timed on every rank from a
  Callback's ``on_train_batch_start`` to its ``on_train_batch_end`` with ``time.perf_counter``
  (forward, backward, gradient reduction, optimizer step, and the layout's gathers and tensor-
  parallel all-reduces; data loading is outside that window). Nothing is synchronized (CPU): a
  step's time is its slowest rank's, since the others wait for it in the next collective. The
  first ``--warmup`` steps of a run are dropped; a run's figure is the median of the rest, and
  with ``--repeats R`` the layouts run R times in a rotating order and the table gives the
  median of the R runs (each run's in the last column).
- params / grads / optim / state: ``ZeroStrategy.model_state_bytes()`` on every rank at
  ``on_train_end`` (before teardown; distinct storages, padding included; ``optim`` includes
  ZeRO's fp32 master shard). Each column is the largest rank's, and ``state`` is the largest
  rank's own total. Communication buffers and stage 3's gathered blocks are not model state.

All three layouts run in one group of 4 spawned ranks (``tests/harness.py``'s ``run_on_ranks``,
which sets ``torch.set_num_threads(1)`` per rank), one ``Trainer.fit`` after another; the parent
prints the table from the ranks' results. Like ``step_time.py``, the run warns when other
processes used the CPU meanwhile: their load is measured as the layouts' step time. This is a
measurement, not a test: nothing here asserts.

What it showed on CPU with gloo (defaults, except ZeRO-2: one run of 10 steps; 2 cores shared
with other jobs, so expect +-20% noise):

                      ZeRO-1              ZeRO-2              ZeRO-3
    step ms (x dp4)
      dp4             159                 168                 282
      dp2 x tp2       243 (1.53x)         246 (1.46x)         362 (1.29x)
      hybrid 2 x 2    157 (0.99x)         147 (0.87x)         229 (0.81x)
    model state MiB per rank (x dp4)
      dp4             9.27                6.18                3.09
      dp2 x tp2       6.33 (0.68x)        4.75 (0.77x)        3.17 (1.02x)
      hybrid 2 x 2    12.36 (1.33x)       9.27 (1.50x)        6.18 (2.00x)

- Tensor parallelism is slower than dp4 here at every stage: each block pays two all-reduces of
  its (batch, seq, n_embd) activations in forward (after the row-parallel ``proj``s) and two in
  backward (the column-parallel inputs' gradients), through gloo's TCP loopback, while each rank
  does the same matmul work as at dp4 (weights half as wide, a batch twice as large). What TP
  buys is memory per rank: at stages 1 and 2, where dp4 replicates the parameters, dp2 x tp2
  holds half of every split weight (most of the GPT), 0.68x-0.77x of dp4's model state. At
  stage 3 dp4 already shards everything 4 ways, and dp2 x tp2 holds about as much (1.02x: the
  replicated embeddings and norms are sharded over 2 ranks, not 4). TP is meant for GPUs
  joined by NVLink, where those all-reduces are cheap, and for models whose blocks' inner
  activations (which TP splits too; not counted here) bound the memory.
- Hybrid sharding keeps twice dp4's sharded state per rank (it shards over 2 ranks, not 4) and
  was as fast or faster, most clearly at stage 3: its gathers and reduce-scatters involve 2
  ranks instead of 4, which (our reading, not measured apart) on a loopback ring of 4 processes
  sharing 2 cores costs fewer hops and context switches than the extra gradient all-reduce
  between the pairs. Across nodes its point is to keep the frequent gathers on a node's fast
  links and send only one gradient all-reduce over the slow ones.
- Stage 1 shows more gradient bytes than parameter bytes (3.86 vs 3.09 MiB at dp4): it keeps
  the full local gradient (``p.grad``) and also the fp32 gradient shard its masters step from.
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
GPT_EXAMPLE_DIR = REPO_ROOT / "examples" / "gpt"
TESTS_DIR = REPO_ROOT / "tests"
WORLD_SIZE = 4
MiB = 2**20

# The same names for the CLI, the table and the JSON; the first is the baseline of the ratios.
LAYOUTS = ("dp4", "dp2xtp2", "hybrid2x2")
BASELINE = LAYOUTS[0]
TENSOR_SIZE = {"dp4": 1, "dp2xtp2": 2, "hybrid2x2": 1}


# ---------------------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class RunSpec:
    """What every rank needs to run one layout's fit (picklable: it crosses the spawn)."""

    layout: str
    stage: int
    warmup: int
    steps: int
    global_batch: int
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    vocab_size: int

    @property
    def data_size(self) -> int:
        """Data-parallel ranks: those that read distinct samples."""
        return WORLD_SIZE // TENSOR_SIZE[self.layout]

    @property
    def per_rank_batch(self) -> int:
        return self.global_batch // self.data_size


@dataclass(frozen=True)
class RankRun:
    """One rank's measurements of one layout's fit."""

    layout: str
    rank: int
    step_times_s: list[float]
    params: int
    grads: int
    optimizer_states: int
    mesh: str
    """The strategy's ParallelDims, as text: which layout really ran (see ``_describe_mesh``)."""


@dataclass
class LayoutResult:
    """One table row: the rank runs of one layout reduced to the worst rank, and to the median run."""

    layout: str
    mesh: str = ""
    run_medians_s: list[float] = field(default_factory=list)
    """Per repeat, in the order they ran: the median over steps of the slowest rank's step time."""
    params: int = 0
    grads: int = 0
    optimizer_states: int = 0
    state_total: int = 0
    """The largest rank's own params + grads + optimizer states."""

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.run_medians_s)


# ---------------------------------------------------------------------------------------- rank side
def _rank_main(specs: Sequence[RunSpec]) -> list[dict[str, Any]]:
    """Runs on every rank (inside ``run_on_ranks``, process group already up): one fit per spec."""
    return fit_each(specs, _fit_and_measure)


def fit_each(specs: Sequence[Any], fit_and_measure: Any) -> list[dict[str, Any]]:
    """On every rank: ``fit_and_measure(spec, rank)`` for each spec in turn, Lightning's per-fit
    chatter silenced (also benchmarks/pipeline.py's).

    Returns plain dicts: a class of the benchmark's file is ``__mp_main__``'s in a spawned rank, a
    name the parent's unpickler cannot find."""
    import logging
    import warnings

    import lightning.pytorch  # noqa: F401 - sets its logger's level on import; ours comes after
    import torch.distributed as dist

    from harness import launched_environment

    # Ranks times fits of "GPU available: False" would bury the table.
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=r".*defined a `validation_step` but have no `val_dataloader`.*")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated.*")
    rank = dist.get_rank()
    runs = []
    for spec in specs:
        # Lightning's teardown deletes WORLD_SIZE & co.; the next fit needs them back.
        with launched_environment():
            runs.append(asdict(fit_and_measure(spec, rank)))
    return runs


def _fit_and_measure(spec: RunSpec, rank: int) -> RankRun:
    import lightning.pytorch as pl

    from lightning_zero import ParallelConfig, ZeroConfig, ZeroStrategy

    pl.seed_everything(1234, workers=True, verbose=False)
    model = _model_class()(
        vocab_size=spec.vocab_size,
        block_size=spec.block_size,
        n_layer=spec.n_layer,
        n_head=spec.n_head,
        n_embd=spec.n_embd,
        max_steps=spec.warmup + spec.steps,  # the same schedule for every layout
    )
    parallel = {
        "dp4": ParallelConfig(),
        "dp2xtp2": ParallelConfig(tensor=2),
        "hybrid2x2": ParallelConfig(shard_size=2),
    }[spec.layout]
    units = {"unit_modules": ("Block",)} if spec.stage == 3 else {}
    strategy = ZeroStrategy(config=ZeroConfig(stage=spec.stage, parallel=parallel, **units))
    from step_time import timed_fit

    step_times_s, (params, grads, optimizer_states) = timed_fit(
        model, strategy, WORLD_SIZE, spec.warmup, spec.steps, _build_loader(spec), spec.layout)
    return RankRun(
        layout=spec.layout,
        rank=rank,
        step_times_s=step_times_s,
        params=params,
        grads=grads,
        optimizer_states=optimizer_states,
        mesh=_describe_mesh(strategy.parallel_dims),
    )


def _describe_mesh(dims: Any) -> str:
    """``data x tensor``, ZeRO's shard group and the replicas, from the strategy's ParallelDims
    (``None`` for plain ZeRO: no mesh, ZeRO shards over the whole world)."""
    if dims is None:
        return f"dp{WORLD_SIZE}, shard {WORLD_SIZE}"
    text = f"dp{dims.data} x tp{dims.tensor}" if dims.tensor > 1 else f"dp{dims.data}"
    text += f", shard {dims.shard}"
    return text + (f" x {dims.replicas} replicas" if dims.replicas > 1 else "")


def _model_class() -> type:
    """The demo GPT, split over the mesh's tensor dim in ``configure_model`` when it has one."""
    if str(GPT_EXAMPLE_DIR) not in sys.path:
        sys.path.insert(0, str(GPT_EXAMPLE_DIR))
    from model import GPT  # examples/gpt/model.py

    from lightning_zero.parallel import parallelize_gpt

    class TensorParallelGPT(GPT):
        def configure_model(self) -> None:
            mesh = self.device_mesh
            if mesh is not None and "tensor" in (mesh.mesh_dim_names or ()) and mesh["tensor"].size() > 1:
                parallelize_gpt(self, mesh["tensor"])

    return TensorParallelGPT


def _build_loader(spec: RunSpec) -> Any:
    from step_time import token_loader

    # Enough windows that no data-parallel rank runs out before max_steps; Lightning adds the
    # DistributedSampler over the data-parallel ranks (tensor ranks of one data rank share theirs).
    samples = spec.global_batch * (spec.warmup + spec.steps + 1)
    return token_loader(samples, spec.vocab_size, spec.block_size, spec.per_rank_batch)


# ---------------------------------------------------------------------------------------- parent side
def _schedule(layouts: Sequence[str], repeats: int) -> list[str]:
    """Each repeat runs every layout once, starting one later than the last repeat did, so that
    a drift of the machine's load (or a warm allocator) does not always favour the same layout."""
    order: list[str] = []
    for repeat in range(repeats):
        shift = repeat % len(layouts)
        order += [*layouts[shift:], *layouts[:shift]]
    return order


def _reduce(layouts: Sequence[str], per_rank: Sequence[Sequence[RankRun]]) -> list[LayoutResult]:
    results = {name: LayoutResult(layout=name) for name in layouts}
    # per_rank[r][i] is rank r's i-th fit; the ranks ran the same fits in the same order.
    for runs in zip(*per_rank, strict=True):
        result = results[runs[0].layout]
        per_step = [max(times) for times in zip(*(r.step_times_s for r in runs), strict=True)]
        result.run_medians_s.append(statistics.median(per_step))
        # Model state does not change between repeats; the last run's is kept.
        result.mesh = runs[0].mesh
        result.params = max(r.params for r in runs)
        result.grads = max(r.grads for r in runs)
        result.optimizer_states = max(r.optimizer_states for r in runs)
        result.state_total = max(r.params + r.grads + r.optimizer_states for r in runs)
    return [results[name] for name in layouts]


def _mib(value: int) -> str:
    return f"{value / MiB:.2f}"


def _ratio(value: float, baseline: float | None) -> str:
    return "—" if not baseline else f"{value / baseline:.2f}x"


def print_table(results: Sequence[LayoutResult], args: argparse.Namespace, num_params: int, command: str,
                wall_s: float) -> None:
    from rich.console import Console
    from rich.table import Table

    baseline = next((r for r in results if r.layout == BASELINE), None)
    table = Table(
        title=(
            f"ZeRO-{args.stage}, {WORLD_SIZE} gloo ranks on CPU: median step of {args.steps} after {args.warmup}"
            f" warm-up, median of {args.repeats} run(s); ratios to {BASELINE} in this run"
        ),
        caption=(
            f"demo GPT n_layer={args.n_layer} n_head={args.n_head} n_embd={args.n_embd} block_size={args.block_size}"
            f" vocab={args.vocab_size}: {num_params / 1e6:.2f} M parameters; AdamW, fp32; global batch"
            f" {args.global_batch}.\n"
            "step: the slowest rank's; model state (MiB): the largest rank's.\n"
            f"{command}   ({wall_s:.0f} s)"
        ),
        caption_justify="left",
    )
    table.add_column("layout", style="bold")
    table.add_column("mesh")
    for name in ("batch/rank", "step ms", f"×{BASELINE}", "params", "grads", "optim", "state", f"×{BASELINE}"):
        table.add_column(name, justify="right")
    if args.repeats > 1:
        table.add_column("runs ms", justify="right")
    for result in results:
        row = [
            result.layout,
            result.mesh,
            str(args.global_batch // (WORLD_SIZE // TENSOR_SIZE[result.layout])),
            f"{result.median_step_s * 1e3:.0f}",
            _ratio(result.median_step_s, baseline.median_step_s if baseline else None),
            _mib(result.params),
            _mib(result.grads),
            _mib(result.optimizer_states),
            _mib(result.state_total),
            _ratio(result.state_total, baseline.state_total if baseline else None),
        ]
        if args.repeats > 1:
            row.append(" ".join(f"{s * 1e3:.0f}" for s in result.run_medians_s))
        table.add_row(*row)
    console = Console()
    if not console.is_terminal:
        # Piped or redirected, rich assumes 80 columns; a file has room for the whole row.
        console = Console(width=max(console.width, 140))
    console.print(table)


def _num_params(args: argparse.Namespace) -> int:
    """Parameters of the whole (unsplit) model; the tied embedding / head weight counts once."""
    import torch

    torch.manual_seed(0)
    model = _model_class()(vocab_size=args.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                           n_head=args.n_head, n_embd=args.n_embd, max_steps=1)
    return sum(p.numel() for p in model.parameters())


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), default=3, help="ZeRO stage of every layout")
    parser.add_argument(
        "--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS),
        help=f"subset to run; {BASELINE} is always run too, as the reference for the ratios",
    )
    parser.add_argument("--steps", type=_positive_int, default=20, help="measured optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="steps run first in each run and not measured")
    parser.add_argument("--repeats", type=_positive_int, default=3, help="runs of each layout, in rotating order")
    parser.add_argument("--global-batch", type=_positive_int, default=32,
                        help="samples per optimizer step over all ranks (a multiple of 4)")
    parser.add_argument("--n-layer", type=_positive_int, default=4)
    parser.add_argument("--n-head", type=_positive_int, default=4, help="a multiple of 2 (the tensor-parallel size)")
    parser.add_argument("--n-embd", type=_positive_int, default=128)
    parser.add_argument("--block-size", type=_positive_int, default=64)
    parser.add_argument("--vocab-size", type=_positive_int, default=65)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here as JSON")
    args = parser.parse_args(argv)
    if args.global_batch % WORLD_SIZE:
        parser.error(f"--global-batch {args.global_batch} must be a multiple of {WORLD_SIZE}: dp4 splits it 4 ways")
    if args.n_embd % args.n_head:
        parser.error(f"--n-embd {args.n_embd} must be a multiple of --n-head {args.n_head}")
    if args.n_head % 2:
        parser.error(f"--n-head {args.n_head} must be even: dp2 x tp2 gives each tensor rank whole heads")
    if args.warmup < 0:
        parser.error(f"--warmup {args.warmup} must be 0 or more")
    return args


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    # One place for the launcher and the CPU-noise check: the tests' harness and step_time.py.
    sys.path[:0] = [str(TESTS_DIR), str(Path(__file__).resolve().parent)]
    from harness import run_on_ranks
    from step_time import _cpu_seconds, _warn_if_shared

    # Inherited by the spawned ranks: also caps the OpenMP pools torch.set_num_threads does not reach.
    os.environ["OMP_NUM_THREADS"] = "1"
    # Spawned ranks import this file as __mp_main__ and need tests/ (harness) and benchmarks/
    # (step_time's loader and timer) on their path too.
    os.environ["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR), str(Path(__file__).resolve().parent),
                                                *filter(None, [os.environ.get("PYTHONPATH")])])
    layouts = [name for name in LAYOUTS if name in args.layouts or name == BASELINE]
    specs = [
        RunSpec(name, args.stage, args.warmup, args.steps, args.global_batch, args.n_layer, args.n_head,
                args.n_embd, args.block_size, args.vocab_size)
        for name in _schedule(layouts, args.repeats)
    ]
    print(f"running {' '.join(s.layout for s in specs)} (ZeRO-{args.stage}) on {WORLD_SIZE} gloo ranks ...",
          flush=True)
    cpu_before = _cpu_seconds()
    started = time.monotonic()
    per_rank = [[RankRun(**run) for run in runs] for runs in run_on_ranks(_rank_main, WORLD_SIZE, specs)]
    wall_s = time.monotonic() - started
    results = _reduce(layouts, per_rank)
    command = " ".join(["python benchmarks/parallel.py", *argv])
    num_params = _num_params(args)
    print_table(results, args, num_params, command, wall_s)
    if args.json is not None:
        payload = {
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "world_size": WORLD_SIZE,
            "num_params": num_params,
            "wall_s": wall_s,
            "results": [{**asdict(r), "median_step_s": r.median_step_s} for r in results],
            "ranks": [[asdict(run) for run in runs] for runs in per_rank],
        }
        args.json.write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.json}")
    _warn_if_shared(cpu_before, _cpu_seconds(), wall_s)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
