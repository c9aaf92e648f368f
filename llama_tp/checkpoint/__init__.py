"""Checkpoints on disk: Meta's shard layout (sharding), strict memory-mapped loading of any shard
count at any world size (loading, mapped_pages), and int8 and int4 checkpoints (quantized)."""

from .loading import (
    TOLERATED_EXTRA_KEYS,
    Checkpoint,
    load_model,
    load_shard,
    load_slice,
    open_checkpoint,
    shard_paths,
)

__all__ = ["TOLERATED_EXTRA_KEYS", "Checkpoint", "load_model", "load_shard", "load_slice", "open_checkpoint",
           "shard_paths"]
