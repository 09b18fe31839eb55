"""AdapterStore: the LoRA adapters served, by name, each with where its weights come from. Every check
happens at registration, so a request can only name an adapter that loaded whole.

Sources: a PEFT directory, a composition of registered adapters, or "remote": validated elsewhere and
fetched by name when needed (a worker's adapters come from the adapter-cache actor). Loaded weights are
kept least recently used first; past max_bytes or max_loaded adapters the oldest are dropped, to be loaded
again from their source when next asked for.
"""

import re
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
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


class AdapterStore(Mapping[str, LoraAdapter]):
    def __init__(self, spec: ModelSpec, max_lora_rank: int, adapter_roots: Sequence[str] | None = None,
                 max_bytes: int | None = None, max_loaded: int | None = None,
                 fetch: Callable[[str], LoraAdapter] | None = None):
        self.spec = spec
        self.max_lora_rank = max_lora_rank
        self.roots = None if adapter_roots is None else [Path(r).expanduser().resolve()
                                                         for r in adapter_roots]
        self.max_bytes, self.max_loaded = max_bytes, max_loaded
        self.fetch = fetch  # name -> the adapter validated elsewhere (remote sources)
        self.sources: dict[str, AdapterSource] = {}  # every adapter served
        self._loaded: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        self._digests: dict[str, str] = {}  # name -> adapter_digest of the weights it was last loaded with
        self.num_hits = self.num_misses = self.num_evictions = 0

    # ---- registration ------------------------------------------------------------------------------

    def register(self, name: str, path: str | Path) -> str:
        """Load a PEFT adapter directory as `name`; -> the resolved directory. Raises AdapterError."""
        check_name(name)
        source = AdapterSource(path=str(resolve_adapter_path(path, self.roots)))
        self._check_free(name, source)
        if name not in self.sources:
            self._add(name, self._build(name, source), source)
        return source.path

    def compose(self, name: str, weights: Mapping[str, float], combination: str = "svd") -> None:
        """Register `name` as the weighted combination of registered adapters (models/lora/compose.py)."""
        check_name(name)
        if not isinstance(weights, Mapping) or not weights:
            raise AdapterError(f"weights must map registered adapter names to numbers, e.g. {{'tests': 0.7, "
                               f"'library': 0.3}}; got {weights!r}")
        unknown = [n for n in weights if n not in self.sources]
        if unknown:
            raise AdapterError(f"cannot compose unknown adapters {unknown} (registered: "
                               f"{', '.join(sorted(self.sources)) or 'none'}); register them first")
        source = AdapterSource(weights=tuple(weights.items()), combination=combination)
        self._check_free(name, source)
        if name not in self.sources:
            self._add(name, self._build(name, source), source)

    def restore(self, name: str, source: AdapterSource) -> None:
        """Serve `name` from a source registered before (a restarted cache), loading it when first
        asked for."""
        self.sources[name] = source

    def add_remote(self, name: str) -> None:
        """Serve `name`, registered and validated elsewhere, fetching it when first asked for."""
        check_name(name)
        self._check_free(name, REMOTE)
        self.sources[name] = REMOTE

    # ---- lookup ------------------------------------------------------------------------------------

    def __getitem__(self, name: str) -> LoraAdapter:
        adapter = self._loaded.get(name)
        if adapter is not None:
            self.num_hits += 1
            self._loaded.move_to_end(name)
            return adapter
        source = self.sources[name]  # KeyError: not served
        self.num_misses += 1
        adapter = self._build(name, source)  # the checks passed at registration; files may have changed since
        self._add(name, adapter, source)
        return adapter

    def __contains__(self, name) -> bool:
        return name in self.sources

    def __iter__(self) -> Iterator[str]:
        return iter(self.sources)

    def __len__(self) -> int:
        return len(self.sources)

    def digest(self, name: str) -> str:
        """The content digest of the weights served as name (models/lora/adapter.adapter_digest)."""
        if name not in self._digests:
            self._digests[name] = adapter_digest(self._loaded.get(name) or self[name])
        return self._digests[name]

    def is_loaded(self, name: str) -> bool:
        return name in self._loaded

    @property
    def loaded_bytes(self) -> int:
        return sum(a.nbytes for a in self._loaded.values())

    def stats(self) -> dict:
        return {"adapter_hits": self.num_hits, "adapter_misses": self.num_misses,
                "adapter_evictions": self.num_evictions, "adapter_bytes": self.loaded_bytes,
                "num_adapters": len(self.sources), "num_adapters_loaded": len(self._loaded),
                "adapters_loaded": sorted(self._loaded)}

    # ---- internals ---------------------------------------------------------------------------------

    def _build(self, name: str, source: AdapterSource) -> LoraAdapter:
        if source.path:
            return load_lora(name, source.path, self.spec, self.max_lora_rank)
        if source.remote:
            adapter = self.fetch(name)
            if adapter.name != name:
                raise AdapterError(f"asked for adapter {name!r}, got {adapter.name!r}")
            return adapter
        adapter = compose(name, [(self[n], w) for n, w in source.weights], source.combination)
        if adapter.max_rank > self.max_lora_rank:
            raise AdapterError(f"composing {name!r} ({source.combination}) gives rank {adapter.max_rank}, "
                               f"above max_lora_rank={self.max_lora_rank}; raise max_lora_rank or use 'svd'")
        return adapter

    def _add(self, name: str, adapter: LoraAdapter, source: AdapterSource) -> None:
        self.sources[name] = source
        self._digests.pop(name, None)  # (its files may have changed since it was last loaded)
        self._loaded[name] = adapter
        self._loaded.move_to_end(name)
        total = self.loaded_bytes
        for old in [n for n in self._loaded if n != name]:  # least recently used first
            if (self.max_bytes is None or total <= self.max_bytes) and \
                    (self.max_loaded is None or len(self._loaded) <= self.max_loaded):
                break
            total -= self._loaded.pop(old).nbytes
            self.num_evictions += 1

    def _check_free(self, name: str, source: AdapterSource) -> None:
        if self.sources.get(name, source) != source:  # requests and cached KV may hold the old weights
            raise AdapterError(f"adapter name {name!r} is taken by {self.sources[name]}; register the new "
                               "weights under another name")


def check_name(name) -> None:
    if not isinstance(name, str) or not re.fullmatch(NAME_PATTERN, name):
        raise AdapterError(f"adapter name {name!r} is not valid: a non-empty string of letters, digits, "
                           "'_' and '-'")


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
