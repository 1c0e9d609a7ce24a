"""ZeRO stage 3: parameters sharded, gathered just in time per unit, freed right after.

[Note: stage-3 layout]
Each parameter is split into N equal pieces (padded): rank r keeps piece r. A *unit* (a module
subtree, e.g. one transformer block) is the unit of communication: its rank-local shard is the
concatenation of its parameters' pieces [S], one all-gather fills a rank-major buffer [N, S] that
is copied out into the unit's full buffer [sum of padded numels], of which every parameter is a
view while the unit is gathered. Freeing resizes that buffer's storage to zero: the tensors autograd
saved stay valid, because re-gathering fills the same storage (under
``_unsafe_preserve_version_counter``, as FSDP2 does), and the parameters are re-pointed at their
pieces (see [Note: a stage-3 parameter outside its gather]).

Gradients go the other way: each parameter's gradient is added into a rank-major buffer [N, S];
when all of a unit's gradients of this backward have arrived, one reduce-scatter leaves this
rank's pieces in the unit's fp32 master-gradient shard [S].

[Note: stage-3 lifecycle]
Forward: a unit's root module's pre-hook acquires it (gather, refcounted) and prefetches the next
units in the recorded order; its post-hook releases it and registers a hook on its outputs that
re-gathers the unit when backward reaches it. Backward: once every parameter of the unit has its
gradient, the unit is reduced and freed. Parameters not under any unit form the root unit, held
for the whole step (and its backward) by the strategy. A module that uses a parameter of another
unit (tied weights) acquires that unit around its own forward and backward as well.

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

import contextlib
import enum
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from torch.optim import Optimizer

from lightning_zero.config import ZeroConfig
from lightning_zero.offload import CPU, CPUOffloadPolicy, MasterPlacement
from lightning_zero.loss_scaler import LossScaler
from lightning_zero.zero.comm import Collectives, CountingCollectives, Handle
from lightning_zero.zero.consistency import Point, RanksDisagreeError, agree_at
from lightning_zero.zero.flat_buffer import Range, _round_up, held_dtype, master_dtype, reduce_dtype_for, take_written
from lightning_zero.zero.optimizer import ParamPiece, ShardedOptimizer, SyncState


class _GatherFor(enum.Enum):
    """Why a unit is gathered, told to the other ranks with the unit (for the error when they disagree)."""

    FORWARD = 0
    BACKWARD = 1
    PREFETCH = 2
    REFRESH = 3


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
    # param._version when the engine last knew the parameter's contents: a larger one means user
    # code wrote the parameter in place (see [Note: a stage-3 parameter outside its gather]).
    seen_version: int = 0

    @property
    def shard(self) -> Tensor:
        return self.shard_range.slice(self.unit.shard)

    @property
    def own_numel(self) -> int:
        """Elements of the parameter in this rank's piece (the padding is nobody's)."""
        return max(0, min(self.shard_numel, self.numel - self.unit.rank * self.shard_numel))

    @property
    def local_view(self) -> Tensor:
        """What the parameter shows while its unit is sharded: this rank's piece, 1-d, unpadded."""
        return self.shard[: self.own_numel]

    def piece_ranges(self) -> tuple[Range, ...]:
        """Rank r's piece in the flattened parameter (the padding past ``numel`` belongs to nobody)."""
        return tuple(
            Range(min(r * self.shard_numel, self.numel), min((r + 1) * self.shard_numel, self.numel))
            for r in range(self.unit.world_size)
        )

    def piece(self, holder: Tensor) -> ParamPiece:
        """This parameter's master piece described for checkpoints; ``holder`` is its master tensor."""
        ranges = self.piece_ranges()
        return ParamPiece(self.param, self.name, ranges, holder, Range(0, ranges[self.unit.rank].size),
                          param_shape=tuple(self.shape))

    @property
    def master(self) -> Tensor:
        return self.shard_range.slice(self.unit.master)

    @property
    def master_grad(self) -> Tensor:
        return self.shard_range.slice(self.unit.master_grad)


def _unit_name(base: str, dtype: torch.dtype, first: torch.dtype | None) -> str:
    """A module's unit of its main dtype is named after the module; the others add their dtype."""
    return base if dtype == first else f"{base}[{str(dtype).replace('torch.', '')}]"


def _in_backward() -> bool:
    """True while the autograd engine runs a backward on this thread (e.g. a checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1


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
        full_offset = shard_offset = 0
        for position, (param_name, param) in enumerate(named_params):
            shard_numel = _round_up(param.numel(), world_size) // world_size
            self.params.append(
                ShardedParam(
                    param, param_name, first_index + position, param.shape, param.numel(), shard_numel,
                    Range(full_offset, full_offset + shard_numel * world_size),
                    Range(shard_offset, shard_offset + shard_numel), self,
                )
            )
            full_offset += shard_numel * world_size
            shard_offset += shard_numel
        self.shard_numel = shard_offset
        master_device = master_device or device
        shard_device = shard_device or device
        self.shard = _zeros(shard_offset, param_dtype, shard_device, pin)
        # fp32 parameters are their own master (when both live on one device): no second copy.
        # fp32 masters, or the parameters' own dtype where it is wider (float64 keeps its precision)
        self.master_dtype = master_dtype(param_dtype)
        same = param_dtype == self.master_dtype and master_device == shard_device
        self.master = self.shard if same else _zeros(shard_offset, self.master_dtype, master_device, pin)
        self.master_grad = _zeros(shard_offset, self.master_dtype, master_device, pin)
        # Offloaded, low-precision: the CPU step writes the rounded pieces here (the shard itself
        # when it lives on the CPU too), and they are copied to the device shard from here.
        self.staging: Tensor | None = None
        if offloaded and param_dtype != self.master_dtype:
            self.staging = self.shard if shard_device.type == "cpu" else _zeros(shard_offset, param_dtype, CPU, pin)
        # The full buffer exists from the start with its final size but no storage: parameters can
        # be views of it before any unit is allocated, so the model is never whole.
        self.full = torch.empty(full_offset, dtype=param_dtype, device=device)
        self.full.untyped_storage().resize_(0)
        self.grad_data: Tensor | None = None  # [N * S] rank-major, only while gradients accumulate
        self.state = UnitState.SHARDED
        self.refcount = 0
        self.ready = 0
        self.ready_to_reduce = False
        self.pending_input_grads = 0  # units with frozen parameters: calls whose input gradients are still to come
        self.grads_complete = False  # every trainable parameter's gradient of this backward has arrived
        self.trainable_count = len(self.params)
        self.reducing = False
        self._gather_out: Tensor | None = None
        self._gather_handle: Handle | None = None
        self._reduce_out: Tensor | None = None
        self._reduce_handle: Handle | None = None

    @property
    def full_bytes(self) -> int:
        return self.full.numel() * self.full.element_size()

    # ------------------------------------------------------------------ set-up
    def take_shards_from_params(self) -> None:
        """Copies each parameter's current (full, real) value into its piece and the master, then
        points the parameter at the unit's full buffer (left allocated: the caller frees it)."""
        self._resize_full(self.full.numel())
        self.state = UnitState.GATHERED
        with torch.no_grad():
            for sp in self.params:
                values = sp.param.detach().reshape(-1)
                padded = torch.zeros(sp.full_range.size, dtype=self.master_dtype, device=self.device)
                padded[: sp.numel].copy_(values)
                piece = padded[self.rank * sp.shard_numel : (self.rank + 1) * sp.shard_numel]
                sp.shard.copy_(piece)
                if self.master is not self.shard:
                    sp.master.copy_(piece)
                sp.full_range.slice(self.full).copy_(padded)
            self._point_params_at_full()
            self._forget_writes()

    @torch.no_grad()
    def gather_master_values(self, collectives: Collectives | CountingCollectives) -> dict[ShardedParam, Tensor]:
        """Every parameter's whole fp32 value from the master pieces (a collective)."""
        out = torch.empty(self.world_size * self.shard_numel, dtype=self.master_dtype, device=self.device)
        collectives.all_gather(out, self.master.to(self.device)).wait()
        by_rank = out.view(self.world_size, self.shard_numel)
        return {
            sp: by_rank[:, sp.shard_range.start : sp.shard_range.end].reshape(-1)[: sp.numel].view(sp.shape)
            for sp in self.params
        }

    @torch.no_grad()
    def write_back_changed(self) -> None:
        """After the full parameters were open for writing: pieces whose values differ from the
        shard become the new shard and master; unchanged pieces keep their fp32 master exactly."""
        by_param = [(sp, sp.full_range.slice(self.full).view(self.world_size, sp.shard_numel)[self.rank]) for sp in self.params]
        for sp, piece in by_param:
            if not torch.equal(piece, sp.shard.to(piece.device)):
                sp.shard.copy_(piece)
                if self.master is not self.shard:
                    sp.master.copy_(piece)

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
            if self.master is not self.shard:  # the shard holds what was written (the piece is a view of it)
                take_written(sp.master, sp.shard)
            sp.seen_version = sp.param._version

    @torch.no_grad()
    def absorb_data_writes(self) -> None:
        """``absorb_writes`` for writes through ``.data`` too, which no version counter sees
        (EMAWeightAveraging swaps weights that way): where the shard differs from the rounded
        master, the shard was written and wins. A pass over the shard: for saves and teardown."""
        self.absorb_writes()
        if self.master is self.shard:
            return  # the shard is the master: nothing to keep in step
        if self.state is UnitState.GATHERED:
            self.write_back_changed()
            return
        take_written(self.master, self.shard)

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
    def ensure_grad_buffer(self) -> None:
        if self.grad_data is None:
            self.grad_data = torch.zeros(self.world_size * self.shard_numel, dtype=self.grad_dtype, device=self.device)

    @torch.no_grad()
    def accumulate(self, sp: ShardedParam, grad: Tensor) -> None:
        if self.reducing:
            self.finish_reduce()  # the previous micro-step's reduction lands first
        self.ensure_grad_buffer()
        by_rank = self.grad_data.view(self.world_size, self.shard_numel)
        padded = torch.zeros(sp.full_range.size, dtype=self.grad_dtype, device=grad.device)
        padded[: sp.numel].copy_(grad.reshape(-1))
        by_rank[:, sp.shard_range.start : sp.shard_range.end].add_(padded.view(self.world_size, sp.shard_numel))

    def start_reduce(self, collectives: Collectives | CountingCollectives) -> None:
        if self.grad_data is None or self.reducing:
            return
        self.grad_data.div_(self.world_size)
        self._reduce_out = torch.empty(self.shard_numel, dtype=self.grad_dtype, device=self.device)
        with torch.profiler.record_function("zero3::reduce_scatter"):
            self._reduce_handle = collectives.reduce_scatter(self._reduce_out, self.grad_data)
        self.reducing = True
        self.ready = 0

    @torch.no_grad()
    def finish_reduce(self) -> None:
        if not self.reducing:
            return
        assert self._reduce_handle is not None and self._reduce_out is not None
        with torch.profiler.record_function("zero3::wait_reduce_scatter"):
            self._reduce_handle.wait()
        self.master_grad.add_(self._reduce_out.to(self.master_grad.device))  # the copy to the CPU if offloaded
        self._reduce_out = None
        self._reduce_handle = None
        self.grad_data = None
        self.reducing = False

    def drop_grads(self) -> None:
        if self._reduce_handle is not None:
            self._reduce_handle.wait()
        self._reduce_handle = None
        self._reduce_out = None
        self.grad_data = None
        self.reducing = False
        self.ready = 0

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
            sp.shard.copy_(sp.shard_range.slice(source))


class Zero3Engine:
    """Shards a module's parameters into units and moves them in and out as the module runs."""

    def __init__(
        self,
        module: nn.Module,
        collectives: Collectives | CountingCollectives,
        unit_classes: Sequence[str],
        min_unit_numel: int,
        persistence_threshold: int,
        prefetch_units: int,
        prefetch_bytes: int | None,
        param_dtype: torch.dtype | None,
        grad_dtype: torch.dtype,
        device: torch.device,
        offload_optimizer: CPUOffloadPolicy | None = None,
        offload_params: CPUOffloadPolicy | None = None,
        check_gather_order: bool = True,
    ) -> None:
        self.module = module
        self.check_gather_order = check_gather_order
        self.offload_optimizer = offload_optimizer
        self.offload_params = offload_params
        self.collectives = collectives
        self.prefetch_units = prefetch_units
        self.prefetch_bytes = prefetch_bytes
        self.device = device
        self.units: list[ShardedUnit] = []
        self.sharded_params: dict[nn.Parameter, ShardedParam] = {}
        self.sync_enabled = True
        self.peak_param_bytes = 0
        self._forward_order: list[ShardedUnit] = []
        self._backward_order: list[ShardedUnit] = []
        self._recording = True
        # The last gather of a training forward (by call count, recorded on the first step).
        self._forward_calls = 0
        self._forward_tail_call = -1
        self._call_stack: list[int] = []
        self._backward_held: set[ShardedUnit] = set()
        self._backward_visited: set[ShardedUnit] = set()
        self._grad_listeners: list[Callable[[ShardedParam], None]] = []
        self._hook_handles: list[Any] = []
        self._launch_order: list[ShardedUnit] = []
        self._launch_cursor = 0
        self._backward_task: int | None = None  # the autograd graph task whose gradients arrive now
        self._backward_synced = True
        self._check_dtypes(module, param_dtype)
        self._init_units(module, unit_classes, min_unit_numel, persistence_threshold, param_dtype, grad_dtype)
        self._replace_meta_params()
        # Parameters outside every other unit (one unit per dtype, see [Note: one unit per dtype]).
        self.root_units = [u for u in self.units if u.module is module]
        self._registrations: list[tuple[str, nn.Module, str, nn.Parameter]] = []
        self.record_registrations()

    @property
    def root_unit(self) -> ShardedUnit | None:
        """The root unit of the parameters' main dtype (the only one when they have one dtype)."""
        return self.root_units[0] if self.root_units else None

    def record_registrations(self) -> None:
        """Remembers which parameter object each module holds, to detect replacements later."""
        module = self.module
        self._registrations = [
            (prefix, submodule, name, param)
            for prefix, submodule in module.named_modules()
            for name, param in submodule.named_parameters(recurse=False)
        ]

    # ------------------------------------------------------------------ set-up
    @staticmethod
    def _check_dtypes(module: nn.Module, param_dtype: torch.dtype | None) -> None:
        non_float = [n for n, p in module.named_parameters() if not p.is_floating_point()]
        if non_float:
            raise ValueError(f"ZeRO-3 shards floating-point parameters only; these are not: {non_float[:5]}.")

    def _init_units(
        self,
        module: nn.Module,
        unit_classes: Sequence[str],
        min_unit_numel: int,
        persistence_threshold: int,
        param_dtype: torch.dtype | None,
        grad_dtype: torch.dtype,
    ) -> None:
        owner_of: dict[nn.Parameter, tuple[str, nn.Module]] = {}
        unit_modules = _choose_unit_modules(module, unit_classes, min_unit_numel)
        # Each parameter belongs to the innermost unit module that registers it first.
        for prefix, submodule in module.named_modules():
            unit_prefix = _innermost_prefix(prefix, unit_modules)
            for name, param in submodule.named_parameters(recurse=False):
                if param not in owner_of:
                    owner_of[param] = (unit_prefix, unit_modules[unit_prefix])
        names = {p: n for n, p in module.named_parameters()}
        # [Note: one unit per dtype] A unit's buffers have one dtype, so a module whose parameters
        # have several (fp32 norms beside bf16 weights, a float64 scale) gets one unit per dtype,
        # gathered and freed together by the module's hooks. A precision's param_dtype applies to
        # parameters of up to 32 bits; wider ones keep their dtype, with a master of their own dtype.
        groups: dict[tuple[str, torch.dtype], list[tuple[str, nn.Parameter]]] = {}
        persistent: dict[torch.dtype, list[tuple[str, nn.Parameter]]] = {}
        for param, (unit_prefix, _) in owner_of.items():
            entry = (names[param], param)
            dtype = held_dtype(param.dtype, param_dtype)
            if param.numel() < persistence_threshold:
                persistent.setdefault(dtype, []).append(entry)
            else:
                groups.setdefault((unit_prefix, dtype), []).append(entry)
        world, rank = self.collectives.world_size, self.collectives.rank
        total = sum(p.numel() for entries in groups.values() for _, p in entries)
        total += sum(p.numel() for entries in persistent.values() for _, p in entries)
        placement = MasterPlacement(self.offload_optimizer, self.device, total // world)
        shard_device = CPU if self.offload_params is not None else self.device
        pin = any(policy is not None and policy.pin_memory for policy in (self.offload_optimizer, self.offload_params))
        # the unit of a module's main dtype (the most elements) is named after the module
        main_dtype: dict[str, tuple[int, torch.dtype]] = {}
        for (prefix, dtype), entries in groups.items():
            size = sum(p.numel() for _, p in entries)
            if prefix not in main_dtype or size > main_dtype[prefix][0]:
                main_dtype[prefix] = (size, dtype)
        first_dtype = {prefix: dtype for prefix, (_, dtype) in main_dtype.items()}
        index = 0
        named_groups = [
            (prefix, _unit_name(prefix or "<root>", dtype, first_dtype[prefix]), unit_modules[prefix], dtype, entries,
             False)
            for (prefix, dtype), entries in groups.items()
        ]
        first_persistent = next(iter(persistent), None)
        named_groups += [(None, _unit_name("<persistent>", dtype, first_persistent), None, dtype, entries, True)
                         for dtype, entries in persistent.items()]
        for prefix, name, unit_module, dtype, entries, is_persistent in named_groups:
            master_device = placement.place(sum(p.numel() for _, p in entries) // world)
            unit = ShardedUnit(name, unit_module, entries, index, world, rank, self.device, dtype,
                               reduce_dtype_for(dtype, grad_dtype), persistent=is_persistent,
                               master_device=master_device, shard_device=shard_device, pin=pin,
                               offloaded=self.offload_optimizer is not None and master_device == CPU)
            unit.prefix = prefix
            unit.number = len(self.units)
            self.units.append(unit)
            index += len(entries)
        for unit in self.units:
            for sp in unit.params:
                self.sharded_params[sp.param] = sp

    def _replace_meta_params(self) -> None:
        """Meta parameters cannot take real data through ``.data``; each is replaced (in every
        module that registers it, so ties survive) by a parameter viewing its unit's full buffer.
        Only possible before an optimizer holds them, which is when the strategy builds the engine."""
        replaced: dict[nn.Parameter, nn.Parameter] = {}
        for unit in self.units:
            if not any(sp.param.is_meta for sp in unit.params):
                continue
            unit.allocate()  # views can only be cut from an allocated buffer; freed right after
            for sp in unit.params:
                if sp.param.is_meta:
                    new = nn.Parameter(unit.view_of(sp), requires_grad=sp.param.requires_grad)
                    replaced[sp.param] = new
                    sp.param = new
            unit.free()
        if not replaced:
            return
        for submodule in self.module.modules():
            for name, param in list(submodule._parameters.items()):
                if param is not None and param in replaced:
                    submodule._parameters[name] = replaced[param]
        self.sharded_params = {sp.param: sp for unit in self.units for sp in unit.params}

    def shard(self) -> None:
        """Takes this rank's pieces of the (real, whole) parameters and frees the rest, unit by unit."""
        for unit in self.units:
            unit.take_shards_from_params()
            unit.free()
        self._track_memory()

    def materialize_and_shard(self, init: Callable[[nn.Module], None]) -> None:
        """For parameters on the meta device: modules are initialized one at a time by ``init``
        (in registration order, as ``module.apply`` would), with only the units owning that module's
        parameters allocated; a unit is cut down to this rank's pieces as soon as all its modules
        are done. The full model never exists on any rank."""
        modules = [m for m in self.module.modules() if any(True for _ in m.parameters(recurse=False))]
        pending: dict[ShardedUnit, set[int]] = {unit: set() for unit in self.units}
        for submodule in modules:
            for param in submodule.parameters(recurse=False):
                pending[self.sharded_params[param].unit].add(id(submodule))
        touched: set[ShardedUnit] = set()
        for submodule in modules:
            needed = list(dict.fromkeys(self.sharded_params[p].unit for p in submodule.parameters(recurse=False)))
            for unit in needed:
                if unit not in touched:
                    unit.allocate()
                    touched.add(unit)
                else:
                    self._gather(unit, order=None)  # already cut: a tied weight written again
            init(submodule)
            for unit in needed:
                pending[unit].discard(id(submodule))
                if not pending[unit]:
                    unit.take_shards_from_params()
                    if unit.persistent and self.collectives.world_size > 1:
                        self.collectives.broadcast(unit.full, 0)  # whole on every rank: must agree
                        unit.take_shards_from_params()
                    unit.free()
                    self._track_memory()

    def install_hooks(self) -> None:
        by_module: dict[nn.Module, list[ShardedUnit]] = {}
        for unit in self.units:
            if unit.module is not None and unit not in self.root_units:
                by_module.setdefault(unit.module, []).append(unit)
        for unit_module, units in by_module.items():
            self._hook_handles.append(unit_module.register_forward_pre_hook(self._make_pre_forward(units)))
            self._hook_handles.append(unit_module.register_forward_hook(self._make_post_forward(units)))
        # The strategy holds the root unit through each *_step; these gather it for a forward
        # anywhere else (a callback calling pl_module(x), Hugging Face generate()). Every module
        # outside the other units gets them: its forward may read a root parameter of a child
        # without calling the child (MultiheadAttention reads out_proj.weight).
        for root in self.root_units:
            for prefix, submodule in self.module.named_modules():
                if root in self._enclosing_units(prefix):
                    self._hook_handles.append(submodule.register_forward_pre_hook(self._make_root_pre_forward(root)))
                    self._hook_handles.append(submodule.register_forward_hook(self._make_root_post_forward(root)))
        # Modules that use a parameter owned by another unit (tied weights) hold that unit too.
        for prefix, submodule in self.module.named_modules():
            enclosing = self._enclosing_units(prefix)
            foreign = [unit for unit in dict.fromkeys(self.sharded_params[p].unit for p in submodule.parameters(recurse=False)
                                                      if p in self.sharded_params)
                       if unit not in enclosing and not unit.persistent and unit not in self.root_units]
            if foreign:
                self._hook_handles.append(submodule.register_forward_pre_hook(self._make_pre_forward(foreign, False)))
                self._hook_handles.append(submodule.register_forward_hook(self._make_post_forward(foreign)))
        for unit in self.units:
            unit.trainable_count = sum(1 for sp in unit.params if sp.param.requires_grad)
        # Reverse registration order is backward order; persistent parameters (spread over the
        # whole model) are complete only at the end, so they come last.
        self._launch_order = [u for u in reversed(self.units) if u.trainable_count and not u.persistent]
        self._launch_order += [u for u in self.units if u.trainable_count and u.persistent]
        self._launch_cursor = 0
        for sp in self.sharded_params.values():
            if sp.param.requires_grad:
                self._hook_handles.append(sp.param.register_post_accumulate_grad_hook(self._on_grad_ready))

    def _enclosing_units(self, prefix: str) -> list[ShardedUnit]:
        """The units of the innermost unit module containing the module at ``prefix``."""
        prefixes = {unit.prefix for unit in self.units if unit.module is not None} | {""}
        inner = _innermost_prefix(prefix, prefixes)  # type: ignore[arg-type]
        return [unit for unit in self.units if unit.module is not None and unit.prefix == inner]

    def remove_hooks(self) -> None:
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()

    # ------------------------------------------------------------------ forward / backward hooks
    def check_parameters_unchanged(self) -> None:
        """Raises if a module's parameter was replaced after sharding (its new value would be ignored)."""
        for prefix, submodule, name, param in self._registrations:
            if submodule._parameters.get(name) is not param:
                raise RuntimeError(
                    f"Parameter '{prefix + '.' if prefix else ''}{name}' was replaced after ZeRO-3 sharded the model,"
                    " so the optimizer and the gathers would ignore it. Create parameters in __init__ or"
                    " configure_model; to change their values, assign under"
                    " `with trainer.strategy.gathered_params():` (e.g. param.copy_(new_value))."
                )

    def _make_pre_forward(self, units: Sequence[ShardedUnit], prefetch: bool = True) -> Callable[..., None]:
        def pre_forward(module: nn.Module, args: Any) -> None:
            if _in_backward():
                # Activation checkpointing recomputes forward inside backward (and may stop it
                # early, so no post-hook runs): hold the unit for backward, not by refcount.
                for unit in units:
                    self._pre_backward(unit) if prefetch else self._hold_for_backward(unit)
                return
            if torch.is_grad_enabled():
                self._forward_calls += 1
                self._call_stack.append(self._forward_calls)
                if self._recording:
                    self._forward_tail_call = self._forward_calls
            for unit in units:
                self.acquire(unit, order=self._forward_order if prefetch else None)

        return pre_forward

    def _make_post_forward(self, units: Sequence[ShardedUnit]) -> Callable[..., Any]:
        def post_forward(module: nn.Module, args: Any, output: Any) -> Any:
            if _in_backward():
                return output
            call = self._call_stack.pop() if torch.is_grad_enabled() and self._call_stack else None
            tensors = ([t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.requires_grad]
                       if torch.is_grad_enabled() else [])
            for unit in units:
                if (call is not None and not self._recording and call == self._forward_tail_call
                        and unit.refcount == 1 and unit not in self._backward_held):
                    # The last unit of forward is the first of backward: keep it rather than free
                    # and re-gather it at once (the hold passes to backward).
                    self._backward_held.add(unit)
                else:
                    self.release(unit)
                if tensors:
                    torch.autograd.graph.register_multi_grad_hook(
                        tensors, lambda grads, unit=unit: self._pre_backward(unit), mode="any"
                    )
                    if unit.trainable_count < len(unit.params):
                        self._release_after_input_grads(unit, args)
            return output

        return post_forward

    def _make_root_pre_forward(self, root: ShardedUnit) -> Callable[..., None]:
        def pre_forward(module: nn.Module, args: Any) -> None:
            if _in_backward():
                self._hold_for_backward(root)
            else:
                self.acquire(root)  # only counts while the strategy holds it for a step

        return pre_forward

    def _make_root_post_forward(self, root: ShardedUnit) -> Callable[..., Any]:
        def post_forward(module: nn.Module, args: Any, output: Any) -> Any:
            if _in_backward():
                return output
            self.release(root)
            if root.refcount == 0 and torch.is_grad_enabled():
                # Nobody holds it for a backward of this forward: gather it again when one comes.
                tensors = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.requires_grad]
                if tensors:
                    torch.autograd.graph.register_multi_grad_hook(
                        tensors, lambda grads: self._pre_backward(root), mode="any"
                    )
            return output

        return post_forward

    def _release_after_input_grads(self, unit: ShardedUnit, args: Any) -> None:
        """A frozen parameter gets no gradient to say its backward is over, yet backward may still
        need it for the gradient of the unit's input (a frozen layer before the trainable ones); the
        gradients of its inputs say so (as FSDP2 releases after backward), once for every call of
        the unit. A unit with trainable parameters too waits for both."""
        inputs = [t for t in tree_flatten(args)[0] if isinstance(t, Tensor) and t.requires_grad]
        if not inputs:
            return
        unit.pending_input_grads += 1

        def done(grads: Any) -> None:
            unit.pending_input_grads -= 1
            if unit.pending_input_grads == 0 and (unit.trainable_count == 0 or unit.grads_complete):
                self._done_with_backward(unit)

        torch.autograd.graph.register_multi_grad_hook(inputs, done, mode="all")

    def _hold_for_backward(self, unit: ShardedUnit) -> None:
        if unit not in self._backward_held:
            self._backward_held.add(unit)
            unit.refcount += 1
            self._gather(unit, order=None)

    def _pre_backward(self, unit: ShardedUnit) -> None:
        # A unit's outputs can be reached more than once in one backward (a tied weight's two
        # modules): only the first time gathers and prefetches.
        if unit in self._backward_visited:
            return
        self._backward_visited.add(unit)
        if unit not in self._backward_held:
            self._backward_held.add(unit)
            unit.refcount += 1
            self._gather(unit, order=self._backward_order)
        else:  # kept from forward: nothing to gather, but record the order and prefetch what follows
            if self._recording and unit not in self._backward_order:
                self._backward_order.append(unit)
            self._prefetch_after(unit, self._backward_order)

    def acquire(self, unit: ShardedUnit, order: list[ShardedUnit] | None = None) -> None:
        unit.refcount += 1
        self._gather(unit, order)

    def release(self, unit: ShardedUnit) -> None:
        unit.refcount -= 1
        if unit.refcount <= 0:
            unit.refcount = 0
            unit.free()

    def _gather(self, unit: ShardedUnit, order: list[ShardedUnit] | None) -> None:
        if order is not None and self._recording and unit not in order:
            order.append(unit)
        self._start_gather(unit, _GatherFor.BACKWARD if _in_backward() else _GatherFor.FORWARD)
        if order is not None:
            self._prefetch_after(unit, order)
        unit.finish_gather()
        self._track_memory()

    def _prefetch_after(self, unit: ShardedUnit, order: list[ShardedUnit]) -> None:
        if self._recording or unit not in order:
            return
        budget = self.prefetch_bytes
        ahead = 0
        for candidate in order[order.index(unit) + 1 :]:
            if budget is not None:
                if candidate.full_bytes > budget:
                    break
                budget -= candidate.full_bytes
            elif ahead >= self.prefetch_units:
                break
            self._start_gather(candidate, _GatherFor.PREFETCH)
            ahead += 1

    def _start_gather(self, unit: ShardedUnit, purpose: _GatherFor) -> None:
        """Launches a unit's all-gather, after checking that every rank gathers the same unit
        (see [Note: ranks that disagree] in consistency.py)."""
        if unit.state is not UnitState.SHARDED:
            return
        if self.check_gather_order and self.collectives.world_size > 1:
            every = agree_at(self.collectives, Point.GATHER, [unit.number, purpose.value])
            if any(row[0] != unit.number for row in every):
                described = ", ".join(
                    f"rank {rank} gathers '{self.units[number].name}' ({_GatherFor(code).name.lower()})"
                    for rank, (number, code) in enumerate(every)
                )
                raise RanksDisagreeError(
                    f"ZeRO-3 ranks disagree on which unit to gather next: {described}. Each gather is a collective"
                    " every rank must join, so every rank must run the same units in the same order. Code that"
                    " differs between ranks (a rank-dependent branch, a data-dependent number of layers, a forward"
                    " called on some ranks only) must run the same units everywhere: keep such layers inside a"
                    " unit every rank runs (e.g. leave them out of unit_modules so they join their parent's unit),"
                    " or make the decision the same on every rank."
                )
        unit.start_gather(self.collectives)

    def _track_memory(self) -> None:
        live = sum(u.shard.numel() * u.shard.element_size() for u in self.units)
        live += sum(u.full.untyped_storage().nbytes() for u in self.units)
        self.peak_param_bytes = max(self.peak_param_bytes, live)

    # ------------------------------------------------------------------ gradients
    def add_grad_listener(self, listener: Callable[[ShardedParam], None]) -> None:
        self._grad_listeners.append(listener)

    @torch.no_grad()
    def _on_grad_ready(self, param: Tensor) -> None:
        if param.grad is None:
            return
        task = torch._C._current_graph_task_id()
        if task != self._backward_task:
            self._start_backward(task)
        sp = self.sharded_params[param]  # type: ignore[index]
        unit = sp.unit
        unit.accumulate(sp, param.grad)
        param.grad = None
        for listener in self._grad_listeners:
            listener(sp)
        unit.ready += 1
        if unit.ready == unit.trainable_count:
            unit.ready = 0
            unit.grads_complete = True
            if self._backward_synced:
                unit.ready_to_reduce = True
                self._launch_ready_reductions()
            if unit.pending_input_grads == 0:
                self._done_with_backward(unit)

    def _start_backward(self, task: int) -> None:
        """A new backward: the previous one's unlaunched reductions go first, so that every rank
        issues one reduction per unit per synchronized backward, in the same order."""
        self._launch_remaining()
        for unit in self.units:
            unit.ready = 0
            unit.grads_complete = False
        self._backward_task = task
        self._backward_synced = self.sync_enabled

    def _launch_remaining(self) -> None:
        if self._backward_task is not None and self._backward_synced:
            for unit in self._launch_order[self._launch_cursor :]:
                unit.finish_reduce()  # an earlier backward's, as in ZeroOptimizer._launch_remaining
                unit.ensure_grad_buffer()  # zeros where this rank got no gradient
                unit.start_reduce(self.collectives)
                unit.ready_to_reduce = False
        self._launch_cursor = 0

    def _launch_ready_reductions(self) -> None:
        """Starts reductions in one fixed order (reverse unit order, i.e. backward order) on every
        rank: a unit complete out of turn waits for the units before it. A rank whose backward
        skipped a parameter then defers the same units to finish_grad_sync, in the same order,
        instead of issuing collectives in an order the other ranks do not."""
        while self._launch_cursor < len(self._launch_order):
            unit = self._launch_order[self._launch_cursor]
            if not unit.ready_to_reduce:
                return
            unit.start_reduce(self.collectives)
            unit.ready_to_reduce = False
            self._launch_cursor += 1

    def _done_with_backward(self, unit: ShardedUnit) -> None:
        if unit in self._backward_held:
            self._backward_held.discard(unit)
            self.release(unit)

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        """Reduces what backward left, continuing the fixed launch order, and waits for all.

        Every trainable unit not launched yet is reduced, with a zero gradient where this rank has
        none: another rank may have one, and all ranks must issue the same collectives.
        """
        if self.sync_enabled:
            if self._backward_task is None or not self._backward_synced:
                # gradients accumulated under no_sync only: reduce every unit now, in order
                self._backward_task, self._backward_synced = -1, True
                self._launch_cursor = 0
            self._launch_remaining()
            self._backward_task = None
            for unit in self.units:
                unit.finish_reduce()
        self.end_backward()

    def end_backward(self) -> None:
        """Frees whatever backward still holds (units with parameters that got no gradient)."""
        for unit in list(self._backward_held):
            self._done_with_backward(unit)
        for unit in self.units:
            unit.ready = 0  # a parameter without a gradient must not count toward the next backward
            unit.pending_input_grads = 0
            unit.grads_complete = False
        if self._forward_order or self._backward_order:
            self._recording = False
        self._forward_calls = 0
        self._call_stack.clear()
        self._backward_visited.clear()
        self.free_idle()

    def free_idle(self) -> None:
        """Frees units nobody holds, e.g. prefetched ones the step did not use."""
        for unit in self.units:
            if unit.refcount == 0:
                unit.free()

    @torch.no_grad()
    def refresh_gathered(self) -> None:
        """After a step: units whose full parameters are in memory re-gather the updated shards."""
        for unit in self.units:
            unit.finish_gather()  # a prefetch still in flight carries the old values: redo it
            if unit.state is UnitState.GATHERED:
                unit.state = UnitState.SHARDED  # the storage stays; only its contents are refreshed
                self._start_gather(unit, _GatherFor.REFRESH)
                unit.finish_gather()

    @torch.no_grad()
    def gather_to_cpu(self, from_master: bool) -> None:
        """Gives every parameter its own whole CPU tensor, unit by unit (used at teardown); with
        ``from_master``, the fp32 master values (a bf16/fp16-mixed model goes back to fp32)."""
        self.absorb_writes(through_data=True)
        for unit in self.units:
            if from_master and unit.master is not unit.shard:
                values = {sp: value.to("cpu", copy=True) for sp, value in unit.gather_master_values(self.collectives).items()}
            else:
                self.acquire(unit)
                values = {sp: sp.param.detach().to("cpu", copy=True) for sp in unit.params}
            unit.refcount = 0
            unit.persistent = False
            unit.free()
            for sp, value in values.items():
                sp.param.data = value

    # ------------------------------------------------------------------ whole parameters on demand
    @contextlib.contextmanager
    def gathered(self, writeback: bool = True) -> Iterator[None]:
        """All units gathered, for reading or modifying full parameters; changes are kept."""
        for unit in self.units:
            self.acquire(unit)
        try:
            yield
        finally:
            for unit in self.units:
                if writeback:
                    unit.write_back_changed()
                unit._forget_writes()  # written back above, or to be dropped
            for unit in self.units:
                self.release(unit)

    @contextlib.contextmanager
    def true_shapes(self) -> Iterator[None]:
        """Parameters of sharded units show their true shape, dtype and device, with zeros for
        values and no memory behind them (a stride-0 view), e.g. while configure_optimizers groups
        parameters by ``p.dim()`` or a fused optimizer checks their devices; writes raise."""
        sharded = [unit for unit in self.units if unit.state is not UnitState.GATHERED]
        for unit in sharded:
            zero = torch.zeros((), dtype=unit.param_dtype, device=unit.device)
            for sp in unit.params:
                if not sp.param.is_meta:
                    sp.param.data = zero.expand(sp.shape)
        try:
            yield
        finally:
            for unit in sharded:
                unit._point_params_at_shard()

    def absorb_writes(self, through_data: bool = False) -> None:
        """Takes in-place writes to parameters into the shards and masters, in every unit (see
        [Note: a stage-3 parameter outside its gather]); cheap when nothing was written. With
        ``through_data``, also writes through ``.data`` (a comparison of every shard)."""
        for unit in self.units:
            unit.absorb_data_writes() if through_data else unit.absorb_writes()

    def param_pieces(self) -> list[ParamPiece]:
        """Every parameter's fp32 master piece on this rank (frozen ones included)."""
        self.absorb_writes(through_data=True)  # a checkpoint reads the masters
        return [sp.piece(sp.master) for unit in self.units for sp in unit.params]

    @torch.no_grad()
    def publish_masters(self) -> None:
        """After the masters were written (a checkpoint load): the parameter shards take their
        values, and units gathered now re-gather (a collective)."""
        for unit in self.units:
            unit.publish_master(unit.params, staged=False)
        self.refresh_gathered()

    @torch.no_grad()
    def full_state_dict(self, to: int = 0) -> dict[str, Tensor]:
        """The module's state dict with whole parameters, on rank ``to`` (CPU); others get {}.

        A collective: units are gathered one at a time, so no rank holds the whole model on the device.
        """
        keep = self.collectives.rank == to
        self.absorb_writes(through_data=True)
        names = {sp.param: sp.name for sp in self.sharded_params.values()}
        result: dict[str, Tensor] = {}
        for unit in self.units:
            if unit.master is not unit.shard:
                # bf16/fp16 parameters: the checkpoint keeps the fp32 master values
                values = unit.gather_master_values(self.collectives)
                if keep:
                    result.update({names[sp.param]: value.cpu().clone() for sp, value in values.items()})
                continue
            self.acquire(unit)
            if keep:
                for sp in unit.params:
                    result[names[sp.param]] = sp.param.detach().cpu().clone()
            self.release(unit)
        if not keep:
            return {}
        state = {}
        for key, value in self.module.state_dict(keep_vars=True).items():
            if isinstance(value, nn.Parameter) and value in names:
                state[key] = result[names[value]]
            else:
                state[key] = value.detach().cpu().clone() if isinstance(value, Tensor) else value
        return state

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Loads whole parameters (and buffers) into this rank's pieces; every rank passes the same dict."""
        param_keys = {}
        for key, value in self.module.state_dict(keep_vars=True).items():
            if isinstance(value, nn.Parameter) and value in self.sharded_params:
                param_keys[self.sharded_params[value].param] = key
        missing = [k for k in param_keys.values() if k not in state]
        unexpected = [k for k in state if k not in self.module.state_dict(keep_vars=True)]
        if strict and (missing or unexpected):
            raise KeyError(f"State dict does not match the model: missing keys {missing[:10]}, unexpected keys"
                           f" {unexpected[:10]}. Load a checkpoint of this model, or pass strict=False.")
        for unit in self.units:
            for sp in unit.params:
                key = param_keys.get(sp.param)
                if key is None or key not in state:
                    continue
                value = state[key]
                if tuple(value.shape) != tuple(sp.shape):
                    raise ValueError(f"'{key}' has shape {tuple(value.shape)} in the state dict but"
                                     f" {tuple(sp.shape)} in the model.")
                padded = torch.zeros(sp.full_range.size, dtype=unit.master_dtype, device=unit.shard.device)
                padded[: sp.numel].copy_(value.reshape(-1))
                piece = padded[unit.rank * sp.shard_numel : (unit.rank + 1) * sp.shard_numel]
                sp.shard.copy_(piece)
                if unit.master is not unit.shard:
                    sp.master.copy_(piece)
                if unit.state is UnitState.GATHERED:
                    sp.full_range.slice(unit.full).copy_(padded)
        buffers = {k: v for k, v in state.items() if k not in param_keys.values()}
        for key, buffer in self.module.named_buffers():
            if key in buffers:
                buffer.copy_(buffers[key])


def _innermost_prefix(prefix: str, candidates: Iterable[str]) -> str:
    """The longest candidate module prefix that contains the module at ``prefix`` ("" contains all)."""
    return max((c for c in candidates if c == "" or prefix == c or prefix.startswith(c + ".")), key=len)


def _choose_unit_modules(module: nn.Module, unit_classes: Sequence[str], min_unit_numel: int) -> dict[str, nn.Module | None]:
    """Module prefixes that become units ("" is the root, always a unit).

    With ``unit_classes``, every module of those classes is a unit. Otherwise modules are chosen
    bottom-up among the root's children and the elements of containers (ModuleList, Sequential,
    ModuleDict), the modules a forward calls as a whole: a module nested deeper may have its
    parameters read by its parent without its own forward running (e.g. MultiheadAttention's
    out_proj), so no hook of its own would gather them. A candidate becomes a unit once the
    parameters under it that no smaller unit took reach ``min_unit_numel``; small modules are
    grouped into their parent's unit.
    """
    units: dict[str, nn.Module | None] = {"": module}
    if unit_classes:
        wanted = set(unit_classes)
        for prefix, submodule in module.named_modules():
            if prefix and type(submodule).__name__ in wanted:
                units[prefix] = submodule
        present = {type(m).__name__ for m in units.values() if m is not module}
        if wanted - present:
            classes = sorted({type(m).__name__ for m in module.modules()})
            raise ValueError(
                f"ZeroConfig.unit_modules names {sorted(wanted - present)}, but the model has no module of that"
                f" class. Its module classes are: {classes}."
            )
        return units
    taken: set[int] = set()
    containers = (nn.ModuleList, nn.Sequential, nn.ModuleDict)

    def visit(prefix: str, submodule: nn.Module, eligible: bool) -> int:
        free = 0
        for child_name, child in submodule.named_children():
            child_eligible = submodule is module or isinstance(submodule, containers)
            free += visit(f"{prefix}.{child_name}" if prefix else child_name, child, child_eligible)
        for param in submodule.parameters(recurse=False):
            if id(param) not in taken:
                taken.add(id(param))
                free += param.numel()
        if prefix and eligible and free >= min_unit_numel:
            units[prefix] = submodule
            return 0
        return free

    visit("", module, False)
    return units


class Zero3Optimizer(ShardedOptimizer):
    """Steps a torch optimizer over this rank's pieces of every stage-3 parameter.

    The wrapped optimizer sees one fp32 master tensor per parameter (this rank's piece, a view
    into its unit's master shard), so param groups need no relation to the unit layout.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        engine: Zero3Engine,
        config: ZeroConfig,
        loss_scaler: LossScaler | None = None,
    ) -> None:
        super().__init__(optimizer, engine.collectives, config, loss_scaler)
        self.engine = engine
        self.groups: list[list[ShardedParam]] = []
        self._master_of: dict[int, tuple[Tensor, Tensor]] = {}  # id(ShardedParam) -> (master, grad)
        self._local_index: dict[int, int] = {}
        for number, group in enumerate(optimizer.param_groups):
            members = []
            for param in group["params"]:
                sp = engine.sharded_params.get(param)
                if sp is None:
                    raise ValueError(
                        f"Param group {number} of {type(optimizer).__name__} holds a parameter of shape"
                        f" {tuple(param.shape)} that is not a parameter of the LightningModule; ZeRO can only"
                        " shard the module's own parameters. Build the optimizer from self.parameters()."
                    )
                if not param.requires_grad:
                    continue
                master, grad = sp.master, sp.master_grad
                master.grad = grad
                self._master_of[id(sp)] = (master, grad)
                self._local_index[id(sp)] = len(self._local_index)
                members.append(sp)
            self.groups.append(members)
        self._units = list(dict.fromkeys(sp.unit for members in self.groups for sp in members))
        self._staging = {
            id(self._master_of[id(sp)][0]): sp.shard_range.slice(sp.unit.staging)
            for sp in self.params
            if sp.unit.staging is not None
        }
        self.comm_device = engine.device
        engine.add_grad_listener(self._on_grad)
        self._finish_init(len(self._local_index))

    @property
    def params(self) -> Iterator[ShardedParam]:
        for members in self.groups:
            yield from members

    def _on_grad(self, sp: ShardedParam) -> None:
        index = self._local_index.get(id(sp))
        if index is not None:
            self._had_grad[index] = 1
            self._sync_state = SyncState.PENDING

    # ------------------------------------------------------------------ layout
    def _master_grads(self) -> Iterator[Tensor]:
        return (self._master_of[id(sp)][1] for sp in self.params)

    def _group_masters(self) -> list[list[Tensor]]:
        return [[self._master_of[id(sp)][0] for sp in members] for members in self.groups]

    def _trained_masters(self, had_grad: Tensor) -> list[list[Tensor]]:
        return [
            [self._master_of[id(sp)][0] for sp in members if had_grad[self._local_index[id(sp)]]]
            for members in self.groups
        ]

    def param_pieces(self) -> list[ParamPiece]:
        return [sp.piece(self._master_of[id(sp)][0]) for sp in self.params]

    def publish_params(self) -> None:
        self.engine.publish_masters()

    def memory_tensors(self) -> tuple[list[Tensor], list[Tensor | None], list[Tensor]]:
        grads: list[Tensor | None] = [unit.master_grad for unit in self._units]
        grads += [unit.grad_data for unit in self._units]
        params = [unit.shard for unit in self.engine.units]
        return params, grads, [unit.master for unit in self._units if unit.master is not unit.shard]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous = self.engine.sync_enabled
        self.engine.sync_enabled = False
        try:
            yield
        finally:
            self.engine.sync_enabled = previous

    def finish_grad_sync(self) -> None:
        # Called before every step (and clipping): values user code wrote into parameters reach
        # the masters before the optimizer reads them.
        self.engine.absorb_writes()
        if self._sync_state is SyncState.SYNCED:
            return
        with torch.profiler.record_function("zero3::finish_grad_sync"):
            self.engine.finish_grad_sync()
        self._sync_state = SyncState.SYNCED

    def _publish_params(self) -> None:
        with torch.no_grad():
            for unit in self._units:
                members = [sp for sp in self.params if sp.unit is unit]
                staged = all(id(self._master_of[id(sp)][0]) in self._fused_last for sp in members)
                unit.publish_master(members, staged=staged)
        self.engine.refresh_gathered()

    def _drop_local_grads(self) -> None:
        self.engine._launch_remaining()  # what other ranks launched, this one must too before dropping
        mine = {id(sp) for sp in self.params}
        for unit in self._units:
            if all(id(sp) in mine for sp in unit.params if sp.param.requires_grad):
                unit.drop_grads()
            else:
                # Shared with another optimizer: keep its gradients, drop only ours (our master
                # pieces are zeroed by zero_grad after this).
                unit.finish_reduce()
                if unit.grad_data is not None:
                    by_rank = unit.grad_data.view(unit.world_size, unit.shard_numel)
                    for sp in unit.params:
                        if id(sp) in mine:
                            by_rank[:, sp.shard_range.start : sp.shard_range.end].zero_()
        for sp in self.params:
            sp.param.grad = None

    # ------------------------------------------------------------------ state dict
    @torch.no_grad()
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gathers the full optimizer state, in torch's format, onto rank ``to`` (collective)."""
        keep = self.collectives.rank == to
        index_of = self._param_indices()
        state: dict[int, dict[str, Any]] = {}
        for sp in self.params:
            master = self._master_of[id(sp)][0]
            entry: dict[str, Any] = {}
            for key, value in sorted(self.optimizer.state.get(master, {}).items()):
                if isinstance(value, Tensor) and value.dim() == 1 and value.numel() == sp.shard_numel:
                    # on the communication device: offloaded state lives on the CPU, NCCL cannot gather it
                    full = torch.empty(sp.shard_numel * self.collectives.world_size, dtype=value.dtype,
                                       device=self.comm_device)
                    self.collectives.all_gather(full, value.to(self.comm_device).contiguous()).wait()
                    value = full[: sp.numel].view(sp.shape).cpu()
                elif isinstance(value, Tensor):
                    value = value.clone()
                entry[key] = value
            if keep and entry:
                state[index_of[sp.param]] = entry
        self._consolidated = {"state": state, "param_groups": self._indexed_param_groups(index_of)} if keep else None

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        saved_index = self._begin_load(state_dict)
        rank = self.collectives.rank
        for sp in self.params:
            saved = state_dict["state"].get(saved_index[sp.param])
            if not saved:
                continue
            master = self._master_of[id(sp)][0]
            entry: dict[str, Any] = {}
            for key, value in saved.items():
                if isinstance(value, Tensor) and value.dim() > 0:
                    if tuple(value.shape) != tuple(sp.shape):
                        raise ValueError(
                            f"Optimizer state '{key}' of parameter '{sp.name}' has shape {tuple(value.shape)}, but the"
                            f" parameter has shape {tuple(sp.shape)}: the state comes from a different model."
                        )
                    padded = torch.zeros(sp.full_range.size, dtype=value.dtype, device=master.device)
                    padded[: sp.numel].copy_(value.reshape(-1))
                    entry[key] = padded[rank * sp.shard_numel : (rank + 1) * sp.shard_numel].clone()
                elif isinstance(value, Tensor):
                    on_device = self.optimizer.defaults.get("fused") or self.optimizer.defaults.get("capturable")
                    entry[key] = value.clone().to(master.device) if on_device else value.clone()
                else:
                    entry[key] = value
            self.optimizer.state[master] = entry
