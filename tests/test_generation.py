"""Hugging Face generate at stage 3 defaults to synced_gpus=True (see [Note: generation at stage 3]):
the wrapper itself, without ranks. The ranks' side (an EOS on one rank first) is in test_user_code.py."""

from __future__ import annotations

import copy
import inspect
import io
import pickle
from typing import Any

import torch
from torch import nn

from lightning_zero import ZeroStrategy
from lightning_zero.fabric import ZeroFabricStrategy
from lightning_zero.zero.stage3.generation import sync_generation


class GenerationMixin:  # transformers' mixin, recognised by name
    def generate(self, inputs: Any = None, synced_gpus: bool | None = None, **kwargs: Any) -> tuple[int, Any]:
        """What it was called on, and with which synced_gpus."""
        return id(self), synced_gpus


class Model(nn.Module, GenerationMixin):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)


def test_generate_syncs_unless_told_and_stays_a_bound_method() -> None:
    outer = nn.Sequential(Model(), nn.Linear(2, 2))
    model = outer[0]
    undo = sync_generation(outer)
    assert model.generate(1) == (id(model), True)
    assert model.generate(1, synced_gpus=False)[1] is False
    # Fabric's mark_forward_method("generate") wants a bound method; the name and signature stay
    assert inspect.ismethod(model.generate) and model.generate.__name__ == "generate"
    assert list(inspect.signature(model.generate).parameters)[:2] == ["inputs", "synced_gpus"]
    average = copy.deepcopy(model)  # a weight-averaging copy calls its own generate
    assert average.generate(1) == (id(average), True)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=False).generate(1)[1] is None  # a pickled copy does not sync
    undo()
    assert "generate" not in model.__dict__ and model.generate(1)[1] is None
    assert average.generate(1)[1] is None  # the copy stops with the strategy: it holds whole weights


def test_the_strategies_still_pickle_for_spawn() -> None:
    # Fabric's and Lightning's spawn launchers pickle the strategy (no lambdas in its attributes).
    for strategy in (ZeroFabricStrategy(stage=3, start_method="spawn"), ZeroStrategy(stage=3, start_method="spawn")):
        assert type(pickle.loads(pickle.dumps(strategy))) is type(strategy)
