"""EAGLE draft head: one decoder layer over the target's own features, as in the EAGLE paper.

At position i the head reads the target's final-norm hidden state f_i (the row that produced token i + 1)
and the embedding of token i + 1, fused by fc: x_i = fc([embed(t_{i+1}); f_i]). One decoder layer of the
target's shape (with its own KV over the positions it has read) and its own final norm turn that into
f'_{i+1}, its guess of the target's next feature, and the target's LM head into a guess of token i + 2.
Drafting feeds each guess back with its feature. The embedding and the LM head are the target's (shared,
not stored); the file holds fc and the layer: `eagle_head.safetensors` beside the model with a 1-layer
DecoderModel's names (`model.layers.0.*`, `model.norm.weight`) plus `fc.weight` [H, 2H] and `fc.bias` [H],
and `eagle_config.json` (`eagle_num_layers`: 1).

A draft vocabulary (FR-Spec: the most frequent tokens; EAGLE-3's `d2t` tensor, [Vd] int64, target id of
draft id i = i + d2t[i]) makes the head guess among those tokens only: its LM head is the target's rows of
them, read once at load, so a pass reads Vd instead of V rows. A token outside it is never drafted (the
target still verifies every guess: outputs are unchanged, only acceptance can drop).
"""

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from cluster_configs.diagnostics import DecisionLog
from cluster_configs.errors import CheckpointError
from memory.kv_cache import KVCache
from memory.matrices import Int8Matrix, WeightMatrix, select_rows
from memory.weights import ModelWeights
from models.batch import ForwardBatch
from models.checkpoint import expected_shapes, load_layer
from models.decoder import DecoderModel
from models.linear import embed, linear
from models.model_spec import ModelSpec
from models.proposers.head_config import read_head_config
from models.quantization.activation_plan import for_activations, plan_activations
from models.safetensors_io import read_header, read_int_tensor, read_tensor

HEAD_FILE, CONFIG_FILE = "eagle_head.safetensors", "eagle_config.json"
D2T = "d2t"  # the draft vocabulary (optional)


@dataclass(frozen=True)
class EagleHead:
    fc: WeightMatrix | Int8Matrix  # [H, 2H] (our linear kernels: a row's result does not depend on its batch)
    fc_bias: np.ndarray  # [H] f32
    # one layer: the target's embedding and LM head (its draft vocabulary's rows), its own layer and norm
    model: DecoderModel
    # [Vd] int64: the target ids of its logits' columns (None: all of them)
    draft_ids: np.ndarray | None = None

    def target_ids(self, ids: np.ndarray) -> np.ndarray:
        """Column indices of the head's logits -> target token ids."""
        return ids if self.draft_ids is None else self.draft_ids[ids]

    def forward(self, batch: ForwardBatch, kv: KVCache,
                features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """batch: the tokens t_{i+1} at positions i (block tables into the head's own KV); features [T, H]:
        f_i -> logits [len(logits_indices), V] (guesses of t_{i+2}) and f'_{i+1} at batch.hidden_indices."""
        x = np.concatenate([embed(self.model.weights.embed, batch.token_ids), features], axis=1)  # [T, 2H]
        fused = linear(x, self.fc) + self.fc_bias
        return self.model.forward_hidden(batch, kv, embeddings=fused)


def eagle_spec(spec: ModelSpec) -> ModelSpec:
    """The head's layer stack: one Llama decoder layer of the target's shape (EAGLE heads are Llama layers
    whatever the target's family), over the target's LM head (with its logit multiplier and soft-cap)."""
    return replace(spec, architecture="LlamaForCausalLM", num_layers=1, layer_windows=spec.layer_windows[:1],
                   layer_ropes=spec.layer_ropes[:1], embedding_multiplier=1.0,
                   attention_multiplier=None, attn_softcap=0.0, residual_multiplier=1.0)


def load_eagle_head(model_dir: str | Path, spec: ModelSpec, target_weights: ModelWeights, weight_dtype: str,
                    activation_dtype: str = "float32", max_model_len: int | None = None) -> EagleHead:
    """The head beside the model; CheckpointError naming the file and the fix if it is missing, malformed
    or shaped for another model. Its matrices (fc included) are stored in the target's weight_dtype and
    multiply activations as the target's do (activation_dtype: int8 ones for q8_0 / q4_0 where the CPU
    can). max_model_len: the target engine's (LongRoPE's factors as the target's)."""
    model_dir = Path(model_dir)
    _check_config(model_dir / CONFIG_FILE)
    path = model_dir / HEAD_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: no EAGLE head beside the model; train one (scripts/train_heads.py "
                              "trains the demo model's) or use another speculation method")
    entries, head_spec, H = read_header(path), eagle_spec(spec), spec.hidden_size
    shapes = {name: shape for name, shape in expected_shapes(head_spec).items() if name.startswith("model.")}
    shapes.pop("model.embed_tokens.weight", None)
    shapes |= {"fc.weight": (H, 2 * H), "fc.bias": (H,)}
    # a layer of the target's own family (q/k norms, sandwich or post norms, fused projections) is not what
    # this head runs: refused, not read in part
    foreign = sorted(n for n in entries if n.startswith("model.layers.") and n not in shapes)
    if foreign:
        raise CheckpointError(f"{path}: tensors {', '.join(foreign)} are not part of an EAGLE head's layer, "
                              "which is a Llama decoder layer (input_layernorm, q/k/v/o_proj, "
                              "post_attention_layernorm, gate/up/down_proj) whatever the target's family; "
                              "train the head as one")

    def read(name: str) -> np.ndarray:
        entry = entries.get(name)
        if entry is None:
            raise CheckpointError(f"{path}: tensor {name!r} is missing; an EAGLE head holds fc and one "
                                  "decoder layer of the target's shape")
        if entry.shape != shapes[name]:
            raise CheckpointError(f"{path}: tensor {name!r} has shape {entry.shape}, expected {shapes[name]} "
                                  "for this model: the head was trained for another model")
        return read_tensor(entry)

    draft_ids = _draft_ids(path, entries[D2T], spec.vocab_size) if D2T in entries else None
    lm_head = target_weights.lm_head if draft_ids is None else select_rows(target_weights.lm_head, draft_ids)
    # the target's embedding and LM head (its draft vocabulary's rows), the head's own norm and layer
    weights = replace(target_weights, lm_head=lm_head, norm=read("model.norm.weight"),
                      layers=(load_layer(read, "model.layers.0.", head_spec, weight_dtype),))
    # the target's LM head stays as it is
    weights = plan_activations(weights, activation_dtype, DecisionLog())
    fc = for_activations(WeightMatrix.from_float(read("fc.weight"), weight_dtype), activation_dtype)
    return EagleHead(fc, read("fc.bias"), DecoderModel(head_spec, weights, max_model_len), draft_ids)


def _draft_ids(path: Path, entry, vocab_size: int) -> np.ndarray:
    """The target ids of a draft vocabulary from its d2t tensor; CheckpointError if they are not distinct
    ascending ids of this model's vocabulary."""
    d2t = read_int_tensor(entry)
    if d2t.ndim != 1 or not 0 < len(d2t) <= vocab_size:
        raise CheckpointError(f"{path}: tensor {D2T!r} has shape {d2t.shape}; expected "
                              f"[draft vocabulary size] of at most {vocab_size} (the model's vocabulary)")
    ids = np.arange(len(d2t), dtype=np.int64) + d2t
    if ids[0] < 0 or ids[-1] >= vocab_size or np.any(np.diff(ids) <= 0):
        raise CheckpointError(f"{path}: tensor {D2T!r} does not map draft ids to distinct ascending token "
                              f"ids below {vocab_size}; it must hold target_id - draft_id for each draft id "
                              "(EAGLE-3's d2t)")
    return ids


def _check_config(path: Path) -> None:
    config = read_head_config(path, f'an EAGLE head needs it beside {HEAD_FILE} ({{"eagle_num_layers": 1}})')
    layers = config.get("eagle_num_layers")
    if layers != 1:
        raise CheckpointError(f"{path}: eagle_num_layers must be 1 (one decoder layer), got {layers!r}")
