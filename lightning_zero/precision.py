"""The Lightning precision plugin ZeroStrategy uses: clipping over sharded gradients.

Lightning's default plugin clips with ``torch.nn.utils.clip_grad_norm_`` over the optimizer's
parameters. Under ZeRO those are this rank's master shards, so the default would clip by a
local norm and silently differ on every rank. This plugin asks the ZeRO optimizer for the true
global norm instead and logs it as ``grad_norm``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.connectors.logger_connector.fx_validator import _FxValidator
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.zero.optimizer import ZeroOptimizer

SUPPORTED_PRECISION = ("32-true",)


class ZeroPrecision(Precision):
    """fp32 training over ZeRO-sharded gradients (mixed precision is not supported yet)."""

    def __init__(self, precision: str = "32-true") -> None:
        if precision not in SUPPORTED_PRECISION:
            raise ValueError(
                f"ZeroPrecision(precision={precision!r}) is not supported yet: ZeroStrategy trains in"
                f" {', '.join(SUPPORTED_PRECISION)}. Use Trainer(precision='32-true')."
            )
        super().__init__()
        self.precision = precision  # type: ignore[assignment]
        self._module: pl.LightningModule | None = None

    @override
    def connect(self, model: Any, optimizers: list[Any], lr_schedulers: list[Any]) -> tuple[Any, list[Any], list[Any]]:
        # Kept to log metrics (grad_norm) through the module the strategy runs.
        self._module = model if isinstance(model, pl.LightningModule) else None
        return super().connect(model, optimizers, lr_schedulers)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        zero_optimizer = _as_zero_optimizer(optimizer, "gradient_clip_algorithm='norm'")
        norm = zero_optimizer.clip_grad_norm_(float(clip_val))
        self._log_metric("grad_norm", norm)

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        _as_zero_optimizer(optimizer, "gradient_clip_algorithm='value'").clip_grad_value_(float(clip_val))

    def _log_metric(self, name: str, value: Tensor) -> None:
        """Logs through the LightningModule when the current hook allows logging."""
        module = self._module
        hook = module._current_fx_name if module is not None else None
        if module is None or hook is None or _FxValidator.functions.get(hook) is None:
            return
        module.log(name, value.detach().float(), on_step=True, on_epoch=False)


def _as_zero_optimizer(optimizer: Any, what: str) -> ZeroOptimizer:
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # unwrap a LightningOptimizer
    if not isinstance(optimizer, ZeroOptimizer):
        raise TypeError(
            f"{what} under ZeroStrategy needs the optimizer the strategy set up, got {type(optimizer).__name__}."
            " Pass the optimizer from `self.optimizers()` (or let Lightning clip via gradient_clip_val)."
        )
    return optimizer


