"""The `numaserve` command line."""

import json
import subprocess
import sys
import time
from pathlib import Path

from cluster_configs.engine_config import EngineConfig
from cluster_configs.errors import NumaserveError
from cluster_configs.sampling_params import SamplingParams
from numaserve.cli_parsers import build_parser
from numaserve.simulate.command import main as cmd_simulate


def _engine_fields(args) -> dict:
    return {name: getattr(args, name) for name in EngineConfig.model_fields
            if getattr(args, name) is not None}


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
        ("tool_call_parser", args.tool_call_parser), ("pooling", args.pooling),
        ("ui", False if args.no_ui else None)) if value is not None}
    if limits:
        if config.http is None:
            flags = ", ".join({"api_keys": "--api-key", "ui": "--no-ui"}.get(f, "--" + f.replace("_", "-"))
                              for f in limits)
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


def _write_imatrix(args, texts: list[str], label: str, start: float) -> None:
    from models.quantization.calibrate import compute_imatrix
    from models.quantization.imatrix import write_imatrix

    im = compute_imatrix(args.model, texts, label, args.chunk, args.process_output,
                         args.weight_dtype or "auto")
    path = write_imatrix(im, args.imatrix)
    print(f"numaserve: importance matrix of {args.model} over {im.chunk_count} chunks of {im.chunk_size} "
          f"tokens of {label} in {time.perf_counter() - start:.1f} s: {len(im.entries)} tensors -> {path}")


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
    if args.imatrix is not None:
        _write_imatrix(args, texts, label, start)
        return
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


COMMANDS = {"generate": cmd_generate, "demo": cmd_demo, "calibrate": cmd_calibrate, "serve": cmd_serve,
            "stats": cmd_stats, "shutdown": cmd_shutdown, "simulate": cmd_simulate}


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
        COMMANDS[args.command](args)
    except (NumaserveError, ValueError) as e:  # pydantic's ValidationError is a ValueError
        print(f"numaserve: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
