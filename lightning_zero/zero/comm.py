"""The collectives the ZeRO engine uses, behind one small object.

The engine never calls ``torch.distributed`` directly: it is handed a :class:`Collectives` bound to
its data-parallel process group. That keeps process groups out of module globals and lets tests
wrap the object to count exactly what is sent (:class:`CountingCollectives`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

# torch 2.13 renames the ``*_tensor`` collectives to ``*_single``; older releases only have the former.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Handle(Protocol):
    def wait(self) -> bool | None: ...

    def is_completed(self) -> bool: ...


class _Done:
    """Handle of a collective that already completed (world size 1)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _timeout_of(group: dist.ProcessGroup | None) -> timedelta | None:
    """The collective timeout ``group`` was created with (None: torch's default, if it cannot tell)."""
    process_group = group if group is not None else dist.group.WORLD
    try:
        device = torch.device("cuda") if "nccl" in str(dist.get_backend(group)) else torch.device("cpu")
        return process_group._get_backend(device).options._timeout  # type: ignore[union-attr]
    except (AttributeError, RuntimeError, ValueError):
        return None


class Collectives:
    """Collectives over one process group; asynchronous ones return a handle to ``wait`` on."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
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
        # Agreement exchanges (see [Note: ranks that disagree] in consistency.py) run on CPU tensors:
        # over a gloo group beside NCCL, so that they never wait for the device.
        self._control_group = group
        self._reduce_group = group
        if self.world_size > 1:
            ranks = dist.get_process_group_ranks(group) if group is not None else None
            # The groups made here wait as long as the group they serve: a rank that never joins
            # must time out (an error) when the user's timeout says, not after torch's default.
            timeout = _timeout_of(group)
            if "gloo" not in self.backend:
                self._control_group = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
            # [Note: reductions on their own group] Gradient reductions run in one fixed order on
            # every rank ([Note: one launch order]), but a rank without some gradient launches a
            # reduction later than the others, so relative to the all-gathers (stage 3's backward
            # gathers) and the small collectives in between, ranks would issue them in different
            # orders, which pairs unrelated collectives up (a hang). On a group of their own the
            # reductions only need to agree among themselves.
            self._reduce_group = dist.new_group(ranks=ranks, backend=self.backend, timeout=timeout)

    def reduce_scatter(self, output: Tensor, input: Tensor) -> Handle:
        """Sums ``input`` (shape [world * n]) over ranks; rank r receives elements [r*n, (r+1)*n)."""
        if self.world_size == 1:
            output.copy_(input)
            return _Done()
        return _reduce_scatter_single(output, input, group=self._reduce_group, async_op=True)

    def all_gather(self, output: Tensor, input: Tensor) -> Handle:
        """Concatenates every rank's ``input`` (shape [n]) into ``output`` (shape [world * n])."""
        if self.world_size == 1:
            output.copy_(input)
            return _Done()
        return _all_gather_single(output, input, group=self.group, async_op=True)

    def all_reduce(self, tensor: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
        """Blocking all-reduce of a small tensor (norms, flags)."""
        if self.world_size > 1:
            dist.all_reduce(tensor, op=op, group=self.group)

    def broadcast(self, tensor: Tensor, src_rank: int = 0) -> None:
        """Blocking broadcast from the group rank ``src_rank``."""
        if self.world_size > 1:
            dist.broadcast(tensor, src=dist.get_global_rank(self.group, src_rank) if self.group else src_rank,
                           group=self.group)

    def agree(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's ``values`` (the same count on each), in rank order: a small blocking exchange
        that tells ranks what the others are about to do."""
        mine = torch.tensor(list(values), dtype=torch.int64)
        if self.world_size == 1:
            return [mine.tolist()]
        every = torch.empty(self.world_size * mine.numel(), dtype=torch.int64)
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

    def reduce_scatter(self, output: Tensor, input: Tensor) -> Handle:
        self.calls.append(CollectiveCall("reduce_scatter", input.numel(), input.dtype))
        return self.inner.reduce_scatter(output, input)

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
