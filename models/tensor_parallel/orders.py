"""What rank 0 sends its followers through the group's segment, once a forward (as msgpack:
models/tensor_parallel/wire.py); adapters' weights go through a pipe a follower (models/tensor_parallel/
group.py), being larger than the plan's bytes."""

from dataclasses import dataclass

import numpy as np

from models.batch import ForwardBatch


@dataclass(frozen=True)
class LoraOrder:
    """A forward's rows on the low-rank LoRA path (models/lora/slots.LoraRows without its holder: each rank's
    slots hold its part of the same adapters), and the slots loaded since the last forward: their adapters
    follow, one each in this order, on the follower's adapter pipe."""
    starts: np.ndarray  # [G] int64
    ends: np.ndarray  # [G] int64
    slots: np.ndarray  # [G] int32
    loads: tuple[int, ...] = ()


@dataclass(frozen=True)
class MergedOrder:
    """A forward's rows on merged LoRA copies (models/lora/merge.MergedRows by adapter name: each rank merges
    its part of an adapter into its part of the weights), the copies rank 0 made for it, whose adapters follow
    the slots' loads on the adapter pipe, one each in this order, and the names rank 0 holds after it (a
    follower drops the others)."""
    runs: tuple[tuple[int, int, str], ...]  # (start, end, adapter)
    built: tuple[str, ...]
    held: tuple[str, ...]


@dataclass(frozen=True)
class ForwardOrder:
    """Run this batch (embeddings: an EAGLE head's inputs in place of the tokens'; lora: its low-rank rows,
    batch.lora being None; merged: its rows on merged copies, batch.merged being None)."""
    batch: ForwardBatch
    embeddings: np.ndarray | None = None
    lora: LoraOrder | None = None
    merged: MergedOrder | None = None


@dataclass(frozen=True)
class StopOrder:
    """The engine is closing: exit."""
