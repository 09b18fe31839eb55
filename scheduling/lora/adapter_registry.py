"""AdapterRegistry: the adapter registrations a deployment keeps across restarts, in one JSON file, per
deployment name and base model. A registration is served only by a deployment of the same name over the same
base model: an adapter registered over one model is never offered by (or loaded into) another model deployed
later under that name, and comes back when the first model is deployed again.

The base model's identity (model_identity) is what an adapter was checked against at registration
(models/lora/adapter.py): the model's resolved path, its architecture, its layer count and the shapes of every
module an adapter may target. Two checkpoints with the same shapes at different paths (a base model and its
fine-tune) are different models: an adapter trained on one is not silently served on the other.

The file: {"registrations": [{"deployment": name, "model": identity, "adapters": {adapter: source}}, ...]},
each registration also with "versions", "retired" and "digests" when it has any (AdapterState).
A file written before registrations carried these ({adapter: source}) is kept as one registration of an
unknown deployment and model: never served, logged, left in the file.
"""

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from cluster_configs.errors import AdapterError
from models.lora.config import target_modules
from models.model_spec import ModelSpec
from scheduling.lora.adapter_store import AdapterSource, AdapterState

log = logging.getLogger("numaserve")


@dataclass(frozen=True)
class ModelIdentity:
    path: str  # resolved
    architecture: str
    num_layers: int
    module_shapes: tuple[tuple[str, int, int], ...]  # (module, out_features, in_features), sorted

    @property
    def key(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:16]

    def to_json(self) -> dict:
        return {"path": self.path, "architecture": self.architecture, "num_layers": self.num_layers,
                "module_shapes": [list(s) for s in self.module_shapes]}

    @classmethod
    def from_json(cls, value) -> "ModelIdentity | None":
        if value is None:
            return None
        return cls(str(value["path"]), str(value["architecture"]), int(value["num_layers"]),
                   tuple((str(m), int(o), int(i)) for m, o, i in value["module_shapes"]))

    def __str__(self) -> str:
        return f"{self.architecture} {self.num_layers}-layer model at {self.path} [{self.key}]"


def model_identity(model_path: str | Path, spec: ModelSpec) -> ModelIdentity:
    """The base model's identity: what registered adapters are served against."""
    shapes = tuple(sorted((m, o, i) for m, (o, i) in target_modules(spec).items()))
    return ModelIdentity(str(Path(model_path).expanduser().resolve()), spec.architecture, spec.num_layers,
                         shapes)


@dataclass
class Registration:
    deployment: str | None  # None: written before registrations carried it
    model: ModelIdentity | None
    state: AdapterState

    def to_json(self) -> dict:
        state = self.state
        entry = {"deployment": self.deployment, "model": None if self.model is None else self.model.to_json(),
                 "adapters": {n: s.to_json() for n, s in state.adapters.items()}}
        extra = {"versions": state.versions, "retired": {i: s.to_json() for i, s in state.retired.items()},
                 "digests": state.digests}
        return entry | {key: value for key, value in extra.items() if value}

    @classmethod
    def from_json(cls, r: dict) -> "Registration":
        return cls(r["deployment"], ModelIdentity.from_json(r["model"]), AdapterState(
            {n: AdapterSource.from_json(v) for n, v in dict(r["adapters"]).items()},
            {str(n): int(v) for n, v in dict(r.get("versions", {})).items()},
            {str(i): AdapterSource.from_json(v) for i, v in dict(r.get("retired", {})).items()},
            {str(i): str(d) for i, d in dict(r.get("digests", {})).items()}))


class AdapterRegistry:
    """The registrations file, read and written for one deployment over one base model."""

    def __init__(self, path: str | Path, deployment: str, model: ModelIdentity):
        self.path = Path(path).expanduser()
        self.deployment, self.model = deployment, model

    def read(self) -> AdapterState:
        """This deployment's adapters over this model; those it kept over another model are logged."""
        served = AdapterState()
        for r in self._read_all():
            if r.deployment == self.deployment and r.model == self.model:
                served = r.state
            elif r.state.adapters and r.deployment in (self.deployment, None):
                log.warning("adapters %s registered on deployment %r over the %s are not loaded: this "
                            "deployment serves the %s; register them again to serve them over it",
                            sorted(r.state.adapters), r.deployment,
                            r.model or "unknown model (an older registry)", self.model)
        return served

    def write(self, state: AdapterState) -> None:
        """Keep `state` as this deployment's adapters over this model; every other registration stays."""
        kept = [r for r in self._read_all()
                if r.state.adapters and (r.deployment, r.model) != (self.deployment, self.model)]
        entries = [r.to_json() for r in [*kept, Registration(self.deployment, self.model, state)]]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"registrations": entries}, indent=2, sort_keys=True))
        os.replace(tmp, self.path)  # atomic: a crash leaves the old registry or the new one

    def _read_all(self) -> list[Registration]:
        if not self.path.exists():
            return []
        try:
            data = dict(json.loads(self.path.read_text()))
            if "registrations" not in data:  # written before registrations carried deployment and model
                return [Registration(None, None, AdapterState(
                    {n: AdapterSource.from_json(v) for n, v in data.items()}))]
            return [Registration.from_json(r) for r in data["registrations"]]
        except (ValueError, TypeError, KeyError) as e:
            raise AdapterError(f"{self.path}: the adapter registry is not a JSON object of adapter "
                               f"registrations ({e!r}); fix or delete the file") from None
