"""Would DeepSpeed's one-step delayed parameter update pay here? A measurement, not a feature.

    python benchmarks/delayed_update.py                      # demo GPT, both layouts, about 1 min
    python benchmarks/delayed_update.py --n-embd 512 --steps 20 --rounds 5

ZeRO-Offload's delayed parameter update (DPU) runs the CPU optimizer step of step t on a host
thread while the forward and backward of step t+1 run, which therefore use weights one update
old: it changes the numerics (every gradient is taken at weights one step stale). What it can
save per step is the CPU step's time, and only where that step has hardware of its own: on a GPU
host the forward and backward run on the device and the optimizer on idle CPU cores. This script
measures both sides on the machine at hand, with the pieces lightning_zero's offload runs:

- the model: the demo GPT (``examples/gpt/model.py``) in bf16 (what ``zero2_offload`` under
  bf16-mixed computes with), its parameters and gradients views into flat bf16 buffers;
- the step: the one-pass C++ Adam (``lightning_zero.ops.fused_adam_step``) over this process's
  fp32 master shard, ``1/--shard-of`` of the parameters as one rank of that many holds, writing
  the bf16 copy of the updated shard into the parameters.

Two ways to run a step, alternated in rounds so that drift hits both alike:

- ``sequential``: forward + backward, then the Adam step, which writes the parameters (what
  lightning_zero does);
- ``delayed``: the Adam step of the previous step's gradient runs on a worker thread while this
  step's forward + backward run (gradients double-buffered); its bf16 copy goes to a staging
  buffer, which is copied into the parameters once both are done.

Two layouts:

- ``ranks``: ``--processes`` processes at once (default 2, the ranks of ``peers.py``), one torch
  thread each, on this machine's cores: how this project's CPU runs share the machine, so the
  worker thread can only take time from the rank's own compute (or its neighbour's);
- ``spare core``: one process with one torch thread, so the worker has a core of its own: the
  best case, standing in for a GPU host whose CPU is free during forward and backward.

Reported per layout: forward + backward alone and the Adam step alone (ms, medians of their own
runs), the step both ways, ``delayed / sequential``, and the ideal ratio ``max(fwd+bwd, adam) /
(fwd+bwd + adam)`` that perfect overlap would reach. The step's time is the slowest process's
median. Nothing here asserts.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_time import GPT_EXAMPLE_DIR, ModelKnobs, _positive_int, add_model_arguments, model_knobs  # noqa: E402 - benchmarks/ is not a package

LR, BETA1, BETA2, EPS, WEIGHT_DECAY = 1e-3, 0.9, 0.999, 1e-8, 0.01


@dataclass(frozen=True)
class Knobs:
    """What one process trains and how often (the command line's values)."""

    model: ModelKnobs
    shard_of: int
    warmup: int
    steps: int
    rounds: int


@dataclass(frozen=True)
class ProcessResult:
    """Median milliseconds per step of one process."""

    forward_backward: float
    adam: float
    sequential: float
    delayed: float
    params: int


class ShardedTrainer:
    """The demo GPT in bf16 over flat parameter and gradient buffers, with one fp32 master shard
    (the first ``numel / shard_of`` elements) stepped by the C++ Adam."""

    def __init__(self, knobs: Knobs) -> None:
        if str(GPT_EXAMPLE_DIR) not in sys.path:
            sys.path.insert(0, str(GPT_EXAMPLE_DIR))
        from model import GPT  # examples/gpt/model.py

        size = knobs.model
        self.model: nn.Module = GPT(vocab_size=size.vocab_size, block_size=size.block_size, n_layer=size.n_layer,
                                    n_head=size.n_head, n_embd=size.n_embd,
                                    max_steps=knobs.warmup + knobs.steps).to(torch.bfloat16)
        params = list(self.model.parameters())  # a tied weight is listed once
        self.numel = sum(p.numel() for p in params)
        self.flat_params = torch.cat([p.detach().reshape(-1) for p in params])  # [numel] bf16
        # Two gradient buffers: the delayed step reads one while backward fills the other.
        self.flat_grads = [torch.zeros(self.numel, dtype=torch.bfloat16) for _ in range(2)]
        offset = 0
        self._views: list[tuple[nn.Parameter, int, int]] = []
        for p in params:
            p.data = self.flat_params[offset : offset + p.numel()].view_as(p)
            self._views.append((p, offset, p.numel()))
            offset += p.numel()
        shard = -(-self.numel // knobs.shard_of)
        self.master = self.flat_params[:shard].float()  # [shard] fp32
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.staging = torch.empty(shard, dtype=torch.bfloat16)
        self.step_count = 0
        tokens = torch.randint(0, size.vocab_size, (size.batch_size, size.block_size + 1))
        self.inputs, self.targets = tokens[:, :-1], tokens[:, 1:]

    def forward_backward(self, grads: Tensor) -> None:
        """One forward and backward whose gradients accumulate into ``grads`` [numel] (zeroed first)."""
        grads.zero_()
        for p, offset, numel in self._views:
            p.grad = grads[offset : offset + numel].view_as(p)
        logits = self.model(self.inputs)
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), self.targets.reshape(-1))
        loss.backward()

    def adam(self, grads: Tensor, out: Tensor) -> None:
        """The Adam step of the shard on ``grads``' shard; the bf16 copy of the new master goes to ``out``."""
        from lightning_zero.ops import fused_adam_step

        self.step_count += 1
        fused_adam_step(self.master, grads[: self.master.numel()], self.exp_avg, self.exp_avg_sq,
                        step=self.step_count, lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS,
                        weight_decay=WEIGHT_DECAY, low_precision_out=out)

    def _adam_on_worker(self, grads: Tensor) -> None:
        # A new thread starts with OpenMP's default team size (every core), not the process's
        # setting: without this the kernel's parallel_for would oversubscribe the cores.
        torch.set_num_threads(1)
        self.adam(grads, self.staging)

    def sequential_step(self, step: int) -> None:
        grads = self.flat_grads[step % 2]
        self.forward_backward(grads)
        self.adam(grads, self.flat_params[: self.master.numel()])

    def delayed_step(self, step: int) -> None:
        """The previous step's gradient is stepped on a worker while this step computes."""
        previous = self.flat_grads[(step + 1) % 2]
        worker = threading.Thread(target=self._adam_on_worker, args=(previous,)) if step > 0 else None
        if worker is not None:
            worker.start()
        self.forward_backward(self.flat_grads[step % 2])
        if worker is not None:
            worker.join()
            self.flat_params[: self.master.numel()].copy_(self.staging)


def _median_ms(run: Any, count: int) -> float:
    times = []
    for index in range(count):
        start = time.perf_counter()
        run(index)
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def _measure(knobs: Knobs, barrier: Any, results: Any, slot: int) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(slot)
    trainer = ShardedTrainer(knobs)
    samples: dict[str, list[float]] = {"forward_backward": [], "adam": [], "sequential": [], "delayed": []}
    grads = trainer.flat_grads[0]
    runs = {
        "forward_backward": lambda step: trainer.forward_backward(grads),
        "adam": lambda step: trainer.adam(grads, trainer.staging),
        "sequential": trainer.sequential_step,
        "delayed": trainer.delayed_step,
    }
    for _ in range(knobs.rounds):
        for name, run in runs.items():
            barrier.wait()  # every process runs the same thing at the same time
            for step in range(knobs.warmup):
                run(step)
            samples[name].append(_median_ms(lambda step: run(knobs.warmup + step), knobs.steps))
    results[slot] = ProcessResult(**{name: statistics.median(values) for name, values in samples.items()},
                                  params=trainer.numel)


def run_layout(knobs: Knobs, processes: int) -> list[ProcessResult]:
    """Runs ``processes`` measuring processes at once and returns each one's result."""
    context = mp.get_context("spawn")
    with context.Manager() as manager:
        barrier = manager.Barrier(processes)
        results = manager.dict()
        workers = [context.Process(target=_measure, args=(knobs, barrier, results, slot)) for slot in range(processes)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        failed = [worker.exitcode for worker in workers if worker.exitcode != 0]
        if failed:
            raise RuntimeError(f"a measuring process exited with {failed[0]}; its traceback is above")
        return [results[slot] for slot in range(processes)]


def _parse() -> tuple[Knobs, int]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=_positive_int, default=2, help="processes of the 'ranks' layout, one thread each")
    parser.add_argument("--shard-of", type=_positive_int, default=2,
                        help="a process steps 1/N of the parameters, as one of N ranks")
    add_model_arguments(parser, batch_size=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=_positive_int, default=12)
    parser.add_argument("--rounds", type=_positive_int, default=3)
    args = parser.parse_args()
    return Knobs(model_knobs(args), args.shard_of, args.warmup, args.steps, args.rounds), args.processes


def main() -> None:
    knobs, processes = _parse()
    console = Console()
    started = time.perf_counter()
    layouts = {f"ranks ({processes} x 1 thread)": processes, "spare core (1 process)": 1}
    table = Table(title="One-step delayed parameter update against the sequential step (ms per step)")
    for column in ("layout", "fwd+bwd", "adam", "sequential", "delayed", "delayed / sequential", "ideal"):
        table.add_column(column, justify="left" if column == "layout" else "right")
    params = 0
    for name, count in layouts.items():
        console.print(f"measuring {name} ...")
        results = run_layout(knobs, count)
        params = results[0].params
        slowest = {field: max(getattr(r, field) for r in results) for field in ("forward_backward", "adam", "sequential", "delayed")}
        ideal = max(slowest["forward_backward"], slowest["adam"]) / (slowest["forward_backward"] + slowest["adam"])
        table.add_row(name, f"{slowest['forward_backward']:.1f}", f"{slowest['adam']:.1f}", f"{slowest['sequential']:.1f}",
                      f"{slowest['delayed']:.1f}", f"{slowest['delayed'] / slowest['sequential']:.2f}x", f"{ideal:.2f}x")
    console.print(table)
    console.print(
        f"GPT n_layer={knobs.model.n_layer} n_embd={knobs.model.n_embd}, {params / 1e6:.2f} M parameters in bf16,"
        f" batch {knobs.model.batch_size} x {knobs.model.block_size}; Adam over 1/{knobs.shard_of} of them (fp32 master). Medians of"
        f" {knobs.steps} steps after {knobs.warmup}, median over {knobs.rounds} rounds; the slowest process."
        f" {os.cpu_count()} CPU cores, {platform.machine()}, torch {torch.__version__};"
        f" {time.perf_counter() - started:.0f} s."
    )


if __name__ == "__main__":
    main()
