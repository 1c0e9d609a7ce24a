"""``ZeroStrategy``: ZeRO data parallelism as a Lightning strategy.

The strategy is the Lightning edge: it launches ranks (through Lightning's own launchers),
initializes the process group, builds the stage's engine (:func:`~lightning_zero.zero.make_engine`,
see [Note: one engine protocol] in zero/engine.py) and hands each optimizer from
``configure_optimizers`` to it; the sharding itself is plain PyTorch.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from dataclasses import fields, replace
from functools import partial
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.nn import Module
from torch.nn.utils import parametrize
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.checkpoint.checksums import CheckpointError
from lightning_zero.checkpoint.full import load_full_checkpoint
from lightning_zero.checkpoint.sharded import (
    META_KEY,
    commit_checkpoint,
    read_metadata,
    is_sharded_checkpoint,
    resolve_checkpoint_path,
    save_sharded,
    whole_save_plan,
    whole_staging_path,
)
from lightning_zero.checkpoint.state import (
    AVERAGE_KEY,
    AVERAGE_MARK,
    SWA_MARK,
    MeshPlacement,
    average_entries,
    check_full_optimizer_states,
    check_full_state_fits,
    load_average,
    load_into,
    model_entries,
    model_pieces,
    model_view,
    optimizer_entries,
    param_names,
    publish_masters,
    sharded_state,
    state_in_pieces,
    swa_average_key,
    whole_average,
)
from lightning_zero.config import ZeroConfig
from lightning_zero.deepspeed_config import (
    DeepSpeedConfigWarning,
    DeepSpeedSettings,
    DeepSpeedSource,
    read_deepspeed_config,
)
from lightning_zero.parallel.mesh import (
    ParallelDims,
    ParallelGroups,
    build_parallel_groups,
    resolve_dims,
    sync_module_states,
)
from lightning_zero.parallel.pipeline import PipelineRunner, build_pipeline, is_split
from lightning_zero.pipeline_steps import PipelineSteps
from lightning_zero.parallel.tensor import TensorParallelParams, materialize_tensor_parallel
from lightning_zero.loss_scaler import LossScaleConfig
from lightning_zero.offload import CPUOffloadPolicy
from lightning_zero.precision import SUPPORTED_PRECISION, ZeroPrecision, cast_norm_statistics, warn_frozen_rounding
from lightning_zero.autotuning.space import size_label
from lightning_zero.profiling.measure import host_memory_available
from lightning_zero.zero.accounting import ModelStateBytes, model_state_bytes
from lightning_zero.zero.comm import GLOO_HELD, Collectives, CountingCollectives
from lightning_zero.zero.consistency import (
    CollectiveAgreement,
    agree_after_batch,
    agree_at_batch_start,
    agree_before_step,
    agree_on_batches,
    check_same_model,
    optimizer_number,
)
from lightning_zero.zero.engine import ZeroEngine, collect_dropped_engines, make_engine
from lightning_zero.zero.layout import ParamPiece
from lightning_zero.zero.optimizer import ShardedOptimizer
from lightning_zero.zero.stage3 import PiecesSource, Zero3Engine
from lightning_zero.zero.stage3.generation import sync_generation

log = logging.getLogger(__name__)

# The callbacks that copy the module at setup to average its weights (WeightAveraging: lightning>=2.6).
_WEIGHT_AVERAGING_CALLBACKS: tuple[type, ...] = tuple(
    cls for cls in (getattr(pl.callbacks, name, None) for name in ("StochasticWeightAveraging", "WeightAveraging"))
    if cls is not None
)
# Of those, the ones that swap a checkpoint's "state_dict" for their average (and back on load).
_SWAPPING_AVERAGES: tuple[type, ...] = tuple(cls for cls in (getattr(pl.callbacks, "WeightAveraging", None),)
                                             if cls is not None)
# In a whole checkpoint loaded at stage 3 with such a callback: its "current_model_state" whole, for
# load_model_state_dict (the checkpoint's "state_dict" and "current_model_state" then hold pieces).
_WHOLE_MODEL_STATE = "lightning_zero_whole_model_state"

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
StateDictType = Literal["sharded", "full"]


class ZeroStrategy(ParallelStrategy):
    """ZeRO stage 1, 2 or 3 data parallelism for the Trainer (Fabric: :class:`~lightning_zero.ZeroFabricStrategy`).

    Args:
        stage: shorthand for ``config=ZeroConfig(stage=stage)``; may be given with ``config`` only if
            both agree.
        config: every ZeRO setting, validated (see :class:`~lightning_zero.ZeroConfig`).
        process_group_backend: ``"gloo"`` or ``"nccl"``; by default the one for the root device.
        timeout: collective timeout of the process group.
        start_method: how Lightning starts the ranks: ``"popen"`` re-runs the script per rank (the
            default, as for ``ddp``), ``"spawn"``/``"fork"`` start them from this process.
        collectives: a :class:`~lightning_zero.zero.Collectives` to use instead of one built over the
            world group, e.g. a :class:`~lightning_zero.zero.CountingCollectives` to audit traffic.
        state_dict_type: ``"sharded"`` (default): checkpoints are directories written by every rank in
            parallel with torch.distributed.checkpoint, loadable at any world size and stage, and
            exported to one file with ``lightning-zero consolidate``. ``"full"``: one file written by
            rank 0 after gathering the weights and optimizer state (only for models that fit in its RAM).
        deepspeed_config: a DeepSpeed JSON config (its path, or the dict) instead of ``stage``/``config``:
            ``zero_optimization`` becomes the ZeroConfig, ``fp16``/``bf16`` the precision, and its
            clipping, accumulation and batch sizes are checked against the Trainer's and the DataLoader's
            (see [Note: DeepSpeed config import] in lightning_zero/deepspeed_config.py). Also
            :meth:`from_deepspeed`.
    """

    strategy_name = "zero"

    def __init__(
        self,
        stage: int | None = None,
        config: ZeroConfig | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: StartMethod = "popen",
        collectives: Collectives | CountingCollectives | None = None,
        state_dict_type: StateDictType = "sharded",
        deepspeed_config: dict[str, Any] | str | Path | None = None,  # dict first: jsonargparse tries in order
    ) -> None:
        # Before the base class, whose constructor assigns the precision plugin (read by its setter).
        self._deepspeed: DeepSpeedSettings | None = None
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if deepspeed_config is not None:
            self._deepspeed = _read_deepspeed(deepspeed_config, stage, config, precision_plugin)
            config = self._deepspeed.zero
            if self._deepspeed.precision is not None:
                # Preset like a plugin: the Trainer then takes it instead of building one from its flag.
                self._precision_plugin = ZeroPrecision(self._deepspeed.precision, loss_scale=self._deepspeed.loss_scale)
        self.config = _resolve_config(stage, config)
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(
                f"ZeroStrategy(start_method={start_method!r}) is not one of 'popen', 'spawn', 'fork', 'forkserver'."
            )
        if state_dict_type not in ("sharded", "full"):
            raise ValueError(f"ZeroStrategy(state_dict_type={state_dict_type!r}) is not one of 'sharded', 'full'.")
        _check_parallel_combination(self.config, state_dict_type, collectives)
        self._state_dict_type = state_dict_type
        self._checkpoint_applied = False  # the last load_checkpoint already put weights/optimizer in place
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method = start_method
        self._collectives = collectives
        # Module-level no-ops, not lambdas: a spawn/fork launcher pickles the strategy.
        self._restore_lr_scheduler_step: Callable[[], Any] = _do_nothing
        self._unsync_generation: Callable[[], None] = _do_nothing
        self._unagree_batch_starts: Callable[[], Any] = _do_nothing
        self._taken_pieces: _TakenPieces | None = None  # see [Note: re-sharding a module left in pieces]
        self._agreement = CollectiveAgreement()
        self._restore_optimizer_zero_grad: Callable[[], Any] = _do_nothing
        self._zero_grad_of_window: Callable[..., Any] = _do_nothing  # the module's own optimizer_zero_grad
        self._engine: ZeroEngine | None = None
        # The mesh and its groups, when config.parallel asks for more than plain ZeRO (see [Note: one mesh]).
        self._parallel: ParallelGroups | None = None
        self._tensor_parallel: TensorParallelParams | None = None
        self._pipeline: PipelineRunner | None = None  # this rank's pipeline stages (see [Note: pipeline stages])
        self._engine_collectives: Collectives | CountingCollectives | None = None
        self._synced_backwards = 0  # backward calls whose gradients the next step reduces
        self._steps_this_batch = 0  # optimizer steps of ZeRO optimizers in this manual training_step
        self._in_no_sync = False
        # The run stopped on an error every rank raised together (a checkpoint that could not be
        # loaded), so teardown's collectives are safe: stage 3 hands the module back whole.
        self._failed_on_every_rank = False

    @classmethod
    def from_deepspeed(cls, config: DeepSpeedSource, **kwargs: Any) -> ZeroStrategy:
        """A strategy from a DeepSpeed JSON config (its path, or the dict); ``kwargs`` are the
        constructor's other arguments (see ``deepspeed_config``)."""
        return cls(deepspeed_config=config, **kwargs)

    @property
    def deepspeed_settings(self) -> DeepSpeedSettings | None:
        """What the ``deepspeed_config`` asked for (None without one)."""
        return self._deepspeed

    # ------------------------------------------------------------------ precision
    @property
    @override
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else ZeroPrecision()

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        # The Trainer assigns a generic plugin built from `precision=`; ZeRO needs its own, which
        # keeps the fp32 master weights in the sharded optimizer.
        if precision_plugin is None or isinstance(precision_plugin, ZeroPrecision):
            if precision_plugin is not None:
                _warn_if_loss_scale_left_out(self._deepspeed, precision_plugin)
            self._precision_plugin = precision_plugin
        elif type(precision_plugin) in (Precision, MixedPrecision, HalfPrecision):
            flag = str(precision_plugin.precision)
            self._precision_plugin = ZeroPrecision(flag, loss_scale=_auto_fp16_loss_scale(self._deepspeed, flag))
        else:
            precision = getattr(precision_plugin, "precision", None)
            raise ValueError(
                f"ZeroStrategy does not support the precision plugin {type(precision_plugin).__name__}"
                f" (precision={precision!r}). Use Trainer(precision=...) with one of"
                f" {', '.join(map(repr, SUPPORTED_PRECISION))}, or plugins=[ZeroPrecision(...)]."
            )

    # ------------------------------------------------------------------ processes and devices
    @property
    @override
    def root_device(self) -> torch.device:
        if not self.parallel_devices:
            raise RuntimeError(
                "ZeroStrategy has no devices yet: it must be passed to a Trainer (`Trainer(strategy=...)`), which"
                " sets the accelerator and devices, before it is used."
            )
        return self.parallel_devices[self.local_rank]

    @property
    def is_distributed(self) -> bool:
        """Tells Lightning to add a DistributedSampler, as for its own data-parallel strategies."""
        return True

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The data is split over the data-parallel ranks only: tensor-parallel ranks see the same batch."""
        if self._parallel is not None:
            dims = self._parallel.dims
            return {"num_replicas": dims.data, "rank": dims.data_rank(self.global_rank)}
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def device_mesh(self) -> DeviceMesh | None:
        """The :class:`~torch.distributed.device_mesh.DeviceMesh` of ``config.parallel`` (dims
        ``data``/``tensor``, or ``replicate``/``shard``/``tensor`` with ``data`` flattened from the
        first two under hybrid sharding), also ``self.device_mesh`` in ``configure_model``; None for
        plain ZeRO."""
        return self._parallel.mesh if self._parallel is not None else None

    @property
    def parallel_dims(self) -> ParallelDims | None:
        return self._parallel.dims if self._parallel is not None else None

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """A dataloader whose number of batches is unknown or differs between ranks is iterated in
        step with the other ranks, so a rank that runs out raises on every rank (see [Note: ranks
        that disagree])."""
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        stage = trainer.state.stage if trainer is not None else None
        prefix = stage.dataloader_prefix if stage is not None else None
        name = f"{prefix}_dataloader" if prefix else "dataloader"
        limit = getattr(trainer, f"limit_{prefix}_batches", None) if prefix else None
        if self._deepspeed is not None and prefix == "train" and trainer is not None:
            self._deepspeed.check_micro_batch_size(getattr(dataloader, "batch_size", None),
                                                   trainer.accumulate_grad_batches,
                                                   self.distributed_sampler_kwargs["num_replicas"])
        return agree_on_batches(dataloader, self.collectives, name, limit)

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._setup_distributed()
        module = self.lightning_module
        if module is not None:
            # A module a previous run left as local parts shows configure_model the plan's DTensors
            # again, so that its usual guard (already DTensors: skip) holds.
            previous = TensorParallelParams.of(module)
            if previous is not None:
                previous.restore_dtensors()
        if self._parallel is not None and module is not None:
            module._device_mesh = self._parallel.mesh  # self.device_mesh in configure_model

    def _setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        assert self.cluster_environment is not None
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        # Before the process group exists: a size that does not fit the world fails on every rank alike.
        dims = resolve_dims(self.config.parallel, self.num_nodes * self.num_processes, self.num_processes,
                            self.config.pipeline.size)
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        self._parallel = None
        if not dims.trivial:
            self._parallel = build_parallel_groups(dims, self.root_device.type, self._process_group_backend,
                                                   self._timeout)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @property
    def collectives(self) -> Collectives | CountingCollectives:
        """The collectives over the world, built once the process group exists: the engine's
        (without a mesh), and the ranks' agreements (see [Note: ranks that disagree])."""
        if self._collectives is None:
            self._collectives = Collectives(group=None)
        return self._collectives

    @property
    def engine_collectives(self) -> Collectives | CountingCollectives:
        """The collectives the engine shards over: the world's, or on a mesh its shard group's."""
        if self._parallel is None:
            return self.collectives
        if self._engine_collectives is None:
            sharded = self._tensor_parallel.sharded if self._tensor_parallel is not None else frozenset()
            self._engine_collectives = self._parallel.engine_collectives(sharded)
        return self._engine_collectives

    def _mesh_description(self) -> dict[str, Any]:
        """The mesh a sharded checkpoint records it was written on (empty for plain ZeRO)."""
        return self._parallel.describe(self._tensor_parallel) if self._parallel is not None else {}

    def _mesh_placement(self) -> MeshPlacement | None:
        """Where this rank's pieces lie in a checkpoint's global tensors (see [Note: checkpoint
        layout with a mesh]); None without a mesh."""
        if self._parallel is None:
            return None
        key_order = self._pipeline.key_order if self._pipeline is not None else ()
        return self._parallel.placement(self.global_rank, self._tensor_parallel, key_order)

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if self._deepspeed is not None:  # before any collective: every rank raises alike
            self._check_deepspeed_against(trainer)
        self._failed_on_every_rank = False
        self._synced_backwards = 0
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        assert self.model is not None
        assert self.lightning_module is not None
        if trainer.state.fn == TrainerFn.FITTING and self._layer_sync is not None:
            # Trainer(sync_batchnorm=True): before the engine takes the parameters, as DDP converts
            # before wrapping; reverted at teardown.
            self.model = self._layer_sync.apply(self.model)
        if trainer.state.fn == TrainerFn.FITTING:
            # A fit again on the same Trainer: the engine and optimizers its last run kept (for a
            # save_checkpoint after it) go before this run builds its own, so that collecting them
            # can free their state (see [Note: engines of earlier runs] in zero/engine.py).
            self._engine = None
            self.optimizers = []
            self.lr_scheduler_configs = []
        self._take_pieces(self.lightning_module)
        try:
            # Before the first collective that depends on the model (see [Note: ranks that disagree]).
            # A module an earlier pipelined run split holds one rank's layers: ranks differ by design.
            if not is_split(self.lightning_module):
                check_same_model(self.lightning_module, self.collectives)
            self._setup_engine()
        except BaseException:
            if self._taken_pieces is not None:  # the new engine holds nothing yet: the pieces stay the module's
                self._taken_pieces.put_back()
                self._taken_pieces = None
            raise
        if trainer.state.fn == TrainerFn.FITTING:
            # Before the precision cast: the fp32 master shards are taken from the fp32 weights.
            self.setup_optimizers(trainer)
            self._skip_scheduler_steps_of_skipped_optimizer_steps()
        precision = self.precision_plugin
        if trainer.state.fn == TrainerFn.FITTING or self.config.stage == 3 or not (
                isinstance(precision, ZeroPrecision) and precision.mixed):
            warn_frozen_rounding(self.lightning_module, self.config.stage, precision, self.zero_optimizers)
            self.model = precision.convert_module(self.model)
        # else: stages 1/2 keep fp32 masters only for what an optimizer trains, and validate, test
        # and predict set none up: cast, the user's weights would round for good. Left in fp32,
        # the module runs under the -mixed precision's autocast, as with DDP.
        self.setup_precision_plugin()

    def _check_deepspeed_against(self, trainer: pl.Trainer) -> None:
        settings = self._deepspeed
        assert settings is not None
        settings.check_trainer(trainer.gradient_clip_val, trainer.gradient_clip_algorithm,
                               trainer.accumulate_grad_batches)
        # The Trainer took the config's precision as a plugin; the flag it was given is still there.
        flag = str(getattr(getattr(trainer, "_accelerator_connector", None), "_precision_flag", "32-true"))
        if settings.precision is not None and flag not in ("32-true", "32", settings.precision):
            raise ValueError(
                f"The DeepSpeed config {settings.source} asks for precision {settings.precision!r} (its"
                f" {'fp16' if settings.precision == '16-mixed' else 'bf16'} section) but the Trainer has"
                f" precision={flag!r}. Drop one: remove Trainer(precision=...), or disable the config's section.")

    def _setup_engine(self) -> None:
        """Builds the stage's engine over the module: from real weights (rank 0's, like DDP), or, for
        a module built on the meta device in ``configure_model`` at stage 3, one unit at a time so
        it is never whole."""
        module = self.lightning_module
        assert module is not None
        precision = self.precision_plugin
        assert isinstance(precision, ZeroPrecision)
        self._localize_tensor_parallel(module)
        self._setup_pipeline(module)
        on_meta = self.config.stage == 3 and any(p.is_meta for p in module.parameters())
        init = None
        taken = self._taken_pieces
        if on_meta:
            group = self._parallel.data_group if self._parallel is not None else torch.distributed.group.WORLD
            prepared = _prepare_meta_build(module, self.root_device, group if self.world_size > 1 else None,
                                           check_resettable=taken is None)
            init = None if taken is not None else prepared
        else:
            self.model_to_device()
            if self._parallel is not None:
                # From data-parallel rank 0's weights: tensor ranks hold different parts, but what
                # they replicate (embeddings, norms, buffers) must be tensor rank 0's on all of them.
                sync_module_states(module, self._parallel.data_group)
                if self._tensor_parallel is not None and self._parallel.tensor_group is not None:
                    sync_module_states(module, self._parallel.tensor_group, skip=self._tensor_parallel.sharded)
            elif self.world_size > 1:
                # Every rank must start from rank 0's weights, as with DDP.
                _sync_module_states(module)
        self._engine = make_engine(module, self.engine_collectives, self.config, precision.param_dtype,
                                   self.root_device, init=init, source=taken.source if taken is not None else None)
        self._taken_pieces = None  # the new engine holds the values now; the old one and its pieces go
        if taken is not None:
            taken = None
            collect_dropped_engines()  # the old engine and its optimizers' state (see [Note: engines of earlier runs])
        if self._tensor_parallel is not None:
            self._tensor_parallel.install_hooks()
        if self._engine.stage_shards_params:
            self._rebuild_weight_averages()
            if self.engine_collectives.world_size > 1:
                self._unsync_generation = sync_generation(module)  # see [Note: generation at stage 3]
                self._agree_at_batch_starts(module.trainer)

    def _agree_at_batch_starts(self, trainer: pl.Trainer | None) -> None:
        """Stage 3 (see [Note: the start of a training batch]): the ranks agree at the start of
        each training batch, where Lightning broadcasts its SIGTERM flag, and the agreement carries
        that flag instead: Lightning's broadcast and the one in its SIGTERM handler are left out."""
        loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        signals = getattr(trainer, "_signal_connector", None)
        if (loop is None or signals is None or not callable(getattr(loop, "_broadcast_sigterm_tensor", None))
                or not callable(getattr(signals, "_sigterm_notifier_fn", None))):
            return  # a Lightning without that broadcast: nothing outside the strategy to agree before
        for owner, name in ((loop, "_broadcast_sigterm_tensor"), (signals, "_sigterm_notifier_fn")):
            owner.__dict__.pop(name, None)  # never wrap a wrapper of an earlier setup
        sigterm = _SigtermSeen()

        def note_sigterm(signum: int, frame: Any) -> None:
            log.info(f"[rank: {self.global_rank}] Received SIGTERM: {signum}; every rank stops at the start of the next"
                     " training batch")
            if not sigterm.seen and self.launcher is not None:
                self.launcher.kill(signum)  # as Lightning's handler: the launcher's other processes get it too
            sigterm.seen = True

        def agreed_batch_start() -> None:
            if agree_at_batch_start(self.collectives, self._synced_backwards, sigterm.seen):
                signals.received_sigterm = True
                raise SIGTERMException()

        loop._broadcast_sigterm_tensor = agreed_batch_start
        # Read by register_signal_handlers, which the Trainer calls after the strategy's setup.
        signals._sigterm_notifier_fn = note_sigterm

        def undo() -> None:
            loop.__dict__.pop("_broadcast_sigterm_tensor", None)
            signals.__dict__.pop("_sigterm_notifier_fn", None)

        self._unagree_batch_starts = undo

    def _localize_tensor_parallel(self, module: Module) -> None:
        """The DTensor parameters of a tensor-parallel plan become local parameters the engine
        shards (see [Note: local tensor-parallel parameters]); a plan built on the meta device is
        materialized first, as DTensors, so that each part is initialized as part of the whole."""
        # A previous run's local parts were turned back into the plan's DTensors in setup_environment.
        self._tensor_parallel = None
        self._engine_collectives = None
        if self._parallel is None or self._parallel.dims.tensor == 1:
            if TensorParallelParams.has_dtensors(module):
                raise ValueError(
                    "The model has DTensor parameters but ZeroStrategy has no tensor-parallel dimension. Set"
                    " ZeroConfig(parallel=ParallelConfig(tensor=N)) and apply the plan with self.device_mesh['tensor']"
                    " in configure_model."
                )
            return
        tensor = self._parallel.dims.tensor
        # A module an earlier pipelined run split holds one stage: it may have no split layer.
        split_by_pipeline = is_split(module)
        if not TensorParallelParams.has_dtensors(module) and not split_by_pipeline:
            raise ValueError(
                f"ZeroConfig.parallel.tensor={tensor} but the model has no tensor-parallel parameters: apply a plan in"
                " configure_model, e.g. lightning_zero.parallel.parallelize_gpt(self, self.device_mesh['tensor']) or"
                " torch.distributed.tensor.parallel.parallelize_module(self, self.device_mesh['tensor'], plan), or"
                " set tensor=1."
            )
        _refuse_weight_averaging(module, f"tensor parallelism (ZeroConfig.parallel.tensor={tensor})",
                                 "hold one tensor rank's part", "set tensor=1")
        if any(p.is_meta for p in module.parameters()):
            for name, submodule in module.named_modules():  # before allocating anything
                _check_resettable(submodule, name)
            unfilled = _materialize_meta_buffers(module, self.root_device)
            materialize_tensor_parallel(module, self.root_device, partial(_reset_parameters, unfilled=unfilled))
        self._tensor_parallel = TensorParallelParams(module, self._parallel.tensor_mesh)
        # The local parts must agree too (a rank that applied another plan would shard other shapes).
        if not split_by_pipeline:
            check_same_model(module, self.collectives)

    def _setup_pipeline(self, module: Module) -> None:
        """Keeps this rank's pipeline stages of the module (see [Note: pipeline stages])."""
        self._pipeline = None
        config = self.config.pipeline
        if not config.enabled:
            if is_split(module):
                raise ValueError(
                    f"This {type(module).__name__} was split into pipeline stages by an earlier run and holds one"
                    " rank's layers only; it cannot run without a pipeline. Build a new module and load the"
                    " checkpoint into it (sharded checkpoints hold the whole model)."
                )
            return
        assert self._parallel is not None and self._parallel.pipeline_group is not None
        _refuse_weight_averaging(module, f"pipeline parallelism (ZeroConfig.pipeline.size={config.size})",
                                 "hold the whole model on every rank", "turn the pipeline off")
        if not module.automatic_optimization:
            raise ValueError(
                f"{type(module).__name__} uses manual optimization, which pipeline parallelism does not support: the"
                " schedule runs every micro-batch's forward and backward itself. Use automatic optimization (return"
                " the loss from training_step), or turn the pipeline off."
            )
        self._pipeline = build_pipeline(module, config, self._parallel.pipeline_group, self.root_device)
        self._defer_zero_grad(module)

    def _defer_zero_grad(self, module: Module) -> None:
        """Lightning zeroes the gradients after training_step, before its backward; in a pipeline
        the backward ran inside training_step, so the module's ``optimizer_zero_grad`` is called
        by the pipelined step itself, before the schedule (see _pipeline_training_step)."""
        original = module.optimizer_zero_grad
        self._zero_grad_of_window = original
        module.optimizer_zero_grad = lambda *args, **kwargs: None  # type: ignore[method-assign]
        self._restore_optimizer_zero_grad = lambda: module.__dict__.pop("optimizer_zero_grad", None)

    @property
    def pipeline(self) -> PipelineRunner | None:
        """This rank's pipeline stages and their schedules, once set up (None without a pipeline)."""
        return self._pipeline

    def _rebuild_weight_averages(self) -> None:
        """Lightning's StochasticWeightAveraging and EMAWeightAveraging copy the module in their
        ``setup``, before the strategy shards it (and before configure_model builds it). Their setup
        runs again on the sharded module, so the averaged copy holds this rank's pieces and is
        averaged piece by piece (see [Note: a stage-3 parameter outside its gather])."""
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, _WEIGHT_AVERAGING_CALLBACKS):
                callback.setup(trainer, module, stage="fit")
                # At stage 1/2 the callbacks copy the fp32 module, before the precision plugin casts
                # it; here the pieces already have the bf16/fp16 param dtype: the average keeps fp32,
                # or its small updates would round away.
                average = getattr(callback, "_average_model", None)
                for param in average.parameters() if isinstance(average, Module) else ():
                    if param.is_floating_point() and param.dtype.itemsize < 4:
                        param.data = param.data.float()

    @property
    def engine(self) -> ZeroEngine | None:
        """The stage's engine (see [Note: one engine protocol] in zero/engine.py), once set up."""
        return self._engine

    def _require_engine(self) -> ZeroEngine:
        if self._engine is None:
            raise RuntimeError(
                "ZeroStrategy has no engine yet: it is built in setup(), when the Trainer starts fit/validate/test/"
                "predict. Call this from a hook that runs after setup (e.g. on_fit_start or a *_step)."
            )
        return self._engine

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        # configure_optimizers often groups parameters by p.dim() or p.shape: at stage 3 it sees
        # their true shapes (see [Note: a stage-3 parameter outside its gather]).
        engine = self._require_engine()
        failure: Exception | None = None
        try:
            with engine.true_shapes():
                super().setup_optimizers(trainer)
        except Exception as error:  # noqa: BLE001 - raised below, on every rank of a pipeline
            failure = error
        if self._pipeline is not None:
            # Each stage holds other layers: configure_optimizers may fail on some stages only
            # (e.g. it names a layer another stage holds), and the others must not go on alone.
            _raise_together(failure, "configure_optimizers")
        elif failure is not None:
            raise failure
        _check_params_in_one_optimizer(self.optimizers, self.lightning_module)
        precision = self.precision_plugin
        assert isinstance(precision, ZeroPrecision)
        self.optimizers = [engine.wrap_optimizer(optimizer, precision.loss_scaler) for optimizer in self.optimizers]

    def _skip_scheduler_steps_of_skipped_optimizer_steps(self) -> None:
        """Lightning steps LR schedulers after every optimizer step call; a step skipped on fp16
        overflow must not advance the schedule, so the module's ``lr_scheduler_step`` is gated."""
        module = self.lightning_module
        assert module is not None
        owner = {opt.optimizer: opt for opt in self.zero_optimizers}
        lr_scheduler_step = module.lr_scheduler_step

        def gated_lr_scheduler_step(scheduler: Any, metric: Any) -> None:
            zero_optimizer = owner.get(getattr(scheduler, "optimizer", None))  # type: ignore[arg-type]
            if zero_optimizer is not None and zero_optimizer.last_step_skipped:
                return
            lr_scheduler_step(scheduler, metric)

        module.lr_scheduler_step = gated_lr_scheduler_step  # type: ignore[method-assign]
        self._restore_lr_scheduler_step = lambda: module.__dict__.pop("lr_scheduler_step", None)

    @property
    def zero_optimizers(self) -> list[ShardedOptimizer]:
        return [opt for opt in self.optimizers if isinstance(opt, ShardedOptimizer)]

    def grad_norm(self, norm_type: float | int | str = 2.0, group_separator: str = "/") -> dict[str, Tensor]:
        """What ``lightning.pytorch.utilities.grad_norm(module, norm_type)`` gives under DDP, read from
        the shards (see :func:`grad_norm`): a collective, to call on every rank, in a hook after the
        closure (``on_before_optimizer_step``), where the reduced gradients are."""
        norm_type = float(norm_type)
        if not norm_type > 0:
            raise ValueError(f"grad_norm(norm_type={norm_type!r}) must be a positive number or 'inf'.")
        norms: dict[str, Tensor] = {}
        for optimizer in self.zero_optimizers:
            norms.update(optimizer.grad_norms(norm_type))
        module = self.lightning_module
        order = {name: index for index, (name, _) in enumerate(module.named_parameters())} if module else {}
        names = sorted(norms, key=lambda name: order.get(name, len(order)))
        result = {f"grad_{norm_type}_norm{group_separator}{name}": norms[name] for name in names}
        if norms:
            result[f"grad_{norm_type}_norm_total"] = torch.stack([norms[name] for name in names]).norm(norm_type)
        return result

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ training
    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        zero_optimizer = getattr(optimizer, "_optimizer", optimizer)
        if not isinstance(zero_optimizer, ShardedOptimizer):
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_sync() -> Any:
            # Hooks after the closure (on_before_optimizer_step, clipping) must see reduced gradients.
            result = closure()
            # Before waiting for reductions other ranks might not have launched: a rank that ran
            # another number of backwards (manual optimization) meets the others here or at one of
            # their gathers, and every rank raises (see [Note: ranks that disagree]).
            backwards, self._synced_backwards = self._synced_backwards, 0
            self._steps_this_batch += 1
            agree_before_step(self.collectives, self._require_engine(), backwards, zero_optimizer,
                              number=optimizer_number(zero_optimizer, self.zero_optimizers))
            if self._gradients_read_before_step(zero_optimizer):
                zero_optimizer.finish_grad_sync()
            # else the step lands the reductions itself, bucket by bucket ([Note: overlapped step]).
            return result

        try:
            return super().optimizer_step(zero_optimizer, closure_then_sync, model, **kwargs)
        finally:
            module = self.lightning_module
            if module is None or module.automatic_optimization:
                self._release_root()  # a step whose training_step returned no loss ran no backward
                if self._engine is not None:
                    self._engine.end_backward()

    def _gradients_read_before_step(self, optimizer: ShardedOptimizer) -> bool:
        """Whether anything between the closure and the step may read the reduced gradients:
        Lightning's gradient clipping, an ``on_before_optimizer_step`` of the LightningModule or of a
        callback, a ``configure_gradient_clipping`` of the module, or an fp16 loss scaler's overflow
        check. Only when nothing does may the reductions stay in flight into the step."""
        from lightning.pytorch.callbacks import Callback
        from lightning.pytorch.utilities.model_helpers import is_overridden

        if not optimizer.config.overlap_step or optimizer.loss_scaler is not None:
            return True
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        if module is None or trainer is None or trainer.gradient_clip_val:
            return True
        if any(is_overridden(hook, module) for hook in ("on_before_optimizer_step", "configure_gradient_clipping")):
            return True
        return any(is_overridden("on_before_optimizer_step", callback, Callback) for callback in trainer.callbacks)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        if self._pipeline is not None:
            # The schedule ran every micro-batch's backward inside training_step; the hooks around
            # a backward (on_before_backward, on_after_backward) still run.
            module = self.lightning_module
            assert module is not None
            self.pre_backward(closure_loss)
            closure_loss = self.precision_plugin.post_backward(
                self.precision_plugin.pre_backward(closure_loss, module), module)
            self.post_backward(closure_loss)
            return closure_loss
        if not self._in_no_sync:
            self._synced_backwards += 1
        engine = self._engine
        if engine is not None:
            # Every rank owes this backward's reductions, whatever part of the model its loss reaches.
            engine.begin_backward()
        try:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        except RuntimeError as error:
            explanation = engine.explain_backward_error(error) if engine is not None else None
            if explanation is None:
                raise
            raise RuntimeError(f"{error}\n{explanation}") from error
        finally:
            if engine is not None:
                engine.close_backward()

    # ------------------------------------------------------------------ what a step holds
    # At stage 3 the parameters outside every unit (the root unit) are gathered for the whole step
    # and its backward: training_step may use them outside forward, and backward needs them again.
    def _hold_root(self) -> None:
        if self._engine is not None:
            self._engine.hold_for_step()

    def _release_root(self) -> None:
        if self._engine is not None:
            self._engine.release_after_step()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            return self._pipeline_training_step(*args, **kwargs)
        self._hold_root()
        module = self.lightning_module
        if module is None or module.automatic_optimization:
            return super().training_step(*args, **kwargs)  # released after the closure's backward
        # Manual optimization runs its backwards (and steps) inside training_step.
        self._steps_this_batch = 0
        try:
            output = super().training_step(*args, **kwargs)
        finally:
            self._release_root()
            if self._engine is not None:
                self._engine.free_idle()
        # Before Lightning's next collective: a rank that skipped a step meets the others' step here
        # (see [Note: ranks that disagree]).
        agree_after_batch(self.collectives, self._steps_this_batch, self._synced_backwards)
        return output

    def _pipeline_training_step(self, batch: Any, *rest: Any, **kwargs: Any) -> Any:
        """Forward and backward of every micro-batch through the schedule (see [Note: Lightning
        steps in a pipeline]); each gradient accumulates locally and the optimizer step reduces it
        once (see [Note: pipeline stages])."""
        if kwargs:
            raise TypeError("Under pipeline parallelism training_step takes its arguments by position.")
        module = self.lightning_module
        assert module is not None and self._pipeline is not None
        engine = self._require_engine()
        precision = self.precision_plugin
        assert isinstance(precision, ZeroPrecision)
        (batch, *rest), _ = precision.convert_input(((batch, *rest), {}))
        trainer = module._trainer
        accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
        scale = precision.loss_scaler.scale if precision.loss_scaler is not None else 1.0
        if not self._in_no_sync:
            self._synced_backwards += 1
        # Lightning's window rule, with its batch index (training_step may not take one)
        batch_idx = trainer.fit_loop.epoch_loop.batch_idx if trainer is not None else 0
        if trainer is not None and batch_idx % accumulate == 0:
            # the first batch of an accumulation window starts from zero gradients (see _defer_zero_grad)
            for optimizer in trainer.optimizers:
                self._zero_grad_of_window(trainer.current_epoch, batch_idx, optimizer)

        def run(schedule_step: Callable[[], None]) -> None:
            with engine.no_sync():
                engine.begin_backward()
                try:
                    with precision.train_step_context():
                        schedule_step()
                    engine.absorb_param_grads()
                finally:
                    engine.close_backward()

        return PipelineSteps(self._pipeline).training_step(module, batch, tuple(rest), scale / accumulate, run)

    def _pipeline_eval_step(self, hook: str, context: Callable[[], Any], *args: Any, **kwargs: Any) -> Any:
        if kwargs or len(args) < 1:
            raise TypeError(f"Under pipeline parallelism {hook} takes (batch, batch_idx[, dataloader_idx]) only.")
        module = self.lightning_module
        assert module is not None and self._pipeline is not None
        args, _ = self.precision_plugin.convert_input((args, {}))
        with context():
            return PipelineSteps(self._pipeline).eval_step(module, hook, args[0], *args[1:])

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        if self._engine is None:
            return
        module = self.lightning_module
        if module is None or module.automatic_optimization:
            self._release_root()
        self._engine.end_backward()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            return self._pipeline_eval_step("validation_step", self.precision_plugin.val_step_context, *args, **kwargs)
        with self._root_gathered():
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            return self._pipeline_eval_step("test_step", self.precision_plugin.test_step_context, *args, **kwargs)
        with self._root_gathered():
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            return self._pipeline_eval_step("predict_step", self.precision_plugin.predict_step_context, *args, **kwargs)
        with self._root_gathered():
            return super().predict_step(*args, **kwargs)

    @contextmanager
    def _root_gathered(self) -> Generator[None, None, None]:
        self._hold_root()
        try:
            yield
        finally:
            self._release_root()
            if self._engine is not None:
                self._engine.free_idle()

    @contextmanager
    def gathered_params(self, writeback: bool = True) -> Generator[None, None, None]:
        """Stage 3: every parameter whole for the duration, to read or modify (changes are kept).

        A collective: call it on every rank. At stages 1 and 2 parameters are always whole.
        """
        if self._engine is None:
            yield
            return
        with self._engine.gathered(writeback=writeback):
            yield

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning enters this on non-boundary accumulation steps: gradients stay local."""
        if self.config.reduce_every_micro_step:
            yield
            return
        self._in_no_sync = True
        try:
            with self._require_engine().no_sync():
                yield
        finally:
            self._in_no_sync = False

    # ------------------------------------------------------------------ collectives for Lightning
    @contextmanager
    def _agreed(self, call: str, group: Any | None = None) -> Generator[None, None, None]:
        """Stage 3: runs one of Lightning's collectives (a synced metric, a barrier, a broadcast)
        after the ranks agreed they all reached it (see [Note: ranks that disagree] in
        zero/consistency.py). A rank still gathering a unit for a forward the others never ran (a
        callback's ``generate`` under ``if trainer.is_global_zero:``) meets them here, and every
        rank raises at once instead of waiting for the process group's timeout. Stages 1/2 gather
        nothing in forward, so they skip it; so does a call on a group of its own."""
        if (self.config.stage != 3 or self._engine is None or group is not None or self.world_size == 1
                or not _distributed_is_initialized()):
            yield
            return
        with self._agreement.before(self.collectives, call, self._synced_backwards):
            yield

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not _distributed_is_initialized():
            return
        with self._agreed("trainer.strategy.barrier"):
            if torch.distributed.get_backend() == "nccl" and self.root_device.type == "cuda":
                torch.distributed.barrier(device_ids=[self.root_device.index])
            else:
                torch.distributed.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        container = [obj]
        with self._agreed("trainer.strategy.broadcast"):
            torch.distributed.broadcast_object_list(container, src, group=_group.WORLD)
        return container[0]

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        if isinstance(tensor, Tensor):
            with self._agreed("trainer.strategy.reduce", group):
                return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        with self._agreed("trainer.strategy.all_gather", group):
            return super().all_gather(tensor, group, sync_grads)

    # ------------------------------------------------------------------ checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Checkpoints load into the masters and shards, which exist only after setup.
        return True

    @property
    def state_dict_type(self) -> StateDictType:
        """What the next checkpoint save writes (see the constructor); may be changed between saves."""
        return self._state_dict_type

    @state_dict_type.setter
    def state_dict_type(self, value: StateDictType) -> None:
        if value not in ("sharded", "full"):
            raise ValueError(f"ZeroStrategy.state_dict_type={value!r} is not one of 'sharded', 'full'.")
        _check_parallel_combination(self.config, value, None)
        self._state_dict_type = value

    def _model_pieces(self) -> list[ParamPiece]:
        # After teardown of an interrupted run the engine is gone; the optimizers still hold the pieces.
        return model_pieces(self._engine, self.zero_optimizers)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Sharded checkpoints: this rank's pieces (fp32 masters) and the replicated rest, no
        communication. Full: the whole weights on rank 0 (a collective); with bf16/fp16
        parameters, the fp32 master values, so a checkpoint loses nothing of the weights trained."""
        module = self.lightning_module
        assert module is not None
        if self._state_dict_type == "sharded":
            return model_entries(module, self._model_pieces(), group=None, placement=self._mesh_placement())
        return self._engine.full_state_dict() if self._engine is not None else module.state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if self._state_dict_type == "sharded" and isinstance(inner, ShardedOptimizer):
            module = self.lightning_module
            assert module is not None
            entries, description = optimizer_entries(inner, param_names(module), group=None,
                                                     placement=self._mesh_placement())
            return {"state": entries, META_KEY: description}
        return super().optimizer_state(optimizer)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        if self._state_dict_type == "full":
            checkpoint = self._whole_averages(checkpoint)
            if "://" in str(filepath):  # a remote store (fsspec): no directory can be in the way
                return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            # Where a sharded checkpoint is, the file replaces it (see [Note: atomic save]); rank 0
            # looks, and every rank takes its decision, so that a refusal raises everywhere.
            target = Path(filepath)
            plan, refusal = self.broadcast(whole_save_plan(target) if self.is_global_zero else ("write", None))
            if plan == "refuse":
                raise CheckpointError(refusal)
            if plan == "write":
                return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            staging = whole_staging_path(target)
            super().save_checkpoint(checkpoint, staging, storage_options=storage_options)
            if self.is_global_zero:
                commit_checkpoint(staging, target)
            self.barrier("lightning_zero.whole_save")
            return None
        if storage_options is not None:
            raise TypeError(
                "ZeroStrategy(state_dict_type='sharded').save_checkpoint(..., storage_options=...) is not supported:"
                " sharded checkpoints are written by torch.distributed.checkpoint, not the CheckpointIO plugin."
            )
        module = self.lightning_module
        assert module is not None
        path = Path(self.broadcast(str(filepath)))  # every rank writes into rank 0's path
        checkpoint = dict(checkpoint)
        model = checkpoint.pop("state_dict")
        average = None
        if "current_model_state" in checkpoint:  # see [Note: weight averages in a checkpoint]
            model, average = checkpoint.pop("current_model_state"), model
            checkpoint[AVERAGE_MARK] = True
        swa = _take_swa_averages(checkpoint)  # see [Note: weight averages in a checkpoint]
        if swa:
            checkpoint[SWA_MARK] = list(swa)
        optimizers = [(state["state"], state[META_KEY]) for state in checkpoint.pop("optimizer_states", [])]
        state = sharded_state(module, model, optimizers, checkpoint, self.world_size, self.config.stage, group=None,
                              parallel=self._mesh_description(), placement=self._mesh_placement())
        averages = {AVERAGE_KEY: average} if average is not None else {}
        averages.update({swa_average_key(index): values for index, values in enumerate(swa.values())})
        for namespace, values in averages.items():
            state[namespace] = average_entries(module, values, self._model_pieces(), group=None,
                                               placement=self._mesh_placement())
        save_sharded(path, state, group=None)

    def _whole_averages(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """A whole checkpoint's weight averages (WeightAveraging's "state_dict", StochasticWeightAveraging's
        average_model_state) with whole tensors at stage 3, gathered on rank 0 like the model (a
        collective; see [Note: weight averages in a whole checkpoint] in checkpoint/state.py)."""
        module = self.lightning_module
        if module is None or self.config.stage != 3 or self._engine is None:
            return checkpoint  # stages 1/2: the averages are whole already
        checkpoint = dict(checkpoint)
        keep = self.global_rank == 0
        pieces, collectives, device = self._model_pieces(), self.engine_collectives, self.root_device
        if "current_model_state" in checkpoint:
            checkpoint["state_dict"] = whole_average(checkpoint["state_dict"], module, pieces, collectives, keep, device)
        swa = _take_swa_averages(checkpoint)
        for key, average in swa.items():
            whole = whole_average(average, module, pieces, collectives, keep, device)
            checkpoint["callbacks"][key]["average_model_state"] = whole
        return checkpoint

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Sharded checkpoints (any world size and stage) load straight into this rank's pieces;
        full ones (DDP's, a consolidated export, a .safetensors file) are checked, then loaded by
        ``load_model_state_dict``/``load_optimizer_state_dict``. A checkpoint without optimizer
        state starts the optimizers (and LR schedulers) afresh, with a warning."""
        module = self.lightning_module
        assert module is not None
        trainer = module._trainer
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        path = resolve_checkpoint_path(checkpoint_path)
        if is_sharded_checkpoint(path) or path.is_dir():
            optimizers = self.zero_optimizers if fitting else None
            try:
                meta = load_into(path, module, self._model_pieces(), optimizers, group=None,
                                 strict=module.strict_loading, placement=self._mesh_placement())
            except CheckpointError:
                self._failed_on_every_rank = True  # load_into's ranks agree on its errors
                raise
            publish_masters(self._engine, self.zero_optimizers)
            self._checkpoint_applied = True
            checkpoint = dict(meta.lightning)
            metadata = read_metadata(path)
            if checkpoint.pop(AVERAGE_MARK, False):
                # WeightAveraging's three keys, as its on_load_checkpoint expects them
                average = load_average(path, metadata, module, self._model_pieces(), None, self._mesh_placement())
                checkpoint["current_model_state"] = {k: v.detach().clone() for k, v in module.state_dict().items()}
                checkpoint["state_dict"] = average
                if not fitting and not self._an_average_swaps_back():
                    # Outside fit Lightning loads "state_dict", the average, into the module (a
                    # callback still holding an average from fit would put "current_model_state" back).
                    with torch.no_grad():
                        module.load_state_dict(average, strict=False)
            swa_keys = checkpoint.pop(SWA_MARK, [])
            if swa_keys:
                checkpoint["callbacks"] = callbacks = dict(checkpoint["callbacks"])
                for index, key in enumerate(swa_keys):
                    if not fitting and self.config.stage == 3:
                        # StochasticWeightAveraging acts only while fitting; outside it its copy is
                        # the whole module, taken before sharding, which the pieces do not fit.
                        callbacks.pop(key, None)
                        continue
                    # StochasticWeightAveraging's state as its load_state_dict expects it
                    callbacks[key] = dict(callbacks[key])
                    callbacks[key]["average_model_state"] = load_average(
                        path, metadata, module, self._model_pieces(), None, self._mesh_placement(),
                        namespace=swa_average_key(index))
            has_optimizer_state = bool(meta.optimizers)
            if has_optimizer_state:
                checkpoint["optimizer_states"] = []  # already in place; Lightning only checks the key
        else:
            checkpoint = load_full_checkpoint(path)
            if self._pipeline is not None:  # on the global tensors, before any tensor-parallel cut
                checkpoint = self._this_stage_of_full_checkpoint(path, checkpoint, fitting)
            if self._tensor_parallel is not None:
                # A whole checkpoint (DDP's, an export): every rank takes its tensor-parallel part.
                checkpoint["state_dict"] = self._tensor_parallel.local_state_dict(module, checkpoint["state_dict"])
                states = checkpoint.get("optimizer_states")
                if fitting and isinstance(states, list) and len(states) == len(self.zero_optimizers):
                    checkpoint["optimizer_states"] = [
                        self._tensor_parallel.local_optimizer_state(state, optimizer._param_indices())
                        for state, optimizer in zip(states, self.zero_optimizers)
                    ]
            pieces = self._model_pieces()
            check_full_state_fits(path, checkpoint["state_dict"], module, strict=module.strict_loading, pieces=pieces)
            checkpoint = self._state_in_pieces(checkpoint, pieces, fitting)
            has_optimizer_state = "optimizer_states" in checkpoint
            if fitting and has_optimizer_state:
                check_full_optimizer_states(path, checkpoint["optimizer_states"], self.zero_optimizers, pieces)
            self._checkpoint_applied = False
        checkpoint.setdefault("pytorch-lightning_version", pl.__version__)
        if fitting:
            self._leave_lr_schedulers_to_swa(checkpoint)
        if fitting and (not has_optimizer_state or "lr_schedulers" not in checkpoint):
            self._start_training_state_afresh(checkpoint, path, has_optimizer_state)
        return checkpoint

    def _state_in_pieces(self, checkpoint: dict[str, Any], pieces: list[ParamPiece], fitting: bool) -> dict[str, Any]:
        """The weight averages of a whole checkpoint in the form the averaged copies hold them:
        this rank's pieces at stage 3 (see [Note: weight averages in a whole checkpoint])."""
        module = self.lightning_module
        if module is None or self.config.stage != 3:
            return checkpoint
        rank = self.engine_collectives.rank
        checkpoint = dict(checkpoint)
        if "current_model_state" in checkpoint and self._an_average_swaps_back():
            # Lightning loads "state_dict" (the average) into the module; then the WeightAveraging
            # callback loads it into its average, and "current_model_state" into the module with a
            # plain load_state_dict: both must then be this rank's pieces. load_model_state_dict
            # takes the whole "current_model_state" from beside them, so the masters hold the trained
            # weights at full precision and the callback's write of their rounded pieces changes
            # nothing (take_written).
            checkpoint[_WHOLE_MODEL_STATE] = checkpoint["current_model_state"]
            for key in ("state_dict", "current_model_state"):
                checkpoint[key] = state_in_pieces(checkpoint[key], module, pieces, rank)
        callbacks = checkpoint.get("callbacks")
        if fitting and isinstance(callbacks, dict):  # outside fit SWA's copy is the whole module
            checkpoint["callbacks"] = callbacks = dict(callbacks)
            for key, state in callbacks.items():
                if _is_swa_state(state):
                    callbacks[key] = {**state, "average_model_state": state_in_pieces(
                        state["average_model_state"], module, pieces, rank)}
        return checkpoint

    def _an_average_swaps_back(self) -> bool:
        """Whether a WeightAveraging callback holds an average (from a fit): on load it takes the
        checkpoint's "state_dict" as its average and puts "current_model_state" into the module."""
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        return trainer is not None and any(
            isinstance(c, _SWAPPING_AVERAGES) and getattr(c, "_average_model", None) is not None
            for c in trainer.callbacks)

    def _leave_lr_schedulers_to_swa(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint taken while StochasticWeightAveraging ran its SWALR: under DDP the callback's
        on_fit_start, after the restore, drops the trainer's LR scheduler so that the SWALR state is
        not loaded into the user's (a KeyError for LambdaLR); here checkpoints are restored after
        setup, past that hook, so the scheduler is dropped here, as it would do."""
        from lightning.pytorch.callbacks import StochasticWeightAveraging

        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        callbacks = checkpoint.get("callbacks")
        if trainer is None or not isinstance(callbacks, dict):
            return
        for callback in trainer.callbacks:
            state = callbacks.get(callback.state_key) if isinstance(callback, StochasticWeightAveraging) else None
            if isinstance(state, Mapping) and state.get("scheduler_state") is not None:
                StochasticWeightAveraging._clear_schedulers(trainer)
                return

    def _this_stage_of_full_checkpoint(self, path: Path, checkpoint: dict[str, Any], fitting: bool) -> dict[str, Any]:
        """A whole-model checkpoint (DDP's, an export) under a pipeline: the keys of every stage are
        checked, and this rank keeps its own stage's."""
        module = self.lightning_module
        assert module is not None
        view = model_view(module, (), self._model_pieces(), self._mesh_placement())  # global shapes
        check_full_state_fits(path, checkpoint["state_dict"], module, strict=module.strict_loading, view=view)
        if fitting and "optimizer_states" in checkpoint:
            raise CheckpointError(
                f"{path} is a whole-model checkpoint with torch-format optimizer state, which indexes parameters by"
                " position over the whole model; under pipeline parallelism each stage holds other parameters, so it"
                " cannot resume from it. Resume from a sharded checkpoint (the default), or load the weights only"
                " (e.g. strategy.load_checkpoint in on_fit_start, or a checkpoint without optimizer_states)."
            )
        mine = set(module.state_dict())
        checkpoint = dict(checkpoint)
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in mine}
        return checkpoint

    def _start_training_state_afresh(self, checkpoint: dict[str, Any], path: Path, has_optimizer_state: bool) -> None:
        """A weights-only checkpoint resumes the weights, one written by Fabric (``fabric.save``: no
        LR scheduler or loop state) the weights and the optimizers; the rest keeps the state it has
        now (fresh), instead of Lightning's KeyError, which blamed ``save_weights_only``."""
        trainer = self.lightning_module._trainer if self.lightning_module is not None else None
        if has_optimizer_state:
            writer = "written by Fabric" if "lightning_zero_fabric" in checkpoint else "saved outside a Trainer"
            rank_zero_only(log.warning)(
                f"{path} holds no LR scheduler state ({writer}): the weights and the optimizer state are loaded, the"
                " LR schedulers start fresh, and so do the loops (epoch and global_step) unless it holds theirs."
            )
            checkpoint["lr_schedulers"] = [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs] \
                if trainer is not None else []
            return
        rank_zero_only(log.warning)(
            f"{path} holds no optimizer state (a weights-only checkpoint): the weights are loaded, the"
            " optimizers and LR schedulers start fresh."
        )
        checkpoint["optimizer_states"] = []
        checkpoint["lr_schedulers"] = [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs] \
            if trainer is not None else []

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._checkpoint_applied:
            return
        state = dict(checkpoint.get(_WHOLE_MODEL_STATE, checkpoint["state_dict"]))
        if self._engine is None:
            assert self.lightning_module is not None
            self.lightning_module.load_state_dict(state, strict=strict)
            return
        self._engine.load_full_state_dict(state, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self._checkpoint_applied or not checkpoint.get("optimizer_states"):
            return
        super().load_optimizer_state_dict(checkpoint)

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Stage 3: modules built in ``configure_model`` are created on the meta device and
        materialized one unit at a time at setup (through each module's ``reset_parameters``)."""
        if self.config.stage != 3:
            yield
            return
        with torch.device("meta"):
            yield

    # ------------------------------------------------------------------ accounting
    def model_state_bytes(self) -> ModelStateBytes:
        """This rank's bytes of parameters, gradients and optimizer state."""
        if self.lightning_module is None:
            raise RuntimeError(
                "ZeroStrategy.model_state_bytes() counts the module the Trainer set up, and there is none yet: call it"
                " from a hook once fit/validate/test/predict has started (e.g. on_train_start or a *_step), or use"
                " lightning_zero.estimate_memory for a model not yet set up."
            )
        return model_state_bytes(self.lightning_module, self.optimizers)

    def all_ranks_model_state_bytes(self) -> list[ModelStateBytes]:
        """Every rank's :meth:`model_state_bytes`, in rank order (a collective: call it on all ranks)."""
        mine = self.model_state_bytes()
        if not _distributed_is_initialized():
            return [mine]
        gathered: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, mine)
        return gathered

    # ------------------------------------------------------------------ teardown and registry
    @override
    def teardown(self) -> None:
        self._restore_lr_scheduler_step()
        self._restore_optimizer_zero_grad()
        self._unsync_generation()
        self._unsync_generation = _do_nothing
        self._unagree_batch_starts()
        self._unagree_batch_starts = _do_nothing
        precision = self.precision_plugin
        from_masters = isinstance(precision, ZeroPrecision) and precision.mixed and precision.param_dtype is not None
        if self._interrupted() and not self._failed_on_every_rank:
            # After an error (perhaps on one rank only) no collective may run: it could hang.
            module = self.lightning_module
            if self._engine is not None:
                self._engine.remove_hooks()
                if self.config.stage == 3 and module is not None and not _has_meta_tensors(module):
                    _leave_in_pieces(module, self._engine, from_masters)
                self._engine = None
            from_masters = False
            if module is not None and _has_meta_tensors(module):
                self._teardown_without_moving_the_module()
                return
        handed_back = True
        if self._engine is not None:
            # Lightning hands the module back on the CPU; stage 3 gathers it unit by unit. After
            # -mixed training each parameter is handed back from its master in the dtype it was
            # built in (fp32 for a model built in fp32), as Lightning's AMP leaves them.
            # The engine stays: after fit, a checkpoint save still reads its masters (see
            # Phase.HANDED_BACK), and the next setup builds a new one.
            self._engine.remove_hooks()
            short = self._hand_back_shortfall(self._engine, from_masters)
            if short is None:
                self._engine.gather_to_cpu(from_master=from_masters)
            else:
                handed_back = False
                assert self.lightning_module is not None
                _leave_in_pieces(self.lightning_module, self._engine, from_masters, because=short)
        if from_masters and handed_back and self.lightning_module is not None:
            cast_norm_statistics(self.lightning_module, None)  # back in the dtype of their weights
        module = self.lightning_module
        if (self._layer_sync is not None and module is not None and module._trainer is not None
                and module._trainer.state.fn == TrainerFn.FITTING):
            self.model = self._layer_sync.revert(self.model)
        GLOO_HELD.settle()  # see [Note: tensors outlive the gloo worker]
        assert self.cluster_environment is not None
        self.cluster_environment.teardown()
        super().teardown()

    def _hand_back_shortfall(self, engine: ZeroEngine, from_masters: bool) -> str | None:
        """Why this node's host memory cannot take the stage-3 module whole on each of its ranks,
        agreed by every rank (see [Note: a hand-back that does not fit]); None when it can."""
        whole_bytes = getattr(engine, "whole_bytes", None)
        if whole_bytes is None or self.lightning_module is None:
            return None  # stages 1/2: every rank holds the module whole already
        if self._start_method != "popen":
            return None  # the spawn launcher sends rank 0's whole state dict to the main process
        whole = whole_bytes(from_masters)
        ranks_here = max(1, self.num_processes)
        available = host_memory_available()
        fits = available is None or whole * ranks_here <= HAND_BACK_SHARE * available
        if self.reduce_boolean_decision(fits, all=True):
            return None
        if fits:
            return "another rank found too little host memory to take it whole on each of its node's ranks"
        assert available is not None
        return (f"it takes {size_label(whole)} whole on each of this node's {ranks_here} rank(s),"
                f" {size_label(whole * ranks_here)} in all, more than {HAND_BACK_SHARE:.0%} of the"
                f" {size_label(available)} of host memory available")

    def _take_pieces(self, module: Module) -> None:
        """A module an earlier stage-3 run left in pieces (after an error, or because the host could
        not take it whole): a stage-3 setup builds its engine from them (see [Note: re-sharding a
        module left in pieces]); any other gathers it whole first (a collective: every rank is
        here), see [Note: pieces after an error], and only if the host can take it whole now."""
        entry = _PIECES_AFTER_ERROR.get(module)
        if entry is None:
            return
        parallel = self._parallel
        if (self.config.stage == 3 and not is_split(module)
                and (parallel is None or parallel.dims.tensor == 1) and not self.config.pipeline.enabled):
            self._taken_pieces = _TakenPieces(module, *entry)
            return
        self._check_pieces_fit(module)
        gather_after_error(module)

    def _check_pieces_fit(self, module: Module) -> None:
        """Refuses, on every rank, a module an earlier run left in pieces because the host could not
        take it whole (see [Note: a hand-back that does not fit]) while that is still so."""
        entry = _PIECES_AFTER_ERROR.get(module)
        if entry is None or not entry[2]:
            return
        short = self._hand_back_shortfall(entry[0], entry[1])
        if short is not None:
            raise RuntimeError(
                f"{type(module).__name__} is still each rank's pieces: an earlier run left it so because the host could"
                f" not take it whole, and it still cannot ({short}), so this run (ZeRO stage {self.config.stage}"
                f"{', with a tensor or pipeline mesh' if self.config.stage == 3 else ''}) cannot take it: it would gather"
                " it whole first. A plain stage-3 run (e.g. strategy='zero3') takes the pieces as they are; or give"
                " trainer.fit/validate/test/predict a fresh module and the checkpoint (ckpt_path=...).")

    def _teardown_without_moving_the_module(self) -> None:
        """Lightning's teardown but for moving the module to the CPU: a setup that failed before a
        module built in ``configure_model`` was materialized leaves tensors on the meta device,
        which have no data to move, and "Cannot copy out of meta tensor" would then be the last
        error the user sees instead of the one that stopped the setup (as in Lightning's FSDP
        strategy, which does not move the module either)."""
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    def _interrupted(self) -> bool:
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        return trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        offload = CPUOffloadPolicy()
        strategy_registry.register(
            "zero2_offload",
            cls,
            description="ZeRO stage 2 with the optimizer state offloaded to the CPU (lightning_zero)",
            config=ZeroConfig(stage=2, offload_optimizer=offload),
        )
        strategy_registry.register(
            "zero3_offload",
            cls,
            description="ZeRO stage 3 with the optimizer state and the parameters offloaded to the CPU (lightning_zero)",
            config=ZeroConfig(stage=3, offload_optimizer=offload, offload_params=offload),
        )
        for stage in (1, 2, 3):
            strategy_registry.register(
                f"zero{stage}",
                cls,
                description=f"ZeRO stage {stage} data parallelism (lightning_zero)",
                config=ZeroConfig(stage=stage),
            )
            strategy_registry.register(
                f"zero{stage}_spawn",
                cls,
                description=f"ZeRO stage {stage} data parallelism, ranks started with 'spawn' (lightning_zero)",
                config=ZeroConfig(stage=stage),
                start_method="spawn",
            )


def _do_nothing(*args: Any) -> None:
    pass


# [Note: pieces after an error]
# At stage 3 each rank holds one piece of every parameter; teardown gathers them back into whole
# tensors, a collective. After an error the strategy cannot know whether every rank stopped at the
# same point (an exception on one rank leaves the others inside a collective), so it gathers
# nothing: the module keeps this rank's pieces, 1-d, which a user catching the error would save or
# train on again (the next fit then failed, naming a rank-dependent model). The engine that knows
# the pieces is kept with the module instead (_PIECES_AFTER_ERROR, weakly), a warning says so, and
# gather_after_error(module) gathers the module back whole when every rank calls it. The next
# fit/validate/test/predict on the module, whose setup is a point every rank reaches together,
# builds a stage-3 engine from the pieces ([Note: re-sharding a module left in pieces] in
# zero/stage3/engine.py) or, at other stages and with a tensor or pipeline mesh, calls it first.
# A -mixed run hands the fp32 masters back, as its teardown would have.
# module -> (the engine that knows its pieces, whether to hand back the masters, whether memory was why)
_PIECES_AFTER_ERROR: weakref.WeakKeyDictionary[Module, tuple[ZeroEngine, bool, bool]] = weakref.WeakKeyDictionary()

# [Note: a hand-back that does not fit]
# Handing a stage-3 module back whole puts all of it in host memory on every rank of a node at
# once: a 70B model in bf16 is 140 GB per rank, over a terabyte on a node of 8, which the kernel
# answers by killing processes at the very end of a run. Before it gathers, teardown compares
# the module's whole size times the node's ranks with HAND_BACK_SHARE of the host's available
# memory (MemAvailable, or what a container's or SLURM job's memory cgroup leaves, where that is
# less), and the ranks agree (one flag each). Where it does not fit, the module
# stays each rank's pieces, as after an error ([Note: pieces after an error]); a warning gives
# the numbers and the ways on. Checkpoints already hold the model whole.
HAND_BACK_SHARE = 0.8


def _leave_in_pieces(module: Module, engine: ZeroEngine, from_master: bool, because: str | None = None) -> None:
    _PIECES_AFTER_ERROR[module] = (engine, from_master, because is not None)
    if because is not None:
        rank_zero_warn(
            f"{type(module).__name__} is not handed back whole: {because}. Its parameters stay each rank's piece of"
            " them (ZeRO stage 3). The run's checkpoints hold them whole (`lightning-zero consolidate CKPT OUT` writes"
            " one file, streamed, on any machine), and trainer.save_checkpoint still writes them; the module's own"
            " state_dict() holds this rank's pieces only. lightning_zero.gather_after_error(module), on every rank,"
            " gathers them whole where memory allows. A next stage-3 trainer.fit/validate/test/predict of this module"
            " (without a tensor or pipeline mesh) builds its engine from these pieces, never whole; any other run"
            " gathers them first if memory allows, else it refuses.")
        return
    rank_zero_warn(
        f"After the error, {type(module).__name__}'s parameters are each rank's piece of them (ZeRO stage 3): gathering"
        " them back is a collective, which is not safe after an error that other ranks may not share. The next"
        " trainer.fit/validate/test/predict of this module builds its engine from them (at stage 3, without a"
        " tensor or pipeline mesh) or gathers them back first; to use it outside a Trainer, call"
        " lightning_zero.gather_after_error(module) on every rank.")


# [Note: the start of a training batch]
# Lightning 2.6 opens each training batch with a torch.distributed.broadcast of its SIGTERM flag,
# outside the strategy, and takes any error in it for "no SIGTERM"; its SIGTERM handler runs a
# broadcast of its own on the rank that got the signal, wherever that rank is. At stage 3 a rank
# still gathering for a forward the others never ran (a generate under `if trainer.is_global_zero:`
# in on_train_batch_end or on_train_epoch_end) met the per-batch broadcast and waited for the
# process group's timeout, then trained on out of step. So the ranks agree at the start of each
# batch, as before the strategy's own collectives (one small exchange per batch, beside one per
# gather), and every rank raises at once. The agreement carries the SIGTERM flag in the
# broadcast's place: the handler only notes the signal (and passes it to the launcher's other
# processes, as Lightning's does), without a broadcast that would meet an agreement instead and
# leave that rank waiting inside its signal handler, and without setting trainer.received_sigterm,
# which Lightning reads at the end of a batch or epoch on that rank alone. A SIGTERM on any rank
# stops every rank together at the start of the next training batch (SIGTERMException, with
# trainer.received_sigterm set), where Lightning's broadcast heard only rank 0's.
class _SigtermSeen:
    """Whether this rank got SIGTERM since its last agreement at a batch start."""

    def __init__(self) -> None:
        self.seen = False


class _TakenPieces:
    """A module left in pieces, taken for re-sharding (see [Note: re-sharding a module left in
    pieces] in zero/stage3/engine.py); ``put_back`` leaves it as it was if the setup fails first."""

    def __init__(self, module: Module, engine: ZeroEngine, from_master: bool, for_memory: bool) -> None:
        assert isinstance(engine, Zero3Engine)  # only stage 3 leaves pieces
        self.source = PiecesSource(engine, from_master)
        if from_master:
            cast_norm_statistics(module, None)  # back in their weights' dtype, as a hand-back leaves them
        self.module = module
        self.entry = (engine, from_master, for_memory)
        del _PIECES_AFTER_ERROR[module]

    def put_back(self) -> None:
        self.source.put_back()
        _PIECES_AFTER_ERROR[self.module] = self.entry


def gather_after_error(module: Module) -> bool:
    """Gathers back whole the parameters a stage-3 run stopped by an error left as each rank's
    piece (see [Note: pieces after an error]); returns whether there was anything to gather. A
    collective: call it on every rank, together."""
    entry = _PIECES_AFTER_ERROR.pop(module, None)
    if entry is None:
        return False
    engine, from_master, _ = entry
    engine.gather_to_cpu(from_master=from_master)
    if from_master:
        cast_norm_statistics(module, None)
    return True


def grad_norm(module: Module, norm_type: float | int | str, group_separator: str = "/") -> dict[str, Tensor]:
    """Lightning's ``grad_norm`` for a module trained by a :class:`ZeroStrategy`: each parameter's
    gradient norm and the total, from the reduced gradient shards (the parameters' ``.grad`` is
    None at stages 1-3, so Lightning's own returns nothing). A collective: call it on every rank,
    in ``on_before_optimizer_step``, e.g. ``self.log_dict(grad_norm(self, norm_type=2))``. Under any
    other strategy it is Lightning's."""
    trainer = getattr(module, "_trainer", None)
    strategy = getattr(trainer, "strategy", None)
    if isinstance(strategy, ZeroStrategy) and strategy.zero_optimizers:
        return strategy.grad_norm(norm_type, group_separator)
    from lightning.pytorch.utilities import grad_norm as lightning_grad_norm

    return lightning_grad_norm(module, norm_type, group_separator)  # type: ignore[return-value]


def _auto_fp16_loss_scale(settings: DeepSpeedSettings | None, flag: str) -> LossScaleConfig | None:
    """The loss scaling of a DeepSpeed config whose fp16 section is ``"enabled": "auto"``, for a
    Trainer or Fabric whose precision ``flag`` turned out to be fp16 (None otherwise)."""
    if settings is None or settings.precision is not None or not flag.startswith("16-"):
        return None
    return settings.loss_scale


def _warn_if_loss_scale_left_out(settings: DeepSpeedSettings | None, plugin: ZeroPrecision) -> None:
    """A plugin the user passed decides the precision; the loss scaling an "auto" fp16 section of
    the DeepSpeed config asks for is then not applied, which the user must hear of."""
    wanted = _auto_fp16_loss_scale(settings, str(plugin.precision))
    if wanted is None or plugin.loss_scaler is None or plugin.loss_scaler.config == wanted:
        return
    assert settings is not None
    rank_zero_warn(
        f"The DeepSpeed config {settings.source} asks for fp16 loss scaling {wanted} (its \"auto\" fp16 section), but"
        f" the precision plugin passed has {plugin.loss_scaler.config}, which is used. Pass"
        " ZeroPrecision('16-mixed', loss_scale=strategy.deepspeed_settings.loss_scale) to take the config's, or"
        " Trainer(precision='16-mixed') without a plugin.", category=DeepSpeedConfigWarning)


def _read_deepspeed(source: DeepSpeedSource, stage: int | None, config: object, precision_plugin: object,
                    owner: str = "ZeroStrategy", precision_name: str = "precision_plugin") -> DeepSpeedSettings:
    """The settings of a ``deepspeed_config`` given to ``owner`` (ZeroStrategy, or ZeroFabricStrategy
    whose precision argument is ``precision``), refusing what the config already decides."""
    given = [name for name, value in (("stage", stage), ("config", config)) if value is not None]
    if given:
        raise ValueError(
            f"{owner}(deepspeed_config=..., {'=..., '.join(given)}=...): the DeepSpeed config already says how"
            " ZeRO runs. Give one of them.")
    settings = read_deepspeed_config(source)
    if settings.precision is not None and precision_plugin is not None:
        raise ValueError(
            f"{owner}(deepspeed_config=..., {precision_name}=...): the DeepSpeed config {settings.source} sets the"
            f" precision ({settings.precision!r}). Drop {precision_name}, or disable the config's fp16/bf16 section.")
    message = settings.ignored_keys_message()
    if message is not None:
        rank_zero_warn(message, category=DeepSpeedConfigWarning)
    return settings


_DEFAULT_STAGE = next(field.default for field in fields(ZeroConfig) if field.name == "stage")


def _resolve_config(stage: int | None, config: ZeroConfig | Mapping[str, Any] | None) -> ZeroConfig:
    """The ZeroConfig of ``ZeroStrategy(stage=..., config=...)``. ``stage`` fills in a config that
    leaves the stage at its default (a dict without "stage", or ZeroConfig's default 2: a YAML
    that sets other fields, an autotuner's file passed after the demo's); two different stages,
    both set, are an error."""
    if isinstance(config, Mapping):
        values = dict(config)
        if stage is not None and "stage" not in values:
            values["stage"] = stage
        config = ZeroConfig.from_dict(values)
    if config is not None and not isinstance(config, ZeroConfig):
        raise ValueError(f"ZeroStrategy(config={config!r}) must be a ZeroConfig or a dict of its fields.")
    if config is None:
        return ZeroConfig() if stage is None else ZeroConfig(stage=stage)
    if stage is not None and stage != config.stage:
        if config.stage != _DEFAULT_STAGE:
            raise ValueError(
                f"ZeroStrategy(stage={stage!r}) disagrees with config.stage={config.stage!r}; give the stage once"
                " (either one)."
            )
        config = replace(config, stage=stage)
    return config




def _is_swa_state(state: Any) -> bool:
    """Whether a callback state in a checkpoint is StochasticWeightAveraging's, with its average."""
    return isinstance(state, Mapping) and isinstance(state.get("average_model_state"), Mapping) \
        and {"n_averaged", "latest_update_epoch"} <= set(state)


def _take_swa_averages(checkpoint: dict[str, Any]) -> dict[str, Mapping[str, Any]]:
    """Takes the averages of StochasticWeightAveraging callbacks out of ``checkpoint`` (its
    "callbacks" copied, each such state left with ``average_model_state=None``); by state key, in
    order. At stage 3 an average holds this rank's pieces: saved once from rank 0, as Lightning
    saves callback states, it would give every rank rank 0's pieces back."""
    callbacks = checkpoint.get("callbacks")
    if not isinstance(callbacks, dict):
        return {}
    taken = {key: state["average_model_state"] for key, state in callbacks.items() if _is_swa_state(state)}
    if taken:
        checkpoint["callbacks"] = {key: {**state, "average_model_state": None} if key in taken else state
                                   for key, state in callbacks.items()}
    return taken


def _refuse_weight_averaging(module: Module, layout: str, copy_would: str, fix: str) -> None:
    trainer = module._trainer
    if trainer is not None and any(isinstance(c, _WEIGHT_AVERAGING_CALLBACKS) for c in trainer.callbacks):
        raise ValueError(
            f"StochasticWeightAveraging / WeightAveraging callbacks are not supported with {layout} yet: their copy of"
            f" the model would {copy_would}. Remove the callback or {fix}."
        )


def _raise_together(failure: Exception | None, what: str) -> None:
    """Raises on every rank if ``what`` failed on any (a collective over the world): the rank's own
    error where it failed, elsewhere one that names the first failing rank and its error."""
    messages: list[str | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(messages, None if failure is None else f"{type(failure).__name__}: {failure}")
    if failure is not None:
        raise failure
    for rank, message in enumerate(messages):
        if message is not None:
            raise RuntimeError(
                f"{what} failed on rank {rank}, whose pipeline stages hold other layers than this rank's: {message}"
            )


def _check_params_in_one_optimizer(optimizers: list[Optimizer], module: Module | None) -> None:
    owner: dict[int, int] = {}
    names = {id(param): name for name, param in module.named_parameters()} if module is not None else {}
    for index, optimizer in enumerate(optimizers):
        for group in optimizer.param_groups:
            for param in group["params"]:
                if owner.setdefault(id(param), index) != index:
                    name = f"'{names[id(param)]}' " if id(param) in names else ""
                    raise ValueError(
                        f"The parameter {name}of shape {tuple(param.shape)} is in optimizer {owner[id(param)]} and in"
                        f" optimizer {index}. ZeRO shards each parameter under one optimizer; give every"
                        " optimizer a disjoint set of parameters."
                    )


def _has_meta_tensors(module: Module) -> bool:
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())


def _prepare_meta_build(module: Module, device: torch.device, group: torch.distributed.ProcessGroup | None,
                        check_resettable: bool = True) -> Callable[[Module], None]:
    """For a model (partly) built on the meta device at stage 3, before the engine allocates any
    unit: allocates the meta buffers, checks that every module on the meta device can be
    initialized (an error then leaves nothing half-built; not where the values come from pieces,
    ``check_resettable=False``), moves what was built whole beside it (a backbone built in
    __init__) to ``device`` with rank 0's values over ``group`` (None: one rank), as a model built
    whole is; returns the per-module ``init`` the engine runs as it materializes."""
    unfilled = _materialize_meta_buffers(module, device)
    if check_resettable:
        for name, submodule in module.named_modules():
            _check_resettable(submodule, name)
    meta = frozenset(p for p in module.parameters() if p.is_meta)
    with torch.no_grad():
        for param in module.parameters():
            if not param.is_meta and param.device != device:
                param.data = param.data.to(device)
        for submodule in module.modules():
            for name, buffer in submodule._buffers.items():
                if buffer is not None and buffer.device != device:
                    submodule._buffers[name] = buffer.to(device)
    if group is not None:
        # The buffers just allocated are reset_parameters'; their version counters must not move.
        sync_module_states(module, group, skip=meta | frozenset(unfilled))
    return partial(_reset_parameters, unfilled=unfilled)


def _materialize_meta_buffers(module: Module, device: torch.device) -> dict[Tensor, tuple[str, int]]:
    """Allocates buffers left on the meta device; ``reset_parameters`` is expected to fill them.
    Returns each allocated buffer with its name and version counter, which a write bumps, so that
    :func:`_reset_parameters` can tell one its module's reset_parameters() left as it was allocated
    (uninitialized memory)."""
    allocated: dict[Tensor, tuple[str, int]] = {}
    for prefix, submodule in module.named_modules():
        for name, buffer in list(submodule._buffers.items()):
            if buffer is not None and buffer.is_meta:
                if not any(True for _ in submodule.parameters(recurse=False)):
                    # nothing would ever initialize it: no reset_parameters() runs for this module
                    raise ValueError(
                        f"Buffer '{prefix + '.' if prefix else ''}{name}' was created on the meta device (configure_model"
                        f" under ZeRO-3) in {type(submodule).__name__}, which has no parameters, so it would stay"
                        " uninitialized. Create such buffers in __init__ (outside configure_model), or give the"
                        " module a parameter and a reset_parameters() that fills the buffer."
                    )
                submodule._buffers[name] = fresh = torch.empty_like(buffer, device=device)
                allocated[fresh] = (f"{prefix + '.' if prefix else ''}{name}", fresh._version)
    return allocated


def _check_parallel_combination(config: ZeroConfig, state_dict_type: str, collectives: object) -> None:
    """Refuses, at construction, what a mesh does not support yet (before any process starts)."""
    parallel = config.parallel
    if parallel.is_trivial and not config.pipeline.enabled:
        return
    if collectives is not None:
        raise ValueError(
            f"ZeroStrategy(collectives=...) cannot be combined with a mesh (ZeroConfig.parallel={parallel},"
            f" pipeline.size={config.pipeline.size}): the engine's collectives are built over the mesh's shard group."
            " Drop collectives=, or use plain ZeRO."
        )
    if config.pipeline.enabled and state_dict_type == "full":
        raise ValueError(
            f"ZeroStrategy(state_dict_type='full') is not supported with pipeline parallelism"
            f" (pipeline.size={config.pipeline.size}): every stage holds other layers. Use the default 'sharded'"
            " checkpoints, which hold the whole model, and export one file with `lightning-zero consolidate`."
        )
    if parallel.tensor != 1 and state_dict_type == "full":
        raise ValueError(
            f"ZeroStrategy(state_dict_type='full') is not supported with tensor parallelism (tensor={parallel.tensor}):"
            " use the default 'sharded' checkpoints, which hold the global tensors, and export one file with"
            " `lightning-zero consolidate`."
        )


def _reset_parameters(module: Module, unfilled: Mapping[Tensor, tuple[str, int]] | None = None) -> None:
    """Initializes a module built on the meta device once its parameters are allocated; a buffer
    allocated for it (``unfilled``) that its reset_parameters() did not write is an error, not the
    uninitialized memory it holds. Its callers checked every module with :func:`_check_resettable`
    first, while the parameters were still on the meta device."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()
    for buffer in module._buffers.values():
        if unfilled and buffer is not None and buffer in unfilled and buffer._version == unfilled[buffer][1]:
            raise ValueError(
                f"Buffer '{unfilled[buffer][0]}' of {type(module).__name__} was created on the meta device"
                " (configure_model under ZeRO-3), where the value __init__ gave it does not exist, and"
                f" {type(module).__name__}.reset_parameters() did not fill it, so it would hold uninitialized memory."
                " Fill it in reset_parameters() (e.g. self.mask.copy_(...)), or build the model in __init__"
                " (outside configure_model)."
            )


def _check_resettable(module: Module, name: str = "") -> None:
    """Whether a module built on the meta device can be initialized by its reset_parameters();
    modules built whole beside it keep their values and need none."""
    if parametrize.is_parametrized(module) and any(p.is_meta for p in module.parameters()):
        names = ", ".join(sorted(module.parametrizations.keys()))  # type: ignore[union-attr]
        label = f"'{name}' ({type(module).__name__})" if name else type(module).__name__
        raise ValueError(
            f"{label} is parametrized ({names}: torch.nn.utils.parametrize, e.g. weight_norm or"
            " spectral_norm) and was built on the meta device (configure_model under ZeRO-3), where each module is"
            " initialized by its own reset_parameters(); a parametrized weight is computed from parameters of"
            f" another module (its .parametrizations), which that cannot initialize. Build {label} in __init__"
            " (outside configure_model): ZeRO-3 shards a model built there as well."
        )
    if not callable(getattr(module, "reset_parameters", None)) and any(p.is_meta for p in module.parameters(recurse=False)):
        raise ValueError(
            f"{type(module).__name__} was built on the meta device (configure_model under ZeRO-3) but has no"
            " reset_parameters() to initialize its parameters once they are allocated. Define"
            f" {type(module).__name__}.reset_parameters(), or build the model outside configure_model."
        )
