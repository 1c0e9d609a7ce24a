"""Hugging Face generation at stage 3: every rank runs as many forwards.

[Note: generation at stage 3]
Each forward at stage 3 gathers its units, collectives every rank must join. Hugging Face's
``generate`` ends a rank's loop once its own sequences end (EOS), so ranks with other prompts run
different numbers of forwards and their gathers pair up wrongly: a hang, or an error once the first
rank has moved on. ``synced_gpus=True`` keeps every rank's loop going until all are done (a rank
that finished runs dummy forwards; what it returns is unchanged), and transformers turns it on by
itself only under DeepSpeed ZeRO-3 and FSDP. So, at stage 3 over several ranks, ``generate`` of
every Hugging Face model in the module defaults to ``synced_gpus=True`` (a value the caller gives is
kept) until the strategy tears down.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn


class _SyncedGenerate:
    """A model's bound ``generate`` with ``synced_gpus=True`` unless the caller gives it. Holds the
    bound method, so a deepcopy of the model (weight averaging) calls its own copy's."""

    def __init__(self, original: Callable[..., Any]) -> None:
        self.original = original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("synced_gpus") is None:  # None is transformers' "decide yourself"
            kwargs["synced_gpus"] = True
        return self.original(*args, **kwargs)


def _is_generation_model(module: nn.Module) -> bool:
    # By name, so that transformers is not imported here.
    return any(cls.__name__ == "GenerationMixin" for cls in type(module).__mro__)


def sync_generation(module: nn.Module) -> Callable[[], None]:
    """Makes ``generate`` of every Hugging Face model in ``module`` default to ``synced_gpus=True``
    (see [Note: generation at stage 3]); returns what undoes it."""
    patched = []
    for submodule in module.modules():
        if _is_generation_model(submodule) and "generate" not in submodule.__dict__:
            submodule.__dict__["generate"] = _SyncedGenerate(submodule.generate)
            patched.append(submodule)

    def undo() -> None:
        for submodule in patched:
            if isinstance(submodule.__dict__.get("generate"), _SyncedGenerate):
                del submodule.__dict__["generate"]

    return undo


__all__ = ["sync_generation"]
