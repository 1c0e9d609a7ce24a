"""ZeRO stage 3's module and autograd hooks: when each unit is gathered, prefetched, held and freed.

[Note: stage-3 lifecycle]
Forward: a unit's root module's pre-hook acquires it (gather, refcounted) and prefetches the next
units in the recorded order; its post-hook releases it and registers a hook on its outputs that
re-gathers the unit when backward reaches it. Backward: once every parameter of the unit has its
gradient, the unit is reduced and freed. Parameters not under any unit form the root unit, held
for the whole step (and its backward) by the strategy. A module that uses a parameter of another
unit (tied weights) acquires that unit around its own forward and backward as well.

The engine's phase (:class:`Phase`) moves BUILT -> IDLE (sharded) -> FORWARD -> BACKWARD -> IDLE
(``end_backward``) ... -> HANDED_BACK (``gather_to_cpu``), or TAKEN (a later engine re-sharded the
module from this one's pieces); every hook and entry point checks it
when entered. What one step's forward leaves for its backward (calls, held and visited units)
lives in one :class:`StepState`, reset when the backward ends; the gather order recorded during
the first step lives in :class:`GatherOrder`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from lightning_zero.zero.comm import Collectives, CountingCollectives
from lightning_zero.zero.consistency import Point, RanksDisagreeError, agree_at
from lightning_zero.zero.layout import DataWriteCheck
from lightning_zero.zero.reduce import ReduceSchedule
from lightning_zero.zero.stage3.partition import innermost_prefix
from lightning_zero.zero.stage3.unit import ShardedParam, ShardedUnit, UnitState


class Phase(enum.Enum):
    """Where the stage-3 engine is in its life; checked when each hook is entered."""

    BUILT = "units exist but the parameters are not sharded yet (shard() or materialize_and_shard() comes next)"
    IDLE = "sharded, outside any forward or backward: units are gathered only for holders (a step, gathered())"
    FORWARD = "a forward under grad mode runs: units are acquired around each module's forward"
    BACKWARD = "a backward runs: units are held until their gradients are reduced"
    HANDED_BACK = (
        "every parameter got its whole tensor back (gather_to_cpu): no hook runs any more; the masters stay"
        " readable (a checkpoint saved after fit) and whole-parameter calls act on the module directly"
    )
    TAKEN = (
        "a later run's engine took the module's parameters from this engine's pieces (re-sharding): this one"
        " holds none of them any more"
    )


class _GatherFor(enum.Enum):
    """Why a unit is gathered, told to the other ranks with the unit (for the error when they disagree)."""

    FORWARD = 0
    BACKWARD = 1
    PREFETCH = 2
    REFRESH = 3


@dataclass
class GatherOrder:
    """The order units were gathered in during the first step, replayed to prefetch after it."""

    forward: list[ShardedUnit] = field(default_factory=list)
    backward: list[ShardedUnit] = field(default_factory=list)
    recording: bool = True
    # The last gather of a training forward, by call count: its unit is kept for backward.
    forward_tail_call: int = -1


@dataclass
class StepState:
    """What a step's forward leaves for its backward; reset by ``end_backward``."""

    forward_calls: int = 0
    call_stack: list[int] = field(default_factory=list)
    backward_held: set[ShardedUnit] = field(default_factory=set)  # units held until their backward ends
    backward_visited: set[ShardedUnit] = field(default_factory=set)  # units whose backward began
    # Per unit, its parameters that required a gradient in any of this backward's forwards (see
    # [Note: gradients a backward brings]).
    expecting: dict[ShardedUnit, set[ShardedParam]] = field(default_factory=dict)


# [Note: compiled units]
# A unit module compiled on its own (``block.compile()``, which compiles its __call__ with the
# hooks inside) must not have dynamo trace the forward hooks: they gather and free storage, swap
# a parameter between its 1-d piece and its whole shape, and count calls, none of which a graph
# can replay (it captured the parameter as the 1-d piece it was before the gather, then failed on
# the whole one). The hooks run eagerly, a graph break on each side of the module's own forward,
# which dynamo then compiles with the parameters whole, as they always are inside a gather.
def _eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    return torch.compiler.disable(hook, recursive=True)


def in_backward() -> bool:
    """True while the autograd engine runs a backward on this thread (e.g. a checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1


class Zero3Hooks:
    """The hook half of :class:`~lightning_zero.zero.stage3.engine.Zero3Engine` (see [Note:
    stage-3 lifecycle]); the engine provides the units and the collectives."""

    module: nn.Module
    collectives: Collectives | CountingCollectives
    units: list[ShardedUnit]
    root_units: list[ShardedUnit]
    sharded_params: dict[nn.Parameter, ShardedParam]
    schedule: ReduceSchedule
    prefetch_units: int
    prefetch_bytes: int | None
    check_gather_order: bool
    phase: Phase
    order: GatherOrder
    step: StepState
    _hook_handles: list[Any]
    _grad_hooked: set[ShardedParam]
    _grad_listeners: list[Callable[[ShardedParam], None]]
    _root_held: bool
    data_writes: DataWriteCheck

    def _track_memory(self) -> None:
        raise NotImplementedError

    def _enter(self, hook: str, phase: Phase | None = None) -> None:
        """Checks that the engine can run ``hook`` now, and moves it to ``phase``."""
        if self.phase is Phase.TAKEN:
            raise RuntimeError(
                f"ZeRO-3 {hook} ran on an engine that no longer holds the module: {self.phase.value}. Use the"
                " Trainer (or Fabric) that ran the module last, whose engine holds it now, e.g. its"
                " save_checkpoint."
            )
        if self.phase in (Phase.BUILT, Phase.HANDED_BACK):
            raise RuntimeError(
                f"ZeRO-3 {hook} ran while the engine is {self.phase.name}: {self.phase.value}. The module's"
                " parameters are only managed between the strategy's setup and teardown; after teardown they"
                " are plain whole tensors again, so run it through a fresh Trainer (or call it before teardown)."
            )
        if phase is not None:
            self.phase = phase

    # ------------------------------------------------------------------ installing the hooks
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
            owners = dict.fromkeys(self.sharded_params[p].unit for p in submodule.parameters(recurse=False)
                                   if p in self.sharded_params)
            foreign = [unit for unit in owners
                       if unit not in enclosing and not unit.persistent and unit not in self.root_units]
            if foreign:
                self._hook_handles.append(submodule.register_forward_pre_hook(self._make_pre_forward(foreign, False)))
                self._hook_handles.append(submodule.register_forward_hook(self._make_post_forward(foreign)))
        # Reverse registration order is backward order; persistent parameters (spread over the
        # whole model) are complete only at the end, so they come last (see [Note: one launch
        # order] in reduce.py).
        launch = [u for u in reversed(self.units) if u.trainable_count and not u.persistent]
        launch += [u for u in self.units if u.trainable_count and u.persistent]
        self.schedule.order = [unit.reduction for unit in launch]
        # On the CPU the units' local gradients reuse their buffers (see [Note: reused gradient
        # buffers] in reduce.py).
        self.schedule.reuse_buffers()
        self.hook_trainable_params()

    def hook_trainable_params(self) -> None:
        """Registers the gradient hook of every parameter laid out as trained (see [Note: trained
        pieces first] in unit.py) that requires a gradient now and has no hook yet. torch takes no
        hook on a tensor that requires none, so a parameter that a reset_parameters() froze as the
        model was materialized gets none when the hooks are installed; if configure_optimizers
        makes it trainable again, it gets its hook when the optimizer is set up (which calls this
        again), rather than training silently on a gradient nobody reduces."""
        for sp in self.sharded_params.values():
            if sp.trained and sp.param.requires_grad and sp not in self._grad_hooked:
                self._grad_hooked.add(sp)
                self._hook_handles.append(sp.param.register_post_accumulate_grad_hook(self._on_grad_ready))

    def _enclosing_units(self, prefix: str) -> list[ShardedUnit]:
        """The units of the innermost unit module containing the module at ``prefix``."""
        prefixes = {unit.prefix for unit in self.units if unit.module is not None} | {""}
        inner = innermost_prefix(prefix, prefixes)  # type: ignore[arg-type]
        return [unit for unit in self.units if unit.module is not None and unit.prefix == inner]

    def remove_hooks(self) -> None:
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()
        self._grad_hooked.clear()

    # ------------------------------------------------------------------ forward
    def _make_pre_forward(self, units: Sequence[ShardedUnit], prefetch: bool = True) -> Callable[..., None]:
        def pre_forward(module: nn.Module, args: Any) -> None:
            if in_backward():
                # Activation checkpointing recomputes forward inside backward (and may stop it
                # early, so no post-hook runs): hold the unit for backward, not by refcount.
                self._enter("recompute pre-forward hook", Phase.BACKWARD)
                for unit in units:
                    self._pre_backward(unit) if prefetch else self._hold_for_backward(unit)
                return
            step = self.step
            if torch.is_grad_enabled():
                self._enter("pre-forward hook", Phase.FORWARD)
                step.forward_calls += 1
                step.call_stack.append(step.forward_calls)
                if self.order.recording:
                    self.order.forward_tail_call = step.forward_calls
            else:
                self._enter("pre-forward hook")
            for unit in units:
                self.acquire(unit, order=self.order.forward if prefetch else None)

        return _eager(pre_forward)

    def _make_post_forward(self, units: Sequence[ShardedUnit]) -> Callable[..., Any]:
        def post_forward(module: nn.Module, args: Any, output: Any) -> Any:
            if in_backward():
                return output
            self._enter("post-forward hook")
            step = self.step
            call = step.call_stack.pop() if torch.is_grad_enabled() and step.call_stack else None
            tensors = ([t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.requires_grad]
                       if torch.is_grad_enabled() else [])
            for unit in units:
                if (call is not None and not self.order.recording and call == self.order.forward_tail_call
                        and unit.refcount == 1 and unit not in step.backward_held):
                    # The last unit of forward is the first of backward: keep it rather than free
                    # and re-gather it at once (the hold passes to backward).
                    step.backward_held.add(unit)
                else:
                    self.release(unit)
                if tensors:
                    torch.autograd.graph.register_multi_grad_hook(
                        tensors, lambda grads, unit=unit: self._pre_backward(unit), mode="any"
                    )
                    if self._expect_current_grads(unit) < len(unit.params):
                        self._release_after_input_grads(unit, args)
            return output

        return _eager(post_forward)

    def _make_root_pre_forward(self, root: ShardedUnit) -> Callable[..., None]:
        def pre_forward(module: nn.Module, args: Any) -> None:
            if in_backward():
                self._enter("recompute pre-forward hook", Phase.BACKWARD)
                self._hold_for_backward(root)
            else:
                self._enter("pre-forward hook", Phase.FORWARD if torch.is_grad_enabled() else None)
                self.acquire(root)  # only counts while the strategy holds it for a step

        return _eager(pre_forward)

    def _make_root_post_forward(self, root: ShardedUnit) -> Callable[..., Any]:
        def post_forward(module: nn.Module, args: Any, output: Any) -> Any:
            if in_backward():
                return output
            self._enter("post-forward hook")
            self._expect_current_grads(root)
            self.release(root)
            if root.refcount == 0 and torch.is_grad_enabled():
                # Nobody holds it for a backward of this forward: gather it again when one comes.
                tensors = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.requires_grad]
                if tensors:
                    torch.autograd.graph.register_multi_grad_hook(
                        tensors, lambda grads: self._pre_backward(root), mode="any"
                    )
            return output

        return _eager(post_forward)

    # ------------------------------------------------------------------ backward
    # [Note: gradients a backward brings]
    # A unit is released in backward, and its reduction launched, once every gradient it waits for
    # has arrived. A parameter frozen after the engine was built (in configure_optimizers, by a
    # callback) brings none, so the count is taken from requires_grad as each forward of the unit
    # ends; but one backward can span several forwards that disagree (a GAN's discriminator run on
    # real data trainable, then frozen for the generator's sample, unfrozen before the joint
    # backward). The count is therefore the union over this backward's forwards: counting a call
    # that was frozen would release the unit on the first call's gradients while the rest of its
    # backward still reads the weights. Waiting for a gradient that never comes only delays the
    # release to the end of backward.
    def _expect_current_grads(self, unit: ShardedUnit) -> int:
        """Adds the unit's trained parameters that require a gradient now to those this backward
        waits for (see [Note: gradients a backward brings]); returns how many of them require one
        in this forward alone."""
        now = [sp for sp in unit.params if sp.trained and sp.param.requires_grad]
        expected = self.step.expecting.setdefault(unit, set())
        expected.update(now)
        unit.reduction.expected_grads = len(expected)
        return len(now)

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
            if unit.pending_input_grads == 0 and (unit.reduction.expected_grads == 0 or unit.reduction.complete):
                self._done_with_backward(unit)

        torch.autograd.graph.register_multi_grad_hook(inputs, done, mode="all")

    def _hold_for_backward(self, unit: ShardedUnit) -> None:
        held = self.step.backward_held
        if unit not in held:
            held.add(unit)
            unit.refcount += 1
            self._gather(unit, order=None)

    def _pre_backward(self, unit: ShardedUnit) -> None:
        self._enter("pre-backward hook", Phase.BACKWARD)
        step = self.step
        # A unit's outputs can be reached more than once in one backward (a tied weight's two
        # modules): only the first time gathers and prefetches.
        if unit in step.backward_visited:
            return
        step.backward_visited.add(unit)
        if unit not in step.backward_held:
            step.backward_held.add(unit)
            unit.refcount += 1
            self._gather(unit, order=self.order.backward)
        else:  # kept from forward: nothing to gather, but record the order and prefetch what follows
            if self.order.recording and unit not in self.order.backward:
                self.order.backward.append(unit)
            self._prefetch_after(unit, self.order.backward)

    @torch.no_grad()
    def _on_grad_ready(self, param: Tensor) -> None:
        if param.grad is None:
            return
        self._enter("gradient hook", Phase.BACKWARD)
        self.schedule.enter_backward()
        sp = self.sharded_params[param]  # type: ignore[index]
        unit = sp.unit
        unit.accumulate(sp, param.grad)
        param.grad = None
        for listener in self._grad_listeners:
            listener(sp)
        if self.schedule.arrived(unit.reduction) and unit.pending_input_grads == 0:
            self._done_with_backward(unit)

    def _done_with_backward(self, unit: ShardedUnit) -> None:
        if unit in self.step.backward_held:
            self.step.backward_held.discard(unit)
            self.release(unit)

    def end_backward(self) -> None:
        """Frees whatever backward still holds (units with parameters that got no gradient)."""
        self._enter("end of backward", Phase.IDLE)
        for unit in list(self.step.backward_held):
            self._done_with_backward(unit)
        self.schedule.end_backward()
        for unit in self.units:
            unit.pending_input_grads = 0
        if self.order.forward or self.order.backward:
            self.order.recording = False
        self.step = StepState()
        self.free_idle()

    def free_idle(self) -> None:
        """Frees units nobody holds, e.g. prefetched ones the step did not use."""
        for unit in self.units:
            if unit.refcount == 0:
                unit.free()

    # ------------------------------------------------------------------ holding and gathering
    def hold_for_step(self) -> None:
        """The root units (parameters outside every other unit) stay gathered for a whole step and
        its backward: training_step may use them outside forward, and backward needs them again."""
        self.check_parameters_unchanged()
        if not self._root_held:
            for root in self.root_units:
                self.acquire(root)
            self._root_held = True

    def release_after_step(self) -> None:
        if self._root_held:
            self._root_held = False
            for root in self.root_units:
                if self.data_writes.checking and root.refcount == 1 and root.state is UnitState.GATHERED:
                    # freeing drops the whole buffer, and a write through .data in it with it
                    self.data_writes.report(root.absorb_data_writes())
                self.release(root)

    def check_parameters_unchanged(self) -> None:
        raise NotImplementedError

    def acquire(self, unit: ShardedUnit, order: list[ShardedUnit] | None = None) -> None:
        unit.refcount += 1
        self._gather(unit, order)

    def release(self, unit: ShardedUnit) -> None:
        unit.refcount -= 1
        if unit.refcount <= 0:
            unit.refcount = 0
            unit.free()

    def _gather(self, unit: ShardedUnit, order: list[ShardedUnit] | None) -> None:
        if order is not None and self.order.recording and unit not in order:
            order.append(unit)
        self._start_gather(unit, _GatherFor.BACKWARD if in_backward() else _GatherFor.FORWARD)
        if order is not None:
            self._prefetch_after(unit, order)
        unit.finish_gather()
        self._track_memory()

    def _prefetch_after(self, unit: ShardedUnit, order: list[ShardedUnit]) -> None:
        if self.order.recording or unit not in order:
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


__all__ = ["GatherOrder", "Phase", "StepState", "Zero3Hooks", "in_backward"]
