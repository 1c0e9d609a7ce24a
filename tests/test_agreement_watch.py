"""[Note: ranks that never arrive]: a rank waiting long in an agreement says which one and why.

One process: a stand-in for the collectives whose exchange takes as long as the test says plays
a rank whose peers are late (or never come). The real case (a generate on rank 0 only at stage 3)
now ends in an error on every rank where the others reach one of Lightning's collectives through
the strategy (test_user_code.py); a rank whose peers wait in a collective of their own still
waits for the process group's timeout, too long for the suite.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest

from lightning_zero.zero import consistency
from lightning_zero.zero.consistency import AgreementWatch, Point, agree_at


class LateCollectives:
    """``agree`` returns after ``delay`` seconds, every rank having given the same values."""

    world_size = 2

    def __init__(self, rank: int, delay: float) -> None:
        self.rank = rank
        self.delay = delay

    def agree(self, values: Sequence[int]) -> list[list[int]]:
        time.sleep(self.delay)
        return [list(values)] * self.world_size


@pytest.fixture
def watch(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What a watch with a patience of 0.2 s, standing in for the process's, says."""
    watch = AgreementWatch(patience_s=0.2)
    monkeypatch.setattr(consistency, "AGREEMENT_WATCH", watch)
    return watch.reported


def test_a_long_wait_in_an_agreement_says_where_once_and_the_agreement_still_completes(watch: list[str]) -> None:
    rows = agree_at(LateCollectives(rank=1, delay=1.2), Point.GATHER, [3, 0])  # type: ignore[arg-type]
    assert rows == [[3, 0], [3, 0]]
    assert len(watch) == 1  # once per wait, however long it lasts
    message = watch[0]
    assert message.startswith("lightning_zero: rank 1 has waited ")
    assert "before it gathers ZeRO-3 unit #3" in message
    assert "`if trainer.is_global_zero: model.generate(...)`" in message and "run it on every rank" in message


def test_short_waits_say_nothing(watch: list[str]) -> None:
    for _ in range(20):
        agree_at(LateCollectives(rank=0, delay=0.0), Point.SYNC, [1, 0, 1, 1])  # type: ignore[arg-type]
    time.sleep(0.3)  # the watch looks again after a wait it could have reported
    assert watch == []


def test_each_long_wait_is_reported_on_its_own(watch: list[str]) -> None:
    agree_at(LateCollectives(rank=0, delay=0.9), Point.BATCH_END, [1, 0])  # type: ignore[arg-type]
    agree_at(LateCollectives(rank=0, delay=0.9), Point.BATCH, [1])  # type: ignore[arg-type]
    assert [message.split(". A rank")[0].split("before it ")[1] for message in watch] == [
        "ended its training_step after 1 optimizer step(s)", "fetches a batch"]


def test_a_wait_after_many_short_ones_is_still_reported(watch: list[str]) -> None:
    """The thread sleeps until a wait begins, then until its deadline: a long wait right after
    short ones is seen as soon as its own patience runs out."""
    for _ in range(50):
        agree_at(LateCollectives(rank=0, delay=0.0), Point.GATHER, [1, 0])  # type: ignore[arg-type]
    agree_at(LateCollectives(rank=0, delay=0.9), Point.GATHER, [2, 0])  # type: ignore[arg-type]
    assert len(watch) == 1 and "gathers ZeRO-3 unit #2" in watch[0]


@pytest.mark.parametrize(("value", "patience"), [("", 120.0), ("5", 5.0), ("0", None), ("nan", 120.0),
                                                 ("-3", 120.0), ("inf", 120.0), ("soon", 120.0)])
def test_the_patience_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch, value: str,
                                                  patience: float | None) -> None:
    """0 turns the watch off; what is not a finite positive number of seconds leaves the default."""
    monkeypatch.setenv("LIGHTNING_ZERO_AGREEMENT_PATIENCE", value)
    assert AgreementWatch().patience() == patience
