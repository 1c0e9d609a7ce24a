"""Randomized differential test against DDP (issue #10): seeded random module trees x ZeRO stages
1-3 x offload x gradient accumulation x world sizes 1-4, each trained with ``ZeroStrategy`` under
a Trainer and compared with DistributedDataParallel(find_unused_parameters=True) and the same
torch optimizer. Final parameters must agree within 1e-5 (fp32; cases with a bf16 parameter use
the looser bounds stated in ``random_models``), and every rank must end with the same weights.

One group of ranks per world size trains all of that size's cases (a failing or hanging case
restarts the group for the cases after it, so it costs only itself). A failure prints the case,
the error and the one-line command that reruns just that seed. The long run is
``python benchmarks/soak_differential.py --cases 500 --seed 0``.

Cost: 23 default cases + 2 mixed-dtype cases + 10 cases that each force one feature the drawn
cases leave out (the bugs (a)-(g) this test was written to catch, all fixed), under a minute on 2
idle cores (most of it starting the groups of 3 and 4 ranks); each case trains in about a second.
"""

from __future__ import annotations

from typing import Any

import pytest

import random_models as rm
from random_models import Case, Features, Outcome, make_case, run_cases

CASES_PER_WORLD = {1: 6, 2: 8, 3: 5, 4: 4}
CASE_TIMEOUT_S = 30.0  # one case trains in about a second; a hang fails after this long
HANG_TIMEOUT_S = 8.0  # for the cases known to hang (2 ranks, under a second each), so that they cost little

# The default suite: what works on main, so it is green there.
DEFAULT = [make_case(1000 * world + index, world_size=world)
           for world, count in CASES_PER_WORLD.items() for index in range(count)]


def _first(seeds: range, features: Features, world: int, accept: Any, count: int) -> list[Case]:
    """The first ``count`` cases of ``seeds`` that ``accept`` takes: picks stay right when draws change."""
    cases = (make_case(seed, features, world_size=world) for seed in seeds)
    return [case for case, _ in zip((case for case in cases if accept(case)), range(count))]


_MIXED = Features.with_enabled([rm.MIXED_DTYPES])
# Several parameter dtypes (a float64 scale, a bf16 gain beside fp32) work at stages 1/2 without
# offload on main: compared with DDP under the bf16 bounds of random_models.
MIXED_WORKING = [*_first(range(6000, 6100), _MIXED, 1, lambda c: c.stage < 3 and c.offload == "none" and c.bf16_gain, 1),
                 *_first(range(6100, 6200), _MIXED, 2, lambda c: c.stage < 3 and c.offload == "none", 1)]

_A = "(a) a trainable parameter without a gradient on any rank in a step (torch.optim skips it)"
_B = "(b) several parameter dtypes (float64 and bf16 beside fp32), at stage 3 and with offload_optimizer"
_D = ("(d) a parameter used on some ranks only at stages 1/2 with reduce_every_micro_step=True and accumulation"
      " (hung: the reductions went out of step with the other collectives)")
_G = ("(g) the same at 4 ranks with a layer used on some micro-steps only (gloo aborted: a bucket still reducing"
      " from the previous micro-step was not reduced again on the ranks without its gradient)")
_E = ("(e) a parameter used on some ranks only at stage 3 beside other units (hung: the rank that used it reduced"
      " its unit before a backward all-gather, the others after)")
_F = ("(f) at stage 3 a frozen module before a trainable one in the same unit (crashed: the unit was freed once its"
      " trainable gradients were in, though backward still needed the frozen weight)")

# Cases that each force one feature (see random_models.FEATURE_CASES), regressions of the bugs
# (a)-(f); the reasons say what each one exercises. The last case of a group is one of them, so
# a failure costs no restart of the group.
FEATURE_CASES: list[tuple[Case, str, float]] = [
    *[(make_case(seed, Features.with_enabled([rm.NO_GRAD_ANYWHERE]), world_size=world), _A, CASE_TIMEOUT_S)
      for seed, world in ((5001, 1), (5002, 1), (5003, 2))],
    # stage 3, and stages 1/2 with offload_optimizer (the fused CPU Adam and float64)
    *[(case, _B, CASE_TIMEOUT_S) for case in _first(range(6200, 6300), _MIXED, 1, lambda c: c.stage == 3, 1)
      + _first(range(6300, 6400), _MIXED, 1, lambda c: c.stage < 3 and c.offload != "none" and c.optimizer == "adamw", 1)],
    *[(case, _D, HANG_TIMEOUT_S) for case in _first(range(7000, 7010), Features.with_enabled(
        [rm.RANK_USE_EVERY_MICRO_STEP]), 2, lambda c: c.stage < 3, 1)],
    # found by the soak: seed 12 (4 ranks, a block used on some micro-steps and one used on rank 1)
    (make_case(12, Features.with_enabled([rm.RANK_USE_EVERY_MICRO_STEP]), world_size=4), _G, CASE_TIMEOUT_S),
    *[(case, _E, HANG_TIMEOUT_S) for case in _first(range(7010, 7100), Features.with_enabled([rm.RANK_USE_WITH_UNITS]),
                                                      2, lambda c: c.stage == 3, 1)],
    *[(case, _F, CASE_TIMEOUT_S) for case in _first(range(7100, 7200), Features.with_enabled([rm.FROZEN_IN_UNIT]),
                                                      1, lambda c: c.stage == 3, 1)],
]
RANK_STRUCTURE_CASE = make_case(8000, Features.with_enabled([rm.RANK_STRUCTURE]), world_size=2)

_OUTCOMES: dict[tuple[int, int, tuple[str, ...]], Outcome] = {}


def _key(case: Case) -> tuple[int, int, tuple[str, ...]]:
    return (case.seed, case.world_size, tuple(case.features.enabled()))


def _outcome(case: Case) -> Outcome:
    """Runs every case of the case's world size on first use (one group per size and timeout)."""
    if _key(case) not in _OUTCOMES:
        for timeout in (CASE_TIMEOUT_S, HANG_TIMEOUT_S):
            # Working cases first: a known-broken one may restart the group.
            group = [c for c in DEFAULT + MIXED_WORKING if c.world_size == case.world_size and timeout == CASE_TIMEOUT_S]
            group += [c for c, _, t in FEATURE_CASES if c.world_size == case.world_size and t == timeout]
            if case.world_size == RANK_STRUCTURE_CASE.world_size and timeout == HANG_TIMEOUT_S:
                group.append(RANK_STRUCTURE_CASE)
            group = [c for c in group if _key(c) not in _OUTCOMES]
            if group:
                for outcome in run_cases(group, case.world_size, case_timeout_s=timeout):
                    _OUTCOMES[_key(outcome.case)] = outcome
    return _OUTCOMES[_key(case)]


def _id(case: Case) -> str:
    enabled = "-".join(case.features.enabled())
    return f"w{case.world_size}-s{case.seed}-z{case.stage}{'-' + enabled if enabled else ''}"


PARAMS: list[Any] = [pytest.param(case, id=_id(case)) for case in DEFAULT + MIXED_WORKING] + [
    pytest.param(case, id=_id(case)) for case, _, _ in FEATURE_CASES
]


@pytest.mark.parametrize("case", PARAMS)
def test_matches_ddp(case: Case) -> None:
    outcome = _outcome(case)
    assert outcome.ok, outcome.report()
    assert case.has_bf16 or outcome.max_diff <= rm.FP32_TOLERANCE


def test_rank_dependent_structure_is_a_clear_error() -> None:
    """(c) used to crash gloo (SIGABRT, 'Received data size doesn't match expected size')."""
    outcome = _outcome(RANK_STRUCTURE_CASE)
    assert not outcome.ok and outcome.kind == "error", outcome.report()
    message = rm.first_line_of_error(outcome)
    # A clear error comes from lightning_zero and says that the ranks' models differ, not gloo's
    # "collective mismatch" or a dead peer's connection reset.
    assert "gloo" not in message and "exited with code" not in message, outcome.report()
    assert "RanksDisagreeError" in message and "ZeRO needs the same model on every rank" in message, outcome.report()


def test_generator_is_a_pure_function_of_the_seed() -> None:
    for case in DEFAULT[:6]:
        assert make_case(case.seed, case.features, case.world_size) == case
    # the world size is drawn even when given, so a soak seed reruns with --world unchanged
    free = make_case(123)
    assert make_case(123, world_size=free.world_size) == free
    assert rm.rerun_command(free).endswith(f"--seed 123 --cases 1 --world {free.world_size}")


def test_default_suite_covers_the_axes() -> None:
    """The default cases exercise every working feature and setting (guards the generator's draws)."""
    features = {name for case in DEFAULT for name in rm.case_features(case)}
    assert {"tied", "frozen", "buffer", "gain", "gated", "rank_only", "nested"} <= features
    assert {case.stage for case in DEFAULT} == {1, 2, 3}
    assert {case.world_size for case in DEFAULT} == {1, 2, 3, 4}
    assert {case.accumulate for case in DEFAULT} == {1, 2}
    assert {case.optimizer for case in DEFAULT} == {"adamw", "sgd"}
    assert {case.offload for case in DEFAULT} == {"none", "preset", "policy"}
    assert any(case.unit_modules for case in DEFAULT if case.stage == 3)
    assert any(case.persistence_threshold for case in DEFAULT if case.stage == 3)
    assert not any(case.features.enabled() for case in DEFAULT)
    assert [rm.case_features(case) for case, _, _ in FEATURE_CASES[:3]] and all(
        case.dead for case, _, _ in FEATURE_CASES[:3])
