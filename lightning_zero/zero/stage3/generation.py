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

The model's ``generate`` becomes a method bound to it (still a bound method, with the original's
name and signature, as Fabric's ``mark_forward_method`` expects), which reads a switch the strategy
turns off at teardown. A deepcopy of the model (a weight average) shares the switch, so its
``generate`` stops syncing then too (its copy has whole parameters, and a synced loop on one rank
would wait for the others); a pickled copy's switch is off.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

from torch import nn

_SWITCH = "_lightning_zero_synced_generation"


class _Switch:
    """Whether generate syncs the ranks now; one per strategy setup, shared by deep copies."""

    def __init__(self, on: bool = True) -> None:
        self.on = on

    def __deepcopy__(self, memo: dict[int, Any]) -> _Switch:
        return self

    def __reduce__(self) -> tuple[type, tuple[bool]]:
        return _Switch, (False,)


def _is_generation_model(module: nn.Module) -> bool:
    # By name, so that transformers is not imported here.
    return any(cls.__name__ == "GenerationMixin" for cls in type(module).__mro__)


def _synced(generate: Callable[..., Any]) -> Callable[..., Any]:
    """The class's ``generate`` with ``synced_gpus=True`` unless given, while the model's switch is on."""

    @functools.wraps(generate)
    def synced_generate(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        switch = self.__dict__.get(_SWITCH)
        if switch is not None and switch.on and kwargs.get("synced_gpus") is None:  # None: transformers decides
            kwargs["synced_gpus"] = True
        return generate(self, *args, **kwargs)

    return synced_generate


def sync_generation(module: nn.Module) -> Callable[[], None]:
    """Makes ``generate`` of every Hugging Face model in ``module`` default to ``synced_gpus=True``
    (see [Note: generation at stage 3]); returns what undoes it."""
    switch = _Switch()
    patched: list[nn.Module] = []
    for submodule in module.modules():
        if _is_generation_model(submodule) and "generate" not in submodule.__dict__:
            submodule.__dict__["generate"] = types.MethodType(_synced(type(submodule).generate), submodule)
            submodule.__dict__[_SWITCH] = switch
            patched.append(submodule)

    def undo() -> None:
        switch.on = False
        for submodule in patched:
            if submodule.__dict__.get(_SWITCH) is switch:
                del submodule.__dict__[_SWITCH]
                submodule.__dict__.pop("generate", None)

    return undo


__all__ = ["sync_generation"]
