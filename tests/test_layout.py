"""Layout types (zero/layout.py) and the stage-1/2 bucket layout built from them, in one process.

A bucket's pieces must say, for every world size and rank, where each rank's part of every
parameter lies in that rank's chunk: the optimizer state is consolidated from those offsets
(one all-gather per chunk) and loaded through the ranges. Checked exhaustively for small
buckets, where chunks are mostly padding.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from lightning_zero.zero.flat import Bucket
from lightning_zero.zero.layout import (
    ParamSlot,
    Range,
    rank_chunk,
    round_up,
    take_written,
)


def test_range_intersect_stays_inside_itself() -> None:
    whole = Range(10, 20)
    assert whole.intersect(Range(12, 30)) == Range(12, 20)
    assert whole.intersect(Range(0, 4)) == Range(10, 10)  # before: empty at the near edge
    assert whole.intersect(Range(30, 40)) == Range(20, 20)  # after: empty at the far edge
    assert whole.intersect(Range(0, 100)) == whole
    assert Range(3, 7).shift(-3) == Range(0, 4) and Range(0, 4).shift(5).size == 4


def _bucket(sizes: tuple[int, ...], world: int, rank: int) -> tuple[Bucket, list[nn.Parameter]]:
    params = [nn.Parameter(torch.arange(n, dtype=torch.float32) + 100 * i) for i, n in enumerate(sizes)]
    padded = round_up(sum(sizes), world)
    data = torch.zeros(padded)
    slots, offset = [], 0
    for index, param in enumerate(params):
        slot = ParamSlot(param, f"p{index}", index, Range(offset, offset + param.numel()))
        slot.bucket_range.slice(data).copy_(param.detach())
        slots.append(slot)
        offset += param.numel()
    bucket = Bucket("b", data, slots, Range(0, padded // world), world, rank, keep_grad_buffer=False,
                    grad_dtype=torch.float32)
    chunk = padded // world
    bucket.set_master(rank_chunk(rank, chunk).slice(data).clone(), torch.zeros(chunk))
    return bucket, params


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
def test_every_rank_s_pieces_tile_its_chunk_and_read_back_every_parameter(world: int) -> None:
    for sizes in itertools.chain(itertools.product(range(1, 6), repeat=2), [(1,), (7,), (3, 1, 4)]):
        buckets = [_bucket(sizes, world, rank)[0] for rank in range(world)]
        chunk = buckets[0].shard_numel
        # What one all-gather of a per-element state gives: each rank's chunk, placed from its
        # pieces' offsets (state = the master itself, so the parameter must come back).
        gathered = torch.full((world * chunk,), float("nan"))
        for rank, bucket in enumerate(buckets):
            tile = bucket.tile()
            for piece in tile.pieces:
                start = piece.tile_offsets[rank] - piece.in_holder.start
                assert 0 <= start <= chunk and start + piece.holder.numel() <= chunk
                gathered[rank * chunk + start :][: piece.holder.numel()] = piece.holder
        for number, piece in enumerate(buckets[0].pieces):
            parts = [gathered[r * chunk + piece.tile_offsets[r] :][: piece.ranges[r].size] for r in range(world)]
            assert torch.equal(torch.cat(parts), piece.param.detach()), (sizes, world, number)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_take_written_takes_what_changed_and_counts_no_nan_as_a_write(dtype: torch.dtype) -> None:
    """A parameter written through .data is taken into its fp32 master where it differs from the
    master rounded to its dtype; NaNs already in both are no write (NaN != NaN made one before,
    and with it a spurious DataWriteWarning)."""
    master = torch.tensor([1.0, float("nan"), 3.000001, 4.0])
    written = master.to(dtype, copy=True)
    assert not take_written(master, written)
    assert master[2].item() == pytest.approx(3.000001, abs=1e-7)  # unchanged: the extra precision stays
    written[3] = 8.0
    assert take_written(master, written)
    assert master[3].item() == 8.0 and master[0].item() == 1.0 and master[1].isnan()
    written[1] = 2.0  # a NaN overwritten is a write
    assert take_written(master, written) and master[1].item() == 2.0
