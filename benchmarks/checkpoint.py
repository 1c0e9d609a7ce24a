"""Checkpoint save, load and export: sharded (ours) against the gathered single file, on gloo ranks.

    python benchmarks/checkpoint.py                         # 2 ranks, 48M params (~45 s)
    python benchmarks/checkpoint.py --ranks 2 --layers 24 --width 2048

The model is a stack of ``--layers`` square ``Linear`` layers (``--width``), trained one step
by the ZeRO-2 engine with AdamW, so a checkpoint holds 3 fp32 tensors per parameter. Measured in
the same run, each against its baseline:

- save: ``save_checkpoint`` (every rank writes its shards; nothing gathered) against the full
  format (optimizer state consolidated onto rank 0, then ``torch.save`` by rank 0), which is
  what ``state_dict_type="full"`` does. Time of the slowest rank; peak RSS growth of rank 0 over
  what it held before (peaks reset through /proc/self/clear_refs on Linux).
- load: ``load_checkpoint`` (every rank reads its own pieces) against every rank ``torch.load``-ing
  the full file and slicing its shards out (``load_state_dict``).
- export to one file: ``lightning_zero.consolidate`` (streamed) against torch's
  ``dcp_to_torch_save`` (loads the whole checkpoint, then saves it), in a fresh process each.
- checksums: the sharded save and load with and without the CRC-32 of every record (see
  [Note: checkpoint checksums]), alternated ``--repeats`` times, the fastest of each kept; the
  difference is the checksums' cost, per GB of checkpoint saved or loaded; and the checksum
  passes alone (the save's read-back and hash, the load's verification), which the fsyncs'
  variance cannot hide.

This is a measurement, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

MIB = 2**20


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as file:
            file.write("5")
    except OSError:
        pass


def _peak() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _measure(fn: Any) -> tuple[float, int]:
    """(seconds, peak RSS growth over the RSS before) of fn(), on this rank, after a barrier."""
    dist.barrier()
    _reset_peak()
    before = _rss()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start, max(0, _peak() - before)


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, directory: str, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from lightning_zero import Collectives, ZeroConfig, ZeroOptimizer
    from lightning_zero.checkpoint import load_checkpoint, save_checkpoint

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers)])
    optimizer = ZeroOptimizer(torch.optim.AdamW(model.parameters()), model, Collectives(), ZeroConfig(stage=2))
    model(torch.randn(2, args.width)).sum().backward()
    optimizer.step()
    sharded = os.path.join(directory, "sharded.ckpt")
    full = os.path.join(directory, "full.ckpt")

    def save_full() -> None:
        optimizer.consolidate_state_dict()
        if rank == 0:
            torch.save({"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()]}, full)

    def load_full() -> None:
        checkpoint = torch.load(full, map_location="cpu", weights_only=True)
        model.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer_states"][0])

    results = {
        "save_full": _measure(save_full),
        "save_sharded": _measure(lambda: save_checkpoint(sharded, model, [optimizer])),
        "load_full": _measure(load_full),
        "load_sharded": _measure(lambda: load_checkpoint(sharded, model, [optimizer])),
    }
    # Checksums: with and without, alternated so that both see the same page cache and disk. Both
    # loads read the same checkpoint, saved with checksums; the plain load only skips verifying.
    timings: dict[str, list[float]] = {name: [] for name in ("save_plain", "save_crc", "load_plain", "load_crc")}
    runs = {
        "save_plain": lambda: save_checkpoint(sharded, model, [optimizer], checksums=False),
        "save_crc": lambda: save_checkpoint(sharded, model, [optimizer]),
        "load_plain": lambda: load_checkpoint(sharded, model, [optimizer], verify=False),
        "load_crc": lambda: load_checkpoint(sharded, model, [optimizer]),
    }
    for repeat in range(args.repeats):
        for kind in ("save", "load"):
            order = ("plain", "crc") if repeat % 2 == 0 else ("crc", "plain")  # neither always goes first
            for how in order:
                timings[f"{kind}_{how}"].append(_measure(runs[f"{kind}_{how}"])[0])
            if kind == "save" and order[-1] == "plain":
                runs["save_crc"]()  # the loads read a checkpoint with checksums
    results.update({name: (min(values), 0) for name, values in timings.items()})
    # The checksum passes alone, without the fsyncs whose variance can exceed them end to end: what
    # the writer does after writing (read back and hash this rank's records) and the load's
    # verification (this rank's share of all records).
    from pathlib import Path

    from lightning_zero.checkpoint.checksums import record_crcs, verify_share
    from lightning_zero.checkpoint.sharded import read_metadata

    metadata = read_metadata(Path(sharded))
    spans = [(i.relative_path, i.offset, i.length) for i in metadata.storage_data.values()
             if i.relative_path == f"__{rank}_0.distcp"]
    results["crc_save_pass"] = min(_measure(lambda: record_crcs(Path(sharded), spans)) for _ in range(args.repeats))
    results["crc_load_pass"] = min(_measure(lambda: verify_share(Path(sharded), metadata, lambda key: True, None))
                                   for _ in range(args.repeats))
    queue.put((rank, results))
    dist.destroy_process_group()


_EXPORT = r"""
import json, os, sys, time, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, sys.argv[4])
from checkpoint import _peak, _reset_peak, _rss
how, source, out = sys.argv[1:4]
if how == "ours":
    from lightning_zero import consolidate
    run = lambda: consolidate(source, out, progress=False, overwrite=True)
else:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    run = lambda: dcp_to_torch_save(source, out)
_reset_peak(); before = _rss(); start = time.perf_counter()
run()
print(json.dumps({"seconds": time.perf_counter() - start, "growth": max(0, _peak() - before)}))
"""


def _export(how: str, source: str, out: str) -> dict[str, float]:
    result = subprocess.run([sys.executable, "-c", _EXPORT, how, source, out, os.path.dirname(__file__)],
                            capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5, help="runs of each checksum measurement (fastest kept)")
    args = parser.parse_args()
    params = args.layers * args.width * args.width
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as directory:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        context = mp.get_context("spawn")
        queue = context.SimpleQueue()
        processes = [context.Process(target=_rank, args=(r, args.ranks, port, args, directory, queue))
                     for r in range(args.ranks)]
        for process in processes:
            process.start()
        per_rank = dict(queue.get() for _ in processes)
        for process in processes:
            process.join()
        sizes = {name: sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(os.path.join(directory, name))
                           for f in files) if os.path.isdir(os.path.join(directory, name))
                 else os.path.getsize(os.path.join(directory, name)) for name in ("sharded.ckpt", "full.ckpt")}
        ours = _export("ours", os.path.join(directory, "sharded.ckpt"), os.path.join(directory, "ours.pt"))
        torchs = _export("torch", os.path.join(directory, "sharded.ckpt"), os.path.join(directory, "torch.pt"))

    def slowest(key: str) -> float:
        return max(per_rank[r][key][0] for r in per_rank)

    def rank0(key: str) -> float:
        return per_rank[0][key][1] / MIB

    print(f"{args.ranks} gloo ranks, {params / 1e6:.0f}M fp32 params + AdamW; full file {sizes['full.ckpt'] / MIB:.0f} MiB,"
          f" sharded {sizes['sharded.ckpt'] / MIB:.0f} MiB in {args.ranks} shard files")
    print("| operation | ours s | baseline s | time x baseline | ours rank-0 peak +MiB | baseline +MiB | memory x baseline |")
    print("|---|---|---|---|---|---|---|")
    for name, ours_key, base_key in (("save", "save_sharded", "save_full"), ("load", "load_sharded", "load_full")):
        print(f"| {name} | {slowest(ours_key):.2f} | {slowest(base_key):.2f} | {slowest(ours_key) / slowest(base_key):.2f} |"
              f" {rank0(ours_key):.0f} | {rank0(base_key):.0f} | {rank0(ours_key) / max(rank0(base_key), 1e-9):.2f} |")
    print(f"| export to one .pt | {ours['seconds']:.2f} | {torchs['seconds']:.2f} | {ours['seconds'] / torchs['seconds']:.2f} |"
          f" {ours['growth'] / MIB:.0f} | {torchs['growth'] / MIB:.0f} | {ours['growth'] / max(torchs['growth'], 1):.3f} |")
    print("baselines: save = consolidate onto rank 0 + torch.save; load = torch.load of the full file on every rank;"
          " export = torch's dcp_to_torch_save")
    gigabytes = sizes["sharded.ckpt"] / 1e9
    print()
    print(f"checksums (CRC-32 of every record), fastest of {args.repeats}, slowest rank, {gigabytes:.2f} GB checkpoint:")
    print("| operation | with checksums s | without s | ratio | extra s per GB |")
    print("|---|---|---|---|---|")
    for kind in ("save", "load"):
        crc, plain = slowest(f"{kind}_crc"), slowest(f"{kind}_plain")
        print(f"| {kind} | {crc:.2f} | {plain:.2f} | {crc / plain:.2f} | {(crc - plain) / gigabytes:.2f} |")
    print("the checksum pass alone (ranks in parallel, each on its share), slowest rank:")
    print("| pass | s | s per GB of checkpoint | share of the run without checksums |")
    print("|---|---|---|---|")
    for kind in ("save", "load"):
        alone = slowest(f"crc_{kind}_pass")
        print(f"| {kind}: {'read back and hash own records' if kind == 'save' else 'verify a share of all records'} |"
              f" {alone:.3f} | {alone / gigabytes:.3f} | {alone / slowest(f'{kind}_plain'):.2f} |")


if __name__ == "__main__":
    main()
