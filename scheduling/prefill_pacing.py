"""How many prompt tokens a step may carry while other requests decode, so that a long prompt arriving never
freezes the streams already running (Sarathi-Serve's stall-free batching, its budget from this engine's
measured step costs rather than an offline profile).

A decode step's time is what a running stream waits between tokens. A step that also carries a prompt chunk
of p tokens takes decode_s + excess(p); holding it to max_stretch * decode_s leaves room = (max_stretch - 1)
* decode_s for the chunk: the largest p with excess(p) <= room.

decode_s is an average of the steps that decoded as many requests with no prompt token, one per number of
decoding requests: where the matrix products are compute-bound (a CPU without VNNI) a decode step of 8
requests costs several times one of 2, so an average over both would misprice every chunk. A count not
measured yet is priced by the largest count below it that was (a cheaper step: less room, never a longer
stall); with none below it, the step decodes alone and measures it. A long prompt's chunks would leave no
decode-only step, while the streams' contexts grow and the VM's speed swings, so at least every
PROBE_EVERY-th step beside decodes carries no prompt token.

A prompt token is priced at the recent chunks' excess over their tokens (the newer weighing more), and the
next chunk is the room at that price: if a chunk of p adds f + t * p, that price is f / p + t, and the chunks
it picks, room * p / (f + t * p) each from the last, settle on (room - f) / t, the chunk a line fitted to
the steps would give, whenever f < room. No line is fitted: at the few tokens a step carries on a small CPU a
step's noise is of a token's cost, and the slope of one fitted to chunks of 3 to 6 tokens then priced every
chunk (on a 2-core Zen 1 VM a deployment's pacer took 7.5 ms a token and 446 ms a chunk, where a regression
over a whole run's steps gives ~32 ms a token and a chunk's part that grows with the prompt's position,
~0.1 s per 1k positions: its attention). A price at the chunks' own size follows such a drift too.
While the room is a fraction of a token over the last chunk, one token more is tried, unless a chunk that
size among the recent ones overran the room. Before any chunk was measured a prompt token is taken to cost
what a decoding request's token does (decode_s over the requests decoding: both are rows of the same matrix
products; on a 2-core Zen 1 VM, 37 ms against 34 measured), and before any step was measured a chunk is
FIRST_CHUNK tokens.

When even a one-token chunk overruns the room (its excess, floor_s, averaged over one-token chunks), no
chunk keeps the stretch: chunks are then sized against a mixed step's floor (decode_s + floor_s) instead,
so that a prompt does not crawl a token a step while the streams wait about as long anyway, and
`floor_over_stretch` says so (the batcher logs it); the first chunk after each decode-only step is then one
token, which measures the floor again. A chunk grows by at most GROWTH times the last one measured: one step
far longer than any measured is the streams' p99. With nothing decoding, or pacing off, only the token budget
bounds a step.
"""

from collections import deque

FIRST_CHUNK = 16  # prompt tokens beside decodes before any step was measured
PROBE_EVERY = 8  # of the steps beside decodes, at least every this many carries no prompt token
GROWTH = 1.25  # a chunk at most this times (plus one token) the last one measured
EMA_WEIGHT = 0.25  # of the newest step in each average: the VM's speed swings within seconds
WINDOW = 16  # the mixed steps a prompt token's price is taken over


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + EMA_WEIGHT * (new - old)


def token_price(chunks: list[tuple[int, float]]) -> float | None:
    """Seconds a prompt token adds: the chunks' (prompt tokens, seconds added), oldest first, summed with each
    weighing (1 - EMA_WEIGHT) times the next, seconds over tokens. None: no chunk."""
    if not chunks:
        return None
    weights = [(1.0 - EMA_WEIGHT) ** age for age in range(len(chunks) - 1, -1, -1)]
    return sum(w * s for w, (_, s) in zip(weights, chunks)) / sum(w * p for w, (p, _) in zip(weights, chunks))


class PrefillPacer:
    def __init__(self, max_stretch: float | None):
        """max_stretch: a step with prompt tokens beside decodes takes at most this times a decode-only step
        (EngineConfig.max_prefill_stretch); None: unpaced."""
        self.max_stretch = max_stretch
        self.decode_steps: dict[int, float] = {}  # decoding requests -> a decode-only step's seconds
        self.num_decoding = 0  # the decoding requests of the step last measured or asked for
        self.chunks: deque[tuple[int, float]] = deque(maxlen=WINDOW)  # (prompt tokens, seconds added)
        self.floor_s: float | None = None  # what a one-token chunk adds (None: none measured)
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
            added = max(seconds - decode_s, 0.0)
            self.chunks.append((num_prompt_tokens, added))
            if num_prompt_tokens == 1:
                self.floor_s = _average(self.floor_s, added)

    @property
    def token_s(self) -> float | None:
        """What a prompt token adds, over the recent chunks (None: none measured)."""
        return token_price(list(self.chunks))

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
    def room_s(self) -> float | None:
        """What max_stretch lets a chunk add to that decode step (None: unpaced, or no such step measured)."""
        decode_s = self.decode_s
        return None if self.max_stretch is None or decode_s is None else (self.max_stretch - 1.0) * decode_s

    @property
    def floor_over_stretch(self) -> bool:
        """Whether a one-token chunk alone makes a step longer than max_stretch decode steps."""
        room = self.room_s
        return room is not None and self.floor_s is not None and self.floor_s >= room

    def prompt_tokens(self, num_decoding: int) -> int | None:
        """Prompt tokens the next step may carry beside num_decoding decoding requests (None: no bound; 0:
        a decode-only step, every PROBE_EVERY-th, and where no decode step of as few was measured)."""
        if self.max_stretch is None or num_decoding == 0:
            return None
        self.num_decoding = num_decoding
        if self.since_decode_only >= PROBE_EVERY - 1:
            return 0
        decode_s, room = self.decode_s, self.room_s
        if decode_s is None:  # none measured (prompts go beside decodes at once), or none of this few
            return 0 if self.decode_steps else FIRST_CHUNK
        if self.floor_over_stretch:
            if self.since_decode_only == 0:
                return 1  # the floor measured again
            room = (self.max_stretch - 1.0) * (decode_s + self.floor_s)
        price = self.token_s
        fits = room / max(decode_s / num_decoding if price is None else price, 1e-9)
        chunk = int(fits + 1e-6)  # 4.9999... is 5
        if self.chunks and chunk == self.last_chunk < fits and not self._overran(chunk + 1, room):
            chunk += 1  # the price at this size includes any fixed part: a token more may fit
        return max(1, min(chunk, int(GROWTH * self.last_chunk) + 1))

    def _overran(self, num_tokens: int, room: float) -> bool:
        """Whether a recent chunk of num_tokens added more than room."""
        return any(p == num_tokens and added > room for p, added in self.chunks)
