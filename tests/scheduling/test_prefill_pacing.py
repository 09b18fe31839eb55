"""The prefill pacer: its chunk from step costs fed to it (no clock read), and the batcher's plan under it."""

import pytest

from cluster_configs.engine_config import EngineConfig
from memory.kv_cache import kv_layout
from scheduling import prefill_pacing as pacing
from scheduling.prefill_pacing import FIRST_CHUNK, GROWTH, PrefillPacer, token_price
from scheduling.scheduler import Scheduler
from tests.scheduling.test_scheduler import BLOCK_SIZE, request, run_step


def scheduler(**config) -> Scheduler:
    """A Scheduler without a model, blocks for every test's requests (none is preempted)."""
    config = EngineConfig(**{"block_size": BLOCK_SIZE, "max_num_seqs": 8} | config)
    return Scheduler(config, kv_layout(1, 64, BLOCK_SIZE, 1, 1, "float32"), eos_token_ids=())


def measured(stretch: float | None = 1.5, decode_s: float = 0.1, prompt_token_s: float = 0.01,
             chunk: int = 16, num_decoding: int = 4) -> PrefillPacer:
    """A pacer that saw a decode-only step of decode_s and a step with a chunk of prompt tokens beside it,
    both with num_decoding requests decoding (a step of more is priced by it too)."""
    pacer = PrefillPacer(stretch)
    pacer.observe(num_decoding, 0, decode_s)
    pacer.observe(num_decoding, chunk, decode_s + chunk * prompt_token_s)
    return pacer


def test_no_bound_unpaced_or_with_nothing_decoding():
    assert PrefillPacer(None).prompt_tokens(8) is None
    assert measured().prompt_tokens(0) is None


def test_first_chunk_before_a_step_was_measured_then_priced_as_a_decoding_token():
    pacer = PrefillPacer(1.5)
    assert pacer.prompt_tokens(3) == FIRST_CHUNK
    pacer.observe(0, 100, 5.0)  # a step where nothing decoded prices nothing (no stream waited on it)
    assert pacer.prompt_tokens(3) == FIRST_CHUNK
    pacer.observe(4, 0, 0.1)  # 4 decoding requests' tokens in 0.1 s: 0.025 s a token
    assert pacer.prompt_tokens(4) == 2  # 0.05 s of room
    assert pacer.prompt_tokens(10) == 5  # a step of 10 decodes: 0.01 s a token, 0.05 s of room


def test_every_probe_every_th_step_beside_decodes_decodes_alone():
    pacer, probe = measured(1.5, 0.1, 0.01), pacing.PROBE_EVERY  # a decode-only step, one of 16 prompt tokens
    chunks = []
    for _ in range(2 * probe):
        chunk = pacer.prompt_tokens(4)
        pacer.observe(4, chunk, 0.1 + chunk * 0.01)
        chunks.append(chunk)
    assert chunks == [5] * (probe - 2) + [0] + [5] * (probe - 1) + [0] + [5]
    unmeasured = PrefillPacer(1.5)  # prompts beside decodes from the first step: a probe measures decode_s
    for _ in range(probe - 1):
        assert unmeasured.prompt_tokens(4) == FIRST_CHUNK
        unmeasured.observe(4, FIRST_CHUNK, 0.3)
    assert unmeasured.prompt_tokens(4) == 0


def test_one_more_token_while_the_room_is_a_fraction_of_a_token_over_the_last_chunk():
    pacer = PrefillPacer(1.25)
    pacer.observe(8, 0, 0.356)
    pacer.observe(8, 2, 0.356 + 0.06 + 2 * 0.002)  # 0.032 s a token at this size: 2.8 fit
    assert pacer.prompt_tokens(8) == 3  # a fixed part in that price would leave room for more
    pacer.observe(8, 3, 0.356 + 0.095)  # 3 overran the 0.089 s of room
    pacer.observe(8, 2, 0.356 + 0.064)
    assert pacer.prompt_tokens(8) == 2  # 2.6 fit, and 3 is not tried again while it is among the recent


@pytest.mark.parametrize("stretch, decode_s, prompt_token_s, expected", [
    (1.5, 0.1, 0.01, 5),  # 0.05 s of room at 0.01 s a token
    (1.5, 0.1, 1 / 256, 12),
    (1.1, 0.1, 0.05, 1),  # not even one token fits: still one, so the prompt moves on
    (2.0, 0.1, 0.0001, int(GROWTH * FIRST_CHUNK) + 1),  # 1,000 would fit, but the chunk grows GROWTH-fold
])
def test_chunk_is_the_room_a_stretch_leaves_over_a_prompt_tokens_cost(stretch, decode_s, prompt_token_s,
                                                                       expected):
    assert measured(stretch, decode_s, prompt_token_s).prompt_tokens(8) == expected


def test_growth_follows_the_last_chunk_measured():
    pacer = measured(2.0, 0.1, 0.0001)
    for chunk in (21, 27, 34, 43):
        assert pacer.prompt_tokens(4) == chunk
        pacer.observe(4, chunk, 0.1 + chunk * 0.0001)
    pacer.observe(4, 8, 0.1 + 8 * 0.0001)  # a smaller chunk (a prompt's tail): growth starts from it
    assert pacer.prompt_tokens(4) == 11


def line(fixed_s: float, token_s: float, *sizes: int) -> list[tuple[int, float]]:
    return [(p, fixed_s + p * token_s) for p in sizes]


def test_a_prompt_tokens_price_is_the_recent_chunks_seconds_over_their_tokens():
    assert token_price(line(0.0, 0.005, 16, 8)) == pytest.approx(0.005)
    newer_weighs_more = token_price([(4, 0.2), (4, 0.1)])  # weights 0.75 and 1
    assert newer_weighs_more == pytest.approx((0.75 * 0.2 + 0.1) / (0.75 * 4 + 4))
    assert token_price([]) is None


@pytest.mark.parametrize("decode_s, fixed_s, token_s, stretch, best", [
    (0.356, 0.06, 0.002, 1.25, 14),  # (0.089 s of room - 0.06) / 0.002: 14.5
    (0.357, 0.03, 0.03, 1.5, 4),  # the 2-core Zen 1 VM's deployment: 4.95
    (0.4, 0.0, 0.05, 1.5, 4),  # all per token
])
def test_steps_with_a_fixed_part_settle_on_the_chunk_that_keeps_the_stretch(decode_s, fixed_s, token_s,
                                                                            stretch, best):
    """A closed loop: each step's seconds from a fixed and a per-token cost (no clock); the pacer's
    decode-only steps take decode_s. Priced at their own size, the chunks settle on the largest that keeps
    the stretch, trying one more now and then (at most a token's cost over)."""
    pacer, room = PrefillPacer(stretch), (stretch - 1) * decode_s
    pacer.observe(8, 0, decode_s)
    chunks = []
    for _ in range(60):
        chunk = pacer.prompt_tokens(8)
        pacer.observe(8, chunk, decode_s + (fixed_s + chunk * token_s if chunk else 0.0))
        chunks.append(chunk)
    settled = [c for c in chunks[-24:] if c]
    assert max(settled) <= best + 1 and sum(c == best + 1 for c in settled) <= 2
    assert min(settled) >= best - 1 and settled.count(best) >= len(settled) // 2
    assert all(fixed_s + c * token_s <= room + token_s + 1e-9 for c in chunks[1:] if c)


def test_costs_that_grow_with_the_prompt_shrink_its_chunks():
    """The long prompt's later tokens attend over more of it: a token's price follows the recent chunks."""
    decode_s, stretch = 0.357, 1.5
    pacer, room = PrefillPacer(stretch), (stretch - 1) * decode_s
    pacer.observe(8, 0, decode_s)
    for token_s in (0.02, 0.04):
        chunks = []
        for _ in range(40):
            chunk = pacer.prompt_tokens(8)
            pacer.observe(8, chunk, decode_s + (0.03 + chunk * token_s if chunk else 0.0))
            chunks.append(chunk)
        settled = [c for c in chunks[-16:] if c]
        assert max(settled) <= int((room - 0.03) / token_s) + 1 <= min(settled) + 2


def test_a_one_token_chunk_over_the_room_stretches_the_floor_measures_it_again_and_is_logged():
    sched = scheduler(max_num_batched_tokens=64, max_prefill_stretch=1.25)
    sched.add(request("a", [1, 2, 3], max_tokens=50))
    run_step(sched)
    sched.add(request("c", list(range(200)), max_tokens=2))
    pacer = sched.batcher.pacer  # steps where a decodes alone
    pacer.observe(1, 0, 0.1)
    pacer.observe(1, 1, 0.1 + 0.031)  # a one-token chunk adds 0.031 s: over the 0.025 s of room
    assert pacer.floor_over_stretch

    def chunk() -> int:
        plan, _ = run_step(sched)
        return {s.request.request_id: s.num_new_tokens for s in plan.scheduled}["c"]

    assert chunk() == 2  # 0.25 x the floor's 0.131 s is 1.06 tokens at its price: one more is tried
    logged = sched.batcher.decisions.recent("prefill_pacing")
    assert logged[0]["choice"] == "floor over the stretch" and "31.0 ms" in logged[0]["reason"]
    pacer.observe(1, 2, 0.1 + 0.032)
    pacer.observe(1, 0, 0.1)  # a decode-only step: the next chunk measures the floor again
    assert chunk() == 1
    for _ in range(3):  # the floor fell (the VM sped up): within the stretch again, and said
        pacer.observe(1, 1, 0.1 + 0.011)
    chunk()
    assert sched.batcher.decisions.recent("prefill_pacing")[-1]["choice"] == "within the stretch"


def test_decode_steps_are_priced_per_number_of_decoding_requests():
    """A compute-bound CPU: 8 requests' decode step costs 4x 2 requests'. Each count's chunk is priced over
    its own decode step (one average over both would price a prompt token at 0.10 s here, and leave one)."""
    pacer = PrefillPacer(1.5)
    pacer.observe(2, 0, 0.1)
    pacer.observe(8, 0, 0.4)
    pacer.observe(8, 4, 0.4 + 4 * 0.05)
    assert pacer.chunks[-1] == (4, pytest.approx(0.2))
    assert pacer.prompt_tokens(8) == 4  # 0.2 s of room at 0.05 s a token
    assert pacer.prompt_tokens(2) == 1  # 0.05 s of room
    assert pacer.prompt_tokens(5) == 1  # priced by the 2 requests' step: the cheaper one


def test_a_count_with_no_decode_step_below_it_measured_is_probed_and_not_fitted():
    pacer = measured(num_decoding=4)
    assert pacer.prompt_tokens(2) == 0  # a decode-only step measures 2 requests' step
    before = list(pacer.chunks)
    pacer.observe(2, 5, 0.3)  # with no decode step of 2 measured, nothing to price this one against
    assert list(pacer.chunks) == before
    pacer.observe(2, 0, 0.05)
    assert pacer.prompt_tokens(2) == 2  # 0.025 s of room at 0.01 s a token
    assert pacer.prompt_tokens(4) == 5  # its own step: 0.05 s of room


def test_averages_move_toward_new_costs():
    pacer = measured(1.5, 0.1, 0.01)
    before = pacer.prompt_tokens(4)
    for _ in range(20):  # prompt tokens got 4x dearer (a longer context)
        pacer.observe(4, 5, 0.1 + 5 * 0.04)
    pacer.observe(4, 0, 0.1)  # the decode-only step every pacing.PROBE_EVERY-th
    assert pacer.prompt_tokens(4) < before
    assert pacer.prompt_tokens(4) == 1  # 0.05 s of room at 0.04 s a token


def test_plan_gives_decodes_their_tokens_and_prompts_the_pacers_chunk():
    sched = scheduler(max_num_batched_tokens=16, max_prefill_stretch=1.5)
    for name in "ab":
        sched.add(request(name, [1, 2, 3], max_tokens=50))
    run_step(sched)  # both prompts at once: nothing decoded yet
    sched.add(request("c", list(range(20)), max_tokens=2))
    sched.batcher.pacer = measured(1.5, 0.1, 0.01, num_decoding=2)  # 5 prompt tokens a step beside decodes
    chunks = []
    while sched.requests["c"].num_computed_tokens < 20:
        plan, _ = run_step(sched)
        by_id = {s.request.request_id: s.num_new_tokens for s in plan.scheduled}
        assert by_id["a"] == by_id["b"] == 1  # the running streams decode every step
        chunks.append(by_id.get("c", 0))
    assert chunks == [5, 5, 5, 5]


def test_unpaced_plan_fills_the_token_budget():
    sched = scheduler(max_num_batched_tokens=16, max_prefill_stretch=None)
    sched.add(request("a", [1, 2, 3], max_tokens=50))
    run_step(sched)
    sched.add(request("c", list(range(20)), max_tokens=2))
    plan, _ = run_step(sched)
    assert [s.num_new_tokens for s in plan.scheduled] == [1, 15]


def test_a_running_prefill_is_paced_too_and_alone_takes_the_budget():
    sched = scheduler(max_num_batched_tokens=16, max_prefill_stretch=1.5)
    sched.add(request("c", list(range(40)), max_tokens=2))
    plan, _ = run_step(sched)
    assert [s.num_new_tokens for s in plan.scheduled] == [16]  # nothing decodes: the budget
    sched.add(request("a", [1], max_tokens=50))
    plan, _ = run_step(sched)  # a's one prompt token is prompt too: both share the budget
    assert {s.request.request_id: s.num_new_tokens for s in plan.scheduled} == {"c": 16}
    sched.batcher.pacer = measured(1.5, 0.1, 0.025)  # 2 prompt tokens a step beside decodes
    plan, _ = run_step(sched)  # nothing decodes yet: c's last 8 and a's token
    assert {s.request.request_id: s.num_new_tokens for s in plan.scheduled} == {"c": 8, "a": 1}


def test_an_admission_and_a_running_chunk_share_the_pacers_tokens():
    sched = scheduler(max_num_batched_tokens=16, max_prefill_stretch=1.5)
    sched.add(request("a", [1], max_tokens=50))
    run_step(sched)
    sched.add(request("b", list(range(9)), max_tokens=5))
    sched.add(request("c", list(range(20, 29)), max_tokens=2))
    sched.batcher.pacer = measured(1.5, 0.1, 0.01, num_decoding=1)  # 5 prompt tokens a step beside decodes
    steps = []
    for _ in range(4):
        plan, _ = run_step(sched)
        steps.append({s.request.request_id: s.num_new_tokens for s in plan.scheduled})
    # b admitted with 5, then its last 4 and c's first 1; then c's next 5; c's last 3 (b decodes)
    assert steps == [{"a": 1, "b": 5}, {"a": 1, "b": 4, "c": 1}, {"a": 1, "b": 1, "c": 5},
                     {"a": 1, "b": 1, "c": 3}]


def test_a_count_with_no_decode_step_measured_does_not_log_a_floor_it_cannot_price():
    """The floor logged over at 2 decoding requests; one finishes, and no decode step of 1 was measured: the
    step probes it, and the log waits for it rather than word a decode step it has not got."""
    sched = scheduler(max_num_batched_tokens=64, max_prefill_stretch=1.25)
    sched.add(request("a", [1, 2, 3], max_tokens=2))
    sched.add(request("b", [4, 5, 6], max_tokens=50))
    run_step(sched)
    sched.add(request("c", list(range(200)), max_tokens=2))
    pacer = sched.batcher.pacer
    pacer.observe(2, 0, 0.1)
    pacer.observe(2, 1, 0.1 + 0.031)
    run_step(sched)  # a's last token: it finishes
    assert sched.batcher.decisions.recent("prefill_pacing")[-1]["choice"] == "floor over the stretch"
    plan, _ = run_step(sched)
    assert {s.request.request_id: s.num_new_tokens for s in plan.scheduled} == {"b": 1}  # a probe
    assert sched.batcher.decisions.recent("prefill_pacing")[-1]["choice"] == "floor over the stretch"
