"""The calibration file `numaserve calibrate` writes beside a model, and the engine reads.

    <model dir>/numaserve_calibration.json        (Hugging Face directory)
    <model>.gguf.calibration.json                  (GGUF file)

It holds, per linear matrix (`layers.{i}.qkv|o|gate_up|down`, `lm_head`;
models/quantization/activation_plan.py), the static int8 scale of its inputs by the chosen method, the
relative error of its output with int8 dynamic and with static activation scales against float32 activations,
measured on the calibration text, and whether it falls back to float32 activations (dynamic error above the
bound); and each layer's attention output error under each KV dtype, with the layers to keep wider for a
target KV dtype. A file that cannot be read or does not fit the model raises CheckpointError naming the file
and the fix: re-run `numaserve calibrate`.
"""

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cluster_configs.engine_config import KVStorage, WeightDtype
from cluster_configs.errors import CheckpointError, NumaserveError
from memory.weights import PROJECTIONS

FORMAT_VERSION = 1


class CalibrationError(NumaserveError, ValueError):
    """Calibration input that cannot be used: an unreadable or empty text, too few tokens."""


class CalibrationOptions(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Literal["minmax", "percentile", "kl"] = "percentile"
    percentile: float = Field(99.99, gt=0, le=100)  # of |x|, for method="percentile"
    # largest relative output error ||Y_int8 - Y_f32|| / ||Y_f32|| a matrix keeps int8 activations with.
    # Dynamic scales err well below it on the demo model, static ones far above it on the down projections
    # (benchmarks/bench_calibration.py, benchmarks/results/HISTORY.md); 0.02 leaves room for models with many
    # more matrices than the demo's 25.
    bound: float = Field(0.02, gt=0)
    weight_dtype: WeightDtype = "auto"  # "auto": a GGUF keeps its types, a directory is quantized to q8_0
    kv_dtype: KVStorage = "int4_hadamard"  # the KV dtype whose outlier layers are recommended wider


class MatrixCalibration(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    absmax: float = Field(ge=0)  # largest |x| seen
    scale: float = Field(ge=0)  # static scale by the file's method (x ~ q * scale); 0 = inputs all zero
    # ||Y_int8 - Y_f32|| / ||Y_f32|| over the calibration tokens, same weights; None = not q8_0 / q4_0 weights
    error_dynamic: float | None = Field(default=None, ge=0)
    error_static: float | None = Field(default=None, ge=0)
    fallback: bool = False  # keep float32 activations: error_dynamic > the file's bound


class KVCalibration(BaseModel):
    """Per-layer KV precision (models/quantization/kv_calibration.py)."""
    model_config = ConfigDict(frozen=True, extra="forbid")

    kv_dtype: str  # the target the recommendation is for
    num_tokens: int = Field(ge=1)
    # dtype -> per layer ||O_dtype - O_bf16|| / ||O_bf16||, O a layer's attention output
    errors: dict[str, list[float]]
    kv_dtype_overrides: dict[int, str]  # the layers to keep wider with kv_dtype, ready for the engine


class Calibration(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    version: Literal[1] = FORMAT_VERSION
    method: Literal["minmax", "percentile", "kl"]
    percentile: float | None = None  # the method's parameter (percentile only)
    bound: float = Field(gt=0)  # largest relative output error kept in int8
    weight_dtype: str  # the weights the errors were measured with
    text: str  # what the calibration text was
    text_sha256: str
    num_tokens: int = Field(ge=1)
    num_layers: int = Field(ge=1)
    matrices: dict[str, MatrixCalibration]
    kv: KVCalibration | None = None  # None in files written before per-layer KV precision
    path: str = Field(default="", exclude=True)  # where it was read from (not stored)

    @model_validator(mode="after")
    def _names_match_layers(self) -> "Calibration":
        expected = set(matrix_names(self.num_layers))
        unknown, missing = sorted(set(self.matrices) - expected), sorted(expected - set(self.matrices))
        if unknown or missing:
            raise ValueError(f"matrices do not match num_layers={self.num_layers}: "
                             + "; ".join(f"{what} {', '.join(names[:4])}" + (" ..." if len(names) > 4 else "")
                                         for what, names in (("unknown", unknown), ("missing", missing))
                                         if names))
        return self

    @property
    def fallback_names(self) -> list[str]:
        return [name for name, m in self.matrices.items() if m.fallback]


def matrix_names(num_layers: int) -> list[str]:
    """Every calibrated matrix of a model, in forward order."""
    return [f"layers.{i}.{key}" for i in range(num_layers) for key in PROJECTIONS] + ["lm_head"]


def calibration_path(model_path: str | Path) -> Path:
    model_path = Path(model_path)
    if model_path.is_dir():
        return model_path / "numaserve_calibration.json"
    return model_path.with_name(model_path.name + ".calibration.json")


def load_calibration(model_path: str | Path) -> Calibration | None:
    """The calibration file beside a model; None if there is none. Raises CheckpointError if unusable."""
    path = calibration_path(model_path)
    if not path.exists():
        return None
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise _unusable(path, f"cannot be read ({e})") from None
    try:
        calibration = Calibration.model_validate_json(text)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'file'}: {err['msg']}"
                             for err in e.errors()[:3])
        raise _unusable(path, f"is not a valid calibration file ({problems})") from None
    return calibration.model_copy(update={"path": str(path)})


def check_fits(calibration: Calibration, num_layers: int) -> None:
    """Raise CheckpointError if the calibration was made for a model with another number of layers."""
    if calibration.num_layers != num_layers:
        raise _unusable(Path(calibration.path), f"was made for a model with {calibration.num_layers} layers; "
                        f"this model has {num_layers}")


def save_calibration(calibration: Calibration, model_path: str | Path) -> Path:
    path = calibration_path(model_path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(calibration.model_dump_json(indent=1) + "\n")
    tmp.replace(path)
    return path


def _unusable(path: Path, problem: str) -> CheckpointError:
    return CheckpointError(f"{path}: {problem}; re-run `numaserve calibrate MODEL` to rewrite it, or delete "
                           "it to run with dynamic activation scales and no per-matrix fallbacks")
