"""The arrays a mixture-of-experts layer's fused path (kernels/moe/fused.py) works in, kept between calls."""

from typing import NamedTuple

import numpy as np

from kernels.formats.int8_layout import QK
from memory.experts import ExpertWeights


class RoutedArrays(NamedTuple):
    """kernels/moe_fused.moe_vnni's buffers, in its argument order; leading dimensions for `capacity`
    tokens (T), their R = T * k (token, slot) pairs, or the E experts."""

    logits: np.ndarray  # [T, E] f32
    ids: np.ndarray  # [T, k] int32
    weights: np.ndarray  # [T, k] f32
    offsets: np.ndarray  # [E + 1] int64
    slots: np.ndarray  # [R] int64
    position: np.ndarray  # [R] int64
    active: np.ndarray  # [E] int64
    starts: np.ndarray  # [E + 1] int64
    token_q: np.ndarray  # [T, Kp] int8, Kp = hidden padded (kernels/formats/int8_layout.py)
    token_d: np.ndarray  # [T, Kp // 32] f32
    token_sum: np.ndarray  # [T, Kp // 32] int32
    xq: np.ndarray  # [R, Kp] int8
    xd: np.ndarray  # [R, Kp // 32] f32
    xsum: np.ndarray  # [R, Kp // 32] int32
    gate_up_out: np.ndarray  # [R, 2I] f32
    act: np.ndarray  # [R, I] f32
    aq: np.ndarray  # [R, Ip] int8, Ip = I padded
    ad: np.ndarray  # [R, Ip // 32] f32
    asum: np.ndarray  # [R, Ip // 32] int32
    y: np.ndarray  # [R, H] f32
    out: np.ndarray  # [T, H] f32


class MoeBuffers:
    """One set of RoutedArrays for a model's MoE layers (they run one after another and have one shape), grown
    to the largest step seen, so a step allocates nothing (Qwen3-MoE's shape, hidden 2048, top 8 of experts
    of 768: 11 MB for 64 tokens, 91 MB after a 512-token prefill chunk, which the path it replaced allocated
    and page-faulted in on every call). What the fused path returns are views into them, valid until the
    next call."""

    def __init__(self):
        self._shape: tuple = ()
        self._arrays: RoutedArrays | None = None

    def arrays(self, experts: ExpertWeights, num_tokens: int) -> RoutedArrays:
        """Arrays for a step of num_tokens over experts' shape: the kept ones when they are large enough."""
        E, k, I = experts.num_experts, experts.top_k, experts.intermediate_size
        hidden, kp, ip = experts.router.shape[1], experts.gate_up.scales.shape[1] * QK, \
            experts.down.scales.shape[1] * QK
        shape = (E, k, I, hidden, kp, ip)
        capacity = 0 if self._arrays is None or shape != self._shape else self._arrays.out.shape[0]
        if capacity < num_tokens:
            self._shape, self._arrays = shape, _allocate(max(num_tokens, 2 * capacity), *shape)
        return self._arrays


def _allocate(T: int, E: int, k: int, I: int, hidden: int, kp: int, ip: int) -> RoutedArrays:
    R = T * k
    f32, i32, i64, i8 = np.float32, np.int32, np.int64, np.int8
    return RoutedArrays(
        logits=np.empty((T, E), f32), ids=np.empty((T, k), i32), weights=np.empty((T, k), f32),
        offsets=np.empty(E + 1, i64), slots=np.empty(R, i64), position=np.empty(R, i64),
        active=np.empty(E, i64), starts=np.empty(E + 1, i64),
        token_q=np.empty((T, kp), i8), token_d=np.empty((T, kp // QK), f32),
        token_sum=np.empty((T, kp // QK), i32),
        xq=np.empty((R, kp), i8), xd=np.empty((R, kp // QK), f32), xsum=np.empty((R, kp // QK), i32),
        gate_up_out=np.empty((R, 2 * I), f32), act=np.empty((R, I), f32),
        aq=np.empty((R, ip), i8), ad=np.empty((R, ip // QK), f32), asum=np.empty((R, ip // QK), i32),
        y=np.empty((R, hidden), f32), out=np.empty((T, hidden), f32))
