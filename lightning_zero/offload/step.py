"""The optimizer step of offloaded masters: the one-pass C++ Adam, and the staging copies it writes.

[Note: offloaded step]
Offloaded fp32 masters of torch's Adam/AdamW take the C++ CPU step (``ops.fused_adam_step``),
which applies the unscale x clip factor, updates the master and its moments, and writes the
rounded bf16/fp16 value into a pinned staging buffer, all in one pass over memory. Publishing
the new parameters then copies the staging buffer to the device instead of casting the master
again. With the parameters on the CPU themselves, the staging is this rank's chunk of the flat
parameters, which the all-gather sends as it is. A staging buffer holds the new values only if
the last step wrote every piece of it: a parameter that got no gradient is not stepped, and a
load writes the masters outside any step (:meth:`StagingBuffers.forget`). Every other master
goes through the wrapped torch optimizer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_zero.offload import CPUOffloadPolicy


class StagingBuffers:
    """Per master holder (the tensor the optimizer steps), the low-precision staging view the CPU
    step writes its rounded values into, and which holders the last step wrote."""

    def __init__(self) -> None:
        self._views: dict[Tensor, Tensor] = {}  # keyed by the holder tensor itself (identity)
        self._written: set[Tensor] = set()
        # Uploads of pinned staging to a CUDA device still running (non_blocking): the next step
        # must not write the staging before they read it.
        self._uploads: list[torch.cuda.Event] = []

    def add(self, holder: Tensor, view: Tensor) -> None:
        self._views[holder] = view

    def view_for(self, holder: Tensor) -> Tensor | None:
        return self._views.get(holder)

    def begin_step(self) -> None:
        for upload in self._uploads:
            upload.synchronize()
        self._uploads = []
        self._written = set()

    def uploading(self, device: torch.device) -> None:
        """Copies from the staging to ``device`` were queued without waiting (non_blocking): the
        next :meth:`begin_step` waits for them, before the CPU step overwrites what they read."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        self._uploads.append(event)

    def mark_written(self, holder: Tensor) -> None:
        self._written.add(holder)

    def wrote_all(self, holders: Iterable[Tensor]) -> bool:
        """Whether the last step wrote the staging of every one of ``holders``."""
        return all(holder in self._written for holder in holders)

    def forget(self) -> None:
        """The masters were written outside a step (a load): no staging copy holds them."""
        self._written = set()


def fused_cpu_masters(
    optimizer: Optimizer, policy: CPUOffloadPolicy | None, trained: list[list[Tensor]]
) -> list[tuple[dict[str, Any], Tensor]]:
    """(param group, master) pairs of ``trained`` (per param group) that the C++ CPU Adam steps:
    offloaded fp32 masters of Adam/AdamW without options it does not implement."""
    if policy is None or type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return []
    pairs = []
    for group, masters in zip(optimizer.param_groups, trained):
        if group.get("amsgrad") or group.get("maximize") or group.get("differentiable"):
            continue
        pairs += [(group, m) for m in masters if m.device.type == "cpu" and m.dtype == torch.float32]
    return pairs


def advance_adam_states(optimizer: Optimizer, masters: Sequence[Tensor]) -> list[int]:
    """Creates each master's state as torch's Adam does on its first step (``step`` a CPU float
    tensor, ``exp_avg``, ``exp_avg_sq``), counts one more step for each, and returns the new counts.
    Shared by the fused CPU and device steps, so checkpoints read the same as the optimizer's own.
    One foreach add for all of them: an add per master cost more host time than a bucket of small
    pieces spends in the kernel."""
    states = [optimizer.state[master] for master in masters]
    for state, master in zip(states, masters):
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(master)
            state["exp_avg_sq"] = torch.zeros_like(master)
    counts = [state["step"] for state in states]
    if counts:
        torch._foreach_add_(counts, 1)
    return [int(count.item()) for count in counts]


def adam_hyperparameters(optimizer: Optimizer, group: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of the fused Adam kernels for one param group of torch's Adam/AdamW."""
    beta1, beta2 = group["betas"]
    return {
        "lr": float(group["lr"]), "beta1": float(beta1), "beta2": float(beta2), "eps": float(group["eps"]),
        "weight_decay": float(group["weight_decay"]),
        "adamw_mode": bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))),
    }  # fmt: skip


def cpu_adam_steps(
    optimizer: Optimizer,
    pairs: Sequence[tuple[dict[str, Any], Tensor]],
    coefficient: float,
    staging: StagingBuffers | None,
) -> None:
    """One Adam/AdamW step of every master of ``pairs`` ((param group, master); its ``.grad`` times
    ``coefficient``) in one pass each, keeping its state in ``optimizer.state`` exactly as torch's
    Adam would; writes the staging copies. One unchecked op call per piece, grouped by param group
    and step count: the pieces are the engine's own flat fp32 CPU chunks (``fused_cpu_masters``),
    and the op checks devices, dtypes and sizes itself."""
    from lightning_zero.ops.cpu_adam import fused_adam_steps

    masters = [master for _, master in pairs]
    calls: dict[tuple[int, int], tuple[dict[str, Any], list[Tensor]]] = {}
    for (group, master), step in zip(pairs, advance_adam_states(optimizer, masters)):
        if staging is not None:
            staging.mark_written(master)
        calls.setdefault((id(group), step), (group, []))[1].append(master)
    for (_, step), (group, members) in calls.items():
        states = [optimizer.state[master] for master in members]
        fused_adam_steps(
            members, [master.grad for master in members],  # type: ignore[misc]
            [state["exp_avg"] for state in states], [state["exp_avg_sq"] for state in states],
            [staging.view_for(master) if staging is not None else None for master in members],
            step=step, grad_scale=float(coefficient), **adam_hyperparameters(optimizer, group),
        )  # fmt: skip


__all__ = ["StagingBuffers", "adam_hyperparameters", "advance_adam_states", "cpu_adam_steps", "fused_cpu_masters"]
