"""One engine interface for every ZeRO stage.

[Note: one engine protocol]
The strategy, the optimizers and the checkpoint code talk to the engine only through
:class:`ZeroEngine`: :class:`~lightning_zero.zero.flat.FlatEngine` at stages 1/2 (whole
parameters, flat buffers per optimizer) and :class:`~lightning_zero.zero.stage3.Zero3Engine` at
stage 3 (sharded parameters, gathered per unit). Where a stage has nothing to do (holding
parameters for a step at stages 1/2) its method is a documented no-op, so callers need no stage
branches; :func:`make_engine` is the one place that picks the stage.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zero.config import ZeroConfig
from lightning_zero.zero.comm import Collectives, CountingCollectives
from lightning_zero.zero.layout import ParamPiece

if TYPE_CHECKING:
    from lightning_zero.zero.stage3 import PiecesSource


@runtime_checkable
class ZeroEngine(Protocol):
    """What every stage's engine offers its callers."""

    module: nn.Module
    collectives: Collectives | CountingCollectives
    config: ZeroConfig
    stage_shards_params: bool  # whether parameters outside a gather are this rank's pieces

    # ---- optimizers
    def wrap_optimizer(self, optimizer: Optimizer, loss_scaler: Any = None) -> Any:
        """The user's optimizer as a ShardedOptimizer over this engine's pieces."""
        ...

    # ---- the step: what is gathered for it, and gradient synchronization
    def hold_for_step(self) -> None:
        """Gathers what a whole step (and its backward) needs beyond the units' own hooks."""
        ...

    def release_after_step(self) -> None: ...

    def begin_backward(self) -> None:
        """A backward starts, on every rank, whatever it reaches: its gradients are one round of
        reductions (see [Note: what one backward is] in reduce.py)."""
        ...

    def close_backward(self) -> None:
        """The backward begin_backward announced has returned."""
        ...

    def finish_grad_sync(self) -> None:
        """Every gradient so far lands, averaged over ranks, in the master gradients (a collective;
        each optimizer's step calls it for its own pieces)."""
        ...

    def absorb_param_grads(self) -> None:
        """Gradients a backward left in ``.grad`` without the accumulation hook join the engine's
        (see [Note: pipeline stages] in parallel/pipeline.py)."""
        ...

    def has_leftover_grads(self) -> bool:
        """Whether gradients arrived after their reduction of that backward went out."""
        ...

    def expect_leftover_grads(self) -> None:
        """Another rank has leftover gradients: this one sends the extra round too."""
        ...

    def end_backward(self) -> None:
        """Frees what a finished backward still holds."""
        ...

    def free_idle(self) -> None:
        """Frees what nobody holds (prefetched but unused)."""
        ...

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Within it, backward accumulates gradients locally and communicates nothing."""
        ...

    def explain_backward_error(self, error: RuntimeError) -> str | None:
        """What an autograd error means under this stage, if the stage explains it."""
        ...

    def check_parameters_unchanged(self) -> None: ...

    # ---- whole parameters
    def gathered(self, writeback: bool = True) -> contextlib.AbstractContextManager[None]:
        """Every parameter whole for the duration (a collective); changes are kept."""
        ...

    def true_shapes(self) -> contextlib.AbstractContextManager[None]:
        """Every parameter shows its true shape (for configure_optimizers)."""
        ...

    def gather_to_cpu(self, from_master: bool) -> None:
        """Hands the module back whole (teardown); with ``from_master``, the fp32 master values."""
        ...

    # ---- masters and checkpoints
    def trained_params(self) -> set[nn.Parameter]:
        """The parameters laid out as trained (with master gradients), whatever their requires_grad
        says now: those the optimizers took at stages 1/2, those requiring a gradient when the
        model was sharded at stage 3."""
        ...

    def param_pieces(self) -> list[ParamPiece]:
        """Every parameter's master piece on this rank, as checkpoints save them."""
        ...

    def absorb_writes(self, through_data: bool = False) -> bool:
        """Takes values user code wrote into the parameters into the masters; with
        ``through_data``, compares them all, and returns whether a write through ``.data`` was found."""
        ...

    def publish_masters(self) -> None:
        """After the masters were written (a load): the parameters take their values (a collective)."""
        ...

    def full_state_dict(self, to: int = 0) -> dict[str, Any]:
        """The module's state dict with whole parameters, on rank ``to`` (a collective)."""
        ...

    def load_full_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Loads whole values (every rank passes the same dict) into this rank's pieces."""
        ...

    def remove_hooks(self) -> None: ...


# [Note: engines of earlier runs]
# A Trainer (or Fabric) and its engine, optimizers and optimizer state hold each other in
# reference cycles, so a Trainer the user dropped (``trainer = pl.Trainer(...)`` again, after an
# error or a finished fit) is freed only when Python's cyclic collector next runs, and large
# tensors do not prompt it: it counts objects, not bytes. Its masters, optimizer state and pieces
# then stay beside the new engine's, twice the model state at the moment a large model can least
# afford it. So building an engine while engines built earlier in this process are still alive
# runs one full collection first, when they were built over at least COLLECT_FROM_BYTES of
# parameters: a collection costs about 0.2 s with transformers loaded, and for a small model the
# state it could free is small too. An engine built from another's pieces (see [Note: re-sharding
# a module left in pieces]) needs that one alive while it builds; its caller collects again once
# it has let go of it, before the new optimizers' state is allocated.
COLLECT_FROM_BYTES = 256 << 20
_ENGINES_BUILT: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # engine -> its parameters' bytes


def collect_dropped_engines() -> None:
    """One full collection of Python's garbage when the engines built so far and still alive
    were built over at least COLLECT_FROM_BYTES of parameters (see [Note: engines of earlier runs])."""
    if _ENGINES_BUILT and sum(_ENGINES_BUILT.values()) >= COLLECT_FROM_BYTES:
        gc.collect()


def make_engine(
    module: nn.Module,
    collectives: Collectives | CountingCollectives,
    config: ZeroConfig,
    param_dtype: torch.dtype | None,
    device: torch.device,
    init: Callable[[nn.Module], None] | None = None,
    source: PiecesSource | None = None,
) -> ZeroEngine:
    """The engine for ``config.stage``, with the parameters in place: at stage 3 sharded (from
    their real values; for a module on the meta device, materialized unit by unit with ``init``,
    or taken unit by unit from the pieces another engine holds, ``source``) and hooked; at stages
    1/2 whole (each optimizer's buffers come with ``wrap_optimizer``)."""
    collect_dropped_engines()  # see [Note: engines of earlier runs]
    param_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    engine: ZeroEngine
    if config.stage != 3:
        from lightning_zero.zero.flat import FlatEngine

        engine = FlatEngine(module, collectives, config, param_dtype)
    else:
        from lightning_zero.zero.stage3 import Zero3Engine

        sharded = Zero3Engine(module, collectives, config, param_dtype, device)
        if source is not None:
            sharded.shard_from(source)
        elif init is not None:
            sharded.materialize_and_shard(init)
        else:
            sharded.shard()
        sharded.install_hooks()
        engine = sharded
    _ENGINES_BUILT[engine] = param_bytes
    return engine


__all__ = ["ZeroEngine", "collect_dropped_engines", "make_engine"]
