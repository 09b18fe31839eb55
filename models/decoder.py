"""The decoder forward pass of every family (models/architectures.py), dense or mixture-of-experts, over a
flat token batch and a paged KV cache. What differs between families is data the pass reads, not branches: a
layer's norms are applied where its weights have them, its experts where it has them (models/moe/layer.py),
the spec's multipliers and soft-caps where they are not neutral."""

import time

import numpy as np

from kernels.attention.chunks import NO_WINDOW
from kernels.exp32 import softcap_inplace
from kernels.norms import GATED_ACTIVATIONS, rms_norm, rms_norm_heads, rope_inplace
from memory.experts import ExpertWeights
from memory.kv_cache import KVCache
from memory.kv_formats import attend_as, write_kv_as
from memory.matrices import Matrix, parts
from memory.weights import LayerWeights, ModelWeights
from models.batch import ForwardBatch
from models.linear import linear
from models.lora.slots import add_lora
from models.model_spec import ModelSpec
from models.moe.buffers import MoeBuffers
from models.moe.layer import ExpertLog, moe_forward
from models.rope import rope_table
from models.tensor_parallel.collectives import WHOLE, Whole


class DecoderModel:
    def __init__(self, spec: ModelSpec, weights: ModelWeights, max_model_len: int | None = None,
                 collectives: Whole = WHOLE):
        """spec and weights: the whole model's, or a tensor-parallel rank's shard of them (its local_spec),
        whose partial results its collectives sum with the other ranks'."""
        self.spec = spec
        self.weights = weights
        self.collectives = collectives
        # [num_layers]; max_model_len (default: the model's context) picks LongRoPE's factors
        self.ropes = tuple(rope_table(r, max_model_len or spec.max_position_embeddings)
                           for r in spec.layer_ropes)
        self.activation = GATED_ACTIVATIONS[spec.arch.activation]
        self.expert_log = ExpertLog(spec.num_layers, spec.num_experts)  # which experts tokens were routed to
        self.moe_buffers = MoeBuffers()  # the MoE layers' working arrays, kept between steps
        q, kv, inter = spec.q_size, spec.kv_size, spec.intermediate_size
        # LoRA modules -> their columns in our fused projections
        self.qkv_modules = (("q_proj", slice(0, q)), ("k_proj", slice(q, q + kv)),
                            ("v_proj", slice(q + kv, None)))
        self.gate_up_modules = (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, None)))
        # calibration (models/quantization/calibrate.py) sets this to see every linear layer's input:
        # (name, x [T, K]); a MoE layer's routed experts as layers.{i}.experts.{e}.gate_up | down
        self.observer = None
        # time in the layers' projections, summed (the runner reads and resets it)
        self.projection_seconds = 0.0

    @property
    def weight_dtype(self) -> str:
        """The layers' format (a StackedMatrix's first part's: a mix's default format)."""
        return parts(self.weights.layers[0].qkv)[0].dtype

    @property
    def weight_bytes(self) -> int:
        return self.weights.nbytes  # a tied LM head once, unless repacked for its activations

    def attention_inputs(self, i: int, qkv: np.ndarray, positions: np.ndarray):
        """Layer i's fused projection qkv [T, q_size + 2 * kv_size] -> views q [T, n_heads, D], k and v
        [T, n_kv, D]; q and k normed (where the layer has norms) and rotated by RoPE at positions [T],
        in place."""
        s, layer, D = self.spec, self.weights.layers[i], self.spec.head_dim
        T = qkv.shape[0]
        q = qkv[:, :s.q_size].reshape(T, s.num_heads, D)
        k = qkv[:, s.q_size:s.q_size + s.kv_size].reshape(T, s.num_kv_heads, D)
        v = qkv[:, s.q_size + s.kv_size:].reshape(T, s.num_kv_heads, D)
        if layer.q_norm is not None:  # over each head [D], or over all heads as one row
            rms_norm_heads(q if layer.q_norm.shape[0] == D else q.reshape(T, 1, -1), layer.q_norm,
                           s.rms_norm_eps)
            rms_norm_heads(k if layer.k_norm.shape[0] == D else k.reshape(T, 1, -1), layer.k_norm,
                           s.rms_norm_eps)
        rope = self.ropes[i]
        rope_inplace(q, positions, rope.inv_freq, rope.attention_scaling)
        rope_inplace(k, positions, rope.inv_freq, rope.attention_scaling)
        return q, k, v

    def forward(self, batch: ForwardBatch, kv: KVCache) -> np.ndarray:
        """-> logits [len(batch.logits_indices), vocab] float32."""
        return self.forward_hidden(batch, kv)[0]

    def forward_hidden(self, batch: ForwardBatch, kv: KVCache,
                       embeddings: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """-> logits [len(batch.logits_indices), vocab] (None on a tensor-parallel follower: rank 0 gathers
        them) and the last layer's hidden states after the final
        norm (what the LM head reads; trained draft heads read them too) at batch.hidden_indices,
        [len(hidden_indices), hidden] float32 (None when not asked for), from the same pass.
        embeddings: [T, hidden] the first layer's input instead of the tokens' embeddings (an EAGLE head)."""
        s, w = self.spec, self.weights
        T, D = batch.num_tokens, s.head_dim
        tp = self.collectives
        tp.begin(batch, embeddings)
        h = tp.embed(w.embed, batch.token_ids) if embeddings is None else embeddings.copy()  # [T, hidden]
        if s.embedding_multiplier != 1.0 and embeddings is None:
            h *= np.float32(s.embedding_multiplier)
        x = np.empty_like(h)
        attn = np.empty((T, s.num_heads, D), np.float32)
        for i, layer in enumerate(w.layers):
            self._norm(h, layer.attn_norm, x)
            qkv = self._project(i, "qkv", layer.qkv, x, batch)  # [T, q_size + 2 * kv_size]
            add_lora(qkv, x, batch.lora, i, self.qkv_modules)
            if layer.qkv_bias is not None:
                qkv += layer.qkv_bias
            q, k, v = self.attention_inputs(i, qkv, batch.positions)
            fmt = kv.formats[i]  # a rotated format rotates q, k and v in place (they are not read again)
            recent = NO_WINDOW if batch.wide_from is None else kv.window(i, batch.wide_from)
            write_kv_as(fmt, k, v, batch.slot_mapping, kv.k[i], kv.v[i], kv.k_scale[i], kv.v_scale[i], recent)
            attend_as(fmt, q, kv.k[i], kv.v[i], kv.k_scale[i], kv.v_scale[i], batch.block_tables,
                      batch.token_seq, batch.positions, s.layer_windows[i], s.softmax_scale, attn,
                      batch.tree_starts, batch.tree_mask, s.attn_softcap, recent)
            attn_flat = attn.reshape(T, s.q_size)
            # a shard's heads give part of the sum, written where the all-reduce reads it
            o = self._project(i, "o", layer.o, attn_flat, batch, tp.partial(T, s.hidden_size))
            add_lora(o, attn_flat, batch.lora, i, (("o_proj", slice(None)),))
            o = tp.all_reduce(o)
            self._add_residual(h, o, layer.attn_out_norm)
            self._norm(h, layer.mlp_norm, x)
            if layer.experts is None:
                mlp = self._mlp(i, layer, x, batch)
            else:
                mlp = self._experts(i, layer.experts, x)
            mlp = tp.all_reduce(mlp)  # a shard's intermediate rows give part of the sum
            self._add_residual(h, mlp, layer.mlp_out_norm)
        h_out = np.ascontiguousarray(h[batch.logits_indices])
        rms_norm(h_out, w.norm, s.rms_norm_eps, h_out)
        hidden = None
        if batch.hidden_indices is not None:
            hidden = np.ascontiguousarray(h[batch.hidden_indices])
            rms_norm(hidden, w.norm, s.rms_norm_eps, hidden)
        logits = self._linear("lm_head", h_out, w.lm_head)
        if s.logit_multiplier != 1.0:
            logits *= np.float32(s.logit_multiplier)
        if s.final_softcap:
            softcap_inplace(logits, s.final_softcap)
        return tp.gather_logits(logits), hidden

    def _mlp(self, i: int, layer: LayerWeights, x: np.ndarray, batch: ForwardBatch) -> np.ndarray:
        """The gated MLP of a dense layer: x [T, hidden] -> [T, hidden]."""
        gate_up = self._project(i, "gate_up", layer.gate_up, x, batch)  # [T, 2 * intermediate]
        add_lora(gate_up, x, batch.lora, i, self.gate_up_modules)
        act = np.empty((x.shape[0], self.spec.intermediate_size), np.float32)
        self.activation(gate_up, act)
        down = self._project(i, "down", layer.down, act, batch, self.collectives.partial(*x.shape))
        add_lora(down, act, batch.lora, i, (("down_proj", slice(None)),))
        return down

    def _experts(self, i: int, experts: ExpertWeights, x: np.ndarray) -> np.ndarray:
        """A MoE layer's experts: x [T, hidden] -> [T, hidden]; the routing counted in expert_log. Timed."""
        start = time.perf_counter()
        observe = None if self.observer is None else (
            lambda e, key, inputs: self.observer(f"layers.{i}.experts.{e}.{key}", inputs))
        out, ids = moe_forward(x, experts, linear, self.moe_buffers, observe)
        self.expert_log.record(i, ids)
        self.projection_seconds += time.perf_counter() - start
        return out

    def _norm(self, h: np.ndarray, weight: np.ndarray | None, out: np.ndarray) -> None:
        """out = RMSNorm(h) where the layer has this norm, else a copy of h."""
        if weight is None:
            out[:] = h
        else:
            rms_norm(h, weight, self.spec.rms_norm_eps, out)

    def _add_residual(self, h: np.ndarray, block_out: np.ndarray, out_norm: np.ndarray | None) -> None:
        """h += a block's output (normed first where the layer has an output norm; times the spec's residual
        multiplier)."""
        if out_norm is not None:
            rms_norm(block_out, out_norm, self.spec.rms_norm_eps, block_out)
        if self.spec.residual_multiplier != 1.0:
            block_out *= np.float32(self.spec.residual_multiplier)
        h += block_out

    def _project(self, i: int, key: str, w: Matrix, x: np.ndarray, batch: ForwardBatch,
                 out: np.ndarray | None = None) -> np.ndarray:
        """Layer i's fused projection `key` (w, its matrix) into out (None: a new array); rows on merged
        copies (batch.merged) run on their adapter's. Timed."""
        start = time.perf_counter()
        name = f"layers.{i}.{key}"
        runs = [] if batch.merged is None else [
            (a, b, merged) for a, b, m in batch.merged.runs
            if (merged := m.layers[i].projection(key)) is not None]
        if not runs:
            out = self._linear(name, x, w, out)
        else:
            out = np.empty((x.shape[0], w.shape[0]), np.float32) if out is None else out
            row = 0
            for a, b, merged in runs + [(x.shape[0], x.shape[0], None)]:
                if a > row:  # base rows before this run
                    out[row:a] = self._linear(name, x[row:a], w)
                if merged is not None:
                    out[a:b] = self._linear(name, x[a:b], merged)
                row = b
        self.projection_seconds += time.perf_counter() - start
        return out

    def _linear(self, name: str, x: np.ndarray, w: Matrix, out: np.ndarray | None = None) -> np.ndarray:
        # name: "layers.{i}.qkv" | ".o" | ".gate_up" | ".down" | "lm_head", the keys of activation plans
        if self.observer is not None:
            self.observer(name, x)
        return linear(x, w, out)
