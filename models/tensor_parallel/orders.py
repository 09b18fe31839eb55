"""What rank 0 sends its followers through the group's segment, once a forward (pickled); adapters' weights
go through a pipe a follower (models/tensor_parallel/group.py), being larger than the plan's bytes."""

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
class ForwardOrder:
    """Run this batch (embeddings: an EAGLE head's inputs in place of the tokens'; lora: its low-rank rows,
    batch.lora being None)."""
    batch: ForwardBatch
    embeddings: np.ndarray | None = None
    lora: LoraOrder | None = None


@dataclass(frozen=True)
class StopOrder:
    """The engine is closing: exit."""
