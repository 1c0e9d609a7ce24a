"""The collectives the ZeRO engine uses, behind one small object.

The engine never calls ``torch.distributed`` directly: it is handed a :class:`Collectives` bound to
its data-parallel process group. That keeps process groups out of module globals and lets tests
wrap the object to count exactly what is sent (:class:`CountingCollectives`).
"""

from __future__ import annotations

import atexit
import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

# torch 2.13 renames the ``*_tensor`` collectives to ``*_single``; older releases only have the former.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# [Note: tensors outlive the gloo worker]
# gloo runs each collective on a worker thread of its process group, which holds the collective's
# work, and with it the tensors it was given, until the worker is done with it: a little after the
# rank's wait() returned, later still when the worker was preempted (2 ranks on 2 cores). When
# Python let go of such a tensor first (a temporary view, a freed gradient buffer), the tensor's
# Python object lives on inside it, and the worker that drops the work last must take the GIL to
# free that object. If the interpreter is finalizing by then, Python ends the worker thread inside
# a C++ destructor and the process aborts ("terminate called without an active exception", exit
# 134 after a run that finished: 1 of 10-30 runs of a ZeRO fit through Lightning's launcher, 1 of
# 10 runs of tests/scripts/collectives_and_exit.py --unheld; pytorch/pytorch#38228, #190489). So
# every tensor a gloo collective is handed is also held here, by Python, until only this holder is
# left (the worker then never needs the GIL for it) or 64 collectives later. ``settle`` waits,
# bounded, for the last ones: at exit (atexit handlers run before the interpreter finalizes) and at
# the strategy's teardown, which lets go of their memory. Collectives issued elsewhere hand gloo
# tensors nobody here holds: torch's object collectives (all_gather_object, broadcast_object_list,
# which the strategy's broadcast, all_ranks_model_state_bytes and Lightning's own calls use) and
# the user's. A script that ends right after one aborted in 8 of 20 runs (2 ranks, 2 busy cores;
# the core dump shows the worker in ~AsyncBroadcastWork, taking the GIL from Py_FinalizeEx's last
# collection). So at exit a process in a process group also gives the workers a moment without
# the GIL (EXIT_GRACE_S): every worker that finished its work drops it then (0 aborts in 20 runs).


# A torch without it cannot tell when gloo let go: its tensors are held ``max_age`` collectives.
_KNOWS_USE_COUNT = hasattr(Tensor, "_use_count")


class HeldTensors:
    """The tensors of recent gloo collectives, held until no collective work holds them (see
    [Note: tensors outlive the gloo worker]). A tensor counts as let go once its reference count is
    back where it was before the collective was issued."""

    def __init__(self, max_age: int = 64) -> None:
        self.max_age = max_age
        self._issued = 0
        self._held: list[tuple[int, tuple[Tensor, ...], tuple[int, ...]]] = []

    def __len__(self) -> int:
        return len(self._held)

    @contextlib.contextmanager
    def holding(self, *tensors: Tensor) -> Iterator[None]:
        """Holds ``tensors`` beyond the collective issued inside."""
        counts = tuple(t._use_count() for t in tensors) if _KNOWS_USE_COUNT else ()
        yield
        self._issued += 1
        self.prune()
        self._held.append((self._issued, tensors, counts))

    @staticmethod
    def _in_use(tensors: tuple[Tensor, ...], counts: tuple[int, ...]) -> bool:
        if not _KNOWS_USE_COUNT:
            return True
        return any(t._use_count() > count for t, count in zip(tensors, counts))

    def prune(self) -> None:
        """Lets go of the tensors no work holds any more, and of those held ``max_age`` collectives."""
        oldest = self._issued - self.max_age
        self._held = [entry for entry in self._held if entry[0] > oldest and self._in_use(entry[1], entry[2])]

    def settle(self, timeout: float = 2.0) -> None:
        """Waits (at most ``timeout`` seconds) until no work holds the held tensors, then lets go
        of every one."""
        if not _KNOWS_USE_COUNT:
            timeout = min(timeout, 0.05)  # no way to tell: give the workers a moment
        deadline = time.monotonic() + timeout
        self.prune()
        while self._held and time.monotonic() < deadline:
            time.sleep(0.001)
            self.prune()
        self._held = []


GLOO_HELD = HeldTensors()
EXIT_GRACE_S = 0.05


def _settle_at_exit() -> None:
    """At exit, before the interpreter finalizes (the workers can still take the GIL then): the held
    tensors, then a moment for the tensors of collectives issued elsewhere (see [Note: tensors
    outlive the gloo worker])."""
    GLOO_HELD.settle()
    if dist.is_available() and dist.is_initialized():
        time.sleep(EXIT_GRACE_S)


atexit.register(_settle_at_exit)


class Handle(Protocol):
    def wait(self) -> bool | None: ...

    def is_completed(self) -> bool: ...


class _Done:
    """Handle of a collective that already completed (world size 1)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


# [Note: collective forms]
# A sharded collective can go out in more than one form with the same result, bit for bit:
# - reduce-scatter as an all-reduce of the whole input followed by a copy of this rank's chunk;
# - all-gather as one broadcast per rank into its slot of the output;
# - between exactly two ranks, either of them as an exchange: one all_to_all_single whose split
#   sizes send the peer its chunk and nothing to oneself. A reduce-scatter then adds this rank's own
#   chunk to the one received, which is the sum gloo forms (a + b equals b + a in IEEE arithmetic,
#   so the bits match for every dtype); with more ranks a local sum would add in another order than
#   gloo's ring, and the bits would differ, so the exchange is never used there.
# Which form is fastest depends on the backend, the ranks and the size. On gloo (CPU), with two
# ranks, the exchange is the fastest form of both at every size measured, 4K-2M elements per rank
# (reduce-scatter 1.4-7x faster than gloo's, all-gather 1.1-1.6x: one collective where the
# broadcasts are two, each byte sent once, and no sum inside gloo, whose bf16 sum is slow). With
# more ranks, from 512K elements per rank, the all-reduce form is 1.1-1.3x faster than gloo's
# reduce-scatter and the broadcasts 1.2-2.1x faster than its all-gather (below that the forms
# trade places from one size to the next). NCCL's reduce-scatter and all-gather are its fastest. CollectiveForms holds fixed rules
# measured by benchmarks/comm.py (per rank's chunk, in elements); every rank applies the same rule
# to the same sizes, so the ranks always issue the same collectives. The all-reduce form writes the
# sum into its input: the reductions' inputs are local gradient buffers, zeroed or freed once
# reduced. CountingCollectives records the logical operation, so traffic accounting reports the
# volume of a reduce-scatter or an all-gather whichever form carried it.


@dataclass(frozen=True)
class CollectiveForms:
    """Which form the sharded collectives take (see [Note: collective forms]).

    Attributes:
        reduce_scatter_as_all_reduce_from: chunks of at least this many elements per rank are
            reduce-scattered as an all-reduce plus a local copy; ``None``: never.
        all_gather_as_broadcasts_from: chunks of at least this many elements per rank are
            all-gathered as one broadcast per rank; ``None``: never.
        exchange_between_two_ranks: over a group of exactly two ranks, both collectives go out as
            one exchange (``all_to_all_single``), whatever the size; this comes before the two
            thresholds, which then only apply to larger groups.
    """

    reduce_scatter_as_all_reduce_from: int | None = None
    all_gather_as_broadcasts_from: int | None = None
    exchange_between_two_ranks: bool = False

    @classmethod
    def native(cls) -> CollectiveForms:
        """Every collective in its own form (what NCCL is fastest with)."""
        return cls()

    @classmethod
    def for_backend(cls, backend: str) -> CollectiveForms:
        """The rules ``benchmarks/comm.py`` measured: on gloo the exchange between two ranks, and
        with more ranks both alternative forms from 512K elements per rank (below that neither form
        wins at every size); every other backend (NCCL) keeps its own."""
        if "gloo" in backend:
            return cls(reduce_scatter_as_all_reduce_from=_GLOO_FORMS_FROM, all_gather_as_broadcasts_from=_GLOO_FORMS_FROM,
                       exchange_between_two_ranks=True)
        return cls.native()

    def reduce_scatter_form(self, chunk_numel: int, world_size: int) -> str:
        if self.exchange_between_two_ranks and world_size == 2:
            return "exchange"
        threshold = self.reduce_scatter_as_all_reduce_from
        return "all_reduce" if threshold is not None and chunk_numel >= threshold else "reduce_scatter"

    def all_gather_form(self, chunk_numel: int, world_size: int) -> str:
        if self.exchange_between_two_ranks and world_size == 2:
            return "exchange"
        threshold = self.all_gather_as_broadcasts_from
        return "broadcasts" if threshold is not None and chunk_numel >= threshold else "all_gather"


_GLOO_FORMS_FROM = 512 * 1024


class _FinishedLocally:
    """A collective whose result still needs one local operation: reduce-scatter carried by an
    all-reduce (copy this rank's chunk into the output) or by an exchange (add this rank's own
    chunk to the one received). ``finish`` runs once, when the collective is seen complete (on
    ``wait``, or when ``is_completed`` sees it)."""

    def __init__(self, work: Handle, finish: Callable[[], object]) -> None:
        self._work = work
        self._finish = finish
        self._finished = False

    def wait(self) -> bool:
        self._work.wait()
        if not self._finished:
            self._finish()
            self._finished = True
        return True

    def is_completed(self) -> bool:
        if self._finished:
            return True
        if not self._work.is_completed():
            return False
        self.wait()
        return True


def _exchange_splits(rank: int, numel: int) -> list[int]:
    """The split sizes of a two-rank exchange: ``numel`` elements to and from the peer, none to or
    from oneself."""
    splits = [numel, numel]
    splits[rank] = 0
    return splits


class _Broadcasts:
    """An all-gather carried by one broadcast per rank into its slot of the output."""

    def __init__(self, works: list[Handle]) -> None:
        self._works = works

    def wait(self) -> bool:
        for work in self._works:
            work.wait()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


def _timeout_of(group: dist.ProcessGroup | None) -> timedelta | None:
    """The collective timeout ``group`` was created with (None: torch's default, if it cannot tell)."""
    process_group = group if group is not None else dist.group.WORLD
    try:
        device = torch.device("cuda") if "nccl" in str(dist.get_backend(group)) else torch.device("cpu")
        return process_group._get_backend(device).options._timeout  # type: ignore[union-attr]
    except (AttributeError, RuntimeError, ValueError):
        return None


@dataclass(frozen=True, eq=False)
class StepGroups:
    """The ranks a step's decisions and gradient norm span beyond the engine's own group (see
    [Note: a step over the mesh]).

    ``everyone``: the group that agrees whether to step (an overflow or a gradient anywhere counts
    for all: tensor-parallel ranks and replicas must skip together); ``None`` is the engine's group.
    Under a pipeline it is the ranks of this stage, and the overflow flag spans ``pipeline`` too.
    ``tensor``: the tensor-parallel group, over which the norms of ``tensor_sharded`` parameters
    (each rank holds another part of them) add up; parameters replicated over it count once.
    ``pipeline``: the ranks of this rank's pipeline, one per stage: each holds other parameters,
    so the whole norm adds up over it.
    """

    everyone: dist.ProcessGroup | None = None
    tensor: dist.ProcessGroup | None = None
    tensor_sharded: frozenset[Any] = frozenset()
    pipeline: dist.ProcessGroup | None = None


# [Note: a step over the mesh]
# The engine shards over its group (the data-parallel ranks, or under hybrid sharding the ranks of
# one shard group), and everything it computes from its pieces covers one tensor-parallel rank's
# part of the model once. Two things span more ranks: whether to step (a tensor-parallel rank or a
# replica that overflowed must make every rank skip, or the model's parts drift apart), agreed over
# ``StepGroups.everyone``; and the global gradient norm: the squared norms of tensor-parallel shards
# add up over the tensor group, while a parameter replicated over it (a norm, an embedding) is the
# same on every tensor rank and is counted once. Replicas of a shard group hold the same reduced
# gradient after the all-reduce across them, so the norm never sums over replicas. Pipeline stages
# hold disjoint parameters: the norm's partial sums (or maxima) then add up over the pipeline group.


class _ReplicaReduction:
    """A reduce-scatter within the shard group followed by an all-reduce of its output across the
    replicas (hybrid sharding). The all-reduces go out in the order the reduce-scatters did, on every
    rank, whichever one is waited for or polled first: otherwise two ranks could pair one bucket's
    all-reduce with another's."""

    def __init__(self, owner: Collectives, scatter: Handle, output: Tensor) -> None:
        self._owner = owner
        self._scatter = scatter
        self.output = output
        self._all_reduce: Handle | None = None

    def launch(self) -> None:
        if self._all_reduce is None:
            self._scatter.wait()
            # Averaging before the sum, as the shard group's reduction does, keeps fp16/bf16 in range.
            self.output.div_(self._owner.replicas)
            with self._owner.holding(self.output):
                self._all_reduce = dist.all_reduce(self.output, group=self._owner.replicate_group, async_op=True)

    @property
    def launched(self) -> bool:
        return self._all_reduce is not None

    def scatter_done(self) -> bool:
        return self._scatter.is_completed()

    def wait(self) -> bool:
        if not self.launched:
            self._owner._launch_replica_reductions(until=self)
        assert self._all_reduce is not None
        self._all_reduce.wait()
        return True

    def is_completed(self) -> bool:
        self._owner._launch_replica_reductions(until=None)
        return self._all_reduce is not None and self._all_reduce.is_completed()


class Collectives:
    """Collectives over one process group; asynchronous ones return a handle to ``wait`` on.

    Args:
        group: the ranks the engine shards over (None: the world).
        control_group, reduce_group: the gloo group for agreement exchanges and the group gradient
            reductions run on (see [Note: reductions on their own group]). By default they are made
            here, which every rank of the world must then do together; a caller building
            collectives for one of several sibling groups (a mesh dimension) passes its own.
        replicate_group: hybrid sharding: the group of this rank's replicas across shard groups;
            every reduce-scatter's output is then all-reduced over it (averaged over both).
        step_groups: see :class:`StepGroups`.
        forms: which form the reduce-scatters and all-gathers take (see [Note: collective forms]);
            by default the rules for the group's backend.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        control_group: dist.ProcessGroup | None = None,
        reduce_group: dist.ProcessGroup | None = None,
        replicate_group: dist.ProcessGroup | None = None,
        step_groups: StepGroups | None = None,
        forms: CollectiveForms | None = None,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ZeRO needs an initialized torch.distributed process group, and none is. Run through"
                " `Trainer(strategy='zero2', devices=N)` (Lightning launches the ranks), start the script"
                " with torchrun/SLURM, or call torch.distributed.init_process_group() before building the engine."
            )
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.backend = str(dist.get_backend(group))
        self.forms = forms if forms is not None else CollectiveForms.for_backend(self.backend)
        self._holds = "gloo" in self.backend  # see [Note: tensors outlive the gloo worker]
        self._group_ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.world_size))
        self.replicate_group = replicate_group
        self.replicas = dist.get_world_size(replicate_group) if replicate_group is not None else 1
        self.step_groups = step_groups if step_groups is not None else StepGroups()
        self._replica_reductions: list[_ReplicaReduction] = []  # launched reduce-scatters, in order
        # Agreement exchanges (see [Note: ranks that disagree] in consistency.py) run on CPU tensors:
        # over a gloo group beside NCCL, so that they never wait for the device.
        self._control_group = group
        self._reduce_group = group
        if control_group is not None or reduce_group is not None:
            self._control_group = control_group if control_group is not None else group
            self._reduce_group = reduce_group if reduce_group is not None else group
        elif self.world_size > 1:
            ranks = dist.get_process_group_ranks(group) if group is not None else None
            # The groups made here wait as long as the group they serve: a rank that never joins
            # must time out (an error) when the user's timeout says, not after torch's default.
            timeout = _timeout_of(group)
            # A group of its own even under gloo: on the default group an agreement of a rank that
            # skipped one would pair with Lightning's own collectives (a broadcast every batch) and
            # hang, where two agreements at different points meet and raise.
            self._control_group = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
            # [Note: reductions on their own group] Gradient reductions run in one fixed order on
            # every rank ([Note: one launch order]), but a rank without some gradient launches a
            # reduction later than the others, so relative to the all-gathers (stage 3's backward
            # gathers) and the small collectives in between, ranks would issue them in different
            # orders, which pairs unrelated collectives up (a hang). On a group of their own the
            # reductions only need to agree among themselves.
            self._reduce_group = dist.new_group(ranks=ranks, backend=self.backend, timeout=timeout)

    def holding(self, *tensors: Tensor) -> contextlib.AbstractContextManager[None]:
        """Holds the tensors of a collective issued inside, on gloo (see [Note: tensors outlive the
        gloo worker])."""
        return GLOO_HELD.holding(*tensors) if self._holds else contextlib.nullcontext()

    def reduce_scatter(self, output: Tensor, input: Tensor) -> Handle:
        """Sums ``input`` (shape [world * n]) over ranks; rank r receives elements [r*n, (r+1)*n).
        Under hybrid sharding the sum then spans the replicas too, and is averaged over them."""
        n = output.numel()
        form = self.forms.reduce_scatter_form(n, self.world_size) if self.world_size > 1 else "local"
        chunk = input[self.rank * n:(self.rank + 1) * n]
        if form == "local":
            output.copy_(input)
            scatter: Handle = _Done()
        elif form == "exchange":
            peer = 1 - self.rank
            splits = _exchange_splits(self.rank, n)
            to_peer = input[peer * n:(peer + 1) * n]
            with self.holding(output, to_peer):
                work = dist.all_to_all_single(output, to_peer, output_split_sizes=splits,
                                              input_split_sizes=splits, group=self._reduce_group, async_op=True)
            scatter = _FinishedLocally(work, lambda: output.add_(chunk))
        elif form == "all_reduce":
            with self.holding(input):
                work = dist.all_reduce(input, group=self._reduce_group, async_op=True)
            scatter = _FinishedLocally(work, lambda: output.copy_(chunk))
        else:
            with self.holding(output, input):
                scatter = _reduce_scatter_single(output, input, group=self._reduce_group, async_op=True)
        if self.replicas == 1:
            return scatter
        reduction = _ReplicaReduction(self, scatter, output)
        if "nccl" in self.backend:
            # On NCCL wait() only orders the streams: launching now costs the host nothing, and every
            # rank then issues its collectives on each communicator in program order.
            reduction.launch()
        else:
            # gloo's wait() blocks the host: the all-reduce goes out once the reduce-scatter is seen done.
            self._replica_reductions.append(reduction)
        return reduction

    def _launch_replica_reductions(self, until: _ReplicaReduction | None) -> None:
        """Launches the pending all-reduces across replicas in launch order: up to and including
        ``until`` (waiting for the reduce-scatters before it), or, without it, those whose
        reduce-scatter completed, stopping at the first that has not."""
        while self._replica_reductions:
            head = self._replica_reductions[0]
            if until is None and not head.scatter_done():
                return
            head.launch()
            self._replica_reductions.pop(0)
            if head is until:
                return

    def broadcast_to_replicas(self, tensor: Tensor) -> None:
        """Hybrid sharding: the replicas take the first replica's ``tensor`` (initial values)."""
        if self.replicas > 1:
            group = self.replicate_group
            with self.holding(tensor):
                dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)

    def all_reduce_step_flags(self, flags: Tensor) -> None:
        """MAX of a step's decision flags over every rank that steps together (see StepGroups):
        all of them over the ranks holding the same parameters, and the last (overflow) over the
        pipeline's stages too, which hold other parameters but must skip together."""
        group = self.step_groups.everyone
        if group is None:
            self.all_reduce(flags, dist.ReduceOp.MAX)
        elif dist.get_world_size(group) > 1:
            with self.holding(flags):
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        pipeline = self.step_groups.pipeline
        if pipeline is not None and dist.get_world_size(pipeline) > 1:
            overflow = flags[-1:].clone()
            with self.holding(overflow):
                dist.all_reduce(overflow, op=dist.ReduceOp.MAX, group=pipeline)
            flags[-1:] = overflow

    def all_reduce_tensor_parallel(self, tensor: Tensor, op: dist.ReduceOp.RedOpType) -> None:
        """Reduces partial norms of tensor-parallel shards over the tensor group (if any)."""
        group = self.step_groups.tensor
        if group is not None and dist.get_world_size(group) > 1:
            with self.holding(tensor):
                dist.all_reduce(tensor, op=op, group=group)

    def all_reduce_pipeline(self, tensor: Tensor, op: dist.ReduceOp.RedOpType) -> None:
        """Reduces a stage's partial norm over the pipeline's stages (if any)."""
        group = self.step_groups.pipeline
        if group is not None and dist.get_world_size(group) > 1:
            with self.holding(tensor):
                dist.all_reduce(tensor, op=op, group=group)

    def all_gather(self, output: Tensor, input: Tensor) -> Handle:
        """Concatenates every rank's ``input`` (shape [n]) into ``output`` (shape [world * n]).

        ``input`` may be of another dtype (an fp32 master of a bf16 parameter): the wire carries
        ``output``'s. It must not change until the gather is waited for."""
        if self.world_size == 1:
            output.copy_(input)
            return _Done()
        form = self.forms.all_gather_form(input.numel(), self.world_size)
        n = input.numel()
        own = output[self.rank * n:(self.rank + 1) * n]
        in_place = input.data_ptr() == own.data_ptr() and input.dtype == own.dtype  # the CPU step wrote it there
        if form != "all_gather":
            # This rank's chunk is written into the output first (cast there) and sent from there:
            # no copy of the input of its own.
            slots = [output[r * n:(r + 1) * n] for r in range(self.world_size)]
            if not in_place:
                own.copy_(input)
        if form == "exchange":
            splits = _exchange_splits(self.rank, n)
            with self.holding(slots[1 - self.rank], own):
                return dist.all_to_all_single(slots[1 - self.rank], own, output_split_sizes=splits,
                                              input_split_sizes=splits, group=self.group, async_op=True)
        if form == "broadcasts":
            with self.holding(*slots):
                return _Broadcasts([dist.broadcast(slot, src=self._group_ranks[r], group=self.group, async_op=True)
                                    for r, slot in enumerate(slots)])
        if in_place or input.dtype != output.dtype:
            input = input.to(output.dtype, copy=True)  # gloo does not promise in-place gathers
        with self.holding(output, input):
            return _all_gather_single(output, input, group=self.group, async_op=True)

    def all_reduce(self, tensor: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
        """Blocking all-reduce of a small tensor (norms, flags)."""
        if self.world_size > 1:
            with self.holding(tensor):
                dist.all_reduce(tensor, op=op, group=self.group)

    def broadcast(self, tensor: Tensor, src_rank: int = 0) -> None:
        """Blocking broadcast from the group rank ``src_rank``."""
        if self.world_size > 1:
            with self.holding(tensor):
                dist.broadcast(tensor, src=dist.get_global_rank(self.group, src_rank) if self.group else src_rank,
                               group=self.group)

    def agree(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's ``values`` (the same count on each), in rank order: a small blocking exchange
        that tells ranks what the others are about to do."""
        mine = torch.tensor(list(values), dtype=torch.int64)
        if self.world_size == 1:
            return [mine.tolist()]
        every = torch.empty(self.world_size * mine.numel(), dtype=torch.int64)
        with GLOO_HELD.holding(every, mine):  # the control group is gloo's
            _all_gather_single(every, mine, group=self._control_group)
        return every.view(self.world_size, -1).tolist()

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order (blocking)."""
        if self.world_size == 1:
            return [obj]
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, obj, group=self._control_group)
        return every


@dataclass(frozen=True)
class CollectiveCall:
    op: str
    numel: int
    dtype: torch.dtype


@dataclass
class CountingCollectives:
    """Wraps :class:`Collectives` and records every call, for tests and communication audits."""

    inner: Collectives
    calls: list[CollectiveCall] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def backend(self) -> str:
        return self.inner.backend

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self.inner.group

    @property
    def replicas(self) -> int:
        return self.inner.replicas

    @property
    def step_groups(self) -> StepGroups:
        return self.inner.step_groups

    def reduce_scatter(self, output: Tensor, input: Tensor) -> Handle:
        self.calls.append(CollectiveCall("reduce_scatter", input.numel(), input.dtype))
        if self.inner.replicas > 1:  # the traffic that crosses shard groups (nodes)
            self.calls.append(CollectiveCall("replica_all_reduce", output.numel(), output.dtype))
        return self.inner.reduce_scatter(output, input)

    def broadcast_to_replicas(self, tensor: Tensor) -> None:
        if self.inner.replicas > 1:
            self.calls.append(CollectiveCall("replica_broadcast", tensor.numel(), tensor.dtype))
        self.inner.broadcast_to_replicas(tensor)

    def all_reduce_step_flags(self, flags: Tensor) -> None:
        # Over the engine's group it is that group's all-reduce; over a wider group, its own entry.
        op = "all_reduce" if self.inner.step_groups.everyone is None else "step_flags"
        self.calls.append(CollectiveCall(op, flags.numel(), flags.dtype))
        self.inner.all_reduce_step_flags(flags)

    def all_reduce_tensor_parallel(self, tensor: Tensor, op: dist.ReduceOp.RedOpType) -> None:
        self.calls.append(CollectiveCall("tensor_all_reduce", tensor.numel(), tensor.dtype))
        self.inner.all_reduce_tensor_parallel(tensor, op)

    def all_reduce_pipeline(self, tensor: Tensor, op: dist.ReduceOp.RedOpType) -> None:
        self.calls.append(CollectiveCall("pipeline_all_reduce", tensor.numel(), tensor.dtype))
        self.inner.all_reduce_pipeline(tensor, op)

    def all_gather(self, output: Tensor, input: Tensor) -> Handle:
        self.calls.append(CollectiveCall("all_gather", output.numel(), output.dtype))
        return self.inner.all_gather(output, input)

    def all_reduce(self, tensor: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
        self.calls.append(CollectiveCall("all_reduce", tensor.numel(), tensor.dtype))
        self.inner.all_reduce(tensor, op)

    def broadcast(self, tensor: Tensor, src_rank: int = 0) -> None:
        self.calls.append(CollectiveCall("broadcast", tensor.numel(), tensor.dtype))
        self.inner.broadcast(tensor, src_rank)

    def agree(self, values: Sequence[int]) -> list[list[int]]:
        self.calls.append(CollectiveCall("agree", len(values), torch.int64))
        return self.inner.agree(values)

    def gather_objects(self, obj: Any) -> list[Any]:
        self.calls.append(CollectiveCall("gather_objects", 0, torch.uint8))
        return self.inner.gather_objects(obj)

    def volume(self, op: str) -> int:
        """Elements each rank sends for ``op`` under ring algorithms: numel * (N - 1) / N."""
        total = sum(call.numel for call in self.calls if call.op == op)
        return total * (self.world_size - 1) // self.world_size

    def reset(self) -> None:
        self.calls.clear()
