"""What rank 0 sends its followers, as msgpack (models/tensor_parallel/wire.py): a step's order and an
adapter come back equal, arrays with their dtype, shape and bits, tuples as tuples; only the known records are
rebuilt, and a follower's start error comes back typed."""

import msgpack
import numpy as np
import pytest

from cluster_configs.errors import CheckpointError, RankLost
from models.batch import ForwardBatch
from models.lora.adapter import LoraAdapter, LoraModule
from models.tensor_parallel.group import RankFailed
from models.tensor_parallel.orders import ForwardOrder, LoraOrder, MergedOrder, StopOrder
from models.tensor_parallel.wire import _RECORD, decode, encode


def test_an_order_and_an_adapter_come_back_equal_arrays_bit_for_bit():
    rng = np.random.default_rng(0)
    batch = ForwardBatch(np.arange(5, dtype=np.int64), np.arange(5, dtype=np.int32), np.zeros(5, np.int32),
                         np.arange(5, dtype=np.int64), rng.integers(0, 9, (2, 3), dtype=np.int32),
                         np.array([4], np.int64), hidden_indices=np.array([1, 4]),
                         tree_mask=rng.random((5, 5)) < 0.5, wide_from=np.array([-1, 3], np.int32))
    order = ForwardOrder(batch, rng.standard_normal((5, 8)).astype(np.float32)[:, ::2],
                         LoraOrder(np.array([0]), np.array([5]), np.array([1], np.int32), (1,)),
                         MergedOrder(((0, 5, "a"),), ("a",), ("a", "b")))
    back = decode(encode(order))
    assert type(back) is ForwardOrder and back.lora.loads == (1,) and back.merged == order.merged
    for name in ("token_ids", "positions", "token_seq", "slot_mapping", "block_tables", "logits_indices",
                 "hidden_indices", "tree_mask", "wide_from"):
        sent, got = getattr(batch, name), getattr(back.batch, name)
        assert got.dtype == sent.dtype and got.shape == sent.shape and got.tobytes() == sent.tobytes()
        got.flat[0] = got.flat[0]  # writable, as the sender's
    assert back.embeddings.tobytes() == np.ascontiguousarray(order.embeddings).tobytes()
    assert back.batch.lora is None and back.batch.tree_starts is None
    assert decode(encode(StopOrder())) == StopOrder()
    adapter = LoraAdapter("a", ({"q_proj": LoraModule(rng.random((2, 4), np.float32),
                                                      rng.random((6, 2), np.float32), 0.5)},), 2,
                          fused={"qkv_proj": (("q_proj", 6),)})
    got = decode(encode(adapter))
    assert (got.name, got.config_rank, got.use_rslora, got.fused) == ("a", 2, False, adapter.fused)
    module = got.layers[0]["q_proj"]
    assert module.scaling == 0.5 and module.a.tobytes() == adapter.layers[0]["q_proj"].a.tobytes()


def test_only_the_known_records_are_rebuilt_and_a_start_error_comes_back_typed():
    with pytest.raises(TypeError, match="not part of what rank 0 sends"):
        encode(RankLost("x"))
    forged = msgpack.packb(msgpack.ExtType(_RECORD, msgpack.packb(["Popen", [["sh"]]])))
    with pytest.raises(ValueError, match="'Popen' is not a record rank 0 sends"):
        decode(forged)
    error = RankFailed(1, "CheckpointError", "x.safetensors: not a readable safetensors file").error()
    assert isinstance(error, CheckpointError) and "rank 1" in error.__notes__[0]
    assert isinstance(RankFailed(1, "MemoryError", "").error(), RankLost)
