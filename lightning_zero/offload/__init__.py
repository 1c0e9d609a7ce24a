"""Offload policies: where the fp32 master weights, optimizer state and (stage 3) parameter shards live.

Policies are types, not booleans (as FSDP2's ``CPUOffloadPolicy``): a ``ZeroConfig`` field holds
either ``None`` (everything on the training device) or a :class:`CPUOffloadPolicy`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class CPUOffloadPolicy:
    """Keep state in CPU memory.

    Attributes:
        pin_memory: allocate the CPU tensors that cross to and from the device in page-locked
            memory, so copies are asynchronous DMA. Ignored where no accelerator exists (there is
            nothing to pin for).
        ratio: the fraction of each rank's optimizer (by elements, bucket by bucket) that lives on
            the CPU; the rest stays on the device, trading device memory for CPU work. Applies to
            optimizer offload; parameter offload moves every shard.
    """

    pin_memory: bool = True
    ratio: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not 0.0 < self.ratio <= 1.0:
            raise ValueError(
                f"CPUOffloadPolicy.ratio={self.ratio!r} must be in (0, 1]: the fraction of the optimizer kept on the"
                " CPU (use no offload policy at all for 0)."
            )
        if not isinstance(self.pin_memory, bool):
            raise ValueError(f"CPUOffloadPolicy.pin_memory={self.pin_memory!r} must be True or False.")


CPU = torch.device("cpu")


def can_pin() -> bool:
    """Pinning needs an accelerator runtime; a CPU-only build raises if asked to pin."""
    return torch.cuda.is_available()


def cpu_empty(numel: int, dtype: torch.dtype, pin: bool) -> Tensor:
    return torch.empty(numel, dtype=dtype, device=CPU, pin_memory=pin and can_pin())


class MasterPlacement:
    """Decides, bucket by bucket (or unit by unit), where master shards live under a policy."""

    def __init__(self, policy: CPUOffloadPolicy | None, device: torch.device, total_numel: int) -> None:
        self.policy = policy
        self.device = device
        self._cpu_budget = int(round(policy.ratio * total_numel)) if policy is not None else 0
        self._cpu_used = 0

    def place(self, numel: int) -> torch.device:
        """CPU while the policy's share is not used up; the training device after."""
        if self.policy is None or (self._cpu_used >= self._cpu_budget and self.policy.ratio < 1.0):
            return self.device
        self._cpu_used += numel
        return CPU

    def zeros(self, numel: int, device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
        if device.type == "cpu" and self.policy is not None:
            tensor = cpu_empty(numel, dtype, self.policy.pin_memory)
            return tensor.zero_()
        return torch.zeros(numel, dtype=dtype, device=device)


__all__ = ["CPU", "CPUOffloadPolicy", "MasterPlacement", "can_pin", "cpu_empty"]
