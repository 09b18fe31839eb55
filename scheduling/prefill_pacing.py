"""How many prompt tokens a step may carry while other requests decode, so that a long prompt arriving never
freezes the streams already running (Sarathi-Serve's stall-free batching, its budget from this engine's
measured step costs rather than an offline profile).

A decode step's time is what a running stream waits between tokens. A step that also carries a prompt chunk
of p tokens takes about decode_s + fixed_s + p * token_s: fixed_s is what any chunk adds whatever its size,
token_s what each of its tokens adds. Holding the step to max_stretch * decode_s gives

    p = ((max_stretch - 1) * decode_s - fixed_s) / token_s   (at least 1 but on the steps below that probe)

decode_s is an average of the steps that decoded as many requests with no prompt token, one per number of
decoding requests: where the matrix products are compute-bound (a CPU without VNNI) a decode step of 8
requests costs several times one of 2, so an average over both would misprice every chunk. A count not
measured yet is priced by the largest count below it that was (a cheaper step: less room, never a longer
stall); with none below it, the step decodes alone and measures it. A long prompt's chunks would leave no
decode-only step, while the streams' contexts grow and the VM's speed swings, so at least every
PROBE_EVERY-th step beside decodes carries no prompt token.

fixed_s and token_s are a line fitted to the recent steps that carried some (their seconds less decode_s
against their prompt tokens, the newer weighing more). While those steps' chunks were all about one size the
line has no slope to fit: it keeps the slope fitted before and moves through their mean, or before any slope
was fitted takes the excess as per token (exact at that size; the chunk sizes it then picks spread the sizes).
Before any chunk was measured a prompt token is taken to cost what a decoding request's token does (decode_s
over the requests decoding: both are rows of the same matrix products; on a 2-core Zen 1 VM, 37 ms against 34
measured), and before any step was measured a chunk is FIRST_CHUNK tokens. When fixed_s alone fills the room,
no chunk keeps the stretch: a chunk is then sized against a mixed step's floor (decode_s + fixed_s) instead,
so that a prompt does not crawl a token a step while the streams wait about as long anyway, and
`floor_over_stretch` says so (the batcher logs it). A chunk grows by at most GROWTH times the last one
measured: a line fitted to noisy steps may promise a chunk far larger than any measured, and one step that
long is the streams' p99. With nothing decoding, or pacing off, only the token budget bounds a step.
"""

from collections import deque
from dataclasses import dataclass

FIRST_CHUNK = 16  # prompt tokens beside decodes before any step was measured
PROBE_EVERY = 8  # of the steps beside decodes, at least every this many carries no prompt token
GROWTH = 1.25  # a chunk at most this times (plus one token) the last one measured
EMA_WEIGHT = 0.25  # of the newest step in each average: the VM's speed swings within seconds
WINDOW = 16  # the mixed steps the line is fitted to
SPREAD = 0.25  # the chunk sizes' weighted relative spread (std / mean) below which no slope is fitted


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + EMA_WEIGHT * (new - old)


@dataclass(frozen=True)
class ChunkCost:
    """What a prompt chunk of p tokens adds to a decode step: fixed_s + p * token_s seconds."""

    fixed_s: float
    token_s: float


def fit_chunk_cost(chunks: list[tuple[int, float]], slope: float | None = None) -> ChunkCost | None:
    """The line through (prompt tokens, seconds added) of mixed steps, oldest first, each weighing
    (1 - EMA_WEIGHT) times the next. When the sizes barely differ: the line of the given slope (one fitted
    before) through their mean, or without one all per token; all per token too when a fit says a token costs
    nothing or a chunk less than nothing (noise). None: no step."""
    if not chunks:
        return None
    weights = [(1.0 - EMA_WEIGHT) ** age for age in range(len(chunks) - 1, -1, -1)]
    total = sum(weights)
    mean_p = sum(w * p for w, (p, _) in zip(weights, chunks)) / total
    mean_s = sum(w * s for w, (_, s) in zip(weights, chunks)) / total
    var_p = sum(w * (p - mean_p) ** 2 for w, (p, _) in zip(weights, chunks)) / total
    per_token = ChunkCost(0.0, max(mean_s, 0.0) / mean_p)
    if var_p < (SPREAD * mean_p) ** 2:
        slope = slope if slope is not None and mean_s - slope * mean_p >= 0 else mean_s / mean_p
        return per_token if slope <= 0 else ChunkCost(mean_s - slope * mean_p, slope)
    slope = sum(w * (p - mean_p) * (s - mean_s) for w, (p, s) in zip(weights, chunks)) / total / var_p
    fixed = mean_s - slope * mean_p
    return ChunkCost(fixed, slope) if slope > 0 and fixed >= 0 else per_token


class PrefillPacer:
    def __init__(self, max_stretch: float | None):
        """max_stretch: a step with prompt tokens beside decodes takes at most this times a decode-only step
        (EngineConfig.max_prefill_stretch); None: unpaced."""
        self.max_stretch = max_stretch
        self.decode_steps: dict[int, float] = {}  # decoding requests -> a decode-only step's seconds
        self.num_decoding = 0  # the decoding requests of the step last measured or asked for
        self.chunks: deque[tuple[int, float]] = deque(maxlen=WINDOW)  # (prompt tokens, seconds added)
        self.cost: ChunkCost | None = None  # fitted to chunks at their last change
        self.since_decode_only = 0  # steps beside decodes measured since the last decode-only one

    def observe(self, num_decode_tokens: int, num_prompt_tokens: int, seconds: float) -> None:
        """A step's tokens (decoding requests' and all others') and its wall time."""
        if num_decode_tokens == 0 or seconds <= 0:
            return  # nothing decoded: no stream waited on it
        self.num_decoding = num_decode_tokens
        if num_prompt_tokens == 0:
            old = self.decode_steps.get(num_decode_tokens)
            self.decode_steps[num_decode_tokens], self.since_decode_only = _average(old, seconds), 0
            return
        self.since_decode_only += 1
        decode_s = self.decode_steps.get(num_decode_tokens)  # only a measured step of this count prices it
        if decode_s is not None:
            self.chunks.append((num_prompt_tokens, max(seconds - decode_s, 0.0)))
            # chunks all of one size keep the slope the sizes gave before
            self.cost = fit_chunk_cost(list(self.chunks), None if self.cost is None else self.cost.token_s)

    @property
    def last_chunk(self) -> int:
        """The prompt tokens the last measured step beside decodes carried (FIRST_CHUNK before one: growth
        does not bound the first)."""
        return self.chunks[-1][0] if self.chunks else FIRST_CHUNK

    def decode_s_for(self, num_decoding: int) -> float | None:
        """A decode-only step of num_decoding requests: as measured, or the largest count below it measured
        (None: none)."""
        below = [n for n in self.decode_steps if n <= num_decoding]
        return self.decode_steps[max(below)] if below else None

    @property
    def decode_s(self) -> float | None:
        """A decode-only step of as many requests as the step last measured or asked for decoded."""
        return self.decode_s_for(self.num_decoding)

    @property
    def floor_over_stretch(self) -> bool:
        """Whether any prompt chunk alone makes a step longer than max_stretch decode steps."""
        cost, decode_s = self.cost, self.decode_s
        return (self.max_stretch is not None and cost is not None and decode_s is not None
                and cost.fixed_s >= (self.max_stretch - 1.0) * decode_s)

    def prompt_tokens(self, num_decoding: int) -> int | None:
        """Prompt tokens the next step may carry beside num_decoding decoding requests (None: no bound; 0:
        a decode-only step, every PROBE_EVERY-th, and where no decode step of as few was measured)."""
        if self.max_stretch is None or num_decoding == 0:
            return None
        self.num_decoding = num_decoding
        if self.since_decode_only >= PROBE_EVERY - 1:
            return 0
        decode_s = self.decode_s
        if decode_s is None:  # none measured (prompts go beside decodes at once), or none of this few
            return 0 if self.decode_steps else FIRST_CHUNK
        # before a chunk was measured: a prompt token costs what a decoding request's token does
        cost = self.cost or ChunkCost(0.0, decode_s / num_decoding)
        room = (self.max_stretch - 1.0) * decode_s - cost.fixed_s
        if room <= 0:  # floor_over_stretch: the stretch over a mixed step's floor instead
            room = (self.max_stretch - 1.0) * (decode_s + cost.fixed_s)
        fits = room / max(cost.token_s, 1e-9)
        chunk = int(fits + 1e-6)  # 4.9999... is 5
        if cost.fixed_s == 0 and self.chunks and chunk == self.last_chunk < fits:
            chunk += 1  # all per token, measured at one size: one more shows whether a chunk has a fixed part
        return max(1, min(chunk, int(GROWTH * self.last_chunk) + 1))
