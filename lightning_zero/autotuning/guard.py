"""Trials that fail on some ranks only end on every rank, without a hang.

[Note: a trial that fails on one rank]
An out-of-memory error is local: one rank raises it (in its forward, its backward, its step) while
the others go on to their next collective, which the failed rank will never join: a hang. Every
collective of a trial therefore first runs :meth:`TrialGuard.check`, a one-element all-reduce
over a gloo group of its own (on CPU: no device sync under NCCL), and a rank that fails runs
:meth:`TrialGuard.fail` once instead. The ranks run the same program, so the k-th guard exchange
pairs up on every rank: a failed rank's ``fail`` meets the others' next ``check``, which then
sees the failure and raises :class:`PeerFailed` *before* issuing its collective. Every
collective issued before it had been issued by the failed rank too, so nothing is left waiting.
A check comes after the allocations of the collective it guards (outputs are passed in), so an
OOM there is seen before the collective, not inside it. After the trial, every rank that did
not fail runs one last ``check``, which meets a late ``fail`` (an error after the last
collective). Once tripped, the guard sends nothing until :meth:`arm` starts the next trial, so
the teardown after a failure cannot start an exchange the others would not join.

It costs one small gloo exchange per collective during trials only (about 0.3 ms on 2 CPU ranks
sharing 2 cores here: 8-13% of a demo-GPT step at stage 2, which has 14 collectives per step).
Training after the search runs without it, and trials take it out of their measured time: each
exchange's latency, measured once with every rank ready (:meth:`TrialGuard.measure_latency`), is
subtracted per exchange of the measured steps (what waiting for a slower rank costs stays in:
that wait would otherwise be spent in the collective that follows).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero.zero.comm import GLOO_HELD, Collectives, Handle, StepGroups, _timeout_of

FINE, FAILED = 0, 1


class PeerFailed(RuntimeError):
    """Another rank's trial failed: this rank stopped before its next collective."""


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's ``OutOfMemoryError``, or an allocator's "out of memory" / "can't allocate" (CPU)."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


class TrialGuard:
    """The guard exchanges of one search (see [Note: a trial that fails on one rank]). Built on
    every rank together: it makes its own gloo group over the world."""

    def __init__(self, timeout: timedelta | None = None) -> None:
        """``timeout``: of the guard's exchanges; by default the world group's (the user's), not
        torch's default of a new group, so that a rank that never joins one ends the run when the
        user's timeout says."""
        self.world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.rank = dist.get_rank() if self.world_size > 1 else 0
        self._group = None
        if self.world_size > 1:
            self._group = dist.new_group(backend="gloo", timeout=timeout if timeout is not None else _timeout_of(None))
        self._tripped = False
        self.exchanges = 0  # guard exchanges this trial (the cost, and a test's handle)

    @property
    def tripped(self) -> bool:
        return self._tripped

    def arm(self) -> None:
        """Starts a trial: every rank fine."""
        self._tripped = False
        self.exchanges = 0

    def _exchange(self, value: int) -> int:
        flag = torch.tensor([value], dtype=torch.int32)
        with GLOO_HELD.holding(flag):  # a gloo group (see [Note: tensors outlive the gloo worker])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        self.exchanges += 1
        return int(flag.item())

    def check(self) -> None:
        """Before a collective: raises :class:`PeerFailed` if another rank's trial failed."""
        if self._tripped:
            raise PeerFailed("another rank's trial already failed")
        if self.world_size == 1:
            return
        if self._exchange(FINE) != FINE:
            self._tripped = True
            raise PeerFailed("another rank's trial failed")

    def fail(self) -> None:
        """This rank's trial failed: tells the others at their next check (once)."""
        if self._tripped:
            return
        self._tripped = True
        if self.world_size > 1:
            self._exchange(FAILED)

    def measure_latency(self, exchanges: int = 50) -> float:
        """Seconds one check costs when every rank is ready (the largest rank's median), so that
        trials can take the guard's own time out of what they measure."""
        if self.world_size == 1:
            return 0.0
        self.arm()
        times = []
        for _ in range(exchanges):
            begin = time.perf_counter()
            self.check()
            times.append(time.perf_counter() - begin)
        mine = sorted(times)[len(times) // 2]
        self.arm()
        return float(max(self.gather(mine)))

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj`` after a trial, in rank order."""
        if self.world_size == 1:
            return [obj]
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, obj, group=self._group)
        return every


class GuardedCollectives(Collectives):
    """The engine's collectives, each preceded by the trial guard's check."""

    def __init__(self, guard: TrialGuard, group: dist.ProcessGroup | None = None,
                 step_groups: StepGroups | None = None) -> None:
        guard.check()  # before the groups made here, which every rank must make together
        super().__init__(group=group, step_groups=step_groups)
        self.guard = guard

    def reduce_scatter(self, output: Tensor, input: Tensor) -> Handle:
        self.guard.check()
        return super().reduce_scatter(output, input)

    def broadcast_to_replicas(self, tensor: Tensor) -> None:
        self.guard.check()
        super().broadcast_to_replicas(tensor)

    def all_reduce_step_flags(self, flags: Tensor) -> None:
        self.guard.check()
        super().all_reduce_step_flags(flags)

    def all_reduce_tensor_parallel(self, tensor: Tensor, op: dist.ReduceOp.RedOpType) -> None:
        self.guard.check()
        super().all_reduce_tensor_parallel(tensor, op)

    def all_reduce_pipeline(self, tensor: Tensor, op: dist.ReduceOp.RedOpType) -> None:
        self.guard.check()
        super().all_reduce_pipeline(tensor, op)

    def all_gather(self, output: Tensor, input: Tensor) -> Handle:
        self.guard.check()
        return super().all_gather(output, input)

    def all_reduce(self, tensor: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
        self.guard.check()
        super().all_reduce(tensor, op)

    def broadcast(self, tensor: Tensor, src_rank: int = 0) -> None:
        self.guard.check()
        super().broadcast(tensor, src_rank)

    def agree(self, values: Sequence[int]) -> list[list[int]]:
        self.guard.check()
        return super().agree(values)

    def gather_objects(self, obj: Any) -> list[Any]:
        self.guard.check()
        return super().gather_objects(obj)


__all__ = ["GuardedCollectives", "PeerFailed", "TrialGuard", "is_out_of_memory"]
