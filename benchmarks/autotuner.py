"""The autotuner's default search against the exhaustive grid on the demo GPT, 2 gloo ranks.

    python benchmarks/autotuner.py                       # about 2-3 min on 2 idle cores
    python benchmarks/autotuner.py --budget-mib 120 --micro-batch-sizes 8 16 32 64

Both searches run the same space (stages 1-3 without offload, the given micro-batch sizes, two
bucket sizes at stages 1/2, two unit sizes at stage 3) under the same per-rank budget, one after
the other in one group of 2 spawned ranks, each trial a short in-process fit of the demo GPT
(``examples/gpt/model.py``, fp32, random tokens). The table gives, per search: trials run, the
search's wall time, its pick, and the pick's throughput as the grid measured it, as a ratio to
the grid's best (the grid measured every configuration under the same conditions, so it is the
baseline of both ratios). The default budget sits between stage 1's estimates at the two largest
micro-batches, so the largest does not fit at stage 1. A measurement, not a test: nothing here
asserts; 2 shared cores give +-15% noise on a single trial's throughput.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "examples" / "gpt"))


def _module(args: argparse.Namespace) -> Any:
    import lightning.pytorch as pl
    import torch
    from model import GPT
    from torch.utils.data import DataLoader, TensorDataset

    class TunedGPT(GPT):
        def __init__(self) -> None:
            super().__init__(vocab_size=64, block_size=args.block_size, n_layer=args.n_layer, n_head=4,
                             n_embd=args.n_embd, dropout=0.0)
            self.batch_size = 8

        def train_dataloader(self) -> DataLoader:
            tokens = torch.randint(0, 64, (4096, args.block_size + 1), generator=torch.Generator().manual_seed(0))
            return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=self.batch_size)

    assert issubclass(TunedGPT, pl.LightningModule)
    return TunedGPT()


def _budget(args: argparse.Namespace) -> int:
    import torch

    from lightning_zero import ZeroConfig, estimate_memory

    if args.budget_mib:
        return args.budget_mib * 2**20
    module = _module(args)
    sizes = sorted(args.micro_batch_sizes)[-2:]
    batch = lambda n: (torch.randint(0, 64, (n, args.block_size)), torch.randint(0, 64, (n, args.block_size)))  # noqa: E731
    at = [estimate_memory(module, 2, ZeroConfig(stage=1), sample_batch=batch(n), device_type="cpu").device.total
          for n in sizes]
    return sum(at) // 2


def _run(args: argparse.Namespace, budget: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch

    from harness import launched_environment
    from lightning_zero import SearchSpace, ZeroAutotuner, ZeroStrategy

    torch.set_num_threads(1)
    space = SearchSpace(micro_batch_sizes=tuple(args.micro_batch_sizes), stages=(1, 2, 3), offload=("none",),
                        reduce_bucket_sizes=(250_000, 25_000_000), prefetch_units=(1,),
                        min_unit_numels=(200_000, 1_000_000))
    out: dict[str, Any] = {}
    for method in ("fast", "grid"):
        tuner = ZeroAutotuner(budget=budget, space=space, method=method, measure_steps=args.measure_steps,
                              output=None, progress=False)
        begin = time.perf_counter()
        with launched_environment():
            trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=2), max_steps=1,
                                 logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                 enable_model_summary=False, callbacks=[tuner])
            trainer.fit(_module(args))
        assert tuner.result is not None
        out[method] = {"seconds": time.perf_counter() - begin, "trials": tuner.result.trials,
                       "best": tuner.result.best.candidate,
                       "rates": {r.candidate: r.samples_per_sec for r in tuner.result.records if r.fits}}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--budget-mib", type=int, default=0, help="per rank (default: see above)")
    parser.add_argument("--measure-steps", type=int, default=5)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=64)
    args = parser.parse_args()
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    from harness import run_on_ranks

    budget = _budget(args)
    result = run_on_ranks(_run, 2, args, budget)[0]
    grid_rates = result["grid"]["rates"]
    best_rate = max(grid_rates.values())
    print(f"\nautotuner vs grid, demo GPT (n_layer={args.n_layer}, n_embd={args.n_embd}), 2 gloo ranks, budget"
          f" {budget / 2**20:.1f} MiB per rank, micro-batches {args.micro_batch_sizes}\n")
    print(f"{'search':8} {'trials':>7} {'seconds':>9} {'pick':58} {'rate (grid)':>12} {'x grid best':>12}")
    for method in ("fast", "grid"):
        run = result[method]
        rate = grid_rates.get(run["best"])
        ratio = f"{rate / best_rate:.2f}" if rate else "-"
        print(f"{method:8} {run['trials']:>7} {run['seconds']:>9.1f} {run['best'].label:58} "
              f"{(rate or 0):>12.1f} {ratio:>12}")
    print(f"\nfast / grid: {result['fast']['trials'] / result['grid']['trials']:.2f}x the trials,"
          f" {result['fast']['seconds'] / result['grid']['seconds']:.2f}x the time")


if __name__ == "__main__":
    main()
