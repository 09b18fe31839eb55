"""One ns.LLM shared by many threads: their requests batch together in one engine loop and each gets the
tokens it would get alone; aborted streams lose or duplicate nothing; a failing step fails only its requests;
close() ends the loop thread."""

import gc
import threading

import numpy as np
import pytest

import numaserve as ns
from tests.conftest import random_prompt

FP32 = {"weight_dtype": "float32", "kv_dtype": "float32", "enable_prefix_caching": False}
NUM_THREADS, NUM_PER_THREAD = 8, 4
PROMPTS = [random_prompt(5 + 3 * i, seed=200 + i) for i in range(NUM_THREADS * NUM_PER_THREAD)]
# greedy and seeded requests alternate
PARAMS = [ns.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True) if i % 2 else
          ns.SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=i, ignore_eos=True)
          for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def alone(llama_dir) -> list[ns.Completion]:
    with ns.LLM(llama_dir, **FP32) as llm:
        completions = [llm.generate(p, sp)[0] for p, sp in zip(PROMPTS, PARAMS)]
        stats = llm.stats()
    assert stats["num_scheduled_requests"] == stats["num_steps"]  # one request a step: nothing shared
    return completions


def run_threads(work, num_threads: int = NUM_THREADS) -> None:
    """work(thread_index) in num_threads threads started together; re-raises the first failure."""
    start, failures = threading.Barrier(num_threads), []

    def run(t: int) -> None:
        start.wait()
        try:
            work(t)
        except BaseException as e:  # noqa: BLE001  (re-raised below)
            failures.append(e)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]


def hold_loop_until_submitted(llm: ns.LLM, num_submissions: int, monkeypatch) -> threading.Thread:
    """Hold llm's loop thread (in a call it runs) until num_submissions submissions are queued behind the
    call: then the first is stepped alone and every other joins the second step, whatever the threads'
    timing. -> the thread waiting on the call (join it)."""
    submitted = threading.Semaphore(0)
    submit = llm._loop.submit

    def counted(requests, deltas=False):
        pending = submit(requests, deltas)
        submitted.release()
        return pending

    def hold(engine) -> None:
        for _ in range(num_submissions):
            submitted.acquire()

    monkeypatch.setattr(llm._loop, "submit", counted)
    holder = threading.Thread(target=llm._loop.call, args=(hold,))
    holder.start()
    return holder


def loop_threads() -> int:
    return sum(t.name == "numaserve-engine-loop" for t in threading.enumerate())


def test_eight_threads_share_steps_and_get_what_each_gets_alone(llama_dir, alone, monkeypatch):
    together: dict[int, ns.Completion] = {}
    with ns.LLM(llama_dir, **FP32) as llm:
        def work(t: int) -> None:
            for i in range(t * NUM_PER_THREAD, (t + 1) * NUM_PER_THREAD):  # one request after another
                [together[i]] = llm.generate(PROMPTS[i], PARAMS[i])

        holder = hold_loop_until_submitted(llm, NUM_THREADS, monkeypatch)  # each thread's first request
        run_threads(work)
        holder.join()
        stats = llm.stats()
    assert [together[i].token_ids for i in range(len(PROMPTS))] == [c.token_ids for c in alone]
    assert [together[i].text for i in range(len(PROMPTS))] == [c.text for c in alone]
    # each thread's requests ran one after another; the second step held every thread's first request (their
    # 376 prompt tokens fit one step's budget of 512)
    assert stats["num_scheduled_requests"] >= stats["num_steps"] + NUM_THREADS - 1
    assert stats["num_generated_tokens"] == sum(len(c.token_ids) for c in alone)


def test_random_stream_aborts_lose_or_duplicate_nothing(llama_dir, alone):
    finished: dict[int, ns.Completion] = {}
    partial: dict[int, str] = {}
    with ns.LLM(llama_dir, **FP32) as llm:
        def work(t: int) -> None:
            rng = np.random.default_rng(t)
            for i in range(t * NUM_PER_THREAD, (t + 1) * NUM_PER_THREAD):
                how = rng.integers(3)
                if how == 0:
                    [finished[i]] = llm.generate(PROMPTS[i], PARAMS[i])
                    continue
                stream = llm.stream(PROMPTS[i], PARAMS[i])
                partial[i] = "".join(next(stream) for _ in range(rng.integers(1, 4)))
                if how == 1:
                    stream.close()
                else:  # dropped unclosed: the garbage collector's finalizing aborts it
                    del stream
                    gc.collect()

        run_threads(work)
        stats = llm.stats()  # read by the loop thread after every abort was queued
    assert finished and partial  # both kinds ran (the seeds pick them)
    for i, completion in finished.items():
        assert completion.token_ids == alone[i].token_ids and completion.finish_reason == "length"
    for i, text in partial.items():  # no delta lost or repeated before the abort
        assert text and alone[i].text.startswith(text)
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_a_failing_step_fails_its_requests_and_the_llm_serves_on(llama_dir, alone, monkeypatch):
    with ns.LLM(llama_dir, **FP32) as llm:
        run = llm.engine.runner.run
        calls = iter(range(1_000_000))

        def fail_third_step(plan):
            if next(calls) == 2:
                raise RuntimeError("injected step failure")
            return run(plan)

        monkeypatch.setattr(llm.engine.runner, "run", fail_third_step)
        with pytest.raises(RuntimeError, match="injected step failure"):
            llm.generate(PROMPTS[:2], PARAMS[:2])
        assert [c.token_ids for c in llm.generate(PROMPTS[:4], PARAMS[:4])] == [
            c.token_ids for c in alone[:4]]
        stats = llm.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_a_failure_of_the_loop_itself_closes_the_llm_and_answers_every_caller(llama_dir, monkeypatch):
    num_before = loop_threads()
    llm = ns.LLM(llama_dir, **FP32)

    def broken(*args):
        raise RuntimeError("injected bug")

    monkeypatch.setattr(llm.engine, "step", broken)
    monkeypatch.setattr(llm.engine, "abort", broken)  # failing the step's requests fails too
    with pytest.raises(ns.EngineClosed, match="injected bug"):
        llm.generate(PROMPTS[:2], PARAMS[:2])
    with pytest.raises(ns.EngineClosed):
        llm.stats()
    llm.close()
    assert loop_threads() == num_before


def test_close_stops_the_loop_thread_and_later_calls_raise(llama_dir, alone):
    num_before = loop_threads()
    with ns.LLM(llama_dir, **FP32) as llm:
        assert loop_threads() == num_before + 1
        assert llm.generate(PROMPTS[0], PARAMS[0])[0].token_ids == alone[0].token_ids
        stream = llm.stream(PROMPTS[1], PARAMS[1].model_copy(update={"max_tokens": 400}))
        next(stream)
    assert loop_threads() == num_before
    with pytest.raises(ns.EngineClosed):  # the stream was pending when the LLM closed
        list(stream)
    for call in (lambda: llm.generate(PROMPTS[0], PARAMS[0]), lambda: next(llm.stream(PROMPTS[0])),
                 lambda: llm.score(PROMPTS[0]), llm.stats, lambda: llm.register_adapter("a", "/nowhere")):
        with pytest.raises(ns.EngineClosed, match="closed"):
            call()
    llm.close()  # again: nothing to do


def test_an_llm_dropped_unclosed_ends_its_thread(llama_dir):
    num_before = loop_threads()
    llm = ns.LLM(llama_dir, **FP32)
    llm.generate(PROMPTS[0], PARAMS[0])
    del llm
    gc.collect()
    assert loop_threads() == num_before


def test_two_cache_salts_never_share_prefix_blocks(llama_dir):
    prompt = random_prompt(100, seed=21)
    greedy = ns.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with ns.LLM(llama_dir, **FP32 | {"enable_prefix_caching": True}) as llm:
        hits, texts = [], set()
        for salt, via_stream in (("x", False), ("y", False), (None, False), ("x", False), ("y", True),
                                 (None, False)):
            before = llm.stats()["num_prefix_hit_tokens"]
            if via_stream:
                texts.add("".join(llm.stream(prompt, greedy, cache_salt=salt)))
            else:
                texts.add(llm.generate(prompt, greedy, cache_salt=salt)[0].text)
            hits.append(llm.stats()["num_prefix_hit_tokens"] - before)
        with pytest.raises(ns.InvalidRequest, match="cache_salt"):
            llm.generate(prompt, greedy, cache_salt=7)
    assert hits == [0, 0, 0, 96, 96, 96]  # 6 full blocks of 16 of the 100 tokens, within one salt only
    assert len(texts) == 1
