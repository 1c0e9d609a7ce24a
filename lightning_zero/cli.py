"""The ``lightning-zero`` console command."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence

from lightning_zero.checkpoint.consolidate import DTYPES, consolidate
from torch.distributed.checkpoint.api import CheckpointException

from lightning_zero.checkpoint.checksums import CheckpointError, reason


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-zero", description="Tools for lightning_zero checkpoints.")
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser(
        "consolidate",
        help="write a sharded checkpoint as one file (.pt or .safetensors), streamed shard by shard",
        description="Writes a sharded checkpoint directory as one file, reading and writing one tensor at a time"
        " (memory stays about the largest tensor). OUT ending in .safetensors gets the weights only; any other"
        " name a Lightning checkpoint that torch.load, LightningModule.load_from_checkpoint and"
        " trainer.fit(ckpt_path=...) read. Needs no GPU.",
    )
    export.add_argument("checkpoint", help="the sharded checkpoint directory")
    export.add_argument("output", help="the file to write (.pt, .ckpt or .safetensors)")
    export.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                        help="dtype of every floating-point tensor of the module's state (float64 tensors and optimizer state"
                             " are kept as saved)")
    export.add_argument("--weights-only", action="store_true", help="leave out optimizer state, schedulers and loops")
    export.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "consolidate":
        warnings.filterwarnings("ignore", module="torch.distributed.checkpoint")
        try:
            path = consolidate(args.checkpoint, args.output, dtype=args.dtype, weights_only=args.weights_only,
                               progress=not args.no_progress)
        except (CheckpointError, ValueError, OSError) as error:
            print(f"lightning-zero consolidate: error: {error}", file=sys.stderr)
            return 2
        except CheckpointException as error:  # DCP's wrapper of an error not translated above: no traceback either
            inner = ", ".join(reason(exc) for exc, _ in error.failures.values())
            print(f"lightning-zero consolidate: error: {args.checkpoint} cannot be read ({inner}).", file=sys.stderr)
            return 2
        print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
