"""Request traces: when each request arrives and what it asks for (prompt ids, the output the modelled
model will produce), from a seed alone.

- poisson: exponential gaps at `rate` requests/s;
- bursty: on/off periods of BURST_S each, 2 x rate while on and nothing while off (mean rate `rate`);
- sessions: conversations of SESSION_TURNS turns starting at rate / SESSION_TURNS a second; a turn's prompt
  is its history (a system prompt shared by the sessions of one of NUM_SYSTEM_PROMPTS, earlier turns'
  prompts and outputs) plus a new message, and it arrives a think time after the previous turn completed;
- adapters: poisson arrivals, each naming one of NUM_ADAPTERS LoRA adapters drawn Zipf(ZIPF_S).
"""

from dataclasses import dataclass

import numpy as np

VOCAB = 32000
BURST_S = 2.0
SESSION_TURNS = 4
NUM_SYSTEM_PROMPTS = 8
SYSTEM_PROMPT_LEN = 128
MESSAGE_LEN = 32
THINK_S = 2.0  # mean think time between a turn's completion and the next turn
NUM_ADAPTERS = 64
ZIPF_S = 1.1
TRACES = ("poisson", "bursty", "sessions", "adapters")


@dataclass(frozen=True)
class Arrival:
    request_id: str
    time: float  # seconds from the start; a session's later turn: think_s after `previous` completed
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]  # what the model generates (len = max_tokens; requests ignore EOS)
    session: str | None = None
    adapter: str | None = None
    previous: str | None = None  # the session's previous turn: this one arrives only after it completed
    think_s: float = 0.0


def make_trace(kind: str, rate: float, duration_s: float, seed: int, prompt_len: int = 128,
               max_tokens: int = 64) -> list[Arrival]:
    """The trace's arrivals (later session turns included), in request-id order."""
    rng = np.random.default_rng(seed)
    if kind == "sessions":
        return _sessions(rng, rate, duration_s, max_tokens)
    if kind == "bursty":
        times = [t for t in _poisson_times(rng, 2 * rate, duration_s) if int(t // BURST_S) % 2 == 0]
    elif kind in ("poisson", "adapters"):
        times = _poisson_times(rng, rate, duration_s)
    else:
        raise ValueError(f"trace must be one of {TRACES}, got {kind!r}")
    ranks = np.arange(1, NUM_ADAPTERS + 1, dtype=np.float64) ** -ZIPF_S
    adapters = (rng.choice(NUM_ADAPTERS, size=len(times), p=ranks / ranks.sum()) if kind == "adapters"
                else None)
    return [Arrival(f"r{i}", t, _tokens(rng, prompt_len), _tokens(rng, max_tokens),
                    adapter=f"adapter-{adapters[i]}" if adapters is not None else None)
            for i, t in enumerate(times)]


def _poisson_times(rng: np.random.Generator, rate: float, duration_s: float) -> list[float]:
    if rate <= 0:
        return []
    n = rng.poisson(rate * duration_s)
    return np.sort(rng.uniform(0.0, duration_s, n)).tolist()


def _tokens(rng: np.random.Generator, n: int) -> tuple[int, ...]:
    return tuple(rng.integers(3, VOCAB, n).tolist())


def _sessions(rng: np.random.Generator, rate: float, duration_s: float, max_tokens: int) -> list[Arrival]:
    systems = [_tokens(rng, SYSTEM_PROMPT_LEN) for _ in range(NUM_SYSTEM_PROMPTS)]
    arrivals = []
    for s, start in enumerate(_poisson_times(rng, rate / SESSION_TURNS, duration_s)):
        history, previous = systems[rng.integers(NUM_SYSTEM_PROMPTS)], None
        for turn in range(SESSION_TURNS):
            prompt = history + _tokens(rng, MESSAGE_LEN)
            output = _tokens(rng, max_tokens)
            request_id = f"s{s}-t{turn}"
            arrivals.append(Arrival(request_id, start, prompt, output, session=f"s{s}", previous=previous,
                                    think_s=float(rng.exponential(THINK_S)) if previous else 0.0))
            history, previous = prompt + output, request_id
    return arrivals
