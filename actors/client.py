"""Client: a handle on a running deployment, from any driver or `ray job submit` entrypoint."""

from collections.abc import Iterator
from pathlib import Path

import ray
from ray.exceptions import RayActorError, RayTaskError

from cluster_configs.errors import NumaserveError, Unavailable
from cluster_configs.sampling_params import SamplingParams
from scheduling.outputs import Completion, RequestOutput


def _get(ref, actor: str = "router"):
    """ray.get, raising numaserve's own errors (InvalidRequest, Overloaded, ...) as themselves, and the death
    of the actor called (router, adapter cache) as Unavailable."""
    try:
        return ray.get(ref)
    except RayTaskError as e:
        if isinstance(e.cause, NumaserveError):
            raise e.cause from None
        raise
    except RayActorError:
        raise _unavailable(actor) from None


def _unavailable(actor: str) -> Unavailable:
    return Unavailable(f"the deployment's {actor} went down mid-call (Ray restarts it; a stream it carried "
                       "is lost): retry in a few seconds")


def cancel_stream(stream) -> None:
    """Cancel the router's stream (it then aborts the request on its worker), unless it has ended."""
    try:
        ray.cancel(stream)
    except TypeError:
        pass  # "No owner found for object": the task had already ended (an error, or the last item)


class Client:
    def __init__(self, name: str, router, adapter_cache, http_url: str | None = None):
        self.name = name
        self.router = router
        self.adapter_cache = adapter_cache
        # the OpenAI-compatible API (e.g. "http://127.0.0.1:8000"), if the deployment has one
        self.http_url = http_url

    def stream(self, prompt, params: SamplingParams | None = None, adapter: str | None = None,
               session: str | None = None, cache_salt: str | None = None) -> Iterator[RequestOutput]:
        """Deltas of one completion (.text, .token_ids, .finish_reason, .logprobs when asked); closing the
        iterator aborts it. cache_salt: share cached prefix blocks only with requests of the same salt."""
        chunks = self._chunks(prompt, params, adapter, session, cache_salt)
        next(chunks)  # the prompt's token ids: admitted
        yield from chunks

    def generate(self, prompt, params: SamplingParams | None = None, adapter: str | None = None,
                 session: str | None = None, cache_salt: str | None = None) -> Completion:
        chunks = self._chunks(prompt, params, adapter, session, cache_salt)
        done = Completion(prompt_token_ids=next(chunks))
        for chunk in chunks:
            done.token_ids += chunk.token_ids
            done.text += chunk.text
            done.finish_reason = chunk.finish_reason
            if chunk.logprobs is not None:
                done.logprobs = (done.logprobs or []) + chunk.logprobs
        return done

    def _chunks(self, prompt, params, adapter, session, cache_salt=None):
        stream = self.router.generate.remote(prompt, params, adapter, session, cache_salt)
        finished = False
        try:
            for ref in stream:
                item = _get(ref)
                yield item
                if isinstance(item, RequestOutput) and item.finished:
                    finished = True
                    return
        except RayActorError:  # the router died between items
            raise _unavailable("router") from None
        finally:
            if not finished:
                cancel_stream(stream)

    def register_adapter(self, name: str, path: str | Path) -> str:
        """Register a PEFT adapter directory under name (kept across restarts); AdapterError if it is
        invalid."""
        return _get(self.adapter_cache.register.remote(name, str(path)), "adapter cache")

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
        ones are admitted and wait, aborts and stats go on (vLLM's pause in "keep" mode). Returns the workers
        paused (a worker restarting now comes back unpaused)."""
        return _get(self.router.pause.remote(True, worker_ids))

    def resume_generation(self, worker_ids: list[str] | None = None) -> list[str]:
        """Let paused workers (all, or worker_ids) step again; the workers resumed."""
        return _get(self.router.pause.remote(False, worker_ids))

    def shutdown(self) -> None:
        """Stop every actor of this deployment."""
        from actors.deploy import shutdown

        shutdown(self.name)
