"""The Lightning precision plugin of ZeroStrategy: compute dtype, loss scaling, sharded clipping.

[Note: where each dtype lives]
* ``"32-true"``: everything fp32.
* ``"bf16-mixed"`` / ``"16-mixed"``: the model's parameters are held in bf16/fp16 (half the memory
  of fp32 on every rank), forward runs under ``torch.autocast`` so that reductions, norms and
  losses keep fp32 where autocast says so, and the fp32 master weights live only in the sharded
  optimizer. Buffers (e.g. running statistics) stay fp32.
* ``"bf16-true"`` / ``"16-true"``: as Lightning's own: the whole module (buffers too) and floating
  inputs are cast, no autocast; the fp32 master weights still live in the sharded optimizer.

Gradients are accumulated and reduced in ``ZeroConfig.reduce_dtype`` (fp32 by default). fp16
multiplies the loss by a dynamic :class:`~lightning_zero.loss_scaler.LossScaler`; the ZeRO
optimizer unscales in the same pass as clipping and skips steps that overflowed on any rank.

Lightning's default clipping uses ``torch.nn.utils.clip_grad_norm_`` over the optimizer's
parameters: under ZeRO that would be a local norm, silently different on every rank. This plugin
asks the ZeRO optimizer for the true global norm instead and logs it as ``grad_norm``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.fabric.utilities.types import Steppable
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.connectors.logger_connector.fx_validator import _FxValidator
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning_utilities import apply_to_collection
from torch import Tensor
from torch.nn import Module
from torch.nn.modules.batchnorm import _NormBase
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero._messages import some_of
from lightning_zero.loss_scaler import LossScaleConfig, LossScaler
from lightning_zero.zero.optimizer import ShardedOptimizer

COMPUTE_DTYPES = {
    "32-true": torch.float32,
    "bf16-mixed": torch.bfloat16,
    "16-mixed": torch.float16,
    "bf16-true": torch.bfloat16,
    "16-true": torch.float16,
}
SUPPORTED_PRECISION = tuple(COMPUTE_DTYPES)


class ZeroPrecision(Precision):
    """Precision for ZeroStrategy. ``Trainer(precision=...)`` selects it automatically; pass it in
    ``plugins=[ZeroPrecision("16-mixed")]`` for fp16 on the CPU (where Lightning turns the flag
    ``"16-mixed"`` into ``"bf16-mixed"``) or to configure loss scaling.

    Args:
        precision: one of ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``, ``"16-true"``.
        loss_scale: fp16 loss-scaling settings (DeepSpeed's names and defaults); fp16 only.
    """

    def __init__(self, precision: str = "32-true", loss_scale: LossScaleConfig | None = None) -> None:
        if precision not in COMPUTE_DTYPES:
            raise ValueError(
                f"ZeroPrecision(precision={precision!r}) is not supported: use one of"
                f" {', '.join(map(repr, SUPPORTED_PRECISION))}."
            )
        if loss_scale is not None and not precision.startswith("16-"):
            raise ValueError(
                f"ZeroPrecision(loss_scale=...) applies to fp16 only, but precision={precision!r}: bf16 and fp32"
                " have fp32's range and need no loss scaling. Drop loss_scale or use '16-mixed'."
            )
        super().__init__()
        self.precision = precision  # type: ignore[assignment]
        self.compute_dtype = COMPUTE_DTYPES[precision]
        self.loss_scaler = LossScaler(loss_scale) if precision.startswith("16-") else None
        self._module: pl.LightningModule | None = None
        self._device_type = "cpu"

    @property
    def mixed(self) -> bool:
        return self.precision.endswith("-mixed")

    @property
    def param_dtype(self) -> torch.dtype | None:
        """The dtype the model's parameters are held in; ``None`` keeps fp32."""
        return None if self.compute_dtype == torch.float32 else self.compute_dtype

    # ------------------------------------------------------------------ module, inputs, contexts
    @override
    def connect(self, model: Any, optimizers: list[Any], lr_schedulers: list[Any]) -> tuple[Any, list[Any], list[Any]]:
        # Kept to log metrics through the module the strategy runs, and for autocast's device type.
        self._module = model if isinstance(model, pl.LightningModule) else None
        if isinstance(model, Module):
            first = next(model.parameters(), None)
            self._device_type = first.device.type if first is not None else "cpu"
        return super().connect(model, optimizers, lr_schedulers)

    @override
    def convert_module(self, module: Module) -> Module:
        if self.param_dtype is None:
            return module
        # Parameters wider than 32 bits (a float64 scale) keep their dtype and precision: ZeRO gives
        # them a master of their own dtype ([Note: one unit per dtype] in zero/stage3/partition.py).
        wide = {param: param.data for param in module.parameters() if param.is_floating_point() and param.dtype.itemsize > 4}
        if not self.mixed:
            module.to(dtype=self.param_dtype)
            for param, data in wide.items():
                param.data = data
            return module
        for param in module.parameters():
            if param.is_floating_point() and param.dtype != self.param_dtype and param not in wide:
                param.data = param.data.to(self.param_dtype)
        # Autocast leaves batch norm alone, and batch norm wants its running statistics in its
        # weight's dtype: they follow the weights (as in DeepSpeed's bf16/fp16 modes).
        cast_norm_statistics(module, self.param_dtype)
        return module

    @override
    def tensor_init_context(self) -> AbstractContextManager:
        return nullcontext() if self.mixed or self.param_dtype is None else _DtypeContextManager(self.compute_dtype)

    @override
    def module_init_context(self) -> AbstractContextManager:
        return self.tensor_init_context()

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.param_dtype is None:
            yield
        elif self.mixed:
            with torch.autocast(self._device_type, dtype=self.compute_dtype):
                yield
        else:
            with _DtypeContextManager(self.compute_dtype):
                yield

    @override
    def convert_input(self, data: Any) -> Any:
        if self.mixed or self.param_dtype is None:
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=self.compute_dtype)

    # ------------------------------------------------------------------ backward and step
    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        if self.loss_scaler is not None:
            tensor = tensor * self.loss_scaler.scale
        return super().pre_backward(tensor, module)

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Steppable, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        result = super().optimizer_step(optimizer, model, closure, **kwargs)
        if self.loss_scaler is not None:
            self._log_metric("loss_scale", torch.tensor(self.loss_scaler.scale))
            self._log_metric("skipped_steps", torch.tensor(float(self.loss_scaler.skipped_steps)))
        return result

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        zero_optimizer = _as_zero_optimizer(optimizer, "gradient_clip_algorithm='norm'")
        norm = zero_optimizer.clip_grad_norm_(float(clip_val))
        self._log_metric("grad_norm", norm)

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        _as_zero_optimizer(optimizer, "gradient_clip_algorithm='value'").clip_grad_value_(float(clip_val))

    # ------------------------------------------------------------------ checkpoint
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"loss_scaler": self.loss_scaler.state_dict()} if self.loss_scaler is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.loss_scaler is not None and "loss_scaler" in state_dict:
            self.loss_scaler.load_state_dict(state_dict["loss_scaler"])

    def _log_metric(self, name: str, value: Tensor) -> None:
        """Logs through the LightningModule when the current hook allows logging."""
        module = self._module
        hook = module._current_fx_name if module is not None else None
        if module is None or hook is None or _FxValidator.functions.get(hook) is None:
            return
        module.log(name, value.detach().float(), on_step=True, on_epoch=False)


def _as_zero_optimizer(optimizer: Any, what: str) -> ShardedOptimizer:
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # unwrap a LightningOptimizer
    if not isinstance(optimizer, ShardedOptimizer):
        raise TypeError(
            f"{what} under ZeroStrategy needs the optimizer the strategy set up, got {type(optimizer).__name__}."
            " Pass the optimizer from `self.optimizers()` (or let Lightning clip via gradient_clip_val)."
        )
    return optimizer


def cast_norm_statistics(module: Module, dtype: torch.dtype | None) -> None:
    """Casts the running statistics of every affine batch/instance norm in ``module`` to ``dtype``
    (None: to the dtype of the norm's weight, as after handing a module back)."""
    for submodule in module.modules():
        if isinstance(submodule, _NormBase) and submodule.weight is not None:
            for name, buffer in submodule.named_buffers(recurse=False):
                if buffer is not None and buffer.is_floating_point():
                    setattr(submodule, name, buffer.to(dtype if dtype is not None else submodule.weight.dtype))


class FrozenRoundingWarning(UserWarning):
    """fp32 parameters no optimizer trains, held in bf16/fp16 at stages 1/2 (see
    :func:`warn_frozen_rounding`)."""


def warn_frozen_rounding(module: Module | None, stage: int, precision: Any,
                         optimizers: Sequence[ShardedOptimizer], held: Mapping[Tensor, Tensor] | None = None) -> None:
    """Stages 1/2 give fp32 masters to the parameters the ``optimizers`` train only; under a
    -mixed precision any other parameter (frozen, or left out of every optimizer) is held in the
    compute dtype alone, so its fp32 value rounds for good: the module is handed back, and
    checkpoints are written, with the rounded value. Said once, before the cast, naming them (a
    weight already in that dtype loses nothing); after it, from the fp32 values the cast replaced
    (``held``, by parameter)."""
    if stage == 3 or module is None or not isinstance(precision, ZeroPrecision) or not precision.mixed:
        return
    dtype = precision.param_dtype
    if dtype is None:
        return
    mastered = {piece.param for optimizer in optimizers for piece in optimizer.param_pieces()}
    values = {param: held.get(param, param) if held is not None else param for param in module.parameters()}
    rounded = [
        name for name, param in module.named_parameters()
        if param not in mastered and (value := values[param].detach()).dtype == torch.float32 and not value.is_meta
        and not torch.equal(value, value.to(dtype).to(torch.float32))
    ]
    if rounded:
        narrow = str(dtype).replace("torch.", "")
        rank_zero_warn(
            f"{len(rounded)} fp32 parameter(s) that no optimizer trains ({some_of(rounded)}) are held in {narrow} under"
            f" precision={precision.precision!r} at ZeRO stage {stage}, which keeps fp32 masters for what the"
            " optimizers train only: their values round for good, and the module handed back after fit (in that"
            " dtype) and every checkpoint hold the rounded values. To keep them exact, use stage 3 (it keeps an fp32"
            f" master of every parameter its shards would round), load them in {narrow} to begin with (nothing is then lost), give the"
            " trainable ones to an optimizer, or train with precision='32-true'.",
            category=FrozenRoundingWarning,
        )
