"""client.session() (actors/client_session.py): a conversation pinned to one worker prefills only each new
turn there, and every turn's tokens equal ns.LLM's fresh generate over the whole history: after fork and
reset, and when its worker is killed between turns or mid-turn (the turn moves to another worker, which
builds the sequence from the history the client holds). Closing the session frees the worker's blocks."""

import gc
import threading

import pytest
import ray

import numaserve as ns
from tests.cluster.conftest import paused, queued, sim_config, wait_for, wait_for_restart, worker_pid
from tests.conftest import random_prompt

NAME = "sessions"
FP32 = {"weight_dtype": "float32", "kv_dtype": "float32"}
GREEDY = ns.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
SEEDED = ns.SamplingParams(max_tokens=6, temperature=0.9, seed=3, ignore_eos=True)
LONG_SEEDED = ns.SamplingParams(max_tokens=24, temperature=0.9, seed=5, ignore_eos=True)
TURNS = [random_prompt(n, seed=500 + i) for i, n in enumerate((20, 7, 13, 5))]


@pytest.fixture(scope="module")
def client(ray_cluster, llama_dir):
    client = ns.serve(sim_config("two_numa_sim", stream_interval_ms=0, engine=FP32), model=llama_dir,
                      name=NAME)
    yield client
    client.shutdown()


@pytest.fixture(scope="module")
def fresh(llama_dir):
    """tokens(history, params): a fresh generate's output over the whole history, no cache involved."""
    llm = ns.LLM(llama_dir, **FP32, enable_prefix_caching=False)
    yield lambda history, params=GREEDY: llm.generate(history, params)[0].token_ids
    llm.close()


def worker_stats(client, worker_id: str) -> dict:
    return client.stats()["workers"][worker_id]


def prefilled(client, session, turn) -> tuple[list[int], int]:
    """turn() -> (its tokens, the prompt tokens the session's worker, after it, prefilled for it)."""
    before = {w: stats.get("num_prefill_tokens") for w, stats in client.stats()["workers"].items()}
    tokens = turn().token_ids
    return tokens, worker_stats(client, session.worker_id)["num_prefill_tokens"] - before[session.worker_id]


def kill(client, worker_id: str) -> int:
    """Kill the worker (Ray restarts it); -> its old pid."""
    pid = worker_pid(client, worker_id)
    ray.kill(ray.get_actor(f"{NAME}.worker.{worker_id}", namespace="numaserve"), no_restart=False)
    return pid


def test_four_turns_prefill_only_each_new_turn_and_equal_fresh_generates(client, fresh):
    with client.session() as session:
        seq = session.sequence()
        history = []
        for i, turn in enumerate(TURNS):
            history += turn
            tokens, num_prefilled = prefilled(client, session, lambda turn=turn: seq.generate(turn, GREEDY))
            # the new input and the last turn's last token (sampled, never fed), nothing earlier
            assert num_prefilled == len(turn) + (1 if i else 0)
            assert tokens == fresh(history)
            history += tokens
        assert seq.token_ids == history
        with pytest.raises(ns.InvalidRequest, match="prompt_logprobs"):
            seq.generate(TURNS[0], GREEDY.model_copy(update={"prompt_logprobs": 1}))


def test_fork_and_reset_equal_their_fresh_equivalents_and_close_frees_the_workers_blocks(client, fresh):
    session = client.session()
    seq = session.sequence()
    seq.generate(TURNS[0] + TURNS[2], GREEDY)  # 33 + 6 tokens: 2 full blocks of 16 and a partial one
    history = seq.token_ids
    branch = seq.fork()
    a, num_a = prefilled(client, session, lambda: seq.generate(TURNS[1], GREEDY))
    b, num_b = prefilled(client, session, lambda: branch.generate(TURNS[3], GREEDY))
    assert a == fresh(history + TURNS[1]) and b == fresh(history + TURNS[3])
    assert num_a == len(TURNS[1]) + 1
    assert num_b == len(history) - 32 + len(TURNS[3])  # the 2 shared blocks not recomputed
    seq.reset()
    assert seq.token_ids == [] and seq.generate(TURNS[1], SEEDED).token_ids == fresh(TURNS[1], SEEDED)
    assert worker_stats(client, session.worker_id)["num_pinned_blocks"] > 0
    session.close()
    stats = worker_stats(client, session.worker_id)
    assert stats["num_pinned_blocks"] == 0 and stats["num_session_sequences"] == 0
    with pytest.raises(ns.EngineClosed, match="session is closed"):
        branch.generate(TURNS[2], GREEDY)
    session.close()  # again: nothing to do


def test_a_session_dropped_without_close_frees_its_sequences_when_collected(client):
    dropped = client.session()
    dropped.sequence().generate(TURNS[0], GREEDY)
    worker_id = dropped.worker_id
    assert worker_stats(client, worker_id)["num_session_sequences"] == 1
    del dropped
    gc.collect()  # (a session and its sequences refer to each other)
    stats = worker_stats(client, worker_id)
    assert stats["num_session_sequences"] == 0 and stats["num_pinned_blocks"] == 0


def test_a_worker_killed_between_turns_the_conversation_goes_on_with_equal_tokens(client, fresh):
    with client.session() as session:
        seq = session.sequence()
        history = TURNS[0] + seq.generate(TURNS[0], SEEDED).token_ids
        killed = session.worker_id
        old_pid = kill(client, killed)
        history += TURNS[1]
        # the router places it on the other worker, or Ray on the restarted one: either builds it from history
        assert seq.generate(TURNS[1], SEEDED).token_ids == fresh(history, SEEDED)
        history += fresh(history, SEEDED) + TURNS[2]
        tokens, num_prefilled = prefilled(client, session, lambda: seq.generate(TURNS[2], SEEDED))
        assert tokens == fresh(history, SEEDED) and num_prefilled == len(TURNS[2]) + 1  # live KV again
    wait_for_restart(client, killed, old_pid)


def test_a_worker_killed_mid_turn_the_turn_resumes_on_another_with_equal_tokens(client, fresh):
    with client.session() as session:
        seq = session.sequence()
        history = TURNS[0] + seq.generate(TURNS[0], GREEDY).token_ids + TURNS[1]
        pinned = session.worker_id
        chunks, first = [], threading.Event()

        def read():
            for chunk in seq.stream(TURNS[1], LONG_SEEDED):
                chunks.append(chunk)
                first.set()

        with paused(client, [pinned]):
            reader = threading.Thread(target=read)
            reader.start()
            wait_for(lambda: queued(client) == 1, 30, "the turn to reach its worker")
            worker = ray.get_actor(f"{NAME}.worker.{pinned}", namespace="numaserve")
            for _ in range(64):  # step by step (a chunked prefill takes several) to its first token
                ray.get(worker.advance.remote(1))
                if first.wait(1):
                    break
            assert first.is_set()
            old_pid = kill(client, pinned)  # its first token streamed, the rest not
        reader.join(120)
        tokens = [t for chunk in chunks for t in chunk.token_ids]
        assert tokens == fresh(history, LONG_SEEDED) and chunks[-1].finish_reason == "length"
        assert session.worker_id != pinned  # moved with the turn
        history += tokens + TURNS[2]
        tokens, num_prefilled = prefilled(client, session, lambda: seq.generate(TURNS[2], GREEDY))
        assert tokens == fresh(history) and num_prefilled == len(TURNS[2]) + 1
    wait_for_restart(client, pinned, old_pid)
