"""AdapterCache: the deployment's LoRA adapters. It alone reads adapter directories: it validates an adapter
against the served model at registration (scheduling/lora/adapter_store.py), keeps the registry in a JSON file
so a restarted cache, or a later deployment of the same name over the same model, still serves it
(scheduling/lora/adapter_registry.py), and holds the loaded tensors, least recently used out past max_bytes. A
worker asks for an adapter by name and gets it through the object store, put there once per load and shared
by every worker that asks: workers on other machines need no shared filesystem.
It also keeps the merged copies workers build (scheduling/lora/planner.py), so each is built once.

Callers resolve a name to the id its current version is served under (AdapterStore's versions) when they admit
a request; the id is what the router, the worker and its engine see. Unloading a name, or registering other
weights under it, retires its id: the cache drops its copies of it at once (a late fetch loads it again from
its source, checked against its digest) and tells every worker of the deployment, which forget it once its
last request ends.
"""

import asyncio
from collections import OrderedDict

import ray
from ray.exceptions import RayActorError

from actors.ray_instance import NAMESPACE
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
        self.deployment = deployment
        self.store.restore(self.registry.read())  # each loaded when first asked for
        self._refs: dict[str, ray.ObjectRef] = {}  # the loaded adapters, in the object store
        # merged copies a worker built (every worker serves the same model and engine config), for the others
        self._merged: OrderedDict[str, tuple[ray.ObjectRef, int]] = OrderedDict()  # name -> (ref, bytes), LRU
        self.max_merged_bytes = max_merged_bytes
        self.num_merged_hits = self.num_merged_misses = 0

    def register(self, name: str, directory: str) -> str:
        """Validate and serve a PEFT adapter directory; -> its resolved path. AdapterError if it does not
        fit."""
        before = self.store.resolve(name)
        path = self.store.register(name, directory)
        self._changed(self.store.replaced(before, name))
        return path

    def compose(self, name: str, weights: dict[str, float], combination: str = "svd") -> None:
        """Serve `name` as a weighted combination of registered adapters (models/lora/compose.py)."""
        before = self.store.resolve(name)
        self.store.compose(name, weights, combination)
        self._changed(self.store.replaced(before, name))

    def unload(self, name: str) -> str:
        """Serve `name` no more -> the id retired; AdapterError if no adapter has that name. Requests that
        hold it finish on its weights."""
        adapter_id = self.store.unload(name)
        self._changed(adapter_id)
        return adapter_id

    def resolve(self, name: str) -> str | None:
        """The id a request naming the adapter is served under now (None: no adapter has that name)."""
        return self.store.resolve(name)

    def get(self, adapter_id: str) -> list[ray.ObjectRef] | None:
        """[the adapter's tensors in the object store] (a list, so the caller gets the reference), or None if
        no adapter has that id. AdapterError if a retired id's files changed since."""
        if adapter_id not in self.store:
            return None
        adapter = self.store[adapter_id]  # loaded (or reloaded) now, which may evict others
        for gone in [n for n in self._refs if not self.store.is_loaded(n)]:
            del self._refs[gone]
        if adapter_id not in self._refs:
            self._refs[adapter_id] = ray.put(adapter)
        return [self._refs[adapter_id]]

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
        if name not in self.store or name in self.store.retired or nbytes > self.max_merged_bytes:
            return
        self._merged[name] = (refs[0], nbytes)
        while sum(b for _, b in self._merged.values()) > self.max_merged_bytes:
            self._merged.popitem(last=False)

    def path(self, name: str) -> str | None:
        """Where the adapter comes from (its directory, or its composition), None if not registered."""
        adapter_id = self.store.resolve(name)
        return None if adapter_id is None else str(self.store.sources[adapter_id])

    def adapters(self) -> dict[str, str]:
        """name -> where its served version comes from."""
        return {name: str(self.store.sources[i]) for name, i in self.store.served.items()}

    def stats(self) -> dict:
        return self.store.stats() | {"merged_hits": self.num_merged_hits,
                                     "merged_misses": self.num_merged_misses,
                                     "merged_held": list(self._merged),
                                     "merged_bytes": sum(b for _, b in self._merged.values())}

    def _changed(self, retired: str | None) -> None:
        """After a registration or an unload: kept in the registry; the id it retired (if any) dropped here
        and retired on every worker."""
        self.registry.write(self.store.state())
        if retired is None:
            return
        self._refs.pop(retired, None)
        self._merged.pop(retired, None)
        self.store.forget(retired)  # a late fetch loads it again
        for worker in self._workers():
            worker.retire_adapters.remote([retired])  # not waited for: a worker lost meanwhile holds nothing

    def _workers(self) -> list:
        prefix = f"{self.deployment}.worker."
        handles = []
        for entry in ray.util.list_named_actors(all_namespaces=True):
            name = entry["name"]
            if entry["namespace"] == NAMESPACE and name.startswith(prefix):
                try:
                    handles.append(ray.get_actor(name, namespace=NAMESPACE))
                except ValueError:  # gone since it was listed
                    pass
        return handles


async def lookup_adapter(adapter_cache, name: str) -> str | None:
    """Where a registered adapter comes from (None if unknown), waiting out a restart of the cache."""
    return await _retrying(lambda: adapter_cache.path.remote(name))


async def resolve_adapter(adapter_cache, name: str) -> str | None:
    """The id a request naming the adapter is served under now (None if unknown), waiting out a restart of
    the cache."""
    return await _retrying(lambda: adapter_cache.resolve.remote(name))


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
