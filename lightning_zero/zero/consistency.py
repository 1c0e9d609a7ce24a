"""Ranks that disagree get an error, not a hang or an abort.

[Note: ranks that disagree]
Every ZeRO collective must be joined by every rank with a tensor of the same size. When ranks
disagree (a model whose structure depends on the rank, a branch that runs a unit on one rank
only, a dataloader with fewer batches on one rank), the collectives pair up wrongly: gloo aborts
the process on a size mismatch (``op.preamble.length <= op.nbytes``) and a mismatch of matching
sizes waits forever or, worse, exchanges the wrong data. So before the collectives that can
diverge, the ranks exchange a few integers saying what they are about to do, and raise the
same clear error on every rank when those differ:

- at setup, every parameter's name, shape and dtype (``check_same_model``), as DDP does;
- at stage 3, before each all-gather, which unit it is for (``ZeroConfig.check_gather_order``);
- at stages 1/2 with several optimizers, before each synchronized backward, which optimizers'
  gradients it reduces (``agree_on_backward``): its reductions launch during backward, before any
  other agreement, and a backward that reduces another optimizer's buckets on some rank
  (``toggle_optimizer`` of a different optimizer per rank) pairs buckets of different sizes, which
  gloo aborts on;
- before the gradients are reduced for a step, which optimizer steps and how many synchronized
  backwards its gradients hold: ranks that step different optimizers would otherwise each land
  the other's reductions, silently, when the two are the same size;
- for each dataloader, its number of batches; where that is unknown (an IterableDataset),
  before each batch whether this rank has one (``AgreedBatches``);
- under manual optimization, after each training_step, how many optimizer steps it took
  (``agree_after_batch``): a rank that skips a step the others take (returns early from
  training_step) would otherwise go on to the next batch, where Lightning's own collective
  (a broadcast every batch) waits for ranks that wait in the step's agreement: a deadlock.
- under Fabric, which has no batch boundary to hook, before each of the loop's own collectives
  (``fabric.barrier``, ``all_reduce``, ``all_gather``, ``broadcast``, ``save``, ``load``), which
  call it is and how many backwards are not stepped yet (``agree_before_collective``): a rank that
  skipped a step and went on to one of these would otherwise wait there while the others wait in
  the step;
- at stage 3 under the Trainer, before each of Lightning's collectives through the strategy (a
  synced metric's reduce, a barrier, a broadcast, an all_gather), the same: a rank still gathering
  a unit for a forward the others never ran (``if trainer.is_global_zero: model.generate(...)``
  in a callback) meets the others there, and every rank raises instead of waiting for the process
  group's timeout.

The exchange is one small all-gather of the same size at every such point (``agree_at``), so
ranks at two different points meet in it and both raise; it runs on a gloo group beside an NCCL
one so that it needs no device synchronization.

[Note: ranks that never arrive]
An agreement meets ranks at two of its points, not a rank that never comes to one: a rank
waiting in a collective of Lightning's own (its broadcast before every batch, a barrier) or one
that left the loop. At stage 3 that is what a forward on some ranks only does (a callback's
``if trainer.is_global_zero: model.generate(...)``, measured: rank 0 waits at the gather of the
first unit while rank 1 waits in Lightning's broadcast before its next batch). Nothing can tell
the ranks apart then, and each waits until its process group's timeout (30 minutes by default).
So a watchdog thread (:class:`AgreementWatch`) says, once per wait, which agreement this rank has
waited in for longer than ``LIGHTNING_ZERO_AGREEMENT_PATIENCE`` seconds (120 by default) and what
usually causes it. The wait itself goes on: a rank that is only slow (a long checkpoint write)
arrives later, and the run continues.
"""

from __future__ import annotations

import contextlib
import enum
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from torch import nn

from lightning_zero.zero.comm import Collectives, CountingCollectives

AnyCollectives = Collectives | CountingCollectives


class RanksDisagreeError(RuntimeError):
    """The ranks were about to run different collectives; raised on every rank alike."""


class Point(enum.IntEnum):
    """Where a rank is when it exchanges an agreement. Every exchange has the same size, so ranks at
    two different points meet in it and both learn it (instead of a size mismatch in gloo)."""

    LENGTH = 1  # values: the dataloader's number of batches (-1: unknown)
    BATCH = 2  # values: 1 if this rank has a next batch
    GATHER = 3  # values: the unit's number, why it is gathered
    SYNC = 4  # values: synchronized backwards since the last optimizer step, leftover gradients, got every gradient,
    #           which optimizer steps (its number in set-up order, from 1)
    BATCH_END = 5  # values: optimizer steps this training_step took, synchronized backwards not stepped yet
    COLLECTIVE = 6  # values: which of LOOP_COLLECTIVES the loop calls, synchronized backwards not stepped yet
    BACKWARD = 7  # values: how many optimizers' gradients a synchronized backward reduces, which ones (bits)


# The collectives a Fabric loop, or Lightning's Trainer, calls through the strategy, numbered for
# Point.COLLECTIVE by their place here.
LOOP_COLLECTIVES = ("fabric.barrier", "fabric.all_reduce", "fabric.all_gather", "fabric.broadcast", "fabric.save",
                    "fabric.load", "trainer.strategy.barrier", "trainer.strategy.reduce",
                    "trainer.strategy.all_gather", "trainer.strategy.broadcast", "trainer.fit_loop.sigterm_broadcast")
# How a rank's place is told where "calls <name>()" would not say it.
_LOOP_COLLECTIVE_PLACES = {"trainer.fit_loop.sigterm_broadcast": "starts a training batch (Lightning's broadcast of"
                                                                 " its SIGTERM flag)"}


_POINT_WIDTH = 5  # the point and four values


class AgreementWatch:
    """Says on stderr which agreement this rank has waited in for long (see [Note: ranks that never
    arrive]); one per process, its thread started on the first wait.

    ``patience_s``: seconds before it speaks; ``None`` reads ``LIGHTNING_ZERO_AGREEMENT_PATIENCE``
    at each wait (120 when unset, 0 turns the watch off, anything else not a finite number of
    seconds is ignored)."""

    DEFAULT_PATIENCE_S = 120.0

    def __init__(self, patience_s: float | None = None) -> None:
        self.reported: list[str] = []  # what it said, for tests
        self._patience_s = patience_s
        # (since, patience, rank, agreement row) of the wait in progress: a new tuple per wait
        self._waiting: tuple[float, float, int, list[int]] | None = None
        self._said_for: float | None = None  # the start of the wait it last spoke about
        self._wake = threading.Event()  # set when a wait begins while the thread sleeps without a deadline
        self._idle = False
        self._thread: threading.Thread | None = None
        self._pid = 0

    def patience(self) -> float | None:
        """Seconds to wait before speaking, or ``None``: the watch is off."""
        if self._patience_s is not None:
            return self._patience_s if self._patience_s > 0 else None
        value = os.environ.get("LIGHTNING_ZERO_AGREEMENT_PATIENCE", "")
        try:
            seconds = float(value) if value else self.DEFAULT_PATIENCE_S
        except ValueError:
            return self.DEFAULT_PATIENCE_S
        if seconds == 0:
            return None
        return seconds if 0 < seconds < float("inf") else self.DEFAULT_PATIENCE_S

    @contextlib.contextmanager
    def watching(self, rank: int, row: list[int]) -> Iterator[None]:
        """Marks this rank's wait in the agreement ``row`` (the point and its values). Agreements
        run several times a step: this wakes the thread only when it sleeps without a deadline."""
        patience = self.patience()
        if patience is None:
            yield
            return
        if self._thread is None or self._pid != os.getpid():  # a forked child has no thread of its parent's
            self._pid = os.getpid()
            self._wake = threading.Event()
            self._thread = threading.Thread(target=self._run, name="lightning_zero agreement watch", daemon=True)
            self._thread.start()
        self._waiting = (time.monotonic(), patience, rank, row)
        if self._idle:
            self._wake.set()
        try:
            yield
        finally:
            self._waiting = None

    def _run(self) -> None:
        while True:
            waiting = self._waiting
            if waiting is not None and waiting[0] != self._said_for:
                since, patience, rank, row = waiting
                remaining = since + patience - time.monotonic()
                if remaining > 0:
                    time.sleep(remaining)
                    continue  # look again: the same wait, another, or none
                self._said_for = since
                self.say(_waited_message(rank, time.monotonic() - since, _describe(row)))
            # Nothing to watch (no wait, or this one was spoken of): sleep until a wait begins.
            self._wake.clear()
            self._idle = True
            if self._waiting is waiting:
                self._wake.wait()
            self._idle = False

    def say(self, message: str) -> None:
        self.reported.append(message)
        print(message, file=sys.stderr, flush=True)


def _waited_message(rank: int, waited: float, what: str) -> str:
    return (
        f"lightning_zero: rank {rank} has waited {waited:.0f} s for the other ranks to agree before it {what}. A rank"
        " that never gets there (it runs other code, or waits in a collective of Lightning's own) keeps this one"
        " waiting until the process group's timeout. At stage 3 the usual cause is a forward on some ranks only,"
        " such as `if trainer.is_global_zero: model.generate(...)` in a callback: every forward gathers the"
        " parameters from every rank, so run it on every rank (and log rank 0's output). A rank that is only slow"
        " (a long checkpoint write) arrives later, and the run goes on."
    )


AGREEMENT_WATCH = AgreementWatch()


def agree_at(collectives: AnyCollectives, point: Point, values: Sequence[int] = ()) -> list[list[int]]:
    """Every rank's ``values`` at ``point`` (one small exchange); raises on every rank when some
    rank is at another point."""
    padded = [int(point), *values] + [0] * (_POINT_WIDTH - 1 - len(values))
    with AGREEMENT_WATCH.watching(getattr(collectives, "rank", 0), padded):
        rows = collectives.agree(padded)
    if any(row[0] != point for row in rows):
        described = ", ".join(f"rank {rank} {_describe(row)}" for rank, row in enumerate(rows))
        gathering = any(row[0] == Point.GATHER for row in rows)
        raise RanksDisagreeError(
            f"The ranks are at different points of the run: {described}. Each of these is a collective every rank"
            " must join in the same order: the ranks ran different code (a rank-dependent number of backward calls"
            " or optimizer steps, a forward on some ranks only, a different number of batches). Decide a skip"
            " together (e.g. with strategy.reduce_boolean_decision), or backward and step a zero loss"
            " ((0 * loss).sum()) on the rank that would skip."
            + (" At ZeRO stage 3 every forward gathers parameters from every rank: run a forward outside the steps"
               " (`if trainer.is_global_zero: model.generate(...)` in a callback) on every rank, and log rank 0's"
               " output." if gathering else "")
        )
    return [row[1 : 1 + len(values)] for row in rows]  # the values each rank gave, without the padding


def _describe(row: Sequence[int]) -> str:
    point = Point(row[0]) if row[0] in Point._value2member_map_ else None
    if point is Point.LENGTH:
        return f"counts the batches of a dataloader ({row[1]})"
    if point is Point.BATCH:
        return "fetches a batch" if row[1] else "ran out of batches"
    if point is Point.GATHER:
        return f"gathers ZeRO-3 unit #{row[1]}"
    if point is Point.SYNC:
        return f"reduces the gradients of {row[1]} backward(s) for {_optimizer(row[4])}'s step"
    if point is Point.BATCH_END:
        return f"ended its training_step after {row[1]} optimizer step(s)"
    if point is Point.COLLECTIVE:
        return f"{_loop_place(row[1])} with {row[2]} backward(s) not stepped"
    if point is Point.BACKWARD:
        return f"starts a backward that reduces the gradients of {_optimizers(row[2])}"
    return f"is at an unknown point {row[0]}"


def _optimizer(number: int) -> str:
    return f"optimizer #{number}" if number else "an optimizer"


def _optimizers(bits: int) -> str:
    numbers = [str(index + 1) for index in range(_OPTIMIZER_BITS) if bits >> index & 1]
    return f"optimizer(s) #{', #'.join(numbers)}" if numbers else "no optimizer"


# Optimizers named in a backward's agreement, as bits of one int64 (numbers past it share bits).
_OPTIMIZER_BITS = 62


def agree_on_backward(collectives: AnyCollectives, reducing: Sequence[int]) -> None:
    """Before a synchronized backward at stages 1/2 launches its reductions: every rank reduces the
    gradients of the same optimizers (``reducing``: their indices in set-up order, from 0), or every
    rank raises (see [Note: ranks that disagree]). A rank at another point (a step, the end of its
    training_step) meets this one and both raise, before any reduction pairs with the wrong one."""
    bits = sum(1 << (index % _OPTIMIZER_BITS) for index in set(reducing))
    rows = agree_at(collectives, Point.BACKWARD, [len(set(reducing)), bits])
    if len({tuple(row) for row in rows}) == 1:
        return
    by_rank = ", ".join(f"rank {rank} {_optimizers(row[1])}" for rank, row in enumerate(rows))
    raise RanksDisagreeError(
        f"The ranks start a backward that reduces the gradients of different optimizers ({by_rank}): an optimizer"
        " counts when any of its parameters requires a gradient, so on some rank every parameter of one is frozen"
        " (toggle_optimizer of a different optimizer on each rank, requires_grad set per rank). Each optimizer's"
        " gradient reductions are collectives every rank must join: toggle and freeze the same optimizers on every"
        " rank, and step the same ones."
    )


def agree_before_step(
    collectives: AnyCollectives, engine: Any, backwards: int, optimizer: Any = None, number: int = 0
) -> None:
    """Before an optimizer step waits for reductions other ranks might not have launched: a rank
    that ran another number of synchronized backwards (manual optimization, a Fabric loop), or
    steps another optimizer (``number``, its place in set-up order from 1; 0 when unknown), meets
    the others here or at one of their gathers, and every rank raises. A rank whose gradients
    arrived after their backward's reduction went out makes every rank send the extra round.
    When every parameter of ``optimizer`` (the ShardedOptimizer about to step) got a gradient on
    every rank, it learns so here, and its step exchanges no per-parameter flags (see
    [Note: parameters without a gradient] in optimizer.py)."""
    every_grad = optimizer is not None and optimizer.got_every_grad()
    rows = agree_at(collectives, Point.SYNC, [backwards, int(engine.has_leftover_grads()), int(every_grad), number])
    counts = [row[0] for row in rows]
    numbers = [row[3] for row in rows]
    if len(set(numbers)) > 1:
        stepping = ", ".join(f"rank {rank} {_optimizer(n)} after {count} backward(s)"
                             for rank, (n, count) in enumerate(zip(numbers, counts)))
        raise RanksDisagreeError(
            f"The ranks are about to step different optimizers ({stepping}; optimizers are numbered in the order"
            " they were set up). Each step lands gradient reductions every rank joined, so every rank must step the"
            " same optimizers in the same order: decide a skip together (e.g. with"
            " strategy.reduce_boolean_decision), or step a zero loss ((0 * loss).sum()) on the rank that would skip."
        )
    if any(row[1] for row in rows):
        engine.expect_leftover_grads()
    if len(set(counts)) > 1:
        raise RanksDisagreeError(
            f"The ranks ran different numbers of backward calls before this optimizer step (by rank: {counts});"
            " each backward's gradient reductions are collectives every rank must join. Call backward the same"
            " number of times on every rank (a rank without a loss can backward a zero loss, e.g."
            " (0 * output).sum())."
        )
    if optimizer is not None and all(row[2] for row in rows):
        optimizer.note_every_grad_everywhere()


def optimizer_number(optimizer: Any, optimizers: Sequence[Any]) -> int:
    """``optimizer``'s place among ``optimizers`` in set-up order, from 1 (0: not among them)."""
    return next((index + 1 for index, candidate in enumerate(optimizers) if candidate is optimizer), 0)


def agree_after_batch(collectives: AnyCollectives, steps: int, pending_backwards: int) -> None:
    """After a manual-optimization training_step: every rank took as many optimizer steps, and holds
    as many synchronized backwards not stepped yet (accumulation across batches), or every rank
    raises. A rank still inside a step (its agreement) meets this one and both raise."""
    rows = agree_at(collectives, Point.BATCH_END, [steps, pending_backwards])
    if len({tuple(row) for row in rows}) > 1:
        steps_by_rank = [row[0] for row in rows]
        pending_by_rank = [row[1] for row in rows]
        raise RanksDisagreeError(
            f"The ranks' training_step took different numbers of optimizer steps (by rank: {steps_by_rank}), or left"
            f" different numbers of backward calls unstepped (by rank: {pending_by_rank}). Each step reduces"
            " gradients over all ranks, so every rank must step at the same batches: skip a batch on every rank alike"
            " (decide it together, e.g. with trainer.strategy.reduce_boolean_decision), or backward and step a zero"
            " loss ((0 * loss).sum()) on the rank that would skip."
        )


def _loop_place(code: int) -> str:
    """Where a rank at LOOP_COLLECTIVES' ``code`` is, in words."""
    if not 1 <= code <= len(LOOP_COLLECTIVES):
        return f"calls collective #{code}"
    name = LOOP_COLLECTIVES[code - 1]
    return _LOOP_COLLECTIVE_PLACES.get(name, f"calls {name}()")


def agree_before_collective(collectives: AnyCollectives, call: str, pending_backwards: int) -> None:
    """Before one of the collectives a Fabric loop or the Trainer calls through the strategy
    (``call``, one of LOOP_COLLECTIVES): every rank is
    at the same call and holds as many synchronized backwards not stepped yet, or every rank raises.
    A rank still inside a step (its agreement) meets this one and both raise."""
    rows = agree_at(collectives, Point.COLLECTIVE, [LOOP_COLLECTIVES.index(call) + 1, pending_backwards])
    _raise_unless_same_collective(rows)


def agree_at_batch_start(collectives: AnyCollectives, pending_backwards: int, sigterm: bool) -> bool:
    """At the start of a training batch, where Lightning broadcasts its SIGTERM flag: every rank is
    here and holds as many synchronized backwards not stepped yet, or every rank raises (as
    ``agree_before_collective``). Returns whether any rank received SIGTERM (``sigterm``), which
    every rank learns at once."""
    code = LOOP_COLLECTIVES.index("trainer.fit_loop.sigterm_broadcast") + 1
    rows = agree_at(collectives, Point.COLLECTIVE, [code, pending_backwards, int(sigterm)])
    _raise_unless_same_collective([row[:2] for row in rows])
    return any(row[2] for row in rows)


def _raise_unless_same_collective(rows: Sequence[Sequence[int]]) -> None:
    """``rows``: each rank's (LOOP_COLLECTIVES code, synchronized backwards not stepped yet)."""
    if len({tuple(row) for row in rows}) == 1:
        return
    places = "; ".join(f"rank {rank} {_loop_place(row[0])}" for rank, row in enumerate(rows))
    pending = [row[1] for row in rows]
    raise RanksDisagreeError(
        f"The ranks reached different collectives ({places}) or hold different numbers of backward calls"
        f" not stepped yet (by rank: {pending}). Every rank must call backward, optimizer.step() and the"
        " collectives in the same order: skip a batch on every rank alike (decide it together, e.g. with"
        " strategy.reduce_boolean_decision), or backward and step a zero loss ((0 * loss).sum()) on the"
        " rank that would skip."
    )


class CollectiveAgreement:
    """Runs a strategy's collectives after ``agree_before_collective``, once: a collective that
    another one calls inside it (Lightning's reduce_boolean_decision calls reduce) agrees no more."""

    def __init__(self) -> None:
        self._inside = False

    @contextlib.contextmanager
    def before(self, collectives: AnyCollectives, call: str, pending_backwards: int) -> Iterator[None]:
        if self._inside:
            yield
            return
        self._inside = True
        try:
            agree_before_collective(collectives, call, pending_backwards)
            yield
        finally:
            self._inside = False


def model_fingerprint(module: nn.Module) -> list[tuple[str, tuple[int, ...], str, bool]]:
    """(name, shape, dtype, requires_grad) of every parameter, in registration order."""
    return [(name, tuple(p.shape), str(p.dtype).replace("torch.", ""), p.requires_grad)
            for name, p in module.named_parameters()]


def check_same_model(module: nn.Module, collectives: AnyCollectives) -> None:
    """Raises :class:`RanksDisagreeError` on every rank unless all ranks hold the same parameters."""
    if collectives.world_size == 1:
        return
    mine = model_fingerprint(module)
    every = collectives.gather_objects(mine)
    if all(fingerprint == every[0] for fingerprint in every):
        return
    odd = next(rank for rank, fingerprint in enumerate(every) if fingerprint != every[0])
    first, other = every[0], every[odd]
    position = next((i for i, (a, b) in enumerate(zip(first, other)) if a != b), min(len(first), len(other)))

    def describe(fingerprint: Sequence[tuple[str, tuple[int, ...], str, bool]]) -> str:
        if position >= len(fingerprint):
            return "no such parameter"
        name, shape, dtype, trained = fingerprint[position]
        return f"'{name}' {shape} {dtype}{'' if trained else ' frozen'}"

    raise RanksDisagreeError(
        f"ZeRO needs the same model on every rank, but rank {odd} has {len(other)} parameters while rank 0 has"
        f" {len(first)}; the first difference is parameter #{position}: rank 0 {describe(first)}, rank {odd}"
        f" {describe(other)}. Build the model the same way on every rank (no rank-dependent layers or"
        " sizes); rank-specific behaviour belongs in forward, inside a module every rank runs."
    )


class AgreedBatches:
    """Iterates a dataloader in step with the other ranks: before each batch, the ranks say
    whether they have one, so a rank that ran out while others go on raises on every rank
    instead of leaving them in mismatched collectives (see [Note: ranks that disagree]).

    Everything else (``len``, ``sampler``, ``dataset``, ...) is the wrapped loader's.
    """

    def __init__(self, loader: Iterable[Any], collectives: AnyCollectives, name: str, lengths: Sequence[int]) -> None:
        self.loader = loader
        self._collectives = collectives
        self._name = name
        self._lengths = list(lengths)

    def __iter__(self) -> Iterator[Any]:
        iterator = iter(self.loader)
        count = 0
        while True:
            try:
                batch = next(iterator)
                have = 1
            except StopIteration:
                batch, have = None, 0
            flags = [row[0] for row in agree_at(self._collectives, Point.BATCH, [have])]
            if all(flags):
                yield batch
                count += 1
                continue
            if not any(flags):
                return
            raise RanksDisagreeError(self._message(count, flags))

    def _message(self, count: int, flags: Sequence[int]) -> str:
        done = [rank for rank, flag in enumerate(flags) if not flag]
        going = [rank for rank, flag in enumerate(flags) if flag]
        return (
            f"Rank(s) {done} ran out of batches of the {self._name} after {count} batches while rank(s) {going} have"
            " more. Under ZeRO every step is a set of collectives all ranks must join, so every rank needs"
            " the same number of batches: use Lightning's distributed sampler (Trainer(use_distributed_sampler=True),"
            " the default), or make each rank's dataloader yield as many batches as the others (e.g. drop_last=True,"
            " or equal shards of an IterableDataset)."
        )

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]  # TypeError when the loader has no length, as for it

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)


def agree_on_batches(loader: Any, collectives: AnyCollectives, name: str, limit: int | float | None = None) -> Any:
    """Checks that every rank will run the same number of batches of ``loader``.

    Known lengths (after ``limit``, Lightning's ``limit_*_batches``) are compared once: equal, the
    loader is returned as it is; different, :class:`RanksDisagreeError` now, on every rank (the
    loop stops a rank at its own length, so a per-batch check would never hear from it). Unknown
    lengths (and IterableDatasets, whose length is only a hint) get an :class:`AgreedBatches`.
    """
    if collectives.world_size == 1:
        return loader
    try:
        length = _limited(len(loader), limit)
    except TypeError:
        length = -1
    lengths = [row[0] for row in agree_at(collectives, Point.LENGTH, [length])]
    known = [n >= 0 for n in lengths]
    if all(known) and len(set(lengths)) > 1 or any(known) and not all(known):
        shown = [n if n >= 0 else "unknown" for n in lengths]
        raise RanksDisagreeError(
            f"The {name} has a different number of batches on each rank (by rank: {shown}). Under ZeRO every step is a set"
            " of collectives all ranks must join, so every rank needs the same number of batches: use Lightning's"
            " distributed sampler (Trainer(use_distributed_sampler=True), the default), give every rank an equal"
            " shard (e.g. drop_last=True), or cap them with limit_train_batches / limit_val_batches."
        )
    if all(known) and not _is_iterable_dataset(loader):
        return loader
    return AgreedBatches(loader, collectives, name, lengths)


def _limited(length: int, limit: int | float | None) -> int:
    """The batches Lightning's loop takes of a loader of ``length`` under ``limit_*_batches``."""
    if limit is None or isinstance(limit, bool):
        return length
    if isinstance(limit, int):
        return min(length, limit)
    return length if limit == 1.0 else int(length * limit)


def _is_iterable_dataset(loader: Any) -> bool:
    # An IterableDataset's __len__ is only a hint: the batches it yields decide.
    from torch.utils.data import IterableDataset

    return isinstance(getattr(loader, "dataset", None), IterableDataset)
