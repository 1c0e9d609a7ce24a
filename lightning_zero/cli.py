"""The ``lightning-zero`` console command."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from lightning_zero.autotuning.report import output_refusal
from lightning_zero.autotuning.space import OFFLOADS, SearchSpace, parse_bytes
from lightning_zero.checkpoint.checksums import CheckpointError, reason
from lightning_zero.checkpoint.consolidate import DTYPES, consolidate
from lightning_zero.checkpoint.hf import DEFAULT_MAX_SHARD_SIZE, consolidate_hf, exported_files
from lightning_zero.config import ZeroConfig


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-zero", description="Tools for lightning_zero checkpoints, memory and tuning.")
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser(
        "consolidate",
        help="write a sharded checkpoint as one file (.pt or .safetensors) or as a Hugging Face model directory,"
             " streamed shard by shard",
        description="Writes a sharded checkpoint directory as one file, reading and writing one tensor at a time"
        " (memory stays about the largest tensor). OUT ending in .safetensors gets the weights only; any other"
        " name a Lightning checkpoint that torch.load, LightningModule.load_from_checkpoint and"
        " trainer.fit(ckpt_path=...) read. With --format hf, OUT is a Hugging Face model directory instead:"
        " model-00001-of-0000n.safetensors files and model.safetensors.index.json (or one model.safetensors),"
        " which transformers' from_pretrained(OUT) loads once OUT has a config.json (--hf-config, or"
        " model.config.save_pretrained(OUT)); memory stays about one shard. Needs no GPU.",
    )
    export.add_argument("checkpoint", help="the sharded checkpoint directory")
    export.add_argument("output", help="the file to write (.pt, .ckpt or .safetensors), or with --format hf the directory")
    export.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                        help="dtype of every floating-point tensor of the module's state (float64 tensors and optimizer state"
                             " are kept as saved)")
    export.add_argument("--weights-only", action="store_true", help="leave out optimizer state, schedulers and loops")
    export.add_argument("--no-progress", action="store_true", help="no progress bar")
    export.add_argument("--format", choices=["file", "hf"], default="file",
                        help="file: one file, its format chosen by OUT's suffix (default); hf: a Hugging Face model"
                             " directory (weights only)")
    hf = export.add_argument_group("--format hf")
    hf.add_argument("--max-shard-size", help=f"the largest shard, e.g. 500MB, 2GiB or a number of bytes (default"
                                             f" {DEFAULT_MAX_SHARD_SIZE}; GB = 10^9 bytes, GiB = 2^30)")
    hf.add_argument("--strip-prefix", metavar="PREFIX",
                    help="remove this key prefix, e.g. model. for a LightningModule holding the Hugging Face model as"
                         " self.model (keys outside it are left out); '' keeps the keys as saved. Default: for a"
                         " checkpoint a Trainer wrote, the attribute every key is under, if there is one")
    hf.add_argument("--hf-config", metavar="PATH_OR_DIR", help="a config.json, or a directory holding one, to copy into OUT")
    export.add_argument("--overwrite", action="store_true",
                        help="replace an existing OUT file; with --format hf, write into a non-empty OUT: its"
                             " model*.safetensors files are replaced, other files kept")
    estimate = commands.add_parser(
        "estimate",
        help="print one rank's memory per ZeRO stage and world size, as a table",
        description="Estimates one rank's memory (parameters, gradients, optimizer state, communication buffers)"
        " on the training device and the host, for each world size and stage (see lightning_zero.estimate_memory)."
        " Activations are not estimated here: estimate_memory(model, ..., sample_batch=...) measures them.",
    )
    estimate.add_argument("model", help="a trainable parameter count (e.g. 7e9 or 125000000), module.path:factory"
                                        " naming a callable that returns the nn.Module (built on the meta device),"
                                        " or a Hugging Face model's config: a config.json, a directory holding one,"
                                        " or hf:NAME (e.g. hf:gpt2, read from the Hub)")
    estimate.add_argument("--model-kwargs", default="{}", help="JSON keyword arguments for the factory, e.g."
                                                                 " '{\"vocab_size\": 50304}'")
    estimate.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4, 8], help="data-parallel ranks")
    estimate.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3], choices=[1, 2, 3])
    estimate.add_argument("--precision", default="bf16-mixed", help="a Trainer precision flag")
    estimate.add_argument("--offload", choices=["none", "optimizer", "params"], default="none",
                          help="optimizer: offload_optimizer; params: also offload_params (stage 3 only)")
    estimate.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="where training runs")
    estimate.add_argument("--reduce-bucket-size", type=int, default=None,
                          help="elements per gradient bucket (default: sized from the model, see ZeroConfig)")
    estimate.add_argument("--reduce-dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    estimate.add_argument("--prefetch-units", type=int, default=ZeroConfig.prefetch_units)
    estimate.add_argument("--min-unit-numel", type=int, default=ZeroConfig.min_unit_numel)
    estimate.add_argument("--optimizer-moments", type=int, default=2, help="fp32 state per element (Adam: 2)")
    tune = commands.add_parser(
        "tune",
        help="run a LightningCLI script's fit with ZeroAutotuner: the fastest ZeRO configuration that fits,"
             " written as YAML",
        description="Runs SCRIPT (a LightningCLI script; its ranks start as its own `fit` would start them) with"
        " lightning_zero.ZeroAutotuner added to its callbacks: short trials of ZeRO stages, offload, micro-batch"
        " and bucket sizes inside the one launch, then the fastest configuration that fits in the budget is written"
        " as that run's whole config (train it with `SCRIPT fit --config OUTPUT`). Any argument after SCRIPT goes to"
        " it, e.g. `lightning-zero tune --budget 8GiB train.py --config run.yaml`.",
    )
    tune.add_argument("--budget", help="bytes per rank, e.g. 8GiB (default: the device's memory; on CPU the host's,"
                                       " shared by its ranks)")
    tune.add_argument("--output", default="zero_tuned.yaml",
                      help="where the tuned config is written (an existing file only if an earlier tuning wrote it)")
    tune.add_argument("--overwrite", action="store_true", help="replace an existing --output file whoever wrote it")
    tune.add_argument("--method", choices=["fast", "grid"], default="fast", help="grid: try every configuration")
    # Comma-separated, not nargs="+": a list option would swallow SCRIPT after it.
    tune.add_argument("--micro-batch-sizes", type=_integers, help="micro-batch sizes to consider, e.g. 8,16,32")
    tune.add_argument("--stages", type=_integers, help="ZeRO stages to consider, e.g. 2,3")
    tune.add_argument("--offload", type=_names, help=f"offload choices to consider, of {','.join(OFFLOADS)}")
    tune.add_argument("--warmup-steps", type=int, default=2, help="steps each trial runs before measuring")
    tune.add_argument("--measure-steps", type=int, default=3, help="steps each trial measures")
    tune.add_argument("--apply", action="store_true", help="train on with the best configuration in the same run")
    tune.add_argument("script", help="the LightningCLI script (e.g. examples/gpt/train.py)")
    tune.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments (its `fit` subcommand's)")
    return parser


def _integers(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 8,16,32") from None


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _tune(args: argparse.Namespace) -> int:
    """Runs the script in this process, as `python SCRIPT fit ...` with the autotuner's arguments
    appended, so that Lightning's launcher starts the other ranks with the same command line."""
    import os
    import runpy
    from pathlib import Path

    script = Path(args.script)
    if not script.is_file():
        raise ValueError(f"SCRIPT={args.script!r} is not a file: give the LightningCLI script to tune, e.g."
                         " examples/gpt/train.py.")
    if args.budget is not None:
        parse_bytes(args.budget, "--budget")
    for name in ("warmup_steps", "measure_steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1.")
    # An option given empty (`--stages ,`) reaches SearchSpace, which refuses it: not the defaults in its place.
    chosen = {name: values for name, values in (("micro_batch_sizes", args.micro_batch_sizes), ("stages", args.stages),
                                                 ("offload", args.offload)) if values is not None}
    SearchSpace(**chosen)  # an empty space is a message now, not a traceback on every rank later
    refusal = output_refusal(args.output, args.overwrite, flag="--overwrite")
    if refusal is not None:
        raise ValueError(f"--output: {refusal}")
    rest = list(args.script_args)
    if not rest or rest[0].startswith("-"):
        rest = ["fit", *rest]
    if rest[0] != "fit":
        raise ValueError(f"lightning-zero tune runs the script's `fit`, not {rest[0]!r}: drop it, or write `fit`.")
    prefix = "--trainer.callbacks"
    extra = [f"{prefix}+=lightning_zero.ZeroAutotuner", f"{prefix}.exit_on_error=true",
             f"{prefix}.output={args.output}", f"{prefix}.method={args.method}", f"{prefix}.apply={str(args.apply).lower()}",
             f"{prefix}.warmup_steps={args.warmup_steps}", f"{prefix}.measure_steps={args.measure_steps}",
             f"{prefix}.overwrite={str(args.overwrite).lower()}"]
    if args.budget is not None:
        extra.append(f"{prefix}.budget={args.budget}")
    for name, values in chosen.items():
        extra.append(f"{prefix}.space.{name}=[{','.join(map(str, values))}]")
    sys.argv = [str(script), *rest, *extra]
    sys.path.insert(0, str(script.resolve().parent))
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exit:
        return exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
    return 0


def _load_model(spec: str, kwargs: str) -> Any:
    """A parameter count, the module a ``module.path:factory`` builds, or a Hugging Face model from
    its config (a config.json, a directory holding one, or ``hf:NAME`` on the Hub), on the meta device."""
    if spec.endswith(".json") and not Path(spec).is_file():
        raise ValueError(f"MODEL={spec!r}: no such file (a Hugging Face config.json, or a directory holding one).")
    if spec.startswith("hf:") or spec.endswith(".json") or Path(spec).is_dir():
        return _build_hugging_face(spec.removeprefix("hf:"))
    if ":" in spec:
        return _build(spec, kwargs)
    try:
        count = float(spec)
        if not count.is_integer():
            raise ValueError
        return int(count)
    except (ValueError, OverflowError):
        raise ValueError(f"MODEL={spec!r} is neither a whole parameter count (e.g. 7e9) nor module.path:factory.") \
            from None


def _build_hugging_face(source: str) -> Any:
    """The Hugging Face model of ``source``'s config (a path or a Hub name), with its causal-LM head
    where it has one, built on the meta device: its sizes, no weights read or allocated."""
    import torch

    try:
        import transformers
    except ImportError:
        raise ValueError(f"MODEL={source!r} is a Hugging Face config, which needs transformers: pip install"
                         " transformers") from None
    try:
        config = transformers.AutoConfig.from_pretrained(source)
    except Exception as error:  # noqa: BLE001 - a missing file, an unknown model type, no network: a message
        raise ValueError(f"cannot read a Hugging Face config from {source!r}: {type(error).__name__}: {error}") \
            from error
    with torch.device("meta"):
        for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
            try:
                return auto.from_config(config)
            except ValueError:  # this architecture has no class under that auto class
                continue
    raise ValueError(f"transformers builds no model for the config of {source!r} (model_type={config.model_type!r})")


def _build(spec: str, kwargs: str) -> Any:
    import importlib
    import json
    import os

    import torch

    try:
        options = json.loads(kwargs)
    except json.JSONDecodeError as error:
        raise ValueError(f"--model-kwargs {kwargs!r} is not JSON: {error}") from error
    if not isinstance(options, dict):
        raise ValueError(f"--model-kwargs {kwargs!r} must be a JSON object of keyword arguments")
    path, _, name = spec.partition(":")
    if os.getcwd() not in sys.path:  # the console script does not put the working directory there
        sys.path.insert(0, os.getcwd())
    try:
        factory = getattr(importlib.import_module(path), name)
    except Exception as error:  # noqa: BLE001 - any import failure is the user's module: a message, no traceback
        raise ValueError(f"cannot import {name!r} from {path!r}: {type(error).__name__}: {error}") from error
    with torch.device("meta"):  # sizes only: nothing is allocated
        try:
            model = factory(**options)
        except Exception as error:  # noqa: BLE001 - as above
            raise ValueError(f"{spec}(**{options}) failed on the meta device: {type(error).__name__}: {error}"
                             " (pass its arguments with --model-kwargs)") from error
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"{spec} returned a {type(model).__name__}, not an nn.Module")
    return model


def _estimate(args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    from lightning_zero.offload import CPUOffloadPolicy
    from lightning_zero.profiling import estimate_memory

    model = _load_model(args.model, args.model_kwargs)
    offload = CPUOffloadPolicy() if args.offload != "none" else None
    notes: set[str] = set()
    rows: list[tuple[int, int, list[int]]] = []
    for world_size in args.world_sizes:
        for stage in args.stages:
            config = ZeroConfig(
                stage=stage, reduce_bucket_size=args.reduce_bucket_size, reduce_dtype=args.reduce_dtype,
                prefetch_units=args.prefetch_units, min_unit_numel=args.min_unit_numel,
                offload_optimizer=offload, offload_params=offload if args.offload == "params" and stage == 3 else None,
            )
            estimate = estimate_memory(model, world_size, config, args.precision,
                                       optimizer_moments=args.optimizer_moments, device_type=args.device)
            notes.update(estimate.notes)
            device, host = estimate.device, estimate.host
            rows.append((world_size, stage, [device.params + host.params, device.grads + host.grads,
                                             device.optimizer_states + host.optimizer_states,
                                             device.comm_buffers + host.comm_buffers, device.total, host.total]))
    scale, unit = (2**30, "GiB") if max(max(values) for *_, values in rows) >= 2**30 else (2**20, "MiB")
    table = Table(title=f"One rank's memory, {args.precision}, offload {args.offload}, on {args.device} ({unit})")
    for column in ("ranks", "stage", "params", "grads", "optimizer", "comm buffers", "device total", "host total"):
        table.add_column(column, justify="right")
    for world_size, stage, values in rows:
        table.add_row(str(world_size), str(stage), *(f"{value / scale:.2f}" for value in values))
    console = Console()
    parameters = model if isinstance(model, int) else sum(p.numel() for p in model.parameters() if p.requires_grad)
    console.print(f"{parameters:,} trainable parameters")
    console.print(table)
    if args.offload == "params":
        notes.add("parameter offload applies to stage 3 only; stages 1/2 offload the optimizer")
    for note in sorted(notes):
        console.print(f"note: {note}")


def _consolidate(args: argparse.Namespace) -> Path:
    """`consolidate`: one file, or with --format hf a Hugging Face model directory."""
    hf_options = {"--max-shard-size": args.max_shard_size, "--strip-prefix": args.strip_prefix,
                  "--hf-config": args.hf_config}
    if args.format != "hf":
        given = [name for name, value in hf_options.items() if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} only apply to --format hf; add --format hf to write a Hugging Face"
                             " model directory.")
        return consolidate(args.checkpoint, args.output, dtype=args.dtype, weights_only=args.weights_only,
                           progress=not args.no_progress, overwrite=args.overwrite)
    if Path(args.output).suffix in (".pt", ".ckpt", ".safetensors"):
        raise ValueError(f"--format hf writes a directory, but OUT={args.output!r} names a file; pass a directory"
                         " (e.g. the model's name), or drop --format hf for one file.")
    # Parsed here so that an error names the flag the user typed, not the function's argument.
    shard_size = parse_bytes(args.max_shard_size or DEFAULT_MAX_SHARD_SIZE, "--max-shard-size")
    return consolidate_hf(args.checkpoint, args.output, dtype=args.dtype, max_shard_size=shard_size,
                          strip_prefix=args.strip_prefix, hf_config=args.hf_config, overwrite=args.overwrite,
                          progress=not args.no_progress)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "tune":
        try:
            return _tune(args)
        except ValueError as error:
            print(f"lightning-zero tune: error: {error}", file=sys.stderr)
            return 2
    if args.command == "estimate":
        try:
            _estimate(args)
        except ValueError as error:
            print(f"lightning-zero estimate: error: {error}", file=sys.stderr)
            return 2
        return 0
    if args.command == "consolidate":
        warnings.filterwarnings("ignore", module="torch.distributed.checkpoint")
        try:
            path = _consolidate(args)
        except (CheckpointError, ValueError, OSError) as error:
            print(f"lightning-zero consolidate: error: {error}", file=sys.stderr)
            return 2
        except CheckpointException as error:  # DCP's wrapper of an error not translated above: no traceback either
            inner = ", ".join(reason(exc) for exc, _ in error.failures.values())
            print(f"lightning-zero consolidate: error: {args.checkpoint} cannot be read ({inner}).", file=sys.stderr)
            return 2
        if path.is_dir():
            files = exported_files(path)
            size = sum(file.stat().st_size for file in files)
            print(f"wrote {path} ({len(files)} safetensors file(s), {size / 2**20:.1f} MiB)")
        else:
            print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
