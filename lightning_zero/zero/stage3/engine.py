"""ZeRO stage 3's engine: a module's parameters sharded into units, moved in and out as it runs.

See [Note: stage-3 layout] in unit.py, [Note: stage-3 lifecycle] in hooks.py and [Note: one
unit per dtype] in partition.py.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.config import ZeroConfig
from lightning_zero.zero.comm import Collectives, CountingCollectives
from lightning_zero.zero.layout import DataWriteCheck, ParamPiece
from lightning_zero.zero.reduce import ReduceSchedule
from lightning_zero.zero.stage3.hooks import GatherOrder, Phase, StepState, Zero3Hooks, _GatherFor
from lightning_zero.zero.stage3.partition import (
    SmallUnitsWarning,
    build_units,
    check_dtypes,
    param_like,
    replace_meta_params,
    small_units_message,
)
from lightning_zero.zero.stage3.unit import ShardedParam, ShardedUnit, UnitState


class Zero3Engine(Zero3Hooks):
    """Shards a module's parameters into units and moves them in and out as the module runs.
    Implements :class:`~lightning_zero.zero.engine.ZeroEngine`."""

    stage_shards_params = True

    def __init__(
        self,
        module: nn.Module,
        collectives: Collectives | CountingCollectives,
        config: ZeroConfig,
        param_dtype: torch.dtype | None,
        device: torch.device,
    ) -> None:
        """
        Args:
            module: the model whose parameters are sharded (real, or on the meta device).
            collectives: the data-parallel group's collectives.
            config: ZeRO settings (units, persistence, prefetch, offload, reduce dtype).
            param_dtype: the dtype parameters are held in (bf16/fp16 for mixed precision), or ``None``.
            device: the training device (gathers and gradients live there).
        """
        check_dtypes(module)
        self.module = module
        self.config = config
        self.collectives = collectives
        self.device = device
        self.check_gather_order = config.check_gather_order
        self.prefetch_units = config.prefetch_units
        self.prefetch_bytes = config.prefetch_bytes
        self.units: list[ShardedUnit] = build_units(module, collectives, config, param_dtype, device)
        message = small_units_message(self.units, str(getattr(collectives, "backend", "")), config)
        if message is not None and getattr(collectives, "rank", 0) == 0:  # the same units on every rank: one warning
            warnings.warn(message, SmallUnitsWarning, stacklevel=2)
        self._from_meta = replace_meta_params(module, self.units)  # what materialize_and_shard initializes
        self.sharded_params: dict[nn.Parameter, ShardedParam] = {sp.param: sp for unit in self.units for sp in unit.params}
        self.schedule = ReduceSchedule([], collectives)  # its launch order is set by install_hooks
        self.peak_param_bytes = 0
        self.phase = Phase.BUILT
        self.order = GatherOrder()
        self.step = StepState()
        self._grad_listeners: list[Callable[[ShardedParam], None]] = []
        self._hook_handles: list[Any] = []
        self._grad_hooked: set[ShardedParam] = set()
        self._root_held = False
        self.data_writes = DataWriteCheck()  # see [Note: writes through .data] in layout.py
        # Parameters outside every other unit (one unit per dtype, see [Note: one unit per dtype]).
        self.root_units = [u for u in self.units if u.module is module]
        self._registrations: list[tuple[str, nn.Module, str, nn.Parameter]] = []
        self.record_registrations()

    @property
    def root_unit(self) -> ShardedUnit | None:
        """The root unit of the parameters' main dtype (the only one when they have one dtype)."""
        return self.root_units[0] if self.root_units else None

    def wrap_optimizer(self, optimizer: Optimizer, loss_scaler: Any = None) -> Any:
        from lightning_zero.zero.stage3.optimizer import Zero3Optimizer

        return Zero3Optimizer(optimizer, self, self.config, loss_scaler=loss_scaler)

    def record_registrations(self) -> None:
        """Remembers which parameter object each module holds, to detect replacements later."""
        module = self.module
        self._registrations = [
            (prefix, submodule, name, param)
            for prefix, submodule in module.named_modules()
            for name, param in submodule.named_parameters(recurse=False)
        ]


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

    def explain_backward_error(self, error: RuntimeError) -> str | None:
        """What autograd's "invalid gradient" error means under ZeRO-3, or None for other errors."""
        if "returned an invalid gradient" not in str(error):
            return None
        return (
            "Under ZeRO-3 this usually means the loss used a parameter outside the forward of its"
            " module, e.g. a regularizer over self.parameters() in training_step: there a parameter is this"
            " rank's 1-d piece (see the README's ZeRO-3 section). Compute such terms inside a module's forward"
            " (where its parameters are gathered), use the optimizer's weight_decay for an L2 penalty, or keep"
            " those parameters whole with ZeroConfig(param_persistence_threshold=...)."
        )

    # ------------------------------------------------------------------ set-up
    def shard(self) -> None:
        """Takes this rank's pieces of the (real, whole) parameters and frees the rest, unit by unit."""
        for unit in self.units:
            unit.take_shards_from_params()
            unit.free()
        self._track_memory()
        self.phase = Phase.IDLE

    def materialize_and_shard(self, init: Callable[[nn.Module], None]) -> None:
        """For parameters on the meta device: modules are initialized one at a time by ``init``
        (in registration order, as ``module.apply`` would), with only the units owning that module's
        parameters allocated; a unit is cut down to this rank's pieces as soon as all its modules
        are done. The full model never exists on any rank. Modules built whole beside them (in
        __init__, e.g. a pretrained backbone under a head built in configure_model) keep their
        values: their parameters are copied into the unit, not initialized again."""
        modules = [m for m in self.module.modules() if any(True for _ in m.parameters(recurse=False))]
        pending: dict[ShardedUnit, set[nn.Module]] = {unit: set() for unit in self.units}
        for submodule in modules:
            for param in submodule.parameters(recurse=False):
                pending[self.sharded_params[param].unit].add(submodule)
        touched: set[ShardedUnit] = set()
        for submodule in modules:
            needed = list(dict.fromkeys(self.sharded_params[p].unit for p in submodule.parameters(recurse=False)))
            for unit in needed:
                if unit not in touched:
                    whole = [(sp, sp.param.data) for sp in unit.params if sp.param not in self._from_meta]
                    unit.allocate()
                    with torch.no_grad():
                        for sp, value in whole:
                            unit.view_of(sp).copy_(value)
                    touched.add(unit)
                else:
                    self._gather(unit, order=None)  # already cut: a tied weight written again
            if any(p in self._from_meta for p in submodule.parameters(recurse=False)):
                init(submodule)
            for unit in needed:
                pending[unit].discard(submodule)
                if not pending[unit]:
                    # Hybrid sharding: every replica holds these pieces, so all start from the first's.
                    self.collectives.broadcast_to_replicas(unit.full)
                    unit.take_shards_from_params()
                    if unit.persistent and self.collectives.world_size > 1:
                        self.collectives.broadcast(unit.full, 0)  # whole on every rank: must agree
                        unit.take_shards_from_params()
                    unit.free()
                    self._track_memory()
        self.phase = Phase.IDLE

    def shard_from(self, source: PiecesSource) -> None:
        """Takes every parameter's value from another engine's pieces of the same module, unit by
        unit (see [Note: re-sharding a module left in pieces]): the full model never exists on any
        rank."""
        unset = [sp.name for sp in self.sharded_params.values() if sp.param in self._from_meta
                 and sp.name not in source.by_name]
        if unset:  # before any collective; every rank has the same module
            raise ValueError(
                f"Parameters {unset[:5]} are on the meta device, but this module is being re-sharded from the pieces"
                " an earlier run left, which hold no value for them. Build them with real values (or gather the"
                " module first: lightning_zero.gather_after_error(module) on every rank).")
        for unit in self.units:
            unit.take_shards_from_params(source.values_for(unit))
            source.consumed(unit)
            unit.free()
            self._track_memory()
        source.finish()
        self.phase = Phase.IDLE

    def _track_memory(self) -> None:
        live = sum(u.shard.numel() * u.shard.element_size() for u in self.units)
        live += sum(u.full.untyped_storage().nbytes() for u in self.units)
        self.peak_param_bytes = max(self.peak_param_bytes, live)

    # ------------------------------------------------------------------ gradients
    def add_grad_listener(self, listener: Callable[[ShardedParam], None]) -> None:
        self._grad_listeners.append(listener)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.schedule.no_sync():
            yield

    def begin_backward(self) -> None:
        """A backward starts: one round of unit reductions (see [Note: what one backward is] in reduce.py)."""
        self.schedule.begin_backward()

    def close_backward(self) -> None:
        self.schedule.close_backward()

    def absorb_param_grads(self) -> None:
        """Only a pipeline's zero-bubble backward leaves gradients outside the hooks, and stage 3
        does not run in a pipeline (ZeroConfig refuses it)."""

    def has_leftover_grads(self) -> bool:
        return self.schedule.leftover

    def expect_leftover_grads(self) -> None:
        self.schedule.leftover = True

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        """Reduces what backward left, continuing the fixed launch order, and waits for all (every
        trainable unit not launched yet goes out, with zeros where this rank has no gradient: all
        ranks must issue the same collectives); then ends the backward."""
        self.schedule.finish()
        self.end_backward()

    # ------------------------------------------------------------------ after a step
    @torch.no_grad()
    def refresh_gathered(self) -> None:
        """After a step: units whose full parameters are in memory re-gather the updated shards."""
        for unit in self.units:
            unit.finish_gather()  # a prefetch still in flight carries the old values: redo it
            if unit.state is UnitState.GATHERED:
                unit.state = UnitState.SHARDED  # the storage stays; only its contents are refreshed
                self._start_gather(unit, _GatherFor.REFRESH)
                unit.finish_gather()

    @staticmethod
    def handed_back_dtype(sp: ShardedParam, from_master: bool) -> torch.dtype:
        """The dtype ``gather_to_cpu(from_master)`` hands ``sp`` back in."""
        return sp.built_dtype if from_master and sp.unit.master is not sp.unit.shard else sp.unit.param_dtype

    def whole_bytes(self, from_master: bool) -> int:
        """Bytes of every parameter whole, as ``gather_to_cpu(from_master)`` would hand them back."""
        return sum(sp.numel * self.handed_back_dtype(sp, from_master).itemsize for sp in self.sharded_params.values())

    def whole_values(self, unit: ShardedUnit, from_master: bool) -> dict[ShardedParam, Tensor]:
        """Each parameter of ``unit`` whole, on the training device (a collective unless the unit
        is whole already): with ``from_master``, its master values (fresh tensors); else the unit
        is acquired and the values are views of its full buffer, valid until it is freed."""
        if from_master and unit.master is not unit.shard:
            return unit.gather_master_values(self.collectives)
        self.acquire(unit)
        return {sp: sp.param.detach() for sp in unit.params}

    @torch.no_grad()
    def gather_to_cpu(self, from_master: bool) -> None:
        """Gives every parameter its own whole CPU tensor, unit by unit (used at teardown); with
        ``from_master``, the master values in the dtype each was built in (a bf16/fp16-mixed model
        built in fp32 goes back to fp32, a parameter built in bf16 stays bf16, as under DDP)."""
        self._enter("gather_to_cpu")
        self.absorb_writes(through_data=True)
        for unit in self.units:
            values = {sp: value.to("cpu", dtype=self.handed_back_dtype(sp, from_master), copy=True)
                      for sp, value in self.whole_values(unit, from_master).items()}
            unit.refcount = 0
            unit.persistent = False
            unit.free()
            for sp, value in values.items():
                sp.param.data = value
        self.phase = Phase.HANDED_BACK

    # ------------------------------------------------------------------ whole parameters on demand
    @contextlib.contextmanager
    def gathered(self, writeback: bool = True) -> Iterator[None]:
        """All units gathered, for reading or modifying full parameters; changes are kept."""
        if self.phase is Phase.HANDED_BACK:
            yield  # every parameter is whole already
            return
        self._enter("gathered()")
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
        if self.phase is Phase.HANDED_BACK:
            sharded = []  # every parameter is whole already
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

    def absorb_writes(self, through_data: bool = False) -> bool:
        """Takes in-place writes to parameters into the shards and masters, in every unit (see
        [Note: a stage-3 parameter outside its gather]); cheap when nothing was written. With
        ``through_data``, also writes through ``.data`` (a comparison of every shard); returns
        whether it found one."""
        if self.phase is Phase.HANDED_BACK:
            return False  # the parameters are the module's own tensors now; the masters keep the trained values
        found = False
        for unit in self.units:
            if through_data:
                found = unit.absorb_data_writes() or found
            else:
                unit.absorb_writes()
        return found

    def trained_params(self) -> set[nn.Parameter]:
        return {sp.param for sp in self.sharded_params.values() if sp.trained}

    def param_pieces(self) -> list[ParamPiece]:
        """Every parameter's fp32 master piece on this rank (frozen ones included)."""
        if self.phase is Phase.TAKEN:
            self._enter("a checkpoint save")  # raises, naming the way on
        self.absorb_writes(through_data=True)  # a checkpoint reads the masters
        return [sp.piece() for unit in self.units for sp in unit.params]

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
        if self.phase is Phase.HANDED_BACK:
            return self.module.state_dict()  # every parameter is whole already
        self._enter("full_state_dict()")
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
        if self.phase is Phase.HANDED_BACK:
            self.module.load_state_dict(state, strict=strict)  # every parameter is whole already
            return
        self._enter("load_full_state_dict()")
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
                padded = sp.padded(value, unit.master_dtype, unit.shard.device)
                piece = sp.own_piece(padded)
                sp.shard.copy_(piece)
                if unit.master is not unit.shard and sp.has_master:
                    sp.master.copy_(piece)
                if unit.state is UnitState.GATHERED:
                    sp.full_range.slice(unit.full).copy_(padded)
        buffers = {k: v for k, v in state.items() if k not in param_keys.values()}
        for key, buffer in self.module.named_buffers():
            if key in buffers:
                buffer.copy_(buffers[key])



# [Note: re-sharding a module left in pieces]
# After an error, or a hand-back the host could not hold ([Note: pieces after an error] and [Note:
# a hand-back that does not fit] in strategy.py), a module's parameters are each rank's pieces and
# the engine that cut them is kept beside it. The next stage-3 setup of that module (without a
# tensor or pipeline mesh) builds its new engine from those pieces instead of gathering the module
# whole first: the module's parameters become meta parameters of their true shapes and dtypes (as
# if built in configure_model, attributes kept), the new engine lays its units out over them, and
# each new unit takes its values from the old engine's units, gathered as the new units need them
# (a collective per old unit, in the new units' order, the same on every rank) and released once
# all their parameters are taken. With the same units, at most one old and one new unit are whole
# at once; a coarser new unit holds the old units it spans. So a module the host cannot hold whole
# trains, validates or predicts again, and a change of unit layout, precision or offload between
# the runs is just another new layout. -mixed runs take the fp32 masters (and norm statistics go
# back to their weights' dtype, as a hand-back leaves them), so the result is that of gathering first.


class PiecesSource:
    """A module whose parameters another engine holds in pieces, taken for re-sharding (see [Note:
    re-sharding a module left in pieces]): on construction each of the module's parameters that
    the engine holds becomes a meta parameter of its true shape; a new engine built over the module
    then reads the whole values from the old engine, one of its units at a time (a collective per
    old unit that is not whole already: every rank asks for the same units in the same order).
    ``put_back`` restores the pieces where the new engine could not be built."""

    def __init__(self, engine: Zero3Engine, from_master: bool) -> None:
        """
        Args:
            engine: the engine whose units hold this rank's pieces of its module.
            from_master: read the fp32 masters (after -mixed training) rather than the shards.
        """
        engine._enter("re-sharding")
        engine.absorb_writes(through_data=True)  # writes through .data into the pieces are kept
        self.engine = engine
        self.from_master = from_master
        # every place a parameter is registered (ties included), to put the pieces back there
        self._registrations = [(submodule, name, param) for submodule in engine.module.modules()
                               for name, param in submodule._parameters.items() if param is not None]
        old_of: dict[nn.Parameter, ShardedParam] = {}  # meta parameter -> the piece it stands for
        meta: dict[nn.Parameter, nn.Parameter] = {}
        for submodule, name, param in self._registrations:
            sp = engine.sharded_params.get(param)
            if sp is None:
                continue  # replaced since (a new head): the new engine takes its own value
            if param not in meta:
                dtype = Zero3Engine.handed_back_dtype(sp, from_master)
                meta[param] = param_like(param, torch.empty(sp.shape, dtype=dtype, device="meta"))
                old_of[meta[param]] = sp
            submodule._parameters[name] = meta[param]
        # By the names the parameters have now (a module wrapped since, e.g. by peft, renames them).
        self.by_name: dict[str, ShardedParam] = {
            name: old_of[param] for name, param in engine.module.named_parameters() if param in old_of}
        self._wanted = set(self.by_name.values())
        self._open: dict[ShardedUnit, tuple[dict[ShardedParam, Tensor], set[ShardedParam]]] = {}  # values, still to take

    def put_back(self) -> None:
        """Registers the pieces again where the meta parameters stand (before a new engine took any)."""
        self.close()
        for submodule, name, param in self._registrations:
            submodule._parameters[name] = param

    @torch.no_grad()
    def values_for(self, unit: ShardedUnit) -> dict[ShardedParam, Tensor]:
        """The whole value of each parameter of the new ``unit`` that was taken from the pieces
        (gathering the old units needed); the others keep their own."""
        values: dict[ShardedParam, Tensor] = {}
        for sp in unit.params:
            old = self.by_name.get(sp.name)
            if old is None:
                continue
            if old.unit not in self._open:
                self._open[old.unit] = (self.engine.whole_values(old.unit, self.from_master),
                                        {piece for piece in old.unit.params if piece in self._wanted})
            values[sp] = self._open[old.unit][0][old]
        return values

    def consumed(self, unit: ShardedUnit) -> None:
        """The new ``unit`` holds its values: old units none of whose values are left go."""
        for sp in unit.params:
            old = self.by_name.get(sp.name)
            entry = self._open.get(old.unit) if old is not None else None
            if entry is not None:
                entry[1].discard(old)
                if not entry[1]:
                    self._release(old.unit)

    def close(self) -> None:
        """Releases every old unit still open."""
        for old_unit in list(self._open):
            self._release(old_unit)

    def finish(self) -> None:
        """The new engine holds every value: the old one is done with the module."""
        self.close()
        self.engine.phase = Phase.TAKEN

    def _release(self, old_unit: ShardedUnit) -> None:
        del self._open[old_unit]
        # As gather_to_cpu does: whatever held it (a forward the error interrupted, persistence),
        # the old engine is done with it.
        old_unit.refcount = 0
        old_unit.persistent = False
        old_unit.free()
