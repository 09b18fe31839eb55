"""Each prefill and batched row of `numaserve bench` is a fraction of the peak of what the engine computed
with, not of what was asked for: a CPU without vdpbf16ps computes bfloat16 requests in float32 (and has no
bf16 peak to measure)."""

from benchmarks.bench_decode import peak_kind


def test_a_row_takes_the_peak_of_the_activations_the_engine_computed_with():
    assert peak_kind(["bfloat16"]) == "bf16"
    assert peak_kind(["float32"]) == "f32"  # bfloat16 asked, float32 computed: the f32 FMA peak
    assert peak_kind(["int8"]) == "int8"


def test_mixed_activations_take_the_highest_peak_of_theirs():
    assert peak_kind(["float32", "int8"]) == "int8"
    assert peak_kind(["bfloat16", "float32"]) == "bf16"
