"""Regressions found in review: activation checkpointing under ZeRO-3, parameters used on some
ranks only (all stages), read-only gathers under bf16. Two gloo ranks, one spawn."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from harness import run_on_ranks
from lightning_zero import ZeroConfig, ZeroStrategy
from models import TiedGPT, TinyGPT, fit, max_abs_diff, params_of

WORLD = 2
TOLERANCE = 1e-5


class CheckpointedGPT(TiedGPT):
    def forward(self, tokens: Tensor) -> Tensor:
        hidden = self.embed(tokens)
        for block in self.blocks:
            hidden = checkpoint(block, hidden, use_reentrant=False)
        return self.head(self.norm(hidden))


class RankDependentGPT(TinyGPT):
    """Rank 0 uses an extra layer, rank 1 does not: a parameter with gradients on one rank only."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(32, 32)

    def forward(self, tokens: Tensor) -> Tensor:
        hidden = self.embed(tokens)
        if self.trainer.global_rank == 0:
            hidden = hidden + self.extra(hidden)
        return self.head(self.norm(self.block(hidden)))


class FrozenBlocksGPT(TiedGPT):
    """Prompt-tuning shape: the blocks are frozen, gradient flows through them to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        width = self.norm.normalized_shape[0]
        self.blocks.extend(
            nn.TransformerEncoderLayer(width, nhead=2, dim_feedforward=2 * width, dropout=0.0, batch_first=True,
                                       bias=False)
            for _ in range(4)
        )
        for param in self.blocks.parameters():
            param.requires_grad = False


class PeakGathered(Callback):
    def __init__(self) -> None:
        self.stats: dict[str, int] = {}

    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        engine = trainer.strategy.engine
        self.stats = {
            "peak": engine.peak_param_bytes,
            "shards": sum(u.shard.numel() * u.shard.element_size() for u in engine.units),
            "largest": max(u.full_bytes for u in engine.units),
            "root": engine.root_unit.full_bytes if engine.root_unit is not None else 0,
            "all": sum(u.full_bytes for u in engine.units),
        }


class EngineState(Callback):
    def __init__(self) -> None:
        self.refcounts: list[list[int]] = []
        self.gathered_bytes: list[int] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        engine = trainer.strategy.engine
        self.refcounts.append([u.refcount for u in engine.units])
        self.gathered_bytes.append(sum(u.full.untyped_storage().nbytes() for u in engine.units))


class ReadOnlyGather(Callback):
    """Reads whole parameters mid-training: the fp32 masters must not be rounded by it."""

    def __init__(self) -> None:
        self.unchanged: list[bool] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        optimizer = trainer.strategy.zero_optimizers[0]
        before = [sp.master.clone() for sp in optimizer.params]
        with trainer.strategy.gathered_params():
            _ = sum(float(p.float().sum()) for p in trainer.lightning_module.parameters())
        self.unchanged.append(all(torch.equal(a, sp.master) for a, sp in zip(before, optimizer.params)))


def _run(module_class: type, strategy: Any, **kwargs: Any) -> dict[str, Any]:
    pl.seed_everything(0)
    module = module_class()
    fit(module, strategy, WORLD, **kwargs)
    return {"losses": module.losses, "params": params_of(module)}


def _cases() -> dict[str, Any]:
    zero3 = {"stage": 3, "min_unit_numel": 500}
    # At stage 3 every rank must run the same units in forward (each runs an all-gather); a layer
    # only some ranks use must live in a unit every rank gathers anyway, here the root unit.
    zero3_blocks = {"stage": 3, "unit_modules": ("TransformerEncoderLayer",)}
    state = EngineState()
    read_only = ReadOnlyGather()
    frozen_peak = PeakGathered()
    return {
        "frozen_ddp": _run(FrozenBlocksGPT, "ddp"),
        "frozen_zero3": _run(FrozenBlocksGPT, ZeroStrategy(config=ZeroConfig(**zero3)), callbacks=[frozen_peak]),
        "frozen_peak": frozen_peak.stats,
        "ckpt_ddp": _run(CheckpointedGPT, "ddp"),
        "ckpt_zero3": _run(CheckpointedGPT, ZeroStrategy(config=ZeroConfig(**zero3)), callbacks=[state]),
        "ckpt_state": {"refcounts": state.refcounts, "gathered": state.gathered_bytes},
        "rank_ddp": _run(RankDependentGPT, "ddp_find_unused_parameters_true"),
        "rank_zero2": _run(RankDependentGPT, ZeroStrategy(config=ZeroConfig(stage=2, reduce_bucket_size=200))),
        "rank_zero3": _run(RankDependentGPT, ZeroStrategy(config=ZeroConfig(**zero3_blocks))),
        "rank_ddp_accumulate": _run(RankDependentGPT, "ddp_find_unused_parameters_true", accumulate_grad_batches=2),
        "rank_zero3_accumulate": _run(RankDependentGPT, ZeroStrategy(config=ZeroConfig(**zero3_blocks)),
                                      accumulate_grad_batches=2),
        "bf16_read_only": _run(TinyGPT, ZeroStrategy(config=ZeroConfig(**zero3)), precision="bf16-mixed",
                               callbacks=[read_only], steps=3),
        "read_only_unchanged": read_only.unchanged,
    }


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_on_ranks(_cases, WORLD)


def _assert_matches(zero: dict[str, Any], ddp: dict[str, Any]) -> None:
    assert len(zero["losses"]) == len(ddp["losses"]) > 0
    assert max(abs(a - b) for a, b in zip(zero["losses"], ddp["losses"])) <= TOLERANCE
    assert max_abs_diff(zero["params"], ddp["params"]) <= TOLERANCE


def test_activation_checkpointing_under_zero3(results: list[dict[str, Any]]) -> None:
    for per_rank in results:
        _assert_matches(per_rank["ckpt_zero3"], per_rank["ckpt_ddp"])
        state = per_rank["ckpt_state"]
        # every step ends with no unit held and nothing whole in memory (no leaked references)
        assert all(refcount == 0 for step in state["refcounts"] for refcount in step)
        assert set(state["gathered"]) == {0}


@pytest.mark.parametrize(
    ("case", "reference"),
    [("rank_zero2", "rank_ddp"), ("rank_zero3", "rank_ddp"), ("rank_zero3_accumulate", "rank_ddp_accumulate")],
)
def test_parameter_used_on_one_rank_only_matches_ddp_find_unused(
    results: list[dict[str, Any]], case: str, reference: str
) -> None:
    for per_rank in results:
        _assert_matches(per_rank[case], per_rank[reference])


def test_frozen_units_are_freed_after_their_backward(results: list[dict[str, Any]]) -> None:
    for per_rank in results:
        _assert_matches(per_rank["frozen_zero3"], per_rank["frozen_ddp"])
        stats = per_rank["frozen_peak"]
        # not every unit at once at the end of backward: the shards, the root, and a few units
        assert stats["peak"] <= stats["shards"] + stats["root"] + 3 * stats["largest"] < stats["shards"] + stats["all"]


def test_read_only_gather_keeps_bf16_masters(results: list[dict[str, Any]]) -> None:
    for per_rank in results:
        assert per_rank["read_only_unchanged"] == [True, True, True]
