"""LocalDeployment (test support): the Deployment OpenAIServing serves (http_api/serving.py) over one engine
in this process (an Engine and its EngineLoop, as numaserve.LLM holds them), without Ray, so the tests drive
the real HTTP app with the `openai` client against a real model in one process.

Each request is validated and tokenized in a worker thread (never on the event loop: compiling a grammar takes
milliseconds), submitted to the LLM's engine loop with deltas, and its outputs are read from its outbox in a
worker thread too. cancel() aborts it on the engine loop, which frees its KV blocks at once.
"""

import asyncio
import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import numpy as np

from cluster_configs.sampling_params import SamplingParams
from scheduling.embedding import embed
from scheduling.engine import Engine
from scheduling.engine_loop import EngineLoop, Pending
from scheduling.validation import encode_prompt

MAX_WAITING_READERS = 256  # threads blocked on outboxes at once: each open choice holds one while it waits

_ids = itertools.count()


class InProcessEngine(Protocol):
    """What a LocalDeployment serves: numaserve.LLM is one."""

    engine: Engine
    engine_loop: EngineLoop


class LocalRequestStream:
    def __init__(self, deployment: "LocalDeployment", prompt, params: SamplingParams, adapter: str | None,
                 cache_salt: str | None):
        self.deployment = deployment
        self.args = (prompt, params, adapter, cache_salt)
        self.pending: Pending | None = None
        self.outputs = None
        self.done = self.cancelled = False

    async def next(self):
        """The prompt's token ids first (InvalidRequest here if the request is invalid), then its outputs."""
        if self.outputs is None:
            await self.deployment.run(self._submit)
            return self.pending.request.token_ids[:self.pending.request.num_prompt_tokens]
        out = await self.deployment.run(next, self.outputs)
        self.done = out.finished
        return out

    def _submit(self) -> None:
        prompt, params, adapter, cache_salt = self.args
        loop = self.deployment.llm.engine_loop
        req = self.deployment.llm.engine.make_request(f"http-{next(_ids)}", prompt, params, adapter=adapter,
                                                      cache_salt=cache_salt)
        [self.pending] = loop.submit([req], deltas=True)
        self.outputs = self.pending.outputs()
        if self.cancelled:  # cancelled while it was being submitted (cancel() saw no pending yet)
            loop.abort(req.request_id)

    def cancel(self) -> None:
        """Abort the request unless it has finished. Runs on the event loop, possibly while _submit runs in
        a worker thread: each sets its own field before reading the other's, so one of them aborts."""
        self.cancelled = True
        if self.pending is not None and not self.done:
            self.done = True
            self.deployment.llm.engine_loop.abort(self.pending.request.request_id)


class LocalDeployment:
    def __init__(self, llm: InProcessEngine):
        self.llm = llm
        self.readers = ThreadPoolExecutor(MAX_WAITING_READERS, thread_name_prefix="numaserve-http-reader")

    async def run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.readers, fn, *args)

    def generate(self, prompt, params: SamplingParams, adapter: str | None,
                 cache_salt: str | None = None) -> LocalRequestStream:
        return LocalRequestStream(self, prompt, params, adapter, cache_salt)

    async def model_info(self) -> dict:
        engine = self.llm.engine
        return {"tokenizer": engine.tokenizer, "vocab_size": engine.spec.vocab_size,
                "max_model_len": engine.max_model_len}

    async def adapter_path(self, name: str) -> str | None:
        return (await self.adapters()).get(name)

    async def adapters(self) -> dict[str, str]:
        def sources(engine) -> dict[str, str]:
            return {name: str(engine.adapters.sources[i]) for name, i in engine.adapters.served.items()}

        return await self.run(self.llm.engine_loop.call, sources)

    async def register_adapter(self, name: str, path: str) -> str:
        await self.run(self.llm.engine_loop.call, lambda engine: engine.register_adapter(name, path))
        return (await self.adapters())[name]

    async def unload_adapter(self, name: str) -> None:
        await self.run(self.llm.engine_loop.call, lambda engine: engine.unload_adapter(name))

    async def embed(self, prompts: list, pooling: str, adapter: str | None,
                    cache_salt: str | None = None) -> tuple[list[list[int]], np.ndarray]:
        """Each prompt's token ids and its final hidden states pooled, L2-normalized (LLM.embed)."""
        engine = self.llm.engine
        ids = [encode_prompt(p, engine.tokenizer, engine.spec.vocab_size) for p in prompts]
        return ids, await self.run(embed, self.llm.engine_loop, engine, ids, pooling, True, adapter)

    async def num_serving_workers(self) -> int:
        return 0 if self.llm.engine_loop.closed else 1

    async def metrics(self) -> list[dict]:
        return []  # the Prometheus series are the workers' (actors/metrics.py); an LLM has its stats()

    async def live(self) -> dict:
        """The router's live view, the engine its one worker."""
        return {"time": time.time(), "workers": {"local": await self.run(self.llm.stats) | {"alive": True}},
                "routed": {}}
