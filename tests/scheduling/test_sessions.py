"""Session sequences keep their KV between turns: a turn prefills only its new input, and every turn's tokens
equal a fresh generate over the whole history (after reset, fork, eviction, and from two threads at once)."""

import threading

import pytest

import numaserve as ns
from tests.conftest import random_prompt

FP32 = {"weight_dtype": "float32", "kv_dtype": "float32"}
GREEDY = ns.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
SEEDED = ns.SamplingParams(max_tokens=6, temperature=0.9, seed=3, ignore_eos=True)
TURNS = [random_prompt(n, seed=500 + i) for i, n in enumerate((20, 7, 13, 5))]
BLOCK_BYTES = 16 * 2 * 2 * 2 * 24 * 4  # block_size * (k, v) * layers * kv_heads * head_dim * fp32


@pytest.fixture(scope="module")
def fresh(llama_dir):
    """tokens(history, params): a fresh generate's output over the whole history, no cache involved."""
    llm = ns.LLM(llama_dir, **FP32, enable_prefix_caching=False)
    yield lambda history, params=GREEDY: llm.generate(history, params)[0].token_ids
    llm.close()


def prefilled(llm: ns.LLM, turn) -> tuple[list[int], int]:
    """turn() -> (its completion's tokens, the prompt tokens its steps prefilled)."""
    before = llm.stats()["num_prefill_tokens"]
    completion = turn()
    return completion.token_ids, llm.stats()["num_prefill_tokens"] - before


def test_four_turns_prefill_only_each_new_turn_and_equal_fresh_generates(llama_dir, fresh):
    with ns.LLM(llama_dir, **FP32) as llm:
        seq = llm.session().sequence()
        history = []
        for i, turn in enumerate(TURNS):
            history += turn
            tokens, num_prefilled = prefilled(llm, lambda turn=turn: seq.generate(turn, GREEDY))
            # the new input and the last turn's last token (sampled, never fed), nothing earlier
            assert num_prefilled == len(turn) + (1 if i else 0)
            assert tokens == fresh(history)
            history += tokens
        assert seq.token_ids == history
        assert llm.stats()["num_pinned_blocks"] == -(-(len(history) - 1) // 16)


def test_reset_returns_a_sequence_to_a_fresh_ones_tokens(llama_dir, fresh):
    with ns.LLM(llama_dir, **FP32) as llm:
        seq = llm.session().sequence()
        seq.generate(TURNS[0], SEEDED)
        seq.reset()
        assert seq.token_ids == [] and llm.stats()["num_pinned_blocks"] == 0
        assert seq.generate(TURNS[1], SEEDED).token_ids == fresh(TURNS[1], SEEDED)


def test_fork_shares_blocks_and_both_branches_equal_their_fresh_equivalents(llama_dir, fresh):
    with ns.LLM(llama_dir, **FP32, enable_prefix_caching=False) as llm:
        seq = llm.session().sequence()
        seq.generate(TURNS[0] + TURNS[2], GREEDY)  # 33 + 6 tokens: 2 full blocks of 16 and a partial one
        history = seq.token_ids
        branch = seq.fork()
        pool, shared = llm.engine.scheduler.kv.pool, seq._kv.block_ids[:2]
        assert branch._kv.block_ids == shared and [pool.ref_cnt[b] for b in shared] == [2, 2]
        assert pool.ref_cnt[seq._kv.block_ids[2]] == 1  # the partial block is not shared
        a, num_a = prefilled(llm, lambda: seq.generate(TURNS[1], GREEDY))
        b, num_b = prefilled(llm, lambda: branch.generate(TURNS[3], GREEDY))
        assert a == fresh(history + TURNS[1]) and b == fresh(history + TURNS[3])
        assert num_a == len(TURNS[1]) + 1
        assert num_b == len(history) - 32 + len(TURNS[3])  # the partial block's tokens recomputed
        assert branch.token_ids[:len(history)] == seq.token_ids[:len(history)] == history


def test_sequences_used_from_two_threads_at_once_stay_independent(llama_dir, fresh):
    with ns.LLM(llama_dir, **FP32) as llm:
        session = llm.session()
        seqs, outputs = [session.sequence(), session.sequence()], [[], []]
        start = threading.Barrier(2)

        def converse(t: int) -> None:
            start.wait()
            for turn in TURNS[t::2] + TURNS[1 - t::2]:
                outputs[t].append(seqs[t].generate(turn, SEEDED).token_ids)

        threads = [threading.Thread(target=converse, args=(t,)) for t in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    for t in range(2):
        history = []
        for turn, tokens in zip(TURNS[t::2] + TURNS[1 - t::2], outputs[t], strict=True):
            history += turn
            assert tokens == fresh(history, SEEDED)
            history += tokens


def test_past_session_kv_bytes_the_least_recently_used_sequence_is_evicted(llama_dir, fresh):
    with ns.LLM(llama_dir, **FP32, session_kv_bytes=3 * BLOCK_BYTES) as llm:
        session = llm.session()
        first, second = session.sequence(), session.sequence()
        first.generate(TURNS[0] + TURNS[1], GREEDY)  # 27 + 6 tokens: KV of 32 in 2 blocks
        second.generate(TURNS[2], GREEDY)  # 2 blocks: 4 pinned > 3, the first is evicted
        assert llm.stats()["num_session_evictions"] == 1 and llm.stats()["num_pinned_blocks"] == 2
        history = first.token_ids
        tokens, num_prefilled = prefilled(llm, lambda: first.generate(TURNS[3], GREEDY))
        assert tokens == fresh(history + TURNS[3])
        assert num_prefilled == len(history) + len(TURNS[3]) - 32  # recomputed past the 2 cached blocks


def test_a_full_pool_evicts_idle_sequences_before_refusing_or_preempting(llama_dir, fresh):
    with ns.LLM(llama_dir, **FP32, kv_cache_bytes=16 * BLOCK_BYTES) as llm:
        seq = llm.session().sequence()
        seq.generate(TURNS[0], GREEDY)  # 2 blocks pinned
        long = random_prompt(200, seed=600)
        params = ns.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)  # 15 of the 16 blocks
        assert llm.generate(long, params)[0].token_ids == fresh(long, params)
        stats = llm.stats()
        assert stats["num_session_evictions"] == 1 and stats["num_preemptions"] == 0
        history = seq.token_ids
        assert seq.generate(TURNS[1], GREEDY).token_ids == fresh(history + TURNS[1])


def test_session_close_frees_every_block(llama_dir):
    with ns.LLM(llama_dir, **FP32) as llm:
        session = llm.session()
        seq = session.sequence()
        seq.generate(TURNS[0], GREEDY)
        seq.fork().generate(TURNS[1], GREEDY)
        session.close()
        stats = llm.stats()
        assert stats["num_pinned_blocks"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
        with pytest.raises(ns.EngineClosed, match="session is closed"):
            seq.generate(TURNS[2], GREEDY)
        session.close()  # again: nothing to do


def test_a_streamed_turn_is_history_like_a_generated_one(llama_dir, fresh):
    with ns.LLM(llama_dir, **FP32) as llm:
        seq = llm.session().sequence()
        seq.generate(TURNS[0], GREEDY)
        history = seq.token_ids + TURNS[1]
        text = "".join(seq.stream(TURNS[1], GREEDY))
        assert seq.token_ids[len(history):] == fresh(history)
        assert text == llm.generate(history, GREEDY, cache_salt="unshared")[0].text
        stream = seq.stream(TURNS[2], GREEDY)
        next(stream)
        stream.close()  # the turn is aborted; what it generated stays in the history
        assert llm.stats()["num_running"] == 0
        assert seq.token_ids[:len(history) + GREEDY.max_tokens + len(TURNS[2])] == (
            history + fresh(history) + TURNS[2])


def test_sliding_window_sequences_continue_from_their_window(model_dirs):
    mistral = model_dirs["mistral"]  # window 8: blocks out of the window are released as it goes
    with ns.LLM(mistral, **FP32, block_size=4, enable_prefix_caching=False) as reference, \
            ns.LLM(mistral, **FP32, block_size=4) as llm:
        seq = llm.session().sequence()
        history = []
        for turn in TURNS[:3]:
            history += turn
            tokens = seq.generate(turn, GREEDY).token_ids
            assert tokens == reference.generate(history, GREEDY)[0].token_ids
            history += tokens


def test_a_queued_turn_leaves_its_blocks_evictable_for_whoever_is_admitted_first(llama_dir, fresh):
    # 16 blocks of 16: the sequence pins 10, the long request arriving before its next turn needs 13 at once
    with ns.LLM(llama_dir, **FP32, kv_cache_bytes=16 * BLOCK_BYTES) as llm:
        seq = llm.session().sequence()
        seq.generate(random_prompt(140, seed=700), GREEDY)
        history, engine = seq.token_ids, llm.engine
        params = ns.SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
        long = engine.make_request("long", random_prompt(200, seed=701), params)
        turn = engine.make_request("turn", history + TURNS[1], GREEDY)
        turn.sequence = seq._kv
        engine.submit(long)
        engine.submit(turn)
        for _ in range(500):  # (a bound for a deadlock only)
            if not engine.has_unfinished():
                break
            engine.step()
        assert long.finished and turn.finished
        assert long.output_token_ids == fresh(random_prompt(200, seed=701), params)
        assert turn.output_token_ids == fresh(history + TURNS[1])
        assert engine.stats()["num_session_evictions"] == 1
