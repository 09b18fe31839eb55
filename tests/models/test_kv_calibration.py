"""`numaserve calibrate`'s per-layer KV precision: on a tiny random model with one layer's keys made outliers
(its k_proj scaled), the recommendation names that layer, in the file and on the command line; the rule
picking the wider dtype, on given errors."""

import json

import pytest
from safetensors.numpy import load_file, save_file

from memory.kv_formats import KV_FORMATS
from models.quantization.calibrate import calibrate
from models.quantization.calibration import CalibrationOptions, calibration_path
from models.quantization.kv_calibration import wider_overrides
from numaserve.cli import main as cli_main
from tests.support.model_factory import CORPUS, build_model

TEXT = "".join(CORPUS) * 40
OUTLIER = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("kv-calib") / "model"
    build_model(path, "llama", seed=3, initializer_range=0.02, hidden_size=128, intermediate_size=352,
                head_dim=32, num_hidden_layers=4)
    weights = load_file(path / "model.safetensors")
    weights[f"model.layers.{OUTLIER}.self_attn.k_proj.weight"] *= 300  # large keys, sharp scores
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_calibrate_keeps_the_layer_with_outlier_keys_wider(model_dir):
    cal = calibrate(model_dir, [TEXT], "test text", CalibrationOptions(weight_dtype="q8_0", kv_dtype="int4"))
    errors = cal.kv.errors
    assert set(errors) == set(KV_FORMATS) - {"float32", "bfloat16"}
    assert all(len(e) == 4 and min(e) > 0 for e in errors.values())
    assert all(a < b for a, b in zip(errors["int8"], errors["int4"]))  # 8 bits err less than 4, every layer
    assert max(range(4), key=errors["int4"].__getitem__) == OUTLIER
    assert list(cal.kv.kv_dtype_overrides) == [OUTLIER]
    wider = cal.kv.kv_dtype_overrides[OUTLIER]
    assert KV_FORMATS[wider].row_bytes(32) > KV_FORMATS["int4"].row_bytes(32)


def test_the_command_prints_the_overrides_and_writes_them_to_the_file(model_dir, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    cli_main(["calibrate", str(model_dir), "--text", str(text), "--kv-dtype", "int4_hadamard"])
    saved = json.loads(calibration_path(model_dir).read_text())["kv"]
    assert saved["kv_dtype"] == "int4_hadamard"
    assert list(saved["kv_dtype_overrides"]) == [str(OUTLIER)]
    overrides = {OUTLIER: saved["kv_dtype_overrides"][str(OUTLIER)]}
    assert f"kv_dtype='int4_hadamard': kv_dtype_overrides={overrides}" in capsys.readouterr().out


def test_an_outlier_layer_gets_the_narrowest_wider_dtype_within_the_median():
    errors = {"int4": [0.010, 0.012, 0.100, 0.011, 0.040], "int8": [0.001, 0.001, 0.011, 0.001, 0.030],
              "fp8_e4m3": [0.002, 0.002, 0.009, 0.002, 0.020], "int8_hadamard": [0.001] * 5}
    # layers 2 and 4 exceed 2 x the median (0.011); of the 8-bit dtypes (the same bytes) the least error first
    assert wider_overrides(errors, "int4", 32) == {2: "int8_hadamard", 4: "int8_hadamard"}
    errors["int8_hadamard"] = [0.05] * 5
    assert wider_overrides(errors, "int4", 32) == {2: "fp8_e4m3", 4: "bfloat16"}
    assert wider_overrides(errors, "int8", 32) == {2: "bfloat16", 4: "bfloat16"}  # nothing 8-bit is wider
