"""The demo model card's held-out evaluation without torch: the same token stream, windows and perplexity, and
the greedy prompts the KV and activation quality checks continue (benchmarks and tests alike).

scripts/train_demo.py (which needs torch) tokenizes the held-out files of the demo corpus
(numaserve/demo_corpus.py), the "tests" subset, then the "library" subset, each as <s> ids </s>, into one
stream, and scores 128 evenly spaced non-overlapping windows of 256 tokens (scripts/demo_eval.py); the same
here, without torch.
"""

import math
from collections.abc import Callable

import numpy as np

from cluster_configs.sampling_params import SamplingParams
from models.quantization.calibrate import token_windows
from numaserve.demo_corpus import heldout_texts

CARD_WINDOWS, CARD_WINDOW_TOKENS = 128, 256
NUM_PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 16, 128, 32
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def heldout_stream(tokenizer, eos_id: int = 2) -> np.ndarray:
    return tokenizer.stream(heldout_texts(), eos_id)  # the post-processor prepends <s>


def card_windows(tokenizer, num_windows: int = CARD_WINDOWS) -> list[np.ndarray]:
    """The model card's evaluation windows (num_windows < 128: evenly spaced ones of the same grid)."""
    return token_windows(heldout_stream(tokenizer), CARD_WINDOW_TOKENS, num_windows)


def greedy_prompts(tokenizer) -> list[list[int]]:
    """The first 128 tokens of every 4th of 64 evenly spaced model-card windows: 16 held-out prompts."""
    windows = card_windows(tokenizer, 4 * NUM_PROMPTS)
    return [[int(t) for t in w[:PROMPT_TOKENS]] for w in windows[::4]]


def perplexity(logits_of: Callable[[list[int]], np.ndarray], windows: list[np.ndarray]) -> float:
    """exp(mean next-token NLL) over every window; logits_of(ids) -> [len(ids), vocab] next-token logits."""
    total, count = 0.0, 0
    for window in windows:
        ids = [int(t) for t in window]
        logp = log_softmax(logits_of(ids)[:-1])  # [S - 1, vocab]
        total -= float(np.sum(logp[np.arange(len(ids) - 1), ids[1:]]))
        count += len(ids) - 1
    return math.exp(total / count)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """[.., vocab] logits -> float64 log-probabilities."""
    x = logits.astype(np.float64)
    peak = x.max(-1, keepdims=True)
    return x - (np.log(np.exp(x - peak).sum(-1, keepdims=True)) + peak)


def window_scores(logits_of: dict[str, Callable[[list[int]], np.ndarray]],
                  windows: list[np.ndarray]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per model and window: (mean next-token NLL, mean KL divergence of its next-token distribution from the
    first model's), each [len(windows)]. The models take turns window by window: one window's logits held."""
    nll = {name: [] for name in logits_of}
    kl = {name: [] for name in logits_of}
    for window in windows:
        ids = [int(t) for t in window]
        targets = np.asarray(ids[1:])
        reference = None
        for name, logits in logits_of.items():
            logp = log_softmax(logits(ids)[:-1])  # [S - 1, vocab]
            reference = logp if reference is None else reference
            nll[name].append(-float(np.mean(logp[np.arange(len(targets)), targets])))
            kl[name].append(float(np.mean(np.sum(np.exp(reference) * (reference - logp), -1))))
    return {name: (np.array(nll[name]), np.array(kl[name])) for name in logits_of}


def greedy_agreement(tokens_a: list[list[int]], tokens_b: list[list[int]]) -> dict:
    """How far two sets of greedy continuations of the same prompts agree."""
    same_prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                   for a, b in zip(tokens_a, tokens_b)]
    num_tokens = sum(len(a) for a in tokens_a)
    return {"num_prompts": len(tokens_a), "num_tokens": num_tokens,
            "identical_continuations": sum(a == b for a, b in zip(tokens_a, tokens_b)),
            "tokens_before_first_difference": sum(same_prefix),
            "prefix_agreement": sum(same_prefix) / num_tokens,
            "positionwise_agreement": sum(x == y for a, b in zip(tokens_a, tokens_b)
                                          for x, y in zip(a, b)) / num_tokens}
