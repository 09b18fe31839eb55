"""A worker's LoRA adapters: fetched from the AdapterCache by name through the object store on the actor's
event loop before a request is queued (with a merged copy another worker shared, if there is one), then held
by the engine-loop thread while a request of the adapter is queued or running. The engine, which keeps at most
max_loras of them loaded, takes them back from there when a step needs them: nothing in the step loop blocks
on Ray, and a cold adapter costs its own request only.
"""

import ray

from actors.adapter_cache import fetch_adapter_ref, fetch_merged_ref
from cluster_configs.engine_config import EngineConfig
from cluster_configs.errors import InvalidRequest
from models.lora.adapter import LoraAdapter
from models.lora.merge import MergedWeights


class AdapterFetcher:
    """The event loop's side: each adapter its requests in flight use, fetched once."""

    def __init__(self, adapter_cache, config: EngineConfig):
        self.adapter_cache, self.config = adapter_cache, config
        self.in_use: dict[str, tuple[LoraAdapter, int]] = {}  # name -> (weights, number of requests)

    async def use(self, name: str) -> tuple[LoraAdapter, MergedWeights | None]:
        """The adapter's weights (and a merged copy another worker shared) for one more request, fetched
        from the AdapterCache unless a request in flight here already uses them."""
        in_use = self.in_use.get(name)
        if in_use is not None:
            self.in_use[name] = (in_use[0], in_use[1] + 1)
            return in_use[0], None
        ref = await fetch_adapter_ref(self.adapter_cache, name) if self.adapter_cache is not None else None
        if ref is None:
            raise InvalidRequest(f"unknown adapter {name!r}: register it first with "
                                 "client.register_adapter(name, path)")
        weights = await ref
        merged = None
        if self.config.lora_merge != "never" and self.config.lora_merged_bytes > 0:
            merged_ref = await fetch_merged_ref(self.adapter_cache, name)
            merged = None if merged_ref is None else await _shared_copy(merged_ref)
        in_use = self.in_use.get(name)  # another request may have fetched it meanwhile
        self.in_use[name] = (weights, 1 + (in_use[1] if in_use else 0))
        return weights, merged

    def done(self, name: str) -> None:
        """A request that used the adapter has ended."""
        weights, num_requests = self.in_use.pop(name, (None, 0))
        if num_requests > 1:
            self.in_use[name] = (weights, num_requests - 1)


async def _shared_copy(ref: ray.ObjectRef) -> MergedWeights | None:
    """The merged copy another worker shared, or None if that worker is gone (the object store lost it with
    its owner): this one builds it again, and its copy replaces the lost one in the AdapterCache. Raised, the
    loss would fail the request's submit as if this worker were lost."""
    try:
        return await ref
    except ray.exceptions.ObjectLostError:  # OwnerDiedError among them
        return None


class HeldAdapters:
    """The engine-loop thread's side: the adapters of the engine's requests, the engine's adapter source."""

    def __init__(self, shared_merged: "CachedMerged | None"):
        self.shared_merged = shared_merged
        self.held: dict[str, tuple[LoraAdapter, int]] = {}  # name -> (weights, number of requests)

    def hold(self, name: str, weights: LoraAdapter, merged: MergedWeights | None) -> None:
        held = self.held.get(name)
        self.held[name] = (weights, 1 + (held[1] if held else 0))
        if merged is not None and self.shared_merged is not None:
            self.shared_merged.offer(merged)

    def release(self, name: str) -> None:
        weights, num_requests = self.held.pop(name)
        if num_requests > 1:
            self.held[name] = (weights, num_requests - 1)
        elif self.shared_merged is not None:
            self.shared_merged.offered.pop(name, None)  # not taken: the engine did not merge it

    def get(self, name: str) -> LoraAdapter:
        """The weights a queued or running request brought."""
        held = self.held.get(name)
        if held is None:
            raise InvalidRequest(f"adapter {name!r} is used by no request on this worker")
        return held[0]


class CachedMerged:
    """The engine's SharedMerged (scheduling/lora/planner.py) in a deployment: a merged copy another worker
    shared comes with the request that needs it (fetched on the event loop, offered here by the loop thread);
    a copy built here goes to the AdapterCache for the others. Nothing waits on Ray."""

    def __init__(self, adapter_cache):
        self.adapter_cache = adapter_cache
        self.offered: dict[str, MergedWeights] = {}  # adapter -> a shared copy not yet taken

    def offer(self, merged: MergedWeights) -> None:
        self.offered[merged.name] = merged

    def get(self, name: str) -> MergedWeights | None:
        merged = self.offered.pop(name, None)
        return None if merged is None else merged.local_copy()

    def put(self, merged: MergedWeights) -> None:
        self.adapter_cache.put_merged.remote(merged.name, [ray.put(merged)], merged.nbytes)  # not waited for
