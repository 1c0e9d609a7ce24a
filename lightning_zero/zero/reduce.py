"""Gradient reductions: one reduction object and one launch schedule for every layout.

A :class:`Reduction` is one reduce-scatter target: a rank-major local gradient [N * S] (a
stage-1/2 bucket's flat gradient, a stage-3 unit's gradient pieces) that one reduce-scatter
turns into this rank's averaged [S], added into its master gradient. The
:class:`ReduceSchedule` decides when each one goes out, in the same order on every rank.

[Note: one launch order]
Reductions are launched in one fixed order (the schedule's ``order``: reverse parameter order,
i.e. backward order) on every rank: one complete out of turn waits for those before it. Each
synchronized backward issues exactly one reduction per entry of the order: what it left
unlaunched (a parameter without a gradient on this rank) goes out, with zeros where needed, when
the next backward starts or at ``finish``. So ranks whose graphs differ still issue the same
collectives in the same order, and a parameter used on some ranks only gets their gradients, as
with DDP's find_unused_parameters.

Several schedules that share one process group (stages 1/2 with several optimizers: a schedule
per optimizer) share one :class:`LaunchQueue` too, so that their reductions also go out in one
order across schedules: the engine-wide ``position`` of each (backward order over every layout's
buckets). Otherwise each schedule launches as its own buckets complete, and a rank whose graph
differs (a module it never reaches, which completes its bucket only at ``finish``) would pair one
optimizer's bucket with another's on the wire.

[Note: what one backward is]
A round of reductions belongs to one backward. The strategy says when each backward starts
(``begin_backward``, before ``loss.backward()``) and ends (``close_backward``), on every rank,
whatever part of the model the backward reaches: a rank whose loss reached no parameter still
owes its round (zeros), and ``finish`` sends it. Without the strategy (the engine used directly),
a backward is recognised by its autograd graph task; a task that starts while another is still
running (a reentrant activation checkpoint's recompute runs its own backward) belongs to the
running one, which ends when the autograd engine runs the callback queued for it.

A gradient that arrives after its reduction of this backward went out (a weight used in two
reentrant checkpoint segments, two ``.backward()`` calls inside one announced backward) stays in
the local buffer, ``leftover``: ``finish`` sends it in one more round. The strategy tells the
ranks of each other's leftovers where they agree before a step, so they all send that round.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

from lightning_zero.zero.comm import Collectives, CountingCollectives, Handle
from lightning_zero.zero.layout import Range, rank_chunk


# [Note: landing on the host]
# Under offload from a CUDA device, a reduced chunk goes to its CPU master gradient through a
# pinned host buffer of its own (chunk-sized, reused every step): once the reduce-scatter is
# waited for (the current stream waits on NCCL, the host does not), a copy stream waits for the
# current one and copies the chunk with non_blocking, and records an event; the CPU add into the
# master gradient synchronizes on that event alone. ReduceSchedule.land queues every such copy
# before it lands the first chunk, so the copies of later chunks run while the CPU steps the
# earlier ones ([Note: overlapped step] in optimizer.py). The chunk's device memory is marked as
# used by the copy stream, so the allocator does not hand it out before the copy ran. On the CPU
# (and for masters on the device) a chunk lands as before, by a plain copy.
_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """One device-to-host copy stream per device, made on first use."""
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]


# [Note: reused gradient buffers]
# At stage 2 a bucket's local gradient is freed once its reduction lands, at stage 3 a unit's, so
# that a rank never holds the whole unreduced gradient for long. On the CPU, torch's allocator
# hands buffers this large to glibc, which returns the memory at the top of its heap to the OS
# when it is freed; the next backward faults every page of it back in (measured on the demo GPT
# on 2 gloo ranks: about 7,500 page faults and 15-20 ms of a 130 ms step at stage 2, ZeRO-2
# slower than ZeRO-1; 5,000-6,000 faults and ~10 ms at stage 3). So on the CPU the reductions of
# a schedule take their buffers from a :class:`BufferPool` of flat buffers the size of the
# largest one, which keeps up to ``keep`` (two: one accumulating, one in flight, as the memory
# estimate counts them) of those given back and frees the rest. Reductions that completed are
# polled when a buffer is needed and none is free, so that a finished bucket's buffer serves the
# next one within the same backward. A buffer goes back only after its reduction was waited for
# (finish, drop): no collective still reads it. CUDA keeps freed blocks in its caching allocator
# already, and there the reductions allocate as before.
class BufferPool:
    """Flat buffers of ``numel`` elements, reused by the reductions of one schedule (see [Note:
    reused gradient buffers])."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, keep: int) -> None:
        self.numel = numel
        self.dtype = dtype
        self.device = device
        self.keep = keep
        self.free: list[Tensor] = []
        self.reclaim: Callable[[], None] = lambda: None  # finishes completed reductions (they give back)

    def take(self) -> Tensor:
        if not self.free:
            self.reclaim()
        if self.free:
            return self.free.pop()
        return torch.empty(self.numel, dtype=self.dtype, device=self.device)

    def give(self, buffer: Tensor) -> None:
        # A buffer of another size came from a pool this one replaced (reuse_buffers again).
        if len(self.free) < self.keep and buffer.numel() == self.numel and buffer.dtype == self.dtype:
            self.free.append(buffer)


class GradState(enum.Enum):
    """Lifecycle of a reduction's local gradient between two reductions."""

    CLEAN = "no local gradient since the last reduction or zero_grad"
    ACCUMULATING = "local gradients present that no reduction has consumed yet"
    REDUCING = "a reduce-scatter of the local gradient is in flight"


class Reduction:
    """The local gradient of one bucket or unit and its reduce-scatter into this rank's chunk.

    Contracts, the same for every layout:
    - ``local_grad()`` is the buffer gradients are added into; a reduction still in flight (an
      earlier micro-step's, with ``reduce_every_micro_step``) lands first.
    - ``start`` sends zeros when this rank has no local gradient (another rank may have one), and
      refuses to start a second reduction while one is in flight.
    - ``finish`` waits and adds this rank's averaged chunk into ``master_grad``; after it, and
      after ``drop``, the local gradient is zeroed (``keep_buffer``, stage 1) or freed.
    - the owner calls ``zero_master_grad`` to zero ``master_grad`` (see [Note: reducing into the
      master gradient]).
    """

    def __init__(
        self,
        name: str,
        chunk_numel: int,
        world_size: int,
        rank: int,
        dtype: torch.dtype,
        device: torch.device,
        keep_buffer: bool,
        expected_grads: int,
        label: str = "zero",
    ) -> None:
        self.name = name
        self.chunk_numel = chunk_numel
        self.world_size = world_size
        self.rank = rank
        self.dtype = dtype
        self.device = device
        self.keep_buffer = keep_buffer
        self.expected_grads = expected_grads  # gradients one backward brings, when every parameter gets one
        self.label = label  # profiler prefix: "zero" (stages 1/2) or "zero3"
        # This rank's master gradient [chunk_numel], set by the owner (on the CPU under offload).
        self.master_grad = torch.empty(0)
        # Whether master_grad holds zeros that nothing landed on since zero_master_grad, and whether
        # the reduction in flight writes straight into it (see [Note: reducing into the master gradient]).
        self.master_grad_zero = False
        self._into_master = False
        self.grad: Tensor | None = None  # [world_size * chunk_numel], rank-major
        self.state = GradState.CLEAN
        # Per backward (reset by the schedule when one starts):
        self.arrived = 0  # gradients counted since the last complete set
        self.complete = False  # every expected gradient of this backward has arrived
        self.ready = False  # complete and waiting for its turn in the launch order
        self.launched = False  # its reduction of this backward went out
        self._output: Tensor | None = None
        self._handle: Handle | None = None
        # With parts (see set_parts): which parts hold a gradient since the buffer was last cleared;
        # the others, and whatever lies past the last part (padding), hold stale values or none.
        self._parts: list[Range] = []
        self._parts_end = 0  # where the last part ends: the padding follows
        self._written: list[bool] = []
        # Offload from a CUDA device (see [Note: landing on the host]): the pinned host copy of the
        # reduced chunk, reused every step, and the event its copy recorded while in flight.
        self._landing: Tensor | None = None
        self._landed: torch.cuda.Event | None = None
        # Where the local gradient comes from when it is not kept (see [Note: reused gradient
        # buffers]); set by the schedule. ``grad`` is then a view of the pool's ``_grad_buffer``.
        self.pool: BufferPool | None = None
        self._grad_buffer: Tensor | None = None

    @property
    def numel(self) -> int:
        return self.world_size * self.chunk_numel

    def local_grad(self) -> Tensor:
        """The local gradient buffer [N * S], allocated (zeros) on first use."""
        if self.state is GradState.REDUCING:
            self.finish()  # the previous micro-step's reduction lands before new gradients
        if self.grad is None:
            self._new_grad().zero_()
            self._written = [True] * len(self._parts)
        self._clear_unwritten()
        self.state = GradState.ACCUMULATING
        return self.grad

    def _new_grad(self) -> Tensor:
        """A fresh local gradient buffer, its values undefined."""
        if self.pool is None:
            self.grad = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        else:
            self._grad_buffer = self.pool.take()
            self.grad = self._grad_buffer[: self.numel]
        return self.grad

    @property
    def is_cleared(self) -> bool:
        """Whether the local gradient holds nothing a reduction would send: no buffer, a zero one,
        or (with parts) one no part of which was written since it was cleared."""
        if self.grad is None:
            return True
        if self._parts:
            return not any(self._written) and not self.grad[self._parts_end :].any()
        return not bool(self.grad.any())

    def set_parts(self, parts: Sequence[Range]) -> None:
        """The disjoint ranges of the local gradient that gradients arrive into (one per
        parameter, in any order). With parts, :meth:`add_to_part` writes a part's first gradient
        since the buffer was cleared instead of adding it to zeros: the buffer is then neither
        zero-filled when allocated nor cleared after each reduction, and only what no gradient
        reached (and the padding) is zeroed, when the reduction starts."""
        self._parts = list(parts)
        self._parts_end = max((part.end for part in self._parts), default=0)
        self._written = [False] * len(self._parts)

    def add_to_part(self, part: int, grad: Tensor) -> None:
        """Adds ``grad`` (flat, the part's size) into part ``part`` of the local gradient."""
        if self.state is GradState.REDUCING:
            self.finish()  # the previous micro-step's reduction lands before new gradients
        if self.grad is None:
            self._new_grad()
            self._written = [False] * len(self._parts)
        view = self._parts[part].slice(self.grad)
        if self._written[part]:
            view.add_(grad)
        else:
            view.copy_(grad)  # also the cast to the reduction's dtype, as add_ did
            self._written[part] = True
        self.state = GradState.ACCUMULATING

    def _clear_unwritten(self) -> None:
        """Zeroes the parts no gradient reached since the buffer was cleared, and the padding."""
        if self.grad is None or not self._parts:
            return
        for part, written in zip(self._parts, self._written):
            if not written:
                part.slice(self.grad).zero_()
        self.grad[self._parts_end :].zero_()
        self._written = [True] * len(self._parts)

    def owned_chunk(self, flat: Tensor) -> Tensor:
        """This rank's chunk of a rank-major tensor of this reduction's size."""
        return rank_chunk(self.rank, self.chunk_numel).slice(flat)

    def start(self, collectives: Collectives | CountingCollectives) -> None:
        """Launches the reduce-scatter (zeros if this rank has no local gradient)."""
        if self.state is GradState.REDUCING:
            raise RuntimeError(f"cannot reduce {self.name} while its previous reduction is in flight")
        if self.grad is None:
            self._new_grad().zero_()
            self._written = [True] * len(self._parts)
        self._clear_unwritten()
        # Averaging before the sum keeps fp16/bf16 sums in range, as DDP does (x / 1 is x: one rank
        # skips the pass over the bucket).
        if self.world_size > 1:
            self.grad.div_(self.world_size)
        self._into_master = self.master_grad_zero and self._can_reduce_into_master()
        if self._into_master:
            self._output = self.master_grad
            self.master_grad_zero = False
        else:
            self._output = torch.empty(self.chunk_numel, dtype=self.dtype, device=self.device)
        with torch.profiler.record_function(f"{self.label}::reduce_scatter"):
            self._handle = collectives.reduce_scatter(self._output, self.grad)
        self.state = GradState.REDUCING
        self.arrived = 0
        self.launched = True

    # [Note: reducing into the master gradient]
    # A reduction adds its chunk into master_grad, which zero_grad zeroed. The first one to land
    # after that, when the chunk has master_grad's dtype and device (no offload from a GPU, no
    # reduction in a narrower dtype), reduces straight into master_grad instead: no chunk to
    # allocate, no pass adding it to zeros. The sum is the same number (x + 0 is x; only a zero's
    # sign may differ, which no later step can tell). A dropped reduction that wrote into it puts
    # the zeros back. Owners zero master_grad through zero_master_grad, which marks it.
    def _can_reduce_into_master(self) -> bool:
        grad = self.master_grad
        return grad.dtype == self.dtype and grad.device == self.device and grad.numel() == self.chunk_numel \
            and grad.is_contiguous()

    def zero_master_grad(self) -> None:
        """Zeroes ``master_grad`` (zero_grad), so that the next reduction may write straight into it."""
        if self._into_master and self.state is GradState.REDUCING:
            raise RuntimeError(f"{self.name}: its reduction still writes into the master gradient; drop() it first")
        self.master_grad.zero_()
        self.master_grad_zero = True

    @property
    def lands_asynchronously(self) -> bool:
        """Whether the reduced chunk crosses from a CUDA device to host memory (offload): its copy
        is then queued on a copy stream (see [Note: landing on the host])."""
        return self.device.type == "cuda" and self.master_grad.device.type == "cpu"

    def start_landing(self) -> None:
        """Orders the reduced chunk's way to the master gradient: waits for the reduce-scatter (on
        NCCL the current stream waits, not the host) and, from a CUDA device to the host, queues
        its copy into pinned memory behind it (see [Note: landing on the host])."""
        if self.state is not GradState.REDUCING or self._handle is None:
            return
        assert self._output is not None
        with torch.profiler.record_function(f"{self.label}::wait_reduce_scatter"):
            self._handle.wait()
        self._handle = None
        if not self.lands_asynchronously:
            return
        if self._landing is None:
            self._landing = torch.empty(self.chunk_numel, dtype=self.dtype, pin_memory=True)
        stream = _copy_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._landing.copy_(self._output, non_blocking=True)
            self._landed = torch.cuda.Event()
            self._landed.record(stream)
        self._output.record_stream(stream)  # its memory is not reused before the copy ran

    def finish(self) -> None:
        """Waits for the reduce-scatter and adds this rank's chunk into the master gradient."""
        if self.state is not GradState.REDUCING:
            return
        self.start_landing()
        assert self._output is not None
        if self._landed is not None:
            assert self._landing is not None
            with torch.profiler.record_function(f"{self.label}::wait_landing"):
                self._landed.synchronize()
            self.master_grad.add_(self._landing)  # upcasts a bf16/fp16 reduction to fp32
            self._landed = None
        elif not self._into_master:
            # Upcasts a bf16/fp16 reduction to fp32; under offload this is the copy to the CPU.
            self.master_grad.add_(self._output.to(self.master_grad.device))
        self.master_grad_zero = False
        self._into_master = False
        self._output = None
        self._release()

    def poll(self) -> None:
        """Finishes the reduction if it already completed: under offload the gradient then moves to
        the CPU while backward goes on."""
        if self.state is GradState.REDUCING and self._handle is not None and self._handle.is_completed():
            self.finish()

    def drop(self) -> None:
        """Drops the local gradient, waiting for any collective still using the buffer."""
        if self._handle is not None:
            self._handle.wait()
        if self._landed is not None:
            self._landed.synchronize()  # the pinned buffer is written no more
        if self._into_master:
            self._into_master = False  # waited for above: nothing writes into it any more
            self.zero_master_grad()  # it held this reduction's partial result, which never landed
        self._handle = None
        self._landed = None
        self._output = None
        self.arrived = 0
        self.ready = False
        self._release()

    def _release(self) -> None:
        if self.keep_buffer and self.grad is not None and self._parts:
            self._written = [False] * len(self._parts)  # stale until written or cleared (set_parts)
        elif self.keep_buffer and self.grad is not None:
            self.grad.zero_()
        else:
            if self.pool is not None and self._grad_buffer is not None:
                self.pool.give(self._grad_buffer)  # waited for: no collective reads it any more
            self.grad = None
            self._grad_buffer = None
        self.state = GradState.CLEAN

    def __repr__(self) -> str:
        return f"Reduction({self.name!r}, {self.state.name}, arrived={self.arrived}/{self.expected_grads})"


class LaunchQueue:
    """The reductions a round owes, in launch order, for one schedule or several sharing a process
    group (see [Note: one launch order]); the head launches once it is ready, the rest wait."""

    def __init__(self, position: dict[Reduction, int] | None = None) -> None:
        # Where each reduction goes in the order shared by several schedules; None for one schedule,
        # whose round joins in the schedule's own order.
        self.position = position
        self.waiting: list[Reduction] = []  # joined a synchronized round, not launched yet
        self.round: int | None = None  # the round (an autograd task, or a negative number) they joined
        self._rounds = 0

    def new_round_id(self) -> int:
        """A round no autograd task can be mistaken for (task ids are never negative)."""
        self._rounds += 1
        return -1 - self._rounds

    def open_round(self, round_id: int, collectives: Collectives | CountingCollectives) -> None:
        """A schedule's round ``round_id`` starts: if it is new to the queue, what earlier rounds
        left goes out first, so that no earlier reduction is sent after a later one. Schedules
        entering a round the queue already opened launch nothing (their reductions join it)."""
        if round_id != self.round:
            self.launch_all(collectives)
            self.round = round_id

    def join(self, reductions: Sequence[Reduction]) -> None:
        """A schedule's synchronized round starts: its reductions wait for their turn."""
        if self.position is None:
            self.waiting.extend(reductions)
        else:
            self.waiting = sorted([*self.waiting, *reductions], key=self.position.__getitem__)

    def launch_ready(self, collectives: Collectives | CountingCollectives) -> None:
        """Launches the ready reductions at the head of the order."""
        launched = 0
        for reduction in self.waiting:
            if not reduction.ready:
                break
            reduction.start(collectives)
            reduction.ready = False
            launched += 1
        del self.waiting[:launched]

    def launch_all(self, collectives: Collectives | CountingCollectives) -> None:
        """Launches every waiting reduction in order, with zeros where this rank has no gradient."""
        waiting, self.waiting = self.waiting, []
        for reduction in waiting:
            # A reduction in flight here is an earlier backward's (reduce_every_micro_step): it lands
            # first, and this backward's still goes out (zeros here), as on the ranks whose gradients
            # finished it early.
            reduction.finish()
            reduction.start(collectives)
            reduction.ready = False


class ReduceSchedule:
    """Launches a fixed list of reductions in one order on every rank (see [Note: one launch order]).

    The layout calls :meth:`enter_backward` when a gradient arrives, adds it into the reduction's
    ``local_grad()`` and calls :meth:`arrived`; the optimizer calls :meth:`finish` before it
    reads the master gradients, and :meth:`drop` to discard them.
    """

    def __init__(
        self,
        order: Sequence[Reduction],
        collectives: Collectives | CountingCollectives,
        launches: LaunchQueue | None = None,
    ) -> None:
        self.order = list(order)
        self.collectives = collectives
        self.sync_enabled = True  # False inside no_sync(): backward accumulates locally only
        # What the current synchronized round has not launched yet; shared with the other schedules
        # of one process group (see [Note: one launch order]).
        self.launches = launches if launches is not None else LaunchQueue()
        self._task: int | None = None  # the autograd graph task whose gradients arrive now
        self._synced = True  # whether the current backward reduces (sync_enabled when it began)
        self.poll_after_launch = False  # offload: finished reductions move to the CPU during backward
        # Whether a backward began since the last finish or drop: only then does finish owe a round.
        self.pending = False
        self._explicit = False  # inside begin_backward/close_backward: task ids do not start backwards
        self._running_tasks: set[int] = set()  # graph tasks seen that have not finished yet
        # Gradients arrived after their reduction of this backward went out: finish owes a round.
        self.leftover = False
        self.pools: list[BufferPool] = []  # see reuse_buffers

    def reuse_buffers(self, keep: int = 2) -> None:
        """Host reductions that free their local gradient take it from a pool per dtype instead
        (see [Note: reused gradient buffers])."""
        by_dtype: dict[torch.dtype, list[Reduction]] = {}
        for reduction in self.order:
            if not reduction.keep_buffer and reduction.device.type == "cpu":
                by_dtype.setdefault(reduction.dtype, []).append(reduction)
        self.pools = []
        for reduction in self.order:
            reduction.pool = None
        for dtype, reductions in by_dtype.items():
            pool = BufferPool(max(r.numel for r in reductions), dtype, torch.device("cpu"), keep)
            pool.reclaim = self._poll
            for reduction in reductions:
                reduction.pool = pool
            self.pools.append(pool)

    def _poll(self) -> None:
        """Finishes every reduction whose collective completed."""
        for reduction in self.order:
            reduction.poll()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Within it, backward accumulates gradients locally and communicates nothing."""
        previous = self.sync_enabled
        self.sync_enabled = False
        try:
            yield
        finally:
            self.sync_enabled = previous

    def begin_backward(self, round_id: int | None = None) -> None:
        """A backward starts (every rank calls it for every backward, see [Note: what one backward
        is]): its gradients form one round, even if they reach no parameter of this schedule.
        Schedules sharing a queue begin one backward with the same ``round_id``
        (``launches.new_round_id()``)."""
        self._explicit = False
        self._running_tasks = set()  # a backward that raised never ran its callback
        self._new_round(round_id)
        self._explicit = True

    def _new_round(self, round_id: int | None = None) -> None:
        self.enter_backward(task=self.launches.new_round_id() if round_id is None else round_id)

    def close_backward(self) -> None:
        """The backward ``begin_backward`` announced has returned."""
        self._explicit = False

    def enter_backward(self, task: int | None = None) -> None:
        """Called for every gradient before it is accumulated: a gradient of a new backward first
        sends what the previous backward left unlaunched, then counts afresh."""
        if task is None:
            if self._explicit:
                return
            task = torch._C._current_graph_task_id()
            if task == self._task or self._task in self._running_tasks:
                return  # the current backward still runs: this task is nested in it (a reentrant checkpoint)
            if task != -1:
                self._running_tasks = {task}
                # Runs when this graph task ends: a task starting before then is nested in it.
                torch.autograd.Variable._execution_engine.queue_callback(lambda: self._running_tasks.discard(task))
        if task == self._task:
            return
        self.launches.open_round(task, self.collectives)
        for reduction in self.order:
            reduction.arrived = 0
            reduction.complete = False
            reduction.launched = False
        self._task = task
        self._synced = self.sync_enabled
        self.pending = True
        if self._synced:
            self.launches.join(self.order)

    def arrived(self, reduction: Reduction) -> bool:
        """Counts one gradient of ``reduction``; True when it completes this backward's set (then,
        in a synchronized backward, it launches in its turn)."""
        if reduction.launched:
            self.leftover = True  # it went out already: this gradient waits for finish's extra round
            return False
        reduction.arrived += 1
        if reduction.arrived < reduction.expected_grads:
            return False
        reduction.arrived = 0
        reduction.complete = True
        if self._synced:
            reduction.ready = True
            self._launch_ready()
            if self.poll_after_launch:
                self._poll()
        return True

    def _launch_ready(self) -> None:
        self.launches.launch_ready(self.collectives)

    def launch_remaining(self) -> None:
        """Launches what the current synchronized round left (with a shared queue, every schedule's
        round: an earlier one's must not go out after a later one's), in order, with zeros where
        this rank has no gradient."""
        self.launches.launch_all(self.collectives)

    def finish(self) -> None:
        """Every gradient produced so far lands, averaged over ranks, in the master gradients.

        What backward did not launch goes out now, in the launch order; after accumulation under
        no_sync only, that is every reduction. Every rank must call it; without a backward since the
        last finish (on every rank, see [Note: what one backward is]) there is nothing to send.
        """
        if self.launch_for_finish():
            for _ in self.land():
                pass

    def launch_for_finish(self) -> bool:
        """The first half of :meth:`finish`: launches everything still owed (every rank must call
        it); returns whether there is anything to land. :meth:`land` then lands it."""
        self._running_tasks = set()
        if not self.pending:
            return False
        if self.leftover:
            # Gradients that came after their reduction went out (here or on another rank) go in a
            # round of their own, zeros elsewhere.
            self.leftover = False
            self._new_round()
            if not self._synced:  # finish inside no_sync: the extra round is sent all the same
                self._synced = True
                self.launches.join(self.order)
        self.pending = False
        if self._task is None or not self._synced:
            # A round of this schedule alone, after what any other round left.
            self._task, self._synced = self.launches.new_round_id(), True
            self.launches.open_round(self._task, self.collectives)
            self.launches.join(self.order)
        self.launch_remaining()
        self._task = None
        return True

    def land(self) -> Iterator[Reduction]:
        """The second half of :meth:`finish`: waits for each reduction in launch order and yields it
        once its chunk is in the master gradient, while the later ones are still in flight (see
        [Note: overlapped step] in optimizer.py). A reduction left unlanded (the caller stopped)
        lands when its buffer is next used or dropped."""
        # Copies to the host are queued for every reduction first: they run on the copy stream
        # while the caller works on the chunks that landed. Elsewhere (gloo) ordering a landing
        # waits on the host, so each is waited for only when its turn comes.
        for reduction in self.order:
            if reduction.lands_asynchronously:
                reduction.start_landing()
        for reduction in self.order:
            reduction.finish()
            yield reduction

    def drop(self, reductions: Sequence[Reduction] | None = None) -> None:
        """Discards local gradients: what other ranks launched, this one launches too first."""
        self.launch_remaining()
        dropped = self.order if reductions is None else list(reductions)
        for reduction in dropped:
            reduction.drop()
        self._task = None
        self._running_tasks = set()
        self.leftover = False
        # What was not dropped (another optimizer's units at stage 3) is still owed at finish.
        self.pending = self.pending and not set(self.order) <= set(dropped)

    def end_backward(self) -> None:
        """A parameter without a gradient this backward must not count toward the next one."""
        for reduction in self.order:
            reduction.arrived = 0
            reduction.complete = False


__all__ = ["BufferPool", "GradState", "LaunchQueue", "ReduceSchedule", "Reduction"]
