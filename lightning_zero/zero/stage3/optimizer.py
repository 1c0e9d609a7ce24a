"""ZeRO stage 3's optimizer: a torch optimizer stepped over this rank's piece of every parameter.

The wrapped optimizer sees one fp32 master tensor per parameter (this rank's piece, a view into
its unit's master shard), so param groups need no relation to the unit layout. What is specific
to stage 3 is the :class:`Zero3Layout` (which pieces belong to this optimizer, how its gradients
are reduced and its new values published); the step itself is
:class:`~lightning_zero.zero.optimizer.ShardedOptimizer`'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn
from torch.autograd.graph import increment_version
from torch.optim import Optimizer

from lightning_zero._messages import some_of
from lightning_zero.config import ZeroConfig
from lightning_zero.loss_scaler import LossScaler
from lightning_zero.offload.step import StagingBuffers
from lightning_zero.zero.device_step import adam_group_is_fusable, check_device_backend, device_adam_backend
from lightning_zero.zero.layout import ParamPiece, ShardTile
from lightning_zero.zero.optimizer import ShardedOptimizer
from lightning_zero.zero.stage3.engine import Zero3Engine
from lightning_zero.zero.stage3.unit import ShardedParam, ShardedUnit


class Zero3Layout:
    """One optimizer's parameters at stage 3: its pieces of the engine's units (see
    :class:`~lightning_zero.zero.optimizer.ShardLayout`)."""

    def __init__(self, optimizer: Optimizer, engine: Zero3Engine) -> None:
        self.engine = engine
        self.collectives = engine.collectives
        self.comm_device = engine.device
        self.on_grad: Callable[[int], None] = lambda index: None
        self.groups: list[list[ShardedParam]] = []
        # The optimizer's parameters left out because they were frozen (see [Note: the trainable set]).
        self.frozen_at_setup: dict[nn.Parameter, str] = {}
        self._local_index: dict[ShardedParam, int] = {}
        self._steps = 0  # steps taken, for the engine's data_writes
        unfrozen: list[str] = []  # frozen when the engine was built, trainable now
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
                    self.frozen_at_setup[param] = sp.name
                    continue
                if not sp.trained:
                    unfrozen.append(sp.name)
                self._local_index[sp] = len(self._local_index)
                members.append(sp)
            self.groups.append(members)
        if unfrozen:
            raise RuntimeError(
                f"The parameter(s) {some_of(unfrozen)} were frozen (requires_grad=False) when ZeRO-3 sharded the model"
                f" and are trainable in {type(optimizer).__name__} now: they have no gradient shard and would not"
                " train. The engine takes the trainable set when it shards the module (the strategy's setup, before"
                " configure_optimizers and before a module built in configure_model is initialized; under Fabric,"
                " fabric.setup): set requires_grad before then, e.g. in __init__, setup or configure_model, not in"
                " configure_optimizers or a module's reset_parameters()."
            )
        engine.hook_trainable_params()  # trained at the layout, frozen at install_hooks, trainable now
        # This optimizer's parameters of each unit, in order (the step publishes them unit by unit).
        self.members: dict[ShardedUnit, list[ShardedParam]] = {}
        for sp in self.params:
            self.members.setdefault(sp.unit, []).append(sp)
        self.units: list[ShardedUnit] = list(self.members)
        self._stage_fused_device_steps(optimizer, engine)
        self.staging: StagingBuffers | None = None
        staged = [sp for sp in self.params if sp.unit.staging is not None]
        if staged:
            self.staging = StagingBuffers()
            for sp in staged:
                assert sp.unit.staging is not None
                self.staging.add(sp.holder, sp.shard_range.slice(sp.unit.staging))
        engine.add_grad_listener(self._on_engine_grad)

    def param_name(self, param: nn.Parameter) -> str:
        """The module's name for ``param`` (its shape for a tensor the module does not hold)."""
        sp = self.engine.sharded_params.get(param)
        return sp.name if sp is not None else f"<a tensor of shape {tuple(param.shape)}>"

    def _stage_fused_device_steps(self, optimizer: Optimizer, engine: Zero3Engine) -> None:
        """Units whose fp32 masters the fused device step updates take its rounded copy straight
        into their low-precision parameter shard (see [Note: fused device step] in
        zero/device_step.py): the shard is the unit's staging buffer, and publishing copies nothing."""
        config = engine.config
        if config.offload_optimizer is None and type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
            check_device_backend(config, engine.device)
        for group, members in zip(optimizer.param_groups, self.groups):
            if not adam_group_is_fusable(optimizer, group):
                continue
            for unit in {sp.unit for sp in members}:
                fused = device_adam_backend(config, unit.master.device) is not None
                if (fused and unit.staging is None and unit.master is not unit.shard
                        and unit.master.dtype == torch.float32 and unit.master.device == unit.shard.device):
                    unit.staging = unit.shard

    @property
    def params(self) -> Iterator[ShardedParam]:
        for members in self.groups:
            yield from members

    @property
    def num_trainable(self) -> int:
        return len(self._local_index)

    @property
    def sync_pending(self) -> bool:
        return self.engine.schedule.pending

    def _on_engine_grad(self, sp: ShardedParam) -> None:
        index = self._local_index.get(sp)
        if index is not None:
            self.on_grad(index)

    # ------------------------------------------------------------------ what the optimizer steps
    def master_grads(self) -> Iterator[Tensor]:
        return (sp.holder.grad for sp in self.params)  # type: ignore[misc]

    def zero_master_grads(self) -> None:
        for unit, members in self.members.items():
            if len(members) == unit.trainable_count:
                unit.reduction.zero_master_grad()
            else:  # the unit's other parameters belong to another optimizer: its gradients stay
                for sp in members:
                    sp.holder.grad.zero_()  # type: ignore[union-attr]

    def trained_masters(self, had_grad: Tensor | None) -> list[list[Tensor]]:
        flags = None if had_grad is None else had_grad.tolist()  # one read, not one per parameter
        return [
            [sp.holder for sp in members if flags is None or flags[self._local_index[sp]]]
            for members in self.groups
        ]

    def param_pieces(self) -> list[ParamPiece]:
        return [sp.piece() for sp in self.params]

    def tiles(self) -> list[ShardTile]:
        return [unit.tile(members) for unit, members in self.members.items()]

    def memory_tensors(self) -> tuple[list[Tensor], list[Tensor | None], list[Tensor]]:
        grads: list[Tensor | None] = [unit.master_grad for unit in self.units]
        grads += [unit.grad_data for unit in self.units]
        params = [unit.shard for unit in self.engine.units]
        # Every unit's master, a frozen unit's too: it holds the frozen weights at full precision
        # (where the shard does not hold them exactly: see [Note: masters of frozen pieces]).
        return params, grads, [unit.master for unit in self.engine.units if unit.master is not unit.shard]

    # ------------------------------------------------------------------ gradients
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.engine.no_sync():
            yield

    def finish_grad_sync(self) -> None:
        with torch.profiler.record_function("zero3::finish_grad_sync"):
            self.engine.finish_grad_sync()

    def drop_local_grads(self) -> None:
        schedule = self.engine.schedule
        mine = set(self.params)
        whole = [unit for unit in self.units if all(sp in mine for sp in unit.params if sp.trained)]
        schedule.drop([unit.reduction for unit in whole])
        for unit in self.units:
            if unit in whole:
                continue
            # Shared with another optimizer: keep its gradients, drop only ours (our master
            # pieces are zeroed by zero_grad after this).
            unit.reduction.finish()
            if unit.grad_data is not None:
                by_rank = unit.grad_data.view(unit.world_size, unit.trained_numel)
                for sp in unit.params:
                    if sp in mine:
                        by_rank[:, sp.shard_range.start : sp.shard_range.end].zero_()
        for sp in self.params:
            sp.param.grad = None

    # ------------------------------------------------------------------ parameters
    @torch.no_grad()
    def publish(self) -> None:
        for unit, members in self.members.items():
            staged = self.staging is not None and self.staging.wrote_all(sp.holder for sp in members)
            unit.publish_master(members, staged=staged)
        self.engine.refresh_gathered()

    def absorb_before_step(self) -> None:
        """Before a step reads the masters: writes through the parameters, and at the steps
        [Note: writes through .data] in zero/layout.py says, writes through ``.data`` (every unit's)."""
        self.engine.data_writes.absorb(self._steps, self.engine.absorb_writes)

    def note_stepped(self, had_grad: Tensor) -> None:
        """See [Note: a step is an in-place write] in zero/optimizer.py."""
        self._steps += 1
        flags = had_grad.tolist()  # one read, not one per parameter
        for sp in self.params:
            if flags[self._local_index[sp]]:
                increment_version(sp.param)
                sp.seen_version = sp.param._version  # the step's write, not the user's

    def publish_masters(self) -> None:
        if self.staging is not None:
            self.staging.forget()
        self.engine.publish_masters()

    def absorb_writes(self, through_data: bool = False) -> bool:
        return self.engine.absorb_writes(through_data)


class Zero3Optimizer(ShardedOptimizer):
    """Steps a torch optimizer over this rank's pieces of every stage-3 parameter."""

    def __init__(
        self,
        optimizer: Optimizer,
        engine: Zero3Engine,
        config: ZeroConfig,
        loss_scaler: LossScaler | None = None,
    ) -> None:
        initial_state = self._take_optimizer(optimizer, config)
        self.engine = engine
        super().__init__(optimizer, Zero3Layout(optimizer, engine), config, loss_scaler)
        if initial_state:
            self._recreate_initial_state()

    @property
    def params(self) -> Iterator[ShardedParam]:
        return self.layout.params  # type: ignore[attr-defined, no-any-return]

    def remove_hooks(self) -> None:
        """The engine's hooks outlive any one optimizer: the strategy removes them at teardown."""


__all__ = ["Zero3Layout", "Zero3Optimizer"]
