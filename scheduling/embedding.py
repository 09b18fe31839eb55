"""Embeddings: a prompt's final hidden states (after the final norm) pooled into one vector, the one rule
LLM.embed and /v1/embeddings share."""

import numpy as np

POOLINGS = ("last", "mean")


def pool(hidden: list[np.ndarray], pooling: str, normalize: bool) -> np.ndarray:
    """hidden: per prompt [n_i, H] f32 -> [len(hidden), H] f32: the last row ("last") or the mean of the rows
    ("mean", accumulated in float64), each L2-normalized if normalize."""
    if pooling == "last":
        out = np.stack([h[-1] for h in hidden]).astype(np.float32)
    else:
        out = np.stack([h.mean(axis=0, dtype=np.float64) for h in hidden]).astype(np.float32)
    if normalize:
        norms = np.linalg.norm(out.astype(np.float64), axis=1, keepdims=True)
        out = (out / np.maximum(norms, 1e-12)).astype(np.float32)
    return out
