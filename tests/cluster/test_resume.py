"""Resuming a request on another engine from the tokens a lost worker had streamed changes nothing (no Ray
cluster needed)."""


import pytest

import numaserve as ns
from actors.resume import resume_request, resume_state
from scheduling.outputs import RequestOutput
from tests.conftest import random_prompt
from tests.scheduling.test_speculation import perturbed_copy, tiny_checkpoint

FP32 = {"weight_dtype": "float32", "kv_dtype": "float32"}


def run_outputs(engine, req) -> list[RequestOutput]:
    engine.submit(req)
    outputs = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step().outputs if o.request_id == req.request_id]
    return outputs


@pytest.mark.parametrize("params", [
    ns.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
    ns.SamplingParams(max_tokens=40, temperature=1.0, top_p=0.9, seed=7, frequency_penalty=0.8,
                      presence_penalty=0.3, repetition_penalty=1.2, ignore_eos=True),
    ns.SamplingParams(max_tokens=60, temperature=1.2, seed=3, stop=("e ", "qu"), ignore_eos=True, logprobs=2),
])
@pytest.mark.parametrize("prompt", ["Grüße aus Köln! 🙂", "The quick brown fox"])
def test_a_resumed_request_goes_on_exactly_as_the_undisturbed_one(llama_dir, params, prompt):
    engine = ns.LLM(llama_dir, **FP32).engine
    whole = engine.make_request("whole", prompt, params)
    outputs = run_outputs(engine, whole)
    prompt_ids = whole.token_ids[:whole.num_prompt_tokens]
    for cut in range(1, len(outputs)):  # the worker died after sending outputs[:cut]
        sent_ids = [t for o in outputs[:cut] for t in o.token_ids]
        sent_text = "".join(o.text for o in outputs[:cut])
        resume = resume_state(engine.tokenizer, prompt_ids, sent_ids, sent_text)
        left = params.model_copy(update={"max_tokens": params.max_tokens - len(sent_ids)})
        req = engine.make_request(f"resumed-{cut}", prompt_ids + sent_ids, left)
        resume_request(req, params, resume)
        rest = run_outputs(engine, req)
        assert sent_ids + [t for o in rest for t in o.token_ids] == whole.output_token_ids
        assert sent_text + "".join(o.text for o in rest) == whole.text
        assert rest[-1].finish_reason == whole.finish_reason
        if params.logprobs is not None:  # each output carries its own tokens' logprobs, resumed or not
            logprobs = [lp for o in outputs[:cut] + rest for lp in o.logprobs]
            assert [list(lp) for lp in logprobs] == [list(lp) for lp in whole.logprobs]
            assert [v for lp in logprobs for v in lp.values()] == pytest.approx(
                [v for lp in whole.logprobs for v in lp.values()], abs=1e-5)


@pytest.fixture(scope="module")
def draft_dir(llama_dir, tmp_path_factory):
    return perturbed_copy(llama_dir, tmp_path_factory.mktemp("draft"), scale=0.3)


SPEC = {"off": {"method": "off"}, "ngram": {"method": "ngram", "mode": "on", "prompt_lookup_min": 1},
        "draft": {"method": "draft", "mode": "on"}}
RESUMED_PARAMS = ns.SamplingParams(max_tokens=40, temperature=1.0, top_p=0.95, seed=11, ignore_eos=True)


def resume_on_a_fresh_engine(model_dir, spec: dict, whole, sent: list[RequestOutput]) -> list[int]:
    """The output tokens of whole when a new engine (another worker, which never saw the request) resumes it
    after the outputs sent."""
    params, prompt_ids = whole.params, whole.token_ids[:whole.num_prompt_tokens]
    sent_ids, sent_text = [t for o in sent for t in o.token_ids], "".join(o.text for o in sent)
    engine = ns.LLM(model_dir, **FP32, speculation=spec).engine
    left = params.model_copy(update={"max_tokens": params.max_tokens - len(sent_ids)})
    req = engine.make_request("resumed", prompt_ids + sent_ids, left)
    resume_request(req, params, resume_state(engine.tokenizer, prompt_ids, sent_ids, sent_text))
    return sent_ids + [t for o in run_outputs(engine, req) for t in o.token_ids]


@pytest.fixture(scope="module")
def vocab16_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("vocab16") / "target", seed=1)  # n-gram drafts pass here


@pytest.mark.parametrize("method", ["off", "ngram"])
def test_a_request_resumed_on_a_fresh_engine_continues_at_its_position(llama_dir, vocab16_dir, method):
    """Another worker knows nothing of the request's earlier draws: a seeded sampled request continues at its
    position, with n-gram speculation too (its verification realizes the plain sampler's keyed draws)."""
    model_dir, prompt = ((llama_dir, "The quick brown fox") if method == "off"
                         else (vocab16_dir, [3, 9, 4, 12, 7]))
    first = ns.LLM(model_dir, **FP32, speculation=SPEC[method]).engine
    whole = first.make_request("whole", prompt, RESUMED_PARAMS)
    outputs = run_outputs(first, whole)
    assert len(outputs) > 3
    if method == "ngram":
        stats = first.stats()
        assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"], stats
    for cut in (1, len(outputs) // 2, len(outputs) - 1):
        assert (resume_on_a_fresh_engine(model_dir, SPEC[method], whole, outputs[:cut])
                == whole.output_token_ids)


def test_a_request_resumed_with_a_draft_model_continues_with_the_same_tokens(llama_dir, draft_dir):
    """A draft model's sampled drafts race with the target's keyed clocks and only decide how many of the
    target's own draws a step makes: a resumed request, whose first step samples plainly, continues with the
    tokens of the undisturbed run."""
    spec = SPEC["draft"] | {"draft_model": str(draft_dir)}
    first = ns.LLM(llama_dir, **FP32, speculation=spec).engine
    whole = first.make_request("whole", "The quick brown fox", RESUMED_PARAMS)
    outputs = run_outputs(first, whole)
    stats = first.stats()
    # some drafts rejected
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"], stats
    for cut in (1, len(outputs) // 2):
        assert resume_on_a_fresh_engine(llama_dir, spec, whole, outputs[:cut]) == whole.output_token_ids


def test_a_resume_without_a_tokenizer_carries_no_text(llama_dir):
    resume = resume_state(None, random_prompt(5, seed=1), [7, 8], "")
    assert (resume.num_prompt_tokens, resume.text, resume.detokenizer) == (5, "", None)
