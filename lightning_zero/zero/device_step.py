"""The optimizer step of device-resident masters: the fused multi-tensor Adam.

[Note: fused device step]
Masters that stay on the device (not offloaded) of a ``torch.optim.Adam``/``AdamW`` param group
without options the kernels lack (amsgrad, maximize, differentiable) are stepped by
``ops.multi_tensor_adam_step`` (see [Note: backends of the fused Adam op] in
lightning_zero/ops/fused_adam.py), chosen by ``ZeroConfig.fused_adam``: by default the CUDA kernel
for CUDA masters and the one-pass C++ CPU Adam for CPU masters where it builds (torch's default
CPU AdamW makes about ten passes over memory and then a cast-and-copy pass: 8.8 ms against 1.1 ms
for a rank's 1.6M-element shard of the demo GPT on this project's CI machine). In one pass per element
it applies the unscale x clip coefficient (a device tensor when clipping computed it there: no
host sync), updates the master and its moments, and writes the rounded bf16/fp16 value into the
buffer the parameters are published from: at stages 1/2 a device staging chunk per bucket that
the all-gather sends as it is (no cast-and-copy pass), at stage 3 the unit's own parameter
shard. The optimizer state stays torch's (``step`` a CPU float tensor, ``exp_avg``,
``exp_avg_sq``), so checkpoints are the same as with the optimizer's own step. Masters are
grouped into one call per (param group, step count, device); a call launches once per table of
tensors (and per gradient/copy dtype).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_zero.config import ZeroConfig
from lightning_zero.offload.step import StagingBuffers, adam_hyperparameters, advance_adam_states

__all__ = ["adam_group_is_fusable", "device_adam_backend", "device_adam_masters", "device_adam_step"]

_UNSUPPORTED_OPTIONS = ("amsgrad", "maximize", "differentiable")


def adam_group_is_fusable(optimizer: Optimizer, group: dict[str, Any]) -> bool:
    """Whether the fused kernels compute exactly what ``optimizer`` would for ``group``."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False  # a subclass may change step()
    return not any(group.get(option) for option in _UNSUPPORTED_OPTIONS)


def device_adam_backend(config: ZeroConfig, device: torch.device) -> str | None:
    """The backend (or "auto") that steps fusable masters living on ``device``, or None for the
    optimizer's own step."""
    choice = config.fused_adam
    if choice == "off":
        return None
    if choice == "auto":
        if device.type == "cpu":
            # The C++ op or the optimizer's own step: its fallback is no faster than the latter.
            from lightning_zero.ops.cpu_adam import cpu_adam_available

            return "auto" if cpu_adam_available() else None
        return "auto" if device.type == "cuda" else None
    return choice


def check_device_backend(config: ZeroConfig, device: torch.device) -> None:
    """Refuses, at set-up, a forced backend that cannot run on the masters' device."""
    choice = config.fused_adam
    if choice == "cuda" and device.type != "cuda":
        raise ValueError(
            f"ZeroConfig.fused_adam='cuda' needs the masters on a CUDA device, but they are on {device}. Use"
            " fused_adam='auto' (the CUDA kernel where it applies) or 'cpu' for the C++ CPU kernel."
        )
    if choice in ("cpu", "host") and device.type != "cpu":
        raise ValueError(
            f"ZeroConfig.fused_adam={choice!r} runs on CPU masters, but they are on {device}. Use fused_adam='auto'."
        )
    if choice in ("cuda", "triton", "host"):
        # Built (or found wanting) now, at set-up, not in the first step: a rank whose step
        # raised would leave the others waiting in the all-gather after it.
        from lightning_zero.ops.fused_adam import backend_unavailable_reason

        reason = backend_unavailable_reason(choice, device)
        if reason is not None:
            raise ValueError(
                f"ZeroConfig.fused_adam={choice!r} cannot step masters on {device}: {reason}. Use fused_adam='auto'"
                " (the best kernel that runs here) or 'off'."
            )


def device_adam_masters(
    optimizer: Optimizer, config: ZeroConfig, trained: list[list[Tensor]], exclude: set[Tensor]
) -> list[tuple[dict[str, Any], list[Tensor]]]:
    """Per param group of ``trained``, the masters the fused kernel steps: fp32 masters not in
    ``exclude`` (the offloaded ones the CPU step takes) of fusable groups; groups without any
    are left out."""
    fused = []
    backends: dict[torch.device, str | None] = {}  # one lookup per device, not per master and step
    for group, masters in zip(optimizer.param_groups, trained):
        if not adam_group_is_fusable(optimizer, group):
            continue
        mine = []
        for master in masters:
            if master in exclude or master.dtype != torch.float32:
                continue
            if master.device not in backends:
                backends[master.device] = device_adam_backend(config, master.device)
            if backends[master.device] is not None:
                mine.append(master)
        if mine:
            fused.append((group, mine))
    return fused


def device_adam_step(
    optimizer: Optimizer,
    fused: list[tuple[dict[str, Any], list[Tensor]]],
    coefficient: Tensor | float,
    staging: StagingBuffers | None,
    config: ZeroConfig,
) -> None:
    """One Adam/AdamW step of every master in ``fused`` (per param group; its ``.grad`` times
    ``coefficient``), keeping its state in ``optimizer.state`` as torch's Adam would; writes the
    staging copies."""
    from lightning_zero.ops.fused_adam import multi_tensor_adam_step

    for group, masters in fused:
        # One call per step count and device: the bias correction is per call.
        calls: dict[tuple[int, torch.device], list[Tensor]] = {}
        for master, step in zip(masters, advance_adam_states(optimizer, masters)):
            if staging is not None:
                staging.mark_written(master)
            calls.setdefault((step, master.device), []).append(master)
        for (step, device), members in calls.items():
            factor = coefficient
            if isinstance(coefficient, Tensor):
                factor = coefficient.detach().to(device=device, dtype=torch.float32).reshape(1)
            backend = device_adam_backend(config, device)
            assert backend is not None  # device_adam_masters only takes masters that have one
            multi_tensor_adam_step(
                members, [m.grad for m in members],  # type: ignore[misc]
                [optimizer.state[m]["exp_avg"] for m in members], [optimizer.state[m]["exp_avg_sq"] for m in members],
                step=step, grad_scale=factor,
                low_precision_outs=[staging.view_for(m) if staging is not None else None for m in members],
                backend=backend, **adam_hyperparameters(optimizer, group),
            )  # fmt: skip
