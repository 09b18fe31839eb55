"""A worker's session sequences by caller id (actors/worker_sequences.py): a turn whose history extends
what the worker holds goes on from its KV; one whose history differs (a turn aborted by its caller holds
tokens the caller never received) is built again, with the tokens of a fresh generate; free lets go of all."""

import numaserve as ns
from actors.worker_sequences import WorkerSequences
from tests.scheduling.test_sessions import FP32, GREEDY, TURNS


def run(engine, sequences: WorkerSequences, request_id: str, prompt: list[int], sequence_id: str):
    """One turn of sequence_id -> (its tokens, the prompt tokens prefilled for it)."""
    before = engine.stats()["num_prefill_tokens"]
    req = engine.make_request(request_id, prompt, GREEDY)
    sequences.attach(req, sequence_id)
    engine.submit(req)
    while engine.has_unfinished():
        engine.step()
    return req.output_token_ids, engine.stats()["num_prefill_tokens"] - before


def test_a_turn_continues_the_kv_its_history_extends_and_rebuilds_one_it_does_not(llama_dir):
    fresh = ns.LLM(llama_dir, **FP32, enable_prefix_caching=False)
    engine = ns.LLM(llama_dir, **FP32, enable_prefix_caching=False).engine
    sequences = WorkerSequences(engine.sessions)
    history = TURNS[0] + run(engine, sequences, "t0", TURNS[0], "s")[0] + TURNS[1]
    tokens, num_prefilled = run(engine, sequences, "t1", history, "s")
    assert tokens == fresh.generate(history, GREEDY)[0].token_ids and num_prefilled == len(TURNS[1]) + 1
    history += tokens[:-2] + TURNS[2]  # the caller received all but the last 2 tokens
    tokens, num_prefilled = run(engine, sequences, "t2", history, "s")
    assert tokens == fresh.generate(history, GREEDY)[0].token_ids and num_prefilled == len(history)
    sequences.fork("s", "f")
    assert engine.stats()["num_pinned_blocks"] > 0
    sequences.free(("s", "f", "never-seen"))
    assert engine.stats()["num_pinned_blocks"] == 0 and sequences.by_id == {}
