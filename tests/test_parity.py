"""ZeRO-1/2 under Lightning equal DDP + torch.optim.AdamW (fp32) after 20 steps, on 2 and 4 gloo ranks."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest

from harness import run_on_ranks
from lightning_zero import ZeroConfig, ZeroStrategy
from models import TinyGPT, fit, max_abs_diff, params_of

TOLERANCE = 1e-5
# (stage, accumulate_grad_batches, reduce_every_micro_step, gradient_clip_val)
CASES_2 = [
    (stage, accumulate, every, clip)
    for stage in (1, 2)
    for accumulate, every in ((1, False), (4, False), (4, True))
    for clip in (None, 0.5)
]
CASES_4 = [(1, 1, False, 0.5), (2, 4, False, 0.5), (2, 4, True, None)]


def _train(strategy: Any, world_size: int, accumulate: int, clip: float | None) -> dict[str, Any]:
    pl.seed_everything(0)
    module = TinyGPT(scheduler=True)
    trainer = fit(module, strategy, world_size, accumulate_grad_batches=accumulate, gradient_clip_val=clip)
    return {
        "losses": module.losses,
        "params": params_of(module),
        "grad_norm": float(trainer.callback_metrics["grad_norm"]) if "grad_norm" in trainer.callback_metrics else None,
    }


def _run_cases(world_size: int, cases: list[tuple[int, int, bool, float | None]]) -> dict[Any, Any]:
    results: dict[Any, Any] = {}
    for accumulate, clip in sorted({(c[1], c[3]) for c in cases}, key=str):
        results[("ddp", accumulate, clip)] = _train("ddp", world_size, accumulate, clip)
    for stage, accumulate, every, clip in cases:
        config = ZeroConfig(stage=stage, reduce_bucket_size=700, reduce_every_micro_step=every)
        results[(stage, accumulate, every, clip)] = _train(ZeroStrategy(config=config), world_size, accumulate, clip)
    return results


_OUTCOMES: dict[int, list[dict[Any, Any]]] = {}


def _outcome(world_size: int) -> list[dict[Any, Any]]:
    """One spawn per world size runs every case of that size; the tests then read its results."""
    if world_size not in _OUTCOMES:
        cases = CASES_2 if world_size == 2 else CASES_4
        _OUTCOMES[world_size] = run_on_ranks(_run_cases, world_size, world_size, cases)
    return _OUTCOMES[world_size]


@pytest.mark.parametrize(
    ("world_size", "case"), [(2, case) for case in CASES_2] + [(4, case) for case in CASES_4], ids=str
)
def test_matches_ddp(world_size: int, case: tuple[int, int, bool, float | None]) -> None:
    per_rank = _outcome(world_size)
    stage, accumulate, _, clip = case
    for results in per_rank:
        zero, ddp = results[case], results[("ddp", accumulate, clip)]
        assert len(zero["losses"]) == len(ddp["losses"]) == 20 * accumulate
        assert max(abs(a - b) for a, b in zip(zero["losses"], ddp["losses"])) <= TOLERANCE
        assert max_abs_diff(zero["params"], ddp["params"]) <= TOLERANCE
        if clip is not None:
            assert zero["grad_norm"] is not None and zero["grad_norm"] > 0.0
    # every rank ends with the same weights
    for results in per_rank[1:]:
        assert max_abs_diff(results[case]["params"], per_rank[0][case]["params"]) == 0.0
