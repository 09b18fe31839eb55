"""The packed cache's directory: entries (models/packed/file.py) named by a key over everything that
changes their bytes, the sources' content hashes, and pruning to a byte budget.

The key: the source's content (sha256 of the GGUF file, or of each .json and .safetensors file of a Hugging
Face directory), the weight and activation dtypes, the calibration file (path and content), the CPU features
(they pick layouts: VNNI interleaves rows), LAYOUT_VERSION and numaserve's version. An entry whose key
differs is never read: it has another name (and its manifest's key is compared too).

Hashing the source at every start would cost about what a warm start costs. So a source's sha256 is computed
when no trusted record of it exists and recorded under sources/ with the file's (size, mtime_ns, ctime_ns,
inode, device); a later start trusts it while all five still match. A write to the file changes its ctime,
which no tool can set back, so a changed source is hashed again (and an unchanged copy or touch re-hashes to
the same key).
"""

import hashlib
import json
import os
import time
import uuid
from importlib import metadata
from pathlib import Path

from kernels.simd.cpu import cpu_features
from models.quantization.calibration import Calibration, calibration_path

# The packed layouts' version. Every packer (Int8Matrix.pack, Bf16Matrix.pack, the K-quant packers, the
# loaders' fusing and row orders) must bump it when the bytes it produces change: entries of another
# version are then never used. 2: a GGUF's F16 tensors load as float16, no longer as bfloat16. 3: the K-quant
# containers moved to memory/block_matrices.py (an entry names its classes by module). 4: the model and kernel
# modules moved into subpackages (models/moe/, models/lora/, ...), which renamed classes' modules. 5: an
# entry's blob starts 16 bytes past a page (models/packed/file.py maps it). 6: the K-quant formats but IQ4 get
# int8 activations without VNNI too (BlockInt8Matrix.vnni): an AVX2 host's entries held them unplanned. 7: a
# Bf16Matrix is row-major (its 4-row blocks were interleaved by group).
LAYOUT_VERSION = 7
ENTRY_SUFFIX = ".packed"
_HASH_BYTES = 64 << 20
_STALE_TEMP_SECONDS = 3600  # a temp file untouched this long belongs to a writer that died


def source_files(model_path: Path) -> list[Path]:
    """The files a load reads: the GGUF file, or each .json and .safetensors file of the directory."""
    if not model_path.is_dir():
        return [model_path]
    return sorted(p for p in model_path.iterdir() if p.suffix in (".json", ".safetensors") and p.is_file()
                  and p != calibration_path(model_path))


def numaserve_version() -> str:
    try:
        return metadata.version("numaserve")
    except metadata.PackageNotFoundError:
        return "unknown"


class PackedCache:
    def __init__(self, directory: Path, max_bytes: int):
        """Raises OSError if the directory cannot be created."""
        self.directory, self.max_bytes = directory, max_bytes
        (directory / "sources").mkdir(parents=True, exist_ok=True)

    def key(self, model_path: Path, weight_dtype: str, activation_dtype: str, activation_scales: str,
            calibration: Calibration | None, imatrix: str | None = None) -> tuple[dict, float]:
        """-> (the key's fields, seconds spent hashing sources whose recorded hash could not be trusted).
        imatrix: the importance matrix file the weights are quantized with (its content is keyed)."""
        hashed, digests = 0.0, []
        for path in source_files(model_path):
            digest, seconds = self._source_hash(path)
            digests.append([path.name if model_path.is_dir() else "", digest])  # a renamed GGUF file hits
            hashed += seconds
        imatrix_digest = None
        if imatrix is not None:
            imatrix_digest, seconds = self._source_hash(Path(imatrix).expanduser().resolve())
            hashed += seconds
        fields = {"source": digests, "weight_dtype": weight_dtype, "activation_dtype": activation_dtype,
                  "activation_scales": activation_scales,
                  # its path too: planning's decisions (replayed on a hit) name it
                  "calibration": None if calibration is None else [
                      calibration.path, _sha256_text(calibration.model_dump_json())],
                  "imatrix": imatrix_digest,
                  "cpu_features": sorted(cpu_features()), "layout_version": LAYOUT_VERSION,
                  "numaserve": numaserve_version()}
        return fields, hashed

    def entry_path(self, key: dict) -> Path:
        return self.directory / (_sha256_text(json.dumps(key, sort_keys=True))[:40] + ENTRY_SUFFIX)

    def touch(self, entry: Path) -> None:
        """Mark an entry used now (pruning removes the least recently used)."""
        try:
            os.utime(entry)
        except OSError:
            pass  # a read-only cache still serves its entries

    def prune(self, keep: Path) -> list[Path]:
        """Remove the least recently used entries (never keep) until the entries fit max_bytes, and the temp
        files of writers that died. -> the entries removed."""
        entries, removed = [], []
        now = time.time()
        for p in self.directory.iterdir():
            try:
                st = p.stat()
            except FileNotFoundError:
                continue  # another process removed it meanwhile
            if p.suffix == ENTRY_SUFFIX:
                entries.append((st.st_mtime, st.st_size, p))
            elif p.name.endswith(".tmp") and now - st.st_mtime > _STALE_TEMP_SECONDS:
                p.unlink(missing_ok=True)
        total = sum(size for _, size, _ in entries)
        for _, size, p in sorted(entries):
            if total <= self.max_bytes:
                break
            if p != keep:
                p.unlink(missing_ok=True)
                removed.append(p)
                total -= size
        return removed

    def _source_hash(self, path: Path) -> tuple[str, float]:
        """-> (sha256 of the file, seconds spent hashing: 0 when the recorded hash was trusted)."""
        st = path.stat()
        stat = [str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]
        record = self.directory / "sources" / (_sha256_text(stat[0])[:40] + ".json")
        try:
            recorded = json.loads(record.read_text())
            if recorded["stat"] == stat:
                return recorded["sha256"], 0.0
        except (OSError, ValueError, KeyError, TypeError):
            pass  # none yet, or unreadable: hash again
        started = time.perf_counter()
        digest = _sha256_file(path)
        seconds = time.perf_counter() - started
        tmp = record.with_name(f".{record.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            tmp.write_text(json.dumps({"stat": stat, "sha256": digest}))
            os.replace(tmp, record)
        except OSError:
            tmp.unlink(missing_ok=True)  # hashed again next time
        return digest, seconds


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_HASH_BYTES):
            h.update(chunk)
    return h.hexdigest()
