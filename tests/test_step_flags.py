"""The per-parameter "had a gradient" flags of a step: exchanged only when some rank lacks one.

When the agreement before a step (``agree_before_step``) says every rank got a gradient for
every parameter, the step takes the flags as all ones and issues no all-reduce for them; when a
parameter got no gradient on some rank, or a loss scaler needs the overflow flag, the flags go out
as before. Either way the result is bit-identical to the step that always exchanges them, and a
parameter no rank used since ``zero_grad`` is left alone even right after a step that skipped the
exchange. Stages 1, 2 and 3 on the engine, and a Trainer at stage 2; two gloo ranks, one spawn.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from harness import run_on_ranks
from lightning_zero import Collectives, CountingCollectives, ZeroConfig, ZeroStrategy
from lightning_zero.loss_scaler import LossScaler
from lightning_zero.zero.consistency import agree_before_step
from lightning_zero.zero.engine import make_engine
from models import TinyGPT, fit

WORLD = 2
STAGES = (1, 2, 3)
# Which ranks use the `extra` layer in each step: every rank, no rank (right after a step that
# skipped the exchange: zero_grad must have forgotten that every rank got every gradient), rank 0
# only, every rank.
USE_EXTRA = ((0, 1), (), (0,), (0, 1))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        self.extra = nn.Linear(6, 3)

    def forward(self, x: Tensor, use_extra: bool) -> Tensor:
        out = self.body(x)
        return out + self.extra(x) if use_extra else out


def _engine_run(stage: int, agree: bool, scaled: bool, wrapped: bool = False) -> dict[str, Any]:
    """Four steps of _Net; with ``agree``, each step is preceded by the strategy's agreement; with
    ``wrapped``, zero_grad is called through Lightning's optimizer wrapper, as manual optimization
    does (see [Note: optimizer wrappers])."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    model = _Net()
    counting = CountingCollectives(Collectives())
    engine = make_engine(model, counting, ZeroConfig(stage=stage, reduce_bucket_size=64), None, torch.device("cpu"))
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1),
                                      loss_scaler=LossScaler() if scaled else None)
    zeroing = LightningOptimizer(optimizer) if wrapped else optimizer
    generator = torch.Generator().manual_seed(dist.get_rank())
    flag_exchanges, extra_after = [], []
    for users in USE_EXTRA:
        loss = model(torch.randn(4, 6, generator=generator), dist.get_rank() in users).pow(2).mean()
        (loss * optimizer.loss_scaler.scale if scaled else loss).backward()
        counting.reset()
        if agree:
            agree_before_step(counting, engine, 1, optimizer)
        optimizer.step()
        flag_exchanges.append(sum(call.op == "all_reduce" and call.numel == optimizer.layout.num_trainable + 1
                                  for call in counting.calls))
        zeroing.zero_grad()
        with engine.gathered(writeback=False):
            extra_after.append([p.detach().clone() for p in model.extra.parameters()])
    with engine.gathered(writeback=False):
        params = [p.detach().clone() for p in model.parameters()]
    masters = [piece.holder.detach().clone() for piece in optimizer.param_pieces()]
    engine.remove_hooks()
    return {"flag_exchanges": flag_exchanges, "extra_after": extra_after, "params": params, "masters": masters}


def _trainer_run() -> dict[str, Any]:
    counting = CountingCollectives(Collectives())
    strategy = ZeroStrategy(config=ZeroConfig(stage=2, reduce_bucket_size=700), collectives=counting)
    module = TinyGPT()
    trainable = sum(1 for p in module.parameters() if p.requires_grad)
    fit(module, strategy, WORLD, steps=3)
    return {"flag_exchanges": sum(call.op == "all_reduce" and call.numel == trainable + 1 for call in counting.calls),
            "reduce_scatters": sum(call.op == "reduce_scatter" for call in counting.calls)}


def _cases() -> dict[str, Any]:
    engine = {(stage, agree, scaled): _engine_run(stage, agree, scaled)
              for stage in STAGES for agree in (True, False) for scaled in (False, True)}
    wrapped = {stage: _engine_run(stage, agree=True, scaled=False, wrapped=True) for stage in STAGES}
    return {"engine": engine, "wrapped": wrapped, "trainer": _trainer_run()}


_RUNS: list[dict[str, Any]] = []


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    if not _RUNS:
        _RUNS.extend(run_on_ranks(_cases, WORLD))
    return _RUNS


@pytest.mark.parametrize("stage", STAGES)
def test_flags_are_exchanged_only_when_some_rank_lacks_a_gradient(runs: list[dict[str, Any]], stage: int) -> None:
    for run in runs:
        # Steps 1 and 4: every rank got every gradient, and the agreement said so.
        assert run["engine"][(stage, True, False)]["flag_exchanges"] == [0, 1, 1, 0]
        # Without the agreement (a direct optimizer.step()), or with a loss scaler, always.
        assert run["engine"][(stage, False, False)]["flag_exchanges"] == [1, 1, 1, 1]
        assert run["engine"][(stage, True, True)]["flag_exchanges"] == [1, 1, 1, 1]


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("scaled", [False, True])
def test_skipping_the_exchange_changes_no_bit(runs: list[dict[str, Any]], stage: int, scaled: bool) -> None:
    for run in runs:
        skipped, exchanged = run["engine"][(stage, True, scaled)], run["engine"][(stage, False, scaled)]
        for key in ("params", "masters"):
            assert len(skipped[key]) == len(exchanged[key])
            for a, b in zip(skipped[key], exchanged[key]):
                assert torch.equal(a, b), key


@pytest.mark.parametrize("stage", STAGES)
def test_parameter_no_rank_used_is_left_alone_after_a_step_without_the_exchange(
    runs: list[dict[str, Any]], stage: int
) -> None:
    for run in runs:
        extra = run["engine"][(stage, True, False)]["extra_after"]
        # Step 2: used nowhere, unchanged (AdamW's momentum and decay would move it if stepped);
        # step 3: used on rank 0 only, so stepped on every rank.
        assert all(torch.equal(a, b) for a, b in zip(extra[0], extra[1]))
        assert not all(torch.equal(a, b) for a, b in zip(extra[1], extra[2]))
    for a, b in zip(runs[0]["engine"][(stage, True, False)]["params"], runs[1]["engine"][(stage, True, False)]["params"]):
        assert torch.equal(a, b)


def test_trainer_steps_exchange_no_flags_when_every_parameter_got_a_gradient(runs: list[dict[str, Any]]) -> None:
    for run in runs:
        assert run["trainer"]["reduce_scatters"] > 0
        assert run["trainer"]["flag_exchanges"] == 0


@pytest.mark.parametrize("stage", STAGES)
def test_zero_grad_through_lightnings_optimizer_wrapper_resets_the_optimizer(runs: list[dict[str, Any]], stage: int) -> None:
    # Through the wrapper, zero_grad reset the wrapper's copy of the flags: the unused layer moved
    # (weight decay) in the step where no rank used it, and later steps differed.
    for run in runs:
        wrapped, plain = run["wrapped"][stage], run["engine"][(stage, True, False)]
        assert all(torch.equal(a, b) for a, b in zip(wrapped["params"], plain["params"]))
        assert all(torch.equal(a, b) for a, b in zip(wrapped["extra_after"][1], wrapped["extra_after"][0]))
