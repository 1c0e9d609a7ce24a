"""What the autotuner may change, and one point of that space (plain Python, no Lightning)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any

from lightning_zero.config import ZeroConfig
from lightning_zero.offload import CPUOffloadPolicy

# Offload choices, from none to the most memory moved to the host (as `lightning-zero estimate --offload`).
OFFLOADS = ("none", "optimizer", "params")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | float | str, name: str = "budget") -> int:
    """Bytes from a number or a string such as ``"8GiB"``, ``"512 MB"`` or ``"1.5e9"``."""
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is not a number of bytes: give e.g. 8589934592 or '8GiB'.")
    if isinstance(value, (int, float)):
        number = float(value)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(f"{name}={value!r} is not a number of bytes: give e.g. 8589934592, '8GiB' or '512MB'.")
        number = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"{name}={value!r} must be a positive number of bytes, e.g. '8GiB'.")
    return int(number)


def _sizes(name: str, values: Any, least: int, allow_none: bool = False) -> tuple[int, ...] | None:
    if values is None and allow_none:
        return None
    if isinstance(values, int) and not isinstance(values, bool):
        values = (values,)
    if not isinstance(values, (tuple, list)) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= least for v in values
    ):
        raise ValueError(f"SearchSpace.{name}={values!r} must be a list of integers >= {least}.")
    if not values:
        raise ValueError(f"SearchSpace.{name} is empty: give at least one value (or leave it out for the default).")
    return tuple(sorted(set(values)))


@dataclass(frozen=True)
class SearchSpace:
    """The configurations the autotuner may try (see [Note: how the autotuner searches]).

    Attributes:
        micro_batch_sizes: samples per rank per forward (the module's or datamodule's ``batch_size``).
        stages: ZeRO stages (1, 2, 3).
        offload: ``"none"``, ``"optimizer"`` (optimizer state and fp32 masters on the host) and
            ``"params"`` (stage 3: the parameter shards too). Offload is only tried when it lets a
            larger micro-batch fit than every faster choice.
        reduce_bucket_sizes: stages 1/2: elements per gradient bucket. ``None``: the base
            configuration's value and 1/4 and 1/16 of the model's parameters.
        prefetch_units: stage 3: units gathered ahead.
        min_unit_numels: stage 3: elements per gathered unit. ``None``: the base configuration's
            value and 1/8 of the model's parameters.
    """

    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    stages: tuple[int, ...] = (1, 2, 3)
    offload: tuple[str, ...] = OFFLOADS
    reduce_bucket_sizes: tuple[int, ...] | None = None
    prefetch_units: tuple[int, ...] = (1, 2)
    min_unit_numels: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "micro_batch_sizes", _sizes("micro_batch_sizes", self.micro_batch_sizes, 1))
        stages = _sizes("stages", self.stages, 1)
        assert stages is not None
        if any(stage not in (1, 2, 3) for stage in stages):
            raise ValueError(f"SearchSpace.stages={list(self.stages)} may only hold 1, 2 and 3.")
        object.__setattr__(self, "stages", stages)
        offload = (self.offload,) if isinstance(self.offload, str) else self.offload
        if not isinstance(offload, (tuple, list)) or not offload or any(o not in OFFLOADS for o in offload):
            raise ValueError(f"SearchSpace.offload={self.offload!r} must be a non-empty list of {list(OFFLOADS)}.")
        object.__setattr__(self, "offload", tuple(o for o in OFFLOADS if o in offload))
        object.__setattr__(self, "reduce_bucket_sizes", _sizes("reduce_bucket_sizes", self.reduce_bucket_sizes, 1, True))
        object.__setattr__(self, "prefetch_units", _sizes("prefetch_units", self.prefetch_units, 0))
        object.__setattr__(self, "min_unit_numels", _sizes("min_unit_numels", self.min_unit_numels, 1, True))
        if not self.layouts():
            raise ValueError(
                f"SearchSpace(stages={list(self.stages)}, offload={list(self.offload)}) holds no configuration:"
                " parameter offload ('params') needs stage 3. Add stage 3, or offload 'none' or 'optimizer'."
            )

    def layouts(self) -> list[tuple[int, str]]:
        """(stage, offload) pairs, fastest first: every stage without offload, then with the optimizer
        offloaded, then stage 3 with the parameters offloaded too."""
        return [(stage, offload) for offload in self.offload for stage in self.stages
                if offload != "params" or stage == 3]

    def bucket_sizes(self, base: ZeroConfig, numel: int, backend: str | None = None) -> tuple[int, ...]:
        """The bucket sizes to try: the given ones, else the base's default for ``numel`` on
        ``backend`` (the process group's, see ZeroConfig.bucket_size_for) and fractions of the model."""
        if self.reduce_bucket_sizes is not None:
            return self.reduce_bucket_sizes
        return _derived(base.bucket_size_for(numel, backend), numel, (4, 16))

    def unit_numels(self, base: ZeroConfig, numel: int) -> tuple[int, ...]:
        if self.min_unit_numels is not None:
            return self.min_unit_numels
        return _derived(base.min_unit_numel, numel, (8,))


def count_label(value: int) -> str:
    """1234567 -> '1.23M'."""
    for unit, size in (("G", 10**9), ("M", 10**6), ("K", 10**3)):
        if value >= size:
            return f"{value / size:.3g}{unit}"
    return str(value)


def size_label(value: int) -> str:
    """Bytes as MiB, GiB from one GiB up, KiB below a tenth of a MiB (where MiB would round to 0.0)."""
    if value >= 2**30:
        return f"{value / 2**30:.2f} GiB"
    if value >= 2**20 // 10:
        return f"{value / 2**20:.1f} MiB"
    return f"{value / 2**10:.1f} KiB"


def _derived(base: int, numel: int, fractions: tuple[int, ...]) -> tuple[int, ...]:
    """``base`` and fractions of the model's ``numel``: sizes that change the number of collectives."""
    values = {base} | {max(65_536, math.ceil(numel / part)) for part in fractions if numel > part * 65_536}
    return tuple(sorted(values))


@dataclass(frozen=True)
class Candidate:
    """One configuration a trial runs."""

    stage: int
    offload: str
    micro_batch_size: int
    reduce_bucket_size: int
    prefetch_units: int
    min_unit_numel: int

    def zero_config(self, base: ZeroConfig) -> ZeroConfig:
        """``base`` with this candidate's choices; its other fields (reduce_dtype, ...) are kept."""
        policy = base.offload_optimizer or base.offload_params or CPUOffloadPolicy()
        stage3 = self.stage == 3
        return replace(
            base, stage=self.stage, reduce_bucket_size=self.reduce_bucket_size,
            offload_optimizer=policy if self.offload != "none" else None,
            offload_params=policy if self.offload == "params" else None,
            prefetch_units=self.prefetch_units if stage3 else base.prefetch_units,
            prefetch_bytes=None if stage3 else base.prefetch_bytes,
            min_unit_numel=self.min_unit_numel if stage3 else base.min_unit_numel,
            unit_modules=base.unit_modules if stage3 else (),
            param_persistence_threshold=base.param_persistence_threshold if stage3 else 0,
        )

    @property
    def label(self) -> str:
        text = f"stage {self.stage}, offload {self.offload}, micro-batch {self.micro_batch_size}"
        if self.stage == 3:
            return f"{text}, prefetch {self.prefetch_units}, unit {count_label(self.min_unit_numel)}"
        return f"{text}, bucket {count_label(self.reduce_bucket_size)}"


__all__ = ["Candidate", "OFFLOADS", "SearchSpace", "count_label", "parse_bytes", "size_label"]
