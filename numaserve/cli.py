"""The `numaserve` command line."""

import argparse
import json
import sys
import time
from pathlib import Path

from cluster_configs.engine_config import EngineConfig
from cluster_configs.errors import NumaserveError
from cluster_configs.sampling_params import SamplingParams


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    for name, field in EngineConfig.model_fields.items():  # validated (and coerced) by EngineConfig
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, metavar="VALUE", help=field.description)


def _engine_fields(args) -> dict:
    return {name: getattr(args, name) for name in EngineConfig.model_fields if getattr(args, name) is not None}


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--ignore-eos", action="store_true")


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

    config = deploy.load_config(args.config, args.model)
    deploy.init_ray(config, persistent=True)  # starts `ray start --head` if no cluster is running
    stats = deploy.serve(config, name=args.name).stats()
    print(f"numaserve: {args.name!r} serves {config.model} with {len(stats['workers'])} workers")
    for worker_id, w in stats["workers"].items():
        info = w.get("info", {})
        print(f"  {worker_id}: cores {info.get('cpu_ids')}, {info.get('num_threads')} threads, "
              f"memory {info.get('memory_policy')}")
    print(f"connect with numaserve.connect({args.name!r}); stop with `numaserve shutdown --name {args.name}`")


def cmd_stats(args) -> None:
    from actors import deploy

    print(json.dumps(deploy.connect(args.name, args.address).stats(), indent=2, default=str))


def cmd_shutdown(args) -> None:
    from actors import deploy

    deploy.connect(args.name, args.address).shutdown()
    print(f"numaserve: {args.name!r} shut down")


def cmd_calibrate(args) -> None:
    from models.calibrate import calibrate, read_text_file
    from models.calibration import CalibrationOptions, save_calibration

    options = CalibrationOptions(**{k: getattr(args, k) for k in ("method", "percentile", "bound", "weight_dtype")
                                    if getattr(args, k) is not None})  # validated before the model loads
    if args.text is None:
        from benchmarks.heldout_eval import heldout_texts

        texts = heldout_texts()
        label = f"the demo model card's held-out set ({len(texts)} standard-library files)"
    else:
        texts, label = [read_text_file(args.text)], str(args.text)
    start = time.perf_counter()
    calibration = calibrate(args.model, texts, label, options)
    path = save_calibration(calibration, args.model)
    errors = [(m.error_dynamic, m.error_static) for m in calibration.matrices.values() if m.error_dynamic is not None]
    print(f"numaserve: calibrated {args.model} ({calibration.weight_dtype} weights) on {calibration.num_tokens} tokens "
          f"of {label} in {time.perf_counter() - start:.1f} s: {calibration.method} scales")
    if errors:
        print(f"  relative int8 output error: dynamic scales max {max(e[0] for e in errors):.4f}, static scales max "
              f"{max(e[1] for e in errors):.4f}; bound {calibration.bound:g}")
    else:
        print(f"  no q8_0 / q4_0 matrices: int8 activations will not run with {calibration.weight_dtype} weights")
    fallbacks = calibration.fallback_names
    print(f"  float32 activations for {len(fallbacks)} matrices" + (f": {', '.join(fallbacks)}" if fallbacks else ""))
    print(f"wrote {path}; the engine reads it when it loads {args.model}")


def _add_calibrate_parser(sub) -> None:
    from models.calibration import CalibrationOptions

    defaults = CalibrationOptions()
    cal = sub.add_parser("calibrate", help="measure int8 activation ranges and errors per matrix; writes the "
                                           "calibration file the engine reads beside MODEL")
    cal.add_argument("model", help="model directory or .gguf file")
    cal.add_argument("--text", help="UTF-8 text to calibrate on (default: the demo model card's held-out set, "
                                    "the Python standard library files it never trained on)")
    cal.add_argument("--method", help=f"minmax | percentile | kl (default {defaults.method})")
    cal.add_argument("--percentile", type=float, help=f"of |x|, for --method percentile (default "
                                                      f"{defaults.percentile:g})")
    cal.add_argument("--bound", type=float, help="relative int8 output error above which a matrix keeps float32 "
                                                 f"activations (default {defaults.bound:g})")
    cal.add_argument("--weight-dtype", help="q8_0 | q4_0 | ... (default: a GGUF file's own types, q8_0 for a "
                                            "directory)")
    cal.set_defaults(func=cmd_calibrate)


def _add_cluster_parsers(sub) -> None:
    serve = sub.add_parser("serve", help="start a deployment on the Ray cluster (starting a head if none runs)")
    serve.add_argument("--config", default=str(Path(__file__).parent.parent / "cluster_configs" / "local.yaml"),
                       help="ClusterConfig YAML (default: cluster_configs/local.yaml)")
    serve.add_argument("--model", help="model directory or GGUF file (overrides the config's)")
    serve.set_defaults(func=cmd_serve)
    stats = sub.add_parser("stats", help="print a deployment's workers, routing and policy as JSON")
    stats.set_defaults(func=cmd_stats)
    shutdown = sub.add_parser("shutdown", help="stop every actor of a deployment")
    shutdown.set_defaults(func=cmd_shutdown)
    for p in (serve, stats, shutdown):
        p.add_argument("--name", default="numaserve", help="deployment name")
    for p in (stats, shutdown):
        p.add_argument("--address", default="auto", help="Ray cluster address")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="numaserve", description="CPU-native LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream a completion of PROMPT from MODEL_DIR")
    gen.add_argument("model_dir")
    gen.add_argument("prompt")
    _add_sampling_args(gen)
    _add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)
    demo = sub.add_parser("demo", help="generate from the shipped demo model")
    demo.add_argument("--max-tokens", type=int, default=48)
    demo.set_defaults(func=cmd_demo)
    _add_calibrate_parser(sub)
    _add_cluster_parsers(sub)
    sub.add_parser("bench", help="decode/prefill benchmark against llama.cpp; `numaserve bench --help` for its "
                                 "options")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # its own parser: every option passes through
        from benchmarks.bench_decode import main as bench_main

        bench_main(argv[1:])
        return 0
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (NumaserveError, ValueError) as e:  # pydantic's ValidationError is a ValueError
        print(f"numaserve: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
