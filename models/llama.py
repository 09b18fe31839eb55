"""The Llama-family forward pass (Llama, Mistral, Qwen2) over a flat token batch and a paged KV cache."""

import math
import time

import numpy as np

from kernels.attention import paged_attention, write_kv, write_kv_int8
from kernels.norms import rms_norm, rope_inplace, silu_mul
from memory.kv_cache import KVCache
from memory.weights import Matrix, ModelWeights
from models.batch import ForwardBatch
from models.linear import embed, linear
from models.lora_slots import add_lora
from models.rope import rope_inv_freq
from models.spec import ModelSpec


class LlamaModel:
    def __init__(self, spec: ModelSpec, weights: ModelWeights):
        self.spec = spec
        self.weights = weights
        self.inv_freq, self.attention_scaling = rope_inv_freq(spec)
        self.softmax_scale = 1.0 / math.sqrt(spec.head_dim)
        q, kv, inter = spec.q_size, spec.kv_size, spec.intermediate_size
        # LoRA modules -> their columns in our fused projections
        self.qkv_modules = (("q_proj", slice(0, q)), ("k_proj", slice(q, q + kv)),
                            ("v_proj", slice(q + kv, None)))
        self.gate_up_modules = (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, None)))
        # calibration (models/calibration.py) sets this to see every linear layer's input: (name, x [T, K])
        self.observer = None
        # time in the layers' projections, summed (the runner reads and resets it)
        self.projection_seconds = 0.0

    @property
    def weight_dtype(self) -> str:
        return self.weights.layers[0].qkv.dtype

    @property
    def weight_bytes(self) -> int:
        return self.weights.nbytes  # a tied LM head once, unless repacked for its activations

    def forward(self, batch: ForwardBatch, kv: KVCache) -> np.ndarray:
        """-> logits [len(batch.logits_indices), vocab] float32."""
        return self.forward_hidden(batch, kv)[0]

    def forward_hidden(self, batch: ForwardBatch, kv: KVCache,
                       embeddings: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """-> logits [len(batch.logits_indices), vocab] and the last layer's hidden states after the final
        norm (what the LM head reads; trained draft heads read them too) at batch.hidden_indices,
        [len(hidden_indices), hidden] float32 (None when not asked for), from the same pass.
        embeddings: [T, hidden] the first layer's input instead of the tokens' embeddings (an EAGLE head)."""
        s, w = self.spec, self.weights
        T, D = batch.num_tokens, s.head_dim
        h = embed(w.embed, batch.token_ids) if embeddings is None else embeddings.copy()  # [T, hidden]
        x = np.empty_like(h)
        attn = np.empty((T, s.num_heads, D), np.float32)
        for i, layer in enumerate(w.layers):
            rms_norm(h, layer.input_norm, s.rms_norm_eps, x)
            qkv = self._project(i, "qkv", layer.qkv, x, batch)  # [T, q_size + 2 * kv_size]
            add_lora(qkv, x, batch.lora, i, self.qkv_modules)
            if layer.qkv_bias is not None:
                qkv += layer.qkv_bias
            q = qkv[:, :s.q_size].reshape(T, s.num_heads, D)
            k = qkv[:, s.q_size:s.q_size + s.kv_size].reshape(T, s.num_kv_heads, D)
            v = qkv[:, s.q_size + s.kv_size:].reshape(T, s.num_kv_heads, D)
            rope_inplace(q, batch.positions, self.inv_freq, self.attention_scaling)
            rope_inplace(k, batch.positions, self.inv_freq, self.attention_scaling)
            if kv.has_scale:
                write_kv_int8(k, v, batch.slot_mapping, kv.k[i], kv.v[i], kv.k_scale[i], kv.v_scale[i])
            else:
                write_kv(k, v, batch.slot_mapping, kv.k[i], kv.v[i])
            paged_attention(q, kv.k[i], kv.v[i], kv.k_scale[i], kv.v_scale[i], kv.has_scale,
                            batch.block_tables, batch.token_seq, batch.positions, s.layer_windows[i],
                            self.softmax_scale, attn, batch.tree_starts, batch.tree_mask)
            attn_flat = attn.reshape(T, s.q_size)
            o = self._project(i, "o", layer.o, attn_flat, batch)
            add_lora(o, attn_flat, batch.lora, i, (("o_proj", slice(None)),))
            h += o
            rms_norm(h, layer.post_norm, s.rms_norm_eps, x)
            gate_up = self._project(i, "gate_up", layer.gate_up, x, batch)  # [T, 2 * intermediate]
            add_lora(gate_up, x, batch.lora, i, self.gate_up_modules)
            act = np.empty((T, s.intermediate_size), np.float32)
            silu_mul(gate_up, act)
            down = self._project(i, "down", layer.down, act, batch)
            add_lora(down, act, batch.lora, i, (("down_proj", slice(None)),))
            h += down
        h_out = np.ascontiguousarray(h[batch.logits_indices])
        rms_norm(h_out, w.norm, s.rms_norm_eps, h_out)
        hidden = None
        if batch.hidden_indices is not None:
            hidden = np.ascontiguousarray(h[batch.hidden_indices])
            rms_norm(hidden, w.norm, s.rms_norm_eps, hidden)
        return self._linear("lm_head", h_out, w.lm_head), hidden

    def _project(self, i: int, key: str, w: Matrix, x: np.ndarray, batch: ForwardBatch) -> np.ndarray:
        """Layer i's fused projection `key` (w, its matrix); rows on merged copies (batch.merged) run on their
        adapter's. Timed."""
        start = time.perf_counter()
        name = f"layers.{i}.{key}"
        runs = [] if batch.merged is None else [
            (a, b, merged) for a, b, m in batch.merged.runs
            if (merged := m.layers[i].projection(key)) is not None]
        if not runs:
            out = self._linear(name, x, w)
        else:
            out = np.empty((x.shape[0], w.shape[0]), np.float32)
            row = 0
            for a, b, merged in runs + [(x.shape[0], x.shape[0], None)]:
                if a > row:  # base rows before this run
                    out[row:a] = self._linear(name, x[row:a], w)
                if merged is not None:
                    out[a:b] = self._linear(name, x[a:b], merged)
                row = b
        self.projection_seconds += time.perf_counter() - start
        return out

    def _linear(self, name: str, x: np.ndarray, w: Matrix) -> np.ndarray:
        # name: "layers.{i}.qkv" | ".o" | ".gate_up" | ".down" | "lm_head", the keys of activation plans
        if self.observer is not None:
            self.observer(name, x)
        return linear(x, w)
