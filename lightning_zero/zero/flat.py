"""Stages 1 and 2: flat parameter buffers, their buckets, and the engine that owns them.

[Note: sharding layout]
The parameters of one optimizer param group and one dtype are packed, in reverse registration
order (roughly the order backward produces their gradients), into buckets of about
``ZeroConfig.bucket_size_for`` elements (``reduce_bucket_size``, or a size from the model: see
[Note: bucket size] in config.py). Each bucket is padded to a multiple of the world size N and
split into N equal chunks: rank r owns chunk r of every bucket. A rank's master shard is the
concatenation of its chunks (one tensor per bucket, ~Psi/N elements in all), and one
reduce-scatter (gradients) or all-gather (parameters) per bucket moves exactly that bucket's
data. Index spaces are named by :class:`~lightning_zero.zero.layout.Range` users: "bucket"
offsets are within a bucket's flat data, "shard" offsets are within the rank's master shard.

Masters are fp32, or the parameters' own dtype where it is wider (float64): a float64 parameter
is reduced, stored and stepped in float64, as DDP does (see :func:`master_dtype`).

Each bucket's master chunk is cut into one view per parameter, its :class:`ParamPiece` (the
last one also covers the chunk's padding, so the views tile the chunk): the wrapped optimizer
steps and keys its state by these views, so it keeps per-parameter state as torch.optim does
(see [Note: parameters without a gradient] in optimizer.py).

[Note: gradient flow]
A post-accumulate-grad hook on every parameter adds the new gradient into its bucket's local
buffer and frees ``param.grad``. When gradients are synchronized (not inside ``no_sync()``), a
bucket whose parameters have all reported starts its reduce-scatter at once, overlapping the rest
of backward (see [Note: one launch order] in reduce.py). ``finish_grad_sync`` launches whatever
backward left, waits for all of them and leaves the averaged gradient in each rank's fp32
master-gradient shard.

[Note: writes to parameters at stages 1/2]
The parameters are whole, but the step updates the fp32 master chunks and publishes them over
the parameters, so a value user code wrote into a parameter between steps (weight clipping,
Lightning's weight-averaging callbacks) would be lost. An in-place write through the parameter
bumps its version counter: before a step the written parameters' chunks go into the masters.
Writes through ``.data`` bypass the counter; before a save and at teardown the masters are also
compared with the parameters (where they differ, the parameter was written).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import increment_version
from torch.optim import Optimizer

from lightning_zero.config import ZeroConfig
from lightning_zero.offload import CPU, CPUOffloadPolicy, MasterPlacement
from lightning_zero.offload.step import StagingBuffers
from lightning_zero.zero.comm import Collectives, CountingCollectives, Handle
from lightning_zero.zero.consistency import agree_on_backward
from lightning_zero.zero.device_step import adam_group_is_fusable, check_device_backend, device_adam_backend
from lightning_zero.zero.layout import (
    DataWriteCheck,
    ParamPiece,
    ParamSlot,
    Range,
    ShardTile,
    held_dtype,
    master_dtype,
    rank_chunk,
    reduce_dtype_for,
    round_up,
    take_written,
)
from lightning_zero.zero.reduce import GradState, LaunchQueue, ReduceSchedule, Reduction


class Bucket:
    """A contiguous run of parameters reduced and gathered as one unit.

    ``param_data`` [padded_numel] is a view into the flat parameter buffer; every parameter of the
    bucket is a view into it. Its local gradient lives in ``reduction`` [padded_numel], which
    exists only while gradients are accumulated: stage 1 keeps it for the whole run, stage 2 frees
    it once reduced.
    """

    def __init__(
        self,
        name: str,
        param_data: Tensor,
        slots: list[ParamSlot],
        shard_range: Range,
        world_size: int,
        rank: int,
        keep_grad_buffer: bool,
        grad_dtype: torch.dtype,
    ) -> None:
        self.param_data = param_data
        self.slots = slots
        self.shard_range = shard_range
        self.world_size = world_size
        self.rank = rank
        self.reduction = Reduction(
            name, param_data.numel() // world_size, world_size, rank, grad_dtype, param_data.device,
            keep_buffer=keep_grad_buffer, expected_grads=0,
        )
        # This rank's master chunk [shard_numel] (fp32 or wider) and its gradient; on the CPU
        # under offload. Never rebound after set_master: the pieces are views into them.
        self.master = torch.empty(0)
        self.master_grad = torch.empty(0)
        self.pieces: list[ParamPiece] = []  # pieces[i]: slots[i]'s part of the master, on this rank
        self._part_of: dict[int, int] = {}  # a slot's index -> its part of the reduction (set_master)
        # Under offload with bf16/fp16 parameters: the CPU step writes the rounded chunk here
        # (pinned), and it is copied to the device from here.
        self.staging: Tensor | None = None

    @property
    def padded_numel(self) -> int:
        return self.param_data.numel()

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    @property
    def grad_data(self) -> Tensor | None:
        """The local gradient [padded_numel] while one exists."""
        return self.reduction.grad

    @property
    def state(self) -> GradState:
        return self.reduction.state

    def owned_chunk(self, flat: Tensor) -> Tensor:
        """This rank's chunk of a bucket-sized tensor."""
        return rank_chunk(self.rank, self.shard_numel).slice(flat)

    def set_master(self, master: Tensor, master_grad: Tensor) -> None:
        """Takes this rank's master chunk and its gradient, and cuts both into one view per slot.

        A slot with no element in this chunk gets an empty view: the wrapped optimizer still
        steps it (nothing to compute) so that every rank keeps the same per-parameter scalars,
        e.g. Adam's step count, which a checkpoint saves from rank 0.
        """
        self.master, self.master_grad = master, master_grad
        self.reduction.master_grad = master_grad
        self.reduction.expected_grads = len(self.slots)
        self.reduction.set_parts([slot.bucket_range for slot in self.slots])
        self._part_of = {slot.index: number for number, slot in enumerate(self.slots)}
        chunk = self.shard_numel
        self.pieces = []
        for number, slot in enumerate(self.slots):
            # rank r's chunk of the bucket, intersected with this parameter, in its own index space
            in_chunks = [slot.bucket_range.intersect(rank_chunk(r, chunk)) for r in range(self.world_size)]
            ranges = tuple(part.shift(-slot.bucket_range.start) for part in in_chunks)
            # where rank r's holder starts in its chunk (its part starts there too when it has one)
            offsets = tuple(min(max(part.start - r * chunk, 0), chunk) for r, part in enumerate(in_chunks))
            # The holders tile the chunk: the last slot's also covers the padding, stepped as before.
            mine = Range(0, chunk).intersect(slot.bucket_range.shift(-self.rank * chunk))
            holder = master[mine.start : chunk if number == len(self.slots) - 1 else mine.end]
            holder.grad = master_grad[mine.start : holder.numel() + mine.start]
            self.pieces.append(ParamPiece(slot.param, slot.name, ranges, holder, Range(0, ranges[self.rank].size),
                                          tile_offsets=offsets))

    def tile(self) -> ShardTile:
        return ShardTile(self.shard_numel, tuple(self.pieces))

    def accumulate(self, slot: ParamSlot, grad: Tensor) -> None:
        self.reduction.add_to_part(self._part_of[slot.index], grad.reshape(-1))


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
        stage_on_device: bool = False,
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
                f"bucket of {members[0][1]}", param_data, [], Range(shard_start, shard_start + padded // world_size),
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
            # The fused steps, fp32 masters only, write the low-precision copy: the C++ CPU step
            # into pinned CPU staging (see [Note: offloaded step] in offload/step.py), the device
            # step into a device chunk the all-gather sends as it is (see [Note: fused device
            # step] in zero/device_step.py). With the parameters on the CPU themselves, either
            # step writes straight into this rank's chunk of them, which the all-gather then sends
            # as it is: no staging buffer, and no copy into the gathered output.
            fused_out = self.master_dtype == torch.float32 and dtype != torch.float32
            offload_step = offload is not None and master_device.type == "cpu"
            device_step = stage_on_device and master_device == device
            if fused_out and device.type == "cpu" and (offload_step or device_step):
                bucket.staging = bucket.owned_chunk(param_data)
            elif fused_out and offload_step:
                bucket.staging = placement.zeros(bucket.shard_numel, CPU, dtype)
            elif fused_out and device_step:
                bucket.staging = torch.zeros(bucket.shard_numel, dtype=dtype, device=device)
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
        self, collectives: Collectives | CountingCollectives, staged: Callable[[Bucket], bool] = lambda _: False
    ) -> list[Handle]:
        """Publishes the updated master shard: every bucket's chunks are gathered to every rank.

        ``staged(bucket)``: whether the CPU step already wrote the bucket's low-precision copy.
        """
        return [self.start_bucket_gather(bucket, collectives, staged(bucket)) for bucket in self.buckets]

    @torch.no_grad()
    def start_bucket_gather(self, bucket: Bucket, collectives: Collectives | CountingCollectives, staged: bool) -> Handle:
        """Starts gathering one bucket's updated chunks into its parameters."""
        with torch.profiler.record_function("zero::all_gather"):
            # On the parameters' device the master (or staging) chunk is handed over as it is:
            # Collectives.all_gather writes it into this rank's chunk of the parameters, cast, and
            # sends it from there, or casts a copy where the collective needs one (before, every
            # chunk was first copied here, then again into the parameters). Nothing writes the
            # masters before the gather is waited for.
            source = bucket.staging if bucket.staging is not None and staged else bucket.master
            if source.device == bucket.param_data.device:
                chunk = source
            else:
                # Pinned staging in the parameters' dtype crosses without the host waiting; the
                # gather runs behind the copy on the same stream (the caller records the upload).
                chunk = source.to(device=bucket.param_data.device, dtype=self.dtype, copy=True,
                                  non_blocking=source is bucket.staging and source.is_pinned())
            return collectives.all_gather(bucket.param_data, chunk)


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
            layout.append((members, round_up(numel, world_size)))
            members, numel = [], 0
    if members:
        layout.append((members, round_up(numel, world_size)))
    return layout


class FlatLayout:
    """One optimizer's parameters at stages 1/2: flat buffers per (param group, dtype), their
    buckets, the reduce schedule over them, and the staging buffers of the CPU step.

    It is what :class:`~lightning_zero.zero.optimizer.ShardedOptimizer` steps over (the
    ``ShardLayout`` of optimizer.py). Its schedule launches in the order of the engine's
    :class:`LaunchQueue`, shared with the layouts of the engine's other optimizers.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        names: dict[nn.Parameter, str],
        collectives: Collectives | CountingCollectives,
        config: ZeroConfig,
        param_dtype: torch.dtype | None,
    ) -> None:
        self.collectives = collectives
        self.config = config
        self.buffers: list[list[FlatParamBuffer]] = []  # [param group][dtype]
        self.slot_of: dict[nn.Parameter, tuple[Bucket, ParamSlot]] = {}
        # The optimizer's parameters left out because they were frozen (see [Note: the trainable set]).
        self.frozen_at_setup: dict[nn.Parameter, str] = {}
        self.on_grad: Callable[[int], None] = lambda index: None  # the optimizer's "got a gradient"
        self._names = names
        self.built_dtypes: dict[nn.Parameter, torch.dtype] = {}  # what each was built in, before it is held
        self._init_buffers(optimizer, names, param_dtype)
        self.schedule = ReduceSchedule([bucket.reduction for bucket in self.buckets], collectives)
        self.schedule.poll_after_launch = config.offload_optimizer is not None
        if config.stage == 2:
            self.schedule.reuse_buffers()
        self.staging = StagingBuffers()
        for bucket in self.buckets:
            if bucket.staging is not None:
                for piece in bucket.pieces:
                    start = piece.holder.storage_offset() - bucket.master.storage_offset()
                    self.staging.add(piece.holder, bucket.staging[start : start + piece.holder.numel()])
        self.comm_device = next(iter(self.slot_of), torch.zeros(0)).device
        self._seen_versions: dict[nn.Parameter, int] = {}
        self.forget_writes()
        self.data_writes = DataWriteCheck()  # the engine's, shared by its layouts, once it adds this one
        self._steps = 0  # steps taken, for data_writes

    def _init_buffers(self, optimizer: Optimizer, names: dict[nn.Parameter, str], param_dtype: torch.dtype | None) -> None:
        device = next(iter(names), torch.zeros(0)).device
        if self.config.offload_optimizer is None and type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
            check_device_backend(self.config, device)
        index = 0
        seen: set[nn.Parameter] = set()
        # One size for every param group of the optimizer, from all of its trainable elements (see
        # [Note: bucket size] in config.py).
        trainable = {p for group in optimizer.param_groups for p in group["params"] if p.requires_grad}
        bucket_size = self.config.bucket_size_for(sum(p.numel() for p in trainable), self.collectives.backend)
        for group_idx, group in enumerate(optimizer.param_groups):
            by_dtype: dict[torch.dtype, list[tuple[int, str, nn.Parameter]]] = {}
            for param in group["params"]:
                if param in seen:
                    raise ValueError(
                        f"The parameter {names.get(param, '')!r} of shape {tuple(param.shape)} appears twice in the"
                        f" param groups of {type(optimizer).__name__}; list each parameter once."
                    )
                seen.add(param)
                if param not in names:
                    raise ValueError(
                        f"Param group {group_idx} of {type(optimizer).__name__} holds a parameter of shape"
                        f" {tuple(param.shape)} that is not a parameter of the LightningModule; ZeRO can only shard"
                        " the module's own parameters. Build the optimizer from self.parameters()."
                    )
                if not param.requires_grad:
                    self.frozen_at_setup[param] = names[param]
                    continue  # torch.optim skips parameters without gradients; so does ZeRO.
                by_dtype.setdefault(param.dtype, []).append((index, names[param], param))
                self.built_dtypes[param] = param.dtype
                index += 1
            fused_device = adam_group_is_fusable(optimizer, group) and device_adam_backend(self.config, device) is not None
            group_buffers = [
                FlatParamBuffer(
                    entries,
                    bucket_size=bucket_size,
                    world_size=self.collectives.world_size,
                    rank=self.collectives.rank,
                    keep_grad_buffers=self.config.stage == 1,
                    device=device,
                    param_dtype=held_dtype(dtype, param_dtype),
                    grad_dtype=reduce_dtype_for(dtype, self.config.reduce_torch_dtype),
                    offload=self.config.offload_optimizer,
                    stage_on_device=fused_device,
                )
                for dtype, entries in by_dtype.items()
            ]
            for buffer in group_buffers:
                for bucket in buffer.buckets:
                    for slot in bucket.slots:
                        self.slot_of[slot.param] = (bucket, slot)
            self.buffers.append(group_buffers)

    def param_name(self, param: nn.Parameter) -> str:
        """The module's name for ``param`` (its shape for a tensor the module does not hold)."""
        return self._names.get(param, f"<a tensor of shape {tuple(param.shape)}>")

    # ------------------------------------------------------------------ what the optimizer steps
    @property
    def flat_buffers(self) -> Iterator[FlatParamBuffer]:
        for group_buffers in self.buffers:
            yield from group_buffers

    @property
    def buckets(self) -> Iterator[Bucket]:
        for buffer in self.flat_buffers:
            yield from buffer.buckets

    @property
    def num_trainable(self) -> int:
        return len(self.slot_of)

    @property
    def sync_pending(self) -> bool:
        return self.schedule.pending

    def master_grads(self) -> Iterator[Tensor]:
        return (bucket.master_grad for bucket in self.buckets)

    def zero_master_grads(self) -> None:
        for bucket in self.buckets:
            bucket.reduction.zero_master_grad()

    def trained_masters(self, had_grad: Tensor | None) -> list[list[Tensor]]:
        """Per param group, the master holders of the parameters flagged in ``had_grad`` (all for None)."""
        flags = None if had_grad is None else had_grad.tolist()  # one read, not one per parameter
        return [
            [
                piece.holder
                for buffer in group_buffers
                for bucket in buffer.buckets
                for slot, piece in zip(bucket.slots, bucket.pieces)
                if flags is None or flags[slot.index]
            ]
            for group_buffers in self.buffers
        ]

    def param_pieces(self) -> list[ParamPiece]:
        self.absorb_writes(through_data=True)  # a checkpoint reads the masters
        return [piece for bucket in self.buckets for piece in bucket.pieces]

    def tiles(self) -> list[ShardTile]:
        return [bucket.tile() for bucket in self.buckets]

    def memory_tensors(self) -> tuple[list[Tensor], list[Tensor | None], list[Tensor]]:
        grads: list[Tensor | None] = [bucket.master_grad for bucket in self.buckets]
        grads += [bucket.grad_data for bucket in self.buckets]
        return [], grads, [bucket.master for bucket in self.buckets]

    # ------------------------------------------------------------------ gradients
    @torch.no_grad()
    def on_grad_ready(self, param: nn.Parameter) -> None:
        if param.grad is None:
            return
        self.schedule.enter_backward()
        bucket, slot = self.slot_of[param]
        bucket.accumulate(slot, param.grad)
        param.grad = None
        self.on_grad(slot.index)
        self.schedule.arrived(bucket.reduction)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.schedule.no_sync():
            yield

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        with torch.profiler.record_function("zero::finish_grad_sync"):
            self.schedule.finish()

    def drop_local_grads(self) -> None:
        self.schedule.drop()
        for param in self.slot_of:
            param.grad = None

    # ------------------------------------------------------------------ parameters
    def publish(self) -> None:
        """The updated masters become the parameters on every rank (a collective)."""
        handles = [
            handle
            for buffer in self.flat_buffers
            for handle in buffer.start_all_gather(
                self.collectives, staged=lambda bucket: self.staging.wrote_all(p.holder for p in bucket.pieces)
            )
        ]
        self._note_uploads()
        with torch.profiler.record_function("zero::wait_all_gather"):
            for handle in handles:
                handle.wait()

    # ------------------------------------------------------------------ overlapped step
    @property
    def can_land_by_bucket(self) -> bool:
        """Whether the step may run bucket by bucket as reductions land (see [Note: overlapped step]
        in optimizer.py): reductions are owed, and none of them belongs to a round of its own."""
        return self.schedule.pending and not self.schedule.leftover

    def launch_reductions(self) -> bool:
        """Launches every reduction still owed (a collective); returns whether any is to land."""
        self.absorb_before_step()
        return self.schedule.launch_for_finish()

    @torch.no_grad()
    def land_step_publish(self, step_bucket: Callable[[list[Tensor]], None]) -> None:
        """As each bucket's reduction lands, in launch order, steps its master pieces
        (``step_bucket``) and starts its all-gather, while later reductions are still in flight;
        then waits for the gathers. Together with :meth:`launch_reductions` it replaces
        ``finish_grad_sync`` + step + :meth:`publish` with the same arithmetic."""
        bucket_of = {bucket.reduction: (buffer, bucket) for buffer in self.flat_buffers for bucket in buffer.buckets}
        handles = []
        with torch.profiler.record_function("zero::land_step_publish"):
            for reduction in self.schedule.land():
                buffer, bucket = bucket_of[reduction]
                step_bucket([piece.holder for piece in bucket.pieces])
                staged = self.staging.wrote_all(piece.holder for piece in bucket.pieces)
                handles.append(buffer.start_bucket_gather(bucket, self.collectives, staged))
            self._note_uploads()
            with torch.profiler.record_function("zero::wait_all_gather"):
                for handle in handles:
                    handle.wait()

    def _note_uploads(self) -> None:
        """Pinned staging was uploaded to a CUDA device without waiting: the next step waits first."""
        if self.comm_device.type == "cuda" and any(
                bucket.staging is not None and bucket.staging.is_pinned() for bucket in self.buckets):
            self.staging.uploading(self.comm_device)

    def publish_masters(self) -> None:
        """After the masters were written (a load): the parameters take their values (a collective)."""
        self.staging.forget()
        with torch.no_grad():
            self.publish()

    def forget_writes(self) -> None:
        self._seen_versions = {param: param._version for param in self.slot_of}

    def absorb_before_step(self) -> None:
        """Before a step reads the masters: writes through the parameters, and at the steps
        [Note: writes through .data] in layout.py says, writes through ``.data``."""
        self.data_writes.absorb(self._steps, self.absorb_writes)

    def note_stepped(self, had_grad: Tensor) -> None:
        """See [Note: a step is an in-place write] in optimizer.py."""
        self._steps += 1
        flags = had_grad.tolist()  # one read, not one per parameter
        for param, (_, slot) in self.slot_of.items():
            if flags[slot.index]:
                increment_version(param)
                self._seen_versions[param] = param._version  # the step's write, not the user's

    @torch.no_grad()
    def absorb_writes(self, through_data: bool = False) -> bool:
        """Takes values user code wrote into the parameters into this rank's master chunks (see
        [Note: writes to parameters at stages 1/2]); with ``through_data``, compares every bucket.
        Returns whether a bucket no version counter marked was written (through ``.data``)."""
        # The flat parameter buffer holds what was written, so one comparison per bucket covers
        # every written parameter of it.
        versioned = {bucket for param, (bucket, _) in self.slot_of.items()
                     if param._version != self._seen_versions.get(param, param._version)}
        through = False
        for bucket in self.buckets:
            if bucket in versioned or through_data:
                taken = take_written(bucket.master, bucket.owned_chunk(bucket.param_data))
                through = through or taken and bucket not in versioned
        self.forget_writes()
        return through

    @torch.no_grad()
    def gather_master_values(self, keep: bool = True) -> dict[nn.Parameter, Tensor]:
        """Every parameter's whole fp32 value from the master chunks (a collective; with
        ``keep=False`` this rank only takes part and gets {})."""
        self.absorb_writes(through_data=True)
        values: dict[nn.Parameter, Tensor] = {}
        for bucket in self.buckets:
            full = torch.empty(bucket.padded_numel, dtype=bucket.master.dtype, device=self.comm_device)
            self.collectives.all_gather(full, bucket.master.to(self.comm_device)).wait()
            if keep:
                for slot in bucket.slots:
                    values[slot.param] = slot.bucket_range.slice(full).view(slot.param.shape)
        return values

    @torch.no_grad()
    def load_master_values(self, values: dict[nn.Parameter, Tensor]) -> None:
        """Sets the masters of the given parameters from their whole values (no communication:
        each rank takes its piece), e.g. from a full checkpoint."""
        rank = self.collectives.rank
        for piece in (piece for bucket in self.buckets for piece in bucket.pieces):
            value = values.get(piece.param)
            if value is not None:
                piece.master.copy_(piece.ranges[rank].slice(value.reshape(-1)))
        self.forget_writes()  # the parameters were written with these values: not a user's write


class FlatEngine:
    """The engine of stages 1 and 2: parameters stay whole on every rank; each optimizer's
    parameters get a :class:`FlatLayout` of flat buffers, and the engine owns the gradient hooks
    that feed them. Implements :class:`~lightning_zero.zero.engine.ZeroEngine`."""

    stage_shards_params = False
    # Stage 3 gathers parameters in units; stages 1/2 never gather them (buckets only reduce
    # gradients and publish the masters), so code that lists an engine's units sees none.
    units: tuple[()] = ()

    def __init__(
        self,
        module: nn.Module,
        collectives: Collectives | CountingCollectives,
        config: ZeroConfig,
        param_dtype: torch.dtype | None = None,
    ) -> None:
        self.module = module
        self.collectives = collectives
        self.config = config
        self.param_dtype = param_dtype
        self.layouts: list[FlatLayout] = []
        # Every layout's reductions go out in one order (see [Note: one launch order] in reduce.py).
        self.launches = LaunchQueue(position={})
        self._hook_handles: list[Any] = []
        self.data_writes = DataWriteCheck()  # see [Note: writes through .data] in layout.py

    # ------------------------------------------------------------------ optimizers
    def add_optimizer(self, optimizer: Optimizer) -> FlatLayout:
        """Packs ``optimizer``'s parameters into flat buffers and hooks their gradients."""
        names = {param: name for name, param in self.module.named_parameters(remove_duplicate=True)}
        layout = FlatLayout(optimizer, names, self.collectives, self.config, self.param_dtype)
        layout.data_writes = self.data_writes
        for param in layout.slot_of:
            self._hook_handles.append(param.register_post_accumulate_grad_hook(layout.on_grad_ready))
        self.layouts.append(layout)
        layout.schedule.launches = self.launches
        self._order_launches()
        return layout

    def _order_launches(self) -> None:
        """Merges the layouts' launch orders into the engine's, by when backward completes each
        bucket: a bucket is complete once its parameter that comes first in the module has its
        gradient, backward reaching later modules first. Each layout keeps its own order (one
        layout's is unchanged); ties go to the layout set up first."""
        index_of = {param: index for index, param in enumerate(self.module.parameters())}
        # Per layout, in its launch order (its buckets'): (when backward completes it, its reduction)
        orders = [[(-min((index_of.get(slot.param, -1) for slot in bucket.slots), default=-1), bucket.reduction)
                   for bucket in layout.buckets] for layout in self.layouts]
        merged: list[Reduction] = []
        while any(orders):
            _, first = min((order[0][0], number) for number, order in enumerate(orders) if order)
            merged.append(orders[first].pop(0)[1])
        self.launches.position = {reduction: place for place, reduction in enumerate(merged)}

    def wrap_optimizer(self, optimizer: Optimizer, loss_scaler: Any = None) -> Any:
        from lightning_zero.zero.optimizer import ZeroOptimizer

        return ZeroOptimizer(optimizer, self.module, self.collectives, self.config, self.param_dtype,
                             loss_scaler=loss_scaler, engine=self)

    # ------------------------------------------------------------------ the step
    def hold_for_step(self) -> None:
        """Nothing to gather: the parameters are whole."""

    def release_after_step(self) -> None:
        """Nothing was gathered for the step."""

    def begin_backward(self) -> None:
        """A backward starts: one round of reductions for the buckets of every optimizer with a
        parameter that requires a gradient now (see [Note: what one backward is] in reduce.py);
        those of an optimizer Lightning toggled off (GANs) cannot get one, so they send nothing.
        A synchronized backward's reductions launch as its gradients arrive, before any other
        agreement, so with several optimizers the ranks first agree which ones' buckets it reduces
        (see [Note: ranks that disagree] in consistency.py). With one, buckets of the same sizes
        pair up whatever the ranks ran, and the step's agreement sees the difference first."""
        reducing = [index for index, layout in enumerate(self.layouts)
                    if any(param.requires_grad for param in layout.slot_of)]
        if (self.collectives.world_size > 1 and len(self.layouts) > 1
                and any(layout.schedule.sync_enabled for layout in self.layouts)):
            agree_on_backward(self.collectives, reducing)
        round_id = self.launches.new_round_id()  # one round for every layout's reductions
        for index in reducing:
            self.layouts[index].schedule.begin_backward(round_id)

    def close_backward(self) -> None:
        for layout in self.layouts:
            layout.schedule.close_backward()

    def finish_grad_sync(self) -> None:
        for layout in self.layouts:
            if layout.sync_pending:
                layout.finish_grad_sync()

    def has_leftover_grads(self) -> bool:
        return any(layout.schedule.leftover for layout in self.layouts)

    def absorb_param_grads(self) -> None:
        """Gradients a backward left in ``.grad`` without running the accumulation hook (torch's
        zero-bubble weight backward adds them itself, see [Note: pipeline stages]) join the buckets."""
        for layout in self.layouts:
            for param in layout.slot_of:
                if param.grad is not None:
                    layout.on_grad_ready(param)

    def expect_leftover_grads(self) -> None:
        for layout in self.layouts:
            layout.schedule.leftover = True

    def end_backward(self) -> None:
        """Backward leaves nothing held at stages 1/2."""

    def free_idle(self) -> None:
        """Nothing is gathered at stages 1/2."""

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for layout in self.layouts:
                stack.enter_context(layout.no_sync())
            yield

    def explain_backward_error(self, error: RuntimeError) -> str | None:
        """Whole parameters give autograd nothing the engine would need to explain."""
        return None

    # ------------------------------------------------------------------ whole parameters
    @contextlib.contextmanager
    def gathered(self, writeback: bool = True) -> Iterator[None]:
        """The parameters are whole at stages 1/2 (writes to them are kept before the next step)."""
        yield

    @contextlib.contextmanager
    def true_shapes(self) -> Iterator[None]:
        """Parameters always show their true shapes at stages 1/2."""
        yield

    def trained_params(self) -> set[nn.Parameter]:
        return {param for layout in self.layouts for param in layout.slot_of}

    def param_pieces(self) -> list[ParamPiece]:
        return [piece for layout in self.layouts for piece in layout.param_pieces()]

    def absorb_writes(self, through_data: bool = False) -> bool:
        found = False
        for layout in self.layouts:
            found = layout.absorb_writes(through_data) or found
        return found

    def publish_masters(self) -> None:
        for layout in self.layouts:
            layout.publish_masters()

    def master_values(self, keep: bool) -> dict[nn.Parameter, Tensor]:
        """Every trained parameter's master value when the parameters are held in a narrower dtype
        (a collective); {} when the parameters are their own masters' dtype."""
        if self.param_dtype is None:
            return {}
        values: dict[nn.Parameter, Tensor] = {}
        for layout in self.layouts:
            values.update(layout.gather_master_values(keep=keep))
        return values

    def full_state_dict(self, to: int = 0) -> dict[str, Any]:
        """The module's state dict with whole parameters: with bf16/fp16 parameters, their fp32
        master values, on rank ``to`` (a collective)."""
        masters = self.master_values(keep=self.collectives.rank == to)
        if not masters:
            return self.module.state_dict()
        state = self.module.state_dict(keep_vars=True)
        return {
            key: masters[value].cpu().clone() if isinstance(value, nn.Parameter) and value in masters
            else (value.detach() if isinstance(value, Tensor) else value)
            for key, value in state.items()
        }

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Loads whole values into the module and every master piece (no communication)."""
        self.module.load_state_dict(state, strict=strict)
        params = {key: value for key, value in self.module.state_dict(keep_vars=True).items()
                  if isinstance(value, nn.Parameter)}
        values = {params[key]: value for key, value in state.items() if key in params}
        for layout in self.layouts:
            layout.load_master_values(values)

    @torch.no_grad()
    def gather_to_cpu(self, from_master: bool) -> None:
        """Hands the module back: with ``from_master``, each trained parameter takes its master
        value in the dtype it was built in (a bf16/fp16-mixed model built in fp32 goes back to
        fp32, a parameter built in bf16 stays bf16, as under DDP); Lightning then moves it to the CPU."""
        if from_master:
            built = {param: dtype for layout in self.layouts for param, dtype in layout.built_dtypes.items()}
            for param, value in self.master_values(keep=True).items():
                param.data = value.to(built.get(param, value.dtype), copy=True)

    def check_parameters_unchanged(self) -> None:
        """Stages 1/2 find replaced parameters through the optimizer's param groups."""

    def remove_hooks(self) -> None:
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()


__all__ = ["Bucket", "FlatEngine", "FlatLayout", "FlatParamBuffer", "GradState", "Range"]
