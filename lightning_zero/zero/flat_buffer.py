"""Flat parameter buffers, their buckets, and the shard of each bucket a rank owns.

[Note: sharding layout]
The parameters of one optimizer param group and one dtype are packed, in reverse registration
order (roughly the order backward produces their gradients), into buckets of about
``reduce_bucket_size`` elements. Each bucket is padded to a multiple of the world size N and
split into N equal chunks: rank r owns chunk r of every bucket. A rank's master shard is the
concatenation of its chunks (one tensor per bucket, ~Psi/N elements in all), and one
reduce-scatter (gradients) or all-gather (parameters) per bucket moves exactly that bucket's
data. Index spaces are named by :class:`Range` users: "bucket" offsets are within a bucket's flat
data, "shard" offsets are within the rank's master shard.

Masters are fp32, or the parameters' own dtype where it is wider (float64): a float64 parameter
is reduced, stored and stepped in float64, as DDP does (see :func:`master_dtype`).

Each bucket's master chunk is cut into one view per parameter, its :class:`ParamPiece` (the
last one also covers the chunk's padding, so the views tile the chunk): the wrapped optimizer
steps and keys its state by these views, so it keeps per-parameter state as torch.optim does
(see [Note: parameters without a gradient] in optimizer.py).
"""

from __future__ import annotations

import math

import enum
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_zero.offload import CPUOffloadPolicy, MasterPlacement
from lightning_zero.zero.comm import Collectives, CountingCollectives, Handle


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


def master_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a parameter's master, gradient reduction and optimizer state: fp32, or the
    parameter's own dtype when it is wider (float64 must not be rounded through fp32)."""
    return torch.promote_types(param_dtype, torch.float32)


def reduce_dtype_for(dtype: torch.dtype, reduce_dtype: torch.dtype) -> torch.dtype:
    """What gradients of ``dtype`` parameters are accumulated and reduced in: the configured
    ``reduce_dtype``, except for parameters wider than fp32, which keep their own (see master_dtype)."""
    wide = master_dtype(dtype)
    return wide if wide != torch.float32 else reduce_dtype


@torch.no_grad()
def take_written(master: Tensor, written: Tensor) -> None:
    """``master`` takes ``written``'s values where they differ from the master rounded to their
    dtype: a parameter user code wrote into. Where the value is unchanged the master keeps its
    extra precision (a bf16 parameter written with its own value loses nothing)."""
    rounded = master.to(written.device, written.dtype)
    changed = written != rounded
    if bool(changed.any()):
        master.copy_(torch.where(changed.to(master.device), written.to(master.device, master.dtype), master))


def held_dtype(dtype: torch.dtype, param_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a parameter is held in: the precision's ``param_dtype``, except for parameters
    wider than 32 bits, which keep theirs (a float64 scale stays float64 under bf16-mixed)."""
    return dtype if param_dtype is None or dtype.itemsize > 4 else param_dtype


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives inside its bucket."""

    param: nn.Parameter
    name: str
    index: int  # position among all parameters of the owning ZeroOptimizer
    bucket_range: Range


class GradState(enum.Enum):
    """Lifecycle of a bucket's local gradient between two reductions."""

    CLEAN = "no local gradient since the last reduction or zero_grad"
    ACCUMULATING = "local gradients present that no reduction has consumed yet"
    REDUCING = "a reduce-scatter of this bucket is in flight"


class Bucket:
    """A contiguous run of parameters reduced and gathered as one unit.

    ``param_data`` [padded_numel] is a view into the flat parameter buffer; every parameter of the
    bucket is a view into it. The local gradient ``grad_data`` [padded_numel] exists only while
    gradients are accumulated: stage 1 keeps it for the whole run, stage 2 frees it once reduced.
    """

    def __init__(
        self,
        param_data: Tensor,
        slots: list[ParamSlot],
        shard_range: Range,
        world_size: int,
        rank: int,
        keep_grad_buffer: bool,
        grad_dtype: torch.dtype,
    ) -> None:
        self.param_data = param_data
        self.grad_dtype = grad_dtype
        self.slots = slots
        self.shard_range = shard_range
        self.world_size = world_size
        self.rank = rank
        self.keep_grad_buffer = keep_grad_buffer
        self.grad_data: Tensor | None = None
        # This rank's master chunk [shard_numel] (fp32 or wider) and its gradient; on the CPU
        # under offload. Never rebound after set_master: the pieces are views into them.
        self.master = torch.empty(0)
        self.master_grad = torch.empty(0)
        self.pieces: list[ParamPiece] = []  # pieces[i]: slots[i]'s part of the master, on this rank
        # Under offload with bf16/fp16 parameters: the CPU step writes the rounded chunk here
        # (pinned), and it is copied to the device from here.
        self.staging: Tensor | None = None
        self.state = GradState.CLEAN
        self._ready = 0
        self.ready_to_reduce = False
        self._reduce_output: Tensor | None = None
        self._handle: Handle | None = None

    @property
    def padded_numel(self) -> int:
        return self.param_data.numel()

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def owned_chunk(self, flat: Tensor) -> Tensor:
        """This rank's chunk of a bucket-sized tensor."""
        return flat[self.rank * self.shard_numel : (self.rank + 1) * self.shard_numel]

    def set_master(self, master: Tensor, master_grad: Tensor) -> None:
        """Takes this rank's master chunk and its gradient, and cuts both into one view per slot.

        A slot with no element in this chunk gets an empty view: the wrapped optimizer still
        steps it (nothing to compute) so that every rank keeps the same per-parameter scalars,
        e.g. Adam's step count, which a checkpoint saves from rank 0.
        """
        self.master, self.master_grad = master, master_grad
        chunk = self.shard_numel
        chunk_start = self.rank * chunk
        self.pieces = []
        for number, slot in enumerate(self.slots):
            start, end = slot.bucket_range.start, slot.bucket_range.end
            # rank r's chunk of the bucket, intersected with this parameter, in its own index space
            ranges = tuple(
                Range(min(max(r * chunk, start), end) - start, max(min((r + 1) * chunk, end), start) - start)
                for r in range(self.world_size)
            )
            # The holders tile the chunk: the last slot's also covers the padding, stepped as before.
            first = min(max(start - chunk_start, 0), chunk)
            stop = chunk if number == len(self.slots) - 1 else min(max(end - chunk_start, 0), chunk)
            holder = master[first:stop]
            holder.grad = master_grad[first:stop]
            self.pieces.append(ParamPiece(slot.param, slot.name, ranges, holder, Range(0, ranges[self.rank].size)))

    def accumulate(self, slot: ParamSlot, grad: Tensor) -> None:
        if self.state is GradState.REDUCING:
            # The previous micro-step's reduction (reduce_every_micro_step) must land in the master
            # gradient before this buffer takes new gradients.
            self.finish_reduce()
        if self.grad_data is None:
            self.grad_data = torch.zeros(self.padded_numel, dtype=self.grad_dtype, device=self.param_data.device)
        slot.bucket_range.slice(self.grad_data).add_(grad.reshape(-1))
        self.state = GradState.ACCUMULATING

    def forget_ready(self) -> None:
        """A new backward starts counting afresh (a parameter may have had no gradient last time)."""
        self._ready = 0

    def mark_ready(self) -> bool:
        """Counts one more parameter gradient of this backward; True once all have arrived."""
        self._ready += 1
        return self._ready == len(self.slots)

    def start_reduce(self, collectives: Collectives | CountingCollectives) -> None:
        """Launches this bucket's reduce-scatter; a bucket with no local gradient sends zeros,
        since another rank may have one."""
        if self.state is GradState.REDUCING:
            raise RuntimeError("cannot reduce a bucket that is already being reduced")
        if self.grad_data is None:
            self.grad_data = torch.zeros(self.padded_numel, dtype=self.grad_dtype, device=self.param_data.device)
        # Averaging before the sum keeps fp16/bf16 sums in range, as DDP does.
        self.grad_data.div_(self.world_size)
        self._reduce_output = torch.empty(self.shard_numel, dtype=self.grad_data.dtype, device=self.grad_data.device)
        with torch.profiler.record_function("zero::reduce_scatter"):
            self._handle = collectives.reduce_scatter(self._reduce_output, self.grad_data)
        self.state = GradState.REDUCING
        self._ready = 0

    def finish_reduce(self) -> None:
        """Waits for the reduce-scatter and adds this rank's chunk into the master gradient shard."""
        if self.state is not GradState.REDUCING:
            return
        assert self._handle is not None and self._reduce_output is not None
        with torch.profiler.record_function("zero::wait_reduce_scatter"):
            self._handle.wait()
        # Upcasts a bf16/fp16 reduction to fp32; under offload this is the copy to the CPU.
        self.master_grad.add_(self._reduce_output.to(self.master_grad.device))
        self._reduce_output = None
        self._handle = None
        self._release_grad()

    def poll(self) -> None:
        """Finishes the reduction if it already completed: under offload the gradient then moves to
        the CPU while backward goes on."""
        if self.state is GradState.REDUCING and self._handle is not None and self._handle.is_completed():
            self.finish_reduce()

    def reset(self) -> None:
        """Drops every local gradient, waiting for any collective still using the buffer."""
        if self._handle is not None:
            self._handle.wait()
        self._handle = None
        self._reduce_output = None
        self._ready = 0
        self.ready_to_reduce = False
        self._release_grad()

    def _release_grad(self) -> None:
        if self.keep_grad_buffer and self.grad_data is not None:
            self.grad_data.zero_()
        else:
            self.grad_data = None
        self.state = GradState.CLEAN


class FlatParamBuffer:
    """The parameters of one param group and one dtype, flattened into buckets.

    Owns the full flat parameter data [sum of padded bucket sizes] in ``param_dtype`` (every rank
    holds all of it at stages 1 and 2); each bucket owns this rank's master chunk with its
    gradient (on the CPU for the share an offload policy sends there), in
    ``master_dtype(parameters' dtype)``. The master is taken from the parameters' values before
    any cast to ``param_dtype``, so casting a model to bf16/fp16 loses nothing of the weights it
    started from.
    """

    def __init__(
        self,
        named_params: list[tuple[int, str, nn.Parameter]],
        bucket_size: int,
        world_size: int,
        rank: int,
        keep_grad_buffers: bool,
        device: torch.device,
        param_dtype: torch.dtype | None = None,
        grad_dtype: torch.dtype = torch.float32,
        offload: CPUOffloadPolicy | None = None,
    ) -> None:
        dtype = param_dtype or named_params[0][2].dtype
        self.master_dtype = master_dtype(named_params[0][2].dtype)
        layout = _plan_buckets(named_params, bucket_size, world_size)
        total = sum(padded for _, padded in layout)
        self.dtype = dtype
        self.data = torch.zeros(total, dtype=dtype, device=device)
        placement = MasterPlacement(offload, device, total // world_size)
        self.buckets: list[Bucket] = []
        self.slots: list[ParamSlot] = []
        bucket_start = 0
        for members, padded in layout:
            param_data = self.data[bucket_start : bucket_start + padded]
            shard_start = bucket_start // world_size
            bucket = Bucket(
                param_data, [], Range(shard_start, shard_start + padded // world_size),
                world_size, rank, keep_grad_buffers, grad_dtype,
            )
            # The bucket's values in full precision, one bucket at a time: the master shard is
            # taken from them rather than from the (possibly bf16/fp16) flat parameters.
            values = torch.zeros(padded, dtype=self.master_dtype, device=device)
            offset = 0
            for index, name, param in members:
                slot = ParamSlot(param, name, index, Range(offset, offset + param.numel()))
                slot.bucket_range.slice(values).copy_(param.detach().reshape(-1))
                bucket.slots.append(slot)
                offset += param.numel()
            param_data.copy_(values)
            master_device = placement.place(bucket.shard_numel)
            master = placement.zeros(bucket.shard_numel, master_device, self.master_dtype)
            master.copy_(bucket.owned_chunk(values))
            bucket.set_master(master, placement.zeros(bucket.shard_numel, master_device, self.master_dtype))
            # Only the C++ CPU step, fp32 masters only, writes a low-precision copy (_fused_cpu_masters).
            fused_out = self.master_dtype == torch.float32 and dtype != torch.float32
            if offload is not None and master_device.type == "cpu" and fused_out:
                bucket.staging = placement.zeros(bucket.shard_numel, torch.device("cpu"), dtype)
            self.buckets.append(bucket)
            self.slots.extend(bucket.slots)
            bucket_start += padded
        # Parameters become views into the flat buffer only after every value was copied, so that
        # no copy reads a parameter that an earlier rebinding already moved.
        for bucket in self.buckets:
            for slot in bucket.slots:
                slot.param.data = slot.bucket_range.slice(bucket.param_data).view_as(slot.param)

    @property
    def numel(self) -> int:
        return sum(slot.bucket_range.size for slot in self.slots)

    def start_all_gather(
        self, collectives: Collectives | CountingCollectives, staged: set[int] | None = None
    ) -> list[Handle]:
        """Publishes the updated master shard: every bucket's chunks are gathered to every rank.

        ``staged``: ids of masters whose CPU step already wrote the low-precision copy to staging.
        """
        handles = []
        with torch.no_grad(), torch.profiler.record_function("zero::all_gather"):
            for bucket in self.buckets:
                # A separate input tensor: gloo does not promise in-place gathers.
                use_staging = bucket.staging is not None and staged is not None and id(bucket.master) in staged
                source = bucket.staging if use_staging else bucket.master
                chunk = source.to(device=bucket.param_data.device, dtype=self.dtype, copy=True)
                handles.append(collectives.all_gather(bucket.param_data, chunk))
        return handles


def _plan_buckets(
    named_params: list[tuple[int, str, nn.Parameter]], bucket_size: int, world_size: int
) -> list[tuple[list[tuple[int, str, nn.Parameter]], int]]:
    """Groups parameters (reverse order) into buckets of >= bucket_size elements, padded to N."""
    layout: list[tuple[list[tuple[int, str, nn.Parameter]], int]] = []
    members: list[tuple[int, str, nn.Parameter]] = []
    numel = 0
    for entry in reversed(named_params):
        members.append(entry)
        numel += entry[2].numel()
        if numel >= bucket_size:
            layout.append((members, _round_up(numel, world_size)))
            members, numel = [], 0
    if members:
        layout.append((members, _round_up(numel, world_size)))
    return layout


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
