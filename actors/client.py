"""Client: a handle on a running deployment, from any driver or `ray job submit` entrypoint.

Requests go as actors/request_stream.py lays out: tokenized and validated here (the tokenizer is fetched once
per client), placed by a router, streamed straight from the worker. A client admits through the router its
own id hashes to among the deployment's (router.replicas), and through the next one while that one is lost.
That module is async (the HTTP actor awaits it on its event loop); a client runs it on an event loop of its
own (actors/client_streams.py), so any number of the driver's threads may stream at once.
"""

import hashlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import ray
from ray.exceptions import RayActorError, RayTaskError

from actors.client_session import ClientSession
from actors.client_streams import ClientStreams, complete
from actors.deployment_actors import shutdown
from actors.ray_errors import unwrap
from actors.request_stream import Ingress
from cluster_configs.sampling_params import SamplingParams
from scheduling.outputs import Completion, RequestOutput


def _get(ref, actor: str = "router"):
    """ray.get, raising numaserve's own errors (InvalidRequest, Overloaded, ...) as themselves, and the death
    of the actor called (router, adapter cache) as Unavailable."""
    try:
        return ray.get(ref)
    except (RayTaskError, RayActorError) as e:
        raise unwrap(e, actor) from None


class Client:
    def __init__(self, name: str, routers: list, adapter_cache, http_url: str | None = None):
        self.name = name
        self.adapter_cache = adapter_cache
        # the OpenAI-compatible API (e.g. "http://127.0.0.1:8000"), if the deployment has one
        self.http_url = http_url
        self.client_id = uuid.uuid4().hex
        first = int.from_bytes(hashlib.blake2b(self.client_id.encode(), digest_size=4).digest(), "big")
        self._streams = ClientStreams(Ingress(routers, adapter_cache, first))

    def stream(self, prompt, params: SamplingParams | None = None, adapter: str | None = None,
               session: str | None = None, cache_salt: str | None = None) -> Iterator[RequestOutput]:
        """Deltas of one completion (.text, .token_ids, .finish_reason, .logprobs when asked); closing the
        iterator aborts it. cache_salt: share cached prefix blocks only with requests of the same salt."""
        yield from self._streams.deltas(self._streams.open(prompt, params, adapter, session, cache_salt))

    def generate(self, prompt, params: SamplingParams | None = None, adapter: str | None = None,
                 session: str | None = None, cache_salt: str | None = None) -> Completion:
        stream = self._streams.open(prompt, params, adapter, session, cache_salt)
        return complete(stream.admission.prompt_token_ids, self._streams.deltas(stream))

    def session(self, adapter: str | None = None, cache_salt: str | None = None) -> ClientSession:
        """A session: sequences that keep their KV between turns on the worker the session is pinned to
        (actors/client_session.py)."""
        return ClientSession(self._streams, adapter, cache_salt)

    @property
    def router(self):
        """The router this client admits through now (stats and pauses are asked of it too)."""
        return self._streams.ingress.router

    def register_adapter(self, name: str, path: str | Path) -> str:
        """Register a PEFT adapter directory under name (kept across restarts); AdapterError if it is
        invalid. Other weights under a registered name are its new version: requests admitted before keep
        the old weights to their end."""
        return _get(self.adapter_cache.register.remote(name, str(path)), "adapter cache")

    def unload_adapter(self, name: str) -> None:
        """Serve the adapter no more (kept across restarts): requests admitted before finish on its weights,
        new ones naming it are refused; registered again, it is a new version. AdapterError if no adapter has
        that name."""
        _get(self.adapter_cache.unload.remote(name), "adapter cache")

    def compose_adapter(self, name: str, weights: dict[str, float], combination: str = "svd") -> None:
        """Register `name` as the weighted combination of registered adapters, as PEFT's add_weighted_adapter
        builds it: combination "cat", "linear" or "svd" (kept across restarts); AdapterError if it cannot
        be."""
        _get(self.adapter_cache.compose.remote(name, weights, combination), "adapter cache")

    def stats(self) -> dict:
        """The router's figures, each worker's, the policies, and the adapter cache's (under
        "adapter_cache")."""
        return _get(self.router.stats.remote()) | {"adapter_cache": _get(self.adapter_cache.stats.remote(),
                                                                         "adapter cache")}

    def pause_generation(self, worker_ids: list[str] | None = None) -> list[str]:
        """Stop the workers (all, or worker_ids) taking steps: requests in flight stay where they are, new
        ones are admitted and wait, aborts and stats go on (vLLM's pause in "keep" mode). Returns once each
        live worker's step in flight has ended: the workers paused (a worker restarting now comes back
        unpaused)."""
        return _get(self.router.pause.remote(True, worker_ids))

    def resume_generation(self, worker_ids: list[str] | None = None) -> list[str]:
        """Let paused workers (all, or worker_ids) step again; the workers resumed."""
        return _get(self.router.pause.remote(False, worker_ids))

    def shutdown(self) -> None:
        """Stop every actor of this deployment."""
        shutdown(self.name)
