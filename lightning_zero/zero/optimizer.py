"""ZeRO stages 1 and 2: a torch optimizer stepped over each rank's fp32 master shard.

[Note: the user's optimizer is re-pointed, not replaced]
:class:`ZeroOptimizer` takes the optimizer the user built and, for the duration of each step,
points each param group's ``params`` at this rank's master pieces: one view per parameter into
its bucket's master chunk (its state is keyed by them). The user's object keeps its class, its
hyperparameters and its identity, so LR schedulers already attached to it keep working, and the
update is whatever that class computes, applied to 1/N of the elements. That is only exact for
optimizers whose update is elementwise, which :func:`check_shardable` enforces.

[Note: parameters without a gradient]
torch.optim skips a parameter whose ``.grad`` is None: no update, no weight decay, and its
per-parameter state (Adam's ``step``, SGD's momentum) stays as it was. DDP with
``find_unused_parameters=True`` leaves ``.grad`` None for a parameter no rank used since the
last ``zero_grad``, and gives one that some ranks used their gradients averaged with zeros. ZeRO
does the same: every step, one all-reduce of per-parameter "had a gradient" flags
(``_step_flags``) tells every rank which parameters got a gradient on any rank, and only their
masters are listed in the param groups for the step (``_trained_masters``). Since the flags are
agreed, every rank steps the same parameters, also those with no element on it (an empty view),
so per-parameter scalars agree across ranks. At stages 1/2 this needs one master per parameter,
not per bucket: the bucket's master chunk is cut into one view per parameter (see
[Note: sharding layout] in flat_buffer.py), and the optimizer's state is keyed by those views,
exactly the pieces the torch-format and sharded checkpoints are written from.

[Note: gradient flow]
A post-accumulate-grad hook on every parameter adds the new gradient into its bucket's local
buffer and frees ``param.grad``. When gradients are synchronized (not inside
``no_sync()``), a bucket whose parameters have all reported starts its reduce-scatter at once,
overlapping the rest of backward. ``finish_grad_sync`` launches whatever backward left, waits for
all of them and leaves the averaged gradient in each rank's fp32 master-gradient shard.
"""

from __future__ import annotations

import contextlib
import enum
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.config import ZeroConfig
from lightning_zero.loss_scaler import LossScaler
from lightning_zero.zero.comm import Collectives, CountingCollectives
from lightning_zero.zero.flat_buffer import (
    Bucket,
    FlatParamBuffer,
    held_dtype,
    ParamPiece,
    ParamSlot,
    take_written,
    reduce_dtype_for,
)

# Optimizers whose update of one element depends only on that element's gradient and state.
ELEMENTWISE_OPTIMIZERS: tuple[type[Optimizer], ...] = tuple(
    cls
    for cls in (
        getattr(torch.optim, name, None)
        for name in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "RMSprop", "Adadelta", "ASGD", "Rprop")
    )
    if cls is not None
)
# Optimizers known to need the whole tensor (or a closure over the whole model).
_NON_ELEMENTWISE = {
    "LBFGS": "it needs the whole model's parameters and a closure for its line search",
    "SparseAdam": "it only works with sparse gradients, which flat buffers cannot hold",
    "Adafactor": "it factors the second moment over each matrix's rows and columns",
    "Muon": "it orthogonalises each matrix's update",
    "Shampoo": "it preconditions each matrix with its row and column statistics",
}


def _has_only_constructor_state(optimizer: Optimizer) -> bool:
    """True for an Adagrad whose state is still the one its constructor created (no step yet)."""
    if not isinstance(optimizer, torch.optim.Adagrad) or not optimizer.state:
        return False
    return all(float(entry.get("step", 0)) == 0 for entry in optimizer.state.values())


class SyncState(enum.Enum):
    """Whether the master-gradient shards hold every gradient produced so far."""

    PENDING = "gradients were produced (or reductions are in flight) since the last finish_grad_sync"
    SYNCED = "every gradient produced so far is reduced into the master-gradient shards"


def check_shardable(optimizer: Optimizer, config: ZeroConfig) -> None:
    """Raises ``ValueError`` if ZeRO cannot shard ``optimizer`` correctly."""
    name = type(optimizer).__name__
    for reason_name, reason in _NON_ELEMENTWISE.items():
        if name == reason_name:
            raise ValueError(
                f"ZeRO cannot shard the optimizer {name}: {reason}, but each rank only holds 1/N of every"
                " parameter's elements. Use an elementwise optimizer such as torch.optim.AdamW, or train"
                " this model with DDP."
            )
    if isinstance(optimizer, ELEMENTWISE_OPTIMIZERS) or config.allow_unknown_optimizer:
        return
    raise ValueError(
        f"ZeRO does not know whether the optimizer {type(optimizer).__module__}.{name} can be sharded: each"
        " rank steps only its 1/N slice of every parameter, which is exact only when the update is elementwise."
        f" Known elementwise optimizers: {', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}. If {name}'s"
        " update is elementwise, set ZeroConfig(allow_unknown_optimizer=True)."
    )


class ShardedOptimizer(Optimizer):
    """What every ZeRO stage's optimizer shares: the step's decisions, clipping, loss scaling.

    A subclass owns the layout: where the fp32 master shards and their gradients live
    (``_master_grads``, ``_group_masters``), how gradients reach them (``finish_grad_sync``), how
    updated values reach the model (``_publish_params``) and the full-format state dict.
    ``param_groups`` and ``state`` are the wrapped optimizer's own objects, so LR schedulers and
    monitors that read or write either see the same values.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        collectives: Collectives | CountingCollectives,
        config: ZeroConfig,
        loss_scaler: LossScaler | None,
    ) -> None:
        check_shardable(optimizer, config)
        # Adagrad builds its (initial) state in its constructor, for whole parameters; it is
        # re-created for the master shards once they exist (_finish_init).
        self._initial_state_at_init = _has_only_constructor_state(optimizer)
        if self._initial_state_at_init:
            optimizer.state.clear()
        if any(optimizer.state.values()):
            raise ValueError(
                f"The {type(optimizer).__name__} handed to ZeRO already has optimizer state; ZeRO must shard it"
                " before the first step. Build the optimizer in configure_optimizers and let the strategy set it up;"
                " to resume, load the state through the checkpoint instead."
            )
        self.optimizer = optimizer
        self.collectives = collectives
        self.config = config
        self.loss_scaler = loss_scaler
        self.last_step_skipped = False
        # true gradient = master_grad * coefficient; None means "1 / loss scale", decided when used.
        self._grad_coefficient: Tensor | float | None = None
        self._sync_enabled = True
        self._sync_state = SyncState.SYNCED
        self._hook_handles: list[Any] = []
        self._consolidated: dict[str, Any] | None = None
        # Every parameter of every group as the user listed it, frozen ones included: the index
        # space of torch's optimizer state_dict format.
        self._group_params: list[list[nn.Parameter]] = [list(group["params"]) for group in optimizer.param_groups]
        self._had_grad = torch.zeros(0, dtype=torch.int32)
        self.comm_device = torch.device("cpu")  # where small collectives run; subclasses set it
        self._fused_last: set[int] = set()  # masters the C++ CPU step updated (and staged) last
        self._staging: dict[int, Tensor] = {}  # id(master) -> low-precision staging (offload)

    def _finish_init(self, num_trainable: int) -> None:
        self._had_grad = torch.zeros(num_trainable, dtype=torch.int32)
        # Optimizer.__init__ sets up the hook registries torch expects on every optimizer; the
        # groups and state it builds are then replaced by the wrapped optimizer's own.
        masters = [master for group in self._group_masters() for master in group]
        super().__init__(masters or [torch.zeros(0)], dict(self.optimizer.defaults))
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        if self._initial_state_at_init:
            for group, group_masters in zip(self.optimizer.param_groups, self._group_masters()):
                for master in group_masters:
                    self.optimizer.state[master] = {
                        "step": torch.tensor(0.0),
                        "sum": torch.full_like(master, group["initial_accumulator_value"]),
                    }

    # ------------------------------------------------------------------ layout (subclasses)
    def _master_grads(self) -> Iterator[Tensor]:
        """Every fp32 master-gradient tensor of this rank."""
        raise NotImplementedError

    def _group_masters(self) -> list[list[Tensor]]:
        """Per param group, the master tensors the wrapped optimizer steps (one per parameter)."""
        raise NotImplementedError

    def _trained_masters(self, had_grad: Tensor) -> list[list[Tensor]]:
        """Per param group, the masters of the parameters whose flag in ``had_grad`` (indexed as
        ``_had_grad``) is set: those stepped now (see [Note: parameters without a gradient])."""
        raise NotImplementedError

    def memory_tensors(self) -> tuple[list[Tensor], list[Tensor | None], list[Tensor]]:
        """(parameter storage the layout owns, gradient tensors, fp32 master tensors) on this rank."""
        raise NotImplementedError

    def param_pieces(self) -> list[ParamPiece]:
        """Every trainable parameter's master piece on this rank, in param-group order."""
        raise NotImplementedError

    def publish_params(self) -> None:
        """Makes the model's parameters equal the master values (a collective), e.g. after the
        masters were loaded from a checkpoint."""
        # The masters were written outside a step: no staging copy the CPU step wrote holds them.
        self._fused_last = set()
        with torch.no_grad():
            self._publish_params()

    def finish_grad_sync(self) -> None:
        raise NotImplementedError

    def _publish_params(self) -> None:
        raise NotImplementedError

    def _drop_local_grads(self) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ gradient flow
    @property
    def sync_state(self) -> SyncState:
        return self._sync_state

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Within it, backward accumulates gradients locally and communicates nothing."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def _step_flags(self) -> tuple[Tensor, bool]:
        """(per trainable parameter: got a gradient on some rank, any rank's gradient overflowed),
        agreed by all ranks.

        One small all-reduce, on every rank, every step, so that all ranks take the same decision:
        per-parameter "had a gradient" flags plus, with a loss scaler, one overflow flag. A
        parameter without a gradient on any rank is skipped by the step, as torch.optim skips it
        (see [Note: parameters without a gradient]).
        """
        flags = torch.zeros(len(self._had_grad) + 1, dtype=torch.int32, device=self.comm_device)
        flags[:-1] = self._had_grad.to(self.comm_device)
        if self.loss_scaler is not None:
            finite = all(bool(torch.isfinite(grad).all()) for grad in self._master_grads())
            flags[-1] = 0 if finite else 1
        self.collectives.all_reduce(flags, dist.ReduceOp.MAX)
        flags = flags.cpu()
        had_grad = flags[:-1].bool()
        return had_grad, bool(had_grad.any()) and bool(flags[-1])

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Reduces, checks, unscales/clips and applies the update, then publishes the new parameters.

        The step is skipped (parameters and optimizer state untouched) when no parameter got a
        gradient, or, with a loss scaler, when any rank's gradient overflowed; ``last_step_skipped``
        tells which happened last. A parameter that got no gradient on any rank since the last
        ``zero_grad`` is left out of the step, its optimizer state untouched, as in torch.optim.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.finish_grad_sync()
        had_grad, overflow = self._step_flags()
        self.last_step_skipped = overflow
        if overflow:
            assert self.loss_scaler is not None
            self.zero_grad()
            self.loss_scaler.update(overflow=True)
            return loss
        if not bool(had_grad.any()):
            return loss
        self._run_optimizer(self._trained_masters(had_grad))
        self._grad_coefficient = None
        self._publish_params()
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow=False)
        return loss

    def _run_optimizer(self, trained: list[list[Tensor]]) -> None:
        """Steps the masters in ``trained`` (per param group). Offloaded Adam/AdamW masters take the
        one-pass C++ CPU step, which applies the unscale x clip factor and writes the low-precision
        copy in the same pass; every other master goes through the wrapped torch optimizer."""
        fused = self._fused_cpu_masters(trained)
        self._fused_last = {id(master) for _, master in fused}
        if not fused:
            self._apply_grad_coefficient()
            with torch.profiler.record_function("zero::optimizer_step"), self._masters_in_param_groups(trained):
                self.optimizer.step()
            return
        coefficient = float(self._grad_coefficient_now())
        rest = [[m for m in masters if id(m) not in self._fused_last] for masters in trained]
        with torch.no_grad():
            if coefficient != 1.0:
                for master in (m for masters in rest for m in masters):
                    master.grad.mul_(coefficient)
        self._grad_coefficient = 1.0
        with torch.profiler.record_function("zero::optimizer_step"), self._masters_in_param_groups(rest):
            if any(group["params"] for group in self.param_groups):
                self.optimizer.step()
        with torch.profiler.record_function("zero::cpu_adam_step"):
            for group, master in fused:
                self._cpu_adam_step(group, master, coefficient)
        # The fused pass is the user's optimizer stepping, without its step() when every shard is
        # fused; an LR scheduler learns of a step only through the flag its wrapper of step() sets,
        # and would otherwise warn that it was stepped first.
        self.optimizer._opt_called = True  # type: ignore[attr-defined]

    def _fused_cpu_masters(self, trained: list[list[Tensor]]) -> list[tuple[dict[str, Any], Tensor]]:
        """(param group, master) pairs of ``trained`` the C++ CPU Adam steps: offloaded fp32
        masters of Adam/AdamW (wider masters go through torch)."""
        if self.config.offload_optimizer is None or type(self.optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
            return []
        pairs = []
        for group, masters in zip(self.param_groups, trained):
            if group.get("amsgrad") or group.get("maximize") or group.get("differentiable"):
                continue
            pairs += [(group, m) for m in masters if m.device.type == "cpu" and m.dtype == torch.float32]
        return pairs

    def _cpu_adam_step(self, group: dict[str, Any], master: Tensor, coefficient: float) -> None:
        from lightning_zero.ops import fused_adam_step

        state = self.optimizer.state[master]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(master)
            state["exp_avg_sq"] = torch.zeros_like(master)
        state["step"] += 1
        if master.numel() == 0:
            return  # a parameter with no element on this rank: only its step count moves
        beta1, beta2 = group["betas"]
        fused_adam_step(
            master, master.grad, state["exp_avg"], state["exp_avg_sq"],
            step=int(state["step"].item()), lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
            eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
            adamw_mode=bool(group.get("decoupled_weight_decay", isinstance(self.optimizer, torch.optim.AdamW))),
            grad_scale=coefficient,
            low_precision_out=self._staging_of(master),
        )

    def _staging_of(self, master: Tensor) -> Tensor | None:
        """The pinned low-precision buffer the CPU step writes for ``master``, if any."""
        return self._staging.get(id(master))

    def _grad_coefficient_now(self) -> Tensor | float:
        if self._grad_coefficient is None:
            return 1.0 / self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        return self._grad_coefficient

    def _apply_grad_coefficient(self) -> None:
        """Unscales and clips the master gradients in one pass (nothing to do when the factor is 1)."""
        coefficient = self._grad_coefficient_now()
        if not isinstance(coefficient, Tensor) and coefficient == 1.0:
            self._grad_coefficient = 1.0
            return
        with torch.profiler.record_function("zero::unscale_and_clip"):
            for grad in self._master_grads():
                grad.mul_(coefficient)
        self._grad_coefficient = 1.0

    @contextlib.contextmanager
    def _masters_in_param_groups(self, masters_per_group: list[list[Tensor]]) -> Iterator[None]:
        """Points each param group at the given masters of this rank for the duration of the step.

        Outside the step the groups list the model's own parameters, so Lightning's
        toggle_optimizer and anything else reading ``param_groups`` sees the model.
        """
        for group, masters in zip(self.param_groups, masters_per_group):
            group["params"] = masters
        try:
            yield
        finally:
            for group, params in zip(self.param_groups, self._group_params):
                group["params"] = params

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops every gradient: local buckets, reductions in flight and the master-gradient shards."""
        with torch.no_grad():
            self._drop_local_grads()
            for grad in self._master_grads():
                grad.zero_()
        self._had_grad.zero_()
        self._grad_coefficient = None
        self._sync_state = SyncState.SYNCED

    # ------------------------------------------------------------------ clipping
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Scales the gradients so their global norm over all ranks is at most ``max_norm``.

        Returns the (unscaled) norm before clipping, as ``torch.nn.utils.clip_grad_norm_`` does. The
        clip factor is folded into the unscale factor and applied in the step's single pass.
        """
        total = self.global_grad_norm(norm_type)
        clip = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        self._grad_coefficient = self._grad_coefficient_now() * clip
        return total

    @torch.no_grad()
    def global_grad_norm(self, norm_type: float = 2.0) -> Tensor:
        """The norm of the full averaged, unscaled gradient, from every rank's shard (collective)."""
        self.finish_grad_sync()
        norm_type = float(norm_type)
        grads = list(self._master_grads())
        # Partial results move to the communication device: offloaded shards are on the CPU.
        device = self.comm_device
        if math.isinf(norm_type):
            partials = [g.abs().max().to(device, torch.float32) for g in grads if g.numel()]
            local = torch.stack(partials).max() if partials else torch.zeros((), device=device)
            self.collectives.all_reduce(local, dist.ReduceOp.MAX)
            norm = local
        else:
            local = sum((g.abs().pow(norm_type).sum().to(device) for g in grads), torch.zeros((), device=device))
            self.collectives.all_reduce(local, dist.ReduceOp.SUM)
            norm = local.pow(1.0 / norm_type)
        coefficient = self._grad_coefficient_now()
        return norm * (coefficient.abs() if isinstance(coefficient, Tensor) else abs(coefficient))

    @torch.no_grad()
    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamps the unscaled gradients to [-clip_value, clip_value]."""
        self.finish_grad_sync()
        self._apply_grad_coefficient()
        for grad in self._master_grads():
            grad.clamp_(-clip_value, clip_value)

    # ------------------------------------------------------------------ state dict
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The consolidated full state, on the rank that consolidate_state_dict() gathered it to."""
        if self._consolidated is None:
            raise RuntimeError(
                "ZeroOptimizer.state_dict() needs consolidate_state_dict() first, on every rank; the full state"
                " is then available on the destination rank (0 by default)."
            )
        consolidated, self._consolidated = self._consolidated, None
        return consolidated

    def _indexed_param_groups(self, index_of: Mapping[nn.Parameter, Any]) -> list[dict[str, Any]]:
        """The param groups in torch's state-dict form: hyperparameters, and each parameter's label
        in ``index_of`` (its index for torch's format, its name for a sharded checkpoint)."""
        return [
            {**{k: v for k, v in group.items() if k != "params"}, "params": [index_of[p] for p in params]}
            for group, params in zip(self.param_groups, self._group_params)
        ]

    def _begin_load(self, state_dict: dict[str, Any]) -> dict[nn.Parameter, Any]:
        """Checks a torch-format state, takes its hyperparameters and clears the current state;
        returns each parameter's index in the saved state."""
        saved_index = _check_full_optimizer_state(state_dict, self._group_params, type(self.optimizer).__name__)
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self.optimizer.state.clear()
        return saved_index

    def _param_indices(self) -> dict[nn.Parameter, int]:
        index_of: dict[nn.Parameter, int] = {}
        for params in self._group_params:
            for param in params:
                index_of[param] = len(index_of)
        return index_of

    # ------------------------------------------------------------------ teardown
    def remove_hooks(self) -> None:
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(stage={self.config.stage}, optimizer={self.optimizer!r})"



class ZeroOptimizer(ShardedOptimizer):
    """Shards a torch optimizer's state and (stage 2) the gradients over a data-parallel group.

    ``param_groups`` and ``state`` are the wrapped optimizer's own objects, so LR schedulers and
    monitors that read or write either see the same values.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        module: nn.Module,
        collectives: Collectives | CountingCollectives,
        config: ZeroConfig,
        param_dtype: torch.dtype | None = None,
        loss_scaler: LossScaler | None = None,
    ) -> None:
        """
        Args:
            optimizer: the user's optimizer over ``module``'s parameters.
            module: owns the parameters (their names appear in errors).
            collectives: the data-parallel group's collectives.
            config: ZeRO settings.
            param_dtype: the dtype the model's parameters are held and computed in (bf16/fp16 for
                mixed precision); the master shard is fp32, or the parameter's dtype where that is
                wider (float64). ``None`` keeps their dtype.
            loss_scaler: for fp16: gradients arrive multiplied by its scale; steps whose gradients
                overflow on any rank are skipped and reported to it.
        """
        super().__init__(optimizer, collectives, config, loss_scaler)
        self.param_dtype = param_dtype
        self.buffers: list[list[FlatParamBuffer]] = []  # [param group][dtype]
        self._slot_of: dict[nn.Parameter, tuple[FlatParamBuffer, Bucket, ParamSlot]] = {}
        self._init_buffers(module)
        self._init_hooks()
        self._launch_order = list(self.buckets)
        self._launch_cursor = 0
        self._backward_task: int | None = None  # the autograd graph task whose gradients arrive now
        self._backward_synced = True
        self._staging = {
            id(piece.holder): bucket.staging[_offset_in(piece.holder, bucket.master) :][: piece.holder.numel()]
            for bucket in self.buckets
            if bucket.staging is not None
            for piece in bucket.pieces
        }
        self.comm_device = next(iter(self._slot_of), torch.zeros(0)).device
        self._finish_init(len(self._slot_of))
        self._forget_writes()

    # ------------------------------------------------------------------ setup
    def _init_buffers(self, module: nn.Module) -> None:
        names = {param: name for name, param in module.named_parameters(remove_duplicate=True)}
        device = next(iter(names), torch.zeros(0)).device
        index = 0
        seen: set[int] = set()
        for group_idx, group in enumerate(self.optimizer.param_groups):
            by_dtype: dict[torch.dtype, list[tuple[int, str, nn.Parameter]]] = {}
            for param in group["params"]:
                if id(param) in seen:
                    raise ValueError(
                        f"A parameter of shape {tuple(param.shape)} appears twice in the param groups of"
                        f" {type(self.optimizer).__name__}; list each parameter once."
                    )
                seen.add(id(param))
                if param not in names:
                    raise ValueError(
                        f"Param group {group_idx} of {type(self.optimizer).__name__} holds a parameter of shape"
                        f" {tuple(param.shape)} that is not a parameter of the LightningModule; ZeRO can only shard"
                        " the module's own parameters. Build the optimizer from self.parameters()."
                    )
                if not param.requires_grad:
                    continue  # torch.optim skips parameters without gradients; so does ZeRO.
                by_dtype.setdefault(param.dtype, []).append((index, names[param], param))
                index += 1
            group_buffers = [
                FlatParamBuffer(
                    entries,
                    bucket_size=self.config.reduce_bucket_size,
                    world_size=self.collectives.world_size,
                    rank=self.collectives.rank,
                    keep_grad_buffers=self.config.stage == 1,
                    device=device,
                    param_dtype=held_dtype(dtype, self.param_dtype),
                    grad_dtype=reduce_dtype_for(dtype, self.config.reduce_torch_dtype),
                    offload=self.config.offload_optimizer,
                )
                for dtype, entries in by_dtype.items()
            ]
            for buffer in group_buffers:
                for bucket in buffer.buckets:
                    for slot in bucket.slots:
                        self._slot_of[slot.param] = (buffer, bucket, slot)
            self.buffers.append(group_buffers)

    def _init_hooks(self) -> None:
        for param in self._slot_of:
            self._hook_handles.append(param.register_post_accumulate_grad_hook(self._on_grad_ready))

    # ------------------------------------------------------------------ gradient flow
    @property
    def flat_buffers(self) -> Iterator[FlatParamBuffer]:
        for group_buffers in self.buffers:
            yield from group_buffers

    @property
    def buckets(self) -> Iterator[Bucket]:
        for buffer in self.flat_buffers:
            yield from buffer.buckets

    def _master_grads(self) -> Iterator[Tensor]:
        return (bucket.master_grad for bucket in self.buckets)

    def _group_masters(self) -> list[list[Tensor]]:
        return self._trained_masters(torch.ones(len(self._slot_of), dtype=torch.bool))

    def _trained_masters(self, had_grad: Tensor) -> list[list[Tensor]]:
        return [
            [
                piece.holder
                for buffer in group_buffers
                for bucket in buffer.buckets
                for slot, piece in zip(bucket.slots, bucket.pieces)
                if had_grad[slot.index]
            ]
            for group_buffers in self.buffers
        ]

    def param_pieces(self) -> list[ParamPiece]:
        self.absorb_writes(through_data=True)  # a checkpoint reads the masters
        return [piece for bucket in self.buckets for piece in bucket.pieces]

    # [Note: writes to parameters at stages 1/2]
    # The parameters are whole, but the step updates the fp32 master chunks and publishes them over
    # the parameters, so a value user code wrote into a parameter between steps (weight clipping,
    # Lightning's weight-averaging callbacks) would be lost. An in-place write through the
    # parameter bumps its version counter: before a step the written parameters' chunks go into
    # the masters. Writes through ``.data`` bypass the counter; before a save and at teardown the
    # masters are also compared with the parameters (where they differ, the parameter was written).
    def _forget_writes(self) -> None:
        self._seen_versions = {param: param._version for param in self._slot_of}

    @torch.no_grad()
    def absorb_writes(self, through_data: bool = False) -> None:
        """Takes values user code wrote into the parameters into this rank's master chunks."""
        # The flat parameter buffer holds what was written, so one comparison per bucket covers
        # every written parameter of it.
        written = {bucket for param, (_, bucket, _) in self._slot_of.items()
                   if through_data or param._version != self._seen_versions.get(param, param._version)}
        for bucket in written:
            take_written(bucket.master, bucket.owned_chunk(bucket.param_data))
        self._forget_writes()

    def memory_tensors(self) -> tuple[list[Tensor], list[Tensor | None], list[Tensor]]:
        grads: list[Tensor | None] = [bucket.master_grad for bucket in self.buckets]
        grads += [bucket.grad_data for bucket in self.buckets]
        return [], grads, [bucket.master for bucket in self.buckets]

    def _drop_local_grads(self) -> None:
        self._launch_remaining()  # what other ranks launched, this one must too before dropping
        for buffer in self.flat_buffers:
            for bucket in buffer.buckets:
                bucket.reset()
        for param in self._slot_of:
            param.grad = None
        self._launch_cursor = 0
        self._backward_task = None

    @torch.no_grad()
    def _on_grad_ready(self, param: Tensor) -> None:
        if param.grad is None:
            return
        task = torch._C._current_graph_task_id()
        if task != self._backward_task:
            self._start_backward(task)
        buffer, bucket, slot = self._slot_of[param]  # type: ignore[index]
        bucket.accumulate(slot, param.grad)
        param.grad = None
        self._had_grad[slot.index] = 1
        self._sync_state = SyncState.PENDING
        if self._backward_synced and bucket.mark_ready():
            bucket.ready_to_reduce = True
            self._launch_ready_reductions()
            if self.config.offload_optimizer is not None:
                for other in self.buckets:  # reductions already done move to the CPU now
                    other.poll()

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

    # [Note: one launch order]
    # Buckets are reduced in bucket order (reverse parameter order, i.e. backward order) on every
    # rank: one complete out of turn waits for those before it. Each synchronized backward issues
    # exactly one reduction per bucket: what it left unlaunched (a parameter without a gradient on
    # this rank) goes out, with zeros where needed, when the next backward starts or at
    # finish_grad_sync. So ranks whose graphs differ still issue the same collectives in the same
    # order, and a parameter used on some ranks only gets their gradients, as with DDP's
    # find_unused_parameters.
    def _launch_ready_reductions(self) -> None:
        while self._launch_cursor < len(self._launch_order):
            bucket = self._launch_order[self._launch_cursor]
            if not bucket.ready_to_reduce:
                return
            bucket.start_reduce(self.collectives)
            bucket.ready_to_reduce = False
            self._launch_cursor += 1

    def _start_backward(self, task: int) -> None:
        self._launch_remaining()
        for bucket in self._launch_order:
            bucket.forget_ready()
        self._backward_task = task
        self._backward_synced = self._sync_enabled

    def _launch_remaining(self) -> None:
        if self._backward_task is not None and self._backward_synced:
            for bucket in self._launch_order[self._launch_cursor :]:
                # Past the cursor, a reduction in flight is an earlier backward's (reduce_every_micro_step):
                # it lands first, and this backward's still goes out (zeros here), as on the ranks
                # whose gradients finished it early.
                bucket.finish_reduce()
                bucket.start_reduce(self.collectives)
                bucket.ready_to_reduce = False
        self._launch_cursor = 0

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        """Makes the master-gradient shards hold every gradient so far, averaged over ranks.

        Idempotent: a second call before the next backward does nothing. Every rank must call it.
        """
        # Called before every step (and clipping): written parameters reach the masters first.
        self.absorb_writes()
        if self._sync_state is SyncState.SYNCED:
            return
        with torch.profiler.record_function("zero::finish_grad_sync"):
            # What backward did not launch goes out now, in the one launch order (see the note);
            # after accumulation under no_sync only, that is every bucket.
            if self._backward_task is None or not self._backward_synced:
                self._backward_task, self._backward_synced = -1, True
                self._launch_cursor = 0
            self._launch_remaining()
            self._backward_task = None
            for bucket in self.buckets:
                bucket.finish_reduce()
        self._sync_state = SyncState.SYNCED

    def _publish_params(self) -> None:
        # A bucket's staging holds the new low-precision values only if the C++ step wrote every
        # piece of it (a skipped parameter's piece was not written): else the master is cast.
        staged = {
            id(bucket.master)
            for bucket in self.buckets
            if all(id(piece.holder) in self._fused_last for piece in bucket.pieces)
        }
        handles = [
            handle
            for buffer in self.flat_buffers
            for handle in buffer.start_all_gather(self.collectives, staged=staged)
        ]
        with torch.profiler.record_function("zero::wait_all_gather"):
            for handle in handles:
                handle.wait()

    # ------------------------------------------------------------------ state dict
    # [Note: full-format optimizer state]
    # state_dict() is torch's own format, indexed by the user's parameters and shaped like them, so
    # a checkpoint loads at any world size and into plain torch.optim. Building it is a collective
    # (consolidate_state_dict, the protocol of torch's ZeroRedundancyOptimizer that Lightning
    # calls); only the destination rank keeps the full tensors, one bucket at a time.

    @torch.no_grad()
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gathers the full optimizer state onto rank ``to`` (collective: every rank must call it)."""
        keep = self.collectives.rank == to
        state: dict[int, dict[str, Any]] = {}
        index_of = self._param_indices()
        for bucket in self.buckets:
            # Every rank holds state for the same pieces (the step decisions are agreed), so the
            # keys, and with them the collectives below, are the same on every rank.
            piece_states = [self.optimizer.state.get(piece.holder, {}) for piece in bucket.pieces]
            for key in sorted(set().union(*piece_states)):
                per_element = _is_per_element(bucket.pieces, piece_states, key)
                full = None
                if per_element:
                    # One all-gather per bucket and key: the pieces' state tensors tile the chunk.
                    dtype = next(s[key].dtype for s in piece_states if key in s)
                    chunk = torch.cat([
                        s[key] if key in s else torch.zeros_like(piece.holder, dtype=dtype)
                        for piece, s in zip(bucket.pieces, piece_states)
                    ])
                    full = torch.empty(bucket.padded_numel, dtype=dtype, device=self.comm_device)
                    self.collectives.all_gather(full, chunk.to(self.comm_device)).wait()
                if not keep:
                    continue
                for slot, piece_state in zip(bucket.slots, piece_states):
                    if key not in piece_state:
                        continue
                    entry = state.setdefault(index_of[slot.param], {})
                    value = piece_state[key]
                    if full is not None:
                        entry[key] = slot.bucket_range.slice(full).view_as(slot.param).cpu().clone()
                    else:
                        entry[key] = value.clone() if isinstance(value, Tensor) else value
        self._consolidated = {"state": state, "param_groups": self._indexed_param_groups(index_of)} if keep else None

    @torch.no_grad()
    def load_master_values(self, values: dict[nn.Parameter, Tensor]) -> None:
        """Sets the masters of the given parameters from their whole values (no communication:
        each rank takes its piece), e.g. from a full checkpoint."""
        rank = self.collectives.rank
        for piece in (piece for bucket in self.buckets for piece in bucket.pieces):
            value = values.get(piece.param)
            if value is not None:
                piece.master.copy_(piece.ranges[rank].slice(value.reshape(-1)))
        self._forget_writes()  # the parameters were written with these values: not a user's write

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Loads a full-format state (from any world size, or from plain torch.optim) into this rank's pieces."""
        saved_index = self._begin_load(state_dict)
        saved_state: dict[Any, dict[str, Any]] = state_dict["state"]
        rank = self.collectives.rank
        on_device = self.optimizer.defaults.get("fused") or self.optimizer.defaults.get("capturable")
        for piece in self.param_pieces():
            saved = saved_state.get(saved_index[piece.param])
            if not saved:
                continue  # nothing was saved for this parameter: a fresh optimizer state, as in torch
            entry: dict[str, Any] = {}
            for key, value in saved.items():
                if isinstance(value, Tensor) and value.dim() > 0:
                    if value.shape != piece.param.shape:
                        raise ValueError(
                            f"Optimizer state '{key}' of parameter '{piece.name}' has shape {tuple(value.shape)},"
                            f" but the parameter has shape {tuple(piece.param.shape)}: the state comes from a"
                            " different model."
                        )
                    # Padding (in the last piece of a bucket) starts at zero, as in a fresh state.
                    target = torch.zeros_like(piece.holder)
                    piece.in_holder.slice(target).copy_(piece.ranges[rank].slice(value.reshape(-1)))
                    entry[key] = target
                elif isinstance(value, Tensor):
                    # Per-parameter scalars such as Adam's step count; fused/capturable optimizers
                    # keep them on the parameters' device.
                    entry[key] = value.clone().to(piece.holder.device) if on_device else value.clone()
                else:
                    entry[key] = value
            self.optimizer.state[piece.holder] = entry


def _is_per_element(pieces: Sequence[ParamPiece], states: Sequence[Mapping[str, Any]], key: str) -> bool:
    """Whether state ``key`` has one value per element of its piece (moments) or is a scalar (step)."""
    for piece, state in zip(pieces, states):
        value = state.get(key)
        if value is not None:
            return isinstance(value, Tensor) and value.dim() == 1 and value.numel() == piece.holder.numel()
    return False


def _offset_in(view: Tensor, base: Tensor) -> int:
    """Where the 1-d ``view`` starts inside ``base``, the tensor it is a slice of."""
    return view.storage_offset() - base.storage_offset()


def _check_full_optimizer_state(
    state_dict: dict[str, Any], group_params: list[list[nn.Parameter]], optimizer_name: str
) -> dict[nn.Parameter, Any]:
    """Checks a torch-format optimizer state against the param groups; maps each param to its saved index."""
    groups = state_dict.get("param_groups")
    if not isinstance(groups, list) or "state" not in state_dict:
        raise ValueError(
            "Not an optimizer state_dict: expected the keys 'state' and 'param_groups' of torch's format,"
            f" got {sorted(state_dict)}."
        )
    if len(groups) != len(group_params):
        raise ValueError(
            f"The optimizer state has {len(groups)} param groups but {optimizer_name} has"
            f" {len(group_params)}: it comes from a different configure_optimizers()."
        )
    saved_index: dict[nn.Parameter, Any] = {}
    for number, (saved, params) in enumerate(zip(groups, group_params)):
        if len(saved["params"]) != len(params):
            raise ValueError(
                f"Param group {number} has {len(saved['params'])} parameters in the optimizer state but"
                f" {len(params)} in this model: the state comes from a different model or optimizer setup."
            )
        saved_index.update(zip(params, saved["params"]))
    return saved_index


@contextlib.contextmanager
def no_sync(optimizers: Sequence[ShardedOptimizer]) -> Iterator[None]:
    """``ShardedOptimizer.no_sync`` for several optimizers at once."""
    with contextlib.ExitStack() as stack:
        for optimizer in optimizers:
            stack.enter_context(optimizer.no_sync())
        yield
