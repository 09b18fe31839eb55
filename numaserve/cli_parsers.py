"""The `numaserve` command line's parsers: every command's options and their help (numaserve/cli.py runs
them)."""

import argparse
import json
from pathlib import Path

from cluster_configs.engine_config import EngineConfig
from numaserve.simulate.command import add_arguments as add_simulate_arguments


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)" after each option's help, unless the help says its default itself (it must
    when the default is None: "None" would not say what happens)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if "default" in (action.help or "") or action.default is None:
            return action.help or ""
        return super()._get_help_string(action)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    for name, field in EngineConfig.model_fields.items():  # validated (and coerced) by EngineConfig
        flag = f"--{name.replace('_', '-')}"
        if name == "speculation":
            p.add_argument(flag, dest=name, metavar="JSON", type=json.loads,
                           help='speculative decoding, a JSON object of SpeculationConfig fields, e.g. '
                                '\'{"method": "ngram", "num_speculative_tokens": 4}\' (default: off)')
        else:
            p.add_argument(flag, dest=name, metavar="VALUE",
                           help=f"{field.description} (default: "  # None: EngineConfig's
                                f"{field.get_default(call_default_factory=True)})")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the likeliest tokens holding this "
                                                            "much probability")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens; 0 = all")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than min_p times the likeliest")
    p.add_argument("--seed", type=int, help="seed of the sampling draws (default: a fresh one each run)")
    p.add_argument("--stop", action="append", default=[], help="a string that ends the text; repeat for "
                                                               "several (default: none)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeating tokens")
    p.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token")


def positive(kind: type, fix: str):
    """An argparse type: a number of `kind` above 0 (else exit 2 saying `fix`)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}; {fix}") from None
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number above 0; {fix}")
        return value
    return parse


def add_calibrate_parser(sub) -> None:
    from models.quantization.calibration import CalibrationOptions

    defaults = CalibrationOptions()
    cal = sub.add_parser("calibrate", formatter_class=HelpFormatter,
                         help="measure int8 activation ranges and errors per matrix; writes the calibration "
                              "file the engine reads beside MODEL")
    cal.add_argument("model", help="model directory or .gguf file")
    cal.add_argument("--text", help="UTF-8 text to calibrate on (default: the demo model card's held-out "
                                    "set, the Python standard library files it never trained on)")
    cal.add_argument("--method", help=f"minmax | percentile | kl (default {defaults.method})")
    cal.add_argument("--percentile", type=float, help=f"of |x|, for --method percentile (default "
                                                      f"{defaults.percentile:g})")
    cal.add_argument("--bound", type=float, help="relative int8 output error above which a matrix keeps "
                                                 f"float32 activations (default {defaults.bound:g})")
    cal.add_argument("--weight-dtype", help="q8_0 | q4_0 | ... (default: a GGUF file's own types, q8_0 for a "
                                            "directory; with --imatrix float32, as llama-imatrix is run on "
                                            "F32 / F16 / Q8_0 weights)")
    cal.add_argument("--kv-dtype", help="KV dtype to recommend per-layer overrides for: the layers whose "
                                        "attention errs most with it are kept wider (default "
                                        f"{defaults.kv_dtype})")
    cal.add_argument("--imatrix", metavar="OUT",
                     help="write the model's importance matrix to OUT instead, in llama.cpp's format (GGUF; "
                          "the legacy format for OUT ending in .dat), for weight_dtype quantizing with "
                          "imatrix= and for llama-quantize --imatrix (default: none, the calibration file)")
    cal.add_argument("--chunk", type=int, help="with --imatrix: tokens per chunk (default 512, at most the "
                                               "model's context; llama-imatrix's -c)")
    cal.add_argument("--process-output", action="store_true",
                     help="with --imatrix: record the LM head's input too (llama-imatrix --process-output; "
                          "default: off)")


def add_serve_parser(sub) -> argparse.ArgumentParser:
    from http_api.tool_parsers import TOOL_PARSERS

    serve = sub.add_parser("serve", formatter_class=HelpFormatter,
                           help="run a deployment on the Ray cluster (starting a local instance if none "
                                "runs), with an OpenAI-compatible HTTP API when given --http-port, in the "
                                "foreground until Ctrl-C / SIGTERM (or --detach)")
    serve.add_argument("--config",
                       default=str(Path(__file__).parent.parent / "cluster_configs" / "local.yaml"),
                       help="ClusterConfig YAML (default: cluster_configs/local.yaml)")
    serve.add_argument("--model", help="model directory or GGUF file (default: the config's model)")
    serve.add_argument("--http-port", type=int,
                       help="serve the OpenAI-compatible API (/v1/completions, /v1/chat/completions, "
                            "/v1/models, /health, /metrics) on this port (default: the config's http.port; "
                            "none: no HTTP server)")
    serve.add_argument("--http-host", help="address the HTTP server binds, e.g. 0.0.0.0 for every interface "
                                           "(default: the config's http.host, else 127.0.0.1: loopback only)")
    serve.add_argument("--api-key", action="append", default=[],
                       help="require this key as 'Authorization: Bearer <key>' on /v1 routes; repeat for "
                            "several tenants (each key gets its own prefix-cache salt)")
    serve.add_argument("--max-prompt-tokens", type=int,
                       help="refuse longer prompts with a 400 (default: the config's http.max_prompt_tokens, "
                            "else max_model_len)")
    serve.add_argument("--max-tokens-cap", type=int, help="refuse a larger max_tokens with a 400 (default: "
                                                           "the config's http.max_tokens_cap, 4096)")
    serve.add_argument("--max-concurrent-per-client", type=int,
                       help="open requests one client (API key, else user, else address) may have before 429 "
                            "(default: the config's http.max_concurrent_per_client, 64)")
    serve.add_argument("--default-deadline-s", type=float,
                       help="seconds a request may take when it sets no deadline_s; then it is aborted "
                            "(default: the config's http.default_deadline_s, 600)")
    serve.add_argument("--allowed-origins", nargs="+",
                       help="browser origins (e.g. https://app.example, or *) that CORS lets call the API; "
                            "vLLM's JSON list '[\"*\"]' works too (default: the config's "
                            "http.allowed_origins, none: no CORS)")
    serve.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS),
                       help="how tool_choice \"auto\" finds tool calls in the model's text: hermes "
                            "(<tool_call>{json}</tool_call>: Hermes, Qwen, the demo model) or llama3_json "
                            "(default: the config's http.tool_call_parser, none: \"auto\" is a 400)")
    serve.add_argument("--pooling", choices=("last", "mean"),
                       help="/v1/embeddings: pool an input's final hidden states as its last token's or "
                            "their mean (default: the config's http.pooling, last)")
    serve.add_argument("--no-ui", action="store_true",
                       help="serve no web console at / (chat and a live view of the workers; default: "
                            "served, its data behind the API key when one is set)")
    serve.add_argument("--served-model-name", help="the name requests give as `model` (default: the config's "
                                                   "http.served_model_name, else the model folder's name)")
    serve.add_argument("--detach", action="store_true",
                       help="start the deployment and return; it runs on (in a Ray instance started with "
                            "`ray start` if none runs) until `numaserve shutdown`")
    serve.add_argument("--drain-timeout-s", type=positive(float, "give seconds above 0, e.g. 30"),
                       default=30.0,
                       help="on Ctrl-C / SIGTERM (not --detach): seconds the requests in flight may take to "
                            "finish, while new ones get 503; then they are aborted")
    return serve


def add_stats_parser(sub) -> argparse.ArgumentParser:
    stats = sub.add_parser("stats", formatter_class=HelpFormatter,
                           help="print a deployment's workers, routing, policy and decisions as JSON, or "
                                "with --watch a live table per worker")
    stats.add_argument("--watch", action="store_true",
                       help="a table per worker (NUMA node, cores, running / waiting, tokens/s, KV use, "
                            "prefix hit rate, speculation acceptance, adapters held), refreshed in place "
                            "until Ctrl-C")
    stats.add_argument("--interval", type=positive(float, "give --interval seconds above 0, e.g. 1"),
                       default=1.0, help="with --watch: seconds between refreshes")
    stats.add_argument("--count",
                       type=positive(int, "give --count a whole number of refreshes above 0, e.g. 10"),
                       help="with --watch: stop after this many refreshes (default: until Ctrl-C)")
    return stats


def add_cluster_parsers(sub) -> None:
    """serve, stats and shutdown: a deployment on the Ray cluster."""
    serve, stats = add_serve_parser(sub), add_stats_parser(sub)
    shutdown = sub.add_parser("shutdown", formatter_class=HelpFormatter,
                              help="stop every actor of a detached deployment, and the Ray instance if it "
                                   "started one")
    for p in (serve, stats, shutdown):
        p.add_argument("--name", default="numaserve", help="deployment name")
    for p in (serve, stats, shutdown):
        p.add_argument("--address", help="the Ray cluster's host:port, checked within 2 s (default: "
                                         "RAY_ADDRESS, else the cluster `ray start` recorded if it answers, "
                                         "else for serve a new local instance); `local` always starts one")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="numaserve", description="CPU-native LLM serving",
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", formatter_class=HelpFormatter,
                         help="stream a completion of PROMPT from MODEL_DIR in this process (no Ray)")
    gen.add_argument("model_dir", help="model directory (Hugging Face safetensors) or GGUF file")
    gen.add_argument("prompt", help="the text to complete")
    add_sampling_args(gen)
    add_engine_args(gen)
    demo = sub.add_parser("demo", formatter_class=HelpFormatter,
                          help="serve the shipped demo model and its adapters, with and without speculation")
    demo.add_argument("--max-tokens", type=int, default=48, help="tokens to generate per prompt")
    add_calibrate_parser(sub)
    add_cluster_parsers(sub)
    simulate = sub.add_parser("simulate", formatter_class=HelpFormatter,
                              help="simulate a deployment at scale for capacity planning (the real routing, "
                                   "batching and admission code against modelled workers): figures as JSON")
    add_simulate_arguments(simulate)
    sub.add_parser("bench", formatter_class=HelpFormatter,
                   help="decode/prefill benchmark against llama.cpp; `numaserve bench --help` for its "
                        "options")
    return parser
