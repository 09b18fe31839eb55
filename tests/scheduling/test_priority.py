"""SamplingParams.priority under EngineConfig.scheduling_policy: "priority" lets a priority-0 request that
arrives behind 16 priority-1 requests in a full KV pool run first (preempting them), "fcfs" keeps it in
its place; neither changes any output. And the HTTP body's priority field reaches SamplingParams."""

import threading

import pytest

import numaserve as ns
from http_api.protocol import CompletionRequest
from tests.conftest import random_prompt

FP32 = {"weight_dtype": "float32", "kv_dtype": "float32", "enable_prefix_caching": False}
# 16 blocks of 64 tokens: the 16 background requests (6 + 40 tokens) take one each and fill the pool without
# ever needing another, so none preempts another and the urgent one (6 + 8) finds no free block
BYTES_PER_BLOCK = 64 * 2 * 2 * 2 * 24 * 4  # block_size * (k, v) * layers * kv_heads * head_dim * fp32
FULL_POOL = {"block_size": 64, "kv_cache_bytes": 16 * BYTES_PER_BLOCK}
BACKGROUND = [random_prompt(6, seed=300 + i) for i in range(16)]
BACKGROUND_PARAMS = ns.SamplingParams(max_tokens=40, temperature=0.8, seed=5, ignore_eos=True, priority=1)
URGENT = random_prompt(6, seed=400)
URGENT_PARAMS = ns.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, priority=0)


@pytest.fixture(scope="module")
def alone(llama_dir) -> list[list[int]]:
    """Tokens of the 16 background requests and the urgent one, each alone in a roomy pool."""
    with ns.LLM(llama_dir, **FP32) as llm:
        return [llm.generate(p, BACKGROUND_PARAMS)[0].token_ids for p in BACKGROUND] + [
            llm.generate(URGENT, URGENT_PARAMS)[0].token_ids]


def finish_order(llm: ns.LLM, pool_full: threading.Event) -> list[int]:
    """The priorities of the requests in the order the engine finishes them (from its steps' outputs).
    pool_full is set after the first step that fills the KV pool; that step then waits until the urgent
    request is made (it is queued right after), so that it arrives while the 16 run however slow this machine
    is."""
    priorities, order, urgent_made = {}, [], threading.Event()
    make_request, submit, step = llm.engine.make_request, llm.engine.submit, llm.engine.step

    def recording_make_request(*args, **kwargs):
        req = make_request(*args, **kwargs)
        if req.priority == 0:
            urgent_made.set()
        return req

    def recording_submit(req):
        priorities[req.request_id] = req.priority
        submit(req)

    def recording_step():
        out = step()
        if out.stats.kv_usage == 1.0 and not pool_full.is_set():
            pool_full.set()
            assert urgent_made.wait(timeout=600)  # (a bound for a hang only)
        order.extend(priorities[o.request_id] for o in out.outputs if o.finished)
        return out

    llm.engine.make_request, llm.engine.submit, llm.engine.step = (recording_make_request, recording_submit,
                                                                   recording_step)
    return order


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_a_priority_0_request_behind_16_of_priority_1_in_a_full_pool(llama_dir, alone, policy):
    with ns.LLM(llama_dir, **FP32, **FULL_POOL, scheduling_policy=policy) as llm:
        pool_full = threading.Event()
        order = finish_order(llm, pool_full)
        background = {}
        thread = threading.Thread(target=lambda: background.update(
            out=llm.generate(BACKGROUND, BACKGROUND_PARAMS)))
        thread.start()
        assert pool_full.wait(timeout=600)  # (a bound for a hang only)
        [urgent] = llm.generate(URGENT, URGENT_PARAMS)
        thread.join()
        stats = llm.stats()
    assert [c.token_ids for c in background["out"]] + [urgent.token_ids] == alone
    assert len(order) == 17 and stats["num_free_blocks"] == stats["num_blocks"] == 16
    if policy == "priority":
        assert order[0] == 0  # before any of the 16 that arrived first
        assert stats["num_preemptions"] == 1  # the last of them made room for it
    else:
        assert order.index(0) > 0  # in its place: a block frees only when one of the 16 finishes
        assert stats["num_preemptions"] == 0


def test_fcfs_ignores_priority_and_priority_orders_by_it(llama_dir):
    for policy, admitted_first in (("fcfs", 1), ("priority", 0)):
        with ns.LLM(llama_dir, **FP32, max_num_seqs=1, scheduling_policy=policy) as llm:
            engine = llm.engine
            early = engine.make_request("early", BACKGROUND[0], BACKGROUND_PARAMS)
            late = engine.make_request("late", URGENT, URGENT_PARAMS)
            engine.submit(early)
            engine.submit(late)
            plan = engine.scheduler.schedule()
            assert [s.request.priority for s in plan.scheduled] == [admitted_first]


def test_the_http_priority_field_becomes_sampling_params_priority():
    body = CompletionRequest(prompt="hi", priority=-3)
    assert [sp.priority for sp in body.sampling_params(4, None)] == [-3]
    assert CompletionRequest(prompt="hi").sampling_params(4, None)[0].priority == 0
