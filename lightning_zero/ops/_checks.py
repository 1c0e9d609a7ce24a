"""Argument checks shared by the fused Adam entry points (cpu_adam.py, fused_adam.py): each bad
tensor gets a ValueError (or TypeError) naming the function, the argument and what would work."""

from __future__ import annotations

from typing import Any

import torch


def check_tensor(
    where: str,
    name: str,
    tensor: Any,
    dtypes: tuple[torch.dtype, ...],
    numel: int | None,
    device: torch.device | str,
) -> None:
    """``tensor`` is a contiguous Tensor of one of ``dtypes`` with ``numel`` elements (None: any)
    on ``device`` (a ``torch.device``: exactly that one; a string: any device of that type)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a Tensor, got {type(tensor).__name__}")
    if isinstance(device, str):
        if tensor.device.type != device:
            raise ValueError(f"{where}: {name} is on {tensor.device}; it must be a {device.upper()} tensor")
    elif tensor.device != device:
        raise ValueError(f"{where}: {name} is on {tensor.device}, masters[0] on {device}; all must be on one device")
    if tensor.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{where}: {name} is {tensor.dtype}; it must be one of {allowed}")
    if not tensor.is_contiguous():
        raise ValueError(f"{where}: {name} is not contiguous; pass {name}.contiguous()")
    if numel is not None and tensor.numel() != numel:
        raise ValueError(
            f"{where}: {name} has {tensor.numel()} elements, its master has {numel}; all tensors of one step "
            "cover the same shard"
        )
