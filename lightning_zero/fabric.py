"""``ZeroFabricStrategy``: the ZeRO engine behind Lightning Fabric.

[Note: the engine under Fabric]
A Fabric loop (litgpt's, for one) owns what the Trainer would do: it calls ``fabric.backward``,
``fabric.clip_gradients`` and ``optimizer.step()`` itself. The same engine as the Trainer's
(:func:`~lightning_zero.zero.make_engine`) is built in ``setup_module_and_optimizers``, and each
Fabric entry point does what the Trainer's hook around it does in ZeroStrategy:

* ``fabric.setup(model, optimizer)``: the ranks agree on the model, take rank 0's weights, build
  the engine over the fp32 weights, wrap each optimizer (fp32 masters), and only then cast the
  parameters to the precision's dtype. Fabric itself calls ``convert_module`` before the strategy
  sees the model, so :class:`ZeroFabricPrecision` leaves it alone there and casts here, after the
  masters were taken.
* a forward with gradients holds the stage-3 root unit (parameters outside every other unit) until
  its backward has run, as the Trainer holds it for a training step;
* ``fabric.backward``: one round of reductions on every rank (the loss scaled under fp16);
  ``fabric.no_backward_sync`` keeps gradients local (accumulation);
* ``optimizer.step()``: first the ranks agree on how many synchronized backwards they ran (see
  [Note: ranks that disagree]), then the sharded step (skipped on fp16 overflow);
* ``fabric.clip_gradients``: the global norm over every rank's shard, folded into the step;
* ``fabric.save`` / ``fabric.load``: the Trainer's sharded format (a torch.distributed.checkpoint
  directory: any world size, any stage, ``lightning-zero consolidate``). The model and the
  optimizers are saved as the Trainer saves them; every other entry of the state (a step counter,
  a scheduler's state) is the checkpoint's Lightning part. A whole checkpoint (Fabric's DDP, a
  consolidated file) loads too.

Fabric runs plain ZeRO over every rank: tensor and pipeline parallelism need the Trainer's hooks
(``configure_model``, the pipelined ``training_step``) and are refused at construction.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.fabric.strategies import DDPStrategy, _StrategyRegistry
from lightning.fabric.strategies.strategy import _BackwardSyncControl, _Sharded, _validate_keys_for_strict_loading
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.fabric.utilities.types import _PATH, Optimizable
from torch import Tensor
from torch.nn import Module, Parameter
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.checkpoint.full import load_full_checkpoint, load_module_state
from lightning_zero.checkpoint.sharded import is_sharded_checkpoint, resolve_checkpoint_path
from lightning_zero.checkpoint.state import load_checkpoint as load_sharded_checkpoint
from lightning_zero.checkpoint.state import save_checkpoint as save_sharded_checkpoint
from lightning_zero.config import ZeroConfig
from lightning_zero.deepspeed_config import DeepSpeedConfigWarning, DeepSpeedSettings
from lightning_zero.offload import CPUOffloadPolicy
from lightning_zero.parallel.mesh import sync_module_states
from lightning_zero.precision import SUPPORTED_PRECISION, ZeroPrecision, warn_frozen_rounding
from lightning_zero.strategy import (
    _auto_fp16_loss_scale,
    _check_params_in_one_optimizer,
    _do_nothing,
    _prepare_meta_build,
    _read_deepspeed,
    _resolve_config,
    _warn_if_loss_scale_left_out,
)
from lightning_zero.zero.comm import GLOO_HELD, Collectives, CountingCollectives
from lightning_zero.zero.consistency import (
    CollectiveAgreement,
    agree_before_step,
    check_same_model,
    optimizer_number,
)
from lightning_zero.zero.engine import ZeroEngine, make_engine
from lightning_zero.zero.optimizer import ShardedOptimizer
from lightning_zero.zero.stage3.generation import sync_generation

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]

# In a checkpoint's Lightning part: which entries of the state were the model and the optimizers.
_FABRIC_KEYS = "lightning_zero_fabric"


class ZeroFabricPrecision(ZeroPrecision):
    """:class:`~lightning_zero.ZeroPrecision` with Fabric's backward and step: the loss is scaled
    inside ``backward`` (Fabric ignores what ``pre_backward`` returns), no Trainer hooks run, and
    the module is cast by the strategy after the fp32 masters were taken (see [Note: the engine
    under Fabric])."""

    @override
    def convert_module(self, module: Module) -> Module:
        return module  # Fabric calls this before setup; ZeroFabricStrategy casts after the masters exist

    def cast_module(self, module: Module) -> Module:
        """The precision's cast of the parameters (ZeroPrecision.convert_module)."""
        return ZeroPrecision.convert_module(self, module)

    @override
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:  # type: ignore[override]
        return tensor

    @override
    def backward(self, tensor: Tensor, model: Any, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        if self.loss_scaler is not None:
            tensor = tensor * self.loss_scaler.scale
        tensor.backward(*args, **kwargs)

    @override
    def post_backward(self, tensor: Tensor, module: Any) -> Tensor:  # type: ignore[override]
        return tensor

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:  # type: ignore[override]
        return optimizer.step(**kwargs)

    def use_device(self, device: torch.device) -> None:
        """Autocast's device type (the Trainer's plugin learns it in ``connect``)."""
        self._device_type = device.type


class ZeroFabricStrategy(DDPStrategy, _Sharded):
    """ZeRO stage 1, 2 or 3 for Lightning Fabric, on the Trainer's engine and checkpoint format
    (see [Note: the engine under Fabric]).

    Args:
        stage: shorthand for ``config=ZeroConfig(stage=stage)``.
        config: every ZeRO setting (see :class:`~lightning_zero.ZeroConfig`); plain ZeRO only (no
            ``parallel`` or ``pipeline``).
        deepspeed_config: a DeepSpeed JSON config (its path, or the dict) instead of ``stage``/``config``
            (see [Note: DeepSpeed config import]); its clipping and accumulation are the loop's to apply.
        process_group_backend: ``"gloo"`` or ``"nccl"``; by default the one for the root device.
        timeout: collective timeout of the process group.
        start_method: ``"popen"`` (``fabric.launch()`` re-runs the script per rank), ``"spawn"``, ``"fork"``.
        collectives: a :class:`~lightning_zero.zero.Collectives` to use instead of one over the world
            group, e.g. a :class:`~lightning_zero.zero.CountingCollectives` to audit traffic.
    """

    def __init__(
        self,
        stage: int | None = None,
        config: ZeroConfig | Mapping[str, Any] | None = None,
        deepspeed_config: dict[str, Any] | str | Path | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: StartMethod = "popen",
        collectives: Collectives | CountingCollectives | None = None,
    ) -> None:
        # Before the base class, whose constructor assigns the precision plugin (read by its setter).
        self._deepspeed: DeepSpeedSettings | None = None
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io, precision=precision,
                         process_group_backend=process_group_backend, timeout=timeout, start_method=start_method)
        if deepspeed_config is not None:
            settings = _read_deepspeed(deepspeed_config, stage, config, precision, owner="ZeroFabricStrategy",
                                      precision_name="precision")
            self._deepspeed = settings
            config = settings.zero
            if settings.precision is not None:
                self._precision = ZeroFabricPrecision(settings.precision, loss_scale=settings.loss_scale)
            _warn_of_loop_settings(settings)
        self.config = _resolve_config(stage, config)
        if not self.config.parallel.is_trivial or self.config.pipeline.enabled:
            raise ValueError(
                f"ZeroFabricStrategy runs plain ZeRO over every rank, but the config has parallel={self.config.parallel}"
                f" and pipeline.size={self.config.pipeline.size}: tensor and pipeline parallelism need the Trainer"
                " (ZeroStrategy), whose configure_model and training_step hooks they use. Drop them, or use the Trainer."
            )
        self._backward_sync_control = _ZeroBackwardSyncControl(self)
        self._collectives = collectives
        self._engine: ZeroEngine | None = None
        self._module: Module | None = None
        self._optimizers: list[ShardedOptimizer] = []
        self._synced_backwards = 0  # backward calls whose gradients the next step reduces
        self._in_no_sync = False
        self._agreement = CollectiveAgreement()
        self._cast_pending = False
        # Stages 1/2: the fp32 values the cast replaced, of parameters no optimizer set up so far
        # trains, kept until the first forward (see [Note: optimizers set up one by one]).
        self._fp32_kept: dict[Parameter, Tensor] = {}
        self._rounded_for_good = False  # a forward ran after the cast: the kept values are gone
        self._forward_handle: Any = None
        self._unsync_generation: Callable[[], None] = _do_nothing  # not a lambda: spawn pickles the strategy

    @property
    def deepspeed_settings(self) -> DeepSpeedSettings | None:
        """What the ``deepspeed_config`` asked for (None without one): its ``gradient_clipping`` and
        ``gradient_accumulation_steps`` are for the loop to apply."""
        return self._deepspeed

    # ------------------------------------------------------------------ precision
    @property
    @override
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else ZeroFabricPrecision()

    @precision.setter
    @override
    def precision(self, precision: Precision | None) -> None:
        # Fabric builds a generic plugin from `precision=`; ZeRO needs its own (fp32 masters in the
        # sharded optimizer, the loss scaler in the step).
        if precision is None or isinstance(precision, ZeroFabricPrecision):
            if precision is not None:
                _warn_if_loss_scale_left_out(self._deepspeed, precision)
            self._precision = precision
        elif type(precision) in (Precision, MixedPrecision, HalfPrecision) or type(precision) is ZeroPrecision:
            current = self._precision
            flag = str(precision.precision)
            if isinstance(current, ZeroFabricPrecision) and flag in ("32-true", current.precision):
                return  # the DeepSpeed config's precision, and Fabric's default flag
            if isinstance(current, ZeroFabricPrecision):
                raise ValueError(
                    f"The DeepSpeed config asks for precision {current.precision!r} but Fabric has precision={flag!r}."
                    " Drop one: remove Fabric(precision=...), or disable the config's fp16/bf16 section.")
            if isinstance(precision, ZeroPrecision):
                _warn_if_loss_scale_left_out(self._deepspeed, precision)
                loss_scale = precision.loss_scaler.config if precision.loss_scaler is not None else None
            else:
                loss_scale = _auto_fp16_loss_scale(self._deepspeed, flag)
            self._precision = ZeroFabricPrecision(flag, loss_scale=loss_scale)
        else:
            raise ValueError(
                f"ZeroFabricStrategy does not support the precision plugin {type(precision).__name__}"
                f" (precision={getattr(precision, 'precision', None)!r}). Use Fabric(precision=...) with one of"
                f" {', '.join(map(repr, SUPPORTED_PRECISION))}, or plugins=[ZeroFabricPrecision(...)]."
            )

    def _zero_precision(self) -> ZeroFabricPrecision:
        precision = self.precision
        assert isinstance(precision, ZeroFabricPrecision)
        return precision

    # ------------------------------------------------------------------ collectives and engine
    @property
    def collectives(self) -> Collectives | CountingCollectives:
        """The collectives over the world, built once the process group exists."""
        if self._collectives is None:
            self._collectives = Collectives(group=None)
        return self._collectives

    @property
    def engine(self) -> ZeroEngine | None:
        """The stage's engine (see [Note: one engine protocol]), once a module was set up."""
        return self._engine

    def _require_engine(self, what: str) -> ZeroEngine:
        if self._engine is None:
            raise RuntimeError(
                f"ZeroFabricStrategy.{what} needs the model set up first: `model, optimizer ="
                " fabric.setup(model, optimizer)`."
            )
        return self._engine

    # ------------------------------------------------------------------ setup
    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[Module, list[Optimizer], Any]:
        if any(p.is_meta for p in module.parameters()):
            raise ValueError(
                "The model was built on the meta device (fabric.init_module(empty_init=True)); its parameters are"
                " created unit by unit in setup, so an optimizer built before then holds none of them. Set the model"
                " up first, then build the optimizer from its parameters: `model = fabric.setup_module(model)`;"
                " `optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))`."
            )
        module = self.setup_module(module)
        return module, [self.setup_optimizer(optimizer) for optimizer in optimizers], scheduler

    @override
    def setup_module(self, module: Module) -> Module:
        """Builds the engine over ``module`` (no wrapper: the parameters themselves are sharded).
        The parameters are cast to the precision's dtype once the optimizers took their fp32
        masters: after ``setup_optimizer``, or at the first forward of a model set up alone."""
        if self._engine is not None:
            raise RuntimeError(
                "ZeroFabricStrategy shards one model per Fabric: set up one module (a module holding several models"
                " is one module), or use a second Fabric for a second model."
            )
        precision = self._zero_precision()
        precision.use_device(self.root_device)
        check_same_model(module, self.collectives)  # before any collective that depends on the model
        on_meta = self.config.stage == 3 and any(p.is_meta for p in module.parameters())
        init = None
        if on_meta:
            group = torch.distributed.group.WORLD if self.world_size > 1 else None
            init = _prepare_meta_build(module, self.root_device, group)
        else:
            module.to(self.root_device)
            sync_module_states(module, torch.distributed.group.WORLD)  # rank 0's weights, as with DDP
        self._engine = make_engine(module, self.collectives, self.config, precision.param_dtype, self.root_device,
                                   init=init)
        self._module = module
        if self._engine.stage_shards_params and self.collectives.world_size > 1:
            self._unsync_generation = sync_generation(module)  # see [Note: generation at stage 3]
        self._cast_pending = precision.param_dtype is not None
        self._forward_handle = module.register_forward_pre_hook(self._before_forward)
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        engine = self._require_engine("setup_optimizer")
        precision = self._zero_precision()
        if precision.param_dtype is not None and self._rounded_for_good:
            raise RuntimeError(
                "ZeroFabricStrategy.setup_optimizer: the model already ran in the precision's dtype, so this"
                " optimizer's fp32 master weights would come from rounded values. Set up every optimizer before"
                " the first forward, best together with the model: `model, optimizer = fabric.setup(model, optimizer)`."
            )
        _check_params_in_one_optimizer([*(o.optimizer for o in self._optimizers), optimizer], self._module)
        self._restore_kept(optimizer)
        zero_optimizer = engine.wrap_optimizer(optimizer, precision.loss_scaler)
        self._optimizers.append(zero_optimizer)
        self._cast_module()
        return zero_optimizer

    # [Note: optimizers set up one by one]
    # Stages 1/2 take an optimizer's fp32 masters from its parameters when it is set up, and the
    # module is cast to the precision's dtype right after (its first forward may come through a
    # submodule no hook sees). Fabric sets several optimizers up one at a time (fabric.setup(model,
    # opt_g, opt_d), setup_optimizers(opt_g, opt_d)): so that the second one's masters are not
    # taken from values the first one's cast rounded, the cast keeps the fp32 values it replaced of
    # the parameters no optimizer trains yet, and a later optimizer's parameters take theirs back
    # before it is wrapped. The first forward drops what is left (it would round for good:
    # FrozenRoundingWarning names it) and from then on an optimizer set up is refused. Stage 3
    # keeps an fp32 master of every parameter its shards would round (see [Note: masters of
    # frozen pieces]): nothing to keep.
    def _cast_module(self) -> None:
        if self._cast_pending and self._module is not None:
            if self.config.stage != 3:
                mastered = {piece.param for optimizer in self._optimizers for piece in optimizer.param_pieces()}
                self._fp32_kept.update({param: param.data for param in self._module.parameters()
                                        if param not in mastered and param.dtype == torch.float32})
            self._zero_precision().cast_module(self._module)
            self._cast_pending = False

    def _restore_kept(self, optimizer: Optimizer) -> None:
        """The parameters of ``optimizer`` that an earlier cast rounded take back their fp32
        values (see [Note: optimizers set up one by one]); the module is cast again after."""
        for group in optimizer.param_groups:
            for param in group["params"]:
                value = self._fp32_kept.pop(param, None)
                if value is not None:
                    param.data = value
                    self._cast_pending = True

    def _drop_kept(self) -> None:
        """The first forward after the cast: what no optimizer trains keeps its rounded value."""
        if self._cast_pending or self._rounded_for_good:
            return
        warn_frozen_rounding(self._module, self.config.stage, self._zero_precision(), self._optimizers,
                             held=self._fp32_kept)
        self._fp32_kept = {}
        self._rounded_for_good = True

    def _before_forward(self, module: Module, args: Any) -> None:
        """The pending cast of a model set up without optimizers; at stage 3, a forward that
        records a graph keeps the root unit gathered for its backward (see [Note: the engine
        under Fabric]); a forward without gradients gathers it per call."""
        # Stages 1/2 keep fp32 masters only for what an optimizer trains: a -mixed model without
        # one (inference) would round for good if cast, so it runs in fp32 under autocast, as with
        # DDP, until an optimizer is set up.
        if self.config.stage == 3 or self._optimizers or not self._zero_precision().mixed:
            self._cast_module()
            self._drop_kept()
        if torch.is_grad_enabled() and self._engine is not None and self._engine.stage_shards_params:
            self._engine.hold_for_step()

    @override
    def module_to_device(self, module: Module) -> None:
        if self.config.stage == 3 and any(p.is_meta for p in module.parameters()):
            return  # materialized unit by unit in setup_module, never whole
        module.to(self.root_device)

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``fabric.init_module(empty_init=True)`` under stage 3 builds the model on the meta device;
        ``setup`` materializes it one unit at a time (each module's ``reset_parameters``)."""
        if self.config.stage == 3 and empty_init:
            return torch.device("meta")
        return super().module_init_context(empty_init=empty_init)

    @override
    def module_sharded_context(self) -> AbstractContextManager:
        return torch.device("meta") if self.config.stage == 3 else nullcontext()

    # ------------------------------------------------------------------ backward and step
    @override
    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        engine = self._require_engine("backward")
        if not self._in_no_sync:
            self._synced_backwards += 1
        # Every rank owes this backward's reductions, whatever part of the model its loss reaches.
        engine.begin_backward()
        try:
            self.precision.backward(tensor, module, *args, **kwargs)
        except RuntimeError as error:
            explanation = engine.explain_backward_error(error)
            if explanation is None:
                raise
            raise RuntimeError(f"{error}\n{explanation}") from error
        finally:
            engine.close_backward()
        engine.release_after_step()
        engine.end_backward()

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        zero_optimizer = _as_sharded(optimizer, "optimizer.step()")
        engine = self._require_engine("optimizer_step")
        backwards, self._synced_backwards = self._synced_backwards, 0
        agree_before_step(self.collectives, engine, backwards, zero_optimizer,
                          number=optimizer_number(zero_optimizer, self._optimizers))
        try:
            return self.precision.optimizer_step(zero_optimizer, **kwargs)
        finally:
            engine.release_after_step()  # a forward with gradients but no backward
            engine.end_backward()

    # ------------------------------------------------------------------ the loop's collectives
    @contextmanager
    def _agreed(self, call: str) -> Generator[None, None, None]:
        """Runs one of the loop's collectives (see [Note: ranks that disagree] in zero/consistency.py)
        after the ranks agreed they all reached it with as many backwards not stepped: a rank that
        skipped an optimizer step raises here, and so do the others, in their step or here."""
        if self._engine is None or self.world_size == 1:
            yield
            return
        with self._agreement.before(self.collectives, f"fabric.{call}", self._synced_backwards):
            yield

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        with self._agreed("barrier"):
            super().barrier(*args, **kwargs)

    @override
    def all_reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: Any = "mean") -> Tensor:
        if not _is_world(group):  # a subgroup's collective: the agreement is over every rank
            return super().all_reduce(tensor, group=group, reduce_op=reduce_op)
        with self._agreed("all_reduce"):
            return super().all_reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        if not _is_world(group):
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)
        with self._agreed("all_gather"):
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        with self._agreed("broadcast"):
            return super().broadcast(obj, src)

    @override
    def clip_gradients_norm(self, module: Module, optimizer: Optimizer, max_norm: float | int,
                            norm_type: float | int = 2.0, error_if_nonfinite: bool = True) -> Tensor:
        """The norm of the whole gradient over every rank's shard (a collective); the clip factor is
        applied in the step's single pass over the masters."""
        zero_optimizer = _as_sharded(optimizer, "fabric.clip_gradients(..., max_norm=...)")
        norm = zero_optimizer.clip_grad_norm_(float(max_norm), float(norm_type))
        # Under fp16 an overflow is the loss scaler's to handle: that step is skipped.
        if error_if_nonfinite and zero_optimizer.loss_scaler is None and not math.isfinite(float(norm)):
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} for gradients from the model's parameters is non-finite,"
                " so it cannot be clipped. Pass error_if_nonfinite=False to fabric.clip_gradients to skip the check.")
        return norm

    @override
    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        _as_sharded(optimizer, "fabric.clip_gradients(..., clip_val=...)").clip_grad_value_(float(clip_val))

    # ------------------------------------------------------------------ whole parameters
    @contextmanager
    def gathered_params(self, writeback: bool = True) -> Generator[None, None, None]:
        """Stage 3: every parameter whole for the duration, to read or modify (changes are kept).
        A collective: call it on every rank. At stages 1 and 2 parameters are always whole."""
        if self._engine is None:
            yield
            return
        with self._engine.gathered(writeback=writeback):
            yield

    @override
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        """The whole state dict (a collective at stage 3), on every rank."""
        if self._engine is not None and module is self._module:
            state = self._engine.full_state_dict(to=0)
            return self.broadcast(state)
        return module.state_dict()

    @override
    def load_module_state_dict(self, module: Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        if self._engine is not None and module is self._module:
            self._engine.load_full_state_dict(dict(state_dict), strict=strict)
        else:
            module.load_state_dict(state_dict, strict=strict)

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(self, path: _PATH, state: dict[str, Module | Optimizer | Any], storage_options: Any | None = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        """A sharded checkpoint in the Trainer's format, written by every rank (a collective)."""
        if storage_options is not None:
            raise TypeError("ZeroFabricStrategy.save_checkpoint(storage_options=...) is not supported: sharded"
                            " checkpoints are written by torch.distributed.checkpoint, not the CheckpointIO plugin.")
        engine = self._require_engine("save_checkpoint")
        model_key, optimizer_keys = self._roles(state, "fabric.save")
        sharded = [model_key, *optimizer_keys]
        filtered = sorted(set(filter or {}) & set(sharded))
        if filtered:
            raise ValueError(f"fabric.save(filter=...) cannot filter {filtered}: the model and its optimizers are"
                             " sharded over the ranks and saved whole. Filter other entries only.")
        rest = self._convert_stateful_objects_in_state(
            {k: v for k, v in state.items() if k not in sharded}, filter=filter or {})
        extra = {_FABRIC_KEYS: {"model": model_key, "optimizers": optimizer_keys}, **rest}
        with self._agreed("save"):
            target = Path(self.broadcast(str(path)))  # every rank writes into rank 0's path
            save_sharded_checkpoint(target, self._module, [state[k] for k in optimizer_keys],  # type: ignore[arg-type]
                                    engine, extra=extra)

    @override
    def load_checkpoint(self, path: _PATH, state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
                        strict: bool = True, weights_only: bool | None = None) -> dict[str, Any]:
        """Loads a sharded checkpoint (any world size and stage, written by Fabric or the Trainer)
        into the set-up model and optimizers, or a whole one (Fabric's DDP, a consolidated file);
        returns the entries not restored into ``state``."""
        engine = self._require_engine("load_checkpoint")
        source = resolve_checkpoint_path(path)
        sharded = is_sharded_checkpoint(source) or source.is_dir()
        raw_module = isinstance(state, Module)
        if isinstance(state, Module):  # fabric.load_raw(path, model)
            state = {"model": state}
        if isinstance(state, Optimizer) or not state:
            raise ValueError(
                f"ZeroFabricStrategy loads {source} into the set-up model and optimizers: pass them, e.g."
                " fabric.load(path, {'model': model, 'optimizer': optimizer}) (a sharded checkpoint is never whole"
                " on one rank; `lightning-zero consolidate` writes one file).")
        model_key, optimizer_keys = self._roles(state, "fabric.load")
        optimizers = [state[k] for k in optimizer_keys]
        lightning: dict[str, Any]
        with self._agreed("load"):
            if sharded:
                lightning = load_sharded_checkpoint(source, self._module, optimizers or None,  # type: ignore[arg-type]
                                                    engine, strict=strict)
                lightning.pop(_FABRIC_KEYS, None)
            elif raw_module:  # the file is the module's state dict, as under Fabric's own strategies
                engine.load_full_state_dict(dict(load_module_state(source)), strict=strict)
                lightning = {}
            else:
                lightning = load_full_checkpoint(source, model_key)
                engine.load_full_state_dict(dict(lightning.pop(model_key)), strict=strict)
                for key in optimizer_keys:
                    if key in lightning:
                        state[key].load_state_dict(lightning.pop(key))
                    elif strict:
                        raise KeyError(f"{source} has no entry {key!r} for the optimizer; it has {sorted(lightning)}.")
        others = [k for k in state if k != model_key and k not in optimizer_keys]
        _validate_keys_for_strict_loading(others, lightning.keys(), strict=strict)
        for key in others:
            if key not in lightning:
                continue
            obj = state[key]
            if hasattr(obj, "load_state_dict") and hasattr(obj, "state_dict"):
                if isinstance(obj, Module):
                    obj.load_state_dict(lightning.pop(key), strict=strict)
                else:
                    obj.load_state_dict(lightning.pop(key))
            else:
                state[key] = lightning.pop(key)
        return lightning

    def _roles(self, state: Mapping[str, Any], what: str) -> tuple[str, list[str]]:
        """Which entry of ``state`` is the set-up model, and which are its optimizers (in order)."""
        model_keys = [k for k, v in state.items() if v is self._module]
        optimizer_keys = [k for k, v in state.items() if isinstance(v, ShardedOptimizer)]
        foreign = [k for k, v in state.items() if isinstance(v, Optimizer) and not isinstance(v, ShardedOptimizer)]
        if foreign:
            raise ValueError(f"{what}: the optimizer(s) {foreign} were not set up by this Fabric (fabric.setup(model,"
                             " optimizer)), so ZeRO does not hold their state.")
        if len(model_keys) != 1:
            raise ValueError(
                f"{what} needs the set-up model in the state exactly once (e.g. {{'model': model, 'optimizer':"
                f" optimizer}}), found it under {model_keys or 'no key'}.")
        return model_keys[0], optimizer_keys

    # ------------------------------------------------------------------ teardown and registry
    @override
    def teardown(self) -> None:
        self._unsync_generation()
        self._unsync_generation = _do_nothing
        if self._forward_handle is not None:
            self._forward_handle.remove()
            self._forward_handle = None
        if self._engine is not None:
            self._engine.remove_hooks()
            self._engine = None
        self._fp32_kept = {}
        GLOO_HELD.settle()  # see [Note: tensors outlive the gloo worker]
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        offload = CPUOffloadPolicy()
        presets: list[tuple[str, str, ZeroConfig]] = [
            ("zero2_offload", "ZeRO stage 2 with the optimizer state offloaded to the CPU",
             ZeroConfig(stage=2, offload_optimizer=offload)),
            ("zero3_offload", "ZeRO stage 3 with the optimizer state and the parameters offloaded to the CPU",
             ZeroConfig(stage=3, offload_optimizer=offload, offload_params=offload)),
        ]
        presets += [(f"zero{stage}", f"ZeRO stage {stage} data parallelism", ZeroConfig(stage=stage))
                    for stage in (1, 2, 3)]
        for name, description, config in presets:
            strategy_registry.register(name, cls, description=f"{description} (lightning_zero, Fabric)", config=config)
            strategy_registry.register(f"{name}_spawn", cls, config=config, start_method="spawn",
                                       description=f"{description}, ranks started with 'spawn' (lightning_zero, Fabric)")


def _warn_of_loop_settings(settings: DeepSpeedSettings) -> None:
    """DeepSpeed's engine clips and accumulates by itself; under Fabric the loop does both, so the
    config's values would be dropped without a word (see ZeroFabricStrategy.deepspeed_settings)."""
    asks = []
    if settings.gradient_clipping:
        asks.append(f"gradient_clipping={settings.gradient_clipping:g}: call fabric.clip_gradients(model, optimizer,"
                    f" max_norm={settings.gradient_clipping:g}) before each optimizer.step()")
    if settings.gradient_accumulation_steps is not None and settings.gradient_accumulation_steps > 1:
        asks.append(f"gradient_accumulation_steps={settings.gradient_accumulation_steps}: step every"
                    f" {settings.gradient_accumulation_steps} backward calls, the others inside"
                    " fabric.no_backward_sync(model)")
    if settings.micro_batch_size is not None or settings.train_batch_size is not None:
        sizes = [f"{name}={value}" for name, value in (("train_micro_batch_size_per_gpu", settings.micro_batch_size),
                                                     ("train_batch_size", settings.train_batch_size)) if value]
        asks.append(f"{' and '.join(sizes)}: build the DataLoader with that batch size")
    if asks:
        rank_zero_warn(
            f"The DeepSpeed config {settings.source} sets what DeepSpeed's engine does in its step, and under Fabric"
            " your loop does: " + "; ".join(asks) + ". They are in strategy.deepspeed_settings; nothing applies"
            " them for you.", category=DeepSpeedConfigWarning)


class _ZeroBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: gradients accumulate locally, nothing is communicated."""

    def __init__(self, strategy: ZeroFabricStrategy) -> None:
        self._strategy = strategy

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        if not enabled or self._strategy.config.reduce_every_micro_step:
            return nullcontext()
        return self._blocked()

    @contextmanager
    def _blocked(self) -> Generator[None, None, None]:
        strategy = self._strategy
        engine = strategy._require_engine("no_backward_sync")
        strategy._in_no_sync = True
        try:
            with engine.no_sync():
                yield
        finally:
            strategy._in_no_sync = False


def _is_world(group: Any) -> bool:
    """Whether a collective's ``group`` is every rank (Fabric passes the world group itself)."""
    return group is None or group is torch.distributed.group.WORLD


def _as_sharded(optimizer: Any, what: str) -> ShardedOptimizer:
    if not isinstance(optimizer, ShardedOptimizer):
        optimizer = getattr(optimizer, "optimizer", optimizer)  # unwrap a _FabricOptimizer
    if not isinstance(optimizer, ShardedOptimizer):
        raise TypeError(f"{what} under ZeroFabricStrategy needs an optimizer set up with fabric.setup(model,"
                        f" optimizer), got {type(optimizer).__name__}.")
    return optimizer
