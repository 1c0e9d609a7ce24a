"""How many bytes of model state one rank holds: parameters, gradients, optimizer state.

Counts distinct storages, so views into one flat buffer are counted once, and padding counts
because it is really allocated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.zero.optimizer import ShardedOptimizer


@dataclass(frozen=True)
class ModelStateBytes:
    """One rank's model-state memory, in bytes.

    ``optimizer_states`` includes ZeRO's fp32 master shard, because it exists only for the optimizer.
    """

    params: int
    grads: int
    optimizer_states: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer_states


class _StorageCounter:
    def __init__(self, where: Callable[[Tensor], bool] | None = None) -> None:
        self._seen: set[tuple[torch.device, int]] = set()
        self._where = where
        self.bytes = 0

    def add(self, tensors: Iterable[Tensor | None]) -> None:
        for tensor in tensors:
            if tensor is None or not isinstance(tensor, Tensor) or tensor.device.type == "meta":
                continue
            if self._where is not None and not self._where(tensor):
                continue
            storage = tensor.untyped_storage()
            key = (tensor.device, storage.data_ptr())
            if storage.nbytes() == 0 or key in self._seen:
                continue
            self._seen.add(key)
            self.bytes += storage.nbytes()


def model_state_bytes(module: nn.Module, optimizers: Sequence[Optimizer],
                      where: Callable[[Tensor], bool] | None = None) -> ModelStateBytes:
    """This rank's bytes of parameters, gradients and optimizer state (ZeRO-aware); with
    ``where``, only the tensors it accepts (e.g. those on one device)."""
    params = _StorageCounter(where)
    params.add(module.parameters())
    grads = _StorageCounter(where)
    grads.add(p.grad for p in module.parameters())
    states = _StorageCounter(where)
    for optimizer in optimizers:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps the real one
        if isinstance(optimizer, ShardedOptimizer):
            param_tensors, grad_tensors, master_tensors = optimizer.memory_tensors()
            params.add(param_tensors)
            grads.add(grad_tensors)
            states.add(master_tensors)
        states.add(value for state in optimizer.state.values() for value in state.values() if isinstance(value, Tensor))
    return ModelStateBytes(params=params.bytes, grads=grads.bytes, optimizer_states=states.bytes)
