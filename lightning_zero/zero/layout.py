"""Which index space a shard lives in: ranges, slots, pieces and the dtypes they are held in.

Every layout (the flat buckets of stages 1/2, the units of stage 3) describes its shards with
the types here, so that the optimizer's state, the checkpoints and the consolidation are written
once, over :class:`ParamPiece` and :class:`ShardTile`, whatever the layout.

Index spaces are named where a :class:`Range` is held: "bucket" offsets are within a bucket's
flat data, "shard" offsets within a rank's master shard, "param" offsets within the flattened
parameter, "tile" offsets within the run of a rank's master one all-gather moves.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class Range:
    """A half-open interval [start, end) of elements in one index space."""

    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start

    def slice(self, flat: Tensor) -> Tensor:
        return flat[self.start : self.end]

    def shift(self, offset: int) -> Range:
        """The same elements in an index space whose origin is ``-offset`` from this one's."""
        return Range(self.start + offset, self.end + offset)

    def intersect(self, other: Range) -> Range:
        """The elements of ``self`` that are also in ``other``. An empty result sits at the edge of
        ``self`` nearest to ``other`` (never outside ``self``), so that its offsets stay valid in
        ``self``'s index space."""
        start = min(max(self.start, other.start), self.end)
        return Range(start, max(min(self.end, other.end), start))


def rank_chunk(rank: int, chunk_numel: int) -> Range:
    """Rank ``rank``'s chunk of a rank-major tensor of equal chunks."""
    return Range(rank * chunk_numel, (rank + 1) * chunk_numel)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class ParamPiece:
    """This rank's part of one parameter's master (and optimizer state), and every rank's part.

    Indices of ``ranges`` are in the flattened parameter; a sharded checkpoint saves each rank's
    range as boxes of the parameter's true shape (see [Note: checkpoint layout] in
    lightning_zero/checkpoint/sharded.py).
    """

    param: nn.Parameter
    name: str
    ranges: tuple[Range, ...]  # rank r holds ranges[r] of the flattened parameter (maybe empty)
    holder: Tensor  # the 1-d master tensor the wrapped optimizer steps and keys its state by
    in_holder: Range  # where this rank's range lies inside ``holder`` and its per-element state
    param_shape: tuple[int, ...] | None = None  # when ``param`` does not show its true shape (stage 3)
    # Where each rank's part starts inside that rank's tile (see ShardTile); rank r's holder
    # starts ``in_holder.start`` elements before it.
    tile_offsets: tuple[int, ...] = ()

    @property
    def master(self) -> Tensor:
        return self.in_holder.slice(self.holder)

    @property
    def shape(self) -> tuple[int, ...]:
        """The parameter's true shape."""
        return tuple(self.param.shape) if self.param_shape is None else self.param_shape

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ShardTile:
    """A run of ``numel`` elements of the master shard that every rank holds at the same size (a
    bucket's chunk, a unit's shard): one all-gather of a per-element state over it gives every
    rank's parts of its ``pieces``, which lie in it at their ``tile_offsets``."""

    numel: int
    pieces: tuple[ParamPiece, ...]


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives inside its bucket."""

    param: nn.Parameter
    name: str
    index: int  # position among all parameters of the owning optimizer
    bucket_range: Range


def master_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a parameter's master, gradient reduction and optimizer state: fp32, or the
    parameter's own dtype when it is wider (float64 must not be rounded through fp32)."""
    return torch.promote_types(param_dtype, torch.float32)


def reduce_dtype_for(dtype: torch.dtype, reduce_dtype: torch.dtype) -> torch.dtype:
    """What gradients of ``dtype`` parameters are accumulated and reduced in: the configured
    ``reduce_dtype``, except for parameters wider than fp32, which keep their own (see master_dtype)."""
    wide = master_dtype(dtype)
    return wide if wide != torch.float32 else reduce_dtype


def held_dtype(dtype: torch.dtype, param_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a parameter is held in: the precision's ``param_dtype``, except for parameters
    wider than 32 bits, which keep theirs (a float64 scale stays float64 under bf16-mixed)."""
    return dtype if param_dtype is None or dtype.itemsize > 4 else param_dtype


@torch.no_grad()
def take_written(master: Tensor, written: Tensor) -> bool:
    """``master`` takes ``written``'s values where they differ from the master rounded to their
    dtype: a parameter user code wrote into. Where the value is unchanged the master keeps its
    extra precision (a bf16 parameter written with its own value loses nothing). A NaN where the
    master holds one too is no write. Returns whether anything differed."""
    if written.dtype == master.dtype and written.device == master.device:
        if torch.equal(written, master):  # one pass, no temporaries: the common case
            return False
        rounded = master
    else:
        rounded = master.to(written.device, written.dtype)
    changed = written != rounded
    if not bool(changed.any()):
        return False
    # NaN != NaN: a parameter that already held a NaN would look written at every comparison.
    changed &= ~(written.isnan() & rounded.isnan())
    if not bool(changed.any()):
        return False
    master.copy_(torch.where(changed.to(master.device), written.to(master.device, master.dtype), master))
    return True


# [Note: writes through .data]
# A write through ``.data`` (``p.data.clamp_(-c, c)``: WGAN weight clipping as its paper's code
# does it) bumps no version counter, so nothing says that it happened; the step then publishes
# the masters over it and the write is lost (DeepSpeed loses it too). Finding it means comparing
# every parameter with its master, which costs about as much as the Adam step itself (3.3 ms
# for 3.7M fp32 elements here, against 3.0 ms for torch's fused AdamW). So each optimizer's
# layout compares before its first two steps and every ``EVERY``-th one: the second step's
# comparison finds writes made after the first step. The first comparison that finds one
# warns once, saying how to write for free (under ``torch.no_grad()``, which bumps the version
# counter), and from then on every step compares, so nothing more is lost. At stage 3 the units
# held through training_step (the root) are compared again when they are released after a
# step that compared, because their whole buffer is freed then.
class DataWriteCheck:
    """When the engine compares parameters with their masters to find writes through ``.data``
    (see [Note: writes through .data]); one per engine, shared by its optimizers' layouts."""

    EVERY = 50

    def __init__(self) -> None:
        self.found = False  # a write through .data was found: every step compares from now on
        self.checking = False  # whether the latest step compared

    def due(self, steps_done: int) -> bool:
        """Whether the step after ``steps_done`` steps of one optimizer compares."""
        step = steps_done + 1
        self.checking = self.found or step <= 2 or step % self.EVERY == 0
        return self.checking

    def absorb(self, steps_done: int, absorb_writes: Callable[[bool], bool]) -> None:
        """Before the step after ``steps_done`` steps of one optimizer: ``absorb_writes(through_data)``
        (a layout's or engine's, returning whether a write through ``.data`` was found), comparing
        when the step is due."""
        if self.due(steps_done):
            self.report(absorb_writes(True))
        else:
            absorb_writes(False)

    def report(self, found: bool) -> None:
        if found and not self.found:
            self.found = True
            warnings.warn(DataWriteWarning(
                "Values were written into parameters through `.data` (e.g. `p.data.clamp_(-c, c)`)."
                " ZeRO steps master copies of the parameters and publishes them over the parameters, so it finds such"
                " a write only by comparing the two, which costs about as much as the optimizer step: it compared"
                f" at the first two steps and every {self.EVERY}th, and now compares at every step, so no more such"
                " writes are lost (those made before an earlier step that did not compare were). Write under"
                " torch.no_grad()"
                " instead, which costs nothing: `with torch.no_grad(): p.clamp_(-c, c)`."
            ), stacklevel=2)


class DataWriteWarning(UserWarning):
    """Writes through ``.data`` into parameters were found (see [Note: writes through .data])."""


__all__ = [
    "DataWriteCheck",
    "DataWriteWarning",
    "ParamPiece",
    "ParamSlot",
    "Range",
    "ShardTile",
    "held_dtype",
    "master_dtype",
    "rank_chunk",
    "reduce_dtype_for",
    "round_up",
    "take_written",
]
