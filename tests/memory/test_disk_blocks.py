"""KV block files (memory/disk_blocks.py): a block round-trips bit for bit; a file that is truncated, flipped,
another identity's or another key's is refused and removed; the bound holds over writers sharing a root;
temp files of dead writers go, live writers' stay."""

import os
import subprocess
import sys

import numpy as np
import pytest

from memory.disk_blocks import SUFFIX, BadBlockFile, BlockFiles, BlockKey, parts_spec


def block_parts(rng: np.random.Generator) -> list[np.ndarray]:
    """One block's parts as KVCache.block_parts gives them: int8 codes [16, 2, 24] and float32 scales [16, 2]
    for keys and values of two layers."""
    parts = []
    for _ in range(2):
        parts += [rng.integers(-128, 128, (16, 2, 24), dtype=np.int8) for _ in range(2)]
        parts += [rng.random((16, 2), dtype=np.float32) for _ in range(2)]
    return parts


def payload(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([p.reshape(-1).view(np.uint8) for p in parts])


def key(i: int, extra: str = "(None, None, None)") -> BlockKey:
    return BlockKey(1000 + i, None if i == 0 else 999 + i, tuple(range(i, i + 16)), extra)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def files(root, rng, identity=None, max_bytes=1 << 30) -> BlockFiles:
    return BlockFiles(root, identity or {"model": "a"}, parts_spec(block_parts(rng)), max_bytes)


def test_a_block_round_trips_bit_for_bit(tmp_path, rng):
    store = files(tmp_path, rng)
    parts = block_parts(rng)
    assert store.write([(key(0), payload(parts))]) == (1, store.file_bytes(key(0)), 0)
    assert store.write([(key(0), payload(parts))])[0] == 0  # there already
    into = [np.zeros_like(p) for p in parts]
    assert store.read_into(key(0), into) == store.path(key(0)).stat().st_size
    for a, b in zip(parts, into):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("damage", ["truncated", "longer", "flipped", "other identity", "other key",
                                    "other salt", "other layout"])
def test_a_bad_file_is_refused_and_removed(tmp_path, rng, damage):
    store = files(tmp_path, rng)
    parts = block_parts(rng)
    path = store.path(key(0))
    if damage == "other identity":
        theirs = files(tmp_path / "x", rng, {"model": "b"})
        theirs.write([(key(0), payload(parts))])
        path.write_bytes(theirs.path(key(0)).read_bytes())
    elif damage in ("other key", "other salt"):
        other = key(1) if damage == "other key" else key(0, "(None, None, 'bob')")
        store.write([(other, payload(parts))])
        path.write_bytes(store.path(other).read_bytes())
    elif damage == "other layout":
        wider = [p.astype(np.float32) for p in parts]
        BlockFiles(tmp_path, {"model": "a"}, parts_spec(wider), 1 << 30).write([(key(0), payload(wider))])
        assert path.exists()  # the same name: its size and its parts differ
    else:
        store.write([(key(0), payload(parts))])
        data = bytearray(path.read_bytes())
        if damage == "truncated":
            data = data[:-100]
        elif damage == "longer":
            data += b"\0"
        else:
            data[len(data) // 3] ^= 1
        path.write_bytes(data)
    into = [np.zeros_like(p) for p in parts]
    with pytest.raises(BadBlockFile):
        store.read_into(key(0), into)
    assert not path.exists()  # (what it read into the parts is garbage: the engine frees that block unused)
    with pytest.raises(FileNotFoundError):
        store.read_into(key(0), into)


def test_the_bound_holds_over_writers_sharing_a_root(tmp_path, rng):
    parts = block_parts(rng)
    size = files(tmp_path, rng).file_bytes(key(0))
    bound = 20 * size + size // 2
    a = files(tmp_path, rng, {"model": "a"}, bound)
    b = files(tmp_path, rng, {"model": "b"}, bound)
    for i in range(60):
        (a if i % 3 else b).write([(key(i), payload(parts)), (key(i + 100), payload(parts))])
        on_disk = a.scan()
        assert on_disk[0] <= bound and on_disk == b.scan()
        assert a.usage() == on_disk[0]  # the ledger counts what is there
    # the least recently used went first: a block read just now stays through the next eviction
    newest = max((p.stat().st_mtime_ns, p) for p in a.folder.glob(f"*{SUFFIX}"))[1]
    assert newest.exists()


def test_least_recently_used_goes_first(tmp_path, rng):
    parts = block_parts(rng)
    bound = sum(files(tmp_path, rng).file_bytes(key(i)) for i in range(10))  # the first ten fit
    store = files(tmp_path, rng, max_bytes=bound)
    for i in range(10):
        store.write([(key(i), payload(parts))])
        os.utime(store.path(key(i)), (1000 + i, 1000 + i))
    store.read_into(key(0), [np.zeros_like(p) for p in parts])  # the oldest, used now
    store.write([(key(10), payload(parts))])  # evicts down to 9/10 of the bound, less the new block
    left = {i for i in range(11) if store.path(key(i)).exists()}
    assert 0 in left and 10 in left and {1, 2} - left == {1, 2}
    assert store.scan()[0] <= bound


def test_temp_files_of_dead_writers_go_and_live_writers_stay(tmp_path, rng):
    store = files(tmp_path, rng, max_bytes=1000 * files(tmp_path, rng).file_bytes(key(0)))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    orphan = store.folder / f".x{SUFFIX}.{int(dead.stdout)}.abcd1234.tmp"
    live = store.folder / f".y{SUFFIX}.{os.getppid()}.abcd1234.tmp"
    for p in (orphan, live):
        p.write_bytes(b"half a block")
    (tmp_path / "usage").unlink(missing_ok=True)  # no ledger: the files are counted
    store.write([(key(0), payload(block_parts(rng)))])
    assert not orphan.exists() and live.exists()
    assert store.usage() == store.file_bytes(key(0)) + len(b"half a block")
