"""The prefix cache's disk tier (scheduling/disk_tier.py over memory/disk_blocks.py) through ns.LLM: a prompt
served again after a restart computes only its last partial block and equals a cold run; bad files are
ignored, counted and removed; salts and adapters never share a block; the bound holds; the step loop runs on
while a read is held."""

import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import numaserve as ns
from memory.disk_blocks import SUFFIX, BlockFiles
from tests.conftest import random_prompt
from tests.support.model_factory import build_model

PROMPT_LEN = 2000 + 5  # 125 full blocks of 16, then 5 tokens: all that a warm restart computes
GREEDY = ns.SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> Path:
    """A tiny llama that takes 4k positions."""
    d = tmp_path_factory.mktemp("long") / "llama"
    build_model(d, "llama", max_position_embeddings=4096)
    return d


@pytest.fixture(scope="module")
def other_model(tmp_path_factory) -> Path:
    """The same shapes and tokenizer, other weights."""
    d = tmp_path_factory.mktemp("other") / "llama"
    build_model(d, "llama", seed=1, max_position_embeddings=4096)
    return d


@pytest.fixture(scope="module")
def cold(long_model) -> dict:
    """Greedy outputs of engines without a disk tier, by prompt seed."""
    with ns.LLM(long_model) as llm:
        return {seed: llm.generate([random_prompt(PROMPT_LEN, seed)], GREEDY)[0].token_ids for seed in (0, 1)}


def serve(model: Path, cache: Path, seed: int = 0, **engine) -> tuple[list[int], dict]:
    """One greedy request in a fresh engine over the disk tier in cache -> (its tokens, the engine's stats
    after it, its writes flushed)."""
    with ns.LLM(model, prefix_cache_dir=str(cache), **engine) as llm:
        out = llm.generate([random_prompt(PROMPT_LEN, seed)], GREEDY)[0]
        assert llm.engine.disk.flush()
        stats = llm.stats()
    return out.token_ids, stats


def block_files(cache: Path) -> list[Path]:
    return sorted((cache / "kv").glob(f"*/*{SUFFIX}"))


def test_a_prompt_served_after_a_restart_computes_only_its_last_partial_block(long_model, cold, tmp_path):
    first, stats = serve(long_model, tmp_path)
    assert first == cold[0]
    assert stats["num_prefill_tokens"] == PROMPT_LEN and stats["disk_hit_blocks"] == 0
    assert len(block_files(tmp_path)) == stats["disk_written_blocks"] >= PROMPT_LEN // 16

    again, stats = serve(long_model, tmp_path)
    assert again == cold[0]
    assert stats["disk_hit_blocks"] == 125 and stats["num_prefill_tokens"] == 5
    assert stats["disk_rejected_blocks"] == 0 and stats["disk_written_blocks"] == 0  # nothing new to write


def test_bad_files_are_ignored_counted_and_removed(long_model, other_model, cold, tmp_path):
    serve(long_model, tmp_path)
    files = {p.name: p for p in block_files(tmp_path)}
    theirs = tmp_path / "theirs"
    serve(other_model, theirs)  # the same prompt's blocks: the same names, another model's KV
    names = [k.name + SUFFIX for k in disk_keys(long_model, tmp_path, random_prompt(PROMPT_LEN, 0))]
    assert set(names) <= set(files)

    victims = {10: "truncated", 40: "bit-flipped", 70: "foreign"}
    for i, how in victims.items():
        path = files[names[i]]
        data = bytearray(path.read_bytes())
        if how == "truncated":
            path.write_bytes(data[:len(data) // 2])
        elif how == "bit-flipped":
            data[len(data) // 2] ^= 0x10
            path.write_bytes(data)
        else:
            foreign = next(p for p in block_files(theirs) if p.name == names[i])
            shutil.copyfile(foreign, path)
    # each bad file stops the read at it: the prefix is taken up to it, the rest computed (and written anew)
    for i in sorted(victims):
        tokens, stats = serve(long_model, tmp_path)
        assert tokens == cold[0]
        assert stats["disk_rejected_blocks"] == 1 and stats["disk_hit_blocks"] == i
        assert stats["num_prefill_tokens"] == PROMPT_LEN - 16 * i
    tokens, stats = serve(long_model, tmp_path)
    assert tokens == cold[0] and stats["disk_hit_blocks"] == 125 and stats["disk_rejected_blocks"] == 0


def disk_keys(model: Path, cache: Path, prompt: list[int], **options) -> list:
    """The disk tier's keys of prompt's full blocks (but the last token), as an engine over cache makes
    them."""
    with ns.LLM(model, prefix_cache_dir=str(cache)) as llm:
        req = llm.engine.make_request("keys", prompt, **options)
        return [llm.engine.disk.key(h, parent, tokens, req.cache_extra)
                for h, parent, tokens in llm.engine.scheduler.kv.prefix_chain(req)]


def test_two_cache_salts_never_share_a_disk_block(long_model, cold, tmp_path):
    prompt = random_prompt(PROMPT_LEN, 0)
    with ns.LLM(long_model, prefix_cache_dir=str(tmp_path)) as llm:
        llm.generate([prompt], GREEDY, cache_salt="alice")
    alice = set(block_files(tmp_path))
    with ns.LLM(long_model, prefix_cache_dir=str(tmp_path)) as llm:
        out = llm.generate([prompt], GREEDY, cache_salt="bob")[0]
        stats = llm.stats()
    assert out.token_ids == cold[0]
    assert stats["disk_hit_blocks"] == 0 and stats["num_prefill_tokens"] == PROMPT_LEN
    assert len(set(block_files(tmp_path)) - alice) == len(alice) == 125  # bob's blocks are his own files
    with ns.LLM(long_model, prefix_cache_dir=str(tmp_path)) as llm:
        llm.generate([prompt], GREEDY, cache_salt="alice")
        assert llm.stats()["disk_hit_blocks"] == 125


def test_the_bound_holds_under_a_stream_of_unique_prefixes(long_model, tmp_path):
    bound = 1 << 20
    with ns.LLM(long_model, prefix_cache_dir=str(tmp_path), prefix_cache_disk_bytes=bound) as llm:
        disk = llm.engine.disk
        for seed in range(12):
            llm.generate([random_prompt(600, 100 + seed)], ns.SamplingParams(max_tokens=1))
            assert disk.flush()
            assert sum(p.stat().st_size for p in block_files(tmp_path)) <= bound
        stats = llm.stats()
        written = stats["disk_written_bytes"]
        assert written > 2 * bound  # the stream wrote more than the bound holds
        assert stats["disk_evicted_files"] > 0
        assert disk.files.scan()[0] == stats["disk_used_bytes"] <= bound  # the ledger counts what is there


def hold_reads(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Block-file reads wait until the first event is set; the second is set once one began."""
    held, reading = threading.Event(), threading.Event()
    original = BlockFiles.read_into

    def slow_read(self, key, parts):
        reading.set()
        assert held.wait(30)
        return original(self, key, parts)

    monkeypatch.setattr(BlockFiles, "read_into", slow_read)
    return held, reading


def test_the_step_loop_runs_on_while_a_read_is_held(long_model, cold, tmp_path, monkeypatch):
    serve(long_model, tmp_path)
    held, reading = hold_reads(monkeypatch)
    with ns.LLM(long_model, prefix_cache_dir=str(tmp_path)) as llm:
        waiting = llm.engine_loop.submit([llm.engine.make_request("held", random_prompt(PROMPT_LEN, 0),
                                                                  GREEDY)])
        assert reading.wait(30)
        other = llm.generate([random_prompt(40, 7)], ns.SamplingParams(max_tokens=20, ignore_eos=True))[0]
        try:
            assert len(other.token_ids) == 20  # served while the first request's prefix is still being read
            assert not waiting[0].request.finished and llm.engine.scheduler.kv.loading
        finally:
            held.set()
        assert waiting[0].wait().output_token_ids == cold[0]


CHILD = """
import sys
import numpy as np
import numaserve as ns
model, cache = sys.argv[1], sys.argv[2]
def random_prompt(n, seed):  # tests/conftest.py's, without importing torch
    return np.random.default_rng(seed).integers(3, 384, n).tolist()
with ns.LLM(model, prefix_cache_dir=cache) as llm:
    for seed in range(1000):
        llm.generate([random_prompt(PROMPT_LEN, 1000 + seed)], ns.SamplingParams(max_tokens=1))
        print(seed, flush=True)
"""


@pytest.mark.parametrize("delay_s", [0.0, 0.05, 0.2])
def test_a_writer_killed_mid_write_leaves_nothing_that_is_served(long_model, tmp_path, delay_s):
    """An engine writing a stream of prompts' blocks is killed (SIGKILL) at a point of its writes; an engine
    over the same folder then serves those prompts from what is there: equal to a cold run, and no file it
    finds fails a check (a write either ended as a whole file or left only a temp file, never read)."""
    script = f"PROMPT_LEN = {PROMPT_LEN}\n" + CHILD
    child = subprocess.Popen([sys.executable, "-c", script, str(long_model), str(tmp_path)],
                             stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    try:
        for _ in range(3):
            served = int(child.stdout.readline())
        time.sleep(delay_s)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    with ns.LLM(long_model) as llm:
        cold_outputs = [llm.generate([random_prompt(PROMPT_LEN, 1000 + s)], GREEDY)[0].token_ids
                        for s in range(served + 2)]
    with ns.LLM(long_model, prefix_cache_dir=str(tmp_path)) as llm:
        for s in range(served + 2):
            assert llm.generate([random_prompt(PROMPT_LEN, 1000 + s)], GREEDY)[0].token_ids == cold_outputs[s]
        stats = llm.stats()
        assert llm.engine.disk.flush()  # (its start's sweep came first)
    assert stats["disk_rejected_blocks"] == 0 and stats["disk_hit_blocks"] > 0
    assert not list((tmp_path / "kv").glob("*/.*.tmp"))  # the dead writer's temp files went at the start


def test_an_adapter_is_keyed_by_its_weights_not_its_name(long_model, tmp_path):
    """A block computed under adapter "x" is served again only to "x" with the same weights: the name given
    other weights in a new engine (or no adapter) reads nothing of it."""
    from tests.models.test_lora import make_adapter
    one = make_adapter(long_model, tmp_path / "one", seed=1)
    two = make_adapter(long_model, tmp_path / "two", seed=2)
    cache, prompt = tmp_path / "cache", random_prompt(PROMPT_LEN, 0)

    def run(adapter_dir, adapter="x") -> tuple[list[int], dict]:
        with ns.LLM(long_model, prefix_cache_dir=str(cache)) as llm:
            if adapter is not None:
                llm.register_adapter(adapter, adapter_dir)
            out = llm.generate([prompt], GREEDY, adapter=adapter)[0].token_ids
            return out, llm.stats()

    with ns.LLM(long_model) as llm:
        llm.register_adapter("x", two)
        cold_two = llm.generate([prompt], GREEDY, adapter="x")[0].token_ids
    first, stats = run(one)
    assert stats["disk_hit_blocks"] == 0
    again, stats = run(one)
    assert again == first and stats["disk_hit_blocks"] == 125
    tokens, stats = run(two)
    assert tokens == cold_two and stats["disk_hit_blocks"] == 0
    assert run(None, adapter=None)[1]["disk_hit_blocks"] == 0


def test_a_second_engine_on_the_machine_reads_the_first_ones_blocks(long_model, cold, tmp_path):
    with ns.LLM(long_model, prefix_cache_dir=str(tmp_path)) as first, \
            ns.LLM(long_model, prefix_cache_dir=str(tmp_path)) as second:
        assert first.generate([random_prompt(PROMPT_LEN, 1)], GREEDY)[0].token_ids == cold[1]
        assert first.engine.disk.flush()
        assert second.generate([random_prompt(PROMPT_LEN, 1)], GREEDY)[0].token_ids == cold[1]
        stats = second.stats()
    assert stats["disk_hit_blocks"] == 125 and stats["num_prefill_tokens"] == 5


def test_a_request_aborted_while_its_prefix_is_read_leaves_no_block_held(long_model, tmp_path, monkeypatch):
    serve(long_model, tmp_path)
    held, _ = hold_reads(monkeypatch)
    with ns.LLM(long_model, prefix_cache_dir=str(tmp_path)) as llm:
        pending = llm.engine_loop.submit([llm.engine.make_request("gone", random_prompt(PROMPT_LEN, 0),
                                                                  GREEDY)])
        while not llm.engine.scheduler.kv.loading:
            time.sleep(0.01)
        llm.engine_loop.abort("gone")
        assert pending[0].wait().finish_reason == "abort"
        held.set()
        deadline = time.monotonic() + 30
        while llm.stats()["num_used_blocks"] and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = llm.stats()
    assert stats["num_used_blocks"] == 0 and stats["disk_hit_blocks"] == 125  # read, then left to the pool


def test_a_folder_that_cannot_be_used_is_a_typed_error_naming_the_field(long_model, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(ValueError, match="prefix_cache_dir=.*cannot be used"):
        ns.LLM(long_model, prefix_cache_dir=str(blocker / "cache"))
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        ns.EngineConfig(prefix_cache_dir=str(tmp_path), enable_prefix_caching=False)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ns.EngineConfig(prefix_cache_dir=str(tmp_path), tensor_parallel_size=2)
