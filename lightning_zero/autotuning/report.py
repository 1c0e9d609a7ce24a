"""The autotuner's results: a table, and the best configuration as LightningCLI YAML."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml
from rich.table import Table

from lightning_zero._messages import unwritable_directory
from lightning_zero.autotuning.search import SearchResult, TrialStatus
from lightning_zero.autotuning.space import count_label
from lightning_zero.config import ZeroConfig

STRATEGY_CLASS = "lightning_zero.ZeroStrategy"
TUNER_CLASS = "lightning_zero.ZeroAutotuner"


def results_table(result: SearchResult, title: str | None = None) -> Table:
    """Every trial that ran (configuration, samples/s, peak memory, estimate, status); the best
    marked. Configurations the estimate skipped are counted in the caption."""
    table = Table(title=title or f"lightning_zero autotuner ({result.method}): {result.trials} trial(s)")
    for column in ("#", "stage", "offload", "micro-batch", "knobs", "samples/s", "peak MiB", "estimate MiB", "result"):
        table.add_column(column, justify="left" if column in ("offload", "knobs", "result") else "right")
    index = 0
    for record in result.records:
        if not record.ran:
            continue
        index += 1
        c = record.candidate
        knobs = f"prefetch {c.prefetch_units}, unit {count_label(c.min_unit_numel)}" if c.stage == 3 \
            else f"bucket {count_label(c.reduce_bucket_size)}"
        status = "best" if record is result.best else record.status.value
        if record.status is TrialStatus.OOM and record.message.startswith("rank "):
            status = f"OOM ({record.message.split(':', 1)[0]})"  # the whole message stays in the record
        table.add_row(
            str(index), str(c.stage), c.offload, str(c.micro_batch_size), knobs,
            f"{record.samples_per_sec:.1f}" if record.samples_per_sec is not None else "-",
            _mib(record.peak_bytes), _mib(record.estimate_bytes), status,
            style="bold green" if record is result.best else None,
        )
    skipped = sum(not record.ran for record in result.records)
    if skipped:
        table.caption = f"{skipped} configuration(s) skipped: their estimate exceeds the budget of {_mib(result.budget)} MiB"
    return table


def zero_config_fields(config: ZeroConfig) -> dict[str, Any]:
    """The fields of ``config`` a YAML file needs: the tuned ones, and every other that is not
    the default (nested configs as mappings)."""
    default = ZeroConfig()
    always = {"stage", "reduce_bucket_size", "offload_optimizer", "offload_params"}
    if config.stage == 3:
        always |= {"prefetch_units", "min_unit_numel"}
    out: dict[str, Any] = {}
    for field in dataclasses.fields(ZeroConfig):
        value = getattr(config, field.name)
        if field.name in always or value != getattr(default, field.name):
            out[field.name] = _plain(value)
    return out


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: _plain(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def tuned_yaml(result: SearchResult, config: ZeroConfig, batch_section: str, batch_arg_name: str,
               base: dict[str, Any] | None) -> dict[str, Any]:
    """The run's LightningCLI config (``base``, as its SaveConfigCallback holds it) with the best
    strategy and micro-batch size, and without the autotuner; without ``base``, just those keys."""
    tuned: dict[str, Any] = dict(base) if base is not None else {}
    trainer = dict(tuned.get("trainer") or {})
    trainer["strategy"] = _strategy_entry(trainer.get("strategy"), config)
    callbacks = trainer.get("callbacks")
    if isinstance(callbacks, list):
        trainer["callbacks"] = [c for c in callbacks if not (isinstance(c, dict) and c.get("class_path") in (
            TUNER_CLASS, "lightning_zero.callbacks.ZeroAutotuner", "lightning_zero.callbacks.autotuner.ZeroAutotuner"))]
    tuned["trainer"] = trainer
    section = dict(tuned.get(batch_section) or {})
    if "class_path" in section:
        section["init_args"] = {**(section.get("init_args") or {}), batch_arg_name: result.best.candidate.micro_batch_size}
    else:
        section[batch_arg_name] = result.best.candidate.micro_batch_size
    tuned[batch_section] = section
    return tuned


def _strategy_entry(previous: Any, config: ZeroConfig) -> dict[str, Any]:
    init_args: dict[str, Any] = {}
    if isinstance(previous, dict) and str(previous.get("class_path", "")).endswith("ZeroStrategy"):
        # The user's own arguments; the Nones a config dump adds for the defaults are left out.
        init_args = {k: v for k, v in (previous.get("init_args") or {}).items()
                     if k not in ("stage", "config") and v is not None}
    elif isinstance(previous, str) and previous.endswith("_spawn"):
        init_args["start_method"] = "spawn"
    # The stage is the config's: null clears a stage an earlier --config file gives the strategy.
    init_args["stage"] = None
    init_args["config"] = zero_config_fields(config)
    return {"class_path": STRATEGY_CLASS, "init_args": init_args}


# A tuned YAML starts with this: an earlier tuning's output may be replaced, any other file is the user's.
TUNED_MARK = "Tuned by lightning_zero's ZeroAutotuner"


def output_refusal(path: str | Path, overwrite: bool, flag: str = "overwrite=True") -> str | None:
    """Why the tuned YAML may not be written to ``path`` (None: it may): an existing file that an
    earlier tuning did not write (the run's own ``--config``, say) is kept unless ``overwrite``."""
    path = Path(path)
    if path.is_dir():
        return f"the output {str(path)!r} is a directory: give a file path for the tuned YAML."
    if not path.exists():
        problem = unwritable_directory(path.parent)
        return None if problem is None else f"the output {str(path)!r} cannot be written: {problem}."
    if overwrite:
        return None
    try:
        with path.open(encoding="utf-8", errors="replace") as file:
            first = file.readline()
    except OSError as error:
        return f"the output {str(path)!r} exists and cannot be read ({error})."
    if first.startswith(f"# {TUNED_MARK}"):
        return None
    return (f"the output {str(path)!r} exists and is not an earlier tuning's output: it is kept. Give another path,"
            f" or pass {flag} to replace it.")


def write_yaml(path: str | Path, content: dict[str, Any], header: str) -> Path:
    """Writes ``header`` as comments, then ``content``; through a temporary file beside it, so that
    a failed write leaves what was there."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    staging = path.with_name(f".{path.name}.tmp")
    try:
        staging.write_text(comment + yaml.safe_dump(content, sort_keys=False, default_flow_style=False))
        staging.replace(path)
    finally:
        staging.unlink(missing_ok=True)
    return path


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


__all__ = ["TUNED_MARK", "output_refusal", "results_table", "tuned_yaml", "write_yaml", "zero_config_fields"]
