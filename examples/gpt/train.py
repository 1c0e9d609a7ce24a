"""Train the character-level GPT with LightningCLI.

    python examples/gpt/train.py fit --config examples/gpt/configs/zero2_cpu.yaml

Under a multi-process CPU strategy (ddp, zero1, zero2) Lightning re-launches this same script
once per extra rank, so everything here runs in every process.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

_EXAMPLE_DIR = Path(__file__).resolve().parent
_REPO_ROOT = _EXAMPLE_DIR.parents[1]
# model.py, data.py, summary.py sit beside this file; python puts the script's folder on
# sys.path itself, but not when train.py is imported (e.g. by a test), so add it explicitly.
if str(_EXAMPLE_DIR) not in sys.path:
    sys.path.insert(0, str(_EXAMPLE_DIR))
# Appended, not prepended: an installed lightning_zero wins, a plain checkout still works.
if str(_REPO_ROOT) not in sys.path:
    sys.path.append(str(_REPO_ROOT))

import torch  # noqa: E402
from data import CharDataModule  # noqa: E402
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI  # noqa: E402
from model import GPT  # noqa: E402

import lightning_zero  # noqa: E402,F401  (registers the strategy names zero1, zero2, ...)


class GPTCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # The vocabulary is known only once the corpus is read; the model must not guess it.
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")
        # One context length for both; a mismatch would crash in forward.
        parser.link_arguments("data.block_size", "model.block_size")


def main() -> None:
    # One intra-op thread per process: the demo runs 2 ranks on 2 cores, and torch's default
    # (one thread per core in each process) would put 4 busy threads on 2 cores, which thrash
    # and make every step slower than with 1.
    torch.set_num_threads(1)
    # With num_workers=0 Lightning warns that loading may bottleneck; here a batch is a tensor
    # slice, and workers would compete for the same two cores.
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    # Lightning 2.6 calls a torch pytree API that newer torch deprecates; nothing to act on here.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated.*")
    GPTCLI(GPT, CharDataModule, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
