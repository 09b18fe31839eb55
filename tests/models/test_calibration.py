"""`numaserve calibrate`: scale methods against numpy references, the calibration file (round trip, corrupt
files), per-matrix fallbacks and static scales in the activation plan, the engine reading the file, and
the command's handling of bad input."""

import hashlib
import json
import math
import shutil

import numpy as np
import pytest
from pydantic import ValidationError

import numaserve as ns
from cluster_configs.diagnostics import DecisionLog
from cluster_configs.errors import CheckpointError
from memory.matrices import Int8Matrix
from models.gguf.writer import convert_to_gguf
from models.linear import linear
from models.loader import load_model
from models.quantization.activation_plan import plan_activations
from models.quantization.activation_ranges import RangeStats, kl_threshold, static_scale
from models.quantization.calibrate import WindowRunner, calibrate, token_windows
from models.quantization.calibration import (
    CalibrationError,
    CalibrationOptions,
    calibration_path,
    load_calibration,
    matrix_names,
    save_calibration,
)
from numaserve.cli import main as cli_main
from numaserve.demo import DEMO_DIR
from tests.support.model_factory import CORPUS, build_model

TEXT = "".join(CORPUS) * 40  # about 6,000 tokens of the test tokenizer: several 256-token windows
NUM_LAYERS = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("calib-model") / "model"
    build_model(path, "llama", seed=3, initializer_range=0.02, hidden_size=128, intermediate_size=352,
                head_dim=32)
    return path


@pytest.fixture
def fresh(model_dir, tmp_path):
    """A copy of the model that tests may write a calibration file beside."""
    return shutil.copytree(model_dir, tmp_path / "model")


@pytest.fixture(scope="module")
def calibration(model_dir):
    return calibrate(model_dir, [TEXT], "test text",
                     CalibrationOptions(method="percentile", weight_dtype="q8_0"))


def _decisions(llm, topic):
    return [d for d in llm.diagnostics() if d["topic"] == topic]


# ---- scale methods ------------------------------------------------------------------------------------

def _stats(x: np.ndarray) -> RangeStats:
    stats = RangeStats()
    for part in np.array_split(x, 3):  # accumulated over several calls, as over layers' inputs
        stats.add_absmax(part)
    for part in np.array_split(x, 3):
        stats.add_histogram(part)
    return stats


def test_minmax_scale_is_absmax_over_127():
    x = np.random.default_rng(0).standard_normal((300, 64)).astype(np.float32) * 3
    assert static_scale(_stats(x), "minmax") == float(np.abs(x).max()) / 127


@pytest.mark.parametrize("percentile", [99.0, 99.9, 99.99])
def test_percentile_scale_matches_numpy_within_one_bin(percentile):
    x = np.random.default_rng(1).laplace(size=1_000_000).astype(np.float32)
    stats = _stats(x)
    got = static_scale(stats, "percentile", percentile) * 127
    assert abs(got - np.percentile(np.abs(x), percentile)) <= stats.absmax / len(stats.hist)


def kl_threshold_reference(hist: np.ndarray, bin_width: float, levels: int = 128) -> float:
    """TensorRT's entropy calibration written out loop by loop, as MXNet's _get_optimal_threshold does it
    (one-sided: the histogram is of |x|), with its zero-bin smoothing and scipy.stats.entropy's
    normalization."""
    def smooth(dist, eps=1e-4):
        zeros = [v == 0 for v in dist]
        num_zeros = sum(zeros)
        eps1 = eps * num_zeros / (len(dist) - num_zeros)
        out = [eps if z else v - eps1 for v, z in zip(dist, zeros)]
        return [v / sum(out) for v in out]

    best, best_kl = None, math.inf
    for i in range(levels, len(hist) + 1):
        sliced = [float(v) for v in hist[:i]]
        p = list(sliced)
        p[-1] += float(hist[i:].sum())
        merged = i // levels
        q = [0.0] * i
        for j in range(levels):
            start, stop = j * merged, (i if j == levels - 1 else (j + 1) * merged)
            mass = sum(sliced[start:stop])
            nonzero = [k for k in range(start, stop) if p[k] != 0]
            for k in nonzero:
                q[k] = mass / len(nonzero)
        ps, qs = smooth(p), smooth(q)
        kl = sum(a * math.log(a / b) for a, b in zip(ps, qs))
        if kl < best_kl:
            best, best_kl = i, kl
    return best * bin_width


@pytest.mark.parametrize("dist", ["laplace", "normal_with_outliers"])
def test_kl_threshold_matches_the_loop_reference(dist):
    rng = np.random.default_rng(2)
    x = rng.laplace(size=200_000) if dist == "laplace" else rng.standard_normal(200_000)
    if dist == "normal_with_outliers":
        x[:5] = 40.0
    absmax = float(np.abs(x).max())
    hist = np.histogram(np.abs(x), bins=384, range=(0, absmax))[0]  # coarser than 2048: the loops are slow
    assert kl_threshold(hist, absmax / 384) == pytest.approx(kl_threshold_reference(hist, absmax / 384),
                                                             rel=1e-12)


def test_kl_clips_outliers_that_minmax_keeps():
    # a normal distribution with a few values at 50 sigma: minmax spends the int8 range on them; KL clips
    # them far below, yet keeps more of the range than the 99.99th percentile
    x = np.random.default_rng(3).standard_normal(1_000_000).astype(np.float32)
    x[:3] = 50.0
    stats = _stats(x)
    kl = static_scale(stats, "kl") * 127
    assert static_scale(stats, "minmax") * 127 == 50.0
    assert np.percentile(np.abs(x), 99.99) < kl < 15


# ---- the calibration run and its file -----------------------------------------------------------------

def test_calibration_measures_every_matrix(calibration):
    assert list(calibration.matrices) == matrix_names(NUM_LAYERS)
    for m in calibration.matrices.values():
        assert 0 < m.scale * 127 <= m.absmax  # the 99.99th percentile of |x|
        assert 0 < m.error_dynamic < m.error_static < 0.5 and not m.fallback
    assert (calibration.weight_dtype == "q8_0"
            and calibration.text_sha256 == hashlib.sha256(TEXT.encode()).hexdigest())


def test_recorded_errors_equal_a_direct_measurement(model_dir, calibration):
    # the inputs of layers.1.down over the same windows, through the float32 path, int8 dynamic and static
    spec, weights, tokenizer = load_model(model_dir, "q8_0")
    stream = np.array(tokenizer.encode(TEXT) + [2], np.int64)
    inputs = []
    runner = WindowRunner(spec, weights)
    runner.run(token_windows(stream, 256, 32),
               lambda name, x: inputs.append(x.copy()) if name == "layers.1.down" else None)
    x = np.concatenate(inputs)
    w = weights.layers[1].down
    m = calibration.matrices["layers.1.down"]
    ref = linear(x, w).astype(np.float64)
    for packed, recorded in ((Int8Matrix.pack(w), m.error_dynamic),
                             (Int8Matrix.pack(w, m.scale), m.error_static)):
        assert (np.linalg.norm(linear(x, packed) - ref) / np.linalg.norm(ref)
                == pytest.approx(recorded, rel=1e-4))
    assert calibration.num_tokens == len(x)


def test_calibration_file_round_trips(fresh, calibration):
    path = save_calibration(calibration, fresh)
    assert path == fresh / "numaserve_calibration.json"
    stored = json.loads(path.read_text())
    assert "path" not in stored and set(stored["matrices"]["lm_head"]) >= {"scale", "error_dynamic",
                                                                          "error_static", "fallback"}
    loaded = load_calibration(fresh)
    assert loaded.model_dump() == calibration.model_dump() and loaded.path == str(path)


def test_a_gguf_file_gets_its_calibration_beside_it(tmp_path):
    gguf = tmp_path / "model-q8_0.gguf"
    assert calibration_path(gguf) == tmp_path / "model-q8_0.gguf.calibration.json"
    assert load_calibration(gguf) is None  # absent: no calibration


# ---- the activation plan: fallbacks and static scales -------------------------------------------------

def test_matrices_over_the_bound_fall_back_to_float32_with_the_reason(model_dir):
    tight = calibrate(model_dir, [TEXT], "test text", CalibrationOptions(bound=1e-3, weight_dtype="q8_0"))
    over = [name for name, m in tight.matrices.items() if m.error_dynamic > 1e-3]
    # every matrix but layers.0.qkv: its input is a q8_0 embedding row times one norm factor, which
    # per-block int8 quantization recovers exactly (error 1e-7)
    assert tight.fallback_names == over and len(over) == len(matrix_names(NUM_LAYERS)) - 1
    _, weights, _ = load_model(model_dir, "q8_0")
    log = DecisionLog()
    planned = plan_activations(weights, "int8", log, tight)
    plan = {d["subject"]: d for d in log.recent("activation_dtype")}
    assert [name for name, d in plan.items() if d["choice"] == "float32"] == over
    assert all("exceeds the bound 0.001" in plan[name]["reason"] for name in over)
    packed = [name for name, w in zip(matrix_names(NUM_LAYERS), _matrices(planned))
              if isinstance(w, Int8Matrix)]
    assert packed == ["layers.0.qkv"]
    [used] = log.recent("calibration")
    assert used["choice"] == "used" and f"float32 activations for {len(over)} matrices" in used["reason"]


def _matrices(weights):
    for layer in weights.layers:
        for key in ("qkv", "o", "gate_up", "down"):
            yield layer.projection(key)
    yield weights.lm_head


def test_static_scales_come_from_the_file_and_fall_back_by_static_error(model_dir, calibration):
    errors = sorted(m.error_static for m in calibration.matrices.values())
    bound = (errors[-2] + errors[-3]) / 2  # the two worst matrices are over it
    cal = calibration.model_copy(update={"bound": bound})
    _, weights, _ = load_model(model_dir, "q8_0")
    planned = plan_activations(weights, "int8", DecisionLog(), cal, static_scales=True)
    for name, w in zip(matrix_names(NUM_LAYERS), _matrices(planned)):
        m = cal.matrices[name]
        if m.error_static > bound:
            assert not isinstance(w, Int8Matrix)
        else:
            assert w.activation_scale == m.scale
    dynamic = plan_activations(weights, "int8", DecisionLog(), cal)  # the default: dynamic, file's fallbacks
    assert all(w.activation_scale == 0.0 for w in _matrices(dynamic))


# ---- the engine and the file --------------------------------------------------------------------------

def test_engine_uses_the_file_when_present(fresh, calibration):
    tokens = list(range(3, 60))
    without = ns.LLM(fresh, weight_dtype="q8_0", activation_dtype="int8")
    assert _decisions(without, "calibration") == []
    save_calibration(calibration, fresh)
    llm = ns.LLM(fresh, weight_dtype="q8_0", activation_dtype="int8")
    [used] = _decisions(llm, "calibration")
    assert used["choice"] == "used" and str(calibration_path(fresh)) in used["reason"]
    assert "float32 activations for 0 matrices" in used["reason"]
    assert np.array_equal(llm.score(tokens), without.score(tokens))  # no fallbacks, dynamic scales: same path
    exact = ns.LLM(fresh, weight_dtype="q8_0", activation_dtype="float32")
    [unused] = _decisions(exact, "calibration")
    assert unused["choice"] == "unused"


def test_engine_follows_the_files_fallbacks(fresh, model_dir, calibration):
    every = {name: m.model_copy(update={"fallback": True}) for name, m in calibration.matrices.items()}
    save_calibration(calibration.model_copy(update={"matrices": every}), fresh)
    llm = ns.LLM(fresh, weight_dtype="q8_0", activation_dtype="int8")
    assert {d["choice"] for d in _decisions(llm, "activation_dtype")} == {"float32"}
    [used] = _decisions(llm, "calibration")
    assert f"float32 activations for {len(matrix_names(NUM_LAYERS))} matrices" in used["reason"]
    tokens = list(range(3, 60))
    exact = ns.LLM(model_dir, weight_dtype="q8_0", activation_dtype="float32")
    assert np.array_equal(llm.score(tokens), exact.score(tokens))


def _corrupt(stored: dict, case: str) -> str:
    if case == "bad json":
        return json.dumps(stored)[:-20]
    if case == "unknown matrix":
        stored["matrices"]["layers.0.attn"] = stored["matrices"].pop("layers.0.o")
    elif case == "missing matrix":
        del stored["matrices"]["lm_head"]
    elif case == "more layers":  # consistent in itself, made for a 3-layer model
        stored["num_layers"] = 3
        stored["matrices"] |= {f"layers.2.{k}": stored["matrices"][f"layers.1.{k}"]
                               for k in ("qkv", "o", "gate_up", "down")}
    elif case == "negative scale":
        stored["matrices"]["layers.1.qkv"]["scale"] = -1.0
    elif case == "unknown method":
        stored["method"] = "entropy"
    return json.dumps(stored)


@pytest.mark.parametrize("case", ["bad json", "unknown matrix", "missing matrix", "more layers",
                                  "negative scale", "unknown method"])
def test_corrupt_or_mismatched_file_raises_checkpoint_error_naming_file_and_fix(fresh, calibration, case):
    path = save_calibration(calibration, fresh)
    path.write_text(_corrupt(json.loads(path.read_text()), case))
    with pytest.raises(ns.CheckpointError) as err:
        ns.LLM(fresh, weight_dtype="q8_0", activation_dtype="int8")
    assert str(path) in str(err.value) and "numaserve calibrate" in str(err.value)
    if case == "more layers":
        assert "3 layers" in str(err.value) and "has 2" in str(err.value)


# ---- the command --------------------------------------------------------------------------------------

def test_cli_calibrates_a_directory_with_a_text_file(fresh, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    assert cli_main(["calibrate", str(fresh), "--text", str(text), "--method", "kl", "--bound", "0.5"]) == 0
    cal = load_calibration(fresh)
    assert (cal.method, cal.bound, cal.text, cal.weight_dtype) == ("kl", 0.5, str(text), "q8_0")
    assert cal.text_sha256 == hashlib.sha256(text.read_bytes()).hexdigest()
    out = capsys.readouterr().out
    assert str(calibration_path(fresh)) in out and "float32 activations for 0 matrices" in out


def test_cli_calibrates_a_gguf_file_and_the_engine_reads_it(model_dir, tmp_path):
    gguf = convert_to_gguf(model_dir, tmp_path / "model.gguf", "q4_0")
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    assert cli_main(["calibrate", str(gguf), "--text", str(text), "--method", "minmax"]) == 0
    cal = load_calibration(gguf)
    assert cal.weight_dtype == "q4_0" and cal.path == str(tmp_path / "model.gguf.calibration.json")
    [used] = _decisions(ns.LLM(gguf, activation_dtype="int8"), "calibration")
    assert used["choice"] == "used" and cal.path in used["reason"]


def test_cli_default_text_is_the_demo_held_out_set(tmp_path, capsys):
    demo = shutil.copytree(DEMO_DIR / "base", tmp_path / "demo")
    assert cli_main(["calibrate", str(demo), "--weight-dtype", "q4_0"]) == 0
    cal = load_calibration(demo)
    assert "held-out set" in cal.text and cal.num_tokens == 32 * 256 and cal.weight_dtype == "q4_0"
    assert cal.fallback_names == []  # the default bound keeps every matrix of the demo model in int8


@pytest.mark.parametrize("case, words", [
    ("missing model", "no such file or directory"),
    ("missing text", "cannot be read"),
    ("text is a directory", "cannot be read"),
    ("binary text", "cannot be read"),
    ("empty text", "is empty"),
    ("unknown method", "method"),
    ("percentile 0", "percentile"),
    ("percentile 101", "percentile"),
    ("bound 0", "bound"),
])
def test_cli_bad_input_exits_nonzero_naming_the_problem(fresh, tmp_path, capsys, case, words):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    model, extra = str(fresh), []
    if case == "missing model":
        model = str(tmp_path / "no-such-model")
    elif case == "missing text":
        text = tmp_path / "absent.txt"
    elif case == "text is a directory":
        text = tmp_path
    elif case == "binary text":
        text.write_bytes(b"\xff\xfe\x00 not utf-8 \xc3\x28")
    elif case == "empty text":
        text.write_text("  \n")
    elif case == "unknown method":
        extra = ["--method", "entropy"]
    elif case.startswith("percentile"):
        extra = ["--method", "percentile", "--percentile", case.split()[1]]
    elif case == "bound 0":
        extra = ["--bound", "0"]
    assert cli_main(["calibrate", model, "--text", str(text), *extra]) != 0
    err = capsys.readouterr().err
    assert err.startswith("numaserve: error:") and words in err
    assert not calibration_path(fresh).exists()


def test_bad_options_are_typed_errors():
    with pytest.raises(ValidationError, match="percentile"):
        CalibrationOptions(percentile=100.5)
    with pytest.raises(ValidationError, match="method"):
        CalibrationOptions(method="entropy")
    with pytest.raises(CalibrationError):
        calibrate(DEMO_DIR / "base", [""], "empty text")


def test_engine_serves_static_scales_when_asked(fresh, calibration):
    with pytest.raises(CheckpointError, match="numaserve calibrate"):  # static scales need the file
        ns.LLM(fresh, weight_dtype="q8_0", activation_dtype="int8", activation_scales="static")
    save_calibration(calibration, fresh)
    llm = ns.LLM(fresh, weight_dtype="q8_0", activation_dtype="int8", activation_scales="static")
    [used] = _decisions(llm, "calibration")
    assert "static, used" in used["reason"]
    scales = [w.activation_scale for w in _matrices(llm.engine.model.weights) if isinstance(w, Int8Matrix)]
    assert scales and all(s > 0 for s in scales)
    dynamic = ns.LLM(fresh, weight_dtype="q8_0", activation_dtype="int8")
    tokens = list(range(3, 60))
    assert not np.array_equal(llm.score(tokens), dynamic.score(tokens))
