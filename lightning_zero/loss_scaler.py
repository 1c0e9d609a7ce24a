"""Loss scaling for fp16 training: DeepSpeed's dynamic scaler semantics, in plain PyTorch.

[Note: loss-scale state machine]
The loss is multiplied by ``scale`` before backward so small fp16 gradients do not flush to zero.
After each optimizer step attempt the scaler is told whether any rank's gradient held an inf or a
nan (decided globally by the ZeRO optimizer with one small all-reduce):

* overflow: the step is skipped. With hysteresis left (``hysteresis`` > 1), the first overflows
  only use it up; once it is spent the scale halves, never below ``min_loss_scale``. An overflow
  already at the minimum scale either raises :class:`LossScaleAtMinimumError` or keeps going,
  as ``on_min_scale`` says.
* no overflow: after ``loss_scale_window`` clean steps since the last overflow the scale doubles
  and the hysteresis is restored. With ``consecutive_hysteresis`` the hysteresis is restored after
  every clean step, so only *consecutive* overflows reduce the scale.

A static ``loss_scale`` never changes; overflowing steps are still skipped.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass
from typing import Any, Literal

MinScaleAction = Literal["raise", "continue"]


class LossScaleAtMinimumError(RuntimeError):
    """fp16 gradients overflow even at the minimum loss scale."""


@dataclass(frozen=True)
class LossScaleConfig:
    """How fp16 losses are scaled (DeepSpeed's names and defaults).

    Attributes:
        initial_scale_power: the dynamic scale starts at 2 ** initial_scale_power.
        loss_scale_window: clean steps since the last overflow before the scale doubles.
        hysteresis: overflows tolerated before the scale is halved.
        consecutive_hysteresis: restore the hysteresis after every clean step, so only
            consecutive overflows lower the scale.
        min_loss_scale: the scale never goes below this.
        loss_scale: a static scale; ``None`` (the default) scales dynamically.
        on_min_scale: what an overflow at the minimum scale does: ``"raise"`` stops training with an
            explanation, ``"continue"`` skips the step and goes on.
    """

    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    loss_scale: float | None = None
    on_min_scale: MinScaleAction = "raise"

    def __post_init__(self) -> None:
        _require(isinstance(self.initial_scale_power, int) and not isinstance(self.initial_scale_power, bool)
                 and 0 <= self.initial_scale_power <= 64,
                 "initial_scale_power", self.initial_scale_power, "an integer from 0 to 64, e.g. 16")
        _require(isinstance(self.loss_scale_window, int) and self.loss_scale_window > 0,
                 "loss_scale_window", self.loss_scale_window, "a positive number of steps, e.g. 1000")
        _require(isinstance(self.hysteresis, int) and self.hysteresis >= 1,
                 "hysteresis", self.hysteresis, "an integer >= 1, e.g. 2")
        _require(isinstance(self.min_loss_scale, (int, float)) and self.min_loss_scale > 0,
                 "min_loss_scale", self.min_loss_scale, "a positive number, e.g. 1")
        if self.loss_scale is not None:
            _require(isinstance(self.loss_scale, (int, float)) and self.loss_scale > 0,
                     "loss_scale", self.loss_scale, "a positive number, or None for dynamic scaling")
        elif self.min_loss_scale > 2.0**self.initial_scale_power:
            raise ValueError(
                f"LossScaleConfig.min_loss_scale={self.min_loss_scale!r} is above the initial scale"
                f" 2**{self.initial_scale_power}={2.0 ** self.initial_scale_power:g}; lower min_loss_scale or"
                " raise initial_scale_power."
            )
        _require(self.on_min_scale in ("raise", "continue"),
                 "on_min_scale", self.on_min_scale, "'raise' or 'continue'")

    @property
    def dynamic(self) -> bool:
        return self.loss_scale is None


def _require(ok: bool, name: str, value: Any, expected: str) -> None:
    if not ok:
        raise ValueError(f"LossScaleConfig.{name}={value!r} is invalid: expected {expected}.")


class LossScaler:
    """The scale to multiply the loss by, and its update after each step attempt."""

    def __init__(self, config: LossScaleConfig | None = None) -> None:
        self.config = config or LossScaleConfig()
        self.scale = float(self.config.loss_scale if not self.config.dynamic else 2.0**self.config.initial_scale_power)
        self.hysteresis_left = self.config.hysteresis
        self.iteration = 0
        self.last_overflow_iteration = -1
        self.skipped_steps = 0

    def update(self, overflow: bool) -> None:
        """Moves the state machine after one optimizer step attempt (see the module note)."""
        config = self.config
        if overflow:
            self.skipped_steps += 1
            self.last_overflow_iteration = self.iteration
            if config.dynamic:
                self._back_off()
        elif config.dynamic:
            if config.consecutive_hysteresis:
                self.hysteresis_left = config.hysteresis
            if (self.iteration - self.last_overflow_iteration) % config.loss_scale_window == 0:
                self.hysteresis_left = config.hysteresis
                self.scale *= 2.0
        self.iteration += 1

    def _back_off(self) -> None:
        config = self.config
        if self.hysteresis_left > 1:
            self.hysteresis_left -= 1
            return
        if self.scale <= config.min_loss_scale:
            if config.on_min_scale == "raise":
                raise LossScaleAtMinimumError(
                    f"fp16 gradients overflowed (inf or nan) at the minimum loss scale {self.scale:g} after"
                    f" {self.skipped_steps} skipped steps. Likely causes: a learning rate that is too high, a"
                    " diverging loss, inputs or weights that already hold inf/nan, or activations beyond fp16's"
                    " range (65504). Train with precision='bf16-mixed' (fp32's range), lower the learning rate,"
                    " clip gradients, or set LossScaleConfig(on_min_scale='continue') to keep skipping steps."
                )
            return
        self.scale = max(self.scale / 2.0, config.min_loss_scale)

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "hysteresis_left": self.hysteresis_left,
            "iteration": self.iteration,
            "last_overflow_iteration": self.last_overflow_iteration,
            "skipped_steps": self.skipped_steps,
            "config": asdict(self.config),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the scaler's state; a static scale configured now (``loss_scale``) is kept over
        the saved one: it is what this run asked for, and a static scale never moves again."""
        saved = float(state["scale"])
        if self.config.dynamic:
            self.scale = saved
        elif saved != self.scale:
            warnings.warn(
                f"The checkpoint's loss scale {saved:g} is not used: this run's scale is static"
                f" (LossScaleConfig(loss_scale={self.scale:g})). Set loss_scale=None to continue scaling dynamically"
                " from the saved scale.", stacklevel=2)
        self.hysteresis_left = int(state["hysteresis_left"])
        self.iteration = int(state["iteration"])
        self.last_overflow_iteration = int(state["last_overflow_iteration"])
        self.skipped_steps = int(state["skipped_steps"])
