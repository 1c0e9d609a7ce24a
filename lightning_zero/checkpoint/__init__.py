"""Sharded checkpoints (torch.distributed.checkpoint) that load at any world size and stage,
their streamed export to one ``.pt`` or ``.safetensors`` file, and to a Hugging Face model
directory (sharded safetensors that ``from_pretrained`` loads)."""

from lightning_zero.checkpoint.consolidate import consolidate
from lightning_zero.checkpoint.hf import consolidate_hf
from lightning_zero.checkpoint.sharded import CheckpointError, CheckpointMeta, is_sharded_checkpoint
from lightning_zero.checkpoint.state import load_checkpoint, save_checkpoint

__all__ = ["CheckpointError", "CheckpointMeta", "consolidate", "consolidate_hf", "is_sharded_checkpoint",
           "load_checkpoint", "save_checkpoint"]
