"""lightning_zero.grad_norm: Lightning's per-parameter gradient norms, read in
on_before_optimizer_step from the reduced shards, equal to what Lightning's own grad_norm gives
under DDP (whose parameters hold whole gradients), at every stage, with offload and an fp16 loss
scale, on 2 gloo ranks. Lightning's grad_norm itself returns nothing under ZeRO (``.grad`` is None)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm

from harness import run_on_ranks
from lightning_zero import CPUOffloadPolicy, LossScaleConfig, ZeroConfig, ZeroPrecision, ZeroStrategy, grad_norm
from models import TinyGPT, fit

WORLD = 2
STEPS = 3


class NormLogger(TinyGPT):
    """Records, at every step, the norms a user would log there."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict[str, dict[str, float]]] = []

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.seen.append({
            "two": {k: float(v) for k, v in grad_norm(self, norm_type=2).items()},
            "inf": {k: float(v) for k, v in grad_norm(self, "inf", group_separator=".").items()},
            "lightning": {k: float(v) for k, v in lightning_grad_norm(self, 2).items()},
        })


def _cases(_: Any) -> dict[str, Any]:
    cases = {
        "ddp": lambda: "ddp",
        "zero1": lambda: ZeroStrategy(stage=1),
        "zero2": lambda: ZeroStrategy(stage=2),
        "zero3": lambda: ZeroStrategy(config=ZeroConfig(stage=3, min_unit_numel=1)),
        "zero2_offload": lambda: ZeroStrategy(config=ZeroConfig(stage=2, offload_optimizer=CPUOffloadPolicy())),
    }
    out: dict[str, Any] = {}
    for name, make in cases.items():
        torch.manual_seed(0)
        module = NormLogger()
        fit(module, make(), WORLD, steps=STEPS)
        out[name] = module.seen
    # fp16 with a loss scale of 2**10: the norms are of the unscaled gradients, as under DDP's GradScaler.
    torch.manual_seed(0)
    module = NormLogger()
    scaled = ZeroPrecision("16-true", loss_scale=LossScaleConfig(loss_scale=1024.0))
    unscaled = ZeroPrecision("16-true", loss_scale=LossScaleConfig(loss_scale=1.0))
    fit(module, ZeroStrategy(stage=2), WORLD, steps=STEPS, plugins=[scaled])
    out["fp16_scaled"] = module.seen
    torch.manual_seed(0)
    module = NormLogger()
    fit(module, ZeroStrategy(stage=2), WORLD, steps=STEPS, plugins=[unscaled])
    out["fp16_unscaled"] = module.seen
    return out


@pytest.fixture(scope="module")
def seen() -> dict[str, Any]:
    return run_on_ranks(_cases, WORLD, None)[0]


def _close(a: dict[str, float], b: dict[str, float], tolerance: float) -> bool:
    return a.keys() == b.keys() and all(abs(a[k] - b[k]) <= tolerance * max(1.0, abs(b[k])) for k in a)


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3", "zero2_offload"])
def test_grad_norm_equals_lightnings_under_ddp(seen: dict[str, Any], stage: str) -> None:
    reference, ours = seen["ddp"], seen[stage]
    assert len(ours) == len(reference) == STEPS
    for step in range(STEPS):
        expected = reference[step]["lightning"]
        assert len(expected) == 1 + sum(1 for _ in TinyGPT().parameters())  # every parameter and the total
        assert _close(ours[step]["two"], expected, 1e-4), (step, ours[step]["two"], expected)
        assert reference[step]["two"] == expected  # under DDP ours is Lightning's
        assert ours[step]["inf"].keys() == {k.replace("grad_2.0_norm", "grad_inf_norm").replace("/", ".")
                                            for k in expected}
        assert _close(ours[step]["inf"], reference[step]["inf"], 1e-4)


def test_lightnings_own_grad_norm_sees_nothing_under_zero(seen: dict[str, Any]) -> None:
    assert all(step["lightning"] == {} for step in seen["zero2"])


def test_grad_norm_is_of_the_unscaled_gradient(seen: dict[str, Any]) -> None:
    for scaled, unscaled in zip(seen["fp16_scaled"], seen["fp16_unscaled"]):
        assert _close(scaled["two"], unscaled["two"], 1e-3)


def test_bad_norm_type_is_refused() -> None:
    with pytest.raises(ValueError, match=r"grad_norm\(norm_type=-1.0\) must be a positive number or 'inf'"):
        ZeroStrategy().grad_norm(-1)
    assert grad_norm(torch.nn.Linear(2, 2), 2) == {}  # no Trainer, no gradient: Lightning's own
