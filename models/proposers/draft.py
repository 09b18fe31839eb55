"""DraftModelProposer: a smaller model with the target's tokenizer drafts greedily (or, for a sampled
request, races with the target's keyed clocks) over its own paged KV cache, one batched forward per draft
position.

Per request it remembers the tokens its KV holds. Each call first keeps the longest prefix of those that
still agrees with the request's verified tokens (rejected drafts and anything the target replaced fall
away, with their tail blocks), then runs every request's unseen tokens in one catch-up forward whose
last-row logits give draft 0, then one forward per further draft position over the requests still
drafting. The last draft is never run through the draft model: its KV is written on the next call, if
the target accepts it.
"""

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cluster_configs.diagnostics import DecisionLog
from cluster_configs.errors import CheckpointError
from cluster_configs.sampling_params import SamplingParams
from memory.block_pool import BlockPool
from memory.kv_cache import KVCache
from models.batch import ForwardBatch
from models.decoder import DecoderModel
from models.loader import load_model
from models.model_spec import ModelSpec
from models.proposers.base import Proposer, SpecRequest
from models.quantization.activation_plan import plan_activations
from models.sampling_batch import SamplingBatch
from models.tokenizer import Tokenizer

GREEDY = SamplingParams(temperature=0.0)  # a request without params drafts greedily
# (logits [M, V] f32, the rows' SamplingBatch) -> [M] int tokens: the engine passes its own batched sampler
# (scheduling/sampling/sampler.py's sample_batch), so that a sampled request's draft races with the target's
# clocks
DraftSampler = Callable[[np.ndarray, SamplingBatch], np.ndarray]


def argmax_sampler(logits: np.ndarray, batch: SamplingBatch) -> np.ndarray:
    return np.argmax(logits, axis=1)


def check_same_vocabulary(draft_path: str | Path, draft_spec: ModelSpec, draft_tok: Tokenizer | None,
                          target_spec: ModelSpec, target_tok: Tokenizer | None) -> None:
    """Raise CheckpointError unless the draft model tokenizes exactly like the target."""
    where = f"draft model {draft_path}"
    if target_tok is None and draft_tok is None:
        if draft_spec.vocab_size != target_spec.vocab_size:
            raise CheckpointError(f"{where}: vocabulary size {draft_spec.vocab_size} differs from the "
                                  f"target's {target_spec.vocab_size} (neither has a tokenizer.json); use a "
                                  "draft model of the target's family")
        return
    if target_tok is None or draft_tok is None:
        has, lacks = ("target", "draft model") if draft_tok is None else ("draft model", "target")
        raise CheckpointError(f"{where}: the {has} has a tokenizer but the {lacks} has none, so their "
                              "vocabularies cannot be compared; copy the target's tokenizer.json beside both")
    draft_vocab = draft_tok.hf_tokenizer.get_vocab(with_added_tokens=True)
    target_vocab = target_tok.hf_tokenizer.get_vocab(with_added_tokens=True)
    if draft_vocab == target_vocab:
        return
    if len(draft_vocab) != len(target_vocab):
        raise CheckpointError(f"{where}: its tokenizer has {len(draft_vocab)} tokens, the target's "
                              f"{len(target_vocab)}; a draft model needs the target's tokenizer")
    by_id = {i: t for t, i in target_vocab.items()}
    diff = sorted((i, t) for t, i in draft_vocab.items() if by_id.get(i) != t)
    i, t = diff[0]
    raise CheckpointError(f"{where}: its tokenizer differs from the target's at {len(diff)} token ids (e.g. "
                          f"id {i} is {t!r} in the draft, {by_id.get(i)!r} in the target); a draft model "
                          "needs the target's tokenizer")


@dataclass
class _DraftSeq:
    token_ids: list[int] = field(default_factory=list)  # tokens whose KV this proposer holds
    block_ids: list[int] = field(default_factory=list)
    num_verified: int = 0  # of token_ids, a prefix that was the request's own (verified) at the last call


class DraftModelProposer(Proposer):
    catches_up = True  # a request that stopped drafting runs every token it missed through the draft model

    def __init__(self, path: str | Path, target_spec: ModelSpec, target_tokenizer: Tokenizer | None, *,
                 kv_cache_tokens: int, block_size: int = 16, weight_dtype: str = "auto",
                 kv_dtype: str = "float32", activation_dtype: str = "auto",
                 decisions: DecisionLog | None = None, sampler: DraftSampler = argmax_sampler,
                 max_model_len: int | None = None):
        super().__init__()
        self.sampler = sampler
        self.spec, weights, tokenizer = load_model(path, weight_dtype)
        check_same_vocabulary(path, self.spec, tokenizer, target_spec, target_tokenizer)
        weights = plan_activations(weights, activation_dtype, decisions or DecisionLog())
        # the target engine's max_model_len: LongRoPE's factors as the target's (Phi-3 within its original
        # context rotates by the short ones)
        self.model = DecoderModel(self.spec, weights, max_model_len)
        self.vocab_size = target_spec.vocab_size  # drafts are tokens of the target's vocabulary
        # a forward costs about its share of the target's layers (fixed, per-layer calls) and of the
        # target's parameters (per token, weights read)
        self.cost_prior = (self.spec.num_layers / target_spec.num_layers,
                           self.spec.num_params / target_spec.num_params)
        s = self.spec
        self.block_size = block_size
        num_blocks = max(1, -(-kv_cache_tokens // block_size))
        self.kv_cache = KVCache(s.num_layers, num_blocks, block_size, s.num_kv_heads, s.head_dim, kv_dtype)
        self.pool = BlockPool(num_blocks)
        self.seqs: dict[str, _DraftSeq] = {}  # insertion order = least recently drafted first

    def free(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.pool.free(reversed(seq.block_ids))

    def propose(self, requests: Sequence[SpecRequest], depths: Sequence[int]) -> list[list[int]]:
        self.last_passes = []
        drafts: list[list[int]] = [[] for _ in requests]
        active = [i for i, d in enumerate(depths) if d > 0 and len(requests[i].token_ids) + d
                  <= self.spec.max_position_embeddings]
        for i in active:  # most recently drafted last, so KV eviction takes idle requests first
            rid = requests[i].request_id
            self.seqs[rid] = self.seqs.pop(rid, None) or _DraftSeq()
        # catch up: every unseen verified token in one forward; its last row gives draft 0
        feeds = []
        for i in active:
            seq, token_ids = self.seqs[requests[i].request_id], requests[i].token_ids
            keep = min(_common_prefix(seq, token_ids), len(token_ids) - 1)  # rerun >= 1 for its logits
            self._truncate(seq, keep)
            seq.num_verified = len(token_ids)
            feeds.append((i, token_ids[keep:]))
        step_ids = {requests[i].request_id for i in active}
        for _ in range(max((depths[i] for i in active), default=0)):
            feeds = self._reserve(requests, feeds, step_ids)
            if not feeds:
                break
            start = time.perf_counter()
            logits = self._forward([(self.seqs[requests[i].request_id], new) for i, new in feeds])
            self.last_passes.append((sum(len(new) for _, new in feeds), time.perf_counter() - start))
            next_feeds = []
            tokens = self._choose([requests[i] for i, _ in feeds], logits)
            for (i, _), token in zip(feeds, tokens):
                drafts[i].append(token)
                if len(drafts[i]) < depths[i]:
                    next_feeds.append((i, [token]))
            feeds = next_feeds
        return drafts

    # ---- helpers ----------------------------------------------------------------------------------

    def _choose(self, reqs: list[SpecRequest], logits: np.ndarray) -> list[int]:
        """Each request's draft at this position, by self.sampler: the engine's sampler takes the argmax for
        a greedy request and, for a sampled one, samples the draft model's logits as the request samples
        (penalties, temperature, filters) in the race keyed like the target's draw at this position, so the
        draft is the target's own draw whenever the two distributions agree enough
        (scheduling/sampling/step_sampler.py)."""
        logits = np.ascontiguousarray(logits[:, :self.vocab_size], np.float32)  # [M, V]
        return self.sampler(logits, _sampling_batch(reqs, [self.seqs[r.request_id].token_ids
                                                           for r in reqs])).tolist()

    def _truncate(self, seq: _DraftSeq, keep: int) -> None:
        del seq.token_ids[keep:]
        seq.num_verified = min(seq.num_verified, keep)
        num_blocks = -(-keep // self.block_size)
        self.pool.free(reversed(seq.block_ids[num_blocks:]))
        del seq.block_ids[num_blocks:]

    def _reserve(self, requests: Sequence[SpecRequest], feeds: list[tuple[int, list[int]]],
                 step_ids: set[str]):
        """Blocks for the feeds' new tokens. If short, requests outside this step lose their draft KV
        (least recently drafted first); a request that still does not fit stops drafting and drops its
        KV (it catches up when it next drafts)."""
        kept = []
        for i, new in feeds:
            rid = requests[i].request_id
            seq = self.seqs[rid]
            need = -(-(len(seq.token_ids) + len(new)) // self.block_size) - len(seq.block_ids)
            while not self.pool.can_allocate(need):
                idle = next((r for r in self.seqs if r not in step_ids), None)
                if idle is None:
                    break
                self.free(idle)
            blocks = self.pool.allocate(need) if need > 0 else []
            if blocks is None:
                self.free(rid)
                self.seqs[rid] = _DraftSeq()
                continue
            seq.block_ids += blocks
            kept.append((i, new))
        return kept

    def _forward(self, feeds: list[tuple[_DraftSeq, list[int]]]) -> np.ndarray:
        """Append each feed's tokens to its sequence and run them; -> logits [len(feeds), V] of last rows."""
        bs = self.block_size
        token_ids, positions, token_seq, last_rows = [], [], [], []
        block_tables = np.zeros((len(feeds), max(len(seq.block_ids) for seq, _ in feeds)), np.int32)
        for s, (seq, new) in enumerate(feeds):
            start = len(seq.token_ids)
            token_ids += new
            positions += range(start, start + len(new))
            token_seq += [s] * len(new)
            last_rows.append(len(token_ids) - 1)
            block_tables[s, :len(seq.block_ids)] = seq.block_ids
            seq.token_ids += new
        positions = np.asarray(positions, np.int32)
        token_seq = np.asarray(token_seq, np.int32)
        slot_mapping = block_tables[token_seq, positions // bs].astype(np.int64) * bs + positions % bs
        batch = ForwardBatch(np.asarray(token_ids, np.int64), positions, token_seq, slot_mapping,
                             block_tables, np.asarray(last_rows, np.int64))
        return self.model.forward(batch, self.kv_cache)


def _common_prefix(seq: _DraftSeq, token_ids: list[int]) -> int:
    """Length of the common prefix of seq.token_ids and token_ids. Verified tokens only grow, so the
    comparison starts where the last call's verified tokens end unless the request got shorter."""
    a, b = seq.token_ids, token_ids
    start = min(seq.num_verified, len(a)) if len(b) >= seq.num_verified else 0
    n = min(len(a), len(b))
    if a[start:n] == b[start:n]:
        return n
    return next(i for i in range(start, n) if a[i] != b[i])


def _sampling_batch(reqs: list[SpecRequest], token_ids: list[list[int]]) -> SamplingBatch:
    """The draft's rows as the requests sample: their params and seeds, the draft's tokens so far (verified
    tokens + this call's drafts) for penalties and the position."""
    params = [getattr(r, "params", None) or GREEDY for r in reqs]
    seeds = [(p.seed or 0) % 2**64 if getattr(r, "seed", None) is None else r.seed
             for r, p in zip(reqs, params)]
    return SamplingBatch.build(params, seeds, [len(t) for t in token_ids], token_ids,
                               [getattr(r, "num_prompt_tokens", len(t)) for r, t in zip(reqs, token_ids)])
