"""The HTTP soak's driver: run_http_soak() sends Poisson arrivals through the openai client to a served
deployment's OpenAI API, chat and completions, streamed and not, some on an adapter; 10% of the requests are
streams their client closes at their first text, 10% carry a deadline (the body's deadline_s) far shorter than
their max_tokens need, so the server aborts them. Then it waits for the drain and reads the workers' stats.

Counted: errors (any request that did not end the way its kind should: a status other than the expected, an
exception, a wrong finish_reason), hangs (a request silent for REQUEST_TIMEOUT_S, or not back
REQUEST_TIMEOUT_S + 10 s after the arrivals stopped), KV blocks still in use and requests still queued after
the drain, each worker's RSS before and after, and latency percentiles (TTFT of streams, end to end of the
rest, the gaps between stream chunks). benchmarks/bench_soak.py --http runs it; tests/cluster/test_soak.py
runs it for 60 s.
"""

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import numpy as np
import openai

from benchmarks.bench_soak import arrivals, drained, warm

REQUEST_TIMEOUT_S = 20.0  # a request silent this long counts as hung (the longest takes a few seconds)
KINDS = {"plain": 0.6, "adapter": 0.2, "disconnect": 0.1, "deadline": 0.1}
DEADLINE_S = 0.05  # far too short for LONG_MAX_TOKENS: the engine aborts the request
# disconnects and deadlines ask this many, so that the close or the abort lands mid-stream (a 30 s run with
# the plain lengths, closing after the third chunk: 7 of 9 had finished first; 300 tokens: 4 of 21 still had,
# the tiny model's tokens coming ~0.4 ms apart and a chunk every stream interval)
LONG_MAX_TOKENS = 300
WORDS = ["def", "add", "(", "a", ",", "b", ")", ":", "return", "the", "quick", "brown", "fox", "jumps",
         "over", "lazy", "dog", "numaserve", "serves", "language", "models", "on", "CPUs", "one", "worker",
         "per", "NUMA", "node", "in", "beginning", "was", "word"]


@dataclass
class HttpOutcome:
    kind: str  # one of KINDS
    api: str  # "chat" | "completions"
    stream: bool
    arrival_s: float
    ttft_s: float | None = None  # streams: the first chunk with text
    latency_s: float | None = None  # end to end
    itl_s: list[float] = field(default_factory=list)  # streams: between chunks with text
    finish_reason: str | None = None  # or "closed": its client closed the stream
    status: int | None = None  # an error's HTTP status
    code: str | None = None  # its OpenAI error body's code
    error: str | None = None
    hung: bool = False
    connection_lost: bool = False  # the connection broke (its HTTP actor was killed)
    greedy: bool = False
    text: str = ""  # what it answered (a stream: its chunks' text)


def one_request(api: openai.OpenAI, model: str, adapter: str | None, seed: int, kind: str,
                arrival_s: float) -> HttpOutcome:
    rng = np.random.default_rng(seed)
    stream = kind == "disconnect" or bool(rng.random() < 0.5)
    out = HttpOutcome(kind, "chat" if rng.random() < 0.5 else "completions", stream, arrival_s)
    text = " ".join(rng.choice(WORDS, int(rng.integers(2, 24))))
    extra = {"ignore_eos": True, "seed": seed}
    max_tokens = int(rng.choice([4, 16, 32, 64]))
    if kind in ("disconnect", "deadline"):
        max_tokens = LONG_MAX_TOKENS
    if kind == "deadline":
        extra["deadline_s"] = DEADLINE_S
    temperature = 0.0 if rng.random() < 0.5 else 0.8
    out.greedy = temperature == 0.0
    kwargs = {"model": adapter if kind == "adapter" else model, "max_tokens": max_tokens,
              "temperature": temperature, "stream": stream, "extra_body": extra}
    start = time.monotonic()
    try:
        if out.api == "chat":
            response = api.chat.completions.create(messages=[{"role": "user", "content": text}], **kwargs)
        else:
            response = api.completions.create(prompt=text, **kwargs)
        if not stream:
            choice = response.choices[0]
            out.finish_reason = choice.finish_reason
            out.text = (choice.message.content or "") if out.api == "chat" else choice.text
        else:
            _read_stream(response, out, start)
    except openai.APIStatusError as e:
        out.status, out.error = e.status_code, f"{e.status_code}: {e.message}"
        body = e.body.get("error", e.body) if isinstance(e.body, dict) else None
        out.code = body.get("code") if isinstance(body, dict) else None
    except Exception as e:  # noqa: BLE001  (counted and reported: the soak's point)
        # a timeout: openai's before the response, its HTTP library's (ReadTimeout) while a stream is read
        out.hung = isinstance(e, openai.APITimeoutError) or "Timeout" in type(e).__name__
        out.connection_lost = not out.hung and (isinstance(e, (openai.APIConnectionError, OSError)) or any(
            word in type(e).__name__ for word in ("Connect", "Protocol", "Network")))
        out.error = f"{type(e).__name__}: {e}"
    out.latency_s = time.monotonic() - start
    return out


def _read_stream(response, out: HttpOutcome, start: float) -> None:
    last = None
    for chunk in response:
        now = time.monotonic()
        choice = chunk.choices[0] if chunk.choices else None
        text = None if choice is None else (choice.delta.content if out.api == "chat" else choice.text)
        if text:
            out.text += text
            if out.ttft_s is None:
                out.ttft_s = now - start
            else:
                out.itl_s.append(now - last)
            last = now
        if choice is not None and choice.finish_reason:
            out.finish_reason = choice.finish_reason
        if out.kind == "disconnect" and text and out.finish_reason is None:
            response.close()  # the connection drops: the server aborts the request on its worker
            out.finish_reason = "closed"
            return


def expected(o: HttpOutcome) -> bool:
    """Ended the way its kind should: completed, closed by its client, or aborted at its deadline (a 408 if
    nothing was sent yet, else a stream ending with finish_reason "abort")."""
    if o.hung:
        return False
    if o.kind == "deadline":
        return (o.status == 408 and o.error is not None) or (o.error is None
                                                             and o.finish_reason in ("abort", "length"))
    if o.error is not None:
        return False
    if o.kind == "disconnect":
        return o.finish_reason in ("closed", "length")
    return o.finish_reason == "length"


def chaos_expected(o: HttpOutcome, chaos) -> bool:
    """Under chaos also: a typed 503 while an actor restarted, a connection broken by its HTTP actor's
    kill."""
    window = (o.arrival_s, o.arrival_s + (o.latency_s or 0.0))
    if o.status == 503 and o.code is not None:
        return chaos.during_restart(*window)
    return o.connection_lost and chaos.during_restart(*window, kinds=("http",))


def run_http_soak(client, duration_s: float, rate_per_s: float, adapter: str | None, seed: int = 0,
                  start: threading.Barrier | None = None, chaos=None) -> dict:
    """Poisson arrivals at rate_per_s for duration_s through client.http_url (at most MAX_CONCURRENT in
    flight), then a drain (of the whole deployment); start: as benchmarks/bench_soak.py's run_soak. chaos:
    a benchmarks/chaos.py Chaos killing actors while the arrivals last; then every greedy request that
    completed is sent again, undisturbed, and its answer compared."""
    rng = np.random.default_rng(seed)
    kinds = [k for k in KINDS if adapter or k != "adapter"]
    weights = np.array([KINDS[k] for k in kinds]) / sum(KINDS[k] for k in kinds)
    api = openai.OpenAI(base_url=f"{client.http_url}/v1", api_key="unused", max_retries=0,
                        timeout=REQUEST_TIMEOUT_S)
    model = api.models.list().data[0].id
    warm(client, adapter)
    rss_before = {w: f[3] for w, f in drained(client, 30).items()}
    if start is not None:
        start.wait()
    t0 = time.monotonic()
    if chaos is not None:
        chaos.start(t0)
    try:
        futures, outcomes, pending = arrivals(
            rng, duration_s, rate_per_s, kinds, weights, REQUEST_TIMEOUT_S + 10,
            lambda seed, kind, at_s: (seed, one_request(api, model, adapter, seed, kind, at_s)),
            more=None if chaos is None else chaos.short_of_a_round)
    finally:
        if chaos is not None:
            chaos.stop()
    elapsed = time.monotonic() - t0
    after = drained(client, 60)
    seeds = [seed for seed, _ in outcomes]
    outcomes = [o for _, o in outcomes]
    unexpected = [o for o in outcomes if not expected(o) and not (chaos and chaos_expected(o, chaos))]
    pct = {}
    for what, xs in (("ttft", [o.ttft_s for o in outcomes if o.ttft_s is not None]),
                     ("latency", [o.latency_s for o in outcomes if not o.stream and expected(o)]),
                     ("itl", [x for o in outcomes for x in o.itl_s])):
        for q in (50, 90, 99):
            pct[f"{what}_p{q}_s"] = float(np.percentile(xs, q)) if xs else None
    rss_after = {w: f[3] for w, f in after.items()}
    result = {
        "duration_s": duration_s, "elapsed_s": round(elapsed, 1), "rate_per_s": rate_per_s,
        "num_requests": len(futures), "num_hung": len(pending) + sum(o.hung for o in outcomes),
        "num_completed": sum(o.finish_reason == "length" and o.error is None for o in outcomes),
        "by_kind": {k: sum(o.kind == k for o in outcomes) for k in kinds},
        "by_api": {f"{a}{' stream' if s else ''}": sum(o.api == a and o.stream == s for o in outcomes)
                   for a in ("chat", "completions") for s in (False, True)},
        "num_deadline_408": sum(o.kind == "deadline" and o.status == 408 for o in outcomes),
        "num_deadline_aborted_mid_stream": sum(o.kind == "deadline" and o.finish_reason == "abort"
                                               for o in outcomes),
        "num_disconnected": sum(o.finish_reason == "closed" for o in outcomes),
        "num_5xx": sum(o.status is not None and o.status >= 500 for o in outcomes),
        "num_errors": len(unexpected),
        "errors": sorted({o.error or f"{o.kind} {o.api}{' stream' if o.stream else ''}: "
                                     f"{'hung' if o.hung else o.finish_reason}" for o in unexpected})[:10],
        **pct,
        "num_blocks_leaked": sum(total - free for total, free, _, _ in after.values()),
        "num_requests_left": sum(busy for _, _, busy, _ in after.values()),
        "rss_before_bytes": rss_before, "rss_after_bytes": rss_after,
        "rss_growth_bytes": {w: rss_after[w] - rss_before[w] for w in rss_after if w in rss_before},
    }
    if chaos is not None:
        result |= {"chaos": chaos.summary(),
                   "num_503_during_restart": sum(o.status == 503 and chaos_expected(o, chaos)
                                                 for o in outcomes),
                   "num_connection_lost_to_http_kill": sum(o.connection_lost and chaos_expected(o, chaos)
                                                           for o in outcomes)}
        result |= greedy_check(api, model, adapter, seeds, outcomes)
    api.close()
    return result | {"outcomes": [asdict(o) | {"itl_s": None, "text": None} for o in outcomes]}


def greedy_check(api: openai.OpenAI, model: str, adapter: str | None, seeds: list[int],
                 outcomes: list[HttpOutcome]) -> dict:
    """Every greedy request that completed under chaos, sent again undisturbed: its answer equal?"""
    done = [(seed, o) for seed, o in zip(seeds, outcomes)
            if o.greedy and o.error is None and o.finish_reason == "length"
            and o.kind in ("plain", "adapter")]
    with ThreadPoolExecutor(8) as pool:
        again = list(pool.map(lambda so: one_request(api, model, adapter, so[0], so[1].kind, 0.0), done))
    mismatched = [(seed, o.kind, o.api, o.stream) for (seed, o), a in zip(done, again)
                  if a.error is not None or a.text != o.text]
    return {"num_greedy_checked": len(done), "num_greedy_mismatched": len(mismatched),
            "greedy_mismatched": mismatched[:10]}
