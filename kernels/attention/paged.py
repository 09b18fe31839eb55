"""Paged attention over a flat token batch, and the KV-cache writes that feed it.

KV cache of one layer: [num_blocks, block_size, n_kv_heads, head_dim] as float32, bfloat16 bits
(uint16), or uint8 codes (int8 as its bytes; fp8: one code a value; int4: [.., head_dim // 2], two a byte,
low nibble first, n - 8 or a Gaussian codebook's level), the code forms with one float32 scale per (slot, kv
head); each row is widened to float32 as it is read (memory/kv_formats.py names the dtypes). Every one-byte
form is one uint8 cache, so each kernel compiles once for the three storage dtypes, not once per form. A
token reads its sequence's KV through block_tables[token_seq[t]]; prefill, chunked prefill and decode are
the same call.

A token sees its sequence's slots 0 .. positions[t] (within the window), unless it is a node of a token
tree being verified (tree_starts[t] >= 0): then it sees the slots before the tree, and of the tree's slots
tree_starts[t] + i those its mask row marks (its ancestors and itself). Its position (RoPE's, and the
window's) is then the tree's start plus its depth, not its slot. A chain of drafts is the special case of
a lower-triangular mask, and gives the same bits as plain positions.

A token's visible slots are taken in chunks of CHUNK: each chunk's partial softmax (its largest score, sum of
exponentials and unnormalized value sum), then the chunks merged in order by the log-sum-exp rule. The chunks
of one (token, kv head) run one after another in its task, or, when there are fewer such tasks than the
threads can share (decode at batch 1 has n_kv of them), each as its own task (flash-decoding): a token's
bits depend on its own visible slots only, not on the split, the batch or the thread count.
"""

import numpy as np
from numba import get_num_threads, njit, parallel_chunksize, prange

from kernels.attention.chunks import FASTMATH, NO_WINDOW, attend, merge_chunks, num_chunks, partial, visible
from kernels.attention.tiles import attention_tiled, row_tiles

PARALLEL_MIN_WORK = 1 << 15  # query-head x key pairs below which waking the threads costs more than it saves
# visible slots a chunk: a token that sees more has its softmax in chunks merged by log-sum-exp. Not tuned:
# chunks of 128 to 512 slots, and one chunk, measured alike (benchmarks/results/HISTORY.md); 256 makes 4 to 16
# chunks a head at 1k to 4k positions, enough for 8 threads at 1k
CHUNK = 256
# query rows a prefill tile (kernels/attention/tiles.py): x 8 query heads at TinyLlama's GQA, 128 score rows
# against each key row
TILE_ROWS = 16
TASKS_PER_THREAD = 2  # (token, kv head) tasks a thread below which long tokens' chunks become tasks


_NO_TREE_MASK = np.zeros((1, 0), np.uint8)


def split_chunks(num_rows: int, n_kv: int, context: int, threads: int, chunk: int) -> bool:
    """Whether the chunks of long tokens run as tasks of their own (flash-decoding) rather than one after
    another in their (token, kv head) task: when there are too few such tasks to keep the threads busy (batch
    1 decode has n_kv of them) and some token sees more than one chunk. Either way gives the same bits."""
    return context > chunk and num_rows * n_kv < TASKS_PER_THREAD * threads


def paged_attention(q, k_cache, v_cache, k_scale, v_scale, has_scale, block_tables, token_seq, positions,
                    window, softmax_scale, out, tree_starts=None, tree_mask=None, softcap=0.0, row_code=0,
                    recent=NO_WINDOW):
    # q: [T, n_heads, D] f32; k_cache, v_cache: [num_blocks, block_size, n_kv, D]
    # k_scale, v_scale: [num_blocks, block_size, n_kv] f32 (read only when has_scale)
    # block_tables: [S, max_blocks] int32; token_seq: [T] int32; positions: [T] int32
    # window: attend to the last `window` positions (0 = all); out: [T, n_heads, D] f32
    # softcap: scores s -> softcap * tanh(s / softcap) before the softmax (Gemma 2), 0 = none
    # tree_starts: [T] int32, the slot where token t's tree begins (-1: not a tree node); tree_mask: [T, W]
    # uint8, 1 where tree slot tree_starts[t] + i is visible to t (the caller leaves out what the window does)
    # row_code: how a uint8 cache's codes read. One code a value: the mantissa bits, 3 (e4m3fn) or 2 (e5m2),
    # of fp8 codes (kernels/formats/fp8.py), 0: int8 codes (the bytes of an int8 cache). Two a byte: 0 the
    # uniform int4 codes n - 8, GAUSS4 indices into kernels/attention/gauss4.py's levels
    # recent: the recent window (kernels/attention/chunks.py's RecentWindow; NO_WINDOW: off)
    if q.shape[0] == 0:
        return
    if tree_starts is None:
        tree_starts, tree_mask = np.full(q.shape[0], -1, np.int32), _NO_TREE_MASK
    context = int(positions.max()) + 1 + tree_mask.shape[1]
    args = (q, k_cache, v_cache, k_scale, v_scale, has_scale, row_code, recent, block_tables, token_seq,
            positions, tree_starts, tree_mask, window, softmax_scale, np.float32(softcap), CHUNK, out)
    if q.shape[0] * q.shape[1] * context < PARALLEL_MIN_WORK:
        _attention_serial(*args)
    elif split_chunks(q.shape[0], k_cache.shape[2], context, get_num_threads(), CHUNK):
        _attention_split(*args)
    else:  # every (tile, kv head) a task: a prefill's tiles, each decode row a tile of its own (attend)
        bounds = row_tiles(token_seq, positions, tree_starts, TILE_ROWS, recent.group)
        # handed out a task at a time as threads free up, not split into an even run a thread: a step's
        # tasks differ widely (decode rows over short contexts beside a chunk of a long prompt over thousands
        # of positions), and one run a thread put all of the long prompt's kv heads on one thread
        with parallel_chunksize(1):
            attention_tiled(*args[:-1], bounds, out)


@njit(cache=True, nogil=True, fastmath=FASTMATH, error_model="numpy")
def _attention_serial(q, k_cache, v_cache, k_scale, v_scale, has_scale, row_code, recent, block_tables,
                      token_seq, positions, tree_starts, tree_mask, window, softmax_scale, softcap, chunk,
                      out):
    for t in range(q.shape[0]):
        for kh in range(k_cache.shape[2]):
            attend(q, k_cache, v_cache, k_scale, v_scale, has_scale, row_code, recent, block_tables,
                   token_seq, positions, tree_starts, tree_mask, window, softmax_scale, softcap, chunk, out,
                   t, kh)


@njit(cache=True, nogil=True, parallel=True, fastmath=FASTMATH, error_model="numpy")
def _attention_split(q, k_cache, v_cache, k_scale, v_scale, has_scale, row_code, recent, block_tables,
                     token_seq, positions, tree_starts, tree_mask, window, softmax_scale, softcap, chunk,
                     out):
    # flash-decoding: every (token, kv head, chunk) a task writing its partial softmax into a scratch row,
    # then every (token, kv head) merges its rows in chunk order, as attend does in one task (same bits)
    T, n_kv = q.shape[0], k_cache.shape[2]
    group = q.shape[1] // n_kv
    # scratch rows: token t's from first[t], n_kv runs of its chunk count, kv head by kv head
    first = np.empty(T + 1, np.int64)
    first[0] = 0
    for t in range(T):
        start, end, num_tree = visible(positions, tree_starts, tree_mask, window, t)
        first[t + 1] = first[t] + n_kv * num_chunks(end - start + num_tree, chunk)
    m, l = np.empty((first[T], group), np.float32), np.empty((first[T], group), np.float32)
    acc = np.empty((first[T], group, q.shape[2]), np.float32)
    for r in prange(first[T]):
        t = np.searchsorted(first, r, side="right") - 1
        k = (first[t + 1] - first[t]) // n_kv
        kh, c = (r - first[t]) // k, (r - first[t]) % k
        partial(q, k_cache, v_cache, k_scale, v_scale, has_scale, row_code, recent, block_tables, token_seq,
                positions, tree_starts, tree_mask, window, softmax_scale, softcap, t, kh, c * chunk,
                 (c + 1) * chunk, m[r], l[r], acc[r])
    for task in prange(T * n_kv):
        t, kh = task // n_kv, task % n_kv
        k = (first[t + 1] - first[t]) // n_kv
        r = first[t] + kh * k
        merge_chunks(m[r:r + k], l[r:r + k], acc[r:r + k], out[t, kh * group:(kh + 1) * group])
