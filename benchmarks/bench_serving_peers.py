"""`numaserve serve` against llama.cpp's own server, through the `openai` client.

    python -m benchmarks.bench_serving_peers [--streams 1,8,32] [--requests-per-stream 2] [--samples 3]

Both servers serve the same weights: the TinyLlama-shaped random checkpoint (benchmarks/checkpoints.py) in
q8_0, exported to GGUF by numaserve (the file bench_decode uses); numaserve serves that GGUF. Each server is
its own process tree, started from the command line with its defaults except:
- llama-server (benchmarks/llama_server.py builds it from the llama.cpp inside the installed
  llama-cpp-python's sdist): `-t` = this machine's cores, `-np` = the largest stream count (one slot per
  stream), `-c` = slots x (prompt + output) tokens, `-lm none` (no mmap: the VM reclaims idle file pages),
  `--no-webui`;
- numaserve: `numaserve serve --config cluster_configs/local.yaml --model GGUF --http-port P` (one worker per
  NUMA node on its cores: one worker on this one-node VM). Workload: closed loops of S streams (1, 8, 32);
  each stream sends `requests-per-stream` requests one after the other: a completion of 128 random token ids
  (drawn afresh for every request of every sample: no prefix cache serves one from another), 64 tokens,
  greedy, ignore_eos, streamed. Per sample: output tokens/s (tokens over the wall time from the first request
  to the last token), TTFT (send to the first streamed token) and ITL (a request's time from its first token
  to its last over its tokens - 1: chunking-neutral, since numaserve streams several tokens a chunk)
  percentiles. The servers alternate sample by sample, the order flipping every sample; one untimed sample of
  each first (numba compiles or loads its kernels, both touch their KV). Medians over samples, ratios
  numaserve / llama-server. Both servers stay up for the whole run and idle while the other is measured.
  Writes benchmarks/results/serving_peers.json and .png."""

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import numpy as np

from benchmarks.checkpoints import CACHE
from benchmarks.llama_server import llama_server_binary
from benchmarks.machine import cpu_name
from benchmarks.ports import free_port

RESULTS = Path(__file__).parent / "results"
REPO = Path(__file__).resolve().parents[1]
SERVERS = ("numaserve", "llama-server")
START_TIMEOUT_S = 600.0
# llama.cpp's tokenizer of the exported GGUF: every id of 3..31999 is an ordinary token
TOKEN_RANGE = (3, 32000)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", default=str(CACHE / "tinyllama-1.1b-q8_0.gguf"),
                        help="the weights both serve (run benchmarks.bench_decode once to export it)")
    parser.add_argument("--streams", default="1,8,32", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--samples", type=int, default=3, help="timed samples per server and stream count")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--out", default=str(RESULTS / "serving_peers.json"))
    return parser


class Server:
    """One server under test: its process, its base URL."""

    def __init__(self, name: str, argv: list[str], port: int):
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}/v1"
        # its output, for a failure's message (closed in close())
        self.log = tempfile.NamedTemporaryFile("w", prefix=f"{name}-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO)

    def wait_ready(self, model: str) -> None:
        import openai

        client = openai.OpenAI(base_url=self.url, api_key="none", max_retries=0, timeout=5.0)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                client.completions.create(model=model, prompt=[5, 6, 7], max_tokens=1, temperature=0)
                return
            except openai.OpenAIError:
                time.sleep(1.0)
        raise RuntimeError(f"{self.name} did not answer within {START_TIMEOUT_S} s (log: {self.log.name})")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def start_servers(args, num_slots: int) -> dict[str, Server]:
    bin_dir = Path(sys.executable).parent
    port = free_port()
    ours = Server("numaserve", [str(bin_dir / "numaserve"), "serve", "--config", "cluster_configs/local.yaml",
                                "--model", args.gguf, "--http-port", str(port), "--name", "bench-peers",
                                "--served-model-name", "model", "--drain-timeout-s", "5"], port)
    # in the foreground: close()'s SIGTERM drains it and stops the Ray instance it started
    port = free_port()
    context = num_slots * (args.prompt_len + args.max_tokens + 16)
    theirs = Server("llama-server", [str(llama_server_binary()), "-m", args.gguf, "--host", "127.0.0.1",
                                     "--port", str(port), "-t", str(args.threads), "-np", str(num_slots),
                                     "-c", str(context), "-lm", "none", "--no-webui", "-a", "model"], port)
    return {"numaserve": ours, "llama-server": theirs}


async def one_request(client, prompt: list[int], max_tokens: int) -> dict:
    start = time.perf_counter()
    times, num_tokens = [], 0
    stream = await client.completions.create(
        model="model", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
        if chunk.usage is not None:
            num_tokens = chunk.usage.completion_tokens
    if num_tokens != max_tokens:
        raise RuntimeError(f"a request generated {num_tokens} tokens, asked for {max_tokens}")
    return {"ttft_s": times[0] - start, "itl_s": (times[-1] - times[0]) / (num_tokens - 1), "end": times[-1],
            "start": start, "tokens": num_tokens}


async def closed_loop(url: str, prompts: list[list[list[int]]], max_tokens: int) -> list[dict]:
    """prompts[stream][k]: stream's k-th request."""
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=600.0)

    async def stream(requests: list[list[int]]) -> list[dict]:
        return [await one_request(client, p, max_tokens) for p in requests]

    try:
        per_stream = await asyncio.gather(*(stream(r) for r in prompts))
    finally:
        await client.close()
    return [r for rs in per_stream for r in rs]


def sample(server: Server, num_streams: int, args, rng: np.random.Generator) -> dict:
    prompts = [[rng.integers(*TOKEN_RANGE, args.prompt_len).tolist() for _ in range(args.requests_per_stream)]
               for _ in range(num_streams)]
    records = asyncio.run(closed_loop(server.url, prompts, args.max_tokens))
    wall = max(r["end"] for r in records) - min(r["start"] for r in records)
    ttft = sorted(r["ttft_s"] for r in records)
    itl = sorted(r["itl_s"] for r in records)
    return {"tokens_per_s": sum(r["tokens"] for r in records) / wall,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99), "num_requests": len(records)}


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def summarize(samples: list[dict]) -> dict:
    return {k: statistics.median(s[k] for s in samples) for k in samples[0] if k != "num_requests"} | {
        "samples": samples}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = list(results["levels"])
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = (("tokens_per_s", "output tokens/s"), ("ttft_p50_s", "TTFT p50 (s)"),
              ("itl_p50_s", "ITL p50 (s)"))
    for ax, (key, label) in zip(axes, panels, strict=True):
        for i, name in enumerate(SERVERS):
            values = [results["levels"][c][name][key] for c in levels]
            ax.bar(np.arange(len(levels)) + 0.4 * i, values, 0.4, label=name)
        ax.set_xticks(np.arange(len(levels)) + 0.2, [f"{c} streams" for c in levels])
        ax.set_title(label)
    axes[0].legend()
    fig.suptitle(f"numaserve serve vs llama-server, {results['meta']['model']}, {results['meta']['cpu']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if not Path(args.gguf).exists():
        raise SystemExit(f"{args.gguf} does not exist: run `python -m benchmarks.bench_decode --dtypes q8_0` "
                         "once to export it")
    servers = start_servers(args, max(args.streams))
    raw = {c: {name: [] for name in SERVERS} for c in args.streams}
    rng = np.random.default_rng(int(time.time()))  # fresh prompts every run
    try:
        for server in servers.values():
            server.wait_ready("model")
        for name in SERVERS:  # untimed: compiles, KV pages touched
            for c in args.streams:
                sample(servers[name], c, args, rng)
        for k in range(args.samples):
            for c in args.streams:
                for name in (SERVERS if k % 2 == 0 else SERVERS[::-1]):
                    raw[c][name].append(sample(servers[name], c, args, rng))
                    print(json.dumps({"sample": k, "streams": c, "server": name,
                                      **{m: round(v, 4) for m, v in raw[c][name][-1].items()}}), flush=True)
    finally:
        for server in servers.values():
            server.close()
    levels = {}
    for c, by_server in raw.items():
        level = {name: summarize(samples) for name, samples in by_server.items()}
        ours, theirs = level["numaserve"], level["llama-server"]
        level["throughput_ratio"] = ours["tokens_per_s"] / theirs["tokens_per_s"]
        level["ttft_p50_ratio"] = ours["ttft_p50_s"] / theirs["ttft_p50_s"]
        levels[str(c)] = level
    results = {"meta": {"date": datetime.now().isoformat(timespec="minutes"), "cpu": cpu_name(),
                        "model": Path(args.gguf).name, "threads": args.threads, "prompt_len": args.prompt_len,
                        "max_tokens": args.max_tokens, "requests_per_stream": args.requests_per_stream,
                        "samples": args.samples, "command": "python -m benchmarks.bench_serving_peers "
                        + " ".join(argv if argv is not None else sys.argv[1:])},
               "levels": levels}
    out = Path(args.out)
    out.write_text(json.dumps(results, indent=1))
    plot(results, out.with_suffix(".png"))
    for c, level in levels.items():
        ours, theirs = level["numaserve"], level["llama-server"]
        print(f"{c} streams: {ours['tokens_per_s']:.1f} vs {theirs['tokens_per_s']:.1f} tok/s "
              f"({level['throughput_ratio']:.2f}x), TTFT p50 {ours['ttft_p50_s']:.3f} vs "
              f"{theirs['ttft_p50_s']:.3f} s")


if __name__ == "__main__":
    main()
