"""CPU time per streamed chunk of the serving path around the engine, in CPU seconds (not wall time), so the
figures hold however loaded the machine is.

    python -m benchmarks.bench_chunk_cpu [--streams 1,16] [--max-tokens 32] [--chunks 2048] [--rate 400]
                                         [--repeats 3] [--source DIR ...] [--ray] [--json PATH]

HTTP: benchmarks/chunk_server.py (the real app, with its middleware and sse-starlette, over a stub
deployment whose streams replay one-token outputs; every stream waits (streams open)/rate seconds before
each, so all of them together send `rate` chunks a second) in a process of its own, driven over loopback by
asyncio `openai` clients in this one: chat and completions, streamed with include_usage, c streams in a
closed loop until about --chunks token chunks are in. Per token chunk (the role chunk, the usage chunk,
[DONE] and each request's own costs spread over them): the server process's CPU seconds and this process's
(the client's), psutil cpu_times user + system of every thread (counted in 10 ms ticks: over 2048 chunks,
5 us a chunk), the median over the repeats. With several --source trees (numaserve source trees, e.g. another
revision's `git archive`) the servers alternate, the order flipping every repeat: an A/B of revisions.

Ray (--ray; starts a local Ray, so run it alone): the hop from a worker-like actor's streaming generator (a
RequestOutput per yield, paced as above) to an async caller actor that reads each item as
actors/request_stream.py does (`await (await refs.__anext__())`); CPU seconds per item of each actor's
process (its Ray core worker threads included).
"""

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
SERVER = Path(__file__).with_name("chunk_server.py")
ENDPOINTS = ("chat", "completions")


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


# ---- HTTP --------------------------------------------------------------------------------------------------

class Server:
    """benchmarks/chunk_server.py over the numaserve tree `source`, in its own process."""

    def __init__(self, source: Path, rate: float):
        self.source = source
        self.process = subprocess.Popen(
            [sys.executable, str(SERVER), "--rate", str(rate)], cwd=source, env=os.environ | {
                "PYTHONPATH": str(source)}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True)
        self.url = f"http://127.0.0.1:{int(self.process.stdout.readline())}/v1"
        self.ps = psutil.Process(self.process.pid)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=30)


async def _stream(client, endpoint: str, max_tokens: int) -> None:
    """One streamed request, read to its end; its usage checked."""
    common = {"model": "stub", "max_tokens": max_tokens, "stream": True,
              "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        stream = await client.chat.completions.create(messages=[{"role": "user", "content": "t1 t2 t3"}],
                                                      **common)
    else:
        stream = await client.completions.create(prompt=[1, 2, 3, 4, 5, 6, 7, 8], **common)
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
    if usage is None or usage.completion_tokens != max_tokens:
        raise RuntimeError(f"{endpoint}: the stream ended with usage {usage}")


async def measure_http(server: Server, client, endpoint: str, num_streams: int, num_requests: int,
                       max_tokens: int) -> dict:
    """Closed loop of num_streams streams until num_requests are done -> CPU ms per token chunk."""
    left = num_requests

    async def closed_loop() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await _stream(client, endpoint, max_tokens)

    me = psutil.Process()
    server_s, client_s = _cpu_s(server.ps), _cpu_s(me)
    await asyncio.gather(*(closed_loop() for _ in range(num_streams)))
    num_chunks = num_requests * max_tokens
    return {"server_ms": (_cpu_s(server.ps) - server_s) / num_chunks * 1e3,
            "client_ms": (_cpu_s(me) - client_s) / num_chunks * 1e3}


async def run_http(sources: list[Path], streams: list[int], max_tokens: int, chunks: int, rate: float,
                   repeats: int) -> list[dict]:
    import openai

    servers = [Server(source, rate) for source in sources]
    try:
        clients = [openai.AsyncOpenAI(base_url=s.url, api_key="unused", max_retries=0, timeout=120)
                   for s in servers]
        levels = [(endpoint, c) for endpoint in ENDPOINTS for c in streams]
        for server, client in zip(servers, clients):  # warm-up: imports, first connections, caches
            for endpoint, c in levels:
                await measure_http(server, client, endpoint, c, c, max_tokens)
        samples: dict[tuple, list[dict]] = {}
        for repeat in range(repeats):
            order = list(zip(servers, clients))
            for server, client in order if repeat % 2 == 0 else order[::-1]:
                for endpoint, c in levels:
                    num_requests = max(c, -(-chunks // max_tokens) // c * c)
                    sample = await measure_http(server, client, endpoint, c, num_requests, max_tokens)
                    samples.setdefault((str(server.source), endpoint, c), []).append(sample)
        for client in clients:
            await client.close()
    finally:
        for server in servers:
            server.close()
    return [{"source": source, "endpoint": endpoint, "streams": c,
             **{key: statistics.median(s[key] for s in runs) for key in ("server_ms", "client_ms")},
             "samples": runs} for (source, endpoint, c), runs in samples.items()]


# ---- Ray ---------------------------------------------------------------------------------------------------

def run_ray(streams: list[int], max_tokens: int, chunks: int, rate: float, repeats: int) -> list[dict]:
    import ray

    from scheduling.outputs import RequestOutput

    @ray.remote(num_cpus=0)
    class Producer:
        """A worker's generate(): a RequestOutput per yield, every interval_s."""

        def pid(self) -> int:
            return os.getpid()

        @ray.method(num_returns="streaming")
        async def generate(self, num_items: int, interval_s: float):
            for i in range(num_items):
                await asyncio.sleep(interval_s)
                yield RequestOutput("bench-0", [i], f" t{i}", "length" if i == num_items - 1 else None)

    @ray.remote(num_cpus=0)
    class Caller:
        """An HTTP actor's RequestStream.next(): each item read off the stream's ObjectRefGenerator."""

        def pid(self) -> int:
            return os.getpid()

        async def read(self, producer, num_streams: int, num_requests: int, num_items: int,
                       interval_s: float) -> int:
            left = num_requests

            async def closed_loop() -> int:
                nonlocal left
                num_read = 0
                while left > 0:
                    left -= 1
                    refs = producer.generate.remote(num_items, interval_s)
                    while not (await (await refs.__anext__())).finished:
                        num_read += 1
                    num_read += 1
                return num_read

            return sum(await asyncio.gather(*(closed_loop() for _ in range(num_streams))))

    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        producer, caller = Producer.remote(), Caller.remote()
        producer_ps, caller_ps = (psutil.Process(ray.get(a.pid.remote())) for a in (producer, caller))
        ray.get(caller.read.remote(producer, 1, 4, max_tokens, 0.0))  # warm-up
        samples: dict[int, list[dict]] = {}
        for _ in range(repeats):
            for c in streams:
                num_requests = max(c, -(-chunks // max_tokens) // c * c)
                before = _cpu_s(producer_ps), _cpu_s(caller_ps)
                num_read = ray.get(caller.read.remote(producer, c, num_requests, max_tokens, c / rate))
                samples.setdefault(c, []).append(
                    {"producer_ms": (_cpu_s(producer_ps) - before[0]) / num_read * 1e3,
                     "caller_ms": (_cpu_s(caller_ps) - before[1]) / num_read * 1e3})
        return [{"streams": c, **{key: statistics.median(r[key] for r in runs)
                                  for key in ("producer_ms", "caller_ms")}, "samples": runs}
                for c, runs in samples.items()]
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="1,16")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=2048, help="token chunks per measurement, about")
    parser.add_argument("--rate", type=float, default=400.0, help="chunks a second over all streams")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--source", type=Path, action="append",
                        help="a numaserve source tree to serve from (repeatable; default: this one)")
    parser.add_argument("--ray", action="store_true", help="the Ray hop instead of HTTP")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    streams = [int(c) for c in args.streams.split(",")]
    if args.ray:
        results = run_ray(streams, args.max_tokens, args.chunks, args.rate, args.repeats)
        print("streams  producer ms/item  caller ms/item")
        for r in results:
            print(f"{r['streams']:>7}  {r['producer_ms']:>16.3f}  {r['caller_ms']:>14.3f}")
    else:
        sources = [s.resolve() for s in args.source or [ROOT]]
        results = asyncio.run(run_http(sources, streams, args.max_tokens, args.chunks, args.rate,
                                       args.repeats))
        print("source                           endpoint     streams  server ms/chunk  client ms/chunk")
        for r in results:
            print(f"{r['source'][-32:]:<32} {r['endpoint']:<12} {r['streams']:>7}  {r['server_ms']:>15.3f}  "
                  f"{r['client_ms']:>15.3f}")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "results": results}, indent=1))


if __name__ == "__main__":
    main()
