"""ForwardBatch: everything one model step needs, as flat arrays (one row per scheduled token)."""

from dataclasses import dataclass

import numpy as np

from models.lora.merge import MergedRows
from models.lora.slots import LoraRows


@dataclass(frozen=True)
class ForwardBatch:
    token_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int32
    token_seq: np.ndarray  # [T] int32, row of block_tables for each token
    slot_mapping: np.ndarray  # [T] int64, block_id * block_size + offset where the token's KV goes
    block_tables: np.ndarray  # [S, max_blocks] int32
    logits_indices: np.ndarray  # [R] int64, token rows whose next-token logits are wanted
    lora: LoraRows | None = None  # rows on the low-rank path (None: none)
    merged: MergedRows | None = None  # rows on an adapter's merged weights (None: none)
    hidden_indices: np.ndarray | None = None  # [H] int64, token rows whose last hidden state is wanted
    # [T] int32, a tree node's first tree slot (-1: not a node); None: no tree
    tree_starts: np.ndarray | None = None
    # [T, W] uint8, the tree slots each node sees (kernels/attention/paged.py)
    tree_mask: np.ndarray | None = None
    # [S] int32, each sequence's first slot its recent window may read (kernels/attention/chunks.py); None: no
    # window
    wide_from: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]
