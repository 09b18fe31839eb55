"""Load a model from a Hugging Face directory or a GGUF file: (spec, weights, tokenizer)."""

from pathlib import Path

from memory.weights import LayerHook, ModelWeights
from models.checkpoint import load_weights, model_directory
from models.model_spec import ModelSpec, load_spec
from models.quantization.imatrix import ImportanceMatrix
from models.tensor_parallel.shard import WHOLE_MODEL, TensorShard
from models.tokenizer import Tokenizer


def load_model(path: str | Path, weight_dtype: str, shard: TensorShard = WHOLE_MODEL,
               imatrix: ImportanceMatrix | None = None, each_layer: LayerHook | None = None,
               ) -> tuple[ModelSpec, ModelWeights, Tokenizer | None]:
    """weight_dtype: a served dtype, or "auto" (bfloat16 for float checkpoints; a GGUF keeps its own);
    shard: a tensor-parallel rank's part of the weights (the spec stays the whole model's); imatrix: the
    importance matrix matrices are quantized with (models/quantization/imatrix.py), checked against the
    model (ImatrixError); each_layer: applied to each layer as it is built (memory/weights.LayerHook)."""
    path = Path(path)
    if path.suffix == ".gguf":
        from models.gguf.reader import load_gguf

        return load_gguf(path, weight_dtype, shard, imatrix, each_layer)
    spec, weights = load_weights(path, "bfloat16" if weight_dtype == "auto" else weight_dtype, shard, imatrix,
                                 each_layer)
    return spec, weights, Tokenizer.from_dir(path)


def read_spec(path: str | Path) -> ModelSpec:
    """The model's spec without its weights (what adapters are validated against)."""
    path = Path(path)
    if path.suffix == ".gguf":
        from models.gguf.reader import read_gguf_spec

        return read_gguf_spec(path)
    return load_spec(model_directory(path))
