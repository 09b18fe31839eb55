"""Importance matrices (models/quantization/imatrix.py): what `numaserve calibrate --imatrix` collects
against transformers' own activations (dense and per expert), the files round-tripping in llama.cpp's GGUF
and legacy formats, quantizing with one at load and at export, and the typed errors of a file that does not
fit. With the bench extra, llama.cpp's own tools: llama-imatrix's matrix of the same model and text equals
ours, and llama-quantize --imatrix writes our bytes."""

import importlib.util
import struct
import subprocess

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from cluster_configs.errors import CheckpointError
from memory.matrices import WeightMatrix
from models.checkpoint import load_weights
from models.gguf.writer import convert_to_gguf
from models.quantization.calibrate import compute_imatrix
from models.quantization.imatrix import (
    ImatrixEntry,
    ImatrixError,
    ImportanceMatrix,
    imatrix_chunks,
    read_imatrix,
    write_imatrix,
)
from models.tokenizer import Tokenizer
from numaserve.cli import main as cli_main
from tests.support.model_factory import CORPUS, build_model

TEXT = "".join(CORPUS) * 12
CHUNK = 64
needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                     reason="llama-cpp-python (the bench extra) is not installed")


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    # hidden 256: whole K-quant super-blocks; untied, so the output can be recorded too
    path = tmp_path_factory.mktemp("imatrix-dense") / "model"
    build_model(path, "llama", seed=5, hidden_size=256, intermediate_size=512, head_dim=32,
                num_attention_heads=8, num_key_value_heads=4, initializer_range=0.05)
    return path


@pytest.fixture(scope="module")
def dense_imatrix(dense_dir):
    return compute_imatrix(dense_dir, [TEXT], "test text", CHUNK, process_output=True)


def hf_chunks(model_dir) -> list[np.ndarray]:
    """The chunks compute_imatrix runs, by the rule it documents (llama-imatrix's)."""
    tokenizer = Tokenizer.from_dir(model_dir).hf_tokenizer
    return imatrix_chunks(np.array(tokenizer.encode(TEXT).ids, np.int64), CHUNK, 1)


def hf_sums(model_dir, modules: dict[str, str]) -> dict[str, tuple[np.ndarray, int]]:
    """transformers' float32 forward over the chunks: GGUF tensor -> (sum of x**2 per input column of its
    module (float64), tokens)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    sums = {name: [np.zeros(model.get_submodule(m).in_features), 0] for name, m in modules.items()}

    def hook(name):
        def record(module, args):
            x = args[0].detach().double().reshape(-1, args[0].shape[-1]).numpy()
            sums[name][0] += (x * x).sum(0)
            sums[name][1] += x.shape[0]
        return record

    handles = [model.get_submodule(m).register_forward_pre_hook(hook(name)) for name, m in modules.items()]
    with torch.no_grad():
        for chunk in hf_chunks(model_dir):
            model(torch.tensor(chunk)[None])
    for h in handles:
        h.remove()
    return {name: (s, n) for name, (s, n) in sums.items()}


def test_the_collected_sums_equal_transformers_activations(dense_dir, dense_imatrix):
    modules = {"output.weight": "lm_head"}
    for i in range(2):
        modules |= {f"blk.{i}.attn_{n}.weight": f"model.layers.{i}.self_attn.{n}_proj" for n in "qkv"}
        modules |= {f"blk.{i}.attn_output.weight": f"model.layers.{i}.self_attn.o_proj",
                    f"blk.{i}.ffn_gate.weight": f"model.layers.{i}.mlp.gate_proj",
                    f"blk.{i}.ffn_up.weight": f"model.layers.{i}.mlp.up_proj",
                    f"blk.{i}.ffn_down.weight": f"model.layers.{i}.mlp.down_proj"}
    reference = hf_sums(dense_dir, modules)
    assert set(dense_imatrix.entries) == set(modules)
    for name, (sums, tokens) in reference.items():
        entry = dense_imatrix.entries[name]
        assert entry.counts.tolist() == [tokens], name
        np.testing.assert_allclose(entry.sums[0], sums, rtol=1e-4, err_msg=name)
    assert dense_imatrix.chunk_count == len(hf_chunks(dense_dir)) and dense_imatrix.chunk_size == CHUNK
    assert dense_imatrix.datasets == ("test text",)


def test_the_experts_sums_equal_transformers_routing(tmp_path):
    # Qwen3-MoE, layer 0 dense and layers 1, 2 of 8 experts (top 2): per expert, the inputs of the tokens
    # transformers routes to it (gate|up) and its SiLU(gate) * up (down), from transformers' own hidden
    # states and weights
    path = tmp_path / "moe"
    build_model(path, "qwen3_moe", seed=2)
    ours = compute_imatrix(path, [TEXT], "test text", CHUNK)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    seen = {i: [] for i in (1, 2)}
    handles = [model.get_submodule(f"model.layers.{i}.mlp.experts").register_forward_pre_hook(
        lambda module, args, i=i: seen[i].append((args[0].numpy().copy(), args[1].numpy().copy())))
        for i in seen]
    with torch.no_grad():
        for chunk in hf_chunks(path):
            model(torch.tensor(chunk)[None])
    for h in handles:
        h.remove()
    for i, calls in seen.items():
        experts = model.get_submodule(f"model.layers.{i}.mlp.experts")
        gate_up, down = experts.gate_up_proj.detach().double().numpy(), experts.down_proj.detach().numpy()
        E, inter = gate_up.shape[0], down.shape[-1]
        sums_in, sums_act, counts = np.zeros((E, 64)), np.zeros((E, inter)), np.zeros(E)
        for hidden, ids in calls:
            for e in range(E):
                x = hidden[(ids == e).any(1)].astype(np.float64)
                h = x @ gate_up[e].T
                act = h[:, :inter] / (1 + np.exp(-h[:, :inter])) * h[:, inter:]
                sums_in[e] += (x * x).sum(0)
                sums_act[e] += (act * act).sum(0)
                counts[e] += len(x)
        for name, sums in ((f"blk.{i}.ffn_gate_exps.weight", sums_in),
                           (f"blk.{i}.ffn_up_exps.weight", sums_in),
                           (f"blk.{i}.ffn_down_exps.weight", sums_act)):
            entry = ours.entries[name]
            assert entry.counts.tolist() == counts.tolist(), name
            np.testing.assert_allclose(entry.sums, sums, rtol=1e-4, atol=1e-6 * sums.max(), err_msg=name)
    assert "blk.0.ffn_down.weight" in ours.entries and "blk.1.ffn_down.weight" not in ours.entries


def test_gguf_and_legacy_files_round_trip(dense_imatrix, tmp_path):
    back = read_imatrix(write_imatrix(dense_imatrix, tmp_path / "m.gguf"))
    assert back == dense_imatrix and back.path == str(tmp_path / "m.gguf")
    legacy = read_imatrix(write_imatrix(dense_imatrix, tmp_path / "m.dat"))
    assert legacy.datasets == dense_imatrix.datasets and legacy.chunk_count == dense_imatrix.chunk_count
    for name in dense_imatrix.entries:
        np.testing.assert_allclose(legacy.importance(name), dense_imatrix.importance(name), rtol=1e-6)
    # the GGUF file as llama.cpp's loader reads it: the keys it requires, F32 sums and counts
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    assert reader.fields["general.type"].contents() == "imatrix"
    assert reader.fields["imatrix.chunk_size"].contents() == CHUNK
    kinds = {t.tensor_type for t in reader.tensors}
    assert kinds == {gguf.GGMLQuantizationType.F32} and len(reader.tensors) == 2 * len(dense_imatrix.entries)


def test_a_legacy_file_written_as_llama_cpp_does_reads_as_its_means(tmp_path):
    # llama-imatrix's .dat: values = sums / count * ncall; the importance is values / ncall, experts' rows
    # kept in one row (llama-quantize offsets them by expert)
    values = np.arange(1, 9, dtype=np.float32)
    name = b"blk.0.ffn_down_exps.weight"
    data = (struct.pack("<i", 1) + struct.pack("<i", len(name)) + name + struct.pack("<ii", 4, 8)
            + values.tobytes() + struct.pack("<i", 10) + struct.pack("<i", 4) + b"wiki")
    (tmp_path / "old.dat").write_bytes(data)
    im = read_imatrix(tmp_path / "old.dat")
    assert im.datasets == ("wiki",) and im.chunk_count == 10
    np.testing.assert_array_equal(im.importance("blk.0.ffn_down_exps.weight"), values[None] / 4)


def test_loading_with_an_imatrix_quantizes_each_matrix_with_its_importance(dense_dir, dense_imatrix):
    _, plain = load_weights(dense_dir, "q4_k_m")
    _, weighted = load_weights(dense_dir, "q4_k_m", imatrix=dense_imatrix)
    from safetensors.numpy import load_file
    tensors = load_file(dense_dir / "model.safetensors")
    down = tensors["model.layers.1.mlp.down_proj.weight"]
    expected = WeightMatrix.from_float(down, weighted.layers[1].down.dtype,
                                       dense_imatrix.importance("blk.1.ffn_down.weight"))
    assert np.array_equal(weighted.layers[1].down.data, expected.data)
    assert not np.array_equal(weighted.layers[1].down.data, plain.layers[1].down.data)
    lm_head = WeightMatrix.from_float(tensors["lm_head.weight"], "q6_k",
                                      dense_imatrix.importance("output.weight"))
    assert np.array_equal(weighted.lm_head.data, lm_head.data)


def test_a_tensor_parallel_rank_quantizes_its_part_with_its_columns_importance(dense_dir, dense_imatrix):
    # rank 1 of 2 holds half of o_proj's and down_proj's columns (and half of q|k|v's, gate|up's rows): its
    # matrices equal the whole tensors' parts quantized with the same part of the importance
    from safetensors.numpy import load_file

    from models.tensor_parallel.shard import TensorShard

    whole = load_file(dense_dir / "model.safetensors")
    shard = TensorShard(1, 2)
    spec, weights = load_weights(dense_dir, "q4_k", shard, imatrix=dense_imatrix)
    for name, gguf_name, served in (("model.layers.0.self_attn.o_proj.weight", "blk.0.attn_output.weight",
                                     weights.layers[0].o),
                                    ("model.layers.1.mlp.down_proj.weight", "blk.1.ffn_down.weight",
                                     weights.layers[1].down)):
        axis, spans = shard.pieces(name, spec)
        assert axis == 1  # split by columns
        cols = np.concatenate([np.arange(lo, hi) for lo, hi in spans])
        importance = dense_imatrix.importance(gguf_name)[:, cols]
        expected = WeightMatrix.from_float(whole[name][:, cols], "q4_k", importance)
        assert np.array_equal(served.data, expected.data), name


def test_export_with_an_imatrix_writes_the_bytes_the_loader_serves(dense_dir, dense_imatrix, tmp_path):
    im_path = write_imatrix(dense_imatrix, tmp_path / "m.gguf")
    out = convert_to_gguf(dense_dir, tmp_path / "q4_0.gguf", "q4_0", imatrix=im_path)
    tensors = {t.name: np.array(t.data) for t in gguf.GGUFReader(out).tensors}
    _, weighted = load_weights(dense_dir, "q4_0", imatrix=dense_imatrix)
    assert np.array_equal(tensors["blk.0.attn_output.weight"], weighted.layers[0].o.ggml_blocks())


def test_an_engine_serves_the_imatrix_weights_and_the_packed_cache_keys_the_file(dense_dir, dense_imatrix,
                                                                               tmp_path, make_llm):
    im_path = write_imatrix(dense_imatrix, tmp_path / "m.gguf")
    cache = str(tmp_path / "packed")
    prompt = [5, 9, 14, 3, 7, 21]
    plain = make_llm(dense_dir, weight_dtype="q4_0", packed_cache_dir=cache)
    weighted = make_llm(dense_dir, weight_dtype="q4_0", imatrix=str(im_path), packed_cache_dir=cache)
    # no hit for the second: the file is part of the key
    assert plain.engine.load_stats.outcome == "built" and weighted.engine.load_stats.outcome == "built"
    again = make_llm(dense_dir, weight_dtype="q4_0", imatrix=str(im_path), packed_cache_dir=cache)
    assert again.engine.load_stats.outcome == "hit"
    scores = [llm.score(prompt) for llm in (plain, weighted, again)]
    assert not np.array_equal(scores[0], scores[1]) and np.array_equal(scores[1], scores[2])


def test_a_file_that_does_not_fit_the_model_is_a_typed_error_naming_the_tensor(dense_dir, dense_imatrix,
                                                                             tmp_path, make_llm):
    wrong = dict(dense_imatrix.entries)
    wrong["blk.1.ffn_down.weight"] = ImatrixEntry(np.ones((1, 100), np.float32), np.ones(1, np.float32))
    path = write_imatrix(ImportanceMatrix(wrong, ("x",), 1, CHUNK), tmp_path / "wrong.gguf")
    with pytest.raises(ImatrixError, match=r"blk\.1\.ffn_down\.weight.*100 columns.*another model"):
        load_weights(dense_dir, "q4_k", imatrix=read_imatrix(path))
    missing = {k: v for k, v in dense_imatrix.entries.items() if k != "blk.0.attn_q.weight"}
    path = write_imatrix(ImportanceMatrix(missing, ("x",), 1, CHUNK), tmp_path / "missing.gguf")
    with pytest.raises(ImatrixError, match=r"no entry for tensor 'blk\.0\.attn_q\.weight'"):
        make_llm(dense_dir, weight_dtype="q4_k", imatrix=str(path))
    (tmp_path / "junk.gguf").write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    for bad in (tmp_path / "junk.gguf", tmp_path / "absent.gguf"):
        with pytest.raises(CheckpointError, match="imatrix|importance|cannot be read"):
            make_llm(dense_dir, weight_dtype="q4_k", imatrix=str(bad))


def test_the_calibrate_command_writes_the_file(dense_dir, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    out = str(tmp_path / "out.gguf")
    assert cli_main(["calibrate", str(dense_dir), "--text", str(text), "--imatrix", out,
                     "--chunk", str(CHUNK)]) == 0
    assert "importance matrix" in capsys.readouterr().out
    im = read_imatrix(tmp_path / "out.gguf")
    assert "output.weight" not in im.entries and len(im.entries) == 14  # 7 per layer, no --process-output
    # --weight-dtype: the forward in those weights (float32 by default), so other, nearby sums
    assert cli_main(["calibrate", str(dense_dir), "--text", str(text), "--imatrix", str(tmp_path / "q8.gguf"),
                     "--chunk", str(CHUNK), "--weight-dtype", "q8_0"]) == 0
    q8 = read_imatrix(tmp_path / "q8.gguf")
    for name, entry in im.entries.items():
        difference = np.abs(q8.entries[name].sums - entry.sums).sum() / entry.sums.sum()
        assert 0 < difference < 0.02, (name, difference)
    assert cli_main(["calibrate", str(dense_dir), "--text", str(text), "--imatrix", str(tmp_path / "x.gguf"),
                     "--chunk", "100000"]) != 0
    err = capsys.readouterr().err
    assert err.startswith("numaserve: error:") and "--chunk 100000" in err
    assert not (tmp_path / "x.gguf").exists()


# ---- llama.cpp's own tools (the bench extra) -------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_tools():
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python (the bench extra) is not installed")
    from benchmarks.llama_server import llama_cpp_tool

    try:
        return {name: llama_cpp_tool(name) for name in ("llama-imatrix", "llama-quantize")}
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"llama.cpp's tools could not be built here ({e})")


def test_llama_imatrix_of_the_demo_model_equals_ours(llama_tools, tmp_path):
    # the demo model exported F32 (its bf16 weights exactly), llama-imatrix with a float32 KV cache and
    # without flash attention (its CPU kernel rounds through f16), over the held-out text
    from numaserve.demo import DEMO_DIR
    from numaserve.demo_corpus import heldout_texts

    text = tmp_path / "heldout.txt"
    text.write_text("".join(heldout_texts()[:4]))
    model = convert_to_gguf(DEMO_DIR / "base", tmp_path / "demo-f32.gguf", "float32")
    theirs_path = tmp_path / "llama.gguf"
    subprocess.run([str(llama_tools["llama-imatrix"]), "-m", str(model), "-f", str(text),
                    "-o", str(theirs_path), "-c", "256", "-b", "256", "-t", "2", "--no-ppl",
                    "-ctk", "f32", "-ctv", "f32", "-fa", "off"], check=True, capture_output=True)
    theirs = read_imatrix(theirs_path)
    ours = compute_imatrix(DEMO_DIR / "base", [text.read_text()], str(text), 256)
    assert set(ours.entries) == set(theirs.entries) and ours.chunk_count == theirs.chunk_count
    for name, entry in theirs.entries.items():
        assert ours.entries[name].counts.tolist() == entry.counts.tolist(), name
        np.testing.assert_allclose(ours.entries[name].sums, entry.sums, rtol=1e-4, err_msg=name)
    # and llama-quantize reads ours: its Q4_K_M / Q4_0 / Q6_K bytes with our file are our export's
    ours_path = write_imatrix(ours, tmp_path / "ours.gguf")
    f16 = convert_to_gguf(DEMO_DIR / "base", tmp_path / "demo-f16.gguf", "float16")
    for ftype, dtype in (("Q4_K_M", "q4_k_m"), ("Q4_0", "q4_0"), ("Q6_K", "q6_k")):
        lc = tmp_path / f"lc-{ftype}.gguf"
        subprocess.run([str(llama_tools["llama-quantize"]), "--imatrix", str(ours_path), str(f16), str(lc),
                        ftype, "2"], check=True, capture_output=True)
        ns_file = convert_to_gguf(f16, tmp_path / f"ns-{ftype}.gguf", dtype, imatrix=ours_path)
        theirs_t = {t.name: t for t in gguf.GGUFReader(lc).tensors}
        for t in gguf.GGUFReader(ns_file).tensors:
            if t.name.startswith("blk."):  # the LM head: q4_0 keeps it in q8_0 here (quant_mix.py)
                assert t.tensor_type == theirs_t[t.name].tensor_type, (ftype, t.name)
                assert np.array_equal(np.array(t.data), np.array(theirs_t[t.name].data)), (ftype, t.name)
