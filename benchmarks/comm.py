"""The forms of ZeRO's sharded collectives on this machine's backend: reduce-scatter against
all-reduce plus a local copy, all-gather against one broadcast per rank, and, between two ranks,
both against one exchange (see [Note: collective forms] in lightning_zero/zero/comm.py), for the
chunk sizes ZeRO's buckets and units use.

    python benchmarks/comm.py                         # gloo, 2 and 4 ranks, fp32 and bf16
    python benchmarks/comm.py --worlds 2 --dtypes fp32 --repeats 9

Each rank runs every (size, form) pair ``--repeats`` times, the forms rotating so that load on
the machine hits each alike, and reports the median time of the slowest rank. The table gives
each form's median and the ratio plain / form (above 1: the form is faster), with the form
:class:`~lightning_zero.zero.comm.CollectiveForms` picks for the backend: its fixed rules come from
this benchmark. A measurement, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
CHUNKS = (4_096, 16_384, 32_768, 131_072, 524_288, 2_097_152)  # elements per rank
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _time(fn: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    import torch

    slowest = torch.tensor([elapsed])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest)


def _worker(rank: int, world: int, port: int, dtypes: list[str], repeats: int, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.path.insert(0, str(REPO_ROOT))
    import torch
    import torch.distributed as dist

    from lightning_zero.zero.comm import CollectiveForms, Collectives

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    forms = {
        "plain": Collectives(forms=CollectiveForms.native()),
        "alt": Collectives(forms=CollectiveForms(reduce_scatter_as_all_reduce_from=1, all_gather_as_broadcasts_from=1)),
    }
    if world == 2:
        forms["exchange"] = Collectives(forms=CollectiveForms(exchange_between_two_ranks=True))
    rows = []
    for name in dtypes:
        dtype = getattr(torch, DTYPES[name])
        for chunk in CHUNKS:
            grad = torch.randn(world * chunk).to(dtype)
            output = torch.empty(chunk, dtype=dtype)
            gathered = torch.empty(world * chunk, dtype=dtype)
            times: dict[str, list[float]] = {f"{op}_{label}": [] for op in ("rs", "ag") for label in forms}
            order = list(forms.items())
            for repeat in range(repeats + 1):  # the first round warms up
                shift = repeat % len(order)
                for label, collectives in order[shift:] + order[:shift]:
                    rs = _time(lambda c=collectives: c.reduce_scatter(output, grad.clone()).wait())
                    ag = _time(lambda c=collectives: c.all_gather(gathered, output).wait())
                    if repeat:
                        times[f"rs_{label}"].append(rs)
                        times[f"ag_{label}"].append(ag)
            rows.append((name, chunk, {key: statistics.median(values) for key, values in times.items()}))
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def measure(world: int, dtypes: list[str], repeats: int) -> list[tuple[str, int, dict[str, float]]]:
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    port = _free_port()
    processes = [context.Process(target=_worker, args=(rank, world, port, dtypes, repeats, queue))
                 for rank in range(world)]
    for process in processes:
        process.start()
    rows = queue.get()
    for process in processes:
        process.join()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO_ROOT))
    from lightning_zero.zero.comm import CollectiveForms

    rule = CollectiveForms.for_backend("gloo")
    print(f"gloo on {os.cpu_count()} cores, median of {args.repeats} (slowest rank); ratio = plain / form")
    print()
    print("| ranks | dtype | chunk (elements/rank) | reduce-scatter ms | all-reduce + copy | exchange | rule picks"
          " | all-gather ms | broadcasts | exchange | rule picks |")
    print("|--:|---|--:|--:|--:|--:|---|--:|--:|--:|---|")
    for world in args.worlds:
        for name, chunk, t in measure(world, args.dtypes, args.repeats):
            cells = [str(world), name, f"{chunk:,}"]
            for op, plain, forms_picked in (("rs", "reduce_scatter", rule.reduce_scatter_form(chunk, world)),
                                            ("ag", "all_gather", rule.all_gather_form(chunk, world))):
                cells.append(f"{t[f'{op}_plain'] * 1e3:.2f}")
                for label in ("alt", "exchange"):
                    key = f"{op}_{label}"
                    cells.append(f"{t[key] * 1e3:.2f} ({t[f'{op}_plain'] / t[key]:.2f}x)" if key in t else "")
                cells.append(forms_picked)
            print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
