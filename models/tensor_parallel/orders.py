"""What rank 0 sends its followers through the group's segment, once a step (pickled)."""

from dataclasses import dataclass

import numpy as np

from models.batch import ForwardBatch


@dataclass(frozen=True)
class ForwardOrder:
    """Run this batch (embeddings: an EAGLE head's inputs in place of the tokens')."""
    batch: ForwardBatch
    embeddings: np.ndarray | None = None


@dataclass(frozen=True)
class StopOrder:
    """The engine is closing: exit."""
