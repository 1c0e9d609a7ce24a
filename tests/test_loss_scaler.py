"""The loss-scale state machine (plain Python, no ranks): DeepSpeed's semantics."""

from __future__ import annotations

import pytest

from lightning_zero.loss_scaler import LossScaleAtMinimumError, LossScaleConfig, LossScaler


def _trajectory(scaler: LossScaler, overflows: list[bool]) -> list[float]:
    scales = []
    for overflow in overflows:
        scaler.update(overflow)
        scales.append(scaler.scale)
    return scales


def test_grows_after_a_window_of_clean_steps() -> None:
    scaler = LossScaler(LossScaleConfig(initial_scale_power=4, loss_scale_window=3))
    assert scaler.scale == 16
    assert _trajectory(scaler, [False] * 7) == [16, 16, 32, 32, 32, 64, 64]


def test_hysteresis_delays_the_back_off_and_is_restored_at_growth() -> None:
    scaler = LossScaler(LossScaleConfig(initial_scale_power=4, loss_scale_window=3, hysteresis=2))
    overflows = [False, True, True, False, False, False, True, False]
    assert _trajectory(scaler, overflows) == [16, 16, 8, 8, 8, 16, 16, 16]
    assert scaler.skipped_steps == 3


def test_without_consecutive_hysteresis_spread_out_overflows_still_add_up() -> None:
    config = LossScaleConfig(initial_scale_power=4, loss_scale_window=100, hysteresis=2)
    assert _trajectory(LossScaler(config), [True, False, True]) == [16, 16, 8]
    consecutive = LossScaleConfig(initial_scale_power=4, loss_scale_window=100, hysteresis=2, consecutive_hysteresis=True)
    assert _trajectory(LossScaler(consecutive), [True, False, True, True]) == [16, 16, 16, 8]


def test_minimum_scale_raises_with_an_explanation_or_continues() -> None:
    scaler = LossScaler(LossScaleConfig(initial_scale_power=1, hysteresis=1, min_loss_scale=1))
    assert _trajectory(scaler, [True]) == [1]
    with pytest.raises(LossScaleAtMinimumError, match=r"minimum loss scale 1.*bf16"):
        scaler.update(True)
    patient = LossScaler(LossScaleConfig(initial_scale_power=1, hysteresis=1, on_min_scale="continue"))
    assert _trajectory(patient, [True, True, True]) == [1, 1, 1]
    assert patient.skipped_steps == 3


def test_static_scale_never_changes_but_counts_skips() -> None:
    scaler = LossScaler(LossScaleConfig(loss_scale=128.0, loss_scale_window=1))
    assert _trajectory(scaler, [False, True, False, True]) == [128, 128, 128, 128]
    assert scaler.skipped_steps == 2


def test_state_dict_round_trip() -> None:
    scaler = LossScaler(LossScaleConfig(initial_scale_power=4, loss_scale_window=3))
    _trajectory(scaler, [True, False, True])
    restored = LossScaler(LossScaleConfig(initial_scale_power=4, loss_scale_window=3))
    restored.load_state_dict(scaler.state_dict())
    assert _trajectory(restored, [False] * 4) == _trajectory(scaler, [False] * 4)


def test_a_static_scale_configured_at_resume_is_kept_over_the_saved_one() -> None:
    dynamic = LossScaler(LossScaleConfig(initial_scale_power=10, hysteresis=1))
    _trajectory(dynamic, [True, True, True])  # backed off to 128
    static = LossScaler(LossScaleConfig(loss_scale=1024.0))
    with pytest.warns(UserWarning, match=r"loss scale 128 is not used: this run's scale is static.*loss_scale=1024"):
        static.load_state_dict(dynamic.state_dict())
    assert static.scale == 1024 and static.skipped_steps == 3
    # the other way, a dynamic run continues from the saved scale, static or not
    resumed = LossScaler(LossScaleConfig(initial_scale_power=4))
    resumed.load_state_dict(LossScaler(LossScaleConfig(loss_scale=64.0)).state_dict())
    assert resumed.scale == 64


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"loss_scale_window": -5}, r"loss_scale_window=-5.*positive"),
        ({"loss_scale_window": 0}, r"loss_scale_window=0"),
        ({"hysteresis": 0}, r"hysteresis=0"),
        ({"min_loss_scale": 2.0**20}, r"min_loss_scale=1048576.0 is above the initial scale 2\*\*16"),
        ({"min_loss_scale": -1}, r"min_loss_scale=-1"),
        ({"loss_scale": 0.0}, r"loss_scale=0.0"),
        ({"on_min_scale": "ignore"}, r"on_min_scale='ignore'.*'raise' or 'continue'"),
        ({"initial_scale_power": 100}, r"initial_scale_power=100"),
    ],
)
def test_bad_configuration_is_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LossScaleConfig(**kwargs)
