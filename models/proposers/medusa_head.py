"""Medusa heads: K extra heads on the target's last hidden state (after the final norm), head k guessing the
token k + 2 places ahead (the target's own LM head gives the next one), as in the Medusa paper.

Head k: h_k = h + SiLU(W h + b) for each of its residual blocks, then its own vocabulary projection.
Files beside the model: `medusa_heads.safetensors` with the Medusa repository's tensor names
(`{k}.{j}.linear.weight` / `.bias` for block j, `{k}.{num_layers}.weight` for the projection) and
`medusa_config.json` (`medusa_num_heads`, `medusa_num_layers`). The projections are stored like the
target's LM head (models/quantization/quant_mix.py lm_head_dtype); the blocks stay float32 (hidden x hidden,
small).
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cluster_configs.errors import CheckpointError
from memory.matrices import WeightMatrix
from models.linear import linear
from models.model_spec import ModelSpec
from models.proposers.head_config import read_head_config
from models.quantization.quant_mix import lm_head_dtype
from models.safetensors_io import read_header, read_tensor

HEADS_FILE, CONFIG_FILE = "medusa_heads.safetensors", "medusa_config.json"
MAX_HEADS, MAX_LAYERS = 8, 4


@dataclass(frozen=True)
class ResBlock:
    weight: np.ndarray  # [hidden, hidden] f32
    bias: np.ndarray  # [hidden] f32


@dataclass(frozen=True)
class MedusaHeads:
    blocks: tuple[tuple[ResBlock, ...], ...]  # [K][num_layers]
    projections: tuple[WeightMatrix, ...]  # [K], each [vocab, hidden]

    @property
    def num_heads(self) -> int:
        return len(self.projections)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """hidden [R, H] f32 (the target's final-norm output) -> [K, R, vocab] f32: head k's logits for the
        token k + 2 places after each row's."""
        out = []
        for blocks, projection in zip(self.blocks, self.projections):
            h = hidden
            for block in blocks:
                z = h @ block.weight.T + block.bias
                h = h + z / (np.float32(1.0) + np.exp(-z))  # SiLU
            out.append(linear(np.ascontiguousarray(h, np.float32), projection))
        return np.stack(out)


def load_medusa_heads(model_dir: str | Path, spec: ModelSpec, weight_dtype: str) -> MedusaHeads:
    """The heads beside the model in model_dir; CheckpointError naming the file and the fix if they are
    missing, malformed or shaped for another model."""
    model_dir = Path(model_dir)
    num_heads, num_layers = _read_config(model_dir / CONFIG_FILE)
    path = model_dir / HEADS_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: no Medusa heads beside the model; train them (scripts/train_demo.py "
                              f"trains the demo model's) or use another speculation method")
    entries = read_header(path)
    H, V = spec.hidden_size, spec.vocab_size

    def tensor(name: str, shape: tuple[int, ...]) -> np.ndarray:
        entry = entries.get(name)
        if entry is None:
            raise CheckpointError(f"{path}: tensor {name!r} is missing; {CONFIG_FILE} says {num_heads} heads "
                                  f"of {num_layers} blocks")
        if entry.shape != shape:
            raise CheckpointError(f"{path}: tensor {name!r} has shape {entry.shape}, expected {shape} "
                                  "for this model (hidden size, vocabulary): the heads were trained for "
                                  "another model")
        return read_tensor(entry)

    blocks, projections = [], []
    for k in range(num_heads):
        blocks.append(tuple(ResBlock(tensor(f"{k}.{j}.linear.weight", (H, H)),
                                     tensor(f"{k}.{j}.linear.bias", (H,))) for j in range(num_layers)))
        projections.append(WeightMatrix.from_float(tensor(f"{k}.{num_layers}.weight", (V, H)),
                                                   lm_head_dtype(weight_dtype)))
    return MedusaHeads(tuple(blocks), tuple(projections))


def _read_config(path: Path) -> tuple[int, int]:
    config = read_head_config(path, f"Medusa heads need it beside {HEADS_FILE} "
                                    '({"medusa_num_heads": K, "medusa_num_layers": 1})')
    values = []
    for key, limit in (("medusa_num_heads", MAX_HEADS), ("medusa_num_layers", MAX_LAYERS)):
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit:
            raise CheckpointError(f"{path}: {key} must be an integer from 1 to {limit}, got {value!r}")
        values.append(value)
    return values[0], values[1]
