"""An engine's model: loaded (models/loader.py) and its matrices planned for their activations
(models/quantization/activation_plan.py), through the packed cache (models/packed/cache.py) when it is on.

A hit maps (map_packed_weights: by default where the mapping comes on huge pages) or reads the planned
weights, the spec and the tokenizer back from one entry and replays the decisions planning recorded; nothing
is loaded or repacked. A miss loads, plans, and writes an entry. Whatever goes wrong with the cache (an
unwritable or full directory, a stale or corrupt entry, something it cannot store) costs the cache, never the
load: the outcome and its reason go to the decision log (topic "packed_cache"; a rebuild or a failure also as
a warning) and to the LoadStats an engine keeps.
"""

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tokenizers import Tokenizer as HFTokenizer

from cluster_configs.diagnostics import DecisionLog
from cluster_configs.engine_config import EngineConfig
from memory.numa import NumaNode, read_topology
from memory.weights import ModelWeights
from models.loader import load_model, read_spec
from models.model_spec import ModelSpec
from models.packed.cache import PackedCache
from models.packed.file import CorruptEntry, read_entry, write_entry
from models.packed.tree import Unstorable, flatten, unflatten
from models.quantization.activation_plan import ActivationPlan
from models.quantization.calibration import Calibration, load_calibration
from models.quantization.imatrix import read_imatrix
from models.tensor_parallel.shard import WHOLE_MODEL, TensorShard
from models.tokenizer import Tokenizer

Outcome = Literal["hit", "built", "rebuilt", "not cached", "off"]
# what reading an entry may raise when its bytes or its description do not fit the code: rebuilt, not used
# (a bad tokenizer.json would make the tokenizers library raise a bare Exception: the manifest holding it is
# checksummed before it is parsed)
_UNREADABLE = (CorruptEntry, OSError, ValueError, KeyError, TypeError, AttributeError, IndexError)


@dataclass(frozen=True)
class LoadStats:
    """How an engine's weights were loaded."""

    outcome: Outcome  # "rebuilt": a stale or corrupt entry was replaced; "not cached": the cache failed
    reason: str
    seconds: float  # the whole load: hashing, then reading the entry or loading, planning and writing one
    hash_seconds: float  # hashing sources whose recorded hash could not be trusted
    entry: str | None  # the entry's path
    entry_bytes: int  # its size (0 when none was read or written)

    @property
    def hit(self) -> bool:
        return self.outcome == "hit"


@dataclass(frozen=True)
class PlannedModel:
    spec: ModelSpec
    weights: ModelWeights  # planned: matrices packed for their activations
    tokenizer: Tokenizer | None
    stats: LoadStats


def load_planned(model_path: str | Path, config: EngineConfig, decisions: DecisionLog,
                 shard: TensorShard = WHOLE_MODEL) -> PlannedModel:
    """shard: a tensor-parallel rank's part (its own cache entry). Raises CheckpointError as load_model and
    plan_activations do; never for the cache's sake."""
    started = time.perf_counter()
    model_path = Path(model_path)
    calibration = load_calibration(model_path)
    cache, key, hash_seconds, why_not = _keyed_cache(model_path, config, calibration)
    if key is not None and shard.size > 1:
        key = key | {"shard": [shard.rank, shard.size, shard.expert_parallel]}
    if key is None:
        spec, weights, tokenizer, _ = _load(model_path, config, decisions, calibration, shard)
        outcome: Outcome = "off" if config.packed_cache_dir is None else "not cached"
        return _done(spec, weights, tokenizer, decisions, outcome, why_not, started, hash_seconds, None, 0)
    entry = cache.entry_path(key)
    try:
        hit = _read(entry, key, decisions, maps_entries(config))
    except FileNotFoundError:
        outcome, problem = "built", "no entry yet"
    except _UNREADABLE as e:
        outcome, problem = "rebuilt", f"{type(e).__name__}: {e}"
    else:
        cache.touch(entry)
        return _done(hit.spec, hit.weights, hit.tokenizer, decisions, "hit", hit.how, started, hash_seconds,
                     entry, hit.entry_bytes)
    spec, weights, tokenizer, recorded = _load(model_path, config, decisions, calibration, shard)
    try:
        tree, arrays = flatten({"spec": spec, "weights": weights})
        text = None if tokenizer is None else tokenizer.hf_tokenizer.to_str()  # its tokenizer.json
        fields = {"key": key, "tree": tree, "tokenizer": text, "decisions": recorded}
        size = write_entry(entry, fields, arrays)
    except Unstorable as e:
        outcome, reason, size = "not cached", f"{problem}; nothing written: cannot store {e}", 0
    except OSError as e:
        outcome, reason, size = "not cached", f"{problem}; cannot write {entry} ({e})", 0
    else:
        removed = cache.prune(keep=entry)
        reason = f"{problem}; wrote {entry}" + (f", removed {len(removed)} least recently used" if removed
                                               else "")
    return _done(spec, weights, tokenizer, decisions, outcome, reason, started, hash_seconds,
                 entry if size else None, size)


def model_key(model_path: str | Path, config: EngineConfig, directory: str | Path) -> dict:
    """The packed cache's key of the model as config loads it (its sources' content, the dtypes, the
    calibration, the CPU's features, the versions), its source hashes recorded under directory/sources: what
    identifies the KV the model computes (the prefix cache's disk tier). Raises OSError."""
    model_path = Path(model_path)
    cache = PackedCache(Path(directory).expanduser(), 0)
    key, _ = cache.key(model_path, config.weight_dtype, config.activation_dtype, config.activation_scales,
                       load_calibration(model_path), config.imatrix)
    return key


@dataclass(frozen=True)
class _Hit:
    """What an entry gave back."""

    spec: ModelSpec
    weights: ModelWeights
    tokenizer: Tokenizer | None
    entry_bytes: int  # of its arrays
    how: str  # "mapped <entry>: why" or "read <entry>: why"


def _read(entry: Path, key: dict, decisions: DecisionLog, mapped: bool | Literal["auto"]) -> _Hit:
    """The entry's model; planning's decisions replayed into decisions. Raises FileNotFoundError (no entry)
    or one of _UNREADABLE."""
    built = {}

    def meanwhile(fields: dict) -> None:  # while the blob is read: the tokenizer from its tokenizer.json
        built["tokenizer"] = _tokenizer(fields["tokenizer"])

    read = read_entry(entry, meanwhile, mapped)
    fields, arrays = read.fields, read.arrays
    if fields["key"] != key:
        raise CorruptEntry(f"{entry}: its manifest's key is another model's")
    tree = unflatten(fields["tree"], arrays)
    replayed = [(topic, choice, why, subject, warn)  # all well-formed before any is recorded
                for topic, choice, why, subject, warn in fields["decisions"]]
    for topic, choice, why, subject, warn in replayed:
        decisions.record(topic, choice, why, subject, warn=warn)
    how = f"{'mapped' if read.mapped else 'read'} {entry}: {read.why}"
    return _Hit(tree["spec"], tree["weights"], built["tokenizer"], sum(a.nbytes for a in arrays), how)


def maps_entries(config: EngineConfig, topology: list[NumaNode] | None = None) -> bool | Literal["auto"]:
    """Whether a hit maps its entry (zero-copy) rather than reading it (read_entry's mapped): as
    config.map_packed_weights says, on a machine of one NUMA node (topology: the machine's, read from /sys by
    default). On several, "auto" reads a copy: each node's workers want their weights next to their cores,
    and replicas on two nodes mapping one entry would share the page cache's one copy, wherever its pages
    first landed. True maps there too, for a machine whose entries are each mapped by one worker (the ranks
    of one tensor-parallel group, each its own shard's entry): the mapping is bound to the worker's node
    (models/packed/file.py), its pages moved there."""
    if topology is None:
        topology = read_topology(allowed=list(range(os.cpu_count() or 1)))
    if len(topology) > 1 and config.map_packed_weights is not True:  # "auto" reads
        return False
    return config.map_packed_weights


def _keyed_cache(model_path: Path, config: EngineConfig, calibration: Calibration | None,
                 ) -> tuple[PackedCache | None, dict | None, float, str]:
    """-> (the cache, the model's key in it, seconds spent hashing its files; or None, None, 0, why not)."""
    if config.packed_cache_dir is None:
        return None, None, 0.0, "packed_cache_dir=None: the weights are repacked at every start"
    directory = Path(config.packed_cache_dir).expanduser()
    try:
        cache = PackedCache(directory, config.packed_cache_bytes)
    except OSError as e:
        return None, None, 0.0, f"cannot use {directory} ({e}); the weights are repacked at every start"
    try:
        key, seconds = cache.key(model_path, config.weight_dtype, config.activation_dtype,
                                 config.activation_scales, calibration, config.imatrix)
    except OSError as e:
        return None, None, 0.0, f"cannot hash the model's files ({e})"
    return cache, key, seconds, ""


class _Recording:
    """Stands in for the DecisionLog while planning: passes each decision on and keeps it (an entry stores
    them; a hit replays them)."""

    def __init__(self, log: DecisionLog):
        self.log, self.records = log, []

    def record(self, topic: str, choice: str, reason, subject: str = "", *, warn: bool = False) -> None:
        self.log.record(topic, choice, reason, subject, warn=warn)
        self.records.append([topic, choice, reason if isinstance(reason, str) else reason(), subject, warn])


def _tokenizer(text: str | None) -> Tokenizer | None:
    """From its tokenizer.json text."""
    return None if text is None else Tokenizer(HFTokenizer.from_str(text))


def _load(model_path: Path, config: EngineConfig, decisions: DecisionLog, calibration: Calibration | None,
          shard: TensorShard) -> tuple[ModelSpec, ModelWeights, Tokenizer | None, list]:
    """Each layer planned as the loader builds it: the unplanned copy of one layer at a time, not of the
    model, is what a load holds beside the planned weights."""
    imatrix = None if config.imatrix is None else read_imatrix(config.imatrix)
    whole = read_spec(model_path)
    recording = _Recording(decisions)
    plan = ActivationPlan(config.activation_dtype, recording, calibration,
                          config.activation_scales == "static", whole.num_layers,
                          any(whole.is_moe(i) for i in range(whole.num_layers)))
    spec, weights, tokenizer = load_model(model_path, config.weight_dtype, shard, imatrix, plan.layer)
    return spec, plan.finish(weights), tokenizer, recording.records


def _done(spec, weights, tokenizer, decisions: DecisionLog, outcome: Outcome, reason: str, started: float,
          hash_seconds: float, entry: Path | None, entry_bytes: int) -> PlannedModel:
    decisions.record("packed_cache", outcome, reason, warn=outcome in ("rebuilt", "not cached"))
    stats = LoadStats(outcome, reason, time.perf_counter() - started, hash_seconds,
                      None if entry is None else str(entry), entry_bytes)
    return PlannedModel(spec, weights, tokenizer, stats)
