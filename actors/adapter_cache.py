"""AdapterCache: the registry of LoRA adapters, name -> directory, validated on registration and kept in a
JSON file so a restarted cache (or deployment) still knows them. The LoRA issue adds the weights."""

import asyncio
import json
import os
import re
from pathlib import Path

import ray
from ray.exceptions import RayActorError

from cluster_configs.cluster_config import NAME_PATTERN
from cluster_configs.errors import AdapterError

REQUIRED_FILES = ("adapter_config.json", "adapter_model.safetensors")
LOOKUP_TIMEOUT_S = 60.0  # a restarting cache is waited for this long


class AdapterRegistry:
    """Plain registry over a JSON file: {name: absolute adapter directory}."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        self.adapters: dict[str, str] = {}
        if self.path.exists():
            try:
                self.adapters = dict(json.loads(self.path.read_text()))
            except (ValueError, TypeError) as e:
                raise AdapterError(f"{self.path}: the adapter registry is not a JSON object ({e}); "
                                   "fix or delete the file") from None

    def register(self, name: str, directory: str | Path) -> str:
        validate_adapter(name, directory)
        path = str(Path(directory).expanduser().resolve())
        if self.adapters.get(name, path) != path:  # workers may hold the old weights under this name
            raise AdapterError(f"adapter {name!r} is already registered to {self.adapters[name]}; "
                               "register the new directory under another name")
        self.adapters[name] = path
        self._save()
        return path

    def get(self, name: str) -> str | None:
        return self.adapters.get(name)

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.adapters, indent=2, sort_keys=True))
        os.replace(tmp, self.path)  # atomic: a crash leaves the old registry or the new one


def validate_adapter(name: str, directory: str | Path) -> None:
    if not isinstance(name, str) or not re.fullmatch(NAME_PATTERN, name):
        raise AdapterError(f"adapter name {name!r} is not valid: use letters, digits, '_' and '-'")
    path = Path(directory).expanduser()
    if not path.is_dir():
        raise AdapterError(f"adapter {name!r}: {path} is not a directory; pass the folder that PEFT's "
                           "save_pretrained wrote")
    missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
    if missing:
        raise AdapterError(f"adapter {name!r}: {path} lacks {', '.join(missing)}; save the adapter with "
                           "PEFT's save_pretrained(dir, safe_serialization=True)")
    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except ValueError as e:
        raise AdapterError(f"adapter {name!r}: {path / 'adapter_config.json'} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {name!r}: {path / 'adapter_config.json'} must hold a JSON object")


@ray.remote(num_cpus=0)
class AdapterCache:
    def __init__(self, registry_path: str):
        self.registry = AdapterRegistry(registry_path)

    def register(self, name: str, directory: str) -> str:
        return self.registry.register(name, directory)

    def path(self, name: str) -> str | None:
        return self.registry.get(name)

    def adapters(self) -> dict[str, str]:
        return dict(self.registry.adapters)


async def lookup_adapter(adapter_cache, name: str) -> str | None:
    """The registered directory of an adapter (None if unknown), waiting out a restart of the cache."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + LOOKUP_TIMEOUT_S
    while True:
        try:
            return await adapter_cache.path.remote(name)
        except RayActorError:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.2)
