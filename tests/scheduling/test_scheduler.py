"""The Scheduler driven without a model: a fake sampler gives every request that reaches the end of its tokens
one fixed token. Exact steps of small cases, and invariants of requests and blocks under random add / abort /
step sequences (preemptions and prefix hits included)."""

import time
from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cluster_configs.engine_config import EngineConfig
from cluster_configs.sampling_params import SamplingParams
from memory.block_pool import NULL_BLOCK
from memory.kv_cache import kv_layout
from scheduling.outputs import RequestOutput, SampledTokens, SamplerOutput
from scheduling.plan import StepPlan
from scheduling.policy import Policy
from scheduling.request import Request, RequestStatus
from scheduling.scheduler import Scheduler

NUM_BLOCKS, BLOCK_SIZE, MAX_MODEL_LEN = 8, 4, 64  # 8 blocks: three requests of 20 tokens preempt
TOKEN = 7  # what the fake sampler samples


def scheduler(released: list[str] | None = None, **config) -> Scheduler:
    """A Scheduler over a pool of NUM_BLOCKS blocks, no KV arrays; released ids are appended to released."""
    config = EngineConfig(**{"block_size": BLOCK_SIZE, "max_num_batched_tokens": 16, "max_num_seqs": 4}
                          | config)
    layout = kv_layout(1, NUM_BLOCKS, BLOCK_SIZE, 1, 1, "float32")
    on_release = released.append if released is not None else (lambda request_id: None)
    return Scheduler(config, layout, eos_token_ids=(), on_release=on_release)


def request(request_id: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   max_model_len=MAX_MODEL_LEN)


def sample(plan: StepPlan) -> SamplerOutput:
    """TOKEN for each request whose step reaches the end of its tokens (None: a prefill chunk short of it)."""
    sampled = tuple(SampledTokens([TOKEN], None, 0, 0, [0])
                    if s.request.num_computed_tokens + s.num_new_tokens == s.request.num_tokens else None
                    for s in plan.scheduled)
    return SamplerOutput(sampled, (None,) * len(sampled), (None,) * len(sampled))


def run_step(sched: Scheduler) -> tuple[StepPlan, list[RequestOutput]]:
    plan = sched.schedule()
    return plan, sched.update_from_output(plan, sample(plan)).outputs if plan.scheduled else []


def test_a_prompt_is_chunked_under_the_budget_then_decodes_a_token_a_step_and_finishes_at_length():
    released = []
    sched = scheduler(released, max_num_batched_tokens=8)
    req = request("a", list(range(20)), max_tokens=3)
    sched.add(req)
    steps = []
    while sched.has_unfinished():
        plan, outputs = run_step(sched)
        steps.append(([s.num_new_tokens for s in plan.scheduled], [(o.token_ids, o.finish_reason)
                                                                    for o in outputs]))
    assert steps == [([8], []), ([8], []), ([4], [([TOKEN], None)]), ([1], [([TOKEN], None)]),
                     ([1], [([TOKEN], "length")])]
    assert req.output_token_ids == [TOKEN] * 3 and req.finish_reason == "length"
    assert released == ["a"] and req.block_ids == []
    assert sched.kv.pool.num_free_blocks == NUM_BLOCKS


def test_abort_returns_the_requests_blocks_and_its_last_output():
    released = []
    sched = scheduler(released)
    sched.add(request("a", [1] * 9, max_tokens=8))
    sched.add(request("b", [2] * 5, max_tokens=8))
    run_step(sched)
    held = len(sched.requests["a"].block_ids)
    assert held == 3 and sched.kv.pool.num_free_blocks == NUM_BLOCKS - 3 - 2
    out = sched.abort("a")  # its token went out with the step
    assert (out.request_id, out.token_ids, out.finish_reason) == ("a", [], "abort")
    assert sched.kv.pool.num_free_blocks == NUM_BLOCKS - 2 and [r.request_id for r in sched.running] == ["b"]
    assert sched.abort("a") is None and released == ["a"]
    assert sched.abort("b").finish_reason == "abort"
    assert sched.kv.pool.num_free_blocks == NUM_BLOCKS and not sched.has_unfinished()


def test_a_request_past_its_deadline_is_aborted_whether_waiting_or_running():
    sched = scheduler()
    for request_id in ("running", "waiting", "later"):
        sched.add(request(request_id, [3] * 5, max_tokens=4))
    run_step(sched)
    sched.add(request("queued", [4] * 5, max_tokens=4))
    sched.requests["running"].deadline = sched.requests["queued"].deadline = time.monotonic() - 1.0
    outputs = sched.abort_expired()
    assert sorted((o.request_id, o.finish_reason) for o in outputs) == [("queued", "abort"),
                                                                         ("running", "abort")]
    assert sorted(sched.requests) == ["later", "waiting"]


def test_a_policy_limits_the_next_steps_batch():
    sched = scheduler()
    for i in range(3):
        sched.add(request(f"r{i}", [i] * 6, max_tokens=4))
    sched.apply(Policy(token_budget=8, max_num_seqs=2, admission_bound=4))
    plan, _ = run_step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in plan.scheduled] == [("r0", 6), ("r1", 2)]
    plan, _ = run_step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in plan.scheduled] == [("r0", 1), ("r1", 4)]
    assert [r.request_id for r in sched.waiting] == ["r2"]


class SchedulerMachine(RuleBasedStateMachine):
    """Every request added is running, waiting or finished (released, its blocks back); a block's ref count is
    the number of running requests holding it; once all finish, every block is free again."""

    def __init__(self):
        super().__init__()
        self.released: list[str] = []
        self.sched = scheduler(self.released, max_num_seqs=3, max_num_batched_tokens=12)
        self.added: dict[str, Request] = {}
        self.finished: dict[str, str] = {}  # request id -> its finish reason, from its last output

    def _record(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                assert out.request_id not in self.finished, "a request finished twice"
                self.finished[out.request_id] = out.finish_reason

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=12), max_tokens=st.integers(1, 8))
    def add(self, prompt, max_tokens):
        req = request(f"r{len(self.added)}", prompt, max_tokens)  # a tiny alphabet: prefixes repeat
        self.added[req.request_id] = req
        self.sched.add(req)

    @precondition(lambda self: self.sched.requests)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.sched.requests)))
        self._record([self.sched.abort(request_id)])

    @rule()
    def step_once(self):
        self._record(run_step(self.sched)[1])

    @rule()
    def drain(self):
        for _ in range(200):  # every request fits the pool alone: preemption makes way, never loops
            if not self.sched.has_unfinished():
                break
            self._record(run_step(self.sched)[1])
        assert not self.sched.has_unfinished()
        assert self.sched.kv.pool.num_free_blocks == NUM_BLOCKS

    @invariant()
    def each_request_is_running_waiting_or_finished_and_released(self):
        running = [r.request_id for r in self.sched.running]
        waiting = [r.request_id for r in self.sched.waiting]
        assert len(set(running + waiting)) == len(running) + len(waiting)
        assert set(self.sched.requests) == set(running) | set(waiting)
        for request_id, req in self.added.items():
            if request_id in self.sched.requests:
                status = RequestStatus.RUNNING if request_id in running else RequestStatus.WAITING
                assert req.status is status
            else:
                assert req.status is RequestStatus.FINISHED and req.block_ids == []
                assert self.finished[request_id] == req.finish_reason
        gone = set(self.added) - set(running + waiting)
        assert sorted(self.released) == sorted(self.finished) == sorted(gone)

    @invariant()
    def finished_at_length_means_max_tokens_appended(self):
        for request_id, reason in self.finished.items():
            req = self.added[request_id]
            if reason == "length":
                assert req.output_token_ids == [TOKEN] * req.params.max_tokens

    @invariant()
    def ref_counts_are_the_running_requests_holding_each_block(self):
        pool = self.sched.kv.pool
        assert all(r.block_ids == [] for r in self.sched.waiting)
        held = Counter(b for r in self.sched.running for b in r.block_ids if b != NULL_BLOCK)
        assert {b: n for b, n in enumerate(pool.ref_cnt) if n} == dict(held)
        assert set(pool.free_queue) == {b for b, n in enumerate(pool.ref_cnt) if n == 0}


SchedulerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestSchedulerMachine = SchedulerMachine.TestCase
