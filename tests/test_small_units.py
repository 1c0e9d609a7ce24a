"""The warning for stage-3 units too small to pay their collectives' latency ([Note: units too
small to pay their latency] in zero/stage3/partition.py), without ranks: units are planned for
rank 0 of 2 on a named backend."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_zero import SmallUnitsWarning, ZeroConfig
from lightning_zero.zero.stage3.engine import Zero3Engine
from lightning_zero.zero.stage3.partition import LATENCY_BOUND_NUMEL, build_units, small_units_message

CPU = torch.device("cpu")


def _collectives(backend: str) -> SimpleNamespace:
    return SimpleNamespace(world_size=2, rank=0, backend=backend)


def _blocks(width: int, count: int = 8) -> nn.Module:
    return nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(count)))


def _message(model: nn.Module, backend: str, **config: object) -> str | None:
    zero = ZeroConfig(stage=3, **config)  # type: ignore[arg-type]
    return small_units_message(build_units(model, _collectives(backend), zero, None, CPU), backend, zero)


def test_many_small_units_are_named_with_the_fix() -> None:
    # Eight 64x64 linears (4,096 elements each) as units on gloo: latency-bound.
    message = _message(_blocks(64), "gloo", unit_modules=("Linear",))
    assert message is not None
    assert "8 of the 8 ZeRO-3 units gather fewer than 65,536 elements" in message
    assert "24 such collectives per step" in message and "name a larger class" in message
    by_size = _message(_blocks(64), "gloo", min_unit_numel=1000)
    assert by_size is not None and "raise min_unit_numel (now 1,000)" in by_size


def test_large_units_few_units_and_unknown_backends_stay_quiet() -> None:
    width = 512  # 262,144 elements per unit: above gloo's bound
    assert _message(_blocks(width), "gloo", unit_modules=("Linear",)) is None
    assert _message(_blocks(64, count=3), "gloo", unit_modules=("Linear",)) is None  # 3 small units: few collectives
    assert _message(_blocks(64), "fake", unit_modules=("Linear",)) is None
    # The default (1M elements per unit) groups small modules into the root unit: one unit, no warning.
    assert _message(_blocks(64), "gloo") is None
    # What is latency-bound on NCCL is not on gloo.
    assert _message(_blocks(width), "nccl", unit_modules=("Linear",)) is not None
    assert LATENCY_BOUND_NUMEL["gloo"] < width * width < LATENCY_BOUND_NUMEL["nccl"]


def test_the_engine_warns_once_on_rank_zero() -> None:
    config = ZeroConfig(stage=3, unit_modules=("Linear",))
    with pytest.warns(SmallUnitsWarning, match="gather fewer than"):
        Zero3Engine(_blocks(64), _collectives("gloo"), config, None, CPU)  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.simplefilter("error", SmallUnitsWarning)
        quiet = _collectives("gloo")
        quiet.rank = 1
        Zero3Engine(_blocks(64), quiet, config, None, CPU)  # type: ignore[arg-type]
