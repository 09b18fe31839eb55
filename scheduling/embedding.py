"""Embeddings: a prompt's final hidden states (after the final norm) pooled into one vector, the one rule
LLM.embed and /v1/embeddings share."""

import itertools

import numpy as np

from cluster_configs.sampling_params import SamplingParams

POOLINGS = ("last", "mean")

_ids = itertools.count()


def embed(loop, engine, prompts: list, pooling: str, normalize: bool, adapter: str | None) -> np.ndarray:
    """float32 [len(prompts), hidden]: each prompt pooled, its requests batched in the engine loop's steps
    (loop: scheduling/engine_loop.EngineLoop over engine)."""
    requests = [engine.make_request(f"embed-{next(_ids)}", p, SamplingParams(max_tokens=1), adapter=adapter,
                                    pooling=True) for p in prompts]
    return pool([np.concatenate(r.collected_rows) for r in loop.run(requests)], pooling, normalize)


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
