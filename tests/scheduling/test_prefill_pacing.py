"""The prefill pacer: its chunk from step costs fed to it (no clock read), and the batcher's plan under it."""

import pytest

from cluster_configs.engine_config import EngineConfig
from memory.kv_cache import kv_layout
from scheduling.prefill_pacing import FIRST_CHUNK, GROWTH, PrefillPacer
from scheduling.scheduler import Scheduler
from tests.scheduling.test_scheduler import BLOCK_SIZE, request, run_step


def scheduler(**config) -> Scheduler:
    """A Scheduler without a model, blocks for every test's requests (none is preempted)."""
    config = EngineConfig(**{"block_size": BLOCK_SIZE, "max_num_seqs": 8} | config)
    return Scheduler(config, kv_layout(1, 64, BLOCK_SIZE, 1, 1, "float32"), eos_token_ids=())


def measured(stretch: float | None = 1.5, decode_s: float = 0.1, prompt_token_s: float = 0.01,
             chunk: int = 16) -> PrefillPacer:
    """A pacer that saw a decode-only step of decode_s and a step with a chunk of prompt tokens beside it."""
    pacer = PrefillPacer(stretch)
    pacer.observe(4, 0, decode_s)
    pacer.observe(4, chunk, decode_s + chunk * prompt_token_s)
    return pacer


def test_no_bound_unpaced_or_with_nothing_decoding():
    assert PrefillPacer(None).prompt_tokens(8) is None
    assert measured().prompt_tokens(0) is None


def test_first_chunk_before_a_cost_was_measured():
    pacer = PrefillPacer(1.5)
    assert pacer.prompt_tokens(3) == FIRST_CHUNK
    pacer.observe(3, 0, 0.1)  # a decode step alone does not price a prompt token
    assert pacer.prompt_tokens(3) == FIRST_CHUNK
    pacer.observe(0, 100, 5.0)  # nor does a step where nothing decoded (no stream waited on it)
    assert pacer.prompt_tokens(3) == FIRST_CHUNK


@pytest.mark.parametrize("stretch, decode_s, prompt_token_s, expected", [
    (1.5, 0.1, 0.01, 5),  # 0.05 s of room at 0.01 s a token
    (1.5, 0.1875, 1 / 256, 24),
    (1.1, 0.1, 0.05, 1),  # not even one token fits: still one, so the prompt moves on
    (2.0, 0.1, 0.0001, GROWTH * FIRST_CHUNK),  # 1,000 would fit, but only twice the largest chunk measured
])
def test_chunk_is_the_room_a_stretch_leaves_over_a_prompt_tokens_cost(stretch, decode_s, prompt_token_s,
                                                                       expected):
    assert measured(stretch, decode_s, prompt_token_s).prompt_tokens(8) == expected


def test_growth_follows_the_largest_chunk_measured():
    pacer = measured(2.0, 0.1, 0.0001)
    for chunk in (32, 64, 128):
        assert pacer.prompt_tokens(4) == chunk
        pacer.observe(4, chunk, 0.1 + chunk * 0.0001)
    assert pacer.prompt_tokens(4) == 256


def test_averages_move_toward_new_costs():
    pacer = measured(1.5, 0.1, 0.01)
    before = pacer.prompt_tokens(4)
    for _ in range(20):  # prompt tokens got 4x dearer (a longer context)
        pacer.observe(4, 5, 0.1 + 5 * 0.04)
    assert pacer.prompt_tokens(4) < before
    assert pacer.prompt_tokens(4) == 1  # 0.05 s of room at 0.04 s a token


def test_plan_gives_decodes_their_tokens_and_prompts_the_pacers_chunk():
    sched = scheduler(max_num_batched_tokens=16, max_prefill_stretch=1.5)
    for name in "ab":
        sched.add(request(name, [1, 2, 3], max_tokens=50))
    run_step(sched)  # both prompts at once: nothing decoded yet
    sched.add(request("c", list(range(20)), max_tokens=2))
    sched.batcher.pacer = measured(1.5, 0.1, 0.01)  # 5 prompt tokens a step beside decodes
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
    sched.batcher.pacer = measured(1.5, 0.1, 0.01)  # 5 prompt tokens a step beside decodes
    steps = []
    for _ in range(4):
        plan, _ = run_step(sched)
        steps.append({s.request.request_id: s.num_new_tokens for s in plan.scheduled})
    # b admitted with 5, then its last 4 and c's first 1; then c's next 5; c's last 3 (b decodes)
    assert steps == [{"a": 1, "b": 5}, {"a": 1, "b": 4, "c": 1}, {"a": 1, "b": 1, "c": 5},
                     {"a": 1, "b": 1, "c": 3}]
