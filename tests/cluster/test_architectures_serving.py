"""The deployment (two_numa_sim.yaml: two workers, a router, a scheduler) serving families beyond Llama: a
dense one with every layer quirk of its own (Gemma 3) and a mixture of experts (Qwen3-MoE), from a Hugging
Face directory and from a GGUF file, give the in-process engine's greedy tokens, streamed concurrently."""

from concurrent.futures import ThreadPoolExecutor

import pytest

import numaserve as ns
from models.gguf.writer import convert_to_gguf
from tests.cluster.conftest import collect, reference_outputs, sim_config
from tests.conftest import random_prompt

GREEDY = ns.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PROMPTS = [random_prompt(n, seed=200 + n) for n in (3, 17, 40, 9, 25, 60)]


@pytest.mark.parametrize("variant, source", [("gemma3", "hf"), ("qwen3_moe", "gguf")])
def test_the_deployment_serves_the_family_as_the_in_process_engine(ray_cluster, model_dirs, variant, source,
                                                                   tmp_path):
    model = model_dirs[variant] if source == "hf" else convert_to_gguf(model_dirs[variant],
                                                                       tmp_path / f"{variant}.gguf", "q8_0")
    config = sim_config("two_numa_sim", engine={"weight_dtype": "q8_0" if source == "hf" else "auto",
                                                "max_num_seqs": 8})
    expected = [c.token_ids for c in reference_outputs(model, config, PROMPTS, GREEDY)]
    client = ns.serve(config, model=model, name=f"arch-{variant}")
    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda p: collect(client.stream(p, GREEDY))[0], PROMPTS))
        assert got == expected
        workers = client.stats()["workers"]
        assert len(workers) == 2 and all(w.get("alive") for w in workers.values())
    finally:
        client.shutdown()
