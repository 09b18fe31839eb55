"""Request: one sequence's state as the engine steps it (tokens, KV blocks, decoding progress)."""

import enum
import itertools
import time

import numpy as np

from cluster_configs.sampling_params import SamplingParams
from memory.block_pool import prefix_cache_key
from scheduling.sampling.sampler import request_seed
from scheduling.validation import max_num_tokens

_arrival = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                 adapter_id: str | None = None, cache_salt: str | None = None,
                 prompt_logits: bool = False, pooling: bool = False, max_model_len: int):
        self.request_id = request_id
        self.params = params
        self.arrival = next(_arrival)
        # monotonic time past which the engine aborts the request (params.deadline_s from its arrival here)
        self.deadline = time.monotonic() + params.deadline_s if params.deadline_s is not None else None
        self.adapter_id = adapter_id
        self.cache_salt = cache_salt
        self.prompt_logits = prompt_logits  # score(): keep the logits of every prompt position
        self.pooling = pooling  # embed(): keep the final-norm hidden state of every prompt position
        self.token_ids = list(prompt_token_ids)  # prompt + output
        self.num_prompt_tokens = len(prompt_token_ids)
        self.max_num_tokens = max_num_tokens(self.num_prompt_tokens, params, max_model_len, self.prompt_only)
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # of those, taken from the prefix cache on admission
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # chain over this request's full blocks
        self.disk_looked_up = False  # its prefix was looked up in the prefix cache's disk tier (once at most)
        # the recent window (memory/kv_formats.py): the first slot computed since it got its blocks (None: has
        # none), and its blocks that carry a bfloat16 shadow
        self.wide_from: int | None = None
        self.shadowed: set[int] = set()
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        # every draw is keyed by (seed, position): an unseeded request gets its seed once, here
        self.seed = request_seed(params)
        self.logprobs: list[dict[int, float]] = []
        # params.prompt_logprobs: entry p scores prompt token p + 1 (the logits row after token p)
        self.prompt_logprobs: list[dict[int, float]] = []
        # per step: logits [n, V] when prompt_logits, hidden [n, H] when pooling
        self.collected_rows: list[np.ndarray] = []
        self.text = ""  # decoded output, stop string cut
        self.num_emitted_chars = 0
        self.num_emitted_tokens = 0
        self.detokenizer = None  # IncrementalDetokenizer when the model has a tokenizer
        self.sequence = None  # a session's SequenceKV: the turn starts from its blocks and leaves them there
        # GrammarMatcher when params.structured_outputs (scheduling/sampling/structured.py)
        self.matcher = None

    @property
    def prompt_only(self) -> bool:
        """A score() or embed() request: it computes its prompt and generates nothing."""
        return self.prompt_logits or self.pooling

    @property
    def computes_every_prompt_row(self) -> bool:
        """Whether each prompt position's output is kept (so none may come from the prefix cache)."""
        return self.prompt_only or self.params.prompt_logprobs is not None

    @property
    def priority(self) -> int:
        return self.params.priority  # lower is served first, under the "priority" scheduling policy

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def cache_extra(self) -> tuple:
        """What besides the tokens decides whether two requests may share KV blocks."""
        return prefix_cache_key(self.adapter_id, self.cache_salt)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
