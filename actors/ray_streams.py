"""The next item of a Ray streaming generator (a worker's generate()), its value awaited once.

Ray's ObjectRefGenerator.__anext__ waits for an item that has not arrived by awaiting the item's ObjectRef and
dropping the value, then hands out the ref, which the caller awaits again: two trips through the core
worker's callback thread, each waking the event loop, and two deserializations per item. next_item awaits
the pending ref once and keeps its value; an item already there, an error, the stream's end or a lost worker
take Ray's own path, unchanged. peek_object_ref_stream and _generator_ref are Ray's internals (2.60): without
them, Ray's path. Not in the serving path: while RequestStream read items through it, a CI run (2026-11-26,
tests/cluster/test_lora_serving.py, 12 client streams with adapters) left one stream waiting forever; measured
by benchmarks/bench_chunk_cpu.py --ray only, until that is understood.
"""

from ray import ObjectRefGenerator


async def next_item(refs: ObjectRefGenerator):
    """`await (await refs.__anext__())`: the next item's value (an error item raises; StopAsyncIteration at
    the end)."""
    peek = getattr(refs.worker.core_worker, "peek_object_ref_stream", None)
    if peek is None or not hasattr(refs, "_generator_ref"):  # Ray's internals moved: its own path
        return await (await refs.__anext__())
    ref, ready = peek(refs._generator_ref)
    if not ready:
        try:
            value = await ref
        except Exception:  # noqa: BLE001  (an error item, the end, a lost worker: raised as Ray raises it)
            return await (await refs.__anext__())
        taken = await refs.__anext__()  # ready now: Ray hands out the ref without waiting
        return value if taken == ref else await taken
    return await (await refs.__anext__())
