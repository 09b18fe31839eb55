"""AdapterCache: the deployment's LoRA adapters. It alone reads adapter directories: it validates an adapter
against the served model at registration (scheduling/lora/adapter_store.py), keeps the registry in a JSON file
so a restarted cache, or a later deployment of the same name over the same model, still serves it
(scheduling/lora/adapter_registry.py), and holds the loaded tensors, least recently used out past max_bytes. A
worker asks for an adapter by name and gets it through the object store, put there once per load and shared
by every worker that asks: workers on other machines need no shared filesystem.
It also keeps the merged copies workers build (scheduling/lora/planner.py), so each is built once.
"""

import asyncio
from collections import OrderedDict

import ray
from ray.exceptions import RayActorError

from models.loader import read_spec
from scheduling.lora.adapter_registry import AdapterRegistry, model_identity
from scheduling.lora.adapter_store import AdapterStore

LOOKUP_TIMEOUT_S = 60.0  # a restarting cache is waited for this long


@ray.remote(num_cpus=0)
class AdapterCache:
    def __init__(self, registry_path: str, deployment: str, model_path: str, max_lora_rank: int,
                 adapter_roots: tuple[str, ...] | None = None, max_bytes: int | None = None,
                 max_merged_bytes: int = 0):
        spec = read_spec(model_path)
        self.registry = AdapterRegistry(registry_path, deployment, model_identity(model_path, spec))
        self.store = AdapterStore(spec, max_lora_rank, adapter_roots, max_bytes=max_bytes)
        for name, source in self.registry.read().items():
            self.store.restore(name, source)  # loaded when first asked for
        self._refs: dict[str, ray.ObjectRef] = {}  # the loaded adapters, in the object store
        # merged copies a worker built (every worker serves the same model and engine config), for the others
        self._merged: OrderedDict[str, tuple[ray.ObjectRef, int]] = OrderedDict()  # name -> (ref, bytes), LRU
        self.max_merged_bytes = max_merged_bytes
        self.num_merged_hits = self.num_merged_misses = 0

    def register(self, name: str, directory: str) -> str:
        """Validate and serve a PEFT adapter directory; -> its resolved path. AdapterError if it does not
        fit."""
        path = self.store.register(name, directory)
        self._save()
        return path

    def compose(self, name: str, weights: dict[str, float], combination: str = "svd") -> None:
        """Serve `name` as a weighted combination of registered adapters (models/lora/compose.py)."""
        self.store.compose(name, weights, combination)
        self._save()

    def get(self, name: str) -> list[ray.ObjectRef] | None:
        """[the adapter's tensors in the object store] (a list, so the caller gets the reference), or None if
        no adapter has that name."""
        if name not in self.store:
            return None
        adapter = self.store[name]  # loaded (or reloaded) now, which may evict others
        for gone in [n for n in self._refs if not self.store.is_loaded(n)]:
            del self._refs[gone]
        if name not in self._refs:
            self._refs[name] = ray.put(adapter)
        return [self._refs[name]]

    def merged(self, name: str) -> list[ray.ObjectRef] | None:
        """[a merged copy of the adapter a worker shared] or None (the caller builds it, then shares it)."""
        held = self._merged.get(name)
        self.num_merged_hits += held is not None
        self.num_merged_misses += held is None
        if held is None:
            return None
        self._merged.move_to_end(name)
        return [held[0]]

    def put_merged(self, name: str, refs: list[ray.ObjectRef], nbytes: int) -> None:
        """Keep a worker's merged copy for the others, least recently used out past max_merged_bytes."""
        if name not in self.store or nbytes > self.max_merged_bytes:
            return
        self._merged[name] = (refs[0], nbytes)
        while sum(b for _, b in self._merged.values()) > self.max_merged_bytes:
            self._merged.popitem(last=False)

    def path(self, name: str) -> str | None:
        """Where the adapter comes from (its directory, or its composition), None if not registered."""
        source = self.store.sources.get(name)
        return None if source is None else str(source)

    def adapters(self) -> dict[str, str]:
        return {name: str(source) for name, source in self.store.sources.items()}

    def stats(self) -> dict:
        return self.store.stats() | {"merged_hits": self.num_merged_hits,
                                     "merged_misses": self.num_merged_misses,
                                     "merged_held": list(self._merged),
                                     "merged_bytes": sum(b for _, b in self._merged.values())}

    def _save(self) -> None:
        self.registry.write(self.store.sources)


async def lookup_adapter(adapter_cache, name: str) -> str | None:
    """Where a registered adapter comes from (None if unknown), waiting out a restart of the cache."""
    return await _retrying(lambda: adapter_cache.path.remote(name))


async def fetch_adapter_ref(adapter_cache, name: str) -> ray.ObjectRef | None:
    """The adapter's tensors in the object store (None if unknown), waiting out a restart of the cache."""
    refs = await _retrying(lambda: adapter_cache.get.remote(name))
    return None if refs is None else refs[0]


async def fetch_merged_ref(adapter_cache, name: str) -> ray.ObjectRef | None:
    """A merged copy of the adapter a worker shared (None if there is none), waiting out a restart of the
    cache."""
    refs = await _retrying(lambda: adapter_cache.merged.remote(name))
    return None if refs is None else refs[0]


async def _retrying(call):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + LOOKUP_TIMEOUT_S
    while True:
        try:
            return await call()
        except RayActorError:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.2)
