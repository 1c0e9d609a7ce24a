"""Memory samples of every rank as a CSV file, PNG plots (matplotlib) and a rich table beside the
estimate."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

from rich.table import Table

from lightning_zero.profiling.estimate import MemoryEstimate
from lightning_zero.profiling.measure import MemorySample

MiB = 2**20
# The categories plotted over steps (stacked), in bytes of each sample.
CATEGORIES = ("params", "params_gathered", "grads", "optimizer_states", "activations")


def write_csv(samples: Sequence[MemorySample], path: Path) -> Path:
    """One row per rank, step and phase; bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [sample.as_row() for sample in samples]
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]) if rows else ["step", "rank", "phase"])
        writer.writeheader()
        writer.writerows(rows)
    return path


def read_csv(path: Path) -> list[MemorySample]:
    """The samples :func:`write_csv` wrote to ``path``; ValueError if it is not such a file."""
    names = [field.name for field in fields(MemorySample)]
    with open(path, newline="") as file:
        reader = csv.DictReader(file)
        if reader.fieldnames != names:
            raise ValueError(f"{str(path)!r} has the columns {reader.fieldnames}, not a memory profile's")
        samples = []
        for line, row in enumerate(reader, start=2):
            try:
                values = {name: (None if row[name] == "" else int(row[name])) for name in names if name != "phase"}
            except ValueError as error:
                raise ValueError(f"{str(path)!r}, line {line}: {error}") from None
            samples.append(MemorySample(phase=row["phase"], **values))
    return samples


def continued(earlier: Sequence[MemorySample], samples: Sequence[MemorySample], first_step: int) -> list[MemorySample]:
    """A resumed run's profile: the earlier run's samples before ``first_step`` (the step the run
    resumed at), then this run's (which replace what the earlier run sampled from there on)."""
    return [sample for sample in earlier if sample.step < first_step] + list(samples)


def _value(sample: MemorySample, category: str) -> float:
    value = getattr(sample, category)
    return (value or 0) / MiB


def _of_step(by_key: dict[tuple[int, int, str], MemorySample], rank: int, step: int, category: str) -> float:
    """What a plot shows of a category at one step: activations as the forward saved them, stage-3
    units gathered at their largest over the phases, the rest after the optimizer step."""
    if category == "activations":
        phases: tuple[str, ...] = ("forward",)
    elif category == "params_gathered":
        phases = ("forward", "backward", "step")
    else:
        phases = ("step",)
    values = [_value(by_key[(rank, step, phase)], category) for phase in phases if (rank, step, phase) in by_key]
    return max(values, default=0.0)


def write_plots(samples: Sequence[MemorySample], directory: Path) -> list[Path]:
    """``memory_over_steps.png``: each rank's memory by category at the end of each sampled step
    (activations from its forward), one panel per rank; ``memory_per_rank.png``: every rank's
    categories at the last sampled step."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    directory.mkdir(parents=True, exist_ok=True)
    ranks = sorted({s.rank for s in samples})
    by_key = {(s.rank, s.step, s.phase): s for s in samples}
    steps = sorted({s.step for s in samples})
    paths = []

    figure, axes = plt.subplots(len(ranks), 1, figsize=(9.5, 2.6 * len(ranks)), squeeze=False, sharex=True)
    for axis, rank in zip(axes[:, 0], ranks):
        series = [[_of_step(by_key, rank, step, category) for step in steps] for category in CATEGORIES]
        axis.stackplot(steps, series, labels=[c.replace("_", " ") for c in CATEGORIES])
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.set_title(f"rank {rank}")
        axis.set_ylabel("MiB")
    axes[-1, 0].set_xlabel("optimizer step")
    axes[0, 0].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    figure.tight_layout()
    paths.append(directory / "memory_over_steps.png")
    figure.savefig(paths[-1], dpi=100)
    plt.close(figure)

    last = steps[-1] if steps else 0
    figure, axis = plt.subplots(figsize=(9.5, 3.5))
    bottom = [0.0] * len(ranks)
    for category in CATEGORIES:
        heights = [_of_step(by_key, rank, last, category) for rank in ranks]
        axis.bar([str(r) for r in ranks], heights, bottom=bottom, label=category.replace("_", " "))
        bottom = [b + h for b, h in zip(bottom, heights)]
    axis.set_xlabel("rank")
    axis.set_ylabel("MiB")
    axis.set_title(f"memory per rank at step {last}")
    axis.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    figure.tight_layout()
    paths.append(directory / "memory_per_rank.png")
    figure.savefig(paths[-1], dpi=100)
    plt.close(figure)
    return paths


def comparison_table(samples: Sequence[MemorySample], estimate: MemoryEstimate | None) -> Table:
    """Each rank's last after-step sample beside the estimate, with the error in percent."""
    table = Table(title="Memory per rank (MiB): estimated vs measured at the last sampled step")
    for column in ("rank", "category", "estimated", "measured", "error %"):
        table.add_column(column, justify="right")
    last: dict[int, MemorySample] = {}
    forward: dict[int, MemorySample] = {}
    for sample in samples:
        if sample.phase == "step":
            last[sample.rank] = sample
        if sample.phase == "forward":
            forward[sample.rank] = sample
    for rank, sample in sorted(last.items()):
        rows: list[tuple[str, int | None, int | None]] = [("parameters", None, sample.params),
                                                          ("gradients", None, sample.grads),
                                                          ("optimizer state", None, sample.optimizer_states),
                                                          ("activations", None, forward[rank].activations
                                                           if rank in forward else None)]
        if estimate is not None:
            both = (estimate.device, estimate.host)
            wanted = [sum(b.params for b in both), sum(b.grads for b in both), sum(b.optimizer_states for b in both),
                      estimate.device.activations]
            rows = [(name, want, got) for (name, _, got), want in zip(rows, wanted)]
        for name, want, got in rows:
            error = f"{100 * (got - want) / want:+.1f}" if want and got is not None else "—"
            table.add_row(str(rank), name, _mib(want), _mib(got), error)
    return table


def _mib(value: int | None) -> str:
    return "—" if value is None else f"{value / MiB:.2f}"


__all__ = ["comparison_table", "write_csv", "write_plots"]
