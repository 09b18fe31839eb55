"""Do running streams stall while a long prompt prefills, or while a 5 MB body is refused?

    python -m benchmarks.bench_stall [--repeats 3] [--idle-s 5] [--prompt-len 4096] [--target-step-ms MS]
                                     [--max-prefill-stretch S] [--stream-tokens N]
                                     [--phases prefill,refusal_text,refusal_token_ids]

The TinyLlama-1.1B-shaped random checkpoint with a word tokenizer (benchmarks/checkpoints.py), q8_0 weights,
max_model_len 8192 (the shape's 2048 positions would refuse a 4,096-token prompt; random weights do not care),
served as bench_http serves it: one worker on every core, its router and HTTP server on the same cores, driven
over loopback by the `openai` AsyncOpenAI client in this process. The deployment keeps its own batching policy
(target_step_ms its default unless --target-step-ms), as a user gets it; --max-prefill-stretch paces prompt
chunks beside decodes (scheduling/prefill_pacing.py).

Each repeat opens 8 streamed completions (16 random prompt tokens each, ignore_eos, stream_interval_ms 0 so a
chunk is an engine step, max_tokens past the repeat's end; closed, and so aborted, when it ends; with
--stream-tokens N each stream is instead a run of N-token completions, the next, with new prompt tokens, as
soon as the last ends, so the streams' contexts stay under 16 + N tokens while a long prompt prefills: the
stall alone, not the streams' own growth; a gap is then between two chunks of one completion) and, once
every stream has its first tokens, runs these phases on them (idle first, the others in an order that flips
every repeat; --phases picks them):
- idle: nothing else for --idle-s seconds; the streams' inter-chunk gaps, p50 / p99 / max.
- prefill: a completion of --prompt-len random token ids, max_tokens 1, not streamed; the streams' gaps that
  overlap its time in flight, p99 over the idle p99 of the same repeat; then idle_after, an idle phase again
  (a paced prefill on a small CPU takes long enough for the streams' own contexts to grow thousands of
  tokens, and their decode step with them): the p99 over its p99 too.
- refusal_text, refusal_token_ids: a /v1/completions body of 5 MB, its prompt a 5,000,000-character string
  (words of the vocabulary, so it would tokenize) or 747,384 random token ids, refused with a 400
  context_length_exceeded (too long for max_model_len); posted from a thread from bytes encoded beforehand,
  so this process's loop only reads the streams. Meanwhile /health is asked every 20 ms from another thread.
  The streams' max gap overlapping the refusal's time in flight (and its excess over the idle max: the idle
  gap is the decode step, which on a small machine may itself pass 100 ms), and /health latency.
Every repeat's prompts are new random ones (drawn from os.urandom: no run saw them before). Figures are
medians over repeats. Writes benchmarks/results/stall.json and stall.png.
"""

import argparse
import asyncio
import http.client
import itertools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

from benchmarks.bench_http import MODEL, SERVED_NAME
from benchmarks.machine import cpu_name
from benchmarks.ports import free_port

RESULTS = Path(__file__).parent / "results"
ENGINE = {"weight_dtype": "q8_0", "max_num_seqs": 64, "max_num_batched_tokens": 512,
          "kv_cache_bytes": 1 << 30, "max_model_len": 8192}
NUM_STREAMS = 8
STREAM_PROMPT_LEN = 16
# more than any repeat lasts (a paced 4k prefill on a 2-core AVX2 CPU: ~0.5 s a step for most of an hour);
# the streams are closed when it ends. 8 such contexts and the long prompt fit kv_cache_bytes in int8 (~12 KB
# a token), so nothing is preempted
STREAM_MAX_TOKENS = 8000
BODY_CHARS = 5_000_000
BODY_KINDS = ("text", "token_ids")
REFUSALS = tuple(f"refusal_{kind}" for kind in BODY_KINDS)
PHASES = ("prefill", *REFUSALS)
HEALTH_INTERVAL_S = 0.02
# the client's timeout and every request's deadline_s (the server's default, 600 s, would end the streams too
# during a paced 4k prefill on a small CPU)
PREFILL_TIMEOUT_S = 3600.0
SETTLE_S = 1.0  # between phases, so one's tail does not land in the next


class Streams:
    """NUM_STREAMS streamed completions and the arrival time of each chunk with text, per stream and run: with
    stream_tokens, each stream is a run of completions of that many tokens, a new one (its prompt new random
    tokens) as soon as the last ends, so the streams' contexts stay between STREAM_PROMPT_LEN and
    STREAM_PROMPT_LEN + stream_tokens however long a phase lasts; without, one completion a stream, its
    context growing all along."""

    def __init__(self, client, rng: np.random.Generator, stream_tokens: int | None = None):
        self.client, self.rng, self.stream_tokens = client, rng, stream_tokens
        self.runs: list[list[list[float]]] = [[] for _ in range(NUM_STREAMS)]  # stream -> its runs' times
        self.tasks = [asyncio.ensure_future(self._stream(runs)) for runs in self.runs]

    @property
    def times(self) -> list[list[float]]:
        """Each stream's chunk times, every run's in order."""
        return [[t for run in runs for t in run] for runs in self.runs]

    async def _stream(self, runs: list[list[float]]) -> None:
        while True:
            runs.append([])
            await self._one(self.client, self.rng.integers(3, 32000, STREAM_PROMPT_LEN).tolist(), runs[-1],
                            self.stream_tokens or STREAM_MAX_TOKENS)
            if self.stream_tokens is None:
                return

    @staticmethod
    async def _one(client, prompt: list[int], times: list[float], max_tokens: int) -> None:
        stream = await client.completions.create(model=SERVED_NAME, prompt=prompt,
                                                 max_tokens=max_tokens, temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True,
                                                             "deadline_s": PREFILL_TIMEOUT_S})
        try:
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    times.append(time.perf_counter())
        finally:
            await stream.close()

    async def started(self, num_chunks: int = 4) -> None:
        while min(map(len, self.times)) < num_chunks:
            if any(t.done() for t in self.tasks):
                [t.result() for t in self.tasks if t.done()]  # raises what ended it
                raise RuntimeError("a stream ended before the repeat did; raise STREAM_MAX_TOKENS")
            await asyncio.sleep(0.05)

    def gaps(self, start: float, end: float) -> list[float]:
        """Every stream's gaps between consecutive chunks whose span overlaps [start, end]; a stream still
        waiting at `end` counts its open gap up to the next chunk (the caller waits for it)."""
        return [b - a for runs in self.runs for times in runs for a, b in itertools.pairwise(times)
                if b > start and a < end]  # within a run: a new run's first chunk is its own prefill's

    async def next_chunks(self, after: float) -> None:
        """Until every stream has a chunk after `after` (so a gap open at a phase's end is measured whole)."""
        while any(not times or times[-1] <= after for times in self.times):
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def big_body(kind: str, rng: np.random.Generator) -> bytes:
    """A completions body of ~5 MB: its prompt BODY_CHARS characters of vocabulary words ("text"), or as many
    random token ids as take BODY_CHARS characters ("token_ids")."""
    if kind == "text":
        prompt = " ".join(f"t{i}" for i in rng.integers(3, 32000, BODY_CHARS // 5))[:BODY_CHARS]
    else:
        prompt = rng.integers(3, 32000, int(BODY_CHARS / 6.69)).tolist()  # "12345, ": 6.69 characters an id
    return json.dumps({"model": SERVED_NAME, "prompt": prompt, "max_tokens": 16}).encode()


def post_blocking(url: str, body: bytes) -> tuple[int, float, float, str]:
    """(status, start, end, error code) of a POST made from this thread."""
    conn = http.client.HTTPConnection(urlsplit(url).netloc, timeout=600)
    try:
        start = time.perf_counter()
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        answer = response.read()
        end = time.perf_counter()
    finally:
        conn.close()
    code = json.loads(answer).get("error", {}).get("code") if response.status >= 400 else None
    return response.status, start, end, str(code)


def poll_health(url: str, stop: threading.Event) -> list[tuple[float, float]]:
    """(start, seconds) of each /health call until stop is set, over one keep-alive connection."""
    conn = http.client.HTTPConnection(urlsplit(url).netloc, timeout=60)
    samples = []
    try:
        while not stop.is_set():
            start = time.perf_counter()
            conn.request("GET", "/health")
            response = conn.getresponse()
            response.read()
            assert response.status == 200, response.status
            samples.append((start, time.perf_counter() - start))
            time.sleep(HEALTH_INTERVAL_S)
    finally:
        conn.close()
    return samples


def pct_ms(xs: list[float]) -> dict:
    return {"p50_ms": 1000 * float(np.percentile(xs, 50)), "p99_ms": 1000 * float(np.percentile(xs, 99)),
            "max_ms": 1000 * max(xs), "num_gaps": len(xs)}


async def idle_phase(streams: Streams, seconds: float) -> dict:
    start = time.perf_counter()
    await asyncio.sleep(seconds)
    end = time.perf_counter()
    await streams.next_chunks(end)
    return pct_ms(streams.gaps(start, end))


async def prefill_phase(client, streams: Streams, prompt: list[int]) -> dict:
    start = time.perf_counter()
    done = await client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=1, temperature=0,
                                           extra_body={"deadline_s": PREFILL_TIMEOUT_S})
    end = time.perf_counter()
    assert done.usage.prompt_tokens == len(prompt), done.usage
    await streams.next_chunks(end)
    return pct_ms(streams.gaps(start, end)) | {"prefill_s": end - start}


async def refusal_phase(url: str, streams: Streams, body: bytes) -> dict:
    stop = threading.Event()
    health = asyncio.ensure_future(asyncio.to_thread(poll_health, url, stop))
    await asyncio.sleep(0.2)  # a few /health calls before the body, for their idle latency
    try:
        status, start, end, code = await asyncio.to_thread(post_blocking, url, body)
        await asyncio.sleep(0.1)
    finally:
        stop.set()
        samples = await health
    await streams.next_chunks(end)
    during = [s for t, s in samples if start <= t + s and t <= end]  # calls in flight at some time of it
    before = [s for t, s in samples if t + s < start]
    return pct_ms(streams.gaps(start, end)) | {
        "status": status, "error_code": code, "body_bytes": len(body), "refusal_s": end - start,
        "health_max_ms": 1000 * max(during, default=float("nan")), "health_num_calls": len(during),
        "health_before_max_ms": 1000 * max(before, default=float("nan"))}


async def one_repeat(url: str, rep: int, prompt_len: int, idle_s: float, phases: tuple[str, ...],
                     stream_tokens: int | None) -> dict:
    import openai

    rng = np.random.default_rng(int.from_bytes(os.urandom(8)))  # prompts no run before this one saw
    # a paced prefill of a 4k prompt beside 8 streams takes over 10 minutes on a 2-core AVX2 CPU
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                timeout=PREFILL_TIMEOUT_S)
    long_prompt = rng.integers(3, 32000, prompt_len).tolist()
    bodies = {f"refusal_{kind}": big_body(kind, rng) for kind in BODY_KINDS}
    streams = Streams(client, rng, stream_tokens)
    try:
        await streams.started()
        result = {"idle": await idle_phase(streams, idle_s)}
        order = [p for p in ("prefill", *bodies) if p in phases]
        for phase in order if rep % 2 == 0 else order[::-1]:
            await asyncio.sleep(SETTLE_S)
            result[phase] = (await prefill_phase(client, streams, long_prompt) if phase == "prefill"
                             else await refusal_phase(url, streams, bodies[phase]))
            if phase == "prefill":  # the streams' contexts grew meanwhile, and with them their decode step
                await asyncio.sleep(SETTLE_S)
                result["idle_after"] = await idle_phase(streams, idle_s)
    finally:
        await streams.close()
        await client.close()
    if "prefill" in result:
        result["prefill"]["p99_over_idle_p99"] = result["prefill"]["p99_ms"] / result["idle"]["p99_ms"]
        result["prefill"]["p99_over_idle_after_p99"] = (result["prefill"]["p99_ms"]
                                                        / result["idle_after"]["p99_ms"])
    return result




def summary(reps: list[dict]) -> dict:
    def med(phase: str, key: str) -> float:
        return statistics.median(r[phase][key] for r in reps)
    out = {"idle": {k: med("idle", k) for k in ("p50_ms", "p99_ms", "max_ms")}}
    if "prefill" in reps[0]:
        out["idle_after"] = {k: med("idle_after", k) for k in ("p50_ms", "p99_ms", "max_ms")}
        out["prefill"] = {k: med("prefill", k) for k in ("p50_ms", "p99_ms", "max_ms", "p99_over_idle_p99",
                                                         "p99_over_idle_after_p99", "prefill_s")}
    for phase in (p for p in REFUSALS if p in reps[0]):
        out[phase] = {k: med(phase, k) for k in ("p50_ms", "p99_ms", "max_ms", "health_max_ms",
                                                 "health_before_max_ms", "refusal_s", "body_bytes")} | {
            "statuses": sorted({r[phase]["status"] for r in reps}),
            "error_codes": sorted({r[phase]["error_code"] for r in reps}),
            "max_gap_over_idle_max_ms": med(phase, "max_ms") - out["idle"]["max_ms"]}
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reps, s = results["repeats"], results["summary"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.4))
    phases = [p for p in ("idle", "prefill", "idle_after", *REFUSALS) if p in s]
    marks = (("p50_ms", "o", "#3a7"), ("p99_ms", "s", "#37a"), ("max_ms", "^", "#a33"))
    for i, phase in enumerate(phases):
        for j, (key, marker, color) in enumerate(marks):
            ys = [r[phase][key] for r in reps]
            axes[0].scatter([i + 0.1 * j] * len(ys), ys, marker=marker, color=color,
                            label=key.replace("_ms", "") if i == 0 else None)
    axes[0].set_xticks(range(len(phases)), [
        p.replace("_", " ") if p.startswith("idle") else f"{results['meta']['prompt_len']}-token\nprefill"
        if p == "prefill"
        else f"5 MB body refused\n(prompt: {p.removeprefix('refusal_').replace('_', ' ')})" for p in phases],
        fontsize=8)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("gap between a running stream's chunks (ms)")
    axes[0].axhline(100, color="#999", ls=":", lw=1)
    axes[0].legend(fontsize=8)
    axes[0].set_title(f"{NUM_STREAMS} running streams, every repeat", fontsize=10)
    refusals = [p for p in REFUSALS if p in s]
    x = np.arange(len(refusals))
    axes[1].bar(x - 0.2, [s[p]["max_ms"] for p in refusals], 0.4, color="#a33", label="streams' max gap")
    axes[1].bar(x + 0.2, [s[p]["health_max_ms"] for p in refusals], 0.4, color="#777", label="/health max")
    axes[1].axhline(s["idle"]["max_ms"], color="#3a7", ls="--", lw=1, label="streams' max gap when idle")
    axes[1].axhline(100, color="#999", ls=":", lw=1)
    axes[1].set_xticks(x, [f"prompt: {p.removeprefix('refusal_').replace('_', ' ')}" for p in refusals])
    axes[1].set_ylabel("ms (median over repeats)")
    axes[1].legend(fontsize=8)
    axes[1].set_title("while a 5 MB body is refused (goal: gaps < 100 ms)", fontsize=10)
    ratio = (f": prefill p99 / idle p99 = {s['prefill']['p99_over_idle_p99']:.2f} before, "
             f"{s['prefill']['p99_over_idle_after_p99']:.2f} after (goal <= 1.5)" if "prefill" in s else "")
    fig.suptitle(f"TinyLlama-1.1B-shaped q8_0, {results['meta']['num_cores']} cores{ratio}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="repeats of the three phases")
    parser.add_argument("--idle-s", type=float, default=5.0, help="length of the idle phase")
    parser.add_argument("--prompt-len", type=int, default=4096, help="tokens of the long prompt")
    parser.add_argument("--phases", default=",".join(PHASES), type=lambda s: tuple(s.split(",")),
                        help="phases after idle, comma-separated (a quick look: --phases refusal_text)")
    parser.add_argument("--target-step-ms", type=float, default=None,
                        help="the deployment's target_step_ms (default: ClusterConfig's)")
    parser.add_argument("--max-prefill-stretch", type=float, default=None,
                        help="the engine's max_prefill_stretch (default: EngineConfig's, no pacing)")
    parser.add_argument("--stream-tokens", type=int, default=None,
                        help="each stream a run of completions of this many tokens, a new one as the last "
                             "ends (contexts that stay short however long the prefill takes); default: one "
                             "completion a stream, its context growing all along")
    parser.add_argument("--out", default=str(RESULTS / "stall.json"),
                        help="JSON to write (and the PNG beside it)")
    args = parser.parse_args(argv)
    if args.stream_tokens is not None and args.stream_tokens < 1:
        parser.error(f"--stream-tokens is a completion's tokens, at least 1 (got {args.stream_tokens})")
    import ray

    import numaserve as ns
    from benchmarks.checkpoints import with_word_tokenizer

    model = str(with_word_tokenizer(MODEL))
    cores = sorted(os.sched_getaffinity(0))
    load_before = os.getloadavg()
    registry = tempfile.TemporaryDirectory(prefix="bench-stall-")
    extra = {} if args.target_step_ms is None else {"target_step_ms": args.target_step_ms}
    engine = ENGINE | ({} if args.max_prefill_stretch is None
                       else {"max_prefill_stretch": args.max_prefill_stretch})
    config = ns.ClusterConfig(
        model=model, engine=engine, machines=[{"name": "stall", "numa_nodes": [{"id": 0, "cpus": cores}]}],
        stream_interval_ms=0, adapter_registry=str(Path(registry.name) / "adapters.json"),
        http={"port": free_port(), "served_model_name": SERVED_NAME, "max_tokens_cap": STREAM_MAX_TOKENS},
        **extra)
    ray.init(num_cpus=len(cores), resources=config.ray_resources("stall"), include_dashboard=False,
             namespace="numaserve", log_to_driver=False)
    start = time.perf_counter()
    client = ns.serve(config, name="bench-stall")
    print(f"deployed in {time.perf_counter() - start:.0f} s", flush=True)
    reps = []
    try:
        for rep in range(args.repeats):
            reps.append(asyncio.run(one_repeat(client.http_url, rep, args.prompt_len, args.idle_s,
                                               args.phases, args.stream_tokens)))
            print(f"rep {rep}: " + json.dumps({p: {k: round(v, 3) if isinstance(v, float) else v
                                                   for k, v in r.items()} for p, r in reps[-1].items()}),
                  flush=True)
    finally:
        client.shutdown()
        ray.shutdown()
    results = {"meta": {"command": "python -m benchmarks.bench_stall " + " ".join(
                            sys.argv[1:] if argv is None else argv),
                        "model": f"{MODEL} (random weights, word tokenizer)", "engine": engine,
                        "target_step_ms": config.target_step_ms, "num_streams": NUM_STREAMS,
                        "stream_prompt_len": STREAM_PROMPT_LEN, "stream_tokens": args.stream_tokens,
                        "prompt_len": args.prompt_len,
                        "idle_s": args.idle_s, "body": f"/v1/completions, prompt a {BODY_CHARS}-character "
                                                      "string of vocabulary words",
                        "repeats": args.repeats, "num_cores": len(cores), "cpu": cpu_name(),
                        "date": time.strftime("%Y-%m-%d %H:%M"), "load_average_before": load_before,
                        "load_average_after": os.getloadavg()},
               "summary": summary(reps), "repeats": reps}
    out = Path(args.out)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    plot(results, out.with_suffix(".png"))
    s = results["summary"]
    print(f"idle: gaps p50 {s['idle']['p50_ms']:.0f} p99 {s['idle']['p99_ms']:.0f} max "
          f"{s['idle']['max_ms']:.0f} ms")
    if "prefill" in s:
        print(f"prefill of {args.prompt_len} tokens ({s['prefill']['prefill_s']:.1f} s): gaps p99 "
              f"{s['prefill']['p99_ms']:.0f} ms = {s['prefill']['p99_over_idle_p99']:.2f}x idle p99 before, "
              f"{s['prefill']['p99_over_idle_after_p99']:.2f}x after ({s['idle_after']['p99_ms']:.0f} ms), "
              f"max {s['prefill']['max_ms']:.0f} ms")
    for phase in (p for p in REFUSALS if p in s):
        r = s[phase]
        print(f"{phase}: {r['body_bytes'] / 1e6:.1f} MB, {r['statuses']} {r['error_codes']} in "
              f"{1000 * r['refusal_s']:.0f} ms; streams' max gap {r['max_ms']:.0f} ms (idle max "
              f"{s['idle']['max_ms']:.0f}), /health max {r['health_max_ms']:.0f} ms (before it: "
              f"{r['health_before_max_ms']:.0f})")

if __name__ == "__main__":
    main()
