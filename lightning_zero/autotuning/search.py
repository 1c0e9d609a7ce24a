"""How the autotuner walks its search space (plain Python: a runner does the trials).

[Note: how the autotuner searches]
An exhaustive grid runs every configuration; the default search runs few of them by using what
is known about ZeRO's trade-offs:

1. Layouts (stage x offload) are taken fastest first: stages 1, 2, 3 without offload, then with
   the optimizer offloaded, then stage 3 with the parameters offloaded too. Each saves memory at
   the price of more communication or host traffic, so a later layout can only win by fitting a
   larger micro-batch than the best so far: it is tried at larger micro-batches only.
2. Within a layout the estimator (:func:`~lightning_zero.estimate_memory`, with the activations
   per sample measured by the first trial) skips the micro-batches that cannot fit, even with
   the knobs that need the least memory (smallest buckets, units, prefetch), which a size that
   did not fit with the base knobs is also tried with. The estimate is scaled by the ratio of
   measured peak to estimate that the trials of the stage showed. The largest
   of the rest is tried first (it usually fits: the estimate is close), and if it does not, a
   binary search finds the largest that does. Once the estimate has let a trial run out of
   memory, a later layout first tries one size above the best so far (if that fails too, the
   layout is done in one trial).
3. Early stop: once a layout that fits a larger micro-batch is not faster than the best so far,
   the slower layouts after it are not tried.
4. At the best configuration, each remaining knob (the next smaller micro-batch while it is
   faster; bucket size at stages 1/2; prefetch and unit size at stage 3) is tried one value at a
   time, keeping what is faster. These knob values are measured, not skipped on the estimate:
   the best point sits near the budget, where the estimate's margin would decide.

A configuration fits when its trial ran on every rank without running out of memory and the
largest rank's measured peak is within the budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Literal, Protocol

from lightning_zero.autotuning.space import Candidate, SearchSpace, size_label
from lightning_zero.config import ZeroConfig

Method = Literal["fast", "grid"]


class TuningError(ValueError):
    """The search could not give a configuration (nothing fits, nothing to try); nothing was applied."""


class TrialStatus(str, Enum):
    FITS = "fits"
    OOM = "OOM"  # out of memory on at least one rank
    OVER_BUDGET = "over budget"  # ran, but the measured peak exceeds the budget
    SKIPPED = "skipped"  # the estimate exceeds the budget: not run


@dataclass(frozen=True)
class TrialRecord:
    """What one configuration gave, the same on every rank."""

    candidate: Candidate
    status: TrialStatus
    samples_per_sec: float | None = None  # every rank together
    peak_bytes: int | None = None  # the largest rank's
    estimate_bytes: int | None = None
    message: str = ""
    seconds: float = 0.0

    @property
    def fits(self) -> bool:
        return self.status is TrialStatus.FITS

    @property
    def ran(self) -> bool:
        return self.status is not TrialStatus.SKIPPED


class Runner(Protocol):
    def estimate(self, candidate: Candidate) -> int | None:
        """One rank's estimated bytes (None: unknown)."""

    def run(self, candidate: Candidate) -> TrialRecord:
        """Runs a trial on every rank together; raises on an error that is not out-of-memory."""


@dataclass
class SearchResult:
    best: TrialRecord
    records: list[TrialRecord] = field(default_factory=list)
    budget: int = 0
    method: Method = "fast"

    @property
    def trials(self) -> int:
        """Configurations that ran (skipped by the estimate: not counted)."""
        return sum(record.ran for record in self.records)


class _Search:
    def __init__(self, space: SearchSpace, base: ZeroConfig, numel: int, runner: Runner, budget: int,
                 on_start: Callable[[Candidate], None] | None, on_record: Callable[[TrialRecord], None] | None,
                 backend: str | None = None) -> None:
        self.space, self.base, self.runner, self.budget = space, base, runner, budget
        self.numel, self.backend = numel, backend
        self.buckets = space.bucket_sizes(base, numel, backend)
        self.units = space.unit_numels(base, numel)
        self.records: list[TrialRecord] = []
        self._done: dict[Candidate, TrialRecord] = {}
        self._misses = 0  # trials that did not fit although the estimate let them run
        self._on_start, self._on_record = on_start, on_record

    def point(self, stage: int, offload: str, micro_batch_size: int) -> Candidate:
        """A layout at a micro-batch, with the other knobs at the base configuration's value (or the
        space's nearest to it)."""
        return Candidate(stage, offload, micro_batch_size, _nearest(self.buckets, self.base.bucket_size_for(self.numel, self.backend)),
                         _nearest(self.space.prefetch_units, self.base.prefetch_units),
                         _nearest(self.units, self.base.min_unit_numel))

    def estimate(self, candidate: Candidate) -> int | None:
        """The runner's estimate, scaled by what the trials measured against it: per stage, the
        largest ratio of a measured peak to the estimate (as the runner estimates it now), else
        the largest of any stage; unscaled before any trial."""
        raw = self.runner.estimate(candidate)
        if raw is None:
            return None
        ratios: dict[int, float] = {}
        for record in self.records:
            if record.peak_bytes is None or not record.ran:
                continue
            then = self.runner.estimate(record.candidate)
            if then:
                stage = record.candidate.stage
                ratios[stage] = max(ratios.get(stage, 0.0), record.peak_bytes / then)
        scale = ratios.get(candidate.stage, max(ratios.values(), default=1.0))
        return int(raw * scale)

    def lean(self, candidate: Candidate) -> Candidate:
        """``candidate`` with the knobs that need the least memory."""
        if candidate.stage == 3:
            return replace(candidate, prefetch_units=self.space.prefetch_units[0], min_unit_numel=self.units[0])
        return replace(candidate, reduce_bucket_size=self.buckets[0])

    def fitting_point(self, stage: int, offload: str, micro_batch_size: int) -> Candidate:
        """The layout at a micro-batch with the base configuration's knobs, or, when the estimate
        says that does not fit, with the knobs that need the least memory (the smallest buckets,
        units and prefetch): a smaller bucket may be what lets a larger micro-batch fit."""
        point = self.point(stage, offload, micro_batch_size)
        estimate = self.estimate(point)
        if estimate is None or estimate <= self.budget:
            return point
        return self.lean(point)

    def try_(self, candidate: Candidate, prune: bool = True) -> TrialRecord:
        if candidate in self._done:
            return self._done[candidate]
        estimate = self.estimate(candidate)
        if prune and estimate is not None and estimate > self.budget:
            record = TrialRecord(candidate, TrialStatus.SKIPPED, estimate_bytes=estimate,
                                 message=f"estimated {size_label(estimate)} > budget {size_label(self.budget)}")
        else:
            if self._on_start is not None:
                self._on_start(candidate)
            record = self.runner.run(candidate)
            if record.estimate_bytes is None and estimate is not None:
                record = replace(record, estimate_bytes=estimate)
            if record.fits and record.peak_bytes is not None and record.peak_bytes > self.budget:
                record = replace(record, status=TrialStatus.OVER_BUDGET,
                                 message=f"peak {size_label(record.peak_bytes)} > budget {size_label(self.budget)}")
            if not record.fits:
                self._misses += 1  # the estimate (if any) said it would fit
        self._done[candidate] = record
        self.records.append(record)
        if self._on_record is not None:
            self._on_record(record)
        return record

    # ------------------------------------------------------------------ the default search
    def fast(self) -> TrialRecord | None:
        best: TrialRecord | None = None
        for stage, offload in self.space.layouts():
            floor = best.candidate.micro_batch_size if best is not None else 0
            options = []
            for size in (s for s in self.space.micro_batch_sizes if s > floor):
                candidate = self.fitting_point(stage, offload, size)
                estimate = self.estimate(candidate)
                if estimate is not None and estimate > self.budget:
                    self.try_(candidate)  # recorded as skipped; larger ones need more memory still
                    break
                options.append(candidate)
            if self._misses and best is not None and options:
                # The estimate missed an OOM already: a step up is worth one trial before the largest.
                first = self.try_(options[0])
                found = (self.largest_fitting(options[1:]) or first) if first.fits else None
            else:
                found = self.largest_fitting(options)
            if found is None:
                continue
            if best is not None and _speed(found) <= _speed(best):
                break  # fits more, runs slower: the layouts after it are slower still
            best = found
        return self.refine(best) if best is not None else None

    def largest_fitting(self, options: list[Candidate]) -> TrialRecord | None:
        """The largest micro-batch of ``options`` (ascending) that fits: the largest first; after a
        failure the largest the estimate still allows when the estimate (which the trial taught the
        activations per sample) now foresees that failure, else a binary search below it."""
        low, high, found = 0, len(options) - 1, None
        index = high
        while low <= high:
            record = self.try_leanly(options[index])
            if record.fits:
                found, low = record, index + 1
                index = (low + high + 1) // 2
                continue
            high = index - 1
            if self._foreseen(options[index]):
                while high >= low and self._foreseen(options[high]):
                    high -= 1
                index = high
            else:
                index = (low + high) // 2
        return found

    def try_leanly(self, candidate: Candidate) -> TrialRecord:
        """``candidate``, and if it does not fit, the same with the leanest knobs: a smaller bucket
        or unit may be what fits."""
        record = self.try_(candidate)
        if not record.fits and self.lean(candidate) != candidate:
            record = self.try_(self.lean(candidate))
        return record

    def _foreseen(self, candidate: Candidate) -> bool:
        estimate = self.estimate(candidate)
        return estimate is not None and estimate > self.budget

    def refine(self, best: TrialRecord) -> TrialRecord:
        sizes = self.space.micro_batch_sizes
        # Smaller micro-batches, while each is faster (throughput need not grow with the batch).
        position = sizes.index(best.candidate.micro_batch_size)
        while position > 0:
            position -= 1
            record = self.try_(replace(best.candidate, micro_batch_size=sizes[position]))
            if not (record.fits and _speed(record) > _speed(best)):
                break
            best = record
        knobs: list[tuple[str, tuple[int, ...]]] = (
            [("prefetch_units", self.space.prefetch_units), ("min_unit_numel", self.units)]
            if best.candidate.stage == 3 else [("reduce_bucket_size", self.buckets)]
        )
        for name, values in knobs:
            current = best
            for value in values:
                # Measured, not skipped on the estimate: at the chosen point the estimate is near
                # the budget by construction, where its margin decides and a trial is the answer
                # (a knob's larger buffers may still fit, as a bucket of the whole model did).
                record = self.try_(replace(current.candidate, **{name: value}), prune=False)
                if record.fits and _speed(record) > _speed(best):
                    best = record
        return best

    # ------------------------------------------------------------------ the exhaustive grid
    def grid(self) -> TrialRecord | None:
        best: TrialRecord | None = None
        for stage, offload in self.space.layouts():
            for size in self.space.micro_batch_sizes:
                point = self.point(stage, offload, size)
                variants = (
                    [replace(point, prefetch_units=p, min_unit_numel=u) for p in self.space.prefetch_units
                     for u in self.units] if stage == 3 else
                    [replace(point, reduce_bucket_size=b) for b in self.buckets]
                )
                for candidate in variants:
                    record = self.try_(candidate, prune=False)
                    if record.fits and (best is None or _speed(record) > _speed(best)):
                        best = record
        return best


def search(space: SearchSpace, base: ZeroConfig, numel: int, runner: Runner, budget: int, method: Method = "fast",
           on_start: Callable[[Candidate], None] | None = None,
           on_record: Callable[[TrialRecord], None] | None = None, backend: str | None = None) -> SearchResult:
    """The fastest configuration of ``space`` that fits in ``budget`` bytes per rank (see [Note: how
    the autotuner searches]); ``method="grid"`` tries every configuration; ``backend``: the process
    group's, whose default bucket size the search starts from. Raises :class:`TuningError` when none
    fits."""
    if method not in ("fast", "grid"):
        raise ValueError(f"search(method={method!r}) must be 'fast' or 'grid'.")
    walk = _Search(space, base, numel, runner, budget, on_start, on_record, backend)
    best = walk.fast() if method == "fast" else walk.grid()
    if best is None:
        raise TuningError(_nothing_fits(walk.records, budget))
    return SearchResult(best=best, records=walk.records, budget=budget, method=method)


def _nothing_fits(records: list[TrialRecord], budget: int) -> str:
    ran = [r for r in records if r.ran]
    if not ran:
        smallest = min((r for r in records if r.estimate_bytes is not None), key=lambda r: r.estimate_bytes or 0,
                       default=None)
        detail = f": the smallest estimate is {size_label(smallest.estimate_bytes or 0)} ({smallest.candidate.label})" \
            if smallest is not None else ""
        return (f"the budget of {size_label(budget)} per rank is smaller than every configuration's estimated memory{detail}."
                " Raise the budget, or add smaller micro_batch_sizes, stage 3 or offload to the search space.")
    counts: dict[str, int] = {}
    for record in ran:
        counts[record.status.value] = counts.get(record.status.value, 0) + 1
    summary = ", ".join(f"{n} {status}" for status, n in counts.items())
    last = ran[-1]
    return (f"no configuration fits in {size_label(budget)} per rank: {len(ran)} trial(s) ran ({summary}); the last,"
            f" {last.candidate.label}: {last.message or last.status.value}. Raise the budget, or add smaller"
            " micro_batch_sizes, stage 3 or offload to the search space.")


def _nearest(values: tuple[int, ...], target: int) -> int:
    return min(values, key=lambda value: (abs(value - target), value))


def _speed(record: TrialRecord) -> float:
    return record.samples_per_sec or 0.0


__all__ = ["Method", "Runner", "SearchResult", "TrialRecord", "TrialStatus", "TuningError", "search"]
