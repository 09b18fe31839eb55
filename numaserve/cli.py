"""The `numaserve` command line."""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from cluster_configs.engine_config import EngineConfig
from cluster_configs.errors import NumaserveError
from cluster_configs.sampling_params import SamplingParams


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)" after each option's help, unless the help says its default itself (it must
    when the default is None: "None" would not say what happens)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if "default" in (action.help or "") or action.default is None:
            return action.help or ""
        return super()._get_help_string(action)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
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


def _engine_fields(args) -> dict:
    return {name: getattr(args, name) for name in EngineConfig.model_fields
            if getattr(args, name) is not None}


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
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


def _sampling(args) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=tuple(args.stop),
                          repetition_penalty=args.repetition_penalty, ignore_eos=args.ignore_eos)


def cmd_generate(args) -> None:
    from numaserve.llm import LLM

    params = _sampling(args)
    llm = LLM(args.model_dir, **_engine_fields(args))
    start = time.perf_counter()
    for delta in llm.stream(args.prompt, params):
        print(delta, end="", flush=True)
    print(f"\n[{time.perf_counter() - start:.2f} s]", file=sys.stderr)


def cmd_demo(args) -> None:
    from numaserve.demo import run_demo

    run_demo(max_tokens=args.max_tokens)


def cmd_serve(args) -> None:
    from actors import deploy

    config = deploy.with_http(deploy.load_config(args.config, args.model), port=args.http_port,
                              host=args.http_host, served_model_name=args.served_model_name)
    limits = {field: value for field, value in (
        ("api_keys", tuple(args.api_key) or None), ("max_prompt_tokens", args.max_prompt_tokens),
        ("max_tokens_cap", args.max_tokens_cap),
        ("max_concurrent_per_client", args.max_concurrent_per_client),
        ("default_deadline_s", args.default_deadline_s), ("allowed_origins", _origins(args.allowed_origins)),
        ("tool_call_parser", args.tool_call_parser), ("pooling", args.pooling)) if value is not None}
    if limits:
        if config.http is None:
            flags = ", ".join("--api-key" if f == "api_keys" else "--" + f.replace("_", "-") for f in limits)
            raise SystemExit(f"{flags}: these are the HTTP server's; pass --http-port too")
        from cluster_configs.cluster_config import ClusterConfig
        config = ClusterConfig.model_validate(config.model_dump()
                                              | {"http": config.http.model_dump() | limits})
    if not args.detach:
        from numaserve.foreground import serve_foreground

        serve_foreground(config, args.name, args.address, args.drain_timeout_s,
                         lambda client: _announce(args.name, config, client))
        return
    from actors import ray_instance

    started = deploy.init_ray(config, persistent=True, address=args.address)  # `ray start --head` if none
    try:
        client = deploy.serve(config, name=args.name)
    except BaseException:
        if started:
            ray_instance.stop_session(ray_instance.current_session())
        raise
    if started:
        ray_instance.record_started(args.name)  # `numaserve shutdown` stops it too
    _announce(args.name, config, client)
    print(f"detached; stop with `numaserve shutdown --name {args.name}`"
          + (" (it stops the Ray instance started here too)" if started else ""))


def _announce(name: str, config, client) -> None:
    stats = client.stats()
    print(f"numaserve: {name!r} serves {config.model} with {len(stats['workers'])} workers")
    for worker_id, w in stats["workers"].items():
        info = w.get("info", {})
        print(f"  {worker_id}: cores {info.get('cpu_ids')}, {info.get('num_threads')} threads, "
              f"memory {info.get('memory_policy')}")
    if client.http_url is not None:
        print(f"OpenAI-compatible API at {client.http_url}/v1 (metrics at {client.http_url}/metrics)")
    print(f"connect with numaserve.connect({name!r})", flush=True)


def _origins(values: list[str] | None) -> tuple[str, ...] | None:
    """--allowed-origins as given: origins, or one JSON list of them (vLLM's form)."""
    if values and len(values) == 1 and values[0].startswith("["):
        return tuple(json.loads(values[0]))
    return tuple(values) if values else None


def cmd_stats(args) -> None:
    from actors import deploy

    client = deploy.connect(args.name, args.address)
    if args.watch:
        from numaserve.stats_watch import watch

        try:
            watch(client.stats, args.interval, args.count)
        except KeyboardInterrupt:
            pass
        return
    print(json.dumps(client.stats(), indent=2, default=str))


def _positive(kind: type, fix: str):
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


def cmd_shutdown(args) -> None:
    from actors import deploy, deployment_actors, ray_instance

    deploy.connect(args.name, args.address).shutdown()
    session = ray_instance.started_session(args.name)
    others = deployment_actors.deployment_names()  # they use that instance too
    if session is None or others:
        print(f"numaserve: {args.name!r} shut down" + (
            f"; the Ray instance it started runs on for {', '.join(others)}" if session and others else ""))
        return
    num_processes = ray_instance.stop_session(session)
    print(f"numaserve: {args.name!r} shut down, and the Ray instance it started ({num_processes} processes)")


def cmd_calibrate(args) -> None:
    from models.quantization.calibrate import calibrate, read_text_file
    from models.quantization.calibration import CalibrationOptions, save_calibration

    options = CalibrationOptions(**{k: getattr(args, k)
                                    for k in ("method", "percentile", "bound", "weight_dtype", "kv_dtype")
                                    if getattr(args, k) is not None})  # validated before the model loads
    if args.text is None:
        from numaserve.demo_corpus import heldout_texts

        texts = heldout_texts()
        label = f"the demo model card's held-out set ({len(texts)} standard-library files)"
    else:
        texts, label = [read_text_file(args.text)], str(args.text)
    start = time.perf_counter()
    calibration = calibrate(args.model, texts, label, options)
    path = save_calibration(calibration, args.model)
    errors = [(m.error_dynamic, m.error_static) for m in calibration.matrices.values()
              if m.error_dynamic is not None]
    print(f"numaserve: calibrated {args.model} ({calibration.weight_dtype} weights) on "
          f"{calibration.num_tokens} tokens of {label} in {time.perf_counter() - start:.1f} s: "
          f"{calibration.method} scales")
    if errors:
        print(f"  relative int8 output error: dynamic scales max {max(e[0] for e in errors):.4f}, static "
              f"scales max {max(e[1] for e in errors):.4f}; bound {calibration.bound:g}")
    else:
        print("  no q8_0 / q4_0 matrices: int8 activations will not run with "
              f"{calibration.weight_dtype} weights")
    fallbacks = calibration.fallback_names
    print(f"  float32 activations for {len(fallbacks)} matrices"
          + (f": {', '.join(fallbacks)}" if fallbacks else ""))
    kv = calibration.kv
    print(f"  attention output error per layer, each KV dtype against bfloat16 KV, {kv.num_tokens} tokens:")
    for kv_dtype, layer_errors in kv.errors.items():
        print(f"    {kv_dtype:<14} " + " ".join(f"{e:.4f}" for e in layer_errors))
    print(f"  layers to keep wider with kv_dtype={kv.kv_dtype!r}: kv_dtype_overrides={kv.kv_dtype_overrides}")
    print(f"wrote {path}; the engine reads it when it loads {args.model}")


def _add_calibrate_parser(sub) -> None:
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
                                            "directory)")
    cal.add_argument("--kv-dtype", help="KV dtype to recommend per-layer overrides for: the layers whose "
                                        "attention errs most with it are kept wider (default "
                                        f"{defaults.kv_dtype})")
    cal.set_defaults(func=cmd_calibrate)


def _add_cluster_parsers(sub) -> None:
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
    serve.add_argument("--served-model-name", help="the name requests give as `model` (default: the config's "
                                                   "http.served_model_name, else the model folder's name)")
    serve.add_argument("--detach", action="store_true",
                       help="start the deployment and return; it runs on (in a Ray instance started with "
                            "`ray start` if none runs) until `numaserve shutdown`")
    serve.add_argument("--drain-timeout-s", type=_positive(float, "give seconds above 0, e.g. 30"),
                       default=30.0,
                       help="on Ctrl-C / SIGTERM (not --detach): seconds the requests in flight may take to "
                            "finish, while new ones get 503; then they are aborted")
    serve.set_defaults(func=cmd_serve)
    stats = sub.add_parser("stats", formatter_class=HelpFormatter,
                           help="print a deployment's workers, routing, policy and decisions as JSON, or "
                                "with --watch a live table per worker")
    stats.add_argument("--watch", action="store_true",
                       help="a table per worker (NUMA node, cores, running / waiting, tokens/s, KV use, "
                            "prefix hit rate, speculation acceptance, adapters held), refreshed in place "
                            "until Ctrl-C")
    stats.add_argument("--interval", type=_positive(float, "give --interval seconds above 0, e.g. 1"),
                       default=1.0, help="with --watch: seconds between refreshes")
    stats.add_argument("--count",
                       type=_positive(int, "give --count a whole number of refreshes above 0, e.g. 10"),
                       help="with --watch: stop after this many refreshes (default: until Ctrl-C)")
    stats.set_defaults(func=cmd_stats)
    shutdown = sub.add_parser("shutdown", formatter_class=HelpFormatter,
                              help="stop every actor of a detached deployment, and the Ray instance if it "
                                   "started one")
    shutdown.set_defaults(func=cmd_shutdown)
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
    _add_sampling_args(gen)
    _add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)
    demo = sub.add_parser("demo", formatter_class=HelpFormatter,
                          help="serve the shipped demo model and its adapters, with and without speculation")
    demo.add_argument("--max-tokens", type=int, default=48, help="tokens to generate per prompt")
    demo.set_defaults(func=cmd_demo)
    _add_calibrate_parser(sub)
    _add_cluster_parsers(sub)
    sub.add_parser("bench", formatter_class=HelpFormatter,
                   help="decode/prefill benchmark against llama.cpp; `numaserve bench --help` for its "
                        "options")
    return parser


def run_bench(argv: list[str]) -> int:
    """`numaserve bench`: the decode benchmark of a source checkout (benchmarks/ is a dev tree, not
    installed), run as `python -m benchmarks.bench_decode` from the checkout this package runs from."""
    checkout = Path(__file__).resolve().parents[1]
    if not (checkout / "benchmarks" / "bench_decode.py").is_file():
        print("numaserve: error: `numaserve bench` runs the benchmarks of a source checkout; install "
              "numaserve from a clone (pip install -e .) and run it there, or run python -m "
              "benchmarks.bench_decode in the clone", file=sys.stderr)
        return 2
    bench = [sys.executable, "-m", "benchmarks.bench_decode", *argv]
    return subprocess.run(bench, cwd=checkout, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # its own parser: every option passes through
        return run_bench(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "stats" and not args.watch and (
            args.count is not None or any(a.startswith("--interval") for a in argv)):
        parser.error("--count and --interval apply to the live table: add --watch")  # exits 2
    try:
        args.func(args)
    except (NumaserveError, ValueError) as e:  # pydantic's ValidationError is a ValueError
        print(f"numaserve: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
