"""The ZeRO engine without a Trainer: global norm, skipped steps and no_sync, on 2 gloo ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import run_on_ranks
from lightning_zero import Collectives, CountingCollectives, ZeroConfig, ZeroOptimizer

WORLD = 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))


def _engine_cases() -> dict[str, Any]:
    rank = dist.get_rank()
    data = torch.randn(8, 6, generator=torch.Generator().manual_seed(rank))
    out: dict[str, Any] = {}

    # Global norm: equal to torch's norm of the DDP-averaged full gradient.
    reference = _model()
    reference(data).pow(2).mean().backward()
    for param in reference.parameters():
        dist.all_reduce(param.grad)
        param.grad /= WORLD
    out["torch_norm"] = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01))
    model = _model()
    counting = CountingCollectives(Collectives())
    optimizer = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1), model, counting, ZeroConfig(stage=2, reduce_bucket_size=16))
    model(data).pow(2).mean().backward()
    out["zero_norm"] = float(optimizer.clip_grad_norm_(0.01))
    optimizer.step()
    optimizer.zero_grad()

    # A step with no gradient anywhere changes nothing, as in torch.
    before = [p.detach().clone() for p in model.parameters()]
    holders = [piece.holder for piece in optimizer.param_pieces()]
    state_before = [{k: v.clone() for k, v in optimizer.state[holder].items()} for holder in holders]
    optimizer.step()
    out["unchanged_params"] = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    state_after = [optimizer.state[holder] for holder in holders]
    out["unchanged_state"] = all(torch.equal(b[k], a[k]) for b, a in zip(state_before, state_after) for k in b)

    # no_sync: three accumulating backwards communicate nothing; the step reduces once.
    counting.reset()
    with optimizer.no_sync():
        for _ in range(3):
            model(data).pow(2).mean().backward()
    out["calls_under_no_sync"] = len(counting.calls)
    model(data).pow(2).mean().backward()
    optimizer.step()
    out["reduce_scatters_after"] = sum(c.op == "reduce_scatter" for c in counting.calls)
    out["buckets"] = sum(len(b.buckets) for b in optimizer.flat_buffers)
    out["grads_are_none"] = all(p.grad is None for p in model.parameters())
    out["adagrad"] = _adagrad_against_torch(data)
    out["published_after_load"] = _publish_after_load(data)
    return out


def _publish_after_load(data: torch.Tensor) -> float:
    """Offload with bf16 parameters: masters loaded after a step reach the parameters (not the
    bf16 copy the last CPU step staged). Returns the largest parameter value after loading zeros."""
    from lightning_zero import CPUOffloadPolicy

    model = _model()
    optimizer = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1), model, Collectives(),
                              ZeroConfig(stage=2, offload_optimizer=CPUOffloadPolicy()), param_dtype=torch.bfloat16)
    model.to(torch.bfloat16)
    model(data.bfloat16()).float().pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    optimizer.load_master_values({param: torch.zeros_like(param, dtype=torch.float32) for param in model.parameters()})
    optimizer.publish_params()
    return max(float(param.abs().max()) for param in model.parameters())


def _adagrad_against_torch(data: torch.Tensor) -> dict[str, float]:
    """Adagrad creates its state in its constructor: ZeRO re-creates it for the shards (stages 2
    and 3) and then steps like torch's Adagrad on the averaged gradient."""
    from lightning_zero.zero.stage3 import Zero3Engine, Zero3Optimizer

    reference = _model()
    torch_adagrad = torch.optim.Adagrad(reference.parameters(), lr=0.1, initial_accumulator_value=0.5)
    zero2_model, zero3_model = _model(), _model()
    zero2 = ZeroOptimizer(torch.optim.Adagrad(zero2_model.parameters(), lr=0.1, initial_accumulator_value=0.5),
                          zero2_model, Collectives(), ZeroConfig(stage=2, reduce_bucket_size=16))
    engine = Zero3Engine(zero3_model, Collectives(), ZeroConfig(stage=3, min_unit_numel=1, param_persistence_threshold=0, prefetch_units=1,
                                                 prefetch_bytes=0), param_dtype=None, device=torch.device("cpu"))
    engine.shard()
    engine.install_hooks()
    zero3 = Zero3Optimizer(torch.optim.Adagrad(zero3_model.parameters(), lr=0.1, initial_accumulator_value=0.5),
                           engine, ZeroConfig(stage=3))
    for _ in range(3):
        reference(data).pow(2).mean().backward()
        for param in reference.parameters():
            dist.all_reduce(param.grad)
            param.grad /= WORLD
        torch_adagrad.step()
        torch_adagrad.zero_grad()
        for model, optimizer in ((zero2_model, zero2), (zero3_model, zero3)):
            model(data).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    whole = engine.full_state_dict()
    engine.remove_hooks()
    expected = reference.state_dict()
    zero3_diff = max((whole[k] - v).abs().max().item() for k, v in expected.items()) if whole else 0.0
    return {"zero2": max((zero2_model.state_dict()[k] - v).abs().max().item() for k, v in expected.items()),
            "zero3": zero3_diff}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_on_ranks(_engine_cases, WORLD)


def test_global_norm_equals_torch_on_the_averaged_gradient(results: list[dict[str, Any]]) -> None:
    for per_rank in results:
        assert per_rank["zero_norm"] == pytest.approx(per_rank["torch_norm"], rel=1e-6)


def test_step_without_gradients_changes_nothing(results: list[dict[str, Any]]) -> None:
    for per_rank in results:
        assert per_rank["unchanged_params"] and per_rank["unchanged_state"]


def test_no_sync_defers_every_reduction_to_the_step(results: list[dict[str, Any]]) -> None:
    for per_rank in results:
        assert per_rank["calls_under_no_sync"] == 0
        assert per_rank["reduce_scatters_after"] == per_rank["buckets"] > 1
        assert per_rank["grads_are_none"]


def test_publish_after_loading_masters_takes_the_masters_not_the_staged_copy(results: list[dict[str, Any]]) -> None:
    for per_rank in results:
        assert per_rank["published_after_load"] == 0.0


def test_adagrad_whose_constructor_builds_state_is_sharded_and_matches_torch(results: list[dict[str, Any]]) -> None:
    for per_rank in results:
        assert per_rank["adagrad"]["zero2"] <= 1e-6 and per_rank["adagrad"]["zero3"] <= 1e-6
