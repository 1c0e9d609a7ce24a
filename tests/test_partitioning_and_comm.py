"""Memory per rank is total / N (apart from padding); stage 2 communicates only on boundary steps."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import Callback

from harness import run_on_ranks
from lightning_zero import Collectives, CountingCollectives, ZeroConfig, ZeroStrategy, model_state_bytes
from models import TinyGPT, fit

BUCKET = 700
FP32 = 4


class CallsPerBatch(Callback):
    """Records how many reduce-scatters each micro-batch issued."""

    def __init__(self, counting: CountingCollectives) -> None:
        self.counting = counting
        self.reduce_scatters: list[int] = []
        self.volume_per_step: list[int] = []
        self._seen = 0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        calls = [c for c in self.counting.calls if c.op == "reduce_scatter"]
        self.reduce_scatters.append(len(calls) - self._seen)
        self._seen = len(calls)


def _run(world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    numel = sum(p.numel() for p in TinyGPT().parameters())
    out["numel"] = numel
    for stage in (1, 2):
        pl.seed_everything(0)
        module = TinyGPT()
        config = ZeroConfig(stage=stage, reduce_bucket_size=BUCKET, reduce_every_micro_step=True)
        trainer = fit(module, ZeroStrategy(config=config), world_size, steps=3, accumulate_grad_batches=2)
        out[f"bytes{stage}"] = trainer.strategy.all_ranks_model_state_bytes()
        out[f"buckets{stage}"] = sum(len(b.buckets) for o in trainer.strategy.zero_optimizers for b in o.flat_buffers)
    pl.seed_everything(0)
    module = TinyGPT()
    ddp = fit(module, "ddp", world_size, steps=3)
    out["ddp"] = model_state_bytes(module, ddp.strategy.optimizers)
    # communication: stage 2, accumulate 4, default (boundary) mode
    counting = CountingCollectives(Collectives())
    recorder = CallsPerBatch(counting)
    pl.seed_everything(0)
    fit(TinyGPT(), ZeroStrategy(config=ZeroConfig(stage=2, reduce_bucket_size=BUCKET), collectives=counting),
        world_size, steps=3, accumulate_grad_batches=4, callbacks=[recorder])
    out["reduce_scatters_per_batch"] = recorder.reduce_scatters
    out["calls"] = counting.calls
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def outcome(request: pytest.FixtureRequest) -> tuple[int, dict[str, Any]]:
    return request.param, run_on_ranks(_run, request.param, request.param)[0]


def test_optimizer_state_is_split_evenly(outcome: tuple[int, dict[str, Any]]) -> None:
    world, result = outcome
    numel = result["numel"]
    for stage in (1, 2):
        per_rank = result[f"bytes{stage}"]
        padding = result[f"buckets{stage}"] * world * FP32 * 3
        scalars = 64 * 8  # Adam's per-group step counters
        # AdamW: exp_avg + exp_avg_sq + the fp32 master, each 1/N of the model.
        for rank_bytes in per_rank:
            assert 3 * FP32 * numel / world <= rank_bytes.optimizer_states <= 3 * FP32 * numel / world + padding + scalars
            assert rank_bytes.params == pytest.approx(FP32 * numel, abs=padding)  # stages 1/2 keep all params
        # DDP keeps exp_avg and exp_avg_sq of the whole model on every rank.
        assert result["ddp"].optimizer_states >= 2 * FP32 * numel
        assert per_rank[0].optimizer_states < result["ddp"].optimizer_states * 3 / (2 * world) + padding + scalars


def test_stage2_gradients_are_split_evenly_when_reducing_every_micro_step(outcome: tuple[int, dict[str, Any]]) -> None:
    world, result = outcome
    numel = result["numel"]
    padding = result["buckets2"] * world * FP32
    for rank_bytes in result["bytes2"]:
        assert FP32 * numel / world <= rank_bytes.grads <= FP32 * numel / world + padding
    # stage 1 keeps a full local gradient buffer besides its shard
    for rank_bytes in result["bytes1"]:
        assert rank_bytes.grads >= FP32 * numel + FP32 * numel / world


def test_stage2_reduces_only_on_boundary_micro_steps(outcome: tuple[int, dict[str, Any]]) -> None:
    _, result = outcome
    per_batch = result["reduce_scatters_per_batch"]
    assert len(per_batch) == 12
    for index, count in enumerate(per_batch):
        if (index + 1) % 4 == 0:
            assert count > 0, f"boundary micro-batch {index} reduced nothing"
        else:
            assert count == 0, f"micro-batch {index} is not a boundary yet reduced {count} buckets"


def test_bytes_per_step_match_reduce_scatter_plus_all_gather(outcome: tuple[int, dict[str, Any]]) -> None:
    world, result = outcome
    numel = result["numel"]
    calls = result["calls"]
    steps = 3
    sent = {op: sum(c.numel for c in calls if c.op == op) * (world - 1) / world / steps for op in ("reduce_scatter", "all_gather")}
    padding = result["buckets2"] * world
    expected = numel * (world - 1) / world  # per collective: Psi (N-1)/N elements
    for op in ("reduce_scatter", "all_gather"):
        assert expected <= sent[op] <= expected + padding
    assert expected * 2 <= sent["reduce_scatter"] + sent["all_gather"] <= 2 * (expected + padding)
