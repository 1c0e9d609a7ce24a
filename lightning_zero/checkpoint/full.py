"""Reading whole-model checkpoint files (DDP's, a consolidated export, safetensors) with errors
that say what is wrong with the file and what to do."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import torch

from lightning_zero.checkpoint.checksums import UNREADABLE_ERRORS, reason
from lightning_zero.checkpoint.sharded import CheckpointError


def load_full_checkpoint(path: Path, model_key: str = "state_dict") -> dict[str, Any]:
    """A Lightning checkpoint dict from a file: ``.safetensors`` gives ``{model_key: ...}``;
    anything else is read with ``torch.load`` (memory-mapped, so the weights are paged in as
    they are copied rather than read whole) and must hold the module's state under ``model_key``
    (Fabric's checkpoints name it as the user did)."""
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory but not a checkpoint (no .metadata file).")
    if path.suffix == ".safetensors":
        from lightning_zero.checkpoint.serialization import load_safetensors

        try:
            return {model_key: load_safetensors(path)}
        except ValueError as error:  # the message names the file and what is wrong with it
            raise CheckpointError(f"{error}. Use an earlier checkpoint, or copy the file again.") from error
    checkpoint = _torch_load(path)
    if not isinstance(checkpoint, dict) or model_key not in checkpoint:
        found = sorted(map(str, checkpoint))[:10] if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise CheckpointError(
            f"{path} is a torch file but not a Lightning checkpoint: it has no {model_key!r} (found {found}). A bare"
            " state dict of the module loads with LightningModule.load_state_dict before fitting; a checkpoint comes"
            " from trainer.save_checkpoint, ModelCheckpoint or `lightning-zero consolidate`."
        )
    return checkpoint


def load_module_state(path: Path) -> dict[str, Any]:
    """A module's whole state dict from a file holding one (``torch.save(model.state_dict())``,
    what Fabric's ``load_raw`` reads), or from a checkpoint holding it under ``state_dict``
    (Lightning's) or ``model`` (Fabric's)."""
    if path.is_dir() or path.suffix == ".safetensors":
        return load_full_checkpoint(path, "model")["model"]
    content = _torch_load(path)
    if isinstance(content, dict) and content and all(isinstance(value, torch.Tensor) for value in content.values()):
        return content
    for key in ("state_dict", "model"):
        if isinstance(content, dict) and isinstance(content.get(key), dict):
            return content[key]
    found = sorted(map(str, content))[:10] if isinstance(content, dict) else type(content).__name__
    raise CheckpointError(
        f"{path} holds no module state: neither a state dict (tensors by name) nor a checkpoint with a 'state_dict'"
        f" or 'model' entry (found {found}). Save one with torch.save(model.state_dict(), path), or fabric.save."
    )


def _torch_load(path: Path) -> Any:
    # Only zip-format files can be memory-mapped (not legacy pickles, nor a zip cut short).
    try:
        return torch.load(path, map_location="cpu", mmap=zipfile.is_zipfile(path), weights_only=False)
    except UNREADABLE_ERRORS as error:
        raise _unreadable(path, error) from error


def _unreadable(path: Path, error: BaseException) -> CheckpointError:
    size = path.stat().st_size if path.exists() else 0
    return CheckpointError(
        f"{path} ({size} bytes) cannot be read as a checkpoint: {reason(error)}."
        " The file is truncated (an interrupted copy or save) or not a torch checkpoint. Use an earlier checkpoint,"
        " or copy the file again."
    )
