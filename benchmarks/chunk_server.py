"""The real OpenAI HTTP app (http_api/app.build_app inside the actor's Lifecycle, served by uvicorn as
the HTTP actor serves it) over a stub deployment whose streams replay made-up outputs, one token each, --rate
chunks a second over all streams: the server side of benchmarks/bench_chunk_cpu.py, in a process of its
own so its CPU time is its own.

    python benchmarks/chunk_server.py [--rate 400]     (with PYTHONPATH=<a numaserve source tree>)

Run by path, not with -m: the numaserve modules come from PYTHONPATH, so the same server runs against
another revision's tree (an A/B). It prints its port on the first line of stdout and serves until stdin
closes.
"""

import argparse
import asyncio
import socket
import sys

import uvicorn
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from cluster_configs.cluster_config import HttpConfig
from http_api.app import build_app
from http_api.chat_template import ChatTemplate
from http_api.lifecycle import Lifecycle, log_access_to_stderr
from http_api.serving import OpenAIServing
from models.tokenizer import Tokenizer
from scheduling.outputs import RequestOutput

VOCAB_SIZE = 1000  # words t0 ... t999; every token is a word, so every chunk carries text
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def word_tokenizer() -> Tokenizer:
    hf = HFTokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB_SIZE)}, unk_token="t0"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(hf)


class ReplayStream:
    """The prompt's ids, then max_tokens outputs of one token each (" t<id>"), the last with
    finish_reason "length"; each output waits (streams open now) / rate seconds, so that all the streams
    together send `rate` chunks a second, as streams wait for their next engine step."""

    def __init__(self, deployment: "ReplayDeployment", prompt, max_tokens: int):
        self.deployment = deployment
        self.prompt_ids = prompt if isinstance(prompt, list) else [1, 2, 3]
        self.num_left = max_tokens
        self.opened = False

    async def next(self):
        if not self.opened:
            self.opened = True
            self.deployment.num_open += 1
            return self.prompt_ids
        if self.num_left < 1:
            raise RuntimeError("read past the end of the stream")
        await asyncio.sleep(self.deployment.num_open / self.deployment.rate)
        self.num_left -= 1
        if self.num_left == 0:
            self.deployment.num_open -= 1
        token_id = 3 + self.num_left % (VOCAB_SIZE - 3)
        return RequestOutput("stub", [token_id], f" t{token_id}", "length" if self.num_left == 0 else None)

    def cancel(self) -> None:
        pass


class ReplayDeployment:
    def __init__(self, rate: float):
        self.rate = rate  # chunks a second over all streams
        self.num_open = 0
        self.tokenizer = word_tokenizer()

    def generate(self, prompt, params, adapter, cache_salt=None) -> ReplayStream:
        return ReplayStream(self, prompt, params.max_tokens)

    async def model_info(self) -> dict:
        return {"tokenizer": self.tokenizer, "vocab_size": VOCAB_SIZE, "max_model_len": 4096}

    async def adapter_path(self, name: str) -> None:
        return None

    async def num_serving_workers(self) -> int:
        return 1


async def serve(rate: float) -> None:
    serving = OpenAIServing(ReplayDeployment(rate), "stub", "/stub", ChatTemplate(TEMPLATE), False,
                            "fp_bench", HttpConfig())
    sock = socket.create_server(("127.0.0.1", 0))
    log_access_to_stderr()  # a line per request, as the HTTP actor writes
    server = uvicorn.Server(uvicorn.Config(Lifecycle(build_app(serving)), lifespan="off", log_config=None,
                                           log_level="warning", access_log=False))
    serving_task = asyncio.create_task(server.serve(sockets=[sock]))
    print(sock.getsockname()[1], flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent goes
    server.should_exit = True
    await serving_task


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=400.0, help="chunks a second over all streams")
    asyncio.run(serve(parser.parse_args().rate))
