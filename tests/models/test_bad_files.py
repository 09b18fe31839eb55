"""Corrupt and lying files, bad YAML and non-finite sampling values: each refused with its typed error naming
the file and the problem, never an IndexError, a numpy error, a huge allocation or a hang."""

import json
import shutil
import struct

import numpy as np
import pytest
from gguf import GGUFReader
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

import numaserve as ns
from models.gguf.writer import convert_to_gguf
from models.loader import load_model
from numaserve.cli import main as cli_main
from tests.models.test_lora import make_adapter

FLIPS = settings(max_examples=40, derandomize=True, deadline=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
UP = "model.layers.0.mlp.up_proj.weight"  # F32 [96, 64]


@pytest.fixture(scope="module")
def shard(llama_dir) -> tuple[bytes, dict, int]:
    """The tiny model's safetensors bytes, its JSON header and the header's length."""
    data = (llama_dir / "model.safetensors").read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    return data, json.loads(data[8:8 + header_len]), header_len


@pytest.fixture
def model_copy(llama_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(llama_dir, d)
    return d


def with_header(shard, edit) -> bytes:
    data, header, header_len = shard
    header = json.loads(json.dumps(header))
    edit(header)
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data[8 + header_len:]


def set_entry(**fields):
    return lambda h: h[UP].update(fields)


SAFETENSORS_LIES = {  # case -> (the file's bytes from shard, the message)
    "huge_header_length": (lambda s: struct.pack("<Q", 1 << 62) + s[0][8:],
                           "header length 4611686018427387904 runs past the"),
    "header_is_a_list": (lambda s: with_header(s, lambda h: h.clear()).replace(b"{}", b"[]"),
                         "header is a JSON list"),
    "offsets_past_the_end": (lambda s: with_header(s, set_entry(data_offsets=[0, 10**12])),
                             f"'{UP}' ends at byte 1000000000000 of the data but the file holds"),
    "offsets_reversed": (lambda s: with_header(s, set_entry(data_offsets=[100, 50])),
                         r"data_offsets \[100, 50\]"),
    "offsets_missing": (lambda s: with_header(s, lambda h: h[UP].pop("data_offsets")), "data_offsets None"),
    "shape_lies_about_size": (lambda s: with_header(s, set_entry(shape=[96, 640])),
                              (r"shape \(96, 640\) of F32 \(245760 bytes\) but its data range holds "
                               r"24576 bytes")),
    "negative_dimension": (lambda s: with_header(s, set_entry(shape=[-96, 64])), "list of non-negative ints"),
    "dtype_unknown": (lambda s: with_header(s, set_entry(dtype="F8_E4M3")), "dtype F8_E4M3 is not supported"),
    "dtype_not_a_string": (lambda s: with_header(s, set_entry(dtype=7)), "malformed header entry"),
    "entry_not_an_object": (lambda s: with_header(s, lambda h: h.update({UP: 5})), "malformed header entry"),
    "truncated_in_header": (lambda s: s[0][:100], "not a readable safetensors file"),
    "truncated_in_data": (lambda s: s[0][:len(s[0]) - 1000], "truncated"),
    "eight_bytes_short": (lambda s: s[0][:5], "not a readable safetensors file"),
}


@pytest.mark.parametrize("case", SAFETENSORS_LIES)
def test_lying_safetensors_headers_raise_checkpoint_error_naming_file_and_problem(case, shard, model_copy):
    make, message = SAFETENSORS_LIES[case]
    path = model_copy / "model.safetensors"
    path.write_bytes(make(shard))
    with pytest.raises(ns.CheckpointError, match=message) as e:
        ns.LLM(model_copy, weight_dtype="float32", kv_dtype="float32", max_model_len=32)
    assert str(path) in str(e.value)


@FLIPS
@given(flips=st.lists(st.tuples(st.integers(0, 2200), st.integers(0, 7)), min_size=1, max_size=4))
def test_bit_flips_in_a_safetensors_header_load_or_raise_checkpoint_error(flips, shard, model_copy):
    data = bytearray(shard[0])
    for pos, bit in flips:
        data[pos % (8 + shard[2])] ^= 1 << bit
    (model_copy / "model.safetensors").write_bytes(bytes(data))
    try:
        load_model(model_copy, "float32")
    except ns.CheckpointError as e:
        assert str(model_copy / "model.safetensors") in str(e) or "config" in str(e)


def test_a_nan_weight_is_refused_naming_the_tensor(shard, model_copy):
    data, header, header_len = shard
    start = 8 + header_len + header[UP]["data_offsets"][0]
    corrupt = bytearray(data)
    corrupt[start + 40:start + 44] = np.float32(np.nan).tobytes()  # what a flipped exponent bit can make
    (model_copy / "model.safetensors").write_bytes(bytes(corrupt))
    with pytest.raises(ns.CheckpointError, match=f"tensor '{UP}' holds NaN or inf"):
        load_model(model_copy, "bfloat16")


def test_a_corrupt_adapter_file_raises_adapter_error_and_the_engine_keeps_serving(llama_dir, tmp_path):
    adapter = make_adapter(llama_dir, tmp_path / "a", seed=1)
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(struct.pack("<Q", 1 << 40) + weights.read_bytes()[8:])
    llm = ns.LLM(llama_dir, weight_dtype="float32", kv_dtype="float32", max_model_len=32)
    with pytest.raises(ns.AdapterError, match="header length 1099511627776 runs past"):
        llm.register_adapter("a", adapter)
    assert llm.generate([5, 6], ns.SamplingParams(max_tokens=2, temperature=0))[0].finish_reason == "length"


# ---- GGUF ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gguf_file(llama_dir, tmp_path_factory) -> tuple[bytes, int]:
    """Our q8_0 export of the tiny model and the length of its header (everything before the tensor data)."""
    path = convert_to_gguf(llama_dir, tmp_path_factory.mktemp("gguf") / "m.gguf", "q8_0")
    return path.read_bytes(), GGUFReader(path).data_offset


def u64(value: int) -> bytes:
    return struct.pack("<Q", value)


GGUF_LIES = {  # case -> (the file's bytes from the good ones)
    "bad_magic": lambda d: b"GGUX" + d[4:],
    "unknown_version": lambda d: d[:4] + struct.pack("<I", 99) + d[8:],
    "tensor_count_huge": lambda d: d[:8] + u64(1 << 60) + d[16:],
    "tensor_count_too_high": lambda d: d[:8] + u64(struct.unpack("<Q", d[8:16])[0] + 5) + d[16:],
    "kv_count_huge": lambda d: d[:16] + u64(1 << 60) + d[24:],
    "string_length_huge": lambda d: d[:24] + u64(1 << 62) + d[32:],  # the first key's length
    "truncated_in_header": lambda d: d[:3000],
}


@pytest.mark.parametrize("case", GGUF_LIES)
def test_lying_gguf_headers_raise_checkpoint_error_naming_the_file(case, gguf_file, tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(GGUF_LIES[case](gguf_file[0]))
    with pytest.raises(ns.CheckpointError, match="not a readable GGUF file") as e:
        load_model(path, "auto")
    assert str(path) in str(e.value)


@FLIPS
@given(flips=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 7)), min_size=1, max_size=4))
def test_bit_flips_in_a_gguf_header_load_or_raise_checkpoint_error(flips, gguf_file, tmp_path):
    data, header_len = gguf_file
    corrupt = bytearray(data)
    for pos, bit in flips:
        corrupt[pos % header_len] ^= 1 << bit
    path = tmp_path / "flipped.gguf"
    path.write_bytes(bytes(corrupt))
    try:
        load_model(path, "auto")
    except ns.CheckpointError as e:
        assert str(path) in str(e)


# ---- YAML configs, the serve command, sampling values ----------------------------------------------------

def test_a_missing_or_binary_yaml_file_is_a_value_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match="nowhere.yaml: cannot read the config file"):
        ns.ClusterConfig.from_yaml(tmp_path / "nowhere.yaml")
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ValueError, match="bin.yaml"):
        ns.ClusterConfig.from_yaml(tmp_path / "bin.yaml")


def test_serve_with_a_bad_yaml_exits_2_naming_the_field_before_starting_ray(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("engine: {max_num_seqs: many}\n")
    assert cli_main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "numaserve: error:" in err and "engine.max_num_seqs" in err
    assert cli_main(["serve", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml: cannot read the config file" in capsys.readouterr().err


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                                   "frequency_penalty"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_sampling_values_are_refused_naming_the_field(field, value):
    with pytest.raises(ValidationError, match=f"{field}[\\s\\S]*finite"):
        ns.SamplingParams(**{field: value})
