"""Trains a tiny demo GPT with ZeRO-3 under ``torchrun`` and saves what every rank saw.

Run by ``tests/test_multinode.py``, either as two ``torchrun`` agents on one machine that pose
as two nodes (``--nnodes 2 --node-rank {0,1}``), or as one node of four processes for the
reference. Lightning detects torchrun (``TorchElasticEnvironment``: RANK, LOCAL_RANK,
GROUP_RANK, WORLD_SIZE) and does not relaunch; ``devices`` and ``num_nodes`` are read from the
variables torchrun sets so that they always agree with the launch.

After fit, global rank 0 writes ``torch.save`` of::

    {"ranks": [per-rank record, in global-rank order], "state_dict": full model, "dims": ...}

where a per-rank record holds its losses, a fingerprint of each step's batch, where torchrun
and Lightning placed it, and the global ranks of its ZeRO shard group.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "gpt"))
from model import GPT  # noqa: E402

from lightning_zero import ParallelConfig, ZeroConfig, ZeroStrategy  # noqa: E402

VOCAB, SEQ = 32, 8
SAMPLES = 64


def token_data(samples: int = SAMPLES, seed: int = 0) -> TensorDataset:
    # A fixed generator: every rank (and both layouts) build the same data set.
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (samples, SEQ + 1), generator=generator)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


class RecordingGPT(GPT):
    """The demo GPT with plain AdamW (no schedule, no decay) that records, per step, its local
    loss and which samples it trained on."""

    def __init__(self) -> None:
        torch.manual_seed(0)  # the same initial weights on every rank and in every layout
        super().__init__(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=32, dropout=0.0,
                         weight_decay=0.0)
        self.losses: list[float] = []
        self.batches: list[list[int]] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.losses.append(loss.item())
        # Token sums per sample: enough to tell whether two layouts dealt the same samples to a rank.
        self.batches.append(batch[0].sum(dim=1).tolist())
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.0)


def parse_shard_size(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where global rank 0 writes the results (torch.save)")
    parser.add_argument("--shard-size", type=parse_shard_size, default=None,
                        help="ParallelConfig.shard_size: an int, -1 for one node, or 'none' for plain ZeRO-3")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=2, help="per rank")
    return parser.parse_args(argv)


def shard_group_ranks(strategy: ZeroStrategy) -> list[int]:
    """The global ranks this rank's ZeRO shards are spread over: the world without a mesh."""
    parallel = strategy._parallel
    group = parallel.shard_group if parallel is not None else dist.group.WORLD
    return dist.get_process_group_ranks(group)


def dims_dict(strategy: ZeroStrategy) -> dict[str, int] | None:
    dims = strategy.parallel_dims
    if dims is None:  # plain ZeRO builds no mesh
        return None
    return {"world": dims.world, "data": dims.data, "tensor": dims.tensor, "shard": dims.shard,
            "replicas": dims.replicas}


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)  # up to 4 ranks share the machine's cores
    local_world = int(os.environ["LOCAL_WORLD_SIZE"])
    num_nodes = int(os.environ["WORLD_SIZE"]) // local_world
    module = RecordingGPT()
    strategy = ZeroStrategy(config=ZeroConfig(stage=3, parallel=ParallelConfig(shard_size=args.shard_size)))
    trainer = pl.Trainer(accelerator="cpu", devices=local_world, num_nodes=num_nodes, strategy=strategy,
                         max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    # shuffle=False here; Lightning still swaps in a shuffled DistributedSampler (seed 0 + epoch).
    trainer.fit(module, train_dataloaders=DataLoader(token_data(), batch_size=args.batch_size, shuffle=False))

    # The process group outlives fit, so the ranks can still exchange their records.
    record = {
        "losses": module.losses,
        "batches": module.batches,
        "env": {key: int(os.environ[key]) for key in ("RANK", "LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE")},
        "lightning": {"global_rank": trainer.global_rank, "local_rank": trainer.local_rank,
                      "node_rank": trainer.node_rank, "world_size": trainer.world_size,
                      "num_nodes": trainer.num_nodes},
        "shard_group": shard_group_ranks(strategy),
        "dist_rank": dist.get_rank(),
    }
    records: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    # Stage 3 hands the module back whole on every rank after fit: rank 0's state dict is the model.
    state_dict = {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}
    if trainer.global_rank == 0:
        torch.save({"ranks": records, "state_dict": state_dict, "dims": dims_dict(strategy)}, args.out)
    dist.barrier()  # no rank leaves (and tears the store down) before rank 0 has written
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
