"""read_header (models/gguf/header.py) equals gguf-py's GGUFReader on every file it reads: llama.cpp's own
files (K-quants, I-quants) and numaserve's exports in every stored type: each metadata value as
field.contents() gives it, and each tensor's name, type, dims, data offset, data dtype and shape."""

from pathlib import Path

import gguf
import numpy as np
import pytest

from models.gguf import header
from models.gguf.header import read_header
from models.gguf.writer import convert_to_gguf

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
LLAMA_CPP_FILES = ("tiny-llama-q4_k_m.gguf", "tiny-llama-iq4_nl.gguf", "tiny-llama-iq4_xs.gguf")


def assert_equals_gguf_reader(path: Path) -> None:
    metadata, tensors = read_header(path)
    reader = gguf.GGUFReader(path)
    assert metadata == {name: field.contents() for name, field in reader.fields.items()
                        if not name.startswith("GGUF.")}
    assert [type(v) for v in metadata.values()] == [type(f.contents()) for n, f in reader.fields.items()
                                                     if not n.startswith("GGUF.")]
    assert [(t.name, t.tensor_type, t.dims, t.data_offset, t.data_dtype, t.data_shape) for t in tensors] == [
        (t.name, t.tensor_type, tuple(t.shape.tolist()), t.data_offset, t.data.dtype, t.data.shape)
        for t in reader.tensors]


@pytest.mark.parametrize("name", LLAMA_CPP_FILES)
def test_llama_cpps_files_read_as_gguf_py_reads_them(name):
    assert_equals_gguf_reader(FIXTURES / name)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "q8_0", "q4_0", "q4_k_m"])
def test_our_exports_read_as_gguf_py_reads_them(llama_dir, tmp_path, dtype):
    assert_equals_gguf_reader(convert_to_gguf(llama_dir, tmp_path / f"llama-{dtype}.gguf", dtype))


def test_a_header_read_a_few_bytes_at_a_time_is_the_same(monkeypatch):
    whole = read_header(FIXTURES / LLAMA_CPP_FILES[0], strings=False)
    monkeypatch.setattr(header, "HEADER_READ", 13)  # every field straddles reads
    assert_equals_gguf_reader(FIXTURES / LLAMA_CPP_FILES[0])
    assert read_header(FIXTURES / LLAMA_CPP_FILES[0], strings=False) == whole


def test_a_truncated_header_raises(tmp_path):
    whole = (FIXTURES / LLAMA_CPP_FILES[0]).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:5000])
    with pytest.raises(EOFError, match="past the end of the file"):
        read_header(cut)
    huge = bytearray(whole[:5000])
    huge[24:32] = (1 << 62).to_bytes(8, "little")  # the first key's length
    cut.write_bytes(bytes(huge))
    with pytest.raises(EOFError, match="past the end of the file"):  # refused, not allocated
        read_header(cut)
    cut.write_bytes(b"GGUX" + whole[4:5000])
    with pytest.raises(ValueError, match="magic"):
        read_header(cut)


@pytest.mark.parametrize("name", LLAMA_CPP_FILES)
def test_string_arrays_stepped_over_keep_their_lengths_and_the_rest(name):
    metadata, tensors = read_header(FIXTURES / name)
    unread, same_tensors = read_header(FIXTURES / name, strings=False)
    assert same_tensors == tensors and unread.keys() == metadata.keys()
    stepped = {k for k, v in unread.items() if isinstance(v, header.UnreadStrings)}
    assert "tokenizer.ggml.tokens" in stepped
    for key, value in metadata.items():
        if key in stepped:
            assert all(isinstance(v, str) for v in value) and len(unread[key]) == len(value)
        else:
            assert unread[key] == value


def test_a_nested_array_of_strings_is_read_whole_either_way(tmp_path):
    path = tmp_path / "nested.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_array("test.nested", [["a", "bc"], ["def"]])
    writer.add_tensor("t", np.zeros(32, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_equals_gguf_reader(path)
    assert read_header(path, strings=False)[0]["test.nested"] == ["a", "bc", "def"]
