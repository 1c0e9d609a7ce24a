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
per-parameter state (Adam's ``step``, SGD's momentum) stays as it was; ``zero_grad(set_to_none=False)``
leaves a zero ``.grad`` where there was one, so those parameters keep being stepped. DDP with
``find_unused_parameters=True`` leaves ``.grad`` None for a parameter no rank used since the
last ``zero_grad``, and gives one that some ranks used their gradients averaged with zeros. ZeRO
does the same: every step, one all-reduce of per-parameter "had a gradient" flags
(``_step_flags``) tells every rank which parameters got a gradient on any rank, and only their
masters are listed in the param groups for the step (``_trained_masters``). The common case needs
no all-reduce: the agreement every rank makes before a step (``agree_before_step`` in
consistency.py, an exchange that runs anyway) carries one more value, whether this rank got a
gradient for every parameter; when every rank did, the flags would be all ones, and the step takes
them as such until the next ``zero_grad`` that sets gradients to None (gradients only add up until
then). ``zero_grad(set_to_none=False)`` keeps the flags: a zero gradient is still one. Ranks decide this
from the same exchanged rows, so they skip the all-reduce together. It is only skipped where the
flags span nothing but the engine's group (no loss scaler's overflow flag, no tensor-parallel
ranks, replicas or pipeline stages beyond the ranks that agreed). Since the flags are
agreed, every rank steps the same parameters, also those with no element on it (an empty view),
so per-parameter scalars agree across ranks. At stages 1/2 this needs one master per parameter,
not per bucket: the bucket's master chunk is cut into one view per parameter (see
[Note: sharding layout] in flat.py), and the optimizer's state is keyed by those views,
exactly the pieces the torch-format and sharded checkpoints are written from.

[Note: one layout protocol]
:class:`ShardedOptimizer` is written once for every stage: it takes the step's decisions, clips,
unscales and keeps torch's state-dict format, over a :class:`ShardLayout`, which says where this
rank's master pieces and their gradients live and how gradients reach them (the flat buckets of
stages 1/2 in flat.py, the units of stage 3 in stage3/). Consolidating and loading the
optimizer state is written once, over the layout's pieces and tiles (layout.py).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import inspect
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
import torch.distributed as dist
import torch.optim.optimizer as torch_optimizer
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero._messages import some_of
from lightning_zero.config import ZeroConfig
from lightning_zero.loss_scaler import LossScaler
from lightning_zero.offload.step import StagingBuffers, cpu_adam_steps, fused_cpu_masters
from lightning_zero.zero.device_step import device_adam_masters, device_adam_step
from lightning_zero.zero.comm import Collectives, CountingCollectives
from lightning_zero.zero.layout import ParamPiece, ShardTile

if TYPE_CHECKING:
    from lightning_zero.zero.flat import Bucket, FlatEngine, FlatParamBuffer

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


def _step_hooks(optimizer: Optimizer) -> tuple[dict[int, Any], dict[int, Any]]:
    """The step pre and post hooks registered on ``optimizer`` itself (none on an optimizer that
    skipped ``Optimizer.__init__``)."""
    return getattr(optimizer, "_optimizer_step_pre_hooks", {}), getattr(optimizer, "_optimizer_step_post_hooks", {})


class SyncState(enum.Enum):
    """Whether the master-gradient shards hold every gradient produced so far."""

    PENDING = "gradients were produced (or reductions are in flight) since the last finish_grad_sync"
    SYNCED = "every gradient produced so far is reduced into the master-gradient shards"


def _fused_set(
    fused_cpu: list[tuple[dict[str, Any], Tensor]], fused_device: list[tuple[dict[str, Any], list[Tensor]]]
) -> set[Tensor]:
    """Every master of ``ShardedOptimizer._fused_masters``' two lists."""
    return {master for _, master in fused_cpu} | {m for _, masters in fused_device for m in masters}


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
    if config.allow_unknown_optimizer:
        return
    if isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
        base = next(cls for cls in type(optimizer).__mro__ if cls in ELEMENTWISE_OPTIMIZERS)
        # torch wraps a class's step() in a profiling hook on first use (functools.wraps): compare
        # what the wrappers wrap.
        if inspect.unwrap(type(optimizer).step) is inspect.unwrap(base.step):
            return
        raise ValueError(
            f"{type(optimizer).__module__}.{name} overrides the step() of torch.optim.{base.__name__}, so ZeRO cannot"
            " tell whether its update is still elementwise: each rank steps only its 1/N slice of every parameter,"
            " so anything computed over a whole tensor (a norm, as LARS and LAMB take) would be computed over the"
            f" slice, silently. If {name}'s update is elementwise, set ZeroConfig(allow_unknown_optimizer=True)."
        )
    raise ValueError(
        f"ZeRO does not know whether the optimizer {type(optimizer).__module__}.{name} can be sharded: each"
        " rank steps only its 1/N slice of every parameter, which is exact only when the update is elementwise."
        f" Known elementwise optimizers: {', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}. If {name}'s"
        " update is elementwise, set ZeroConfig(allow_unknown_optimizer=True)."
    )


# [Note: optimizer wrappers]
# Lightning's LightningOptimizer and Fabric's _FabricOptimizer wrap the optimizer in an object whose
# class derives from the optimizer's own (so that isinstance checks pass) and that forwards unknown
# attributes to it. A method they do not override (zero_grad, clip_grad_norm_, state_dict, ...)
# therefore runs with the wrapper as ``self``: what it assigns lands on the wrapper, where the
# optimizer that steps never sees it and later reads through the wrapper see the stale copy (a
# zero_grad that left the "had a gradient" flags and a clip factor in place: parameters stepped
# without a gradient, a NaN clip factor for good). Those methods run on the wrapped optimizer.
_Method = TypeVar("_Method", bound=Callable[..., Any])


def _on_the_optimizer(method: _Method) -> _Method:
    """Runs ``method`` on the ShardedOptimizer a Lightning or Fabric wrapper holds (see [Note:
    optimizer wrappers])."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        inner = self.__dict__.get("_optimizer")
        if isinstance(inner, ShardedOptimizer) and inner is not self:
            return getattr(inner, method.__name__)(*args, **kwargs)
        return method(self, *args, **kwargs)

    return run  # type: ignore[return-value]


class ShardLayout(Protocol):
    """Where one optimizer's master pieces live and how gradients reach them (see [Note: one
    layout protocol]): :class:`~lightning_zero.zero.flat.FlatLayout` at stages 1/2,
    :class:`~lightning_zero.zero.stage3.optimizer.Zero3Layout` at stage 3."""

    collectives: Collectives | CountingCollectives
    comm_device: torch.device  # where small collectives run
    staging: StagingBuffers | None  # the CPU step's low-precision copies (offload)
    on_grad: Callable[[int], None]  # told the optimizer-local index of each parameter given a gradient
    frozen_at_setup: dict[nn.Parameter, str]  # the optimizer's parameters left out as frozen, by name

    def param_name(self, param: nn.Parameter) -> str: ...

    @property
    def num_trainable(self) -> int: ...

    @property
    def sync_pending(self) -> bool:
        """Whether a backward began since gradients were last synchronized (see [Note: what one
        backward is] in reduce.py)."""
        ...

    def master_grads(self) -> Iterator[Tensor]: ...

    def zero_master_grads(self) -> None:
        """Zeroes every master gradient (see [Note: reducing into the master gradient] in reduce.py)."""
        ...

    def trained_masters(self, had_grad: Tensor | None) -> list[list[Tensor]]: ...

    def param_pieces(self) -> list[ParamPiece]: ...

    def tiles(self) -> list[ShardTile]: ...

    def memory_tensors(self) -> tuple[list[Tensor], list[Tensor | None], list[Tensor]]: ...

    def finish_grad_sync(self) -> None: ...

    def drop_local_grads(self) -> None: ...

    def no_sync(self) -> contextlib.AbstractContextManager[None]: ...

    def publish(self) -> None: ...

    def note_stepped(self, had_grad: Tensor) -> None: ...

    def absorb_before_step(self) -> None: ...

    def publish_masters(self) -> None: ...

    def absorb_writes(self, through_data: bool = False) -> bool: ...


class ShardedOptimizer(Optimizer):
    """What every ZeRO stage's optimizer shares: the step's decisions, clipping, loss scaling and
    torch's state-dict format, over the :class:`ShardLayout` that holds the master pieces.

    ``param_groups`` and ``state`` are the wrapped optimizer's own objects, so LR schedulers and
    monitors that read or write either see the same values.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        layout: ShardLayout,
        config: ZeroConfig,
        loss_scaler: LossScaler | None,
    ) -> None:
        self.optimizer = optimizer
        self.layout = layout
        self.collectives = layout.collectives
        self.config = config
        self.loss_scaler = loss_scaler
        self.last_step_skipped = False
        # true gradient = master_grad * coefficient; None means "1 / loss scale", decided when used.
        self._grad_coefficient: Tensor | float | None = None
        self._consolidated: dict[str, Any] | None = None
        # Every parameter of every group as the user listed it, frozen ones included: the index
        # space of torch's optimizer state_dict format.
        self._group_params: list[list[nn.Parameter]] = [list(group["params"]) for group in optimizer.param_groups]
        self.comm_device = layout.comm_device
        # Per trainable parameter: got a gradient since zero_grad. A bytearray: set from every
        # gradient hook, where a tensor element write costs ten times more.
        self._had_grad = bytearray(layout.num_trainable)
        # Every rank got a gradient for every parameter since zero_grad (the step's agreement said so).
        self._every_grad_everywhere = False
        layout.on_grad = self._note_grad
        # Optimizer.__init__ sets up the hook registries torch expects on every optimizer; the
        # groups and state it builds are then replaced by the wrapped optimizer's own.
        masters = [master for group in layout.trained_masters(None) for master in group]
        super().__init__(masters or [torch.zeros(0)], dict(optimizer.defaults))
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state

    @staticmethod
    def _take_optimizer(optimizer: Optimizer, config: ZeroConfig) -> bool:
        """Checks that ``optimizer`` can be sharded and holds no state yet; returns whether its
        (Adagrad's) constructor built an initial state, cleared here and re-created for the
        master pieces by :meth:`_recreate_initial_state`."""
        check_shardable(optimizer, config)
        initial_state = _has_only_constructor_state(optimizer)
        if initial_state:
            optimizer.state.clear()
        if any(optimizer.state.values()):
            raise ValueError(
                f"The {type(optimizer).__name__} handed to ZeRO already has optimizer state; ZeRO must shard it"
                " before the first step. Build the optimizer in configure_optimizers and let the strategy set it up;"
                " to resume, load the state through the checkpoint instead."
            )
        return initial_state

    def _recreate_initial_state(self) -> None:
        for group, group_masters in zip(self.optimizer.param_groups, self.layout.trained_masters(None)):
            for master in group_masters:
                self.optimizer.state[master] = {
                    "step": torch.tensor(0.0),
                    "sum": torch.full_like(master, group["initial_accumulator_value"]),
                }

    def _note_grad(self, index: int) -> None:
        self._had_grad[index] = 1

    def got_every_grad(self) -> bool:
        """Whether every trainable parameter got a gradient on this rank since ``zero_grad``."""
        return 0 not in self._had_grad

    def note_every_grad_everywhere(self) -> None:
        """Every rank got a gradient for every parameter (agreed by all of them, see
        [Note: parameters without a gradient]): the step needs no exchange of flags."""
        self._every_grad_everywhere = True

    # ------------------------------------------------------------------ layout
    def param_pieces(self) -> list[ParamPiece]:
        """Every trainable parameter's master piece on this rank, in param-group order."""
        return self.layout.param_pieces()

    def memory_tensors(self) -> tuple[list[Tensor], list[Tensor | None], list[Tensor]]:
        """(parameter storage the layout owns, gradient tensors, fp32 master tensors) on this rank."""
        return self.layout.memory_tensors()

    def publish_params(self) -> None:
        """Makes the model's parameters equal the master values (a collective), e.g. after the
        masters were loaded from a checkpoint."""
        self.layout.publish_masters()

    def absorb_writes(self, through_data: bool = False) -> None:
        """Takes values user code wrote into the parameters into this rank's masters."""
        self.layout.absorb_writes(through_data)

    # ------------------------------------------------------------------ gradient flow
    @property
    def sync_state(self) -> SyncState:
        return SyncState.PENDING if self.layout.sync_pending else SyncState.SYNCED

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Within it, backward accumulates gradients locally and communicates nothing."""
        with self.layout.no_sync():
            yield

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        """Makes the master-gradient shards hold every gradient so far, averaged over ranks.

        Idempotent: a second call before the next backward does nothing. Every rank must call it.
        """
        # Called before every step (and clipping): values user code wrote into parameters reach
        # the masters before the optimizer reads them.
        self.layout.absorb_before_step()
        if not self.layout.sync_pending:
            return
        self.layout.finish_grad_sync()

    def _step_flags(self) -> tuple[Tensor, bool]:
        """(per trainable parameter: got a gradient on some rank, any rank's gradient overflowed),
        agreed by all ranks.

        One small all-reduce, on every rank, every step, so that all ranks take the same decision:
        per-parameter "had a gradient" flags plus, with a loss scaler, one overflow flag; none when
        the step's agreement already said every rank got every gradient. A parameter without a
        gradient on any rank is skipped by the step, as torch.optim skips it (see
        [Note: parameters without a gradient]).
        """
        if self._every_grad_everywhere and self.loss_scaler is None:
            step_groups = self.collectives.step_groups
            if step_groups.everyone is None and step_groups.pipeline is None:
                return torch.ones(len(self._had_grad), dtype=torch.bool), False
        local = torch.frombuffer(self._had_grad + b"\0", dtype=torch.uint8).to(torch.int32)
        flags = local.to(self.comm_device)
        if self.loss_scaler is not None:
            finite = all(bool(torch.isfinite(grad).all()) for grad in self.layout.master_grads())
            flags[-1] = 0 if finite else 1
        # Over every rank that steps together: tensor-parallel ranks and replicas skip as one (see
        # [Note: a step over the mesh] in comm.py).
        self.collectives.all_reduce_step_flags(flags)
        flags = flags.cpu()
        had_grad = flags[:-1].bool()
        # The overflow flag alone: under a pipeline another stage may have overflowed while this
        # one got no gradient, and every stage's scaler must take the same decision.
        return had_grad, bool(flags[-1])

    # ------------------------------------------------------------------ step

    # [Note: the trainable set]
    # ZeRO shards what the optimizer trains: the parameters of its param groups that require a
    # gradient when the strategy sets it up get master pieces, gradient buckets and hooks; frozen
    # ones get none (a frozen base under LoRA costs no optimizer memory). That set is fixed from
    # then on. A parameter unfrozen later (BaseFinetuning's unfreeze, requires_grad_(True) between
    # epochs) or a param group added later (BackboneFinetuning's add_param_group) has no master to
    # step, and torch's step would skip it without a word (stages 1/2: its .grad is never set) or
    # fail on its 1-d piece (stage 3). So every step first checks both, on every rank before any
    # collective (the ranks run the same callbacks), and raises naming the parameters. Freezing
    # later is fine: a parameter without a gradient is left out of the step, as in torch.
    def _check_trainable_set(self) -> None:
        groups = self.optimizer.param_groups
        added = [param for index, group in enumerate(groups) for param in group["params"][
            len(self._group_params[index]) if index < len(self._group_params) else 0:]]
        unfrozen = [name for param, name in self.layout.frozen_at_setup.items() if param.requires_grad]
        if not added and not unfrozen:
            return
        what = []
        if unfrozen:
            what.append(f"the parameter(s) {some_of(unfrozen)} were frozen (requires_grad=False) when the"
                        " strategy set the optimizer up and are trainable now")
        if added:
            names = [self.layout.param_name(param) for param in added]
            what.append(f"{len(added)} parameter(s) were added to its param groups since ({some_of(names)})")
        raise RuntimeError(
            f"ZeRO shards the parameters {type(self.optimizer).__name__} trains once, at setup, but "
            + " and ".join(what) + ": they have no optimizer shard and would not train. Make every parameter the run"
            " will train trainable, and part of the optimizer, before fit (hold one back with its param group's lr at 0"
            " until it should train), or train in two fits: the second one loads the first one's weights with those"
            " parameters trainable from the start."
        )

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
        self._check_trainable_set()
        if self._can_overlap_step():
            self._overlapped_step()
            return loss
        self.finish_grad_sync()
        had_grad, overflow = self._step_flags()
        self.last_step_skipped = overflow
        if overflow:
            assert self.loss_scaler is not None
            self.zero_grad()
            self.loss_scaler.update(overflow=True)
            return loss
        if not bool(had_grad.any()):
            if self.loss_scaler is not None and self.collectives.step_groups.pipeline is not None:
                self.loss_scaler.update(overflow=False)  # as the stages that stepped do
            return loss
        trained = self.layout.trained_masters(had_grad)
        with self._masters_in_param_groups(trained), self._user_step_hooks():
            self._run_optimizer(trained)
            self._grad_coefficient = None
            self.layout.publish()  # before the post hooks (see [Note: the user's step hooks])
            self.layout.note_stepped(had_grad)
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow=False)
        return loss

    # [Note: a step is an in-place write]
    # torch.optim updates each parameter that has a gradient in place, which bumps its version
    # counter: a graph that saved the parameter before the step then fails in backward ("modified
    # by an inplace operation"), under DDP too. That is the classic GAN mistake of stepping the
    # critic, then backpropagating the generator's loss through the critic's old graph. Here the
    # step writes the masters and publishes them into the parameters by means autograd does not
    # see (a gather into the flat buffer, a copy into the shard), so after publishing, the layout
    # bumps the version of every parameter the step updated (``note_stepped``), and marks the bump
    # as seen, so that ``absorb_writes`` does not take it for a user's write and copy the rounded
    # parameter back over its master.

    # [Note: overlapped step]
    # When the step needs no decision over the whole gradient first (no loss scaler whose overflow
    # check would skip it, no clipping factor) and every master can be stepped bucket by bucket, the
    # step goes bucket by bucket: the reductions still owed are launched, the per-parameter "had a
    # gradient" flags are agreed, and then, as each bucket's reduction lands (in launch order, the
    # same on every rank), its master pieces step and its all-gather starts while the later
    # reductions are still in flight. The CPU step of bucket k then overlaps the reductions of
    # buckets k+1..., and the gather of bucket k the step of bucket k+1. A master can be stepped
    # alone when a fused kernel steps it (the C++ CPU Adam of offloaded masters, the device kernel
    # of the others), or when the user's optimizer is one of torch.optim's own elementwise classes
    # (not a subclass, whose step() may look at every parameter) with no step hooks (which would
    # run once per bucket), and all of its masters share one device (torch picks the foreach or
    # for-loop implementation from the devices of the call: one device, one choice). Each element
    # sees the same operations as in the plain step (finish every reduction, step every master,
    # gather every bucket), so the result is bit-identical. Stages 1/2 only (the layout must offer
    # land_step_publish); stage 3 keeps the plain step. ZeroConfig.overlap_step=False turns it off.
    # The strategy leaves the reductions in flight past the closure only when nothing between the
    # closure and the step reads the gradients (ZeroStrategy._gradients_read_before_step).
    def _can_overlap_step(self) -> bool:
        if not self.config.overlap_step or self.loss_scaler is not None or self._grad_coefficient is not None:
            return False
        if any(_step_hooks(self.optimizer)):
            return False  # they run once around the whole step (see [Note: the user's step hooks])
        if not getattr(self.layout, "can_land_by_bucket", False):
            return False
        trained = self.layout.trained_masters(None)
        fused_cpu, fused_device = self._fused_masters(trained)
        fused = _fused_set(fused_cpu, fused_device)
        rest = [master for masters in trained for master in masters if master not in fused]
        return not rest or (self._steps_by_parts() and len({master.device for master in rest}) == 1)

    # [Note: the user's step hooks]
    # Hooks registered on the user's optimizer (register_step_pre_hook / register_step_post_hook)
    # run once per applied step, as torch runs them around its step(): with the param groups
    # listing this rank's masters (what the step updates), the pre hooks before the first master
    # changes and the post hooks after the last one did and the all-gather published them into the
    # parameters: a post hook reading the module (an EMA, say) sees the stepped model, the same on
    # every rank, as after torch's step (the CPU step writes this rank's chunk of the parameters
    # before the gather fills the rest). The fused kernels update masters without calling that
    # step(), and it may run for only some of the masters, so ZeroOptimizer calls the hooks
    # itself, as torch does (``args`` is ``(optimizer,)``: the closure, if any, has run; a pre hook
    # may return new arguments, which nothing here takes), and its own calls of the optimizer's
    # step() run no hook (_inner_step). A skipped step (overflow, no gradient) runs none, as under GradScaler.
    # While any is registered the step is the plain one, never the overlapped one. torch's global
    # optimizer hooks run once per step() call, on ZeroOptimizer's own.
    @contextlib.contextmanager
    def _user_step_hooks(self) -> Iterator[None]:
        optimizer = self.optimizer
        pre, post = _step_hooks(optimizer)
        if not pre and not post:
            yield
            return
        args: tuple[Any, ...] = (optimizer,)
        for hook in list(pre.values()):
            result = hook(optimizer, args, {})
            if result is not None and not (isinstance(result, tuple) and len(result) == 2):
                raise RuntimeError(
                    f"The step pre hook {hook!r} of {type(optimizer).__name__} returned {result!r}; a step pre hook"
                    " returns None or a tuple (new_args, new_kwargs), as torch.optim requires."
                )
        yield
        for hook in list(post.values()):
            hook(optimizer, args, {})

    def _inner_step(self) -> None:
        """The wrapped optimizer's own step() over what its param groups list now, running no step
        hook (see [Note: the user's step hooks]): its own hooks run once around the whole step
        (_user_step_hooks), torch's global ones on this ZeroOptimizer's step(), which torch wraps
        as every optimizer's. Both are swapped out for the call and back, not cleared: their
        removal handles hold these very dicts. The global ones are module state: another thread
        stepping another optimizer in that window would not run them."""
        optimizer = self.optimizer
        own = _step_hooks(optimizer)
        shared = torch_optimizer._global_optimizer_pre_hooks, torch_optimizer._global_optimizer_post_hooks
        if not any(own) and not any(shared):
            optimizer.step()
            return
        optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks = OrderedDict(), OrderedDict()
        torch_optimizer._global_optimizer_pre_hooks = OrderedDict()
        torch_optimizer._global_optimizer_post_hooks = OrderedDict()
        try:
            optimizer.step()
        finally:
            optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks = own
            torch_optimizer._global_optimizer_pre_hooks, torch_optimizer._global_optimizer_post_hooks = shared

    def _steps_by_parts(self) -> bool:
        """Whether stepping the user's optimizer over disjoint parts of its masters, one after the
        other, computes what one step over all of them does (see [Note: overlapped step])."""
        optimizer = self.optimizer
        if type(optimizer) not in ELEMENTWISE_OPTIMIZERS:
            return False
        hooks = (*_step_hooks(optimizer), torch_optimizer._global_optimizer_pre_hooks,
                 torch_optimizer._global_optimizer_post_hooks)
        return not any(hooks)

    def _fused_masters(
        self, trained: list[list[Tensor]]
    ) -> tuple[list[tuple[dict[str, Any], Tensor]], list[tuple[dict[str, Any], list[Tensor]]]]:
        """Of ``trained`` (per param group): the (group, master) pairs the C++ CPU Adam steps, and
        per group the masters the fused device kernel steps (the rest go through the optimizer)."""
        fused_cpu = fused_cpu_masters(self.optimizer, self.config.offload_optimizer, trained)
        return fused_cpu, device_adam_masters(self.optimizer, self.config, trained, {m for _, m in fused_cpu})

    def _overlapped_step(self) -> None:
        """The step of [Note: overlapped step]."""
        layout = self.layout
        launched = layout.launch_reductions()  # type: ignore[attr-defined]
        had_grad, _ = self._step_flags()
        self.last_step_skipped = False
        if not launched or not bool(had_grad.any()):
            layout.finish_grad_sync()  # lands what was launched; nothing to step
            return
        trained = layout.trained_masters(had_grad)
        fused_cpu, fused_device = self._fused_masters(trained)
        if layout.staging is not None:
            layout.staging.begin_step()

        fused = _fused_set(fused_cpu, fused_device)

        def step_bucket(holders: list[Tensor]) -> None:
            mine = set(holders)
            rest = [[m for m in masters if m in mine and m not in fused] for masters in trained]
            if any(rest):
                with torch.profiler.record_function("zero::optimizer_step"), self._masters_in_param_groups(rest):
                    self._inner_step()
            device = [(group, kept) for group, masters in fused_device if (kept := [m for m in masters if m in mine])]
            if device:
                with torch.profiler.record_function("zero::fused_adam_step"):
                    device_adam_step(self.optimizer, device, 1.0, layout.staging, self.config)
            cpu = [(group, master) for group, master in fused_cpu if master in mine]
            if cpu:
                with torch.profiler.record_function("zero::cpu_adam_step"):
                    cpu_adam_steps(self.optimizer, cpu, 1.0, layout.staging)

        layout.land_step_publish(step_bucket)  # type: ignore[attr-defined]
        layout.note_stepped(had_grad)
        self._grad_coefficient = None
        self.optimizer._opt_called = True  # type: ignore[attr-defined]  # as in _run_optimizer

    def _run_optimizer(self, trained: list[list[Tensor]]) -> None:
        """Steps the masters in ``trained`` (per param group): offloaded Adam/AdamW masters take the
        one-pass C++ CPU step (see [Note: offloaded step] in offload/step.py), device-resident ones
        the fused multi-tensor Adam (see [Note: fused device step] in device_step.py), every other
        master goes through the wrapped torch optimizer."""
        fused_cpu, fused_device = self._fused_masters(trained)
        staging = self.layout.staging
        if staging is not None:
            staging.begin_step()
        if not fused_cpu and not fused_device:
            self._apply_grad_coefficient()
            with torch.profiler.record_function("zero::optimizer_step"), self._masters_in_param_groups(trained):
                self._inner_step()
            return
        coefficient = self._grad_coefficient_now()
        fused_masters = _fused_set(fused_cpu, fused_device)
        rest = [[m for m in masters if m not in fused_masters] for masters in trained]
        if isinstance(coefficient, Tensor) or coefficient != 1.0:
            for master in (m for masters in rest for m in masters):
                master.grad.mul_(coefficient.to(master.grad.device) if isinstance(coefficient, Tensor) else coefficient)
        self._grad_coefficient = 1.0
        with torch.profiler.record_function("zero::optimizer_step"), self._masters_in_param_groups(rest):
            if any(group["params"] for group in self.param_groups):
                self._inner_step()
        if fused_device:
            with torch.profiler.record_function("zero::fused_adam_step"):
                device_adam_step(self.optimizer, fused_device, coefficient, staging, self.config)
        if fused_cpu:
            cpu_coefficient = float(coefficient)  # the CPU kernel takes a float (offload syncs anyway)
            with torch.profiler.record_function("zero::cpu_adam_step"):
                cpu_adam_steps(self.optimizer, fused_cpu, cpu_coefficient, staging)
        # The fused passes are the user's optimizer stepping, without its step() when every shard is
        # fused; an LR scheduler learns of a step only through the flag its wrapper of step() sets,
        # and would otherwise warn that it was stepped first.
        self.optimizer._opt_called = True  # type: ignore[attr-defined]

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
            for grad in self.layout.master_grads():
                grad.mul_(coefficient)
        self._grad_coefficient = 1.0

    @contextlib.contextmanager
    def _masters_in_param_groups(self, masters_per_group: list[list[Tensor]]) -> Iterator[None]:
        """Points each param group at the given masters of this rank for the duration of the step.

        Outside the step the groups list the model's own parameters, so Lightning's
        toggle_optimizer and anything else reading ``param_groups`` sees the model.
        """
        before = [group["params"] for group in self.param_groups]  # nested: the outer step's masters
        for group, masters in zip(self.param_groups, masters_per_group):
            group["params"] = masters
        try:
            yield
        finally:
            for group, params in zip(self.param_groups, before):
                group["params"] = params

    @_on_the_optimizer
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops every gradient: local buckets, reductions in flight and the master-gradient shards.

        As in torch, ``set_to_none=False`` leaves a parameter that had a gradient with a zero one,
        which the next step still steps (weight decay, momentum, Adam's moments); ``True`` (the
        default) leaves it with none, and the step skips it until it gets one (see [Note:
        parameters without a gradient])."""
        with torch.no_grad():
            self.layout.drop_local_grads()
            self.layout.zero_master_grads()
        if set_to_none:
            self._had_grad = bytearray(len(self._had_grad))
            self._every_grad_everywhere = False
        self._grad_coefficient = None

    # ------------------------------------------------------------------ clipping
    @_on_the_optimizer
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
        tensor_sharded = self.collectives.step_groups.tensor_sharded
        if not tensor_sharded:
            return self._norm_of(list(self.layout.master_grads()), norm_type)
        # Squared norms of tensor-parallel shards add up over the tensor group; parameters
        # replicated over it count once (see [Note: a step over the mesh] in comm.py).
        sharded: list[Tensor] = []
        replicated: list[Tensor] = []
        # Through the tiles: param_pieces() would first compare every parameter with its master.
        for piece in (piece for tile in self.layout.tiles() for piece in tile.pieces):
            if piece.holder.grad is not None and piece.master.numel():
                (sharded if piece.param in tensor_sharded else replicated).append(piece.in_holder.slice(piece.holder.grad))
        infinite = math.isinf(norm_type)
        partials = [self._local_max(grads) if infinite else self._local_power_sum(grads, norm_type)
                    for grads in (sharded, replicated)]
        op = dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM
        both = self._reduce_partials(torch.stack(partials), torch.tensor([True, False], device=self.comm_device), op)
        total = both.max() if infinite else both.sum()
        self.collectives.all_reduce_pipeline(total, op)
        return self._unscaled(total if infinite else total.pow(1.0 / norm_type))

    def _reduce_partials(self, values: Tensor, tensor_sharded: Tensor, op: dist.ReduceOp.RedOpType) -> Tensor:
        """Partial norms (maxima, or sums of powers) of this rank's shards, each reduced over the
        engine's group; those of tensor-parallel shards (where ``tensor_sharded``) over the tensor
        group too, where parameters replicated over it count once (see [Note: a step over the mesh]
        in comm.py). Every rank of that group holds the same entries, so the vectors line up."""
        self.collectives.all_reduce(values, op)
        over_tensor = torch.where(tensor_sharded, values, torch.zeros_like(values))
        self.collectives.all_reduce_tensor_parallel(over_tensor, op)
        return torch.where(tensor_sharded, over_tensor, values)

    @_on_the_optimizer
    @torch.no_grad()
    def grad_norms(self, norm_type: float = 2.0) -> dict[str, Tensor]:
        """Each trained parameter's gradient norm, by name: of the averaged, unscaled gradient, as
        ``param.grad.norm(norm_type)`` reads under DDP, from every rank's shard (a collective over the
        engine's group and the tensor-parallel group: every rank calls it). One all-reduce for all
        of them. Under a pipeline each stage has the norms of its own parameters."""
        self.finish_grad_sync()
        norm_type = float(norm_type)
        infinite = math.isinf(norm_type)
        tensor_sharded = self.collectives.step_groups.tensor_sharded
        local: dict[str, Tensor] = {}
        sharded: set[str] = set()
        for piece in (piece for tile in self.layout.tiles() for piece in tile.pieces):
            # Reduced where the shard lives (the CPU under offload); only the scalar moves.
            grads = [piece.in_holder.slice(piece.holder.grad)] if piece.holder.grad is not None else []
            part = self._local_max(grads) if infinite else self._local_power_sum(grads, norm_type)
            previous = local.get(piece.name)
            local[piece.name] = part if previous is None else (
                torch.maximum(previous, part) if infinite else previous + part)
            if piece.param in tensor_sharded:
                sharded.add(piece.name)
        if not local:
            return {}
        names = list(local)
        values = torch.stack([local[name] for name in names])
        mask = torch.tensor([name in sharded for name in names], device=values.device)
        values = self._reduce_partials(values, mask, dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM)
        norms = values if infinite else values.pow(1.0 / norm_type)
        norms = self._unscaled(norms)
        return dict(zip(names, norms.unbind()))

    def _local_max(self, grads: Sequence[Tensor]) -> Tensor:
        partials = [g.abs().max().to(self.comm_device, torch.float32) for g in grads if g.numel()]
        return torch.stack(partials).max() if partials else torch.zeros((), device=self.comm_device)

    def _local_power_sum(self, grads: Sequence[Tensor], norm_type: float) -> Tensor:
        # Partial results move to the communication device: offloaded shards are on the CPU.
        device = self.comm_device
        return sum((g.abs().pow(norm_type).sum().to(device) for g in grads), torch.zeros((), device=device))

    def _norm_of(self, grads: list[Tensor], norm_type: float) -> Tensor:
        """The norm over every rank of the engine's group, of gradients sharded over it (and over
        the pipeline's stages, which hold other parameters)."""
        if math.isinf(norm_type):
            local = self._local_max(grads)
            self.collectives.all_reduce(local, dist.ReduceOp.MAX)
            self.collectives.all_reduce_pipeline(local, dist.ReduceOp.MAX)
            return self._unscaled(local)
        local = self._local_power_sum(grads, norm_type)
        self.collectives.all_reduce(local, dist.ReduceOp.SUM)
        self.collectives.all_reduce_pipeline(local, dist.ReduceOp.SUM)
        return self._unscaled(local.pow(1.0 / norm_type))

    def _unscaled(self, norm: Tensor) -> Tensor:
        coefficient = self._grad_coefficient_now()
        return norm * (coefficient.abs() if isinstance(coefficient, Tensor) else abs(coefficient))

    @_on_the_optimizer
    @torch.no_grad()
    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamps the unscaled gradients to [-clip_value, clip_value]."""
        self.finish_grad_sync()
        self._apply_grad_coefficient()
        for grad in self.layout.master_grads():
            grad.clamp_(-clip_value, clip_value)

    # ------------------------------------------------------------------ state dict
    # [Note: full-format optimizer state]
    # state_dict() is torch's own format, indexed by the user's parameters and shaped like them, so
    # a checkpoint loads at any world size and into plain torch.optim. Building it is a collective
    # (consolidate_state_dict, the protocol of torch's ZeroRedundancyOptimizer that Lightning
    # calls); only the destination rank keeps the full tensors, one tile (a bucket's chunk, a
    # unit's shard) at a time: one all-gather per tile and per-element key.
    @_on_the_optimizer
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The consolidated full state, on the rank that consolidate_state_dict() gathered it to."""
        if self._consolidated is None:
            raise RuntimeError(
                f"{type(self).__name__}.state_dict() needs consolidate_state_dict() first, on every rank; the full"
                " state is then available on the destination rank (0 by default)."
            )
        consolidated, self._consolidated = self._consolidated, None
        return consolidated

    @_on_the_optimizer
    @torch.no_grad()
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gathers the full optimizer state onto rank ``to`` (collective: every rank must call it)."""
        keep = self.collectives.rank == to
        rank, world = self.collectives.rank, self.collectives.world_size
        state: dict[int, dict[str, Any]] = {}
        index_of = self._param_indices()
        for tile in self.layout.tiles():
            # Every rank holds state for the same pieces (the step decisions are agreed), so the
            # keys, and with them the collectives below, are the same on every rank.
            piece_states = [self.optimizer.state.get(piece.holder, {}) for piece in tile.pieces]
            for key in sorted(set().union(*piece_states)):
                gathered = None
                if _is_per_element(tile.pieces, piece_states, key):
                    dtype = next(s[key].dtype for s in piece_states if key in s)
                    chunk = torch.zeros(tile.numel, dtype=dtype, device=self.comm_device)
                    for piece, piece_state in zip(tile.pieces, piece_states):
                        if key in piece_state:
                            start = piece.tile_offsets[rank] - piece.in_holder.start
                            chunk[start : start + piece.holder.numel()].copy_(piece_state[key])
                    gathered = torch.empty(world * tile.numel, dtype=dtype, device=self.comm_device)
                    self.collectives.all_gather(gathered, chunk).wait()
                if not keep:
                    continue
                for piece, piece_state in zip(tile.pieces, piece_states):
                    if key not in piece_state:
                        continue
                    entry = state.setdefault(index_of[piece.param], {})
                    value = piece_state[key]
                    if gathered is not None:
                        parts = [
                            gathered[r * tile.numel + piece.tile_offsets[r] :][: piece.ranges[r].size]
                            for r in range(world)
                        ]
                        entry[key] = torch.cat(parts).view(piece.shape).cpu().clone()
                    else:
                        entry[key] = value.clone() if isinstance(value, Tensor) else value
        self._consolidated = {"state": state, "param_groups": self._indexed_param_groups(index_of)} if keep else None

    @_on_the_optimizer
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
                    if tuple(value.shape) != piece.shape:
                        raise ValueError(
                            f"Optimizer state '{key}' of parameter '{piece.name}' has shape {tuple(value.shape)},"
                            f" but the parameter has shape {piece.shape}: the state comes from a"
                            " different model."
                        )
                    # Padding (in the last piece of a bucket or of a parameter) starts at zero, as in a fresh state.
                    target = torch.zeros_like(piece.holder, dtype=piece.holder.dtype if value.is_floating_point() else value.dtype)
                    piece.in_holder.slice(target).copy_(piece.ranges[rank].slice(value.reshape(-1)))
                    entry[key] = target
                elif isinstance(value, Tensor):
                    # Per-parameter scalars such as Adam's step count; fused/capturable optimizers
                    # keep them on the parameters' device.
                    entry[key] = value.clone().to(piece.holder.device) if on_device else value.clone()
                else:
                    entry[key] = value
            self.optimizer.state[piece.holder] = entry

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
        """The engine owns the gradient hooks (see ZeroEngine.remove_hooks); kept for callers of
        the optimizer-level API."""

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
        engine: FlatEngine | None = None,
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
            engine: the stages-1/2 engine that owns the flat buffers and gradient hooks (one is
                made for this optimizer alone when ``None``).
        """
        from lightning_zero.zero.flat import FlatEngine

        initial_state = self._take_optimizer(optimizer, config)
        self.engine = engine if engine is not None else FlatEngine(module, collectives, config, param_dtype)
        self.param_dtype = param_dtype
        super().__init__(optimizer, self.engine.add_optimizer(optimizer), config, loss_scaler)
        if initial_state:
            self._recreate_initial_state()

    @property
    def flat_buffers(self) -> Iterator[FlatParamBuffer]:
        return self.layout.flat_buffers

    @property
    def buckets(self) -> Iterator[Bucket]:
        return self.layout.buckets

    def gather_master_values(self, keep: bool = True) -> dict[nn.Parameter, Tensor]:
        """Every parameter's whole fp32 value from the master chunks (a collective)."""
        return self.layout.gather_master_values(keep)

    def load_master_values(self, values: dict[nn.Parameter, Tensor]) -> None:
        """Sets the masters of the given parameters from their whole values (no communication)."""
        self.layout.load_master_values(values)

    def remove_hooks(self) -> None:
        self.engine.remove_hooks()


def _is_per_element(pieces: Sequence[ParamPiece], states: Sequence[Mapping[str, Any]], key: str) -> bool:
    """Whether state ``key`` has one value per element of its piece (moments) or is a scalar (step)."""
    for piece, state in zip(pieces, states):
        value = state.get(key)
        if value is not None:
            return isinstance(value, Tensor) and value.dim() == 1 and value.numel() == piece.holder.numel()
    return False


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
