"""lm-evaluation-harness against the HTTP server: `--model local-completions` (here its registry entry, what
the CLI flag builds) runs tests/fixtures/lm_eval/numaserve_mc.yaml, a multiple-choice task over a local JSONL
file, through /v1/completions with echo and logprobs; each choice's loglikelihood equals LLM.score on the same
token ids (the sum of the continuation tokens' log-softmax), and its is_greedy too. Offline: the data set is
the local file, the tokenizer the model directory's. Needs `pip install "lm_eval[api]"`."""

from pathlib import Path

import lm_eval
import numpy as np

import numaserve as ns
from cluster_configs.cluster_config import HttpConfig
from tests.http_api.test_http_options import FP32, log_softmax, serve

ROOT = Path(__file__).resolve().parents[2]


def test_local_completions_loglikelihoods_equal_llm_score(llama_dir, monkeypatch):
    with ns.LLM(llama_dir, **FP32) as llm, serve(llm, HttpConfig()) as url:
        check_local_completions(url, "tiny", llm, llama_dir, monkeypatch)


def check_local_completions(url: str, model: str, llm: ns.LLM, tokenizer_dir, monkeypatch) -> None:
    """lm_eval's local-completions over the server at url: every choice's loglikelihood and is_greedy equal
    llm.score's (llm: the served model in process, with the server's engine config)."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(ROOT)  # the task's data_files
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    lm = get_model("local-completions")(model=model, base_url=f"{url}/v1/completions",
                                        tokenizer=str(tokenizer_dir), tokenizer_backend="huggingface",
                                        batch_size=4, max_retries=1)
    results = lm_eval.simple_evaluate(
        model=lm, tasks=["numaserve_mc"], log_samples=True,
        task_manager=TaskManager(include_path=str(ROOT / "tests/fixtures/lm_eval")))
    samples = results["samples"]["numaserve_mc"]
    assert len(samples) == 6 and sum(len(s["arguments"]) for s in samples) == 20
    for sample in samples:
        for (context, continuation), [(ll, greedy)] in zip(sample["arguments"], sample["resps"]):
            context_ids, continuation_ids = lm._encode_pair(context, continuation)
            ids = context_ids + continuation_ids
            reference = log_softmax(llm.score(ids))
            rows = [reference[p - 1] for p in range(len(context_ids), len(ids))]
            expected = sum(row[t] for row, t in zip(rows, continuation_ids))
            np.testing.assert_allclose(ll, expected, atol=1e-4, rtol=0)
            assert greedy == all(int(np.argmax(row)) == t for row, t in zip(rows, continuation_ids))
    assert 0.0 <= results["results"]["numaserve_mc"]["acc,none"] <= 1.0
