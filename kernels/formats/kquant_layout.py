"""GGUF Q4_K, Q5_K, Q4_1, Q5_0, Q5_1, IQ4_NL and IQ4_XS weights repacked from their raw GGML blocks for the
int8-activation kernel (kernels/simd/kquant.py: VNNI's, or AVX2's for all but IQ4).

The values go in the quad order of kernels/formats/int8_layout.py, so the activations quantized for q8_0 /
q4_0 (int8 xq, f32 xd, int32 xsum per 32-value block) serve these formats unchanged. Every format's quants are
unsigned (0..15, or 0..31 with a fifth bit), the weights' side of vpdpbusd; the IQ4 formats' 4-bit indices
become their level + 128 (IQ4_VALUES + 128: 1..241, unsigned) through a byte shuffle in the kernel. What
turns them into values is kept per 32-value block b as the format gives it: value = S_b q - M_b with
    Q4_K, Q5_K  S_b = d sc_b, M_b = dmin mn_b  (fp16 d, dmin per 256 values, 6-bit sc, mn per 32)
    Q4_1, Q5_1  S_b = d_b, M_b = -m_b          (fp16 d, m per 32)
    Q5_0        S_b = d_b, offset 16           (fp16 d per 32; the kernel takes 16 off in int32)
    IQ4_NL      S_b = d_b, offset 128          (fp16 d per 32; level + 128, the 128 taken off in int32)
    IQ4_XS      S_b = d sc_b, offset 128       (fp16 d per 256, signed 6-bit sc = l_b - 32 per 32)
K is zero-padded to a whole number of groups of 256 values (one K-quant super-block, 8 legacy blocks): the
padding's quants and scales are 0. Rows are padded with zeros to N4, a multiple of ROWS = 4.

A tile is one group of one block of 4 rows: its parts one after another, each part the 4 rows' bytes in
row order, per row
    quants  128 bytes: chunk c (32 bytes) = vector 2c in its low nibbles, vector 2c + 1 in its high ones
            (vector j, lane m: int8_layout's quad order; q4_0's nibble layout)
    high    32 bytes (5-bit formats): bit j of byte m = the fifth bit of vector j's lane m
    K-quants: scales 8 bytes (sc_b), mins 8 bytes (mn_b), d 2 bytes, dmin 2 bytes (fp16 bits)
    IQ4_XS:   scales 8 bytes (sc_b, int8), d 2 bytes
    legacy, IQ4_NL: d 16 bytes (8 fp16), m 16 bytes (Q4_1, Q5_1)
and data: uint8 [N4, Kp // 256 * tile_bytes // 4] holds each block's tiles group after group (the block's
rows 4i..4i+3 of the array are its stream). Bytes per weight against the GGML block's: Q4_K 148 / 144 per
256 (+2.8%: sc and mn as 16 bytes, not packed into 12, so the kernel converts each 8 with no bit
unpacking), Q5_K 180 / 176 (+2.3%), IQ4_XS 138 / 136 (+1.5%), Q4_1, Q5_0, Q5_1, IQ4_NL the same as GGML's
(but for padding).
"""

from dataclasses import dataclass
from functools import cached_property

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from kernels.formats.ggml_blocks import IQ4_NL, IQ4_XS, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K
from kernels.formats.int8_layout import GROUP, QK, QUADS, _packed_index, padded_k
from kernels.formats.quant_iq4 import IQ4_VALUES
from kernels.placement import stream_empty
from kernels.simd.vnni import ROWS

QT = GGMLQuantizationType
PACK_ROWS = 4096  # a multiple of ROWS
VECTORS = GROUP // 32  # 32-byte vectors of a group
# position p of a group in quad order holds the group's value QUAD_ORDER[p]
QUAD_ORDER = np.argsort([_packed_index.py_func(i, QUADS) for i in range(GROUP)])


@dataclass(frozen=True)
class KQuantFormat:
    qtype: int  # the GGML type id (kernels/formats/ggml_blocks.py's CODE)
    bits: int  # 4 | 5
    has_min: bool
    table: bool = False  # IQ4: a quant is an index into IQ4_VALUES

    @property
    def super_block(self) -> bool:
        """One fp16 d per 256 values and a 6-bit scale per 32 (K-quants, IQ4_XS), not fp16 scales per 32."""
        return GGML_QUANT_SIZES[QT(self.qtype)][0] == GROUP

    @property
    def offset(self) -> int:
        """What the kernel takes off every quant in int32 (the formats without a min)."""
        return 128 if self.table else 16 if not self.has_min else 0

    @property
    def block_fields(self) -> list[tuple[str, int]]:
        """A raw GGML block's fields and their bytes, in order."""
        values = GGML_QUANT_SIZES[QT(self.qtype)][0]
        if self.table:
            return [("d", 2)] + ([("scales_h", 2), ("scales_l", 4)] if self.super_block else []) + [
                ("qs", values // 2)]
        head = [("d", 2)] + ([("dmin", 2), ("scales", 12)] if self.super_block else
                             [("m", 2)] if self.has_min else [])
        return head + ([("qh", values // 8)] if self.bits == 5 else []) + [("qs", values // 2)]

    @property
    def nibble_run(self) -> int:
        """Values per run of qs bytes: a run holds them in its low nibbles and the next as many in its high
        ones (K-quants: 32-byte runs, sub-blocks 2i and 2i + 1; legacy, IQ4: 16 bytes, a block's halves)."""
        return GROUP // 8 if self.super_block and not self.table else QK // 2

    @property
    def tile_parts(self) -> list[tuple[str, int]]:
        """A tile's parts and one row's bytes of each, in order."""
        quants = [("quants", GROUP // 2)] + ([("high", GROUP // 8)] if self.bits == 5 else [])
        if self.super_block:
            return quants + [("scales", 8)] + ([("d", 2)] if self.table else [("mins", 8), ("d", 2),
                                                                             ("dmin", 2)])
        return quants + [("d", 16)] + ([("m", 16)] if self.has_min else [])

    @cached_property
    def tile_offsets(self) -> dict[str, int]:
        """Each part's offset in a tile, and "end": the tile's bytes."""
        offsets, at = {}, 0
        for name, width in self.tile_parts:
            offsets[name] = at
            at += ROWS * width
        return offsets | {"end": at}


FORMATS = {f.qtype: f for f in (KQuantFormat(Q4_K, 4, True), KQuantFormat(Q5_K, 5, True),
                                KQuantFormat(Q4_1, 4, True), KQuantFormat(Q5_0, 5, False),
                                KQuantFormat(Q5_1, 5, True), KQuantFormat(IQ4_NL, 4, False, True),
                                KQuantFormat(IQ4_XS, 4, False, True))}
# an IQ4 index's unsigned level, as the kernel's byte shuffle reads it (both 128-bit lanes)
IQ4_UNSIGNED = (IQ4_VALUES.astype(np.int16) + 128).astype(np.uint8)


def pack_kquant(raw: np.ndarray, qtype: int, k: int) -> np.ndarray:
    """raw: uint8 [N, K // block_values * block_bytes] GGML blocks -> data: uint8 [N4, Kp // 256 * tile // 4]
    (tile = FORMATS[qtype].tile_offsets["end"]), PACK_ROWS rows at a time (the numpy temporaries are a few
    times the rows' values)."""
    f = FORMATS[qtype]
    values, size = GGML_QUANT_SIZES[QT(qtype)]
    if k % values or raw.shape[1] != k // values * size:
        raise ValueError(f"{QT(qtype).name} rows of {k} values need K % {values} == 0 and "
                         f"{k // values * size} bytes each, got {raw.shape[1]}")
    n, kp = raw.shape[0], padded_k(k)
    data = stream_empty((-(-n // ROWS) * ROWS, kp // GROUP * f.tile_offsets["end"] // ROWS), np.uint8)
    for r0 in range(0, n, PACK_ROWS):
        rows = raw[r0:r0 + PACK_ROWS]
        n4 = -(-rows.shape[0] // ROWS) * ROWS
        zero_rows = np.zeros((n4 - rows.shape[0], rows.shape[1]), np.uint8)  # zero blocks: values 0
        parts = _parts(np.concatenate([rows, zero_rows]), f, k, kp)
        tiles = [_interleave(parts[name]) for name, _ in f.tile_parts]
        data[r0:r0 + n4] = np.concatenate(tiles, axis=-1).reshape(n4, -1)
    return data


def unpack_kquant(data: np.ndarray, qtype: int, n: int, k: int) -> np.ndarray:
    """The inverse of pack_kquant: the raw GGML blocks, bit for bit."""
    f = FORMATS[qtype]
    values, size = GGML_QUANT_SIZES[QT(qtype)]
    num_groups = padded_k(k) // GROUP
    raw = np.empty((n, k // values * size), np.uint8)
    for r0 in range(0, n, PACK_ROWS):
        tiles = data[r0:r0 + PACK_ROWS].reshape(-1, num_groups, f.tile_offsets["end"])
        parts = {name: _deinterleave(tiles[..., f.tile_offsets[name]:f.tile_offsets[name] + ROWS * width])
                 [:n - r0] for name, width in f.tile_parts}
        raw[r0:r0 + PACK_ROWS] = _raw(parts, f, k)
    return raw


def _interleave(part):
    # [N4, G, w] -> [N4 // 4, G, 4 w]: each group's bytes of a block's 4 rows one after another
    n4, num_groups, width = part.shape
    return part.reshape(n4 // ROWS, ROWS, num_groups, width).transpose(0, 2, 1, 3).reshape(
        n4 // ROWS, num_groups, ROWS * width)


def _deinterleave(part):
    # the inverse of _interleave
    blocks, num_groups, width = part.shape
    return part.reshape(blocks, num_groups, ROWS, width // ROWS).transpose(0, 2, 1, 3).reshape(
        blocks * ROWS, num_groups, width // ROWS)


def _parts(raw, f, k, kp):
    # raw blocks -> {tile part: uint8 [N, Kp // 256, bytes of a row]}
    n, num_groups = raw.shape[0], kp // GROUP
    blocks = raw.reshape(n, -1, GGML_QUANT_SIZES[QT(f.qtype)][1])
    fields, at = {}, 0
    for name, width in f.block_fields:
        fields[name] = blocks[..., at:at + width]
        at += width
    qs = fields["qs"].reshape(n, -1, f.nibble_run)
    q = np.zeros((n, kp), np.uint8)
    q[:, :k] = np.stack([qs & 15, qs >> 4], axis=-2).reshape(n, k)
    if f.bits == 5:
        qh = fields["qh"]
        if f.super_block:  # bit s of byte l: value l of sub-block s
            high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
        else:  # 32 bits, little-endian: bit i = value i
            high = np.unpackbits(qh, axis=-1, bitorder="little")
        q[:, :k] |= high.reshape(n, k) << 4
    vectors = q.reshape(n, num_groups, GROUP)[..., QUAD_ORDER].reshape(n, num_groups, VECTORS, 32)
    parts = {"quants": ((vectors[:, :, 0::2] & 15) | (vectors[:, :, 1::2] << 4)).reshape(n, num_groups, -1)}
    if f.bits == 5:
        parts["high"] = ((vectors >> 4) << np.arange(VECTORS, dtype=np.uint8)[:, None]).sum(2, dtype=np.uint8)
    if f.super_block and f.table:  # IQ4_XS: l_b - 32 as int8
        low = (fields["scales_l"][..., :, None] >> np.array([0, 4], np.uint8)) & 15  # [N, G, 4, 2]
        high = (fields["scales_h"].view("<u2")[..., None] >> (2 * np.arange(8, dtype=np.uint16))) & 3
        levels = low.reshape(n, num_groups, 8) | (high.reshape(n, num_groups, 8).astype(np.uint8) << 4)
        return parts | {"scales": (levels.astype(np.int16) - 32).astype(np.int8).view(np.uint8),
                        "d": fields["d"]}
    if f.super_block:
        sc, mn = quants.Q4_K.get_scale_min(fields["scales"].reshape(-1, 12))
        return parts | {"scales": sc.reshape(n, num_groups, 8), "mins": mn.reshape(n, num_groups, 8),
                        "d": fields["d"], "dmin": fields["dmin"]}
    for name in ("d", "m") if f.has_min else ("d",):  # padding blocks: scale 0
        per_block = np.zeros((n, kp // QK, 2), np.uint8)
        per_block[:, :k // QK] = fields[name]
        parts[name] = per_block.reshape(n, num_groups, -1)
    return parts


def _raw(parts, f, k):
    # the inverse of _parts: {tile part: [N, Kp // 256, bytes]} -> raw blocks uint8 [N, K // values * bytes]
    n, num_groups = parts["quants"].shape[:2]
    nibbles = parts["quants"].reshape(n, num_groups, VECTORS // 2, 1, 32)
    vectors = np.concatenate([nibbles & 15, nibbles >> 4], axis=3).reshape(n, num_groups, VECTORS, 32)
    if f.bits == 5:
        vectors |= ((parts["high"][:, :, None, :] >> np.arange(VECTORS, dtype=np.uint8)[:, None]) & 1) << 4
    q = np.empty((n, num_groups, GROUP), np.uint8)
    q[..., QUAD_ORDER] = vectors.reshape(n, num_groups, GROUP)
    values = GGML_QUANT_SIZES[QT(f.qtype)][0]
    nb = k // values
    q = q.reshape(n, -1)[:, :k]
    runs = q.reshape(n, -1, 2, f.nibble_run)
    fields = {"qs": ((runs[:, :, 0] & 15) | (runs[:, :, 1] << 4)).reshape(n, nb, -1)}
    if f.bits == 5 and f.super_block:
        bits = (q.reshape(n, nb, 8, 32) >> 4) << np.arange(8, dtype=np.uint8)[:, None]
        fields["qh"] = bits.sum(2, dtype=np.uint8)
    elif f.bits == 5:
        fields["qh"] = np.packbits(q.reshape(n, nb, 32) >> 4, axis=-1, bitorder="little")
    if f.super_block and f.table:
        levels = (parts["scales"].view(np.int8).astype(np.int16) + 32).astype(np.uint8)  # [N, G, 8]
        scales_h = (levels.astype(np.uint16) >> 4) << (2 * np.arange(8, dtype=np.uint16))
        fields |= {"d": parts["d"], "scales_l": (levels[..., 0::2] & 15) | (levels[..., 1::2] << 4),
                   "scales_h": scales_h.sum(-1, dtype=np.uint16)[..., None].astype("<u2").view(np.uint8)}
    elif f.super_block:
        sc, mn = parts["scales"], parts["mins"]
        fields |= {"d": parts["d"], "dmin": parts["dmin"],
                   "scales": np.concatenate([sc[..., :4] | (sc[..., 4:] >> 4) << 6,
                                             mn[..., :4] | (mn[..., 4:] >> 4) << 6,
                                             (sc[..., 4:] & 15) | (mn[..., 4:] << 4)], axis=-1)}
    else:
        for name in ("d", "m") if f.has_min else ("d",):
            fields[name] = parts[name].reshape(n, -1, 2)[:, :nb]
    return np.concatenate([fields[name] for name, _ in f.block_fields], axis=-1).reshape(n, -1)
