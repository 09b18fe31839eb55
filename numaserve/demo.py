"""`numaserve demo`: the local deployment with the shipped demo model, its two LoRA adapters and its draft.

Starts Ray and one worker per NUMA node (auto topology), streams a completion of the same prompts from
the base model and from each adapter, asks for one completion constrained to a JSON Schema and one tool call
(the demo chat template shows the tool; its arguments are constrained by the tool's schema), then decodes a
few prompts greedily without speculation, with n-gram prompt lookup and with the shipped draft model (one
deployment each, started in turn), prints acceptance and tokens/s of each and whether the text matches, and
shuts everything down.
"""

import tempfile
import time
from pathlib import Path

from cluster_configs.errors import CheckpointError
from cluster_configs.sampling_params import SamplingParams
from cluster_configs.structured_outputs import StructuredOutputs

DEMO_DIR = Path(__file__).parent / "assets" / "demo"
ADAPTERS = ("tests", "library")  # trained on the standard library's test modules / its other modules
PROMPTS = ("def test_", "class Stack:\n    def __init__(self")
# seeded sampling, the same seed for every adapter: greedy decoding of a 7M-parameter model loops on a
# phrase ("from_from_from"), while sampled text shows what each adapter learned
SAMPLING = {"temperature": 0.6, "top_p": 0.9, "seed": 0}
WARM_UP_PROMPT = "import os\n"  # shares no prefix-cache block with PROMPTS
# speculation is shown greedy, so the text with and without it must match token for token; the first
# prompt asks to restate a function (copy-heavy: n-gram lookup pays), the second is plain continuation
SPEC_PROMPTS = (
    ("def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
    "    return total / len(values)\n\n\n# The same function again, with a docstring:\ndef mean(values):"),
    "import os\n\n\ndef read_config(path):",
)
SPEC_DEPTH = 4
# a structured output: the model writes Python, so the JSON it is held to describes a function
FUNCTION_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "args", "returns"],
                   "properties": {"name": {"type": "string", "pattern": "^[a-z_]{1,16}$"},
                                  "args": {"type": "array", "maxItems": 3,
                                           "items": {"type": "string", "pattern": "^[a-z]{1,8}$"}},
                                  "returns": {"enum": ["int", "str", "bool", "None"]}}}
RUN_TESTS = {"type": "function", "function": {
    "name": "run_tests", "description": "Run one test module of the standard library.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["module", "verbose"],
                   "properties": {"module": {"type": "string", "pattern": "^test_[a-z_]{1,16}$"},
                                  "verbose": {"type": "boolean"}}}}}
TOOL_MESSAGES = [{"role": "user", "content": "Run the tests of the os module."}]
SPECULATION = {"n-gram": {"method": "ngram", "num_speculative_tokens": SPEC_DEPTH, "mode": "on"},
               "draft model": {"method": "draft", "num_speculative_tokens": SPEC_DEPTH, "mode": "on",
                               "draft_model": str(DEMO_DIR / "draft")}}


def run_demo(max_tokens: int = 48, speculation: bool = True) -> dict:
    import ray

    from actors.deploy import serve
    from cluster_configs.cluster_config import ClusterConfig

    model_dir = DEMO_DIR / "base"
    if not (model_dir / "config.json").exists():
        raise CheckpointError(f"{model_dir}: the demo model is missing; reinstall numaserve or rebuild it "
                              "with python scripts/train_demo.py")
    start = time.perf_counter()
    # a registry of its own per run: a persistent one would tie the names to the first checkout that ran it
    registry_dir = tempfile.TemporaryDirectory(prefix="numaserve-demo-")
    config = ClusterConfig(adapter_registry=str(Path(registry_dir.name) / "adapters.json"))
    client = serve(config, model=model_dir, name="numaserve-demo")
    try:
        for name in ADAPTERS:
            client.register_adapter(name, DEMO_DIR / "adapters" / name)
        workers = client.stats()["workers"]
        print(f"deployment up in {time.perf_counter() - start:.1f} s: " + ", ".join(
            f"{w} on cores {s['info']['cpu_ids']} ({s['info']['num_threads']} threads)"
            for w, s in workers.items()))
        summary = _adapters(client, max_tokens)
        summary["structured"] = _structured_and_tool_call(client, model_dir)
        if speculation:
            baseline = _greedy(client, max_tokens)
            num_threads = next(iter(workers.values()))["info"]["num_threads"]
            client.shutdown()
            client = None
            in_process = _in_process_greedy(config.engine, model_dir, max_tokens, num_threads)
            summary["speculation"] = _speculation(config, model_dir, max_tokens, baseline, in_process)
        return summary
    finally:
        if client is not None:
            client.shutdown()
        ray.shutdown()
        registry_dir.cleanup()


def _adapters(client, max_tokens: int) -> dict:
    # untimed: on a fresh install the first request of each adapter compiles its kernels (the sampled path,
    # LoRA), which the timed summary line would otherwise count
    for adapter in (None, *ADAPTERS):
        client.generate(WARM_UP_PROMPT, SamplingParams(max_tokens=2, **SAMPLING), adapter=adapter)
    num_tokens, seconds = 0, 0.0
    for prompt in PROMPTS:
        for adapter in (None, *ADAPTERS):
            params = SamplingParams(max_tokens=max_tokens, **SAMPLING)
            print(f"\n--- {adapter or 'base'} ---\n{prompt}", end="", flush=True)
            t = time.perf_counter()
            for chunk in client.stream(prompt, params, adapter=adapter):
                print(chunk.text, end="", flush=True)
                num_tokens += len(chunk.token_ids)
            seconds += time.perf_counter() - t
    stats = client.stats()
    engines = [w for w in stats["workers"].values() if "kv_usage" in w]
    summary = {"tokens": num_tokens, "tokens_per_s": num_tokens / seconds,
               "prefix_hit_rate": max(w["prefix_hit_rate"] for w in engines),
               "kv_bytes_per_token": engines[0]["kv_bytes_per_token"], "routed": stats["routed"]}
    print(f"\n\n--- summary ---\n{num_tokens} tokens streamed at {summary['tokens_per_s']:.1f} tokens/s "
          f"(one stream at a time), routing decisions {summary['routed']}, prefix-cache hit rate "
          f"{summary['prefix_hit_rate']:.0%}, {summary['kv_bytes_per_token']} KV bytes per token")
    return summary


def structured_request() -> tuple[str, SamplingParams]:
    return "# the function as JSON:\n", SamplingParams(max_tokens=96, structured_outputs=StructuredOutputs(
        json=FUNCTION_SCHEMA), **SAMPLING)


def tool_call_request(model_dir: Path):
    """The prompt ids of TOOL_MESSAGES with RUN_TESTS rendered by the model's chat template, the params that
    constrain the output to run_tests' arguments, and the parser that reads the call back: what
    /v1/chat/completions does for tool_choice {"type": "function", "function": {"name": "run_tests"}}."""
    from http_api.chat_template import load_chat_template
    from http_api.tool_calls import plan_tools
    from models.tokenizer import Tokenizer

    plan = plan_tools([RUN_TESTS], {"type": "function", "function": {"name": "run_tests"}}, True, None)
    text = load_chat_template(model_dir).render(TOOL_MESSAGES, tools=plan.tools)
    prompt_ids = Tokenizer.from_dir(model_dir).hf_tokenizer.encode(text, add_special_tokens=False).ids
    params = SamplingParams(max_tokens=64, structured_outputs=plan.constraint, **SAMPLING)
    return prompt_ids, params, plan.new_parser()


def _structured_and_tool_call(client, model_dir: Path) -> dict:
    prompt, params = structured_request()
    record = client.generate(prompt, params).text
    print(f"\n--- structured output (JSON Schema) ---\n{prompt}{record}")
    prompt_ids, params, parser = tool_call_request(model_dir)
    [call] = parser.parse(client.generate(prompt_ids, params).text, final=True).calls
    print(f"--- tool call ---\n{TOOL_MESSAGES[0]['content']} -> {call.name}({call.arguments})")
    return {"json": record, "tool_call": {"name": call.name, "arguments": call.arguments}}


def _greedy(client, max_tokens: int) -> dict:
    """Greedy completions of SPEC_PROMPTS, one stream at a time: texts, tokens/s and acceptance."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    client.generate(SPEC_PROMPTS[-1], params.model_copy(update={"max_tokens": 8}))  # warm-up, untimed
    before, _ = _spec_counts(client)
    texts, num_tokens, seconds = [], 0, 0.0
    for prompt in SPEC_PROMPTS:
        t = time.perf_counter()
        text = ""
        for chunk in client.stream(prompt, params):
            text += chunk.text
            num_tokens += len(chunk.token_ids)
        seconds += time.perf_counter() - t
        texts.append(text)
    after, reports = _spec_counts(client)
    verifications, drafted, accepted = (after[k] - before[k] for k in SPEC_COUNTS)
    return {"texts": texts, "tokens": num_tokens, "tokens_per_s": num_tokens / seconds,
            "reports_speculation": reports, "num_verifications": verifications, "num_draft_tokens": drafted,
            "num_accepted_tokens": accepted, "acceptance": accepted / drafted if drafted else None,
            "tokens_per_verification": 1 + accepted / verifications if verifications else None}


def _in_process_greedy(engine_config, model_dir: Path, max_tokens: int, num_threads: int) -> dict:
    """The greedy prompts of _greedy in this process's own engine (numaserve.LLM, no Ray, a worker's threads,
    the deployment shut down), one at a time: the single-stream rate the deployment's streams are held to."""
    from numaserve.llm import LLM

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with LLM(model_dir, **(engine_config.model_dump() | {"num_threads": num_threads})) as llm:
        llm.generate(SPEC_PROMPTS[-1], params.model_copy(update={"max_tokens": 8}))  # warm-up, untimed
        texts, num_tokens, seconds = [], 0, 0.0
        for prompt in SPEC_PROMPTS:
            t = time.perf_counter()
            completion = llm.generate(prompt, params)[0]
            seconds += time.perf_counter() - t
            texts.append(completion.text)
            num_tokens += len(completion.token_ids)
    return {"texts": texts, "tokens": num_tokens, "tokens_per_s": num_tokens / seconds}


SPEC_COUNTS = ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens")


def _spec_counts(client) -> tuple[dict[str, int], bool]:
    """The workers' speculation counters summed, and whether the engines report them at all."""
    engines = [w for w in client.stats()["workers"].values() if "kv_usage" in w]
    return ({k: sum(w.get(k, 0) for w in engines) for k in SPEC_COUNTS},
            any(SPEC_COUNTS[0] in w for w in engines))


def _speculation(config, model_dir: Path, max_tokens: int, baseline: dict, in_process: dict) -> dict:
    from actors.deploy import serve
    from cluster_configs.speculation_config import SpeculationConfig

    print(f"\n--- speculative decoding (greedy, depth {SPEC_DEPTH}, {len(SPEC_PROMPTS)} prompts, "
          f"{max_tokens} tokens each) ---\nfirst prompt, without speculation:\n{SPEC_PROMPTS[0]}"
          f"{baseline['texts'][0]}")
    rows = {"none": baseline}
    for label, spec in SPECULATION.items():
        engine = config.engine.model_copy(update={"speculation": SpeculationConfig(**spec)})
        client = serve(config.model_copy(update={"engine": engine}), model=model_dir, name="numaserve-demo")
        try:
            rows[label] = _greedy(client, max_tokens)
        finally:
            client.shutdown()
    base = baseline["tokens_per_s"]
    print(f"{'speculation':<12} {'tokens/s':>9} {'speed-up':>9} {'accepted/drafted':>17} "
          f"{'tokens/verify':>14}  same text")
    for label, row in rows.items():
        if label != "none" and not row["reports_speculation"]:
            print(f"{label:<12} {row['tokens_per_s']:9.1f} {row['tokens_per_s'] / base:8.2f}x "
                  "  (this engine build reports no speculation figures)")
            continue
        acceptance = "-" if row["acceptance"] is None else f"{row['acceptance']:.0%}"
        per_verify = row["tokens_per_verification"]
        per_verify = "-" if per_verify is None else f"{per_verify:.2f}"
        print(f"{label:<12} {row['tokens_per_s']:9.1f} {row['tokens_per_s'] / base:8.2f}x {acceptance:>17} "
              f"{per_verify:>14}  {'yes' if row['texts'] == baseline['texts'] else 'NO'}")
    print(f"{'in process':<12} {in_process['tokens_per_s']:9.1f} {in_process['tokens_per_s'] / base:8.2f}x "
          f"{'-':>17} {'-':>14}  {'yes' if in_process['texts'] == baseline['texts'] else 'NO'}")
    ratio = base / in_process["tokens_per_s"]
    print(f"(one stream at a time through Ray on a 7M-parameter model: per-step overheads, not weight reads, "
          f"bound it; without speculation the deployment streamed at {ratio:.2f}x "
          "the rate of the same engine in this process: numaserve.LLM, no Ray, the same prompts and "
          "threads; benchmarks/bench_speculation.py measures where speculation pays)")
    return {label: {k: v for k, v in row.items() if k != "texts"}
            | {"same_text": row["texts"] == baseline["texts"]} for label, row in rows.items()} | {
        "in_process": {"tokens": in_process["tokens"], "tokens_per_s": in_process["tokens_per_s"],
                       "same_text": in_process["texts"] == baseline["texts"]}}
