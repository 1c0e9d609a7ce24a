"""Hybrid sharding's all-reduces across replicas go out in launch order on every rank, whichever
reduction is polled or waited for first (one process, the collectives faked)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import lightning_zero.zero.comm as comm
from lightning_zero.zero.comm import CollectiveForms, Collectives, StepGroups


class FakeScatter:
    def __init__(self) -> None:
        self.done = False
        self.waited = False

    def wait(self) -> bool:
        self.done = self.waited = True
        return True

    def is_completed(self) -> bool:
        return self.done


class FakeAllReduce:
    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@pytest.fixture
def collectives(monkeypatch: pytest.MonkeyPatch) -> tuple[Collectives, list[torch.Tensor]]:
    launched: list[Any] = []

    def all_reduce(tensor: torch.Tensor, group: Any = None, async_op: bool = False) -> FakeAllReduce:
        launched.append(tensor)
        return FakeAllReduce()

    monkeypatch.setattr(comm.dist, "all_reduce", all_reduce)
    # Only what the replica path reads: the real constructor needs a process group.
    fake = object.__new__(Collectives)
    fake.world_size, fake.rank, fake.backend, fake.replicas = 2, 0, "gloo", 2
    fake.replicate_group, fake.step_groups, fake._replica_reductions = None, StepGroups(), []
    fake._reduce_group = fake._control_group = fake.group = None
    fake.forms = CollectiveForms.native()  # the reduce-scatter form, whose handle these tests fake
    fake._holds = False  # nothing reaches gloo
    return fake, launched


def test_all_reduces_follow_the_launch_order(collectives: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    fake, launched = collectives
    scatters = [FakeScatter() for _ in range(3)]
    pending = iter(scatters)
    monkeypatch.setattr(comm, "_reduce_scatter_single", lambda out, inp, group, async_op: next(pending))
    handles = [fake.reduce_scatter(torch.full((2,), float(i + 1)), torch.zeros(4)) for i in range(3)]
    # The second finished first: nothing may go out before the first does.
    scatters[1].done = True
    assert not handles[1].is_completed() and launched == []
    scatters[0].done = True
    handles[2].is_completed()  # a poll launches every finished one from the head, in order
    assert [t[0].item() for t in launched] == [0.5, 1.0]  # averaged over the 2 replicas first
    # Waiting for the last launches it; waiting again for a launched one waits for nothing else.
    handles[2].wait()
    assert [t[0].item() for t in launched] == [0.5, 1.0, 1.5]
    handles[0].wait()
    assert len(launched) == 3 and fake._replica_reductions == []


def test_waiting_for_a_later_one_launches_the_earlier_ones_first(collectives: Any,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    fake, launched = collectives
    scatters = [FakeScatter() for _ in range(3)]
    pending = iter(scatters)
    monkeypatch.setattr(comm, "_reduce_scatter_single", lambda out, inp, group, async_op: next(pending))
    handles = [fake.reduce_scatter(torch.full((2,), float(i + 1)), torch.zeros(4)) for i in range(3)]
    handles[1].wait()
    assert [t[0].item() for t in launched] == [0.5, 1.0]
    assert scatters[0].waited and scatters[1].waited and not scatters[2].waited
    assert len(fake._replica_reductions) == 1
    handles[0].wait()  # already out: it must not hold the host on the third's reduce-scatter
    assert not scatters[2].waited and len(launched) == 2


def test_on_nccl_the_all_reduce_goes_out_with_the_reduce_scatter(collectives: Any,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    fake, launched = collectives
    fake.backend = "nccl"
    monkeypatch.setattr(comm, "_reduce_scatter_single", lambda out, inp, group, async_op: FakeScatter())
    fake.reduce_scatter(torch.ones(2), torch.zeros(4))
    assert len(launched) == 1 and fake._replica_reductions == []
