"""Load a Hugging Face model directory: safetensors (single or sharded) into served weight formats."""

import json
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from cluster_configs.errors import CheckpointError
from memory.experts import ExpertWeights
from memory.matrices import Matrix, WeightMatrix, stacked
from memory.weights import LayerHook, LayerWeights, ModelWeights, as_built
from models.model_spec import ModelSpec, load_spec
from models.quantization.imatrix import ImportanceLookup, ImportanceMatrix
from models.quantization.quant_mix import embedding_dtype, lm_head_dtype, matrix_dtype
from models.safetensors_io import TensorEntry, read_header, read_tensor
from models.tensor_parallel.shard import WHOLE_MODEL, TensorShard

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def find_tensors(model_dir: Path) -> dict[str, TensorEntry]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: unreadable index ({e}); it needs a 'weight_map'") from None
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        if pickles:
            raise CheckpointError(
                f"{model_dir}: only pickle checkpoints found ({', '.join(pickles)}); pickle files can run "
                "arbitrary code, so numaserve refuses them. Convert once with transformers: "
                "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)")
        raise CheckpointError(f"{model_dir}: no model.safetensors found; save the model with save_pretrained")
    entries: dict[str, TensorEntry] = {}
    for name in files:
        path = model_dir / name
        if not path.exists():
            raise CheckpointError(f"{path}: listed in the index but missing; copy the whole model directory")
        entries.update(read_header(path))
    return entries


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    h, q, kv, inter, D = spec.hidden_size, spec.q_size, spec.kv_size, spec.intermediate_size, spec.head_dim
    arch = spec.arch
    shapes = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + f"{name}.weight": (h,) for name in arch.norms.values()}
        if arch.fused_projections:
            shapes |= {p + "self_attn.qkv_proj.weight": (q + 2 * kv, h),
                       p + "mlp.gate_up_proj.weight": (2 * inter, h)}
        else:
            shapes |= {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h)}
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if spec.is_moe(i):
            shapes |= _expert_shapes(spec, p)
        elif not arch.fused_projections:
            shapes |= {p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter)}
        else:
            shapes[p + "mlp.down_proj.weight"] = (h, inter)
        if arch.qk_norm != "none":
            whole = arch.qk_norm == "whole"
            shapes |= {p + "self_attn.q_norm.weight": (q if whole else D,),
                       p + "self_attn.k_norm.weight": (kv if whole else D,)}
        if spec.qkv_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
    return shapes


def _expert_names(spec: ModelSpec, prefix: str) -> tuple[str, list[tuple[str, str, str]]]:
    """A MoE layer's tensor names: its router's, and each held expert's (gate, up, down)."""
    experts = spec.arch.experts
    block = prefix + experts.block
    return f"{block}.gate.weight", [
        tuple(f"{block}.experts.{e}.{name}.weight" for name in experts.projections)
        for e in range(*(spec.held_experts or (0, spec.num_experts)))]


def _expert_shapes(spec: ModelSpec, prefix: str) -> dict[str, tuple[int, ...]]:
    h, inter = spec.hidden_size, spec.moe_intermediate_size
    router, names = _expert_names(spec, prefix)
    shapes = {router: (spec.num_experts, h)}
    for gate, up, down in names:
        shapes |= {gate: (inter, h), up: (inter, h), down: (h, inter)}
    return shapes


class TensorReader:
    """Reads checked tensors as float32, with a progress bar on a terminal."""

    def __init__(self, model_dir: Path, spec: ModelSpec):
        self.entries = find_tensors(model_dir)
        self.shapes = expected_shapes(spec)
        for name, shape in self.shapes.items():
            entry = self.entries.get(name)
            if entry is None:
                raise CheckpointError(f"{model_dir}: tensor {name!r} is missing (expected shape {shape}); "
                                      "the checkpoint is incomplete or not a "
                                      f"{spec.architecture} with this config.json")
            if entry.shape != shape:
                raise CheckpointError(f"{entry.path}: tensor {name!r} has shape {entry.shape}, expected "
                                      f"{shape} from config.json; the weights and the config do not match")
        self.progress = tqdm(total=sum(self.entries[n].nbytes for n in self.shapes), unit="B",
                             unit_scale=True, desc=f"loading {model_dir.name}",
                             disable=not sys.stderr.isatty(), leave=False)

    def __call__(self, name: str) -> np.ndarray:
        entry = self.entries[name]
        self.progress.update(entry.nbytes)
        return read_tensor(entry)

    def part(self, name: str, spec: ModelSpec, shard: TensorShard) -> np.ndarray:
        """A tensor-parallel rank's part of tensor `name` (spec: the whole model's): spans of rows read alone,
        spans of columns cut from the whole tensor."""
        plan = shard.pieces(name, spec)
        if plan is None or plan[0] == 1:
            return shard.take(name, spec, self(name))
        entry, spans = self.entries[name], plan[1]
        self.progress.update(sum(hi - lo for lo, hi in spans) * (entry.nbytes // entry.shape[0]))
        parts = [read_tensor(entry, span) for span in spans]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def close(self) -> None:
        self.progress.close()


def model_directory(path: str | Path) -> Path:
    """path, checked to be a directory (what a Hugging Face checkpoint is)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory; pass a Hugging Face model directory")
    return path


def load_weights(model_dir: str | Path, weight_dtype: str, shard: TensorShard = WHOLE_MODEL,
                 imatrix: ImportanceMatrix | None = None, each_layer: LayerHook | None = None,
                 ) -> tuple[ModelSpec, ModelWeights]:
    """-> (spec, weights): matrices as WeightMatrix in `weight_dtype`, quantized as they are read (q|k|v and
    gate|up fused; with the importance matrix imatrix, by llama.cpp's names), norms and biases as float32;
    spec is the whole model's, the weights shard's (its local_spec's shapes: the whole model unless a
    tensor-parallel rank's shard is asked for)."""
    model_dir = model_directory(model_dir)
    whole = load_spec(model_dir)
    spec = shard.local_spec(whole)
    importance = None if imatrix is None else ImportanceLookup(imatrix, whole, shard)
    reader = TensorReader(model_dir, whole)

    def read(name: str) -> np.ndarray:
        return reader.part(name, whole, shard)

    def mat(name: str, gguf_name: str, dtype: str) -> WeightMatrix:
        return WeightMatrix.from_float(read(name), dtype, importance and importance(gguf_name))

    embed = mat("model.embed_tokens.weight", "token_embd.weight",
                embedding_dtype(weight_dtype, spec.tie_word_embeddings))
    norm = read("model.norm.weight") + np.float32(spec.arch.norm_offset)
    lm_head = embed if spec.tie_word_embeddings else mat("lm_head.weight", "output.weight",
                                                         lm_head_dtype(weight_dtype))
    each_layer = each_layer or as_built
    layers = tuple(each_layer(i, load_layer(read, f"model.layers.{i}.", spec, weight_dtype, spec.is_moe(i), i,
                                            importance))
                   for i in range(spec.num_layers))
    reader.close()
    return whole, ModelWeights(embed=embed, norm=norm, lm_head=lm_head, layers=layers)


def load_vocabulary(model_dir: str | Path, weight_dtype: str) -> tuple[Matrix, Matrix]:
    """The whole (embedding, LM head) in weight_dtype's formats, as load_weights makes them: what an EAGLE
    head shares with a target whose tensor-parallel rank holds a share of the vocabulary."""
    model_dir = model_directory(model_dir)
    spec = load_spec(model_dir)
    reader = TensorReader(model_dir, spec)
    embed = WeightMatrix.from_float(reader("model.embed_tokens.weight"),
                                    embedding_dtype(weight_dtype, spec.tie_word_embeddings))
    lm_head = embed if spec.tie_word_embeddings else WeightMatrix.from_float(reader("lm_head.weight"),
                                                                             lm_head_dtype(weight_dtype))
    reader.close()
    return embed, lm_head


def load_layer(read, prefix: str, spec: ModelSpec, weight_dtype: str, moe: bool = False,
               index: int = 0, importance: ImportanceLookup | None = None) -> LayerWeights:
    """Layer `index`'s weights from read(name) -> float32 tensor: q|k|v and gate|up fused, matrices in
    weight_dtype (a mix's choice per matrix: models/quantization/quant_mix.py; quantized with importance,
    when given, by GGUF name), norms (as the forward applies them: Gemma's offset added) and biases float32;
    moe: its MLP is experts (stacked, the router float32)."""
    p, arch = prefix, spec.arch

    def norm(name: str) -> np.ndarray:
        return read(p + name + ".weight") + np.float32(arch.norm_offset)

    def mat(category: str, *names: str) -> Matrix:
        """The tensors `names`, stacked by rows, in the format of their GGUF category (one input: one
        importance, blk.{index}.{category}.weight's)."""
        dtype = matrix_dtype(weight_dtype, category, index, spec, importance is not None)
        weights = importance and importance(f"blk.{index}.{category}.weight")
        stack = np.concatenate([read(p + n + ".weight") for n in names])
        return WeightMatrix.from_float(stack, dtype, weights)

    if arch.fused_projections:
        qkv = mat("attn_qkv", "self_attn.qkv_proj")
    else:
        qkv = stacked([mat(f"attn_{n}", f"self_attn.{n}_proj") for n in "qkv"])
    qk_norms = {} if arch.qk_norm == "none" else {"q_norm": norm("self_attn.q_norm"),
                                                  "k_norm": norm("self_attn.k_norm")}
    gate_up = down = experts = None
    if moe:
        experts = _load_experts(read, p, spec, weight_dtype, index, importance)
    else:
        gate_up = (mat("ffn_up", "mlp.gate_up_proj") if arch.fused_projections else
                   mat("ffn_gate", "mlp.gate_proj", "mlp.up_proj"))
        down = mat("ffn_down", "mlp.down_proj")
    return LayerWeights(
        qkv=qkv,
        o=mat("attn_output", "self_attn.o_proj"),
        gate_up=gate_up,
        down=down,
        experts=experts,
        qkv_bias=(np.concatenate([read(p + f"self_attn.{n}_proj.bias") for n in "qkv"]) if spec.qkv_bias
                  else None),
        **{role: norm(name) for role, name in arch.norms.items()},
        **qk_norms,
    )


def _load_experts(read, prefix: str, spec: ModelSpec, weight_dtype: str, index: int,
                  importance: ImportanceLookup | None) -> ExpertWeights:
    """A MoE layer's router and held experts, stacked: gate_up [E_held * 2I, hidden], down [E_held * hidden,
    I]; with importance, each expert's rows weighted by its own."""
    router, names = _expert_names(spec, prefix)
    gate_up = np.concatenate([np.concatenate([read(gate), read(up)]) for gate, up, _ in names])
    downs = np.concatenate([read(down) for _, _, down in names])

    def quantized(w: np.ndarray, category: str) -> WeightMatrix:
        dtype = matrix_dtype(weight_dtype, category, index, spec, importance is not None)
        weights = importance and importance(f"blk.{index}.{category}_exps.weight")
        return WeightMatrix.from_float(w, dtype, weights)

    return ExpertWeights(read(router), quantized(gate_up, "ffn_gate"), quantized(downs, "ffn_down"),
                         spec.num_experts,
                         spec.num_experts_per_tok, spec.normalize_routing, spec.moe_intermediate_size,
                         (spec.held_experts or (0,))[0])
