"""AdapterStore: the LoRA adapters served, by name, each with where its weights come from. Every check
happens at registration, so a request can only name an adapter that loaded whole.

Sources: a PEFT directory, a composition of registered adapters, or "remote": validated elsewhere and
fetched by name when needed (a worker's adapters come from the adapter-cache actor). Loaded weights are
kept least recently used first; past max_bytes or max_loaded adapters the oldest are dropped, to be loaded
again from their source when next asked for.

Versions: requests name an adapter, the engine serves an id. A name's first registration is served as the
name itself, each later one with other weights as `name@v` (version_id); the old id is retired: requests
that hold it keep its weights to their end, new ones resolve the name to the new id. A retired id's weights
are dropped (forget) once nothing uses it. Weights are checked against the digest taken at registration
whenever they are loaded again: an id never serves other weights than it was registered with.
"""

import re
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cluster_configs.cluster_config import NAME_PATTERN
from cluster_configs.errors import AdapterError
from models.lora.adapter import LoraAdapter, adapter_digest, load_lora
from models.lora.compose import compose
from models.model_spec import ModelSpec


@dataclass(frozen=True)
class AdapterSource:
    path: str | None = None  # a PEFT directory, resolved
    weights: tuple[tuple[str, float], ...] = ()  # or a composition: (registered adapter, weight) ...
    combination: str = ""  # ... combined so
    remote: bool = False  # or fetched by name (AdapterStore.fetch)

    def to_json(self) -> str | dict:
        return self.path or {"weights": dict(self.weights), "combination": self.combination}

    @classmethod
    def from_json(cls, value) -> "AdapterSource":
        if isinstance(value, str):  # registries written before compositions: name -> directory
            return cls(path=value)
        if isinstance(value, dict) and isinstance(value.get("weights"), dict):
            return cls(weights=tuple(value["weights"].items()), combination=str(value.get("combination")))
        raise ValueError(f"not an adapter source: {value!r}")

    def __str__(self) -> str:
        if self.path:
            return self.path
        return (f"compose({dict(self.weights)!r}, {self.combination!r})" if self.weights
                else "the adapter cache")


REMOTE = AdapterSource(remote=True)


def version_id(name: str, version: int) -> str:
    """The id the version-th registration of name is served under."""
    return name if version == 1 else f"{name}@{version}"


@dataclass
class AdapterState:
    """What a store keeps across restarts (scheduling/lora/adapter_registry.py): the served names' sources,
    each name's last version (an unloaded name too: registered again, it gets the next one), the sources of
    retired ids a served composition is made of, and the weights' digests by id."""
    adapters: dict[str, AdapterSource] = field(default_factory=dict)  # name -> its served id's source
    versions: dict[str, int] = field(default_factory=dict)  # name -> last version (above 1, or unloaded)
    retired: dict[str, AdapterSource] = field(default_factory=dict)  # id -> source
    digests: dict[str, str] = field(default_factory=dict)  # id -> adapter_digest


class AdapterStore(Mapping[str, LoraAdapter]):
    """A Mapping of adapter ids (served and retired) to their weights."""

    def __init__(self, spec: ModelSpec, max_lora_rank: int, adapter_roots: Sequence[str] | None = None,
                 max_bytes: int | None = None, max_loaded: int | None = None,
                 fetch: Callable[[str], LoraAdapter] | None = None):
        self.spec = spec
        self.max_lora_rank = max_lora_rank
        self.roots = None if adapter_roots is None else [Path(r).expanduser().resolve()
                                                         for r in adapter_roots]
        self.max_bytes, self.max_loaded = max_bytes, max_loaded
        self.fetch = fetch  # id -> the adapter validated elsewhere (remote sources)
        self.sources: dict[str, AdapterSource] = {}  # id -> where its weights come from
        self.served: dict[str, str] = {}  # name -> the id requests naming it get
        self.versions: dict[str, int] = {}  # name -> its last version
        self.retired: set[str] = set()  # ids no name resolves to any more (weights dropped once unused)
        self._loaded: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        self._digests: dict[str, str] = {}  # id -> adapter_digest of its weights
        self.num_hits = self.num_misses = self.num_evictions = 0
        self.num_retired = self.num_forgotten = 0

    # ---- registration ------------------------------------------------------------------------------

    def register(self, name: str, path: str | Path) -> str:
        """Serve the PEFT adapter directory as `name`; -> the resolved directory. Other weights under a
        served name become its next version. Raises AdapterError."""
        check_name(name)
        source = AdapterSource(path=str(resolve_adapter_path(path, self.roots)))
        self._serve(name, source)
        return source.path

    def compose(self, name: str, weights: Mapping[str, float], combination: str = "svd") -> None:
        """Serve `name` as the weighted combination of registered adapters (models/lora/compose.py), as they
        are now: the composition keeps their ids."""
        check_name(name)
        if not isinstance(weights, Mapping) or not weights:
            raise AdapterError(f"weights must map registered adapter names to numbers, e.g. {{'tests': 0.7, "
                               f"'library': 0.3}}; got {weights!r}")
        unknown = [n for n in weights if n not in self.served]
        if unknown:
            raise AdapterError(f"cannot compose unknown adapters {unknown} (registered: "
                               f"{', '.join(sorted(self.served)) or 'none'}); register them first")
        self._serve(name, AdapterSource(weights=tuple((self.served[n], w) for n, w in weights.items()),
                                        combination=combination))

    def unload(self, name: str) -> str:
        """Serve `name` no more -> the id retired. AdapterError if no adapter has that name."""
        adapter_id = self.served.pop(name, None)
        if adapter_id is None:
            raise AdapterError(f"no adapter is named {name!r} (registered: "
                               f"{', '.join(sorted(self.served)) or 'none'})")
        self._retire(adapter_id)
        return adapter_id

    def restore(self, state: AdapterState) -> None:
        """Serve what a store kept (a restarted cache), loading each adapter when first asked for."""
        self.versions.update(state.versions)
        self._digests.update(state.digests)
        for adapter_id, source in state.retired.items():
            self.sources[adapter_id] = source
            self.retired.add(adapter_id)
        for name, source in state.adapters.items():
            adapter_id = version_id(name, self.versions.setdefault(name, 1))
            self.sources[adapter_id], self.served[name] = source, adapter_id

    def state(self) -> AdapterState:
        """What restore() takes back (the retired ids kept are those a served composition is made of)."""
        parts = self._parts({self.served[n] for n in self.served})
        return AdapterState({n: self.sources[i] for n, i in self.served.items()},
                            {n: v for n, v in self.versions.items() if v > 1 or n not in self.served},
                            {i: self.sources[i] for i in parts if i in self.retired},
                            {i: d for i, d in self._digests.items() if i in parts})

    def add_remote(self, adapter_id: str) -> None:
        """Serve the id, registered and validated elsewhere, fetching its weights when first asked for."""
        check_id(adapter_id)
        if self.sources.get(adapter_id, REMOTE) != REMOTE:
            raise AdapterError(f"adapter {adapter_id!r} is taken by {self.sources[adapter_id]}")
        self.sources[adapter_id] = REMOTE

    def retire(self, adapter_id: str) -> None:
        """The id was retired elsewhere (a worker told by the adapter cache): forget it once unused."""
        if adapter_id not in self.retired:
            self._retire(adapter_id)

    def replaced(self, before: str | None, name: str) -> str | None:
        """The id a registration of name retired, given the id name resolved to before it (None: none)."""
        return before if before is not None and self.served.get(name) != before else None

    def forget(self, adapter_id: str) -> None:
        """Drop a retired id's weights. Its source stays (a few bytes): a request resolved to it just before
        it was retired, or moved from a lost worker, loads it again, checked against its digest."""
        self._loaded.pop(adapter_id, None)
        self.num_forgotten += 1

    # ---- lookup ------------------------------------------------------------------------------------

    def resolve(self, name: str) -> str | None:
        """The id a request naming `name` is served (None: no adapter has that name)."""
        return self.served.get(name)

    def __getitem__(self, adapter_id: str) -> LoraAdapter:
        adapter = self._loaded.get(adapter_id)
        if adapter is not None:
            self.num_hits += 1
            self._loaded.move_to_end(adapter_id)
            return adapter
        source = self.sources[adapter_id]  # KeyError: not served
        self.num_misses += 1
        adapter = self._build(adapter_id, source)  # the checks passed at registration; files may have changed
        self._check_digest(adapter_id, adapter)
        self._add(adapter_id, adapter)
        return adapter

    def __contains__(self, adapter_id) -> bool:
        return adapter_id in self.sources

    def __iter__(self) -> Iterator[str]:
        return iter(self.sources)

    def __len__(self) -> int:
        return len(self.sources)

    def digest(self, adapter_id: str) -> str:
        """The content digest of the weights served as the id (models/lora/adapter.adapter_digest)."""
        if adapter_id not in self._digests:
            self._digests[adapter_id] = adapter_digest(self._loaded.get(adapter_id) or self[adapter_id])
        return self._digests[adapter_id]

    def is_loaded(self, adapter_id: str) -> bool:
        return adapter_id in self._loaded

    @property
    def loaded_bytes(self) -> int:
        return sum(a.nbytes for a in self._loaded.values())

    def stats(self) -> dict:
        return {"adapter_hits": self.num_hits, "adapter_misses": self.num_misses,
                "adapter_evictions": self.num_evictions, "adapter_bytes": self.loaded_bytes,
                "num_adapters": sum(i not in self.retired for i in self.sources),
                "num_adapters_loaded": len(self._loaded), "adapters_loaded": sorted(self._loaded),
                "num_adapters_retired": self.num_retired, "num_adapters_forgotten": self.num_forgotten,
                "adapters_retired": sorted(i for i in self.retired if i in self._loaded)}

    # ---- internals ---------------------------------------------------------------------------------

    def _serve(self, name: str, source: AdapterSource) -> None:
        """Serve source as name: a no-op for the weights it serves already, else its next version."""
        current = self.served.get(name)
        if self.sources.get(current or name, source).remote:  # a worker's: registered at the adapter cache
            raise AdapterError(f"adapter name {name!r} is taken by {REMOTE}; register it there")
        adapter_id = version_id(name, self.versions.get(name, 0) + 1)
        adapter = self._build(adapter_id, source)
        digest = adapter_digest(adapter)
        if current is not None and self.sources[current] == source and \
                self._digests.setdefault(current, digest) == digest:  # (unknown: kept by an older registry)
            return
        self.versions[name] = self.versions.get(name, 0) + 1
        self.sources[adapter_id], self.served[name] = source, adapter_id
        self._digests[adapter_id] = digest
        self._add(adapter_id, adapter)
        if current is not None:
            self._retire(current)

    def _retire(self, adapter_id: str) -> None:
        self.retired.add(adapter_id)
        self.num_retired += 1

    def _parts(self, adapter_ids: set[str]) -> set[str]:
        """adapter_ids and every id the compositions among them are made of, down to directories."""
        parts, todo = set(), list(adapter_ids)
        while todo:
            adapter_id = todo.pop()
            if adapter_id in parts or adapter_id not in self.sources:
                continue
            parts.add(adapter_id)
            todo += [i for i, _ in self.sources[adapter_id].weights]
        return parts

    def _check_digest(self, adapter_id: str, adapter: LoraAdapter) -> None:
        """An id reloaded from a directory serves the weights it was registered with, or nothing."""
        known = self._digests.get(adapter_id)
        if known is not None and self.sources[adapter_id].path and adapter_digest(adapter) != known:
            raise AdapterError(f"the files of adapter {adapter_id!r} ({self.sources[adapter_id]}) changed "
                               f"since it was registered; register it again to serve the new weights")

    def _build(self, adapter_id: str, source: AdapterSource) -> LoraAdapter:
        if source.path:
            return load_lora(adapter_id, source.path, self.spec, self.max_lora_rank)
        if source.remote:
            adapter = self.fetch(adapter_id)
            if adapter.name != adapter_id:
                raise AdapterError(f"asked for adapter {adapter_id!r}, got {adapter.name!r}")
            return adapter
        adapter = compose(adapter_id, [(self[i], w) for i, w in source.weights], source.combination)
        if adapter.max_rank > self.max_lora_rank:
            raise AdapterError(f"composing {adapter_id!r} ({source.combination}) gives rank "
                               f"{adapter.max_rank}, above max_lora_rank={self.max_lora_rank}; raise "
                               "max_lora_rank or use 'svd'")
        return adapter

    def _add(self, adapter_id: str, adapter: LoraAdapter) -> None:
        self._loaded[adapter_id] = adapter
        self._loaded.move_to_end(adapter_id)
        total = self.loaded_bytes
        for old in [n for n in self._loaded if n != adapter_id]:  # least recently used first
            if (self.max_bytes is None or total <= self.max_bytes) and \
                    (self.max_loaded is None or len(self._loaded) <= self.max_loaded):
                break
            total -= self._loaded.pop(old).nbytes
            self.num_evictions += 1


def check_name(name) -> None:
    if not isinstance(name, str) or not re.fullmatch(NAME_PATTERN, name):
        raise AdapterError(f"adapter name {name!r} is not valid: a non-empty string of letters, digits, "
                           "'_' and '-'")


def check_id(adapter_id) -> None:
    """An id version_id makes: a name, then @ and a version above 1."""
    name, at, version = str(adapter_id).partition("@")
    check_name(name if isinstance(adapter_id, str) else adapter_id)
    if at and not (version.isdigit() and int(version) > 1):
        raise AdapterError(f"adapter id {adapter_id!r} is not valid: a name, or a name@version")


def resolve_adapter_path(path: str | Path, roots: Sequence[Path] | None) -> Path:
    """The adapter directory with '..' and symlinks resolved; AdapterError if it lies outside every root."""
    if not isinstance(path, str | Path):
        raise AdapterError(f"an adapter path is a directory path, got {type(path).__name__}")
    resolved = Path(path).expanduser().resolve()
    if roots is not None and not any(resolved.is_relative_to(root) for root in roots):
        raise AdapterError(f"adapter path {path} (resolved: {resolved}) is outside adapter_roots "
                           f"({', '.join(map(str, roots))}); move the adapter under one of them or "
                           "add its folder")
    if not resolved.is_dir():
        raise AdapterError(f"adapter path {path}: not a directory; "
                           "pass the folder PEFT's save_pretrained wrote")
    return resolved
