"""ZeRO stage 3's unit of communication: a group of parameters gathered, reduced and freed together.

[Note: stage-3 layout]
Each parameter is split into N equal pieces (padded): rank r keeps piece r. A *unit* (a module
subtree, e.g. one transformer block) is the unit of communication: its rank-local shard is the
concatenation of its parameters' pieces [S], one all-gather fills a rank-major buffer [N, S] that
is copied out into the unit's full buffer [sum of padded numels], of which every parameter is a
view while the unit is gathered. Freeing resizes that buffer's storage to zero: the tensors autograd
saved stay valid, because re-gathering fills the same storage (under
``_unsafe_preserve_version_counter``, as FSDP2 does), and the parameters are re-pointed at their
pieces (see [Note: a stage-3 parameter outside its gather]).

Gradients go the other way: each parameter's gradient is added into a rank-major buffer [N, T];
when all of a unit's gradients of this backward have arrived, one reduce-scatter leaves this
rank's pieces in the unit's fp32 master-gradient shard [T].

[Note: trained pieces first]
Within a unit's shard the pieces of the parameters that train (requires_grad when the engine is
built) come first, in registration order, then the frozen ones (those the shard would round before
those it holds exactly: [Note: masters of frozen pieces]): the trained ones span the shard's
first T elements. Only those have a master gradient [T], a reduction [N, T] and (offloaded) a
staging buffer, so a unit that mixes frozen and trained parameters (a LoRA adapter beside its
frozen base weight) neither holds an fp32 gradient over its frozen weights nor reduce-scatters
their zeros every step, and a unit of frozen parameters only (T = 0) is never reduced. The full
buffer keeps registration order; checkpoints record every piece's place, so they do not depend on
the order within a shard.

[Note: masters of frozen pieces]
A frozen piece is never stepped: its master only keeps its value at the precision it was built
in, which the low-precision shard would round (an fp32 base weight under bf16-mixed). Where a
frozen parameter was built in the shard's own dtype (a base model loaded in bf16 for a
LoRA fine-tune), the shard already holds those values exactly, and the unit's master leaves them
out: 4 bytes per such frozen element and rank less. The frozen pieces are then read
from the shard wherever a master would be: ``gather_master_values`` (``full_state_dict``,
hand-back) widens them exactly, and sharded checkpoints save them as the shard holds them, in its
dtype (loading converts, either way). The rule is per piece: in the shard, after the trained
pieces, come the frozen pieces the shard would round (an fp32 norm kept beside a bf16 base, as
Hugging Face's ``_keep_in_fp32_modules`` does), then those it holds exactly, and the master spans
the first two [T + R]. The decision depends on dtypes only, so every rank makes the same one.

[Note: a stage-3 parameter outside its gather]
While its unit is gathered a parameter has its true shape and value. Otherwise it is this rank's
piece of it: a 1-d tensor of ``own_numel`` elements (the flattened parameter's elements
``[rank * shard_numel, ...)``), a view of the unit's shard, on the shard's device. It never shows
freed memory, so reading it anywhere is safe (a norm, ``deepcopy``, ``.detach().clone()``), and
elementwise code works piece by piece on every rank: Lightning's StochasticWeightAveraging and
EMAWeightAveraging average each rank's pieces, so the averaged copy is sharded like the model.
``numel()`` and ``shape`` outside a gather are the piece's (Lightning's ModelSummary counts this
rank's elements); ``gathered_params()`` gives every parameter whole.

Writes are kept, in either state: an in-place write through the parameter (``copy_``, ``lerp_``,
``mul_`` under no_grad, also on ``.detach()``) bumps its version counter, and the engine takes
the written values into the shard and the fp32 master the next time it frees the unit, steps,
saves or hands the module back (``absorb_writes``). Writes through ``.data`` bypass the counter
and reach the shard only (at fp32 without offload the shard is the master, so they are kept too).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_zero.offload import CPU
from lightning_zero.zero.comm import Collectives, CountingCollectives, Handle
from lightning_zero.zero.layout import ParamPiece, Range, ShardTile, master_dtype, rank_chunk, round_up, take_written
from lightning_zero.zero.reduce import Reduction


class UnitState(enum.Enum):
    """Whether a unit's full parameters exist on this rank."""

    SHARDED = "only this rank's shard is in memory; the full buffer has no storage"
    GATHERING = "an all-gather into the full buffer is in flight (a prefetch)"
    GATHERED = "the full parameters are materialized"


@dataclass(eq=False)  # identity: one object per parameter, usable as a key
class ShardedParam:
    """One parameter under stage 3 and where its pieces live."""

    param: nn.Parameter
    name: str
    index: int  # among all parameters of the engine
    shape: torch.Size  # the parameter's true shape (outside a gather it shows its 1-d piece)
    numel: int
    shard_numel: int  # elements of each rank's piece (padded)
    full_range: Range  # "full" index space: the padded parameter inside the unit's full buffer
    shard_range: Range  # "shard" index space: this rank's piece inside the unit's shard
    unit: ShardedUnit
    trained: bool  # requires_grad when the engine was built: its piece lies in the unit's first T elements
    built_dtype: torch.dtype = torch.float32  # the dtype it was built in (handed back in it)
    # param._version when the engine last knew the parameter's contents: a larger one means user
    # code wrote the parameter in place (see [Note: a stage-3 parameter outside its gather]).
    seen_version: int = 0
    _holder: Tensor | None = None

    @property
    def shard(self) -> Tensor:
        return self.shard_range.slice(self.unit.shard)

    @property
    def own_numel(self) -> int:
        """Elements of the parameter in this rank's piece (the padding is nobody's)."""
        return self.piece_ranges()[self.unit.rank].size

    @property
    def local_view(self) -> Tensor:
        """What the parameter shows while its unit is sharded: this rank's piece, 1-d, unpadded."""
        return self.shard[: self.own_numel]

    def piece_ranges(self) -> tuple[Range, ...]:
        """Rank r's piece in the flattened parameter (the padding past ``numel`` belongs to nobody)."""
        whole = Range(0, self.numel)
        return tuple(whole.intersect(rank_chunk(r, self.shard_numel)) for r in range(self.unit.world_size))

    def piece(self) -> ParamPiece:
        """This parameter's master piece: its ``holder`` is the master view the optimizer steps."""
        ranges = self.piece_ranges()
        return ParamPiece(self.param, self.name, ranges, self.holder, Range(0, ranges[self.unit.rank].size),
                          param_shape=tuple(self.shape), tile_offsets=(self.shard_range.start,) * len(ranges))

    @property
    def has_master(self) -> bool:
        """Whether its piece lies in the unit's master: trained pieces always, frozen ones unless the
        shard holds them exactly (see [Note: masters of frozen pieces])."""
        return self.shard_range.end <= self.unit.master_numel  # the master spans a prefix of the shard

    @property
    def master(self) -> Tensor:
        """Its master piece; for a frozen piece the shard holds exactly, the shard's piece itself
        (see [Note: masters of frozen pieces])."""
        return self.shard_range.slice(self.unit.master) if self.has_master else self.shard

    @property
    def master_grad(self) -> Tensor | None:
        """Its piece of the unit's master gradient; a frozen parameter has none (see [Note: trained
        pieces first])."""
        return self.shard_range.slice(self.unit.master_grad) if self.trained else None

    @property
    def holder(self) -> Tensor:
        """The one master view [shard_numel] the optimizer steps and keys its state by, with its
        gradient as ``.grad`` (made once: optimizer state is keyed by tensor identity)."""
        if self._holder is None:
            self._holder = self.master
            self._holder.grad = self.master_grad
        return self._holder

    def padded(self, values: Tensor, dtype: torch.dtype, device: torch.device) -> Tensor:
        """``values`` (the whole parameter) flattened and zero-padded to N pieces [N * shard_numel]."""
        out = torch.zeros(self.full_range.size, dtype=dtype, device=device)
        out[: self.numel].copy_(values.reshape(-1))
        return out

    def own_piece(self, padded: Tensor) -> Tensor:
        """This rank's piece [shard_numel] of a padded whole parameter."""
        return rank_chunk(self.unit.rank, self.shard_numel).slice(padded)


def _zeros(numel: int, dtype: torch.dtype, device: torch.device, pin: bool) -> Tensor:
    if device.type == "cpu" and pin and torch.cuda.is_available():
        return torch.zeros(numel, dtype=dtype, device=device).pin_memory()
    return torch.zeros(numel, dtype=dtype, device=device)


class ShardedUnit:
    """A group of parameters gathered, reduced and freed together."""

    def __init__(
        self,
        name: str,
        module: nn.Module | None,
        named_params: list[tuple[str, nn.Parameter]],
        first_index: int,
        world_size: int,
        rank: int,
        device: torch.device,
        param_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        persistent: bool,
        master_device: torch.device | None = None,
        shard_device: torch.device | None = None,
        pin: bool = False,
        offloaded: bool = False,
    ) -> None:
        self.name = name
        self.number = -1  # position among the engine's units (set by the engine)
        self.prefix: str | None = None  # the unit module's name in the model ("" the root; None: persistent)
        self.device = device
        self.module = module
        self.world_size = world_size
        self.rank = rank
        self.param_dtype = param_dtype
        self.grad_dtype = grad_dtype
        self.persistent = persistent
        self.params: list[ShardedParam] = []
        shard_numels = [round_up(param.numel(), world_size) // world_size for _, param in named_params]
        # Trained pieces first in the shard (see [Note: trained pieces first]), then the frozen ones
        # the shard would round, then those it holds exactly (see [Note: masters of frozen pieces]).
        def place(position: int) -> int:
            param = named_params[position][1]
            return 0 if param.requires_grad else 1 if param.dtype != param_dtype else 2

        in_shard_order = sorted(range(len(named_params)), key=place)
        shard_starts = [0] * len(named_params)
        shard_offset = 0
        for position in in_shard_order:
            shard_starts[position] = shard_offset
            shard_offset += shard_numels[position]
        full_offset = 0
        for position, (param_name, param) in enumerate(named_params):
            shard_numel = shard_numels[position]
            self.params.append(
                ShardedParam(
                    param, param_name, first_index + position, param.shape, param.numel(), shard_numel,
                    Range(full_offset, full_offset + shard_numel * world_size),
                    Range(shard_starts[position], shard_starts[position] + shard_numel), self, param.requires_grad,
                    built_dtype=param.dtype,
                )
            )
            full_offset += shard_numel * world_size
        self.shard_numel = shard_offset
        self.trained_numel = sum(sp.shard_numel for sp in self.params if sp.trained)  # T
        self._trained_count = sum(1 for sp in self.params if sp.trained)
        master_device = master_device or device
        shard_device = shard_device or device
        self.shard = _zeros(shard_offset, param_dtype, shard_device, pin)
        # fp32 parameters are their own master (when both live on one device): no second copy.
        # fp32 masters, or the parameters' own dtype where it is wider (float64 keeps its precision)
        self.master_dtype = master_dtype(param_dtype)
        same = param_dtype == self.master_dtype and master_device == shard_device
        # The master spans the frozen pieces too, but for those the shard holds exactly (see [Note:
        # masters of frozen pieces]): checkpoints read the frozen weights from it, at full precision.
        rounded = sum(shard_numels[position] for position in range(len(named_params)) if place(position) == 1)
        self.master_numel = shard_offset if same else self.trained_numel + rounded
        self.master = self.shard if same else _zeros(self.master_numel, self.master_dtype, master_device, pin)
        # The trained pieces' master gradient [T] (see [Note: trained pieces first]).
        self.master_grad = _zeros(self.trained_numel, self.master_dtype, master_device, pin)
        # Offloaded, low-precision: the CPU step writes the rounded pieces here (the shard itself
        # when it lives on the CPU too), and they are copied to the device shard from here.
        self.staging: Tensor | None = None
        if offloaded and self.trained_numel and param_dtype != self.master_dtype:
            self.staging = self.shard if shard_device.type == "cpu" else \
                _zeros(self.trained_numel, param_dtype, CPU, pin)
        # The full buffer exists from the start with its final size but no storage: parameters can
        # be views of it before any unit is allocated, so the model is never whole.
        self.full = torch.empty(full_offset, dtype=param_dtype, device=device)
        self.full.untyped_storage().resize_(0)
        # The trained pieces' local gradient [N * T] rank-major, only while gradients accumulate.
        self.reduction = Reduction(name, self.trained_numel, world_size, rank, grad_dtype, device, keep_buffer=False,
                                   expected_grads=self._trained_count, label="zero3")
        self.reduction.master_grad = self.master_grad
        self.state = UnitState.SHARDED
        self.refcount = 0
        self.pending_input_grads = 0  # units with frozen parameters: calls whose input gradients are still to come
        self._gather_out: Tensor | None = None
        self._gather_handle: Handle | None = None

    @property
    def full_bytes(self) -> int:
        return self.full.numel() * self.full.element_size()

    # ------------------------------------------------------------------ set-up
    def take_shards_from_params(self, values: Mapping[ShardedParam, Tensor] | None = None) -> None:
        """Copies each parameter's current (full, real) value, or its whole value in ``values`` where
        it has one there, into its piece and the master, then points the parameter at the unit's
        full buffer (left allocated: the caller frees it)."""
        self._resize_full(self.full.numel())
        self.state = UnitState.GATHERED
        with torch.no_grad():
            for sp in self.params:
                value = values[sp] if values is not None and sp in values else sp.param.detach()
                padded = sp.padded(value, self.master_dtype, self.device)
                piece = sp.own_piece(padded)
                sp.shard.copy_(piece)
                if self.master is not self.shard and sp.has_master:
                    sp.master.copy_(piece)
                sp.full_range.slice(self.full).copy_(padded)
            self._point_params_at_full()
            self._forget_writes()

    @torch.no_grad()
    def gather_master_values(self, collectives: Collectives | CountingCollectives) -> dict[ShardedParam, Tensor]:
        """Every parameter's whole fp32 value from the master pieces (a collective)."""
        out = torch.empty(self.world_size * self.shard_numel, dtype=self.master_dtype, device=self.device)
        collectives.all_gather(out, self.master_values().to(self.device)).wait()
        by_rank = out.view(self.world_size, self.shard_numel)
        return {
            sp: by_rank[:, sp.shard_range.start : sp.shard_range.end].reshape(-1)[: sp.numel].view(sp.shape)
            for sp in self.params
        }

    def master_values(self) -> Tensor:
        """The whole shard's values at master precision [S]: the master, and past its end the
        frozen pieces the shard holds exactly (see [Note: masters of frozen pieces])."""
        if self.master_numel == self.shard_numel:
            return self.master
        values = torch.empty(self.shard_numel, dtype=self.master_dtype, device=self.master.device)
        values[: self.master_numel].copy_(self.master)
        values[self.master_numel :].copy_(self.shard[self.master_numel :])
        return values

    @torch.no_grad()
    def write_back_changed(self) -> bool:
        """After the full parameters were open for writing: pieces whose values differ from the
        shard become the new shard and master; unchanged pieces keep their fp32 master exactly.
        Returns whether any differed."""
        by_param = [(sp, sp.full_range.slice(self.full).view(self.world_size, sp.shard_numel)[self.rank]) for sp in self.params]
        changed = False
        for sp, piece in by_param:
            if not torch.equal(piece, sp.shard.to(piece.device)):
                changed = True
                sp.shard.copy_(piece)
                if self.master is not self.shard and sp.has_master:
                    sp.master.copy_(piece)
        return changed

    def allocate(self) -> None:
        """Gives the full buffer its storage (contents undefined): for initializing in place."""
        self._resize_full(self.full.numel())
        self.state = UnitState.GATHERED
        self._point_params_at_full()

    def view_of(self, sp: ShardedParam) -> Tensor:
        return sp.full_range.slice(self.full)[: sp.numel].view(sp.shape)

    def _point_params_at_full(self) -> None:
        for sp in self.params:
            if not sp.param.is_meta:  # replaced by a view of the buffer instead (_replace_meta_params)
                sp.param.data = self.view_of(sp)

    def _point_params_at_shard(self) -> None:
        for sp in self.params:
            if not sp.param.is_meta:
                sp.param.data = sp.local_view

    def _forget_writes(self) -> None:
        for sp in self.params:
            sp.seen_version = sp.param._version

    @torch.no_grad()
    def absorb_writes(self) -> None:
        """Takes values user code wrote into parameters in place into the shard and the master
        (see [Note: a stage-3 parameter outside its gather])."""
        for sp in self.params:
            if sp.param._version == sp.seen_version:
                continue
            if self.state is UnitState.GATHERED:
                piece = sp.full_range.slice(self.full).view(self.world_size, sp.shard_numel)[self.rank]
                sp.shard.copy_(piece)
            if self.master is not self.shard and sp.has_master:  # the shard holds what was written
                take_written(sp.master, sp.shard)
            sp.seen_version = sp.param._version

    @torch.no_grad()
    def absorb_data_writes(self) -> bool:
        """``absorb_writes`` for writes through ``.data`` too, which no version counter sees
        (EMAWeightAveraging swaps weights that way): where the gathered piece differs from the
        shard, or the shard from the rounded master, it was written and wins. A pass over the
        shard: for saves, teardown and the steps of [Note: writes through .data] in layout.py.
        Returns whether it found such a write."""
        self.absorb_writes()
        if self.state is UnitState.GATHERED:
            return self.write_back_changed()  # the whole buffer is what forward and user code see
        if self.master is self.shard:
            return False  # the shard is the master: nothing to keep in step
        return take_written(self.master, self.shard[: self.master_numel])

    # ------------------------------------------------------------------ gather / free
    def start_gather(self, collectives: Collectives | CountingCollectives) -> None:
        if self.state is not UnitState.SHARDED:
            return
        self._gather_out = torch.empty(self.world_size * self.shard_numel, dtype=self.param_dtype, device=self.device)
        # An offloaded shard travels to the device for the gather.
        shard = self.shard if self.shard.device == self.device else self.shard.to(self.device, non_blocking=True)
        with torch.profiler.record_function("zero3::all_gather"):
            self._gather_handle = collectives.all_gather(self._gather_out, shard)
        self.state = UnitState.GATHERING

    @torch.no_grad()
    def finish_gather(self) -> None:
        if self.state is not UnitState.GATHERING:
            return
        assert self._gather_handle is not None and self._gather_out is not None
        with torch.profiler.record_function("zero3::wait_all_gather"):
            self._gather_handle.wait()
        self._resize_full(self.full.numel())
        by_rank = self._gather_out.view(self.world_size, self.shard_numel)
        # Autograd saved views of this buffer in forward: refilling it is not a modification.
        with torch.autograd._unsafe_preserve_version_counter(self.full):
            for sp in self.params:
                sp.full_range.slice(self.full).view(self.world_size, sp.shard_numel).copy_(
                    by_rank[:, sp.shard_range.start : sp.shard_range.end]
                )
        self._gather_out = None
        self._gather_handle = None
        self.state = UnitState.GATHERED
        self._point_params_at_full()

    def free(self) -> None:
        if self.persistent or self.state is UnitState.SHARDED:
            return
        if self.state is UnitState.GATHERING:
            self.finish_gather()
        self.absorb_writes()
        self._point_params_at_shard()
        self._resize_full(0)
        self.state = UnitState.SHARDED

    def _resize_full(self, numel: int) -> None:
        storage = self.full.untyped_storage()
        nbytes = numel * self.full.element_size()
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)

    # ------------------------------------------------------------------ gradients
    @property
    def trainable_count(self) -> int:
        """Parameters of the unit laid out as trained (see [Note: trained pieces first])."""
        return self._trained_count

    @property
    def grad_data(self) -> Tensor | None:
        return self.reduction.grad

    @torch.no_grad()
    def accumulate(self, sp: ShardedParam, grad: Tensor) -> None:
        by_rank = self.reduction.local_grad().view(self.world_size, self.trained_numel)
        padded = sp.padded(grad, self.grad_dtype, grad.device)
        by_rank[:, sp.shard_range.start : sp.shard_range.end].add_(padded.view(self.world_size, sp.shard_numel))

    def tile(self, params: Sequence[ShardedParam]) -> ShardTile:
        """The unit's master shard up to the last of ``params`` (of one optimizer) as one tile,
        holding their pieces: trained pieces come first, so the frozen rest is not gathered."""
        return ShardTile(max((sp.shard_range.end for sp in params), default=0), tuple(sp.piece() for sp in params))

    @torch.no_grad()
    def publish_master(self, params: Sequence[ShardedParam], staged: bool) -> None:
        """After a step: the updated master pieces become the parameter shard (from the staging
        buffer when the CPU step already wrote the rounded pieces there)."""
        if self.master is self.shard:
            return
        source = self.staging if staged and self.staging is not None else self.master
        if source is self.shard:
            return
        for sp in params:
            if sp.has_master:  # the others are their own master
                sp.shard.copy_(sp.shard_range.slice(source))

