"""/proc/self/smaps parsed: each mapping's range, what it maps and its kB counters."""

from memory.smaps import mapping_at, mappings
from tests.models.test_packed_file import SMAPS


def test_each_mapping_has_its_range_path_and_counters_and_no_flags():
    maps = mappings(SMAPS)
    assert [(m.start, m.end, m.path) for m in maps] == [
        (0x7f0000000000, 0x7f0000200000, "/usr/lib/libc.so.6"),
        (0x7fbc26c00000, 0x7fbc6c80f000, "/cache/entry.packed"),
        (0x7fbc6c80f000, 0x7fbc6c810000, "")]
    assert maps[1].kb == {"Size": 1142844, "Rss": 1142844, "AnonHugePages": 0, "FilePmdMapped": 880640}
    assert sum(m.kb.get("Rss", 0) for m in mappings()) > 0  # this process's own


def test_unreadable_smaps_is_no_mappings(monkeypatch, tmp_path):
    from memory import smaps

    monkeypatch.setattr(smaps, "Path", lambda _: tmp_path / "missing")
    assert mappings() == []


def test_the_mapping_at_an_address_is_the_one_whose_range_holds_it():
    maps = mappings(SMAPS)
    for m in maps:
        assert mapping_at(m.start, SMAPS) == m
        assert mapping_at(m.end - 1, SMAPS) == m
    assert mapping_at(0x1000, SMAPS) is None
    assert mapping_at(maps[-1].end, SMAPS) is None
    here = mapping_at(id(maps))  # a Python object's address: in this process's heap
    assert here is not None and here.start <= id(maps) < here.end
