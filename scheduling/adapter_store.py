"""AdapterStore: the LoRA adapters one engine serves, by name. Every check happens at registration, so a
request can only name an adapter that loaded whole."""

import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from cluster_configs.cluster_config import NAME_PATTERN
from cluster_configs.errors import AdapterError
from models.lora import LoraAdapter, load_lora
from models.lora_compose import compose
from models.spec import ModelSpec


class AdapterStore(Mapping[str, LoraAdapter]):
    def __init__(self, spec: ModelSpec, max_lora_rank: int, adapter_roots: Sequence[str] | None = None):
        self.spec = spec
        self.max_lora_rank = max_lora_rank
        self.roots = None if adapter_roots is None else [Path(r).expanduser().resolve() for r in adapter_roots]
        self._adapters: dict[str, LoraAdapter] = {}
        self._sources: dict[str, str] = {}  # name -> its resolved directory, or how it was composed

    def register(self, name: str, path: str | Path) -> LoraAdapter:
        """Load a PEFT adapter directory as `name`. Raises AdapterError."""
        check_name(name)
        resolved = resolve_adapter_path(path, self.roots)
        self._check_free(name, str(resolved))
        if name not in self._adapters:
            self._adapters[name] = load_lora(name, resolved, self.spec, self.max_lora_rank)
            self._sources[name] = str(resolved)
        return self._adapters[name]

    def compose(self, name: str, weights: Mapping[str, float], combination: str = "svd") -> LoraAdapter:
        """Register `name` as the weighted combination of registered adapters (models/lora_compose.py)."""
        check_name(name)
        if not isinstance(weights, Mapping) or not weights:
            raise AdapterError(f"weights must map registered adapter names to numbers, e.g. {{'tests': 0.7, "
                               f"'library': 0.3}}; got {weights!r}")
        unknown = [n for n in weights if n not in self._adapters]
        if unknown:
            raise AdapterError(f"cannot compose unknown adapters {unknown} (registered: "
                               f"{', '.join(sorted(self._adapters)) or 'none'}); register them first")
        source = f"compose({dict(weights)!r}, {combination!r})"
        self._check_free(name, source)
        if name not in self._adapters:
            adapter = compose(name, [(self._adapters[n], w) for n, w in weights.items()], combination)
            if adapter.max_rank > self.max_lora_rank:
                raise AdapterError(f"composing {name!r} ({combination}) gives rank {adapter.max_rank}, above "
                                   f"max_lora_rank={self.max_lora_rank}; raise max_lora_rank or use 'svd'")
            self._adapters[name], self._sources[name] = adapter, source
        return self._adapters[name]

    def _check_free(self, name: str, source: str) -> None:
        if self._sources.get(name, source) != source:  # requests and cached KV may hold the old weights
            raise AdapterError(f"adapter name {name!r} is taken by {self._sources[name]}; register the new "
                               "weights under another name")

    def __getitem__(self, name: str) -> LoraAdapter:
        return self._adapters[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._adapters)

    def __len__(self) -> int:
        return len(self._adapters)


def check_name(name) -> None:
    if not isinstance(name, str) or not re.fullmatch(NAME_PATTERN, name):
        raise AdapterError(f"adapter name {name!r} is not valid: a non-empty string of letters, digits, '_' and '-'")


def resolve_adapter_path(path: str | Path, roots: Sequence[Path] | None) -> Path:
    """The adapter directory with '..' and symlinks resolved; AdapterError if it lies outside every root."""
    if not isinstance(path, str | Path):
        raise AdapterError(f"an adapter path is a directory path, got {type(path).__name__}")
    resolved = Path(path).expanduser().resolve()
    if roots is not None and not any(resolved.is_relative_to(root) for root in roots):
        raise AdapterError(f"adapter path {path} (resolved: {resolved}) is outside adapter_roots "
                           f"({', '.join(map(str, roots))}); move the adapter under one of them or add its folder")
    if not resolved.is_dir():
        raise AdapterError(f"adapter path {path}: not a directory; pass the folder PEFT's save_pretrained wrote")
    return resolved
