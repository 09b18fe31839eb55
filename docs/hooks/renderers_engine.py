"""Tables for the single-engine benchmarks: decode and prefill against llama.cpp, long context, MoE, load
time, architectures, the weight stream, LoRA, structured outputs, batching, calibration, quality, revisions,
the all-reduce of tensor-parallel ranks.

Each renderer takes a file's parsed JSON and returns Markdown; a KeyError or TypeError on a shape it does
not expect sends the file to the generic table (result_tables.render_data)."""

import re

from result_tables import gb, labelled, num, pct, table, times

METRICS = {"prefill": "prefill", "decode_b1": "decode, batch 1", "decode_b8": "decode, batch 8 (aggregate)",
           "decode_b32": "decode, batch 32 (aggregate)"}


def metric_label(metric: str) -> str:
    if metric in METRICS:
        return METRICS[metric]
    m = re.fullmatch(r"decode_b(\d+)_ctx(\d+)", metric)
    if m:
        return f"decode b{m[1]}, {int(m[2]) // 1024}k positions"
    m = re.fullmatch(r"prefill_(\d+)x(\d+)", metric)
    return f"prefill {m[1]} x {m[2]}" if m else metric.replace("_", " ")


def roofline(row: dict) -> str:
    if "bandwidth_roofline" in row:
        return f"{pct(row['bandwidth_roofline'], 0)} bandwidth"
    if "of_peak" in row:
        return f"{pct(row['of_peak'], 0)} of {row['peak_kind']} peak"
    if "compute_roofline" in row:  # runs before bench_peak: numpy's float32 sgemm rate
        return f"{pct(row['compute_roofline'], 0)} of sgemm"
    return ""


def decode(data: dict) -> str:
    rows = data["rows"]
    speed = [r for r in rows if r["metric"] in METRICS or re.fullmatch(r"decode_b1_ctx\d+", r["metric"])]
    blocks = [table(["weights", "activations", "metric", "numaserve tok/s", "llama.cpp tok/s", "ratio",
                     "roofline"],
                    [[r["dtype"], r.get("activation_dtype", ""), metric_label(r["metric"]),
                      num(r["numaserve_tok_s"]), num(r.get("llamacpp_tok_s")), times(r.get("ratio")),
                      roofline(r)]
                     for r in speed])]
    machine = data.get("machine") or {}
    probes = []
    if "read_bytes_per_s" in machine:
        probes.append(f"read probe {machine['read_bytes_per_s'] / 1e9:.0f} GB/s")
    if "matmul_flop_per_s" in machine:
        probes.append(f"numpy float32 sgemm {machine['matmul_flop_per_s'] / 1e9:.0f} GFLOP/s")
    probes += [f"{key.split('_')[1]} dot-product peak {value / 1e9:.0f} G op/s"
               for key, value in machine.items() if key.startswith("peak_")]
    threading = (data.get("meta", {}).get("numaserve_settings") or {}).get("threading")
    if probes or threading:
        blocks.append("At the start of the run: " + ", ".join(probes)
                      + (f"; numaserve's threading trial chose `{threading}`." if threading else "."))
    first = [r for r in rows if r["metric"].startswith("torch_first_")]
    if first:
        blocks.append(labelled("torch imported first, against a plain process", table(
            ["weights", "metric", "torch first tok/s", "plain tok/s", "ratio"],
            [[r["dtype"], metric_label(r["metric"].removeprefix("torch_first_")), num(r["numaserve_tok_s"]),
              num(r["plain_tok_s"]), times(r["ratio_to_plain"])] for r in first])))
    memory = [r for r in rows if r["metric"] == "memory"]
    if memory:
        blocks.append(labelled("Memory", table(
            ["weights", "engine", "peak RSS", "RSS growth while loading", "resident bytes per parameter"],
            [[r["dtype"], r.get("engine", ""), gb(r.get("peak_rss_bytes")), gb(r.get("rss_delta_bytes")),
              num(r.get("bytes_per_param"), 2)] for r in memory])))
    return "\n\n".join(blocks)


def engines_by_metric(rows: list[dict], value) -> str:
    """One row per engine, one column per metric, in the order the file has them."""
    metrics = list(dict.fromkeys(r["metric"] for r in rows))
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    cells = {(r["engine"], r["metric"]): value(r) for r in rows}
    return table(["engine"] + [metric_label(m) for m in metrics],
                 [[e] + [cells.get((e, m), "") for m in metrics] for e in engines])


def with_ratio(r: dict, key: str = "tok_s", ratio: str = "ratio_to_llamacpp") -> str:
    return num(r[key]) + (f" ({times(r[ratio])})" if ratio in r else "")


def context(data: dict) -> str:
    speed = [r for r in data["rows"] if r["metric"] != "memory"]
    memory = [r for r in data["rows"] if r["metric"] == "memory"]
    blocks = ["Tokens/s (ratio to llama.cpp's KV type of the same bytes per value):",
              engines_by_metric(speed, with_ratio)]
    if memory:
        blocks.append(labelled("Peak RSS", table(["engine", "peak RSS"],
                                                 [[r["engine"], gb(r["peak_rss_bytes"])] for r in memory])))
    return "\n\n".join(blocks)


def moe(data: dict) -> str:
    rows = data["rows"]
    speed = [r for r in rows if r["metric"] != "memory"]
    blocks = [table(["metric", "numaserve tok/s", "llama.cpp tok/s", "ratio",
                     "of the roofline (numaserve / llama.cpp)"],
                    [[metric_label(r["metric"]), num(r["numaserve_tok_s"]), num(r["llamacpp_tok_s"]),
                      times(r["ratio"]),
                      (f"{pct(r['numaserve_of_roofline'], 0)} / {pct(r['llamacpp_of_roofline'], 0)} "
                       f"({gb(r['bytes_per_token'])} a token at {r['read_bytes_per_s'] / 1e9:.1f} GB/s)")
                      if "roofline_tok_s" in r else ""] for r in speed])]
    meta = data.get("meta", {})
    if "total_params" in meta:
        blocks.append(f"{meta['total_params'] / 1e9:.2f}B parameters, {meta['active_params'] / 1e9:.2f}B "
                      "active per token.")
    memory = [r for r in rows if r["metric"] == "memory"]
    if memory:
        blocks.append(labelled("Memory", table(["engine", "peak RSS", "RSS growth while loading"],
                                               [[r["engine"], gb(r.get("peak_rss_bytes")),
                                                 gb(r.get("rss_delta_bytes"))] for r in memory])))
    return "\n\n".join(blocks)


def load(data: dict) -> str:
    medians = data["medians"]
    blocks = [table(["run", "import (s)", "constructor (s)", "first token (s)", "decode (tok/s)"],
                    [[run, num(m["import_s"], 2), num(m["load_s"], 2), num(m["first_token_s"], 3),
                      num(m.get("decode_tok_s"), 2)] for run, m in medians.items()])]
    ratios = data.get("ratios") or {}
    both = data.get("load_and_first_token_ratios") or {}
    if ratios or both:
        blocks.append(table(["ratio", "constructor", "constructor and first token"],
                            [[k, times(ratios.get(k), 1), times(both.get(k), 1)]
                             for k in dict.fromkeys(list(ratios) + list(both))]))
    meta = data.get("meta", {})
    decode = data.get("decode_ratios") or {}
    if decode:
        blocks.append(table(["decode at batch 1", "ratio"], [[k, times(v, 3)] for k, v in decode.items()]))
    memory = data.get("memory_over_weights") or {}
    if memory:
        blocks.append(table(["memory over the weights' bytes", "ratio"],
                            [[k, times(v, 2)] for k, v in memory.items() if k != "weight_bytes"]))
    if "gguf_bytes" in meta:
        within = data.get("warm_within_2x_llamacpp")
        said = (", ".join(f"{k}: {'yes' if v else 'no'}" for k, v in within.items())
                if isinstance(within, dict) else "yes" if within else "no")
        blocks.append(f"GGUF of {gb(meta['gguf_bytes'])} ({meta.get('dtype', '')}), medians of "
                      f"{meta.get('samples', '?')} samples; warm start within 2x llama.cpp's load to its "
                      f"first token: {said}.")
    return "\n\n".join(blocks)


def architectures(data: dict) -> str:
    rows = data["rows"]
    families = list(dict.fromkeys(r["family"] for r in rows))
    keys = list(dict.fromkeys((r["weight_dtype"], r["activation_dtype"], r["metric"]) for r in rows))
    cells = {(r["weight_dtype"], r["activation_dtype"], r["metric"], r["family"]):
             num(r["tok_s"]) + ("" if r["family"] == "llama" else f" ({r['ratio_to_llama']:.2f})")
             for r in rows}
    return "Tokens/s (ratio to Llama's):\n\n" + table(
        ["weights / activations", "metric"] + families,
        [[f"{w} / {a}", metric_label(m)] + [cells.get((w, a, m, f), "") for f in families]
         for w, a, m in keys])


def stream(data: dict) -> str:
    formats = data["formats"]
    variants = list(dict.fromkeys(v for f in formats for v in f["variants"]))
    rows = []
    for f in formats:
        probe = f.get("probe_gb_s") or []
        rows.append([f["format"], f"{min(probe):.1f}-{max(probe):.1f}" if probe else ""]
                    + [f"{f['variants'][v]['median_gb_s']:.1f} ({f['variants'][v]['median_of_probe']:.2f})"
                       if v in f["variants"] else "" for v in variants])
    return "GB/s (fraction of the read probe in the same repeat):\n\n" + table(
        ["format", "probe GB/s"] + variants, rows)


def lora(data: dict) -> str:
    rows = data["rows"]
    counts = list(dict.fromkeys(r["num_adapters"] for r in rows))
    dtypes = list(dict.fromkeys(r["weight_dtype"] for r in rows))
    cell = {(r["weight_dtype"], r["num_adapters"]): num(r["tok_s"]) + (
        f" ({times(r['ratio_to_base'])})" if r["num_adapters"] else "") for r in rows}
    head = (f"Decode tokens/s at batch {data.get('batch', '?')} with rank-{data.get('rank', '?')} adapters "
            "(ratio to the base model alone):")
    blocks = [head,
              table(["weights"] + ["base" if n == 0 else f"{n} adapter{'s' * (n > 1)}" for n in counts],
                    [[d] + [cell.get((d, n), "") for n in counts] for d in dtypes])]
    cross = data.get("crossover") or []
    if cross:
        sizes = list(dict.fromkeys(r["adapter_rows"] for r in cross))
        cc = {(r["weight_dtype"], r["adapter_rows"]):
              f"{r['lowrank_s'] * 1e3:.0f} / {r['merged_s'] * 1e3:.0f} ({times(r['merged_over_lowrank'])})"
              for r in cross}
        blocks.append(labelled("Merged against low-rank: step ms, low-rank / merged, by adapter rows beside "
                               f"{cross[0]['base_rows']} base decode rows", table(
                                   ["weights"] + [str(n) for n in sizes],
                                   [[d] + [cc.get((d, n), "") for n in sizes]
                                    for d in dict.fromkeys(r["weight_dtype"] for r in cross)])))
    return "\n\n".join(blocks)


def structured(data: dict) -> str:
    return table(["batch", "schema", "jump-forward", "constrained tok/s", "unconstrained tok/s", "ratio",
                  "forced share", "mask ms / row (wait)", "cut by max_tokens"],
                 [[r["batch"], r["schema"], "on" if r["jump_forward"] else "off", num(r["constrained_tok_s"]),
                   num(r["unconstrained_tok_s"]), times(r["ratio"]), pct(r["forced_share"], 0),
                   f"{r['mask_ms_per_row']:.3f} ({r['mask_wait_ms_per_row']:.3f})", r["num_length_finishes"]]
                  for r in sorted(data["rows"], key=lambda r: (r["batch"], r["schema"],
                                                              not r["jump_forward"]))])


def batching(data: dict) -> str:
    return table(["concurrent requests", "aggregate decode tok/s", "mean batch",
                  "KV utilization (mean / min)"],
                 [[r["concurrency"], num(r["decode_tokens_per_s"], 0), num(r["mean_batch"]),
                   f"{pct(r['kv_utilization_mean'], 0)} / {pct(r['kv_utilization_min'], 0)}"]
                  for r in data["rows"]])


def calibration(data: dict) -> str:
    quality = data["quality"]
    modes = list(next(iter(quality.values()))["vs_float32"])
    blocks = [labelled("Perplexity against float32 activations", table(
        ["weights"] + modes, [[w, *(pct(q["vs_float32"][m], 3, sign=True) for m in modes)]
                              for w, q in quality.items()]))]
    first = next(iter(quality.values()))
    errors = first.get("errors") or {}
    if errors:
        blocks.append(labelled("Worst matrix's relative int8 output error", table(
            ["scales", "dynamic", "static"],
            [[m, pct(e["max_error_dynamic"], 2), pct(e["max_error_static"], 1)] for m, e in errors.items()])))
    fallback = [(w, r) for w, q in quality.items() for r in q.get("static_with_fallback") or []]
    if fallback:
        blocks.append(labelled("Static scales with the per-matrix float32 fallback", table(
            ["weights", "method", "bound", "matrices in float32", "perplexity vs float32"],
            [[w, r["method"], r["bound"], r["num_fallbacks"], pct(r["vs_float32"], 3, sign=True)]
             for w, r in fallback])))
    speed = data.get("speed") or {}
    if speed:
        blocks.append(labelled("Speed, static over dynamic scales", table(
            ["weights", "metric", "dynamic tok/s", "static tok/s", "static / dynamic"],
            [[w, m.replace("_", " "), num(v["dynamic_tok_s"]), num(v["static_tok_s"]),
              times(v["static_over_dynamic"])] for w, s in speed.items() for m, v in s.items()])))
    return "\n\n".join(blocks)


def kv_quality(data: dict) -> str:
    contexts = data["contexts"]
    head = ("Demo model (trained on 256-token windows), held-out windows at each context length ("
            + ", ".join(f"{c['windows']} of {c['window_tokens']} tokens" for c in contexts.values())
            + f"), and {data['new_tokens']} greedy tokens after each of {data['prompts']} held-out prompts, "
            "against bfloat16 KV. Perplexity change +- one standard error (paired, across windows); KL: the "
            "mean KL divergence of the next-token distribution from bfloat16 KV's, in nats:")
    columns = ["kv_dtype"]
    for context in contexts:
        columns += [f"perplexity, {context}", f"KL, {context}"]
    columns += [f"continuations identical (of {data['prompts']})", "tokens before the first difference"]
    rows = []
    for dtype, greedy in data["greedy"].items():
        row = [dtype]
        for c in contexts.values():
            v = c["kv_dtypes"].get(dtype)
            row += ([f"{pct(v['vs_bf16'], 3, sign=True)} +- {pct(v['vs_bf16_standard_error'], 3)}",
                     f"{v['kl_divergence']:.5f}"] if v else ["", ""])
        rows.append(row + [greedy["identical_continuations"],
                           pct(greedy["tokens_before_first_difference"] / greedy["num_tokens"], 0)])
    return head + "\n\n" + table(columns, rows)


def quant_quality(data: dict) -> str:
    head = (f"Demo model, {data['windows']} held-out windows of {data['window_tokens']} tokens; bfloat16 "
            f"weights' perplexity {data['bf16_perplexity']:.3f}.")
    blocks = [head,
              table(["weights", "perplexity vs bfloat16 weights, float32 activations",
                     "with int8 activations"],
                    [[f, pct(v["vs_bf16"], 3, sign=True), pct(v["int8_vs_bf16"], 3, sign=True)]
                     for f, v in data["formats"].items()])]
    goals = data.get("goals") or {}
    if goals:
        blocks.append(labelled("Goals", table(["goal", "bound", "value", "met"],
                                              [[g, pct(v["bound"], 2), pct(v["value"], 3),
                                                "yes" if v["met"] else "no"] for g, v in goals.items()])))
    return "\n\n".join(blocks)


def imatrix_quality(data: dict) -> str:
    im = data["imatrix"]
    head = (f"Demo model, {data['windows']} held-out windows of {data['window_tokens']} tokens, float32 "
            f"activations; bfloat16 weights' perplexity {data['bf16_perplexity']:.3f}. Importance matrix: "
            f"{im['chunks']} chunks of {im['chunk_tokens']} tokens of {im['text']} (not the held-out set).")
    rows = [[f] + [pct(v[run][key], 3, sign=True) for run, key in (
        ("plain", "vs_bf16"), ("plain", "llama_cpp_vs_bf16"), ("imatrix", "vs_bf16"),
        ("imatrix", "llama_cpp_vs_bf16"), ("imatrix", "vs_llama_cpp"))] for f, v in data["formats"].items()]
    blocks = [head, table(["weights", "numaserve", "llama.cpp's file", "numaserve + imatrix",
                           "llama.cpp's file + imatrix", "ours vs llama.cpp's (imatrix)"], rows)]
    goals = data.get("goals") or {}
    if goals:
        blocks.append(labelled("Goals (perplexity vs bfloat16 weights, at most)", table(
            ["goal", "bound", "value", "met"],
            [[g, pct(v["bound"], 2), pct(v["value"], 3, sign=True), "yes" if v["met"] else "no"]
             for g, v in goals.items()])))
    return "\n\n".join(blocks)


def sampling(data: dict) -> str:
    meta = data.get("meta", {})
    frac = data["fraction_of_decode_step"]
    return (f"{meta.get('num_requests', '?')} requests, vocabulary {meta.get('vocab', '?')}, "
            f"sampling parameters {meta.get('params', {})}:\n\n") + table(
        ["sampler", "ms a step", "share of the decode step"],
        [["per request (before)", num(data["sampling_ms"]["before"]), pct(frac["before"])],
         ["batched (after)", num(data["sampling_ms"]["after"]), pct(frac["after"])]]) + (
        f"\n\nSpeedup {times(data['speedup'], 1)}; decode step {num(data['decode_step_ms'], 0)} ms; "
        f"under 5% of it: {'yes' if data.get('goal_under_5_percent') else 'no'}.")


def revisions(data: dict) -> str:
    rev = data.get("revisions", {})
    return table(["model", "weights", "batch (or prefill)", f"old ({rev.get('old', '?')}) tok/s",
                  f"new ({rev.get('new', '?')}) tok/s", "new / old"],
                 [[r["model"], r["weight_dtype"], r["batch"], num(r["median_tokens_per_s"]["old"]),
                   num(r["median_tokens_per_s"]["new"]), f"{r['new_over_old']:.3f}"] for r in data["rows"]])


def all_reduce(data: dict) -> str:
    rows = data["rows"]

    def bound(r: dict) -> str:
        if "target_us" not in r:
            return ""
        return f"<= {num(r['target_us'], 0)}: {'met' if r['met'] else 'missed'}"

    return (f"{data.get('ranks', '?')} ranks on cores {data.get('cores', '?')}, {data.get('iters', '?')} "
            f"all-reduces per shape and round, {data.get('rounds', '?')} rounds:\n\n") + table(
        ["rows x hidden (float32)", "bytes", "median us", "p10 us", "p90 us", "target"],
        [[k, f"{r['bytes']:,}", num(r["median_us"]), num(r["p10_us"]), num(r["p90_us"]), bound(r)]
         for k, r in rows.items()])


def tensor_parallel(data: dict) -> str:
    engines = data.get("engines", {})
    return table(["row", f"tp1: {engines.get('tp1', '?')} tok/s", f"tp2: {engines.get('tp2', '?')} tok/s",
                  "tp2 / tp1", "tp2's collectives (share of its time)",
                  "of which waiting for the other rank"],
                 [[f"decode batch {r['row']}" if r["row"].isdigit() else r["row"],
                   num(r["median_tokens_per_s"]["tp1"]), num(r["median_tokens_per_s"]["tp2"]),
                   times(r["tp2_over_tp1"]), pct(r.get("tp2_median_collective_share")),
                   pct(r.get("tp2_median_collective_wait_share"))]
                  for r in data["rows"]])


def tensor_parallel_projection(data: dict) -> str:
    a = data["assumed"]
    cost, ar = a["socket_step_cost"], a["all_reduce"]
    head = (f"Assumed a socket: {cost['source']}; its step's weights stream {num(cost['weights_s'] * 1e3)} "
            f"ms (TinyLlama q8_0), fixed cost {num(cost['fixed_s'] * 1e3)} ms (the measured step floor; the "
            f"fit's {num(a['fitted_fixed_s'] * 1e3)} ms); an all-reduce {num(ar['latency_s'] * 1e6)} us + "
            f"{num(ar['per_byte_s'] * 1e6 * 1024, 3)} us a KB ({ar['source']}); {a['node_gib']:g} GB a "
            f"socket; decode contexts of {a['context_tokens']} tokens.\n\n")
    fitted = data.get("with_fitted_fixed_s", {})
    return head + table(
        ["model (q8_0)", "one node b1 tok/s", "TP=2 b1 tok/s", "TP=2 / one node",
         "(with the fit's fixed cost)", "collectives ms a b1 step", "two replicas beat TP=2 above",
         "fits one node", "fits TP=2"],
        [[name, num(r["batch_1"]["one_node_tok_s"]), num(r["batch_1"]["tp2_tok_s"]),
          times(r["batch_1"]["speedup"]),
          times(fitted[name]["batch_1"]["speedup"]) if name in fitted else "",
          num(r["batch_1"]["step_ms"]["tp2_collectives"], 3), f"{r['dp_beats_tp2_above_streams']} streams",
          "yes" if r["fits"]["one_node"] else "no", "yes" if r["fits"]["tp2"] else "no"]
         for name, r in data["models"].items()])


def peak(data: dict) -> str:
    head = (f"{data.get('threads', '?')} threads, {data.get('samples', '?')} rounds alternating; read probe "
            f"{data['read_bytes_per_s'] / 1e9:.1f} GB/s (median).\n\n")
    return head + table(
        ["instruction", "multiply-adds each", "one core G op/s", "every thread G op/s", "best G op/s"],
        [[r["instruction"], r["macs_per_instruction"], num(r["per_core_ops_s"] / 1e9),
          num(r["all_cores_ops_s"] / 1e9), num(r["all_cores_best_ops_s"] / 1e9)] for r in data["rows"]])


def chunks(data: dict) -> str:
    head = (f"Prefill of {data['prompt_len']} tokens, {data['threads']} threads, {data['samples']} rounds "
            f"alternating; the pick: the smallest chunk within {pct(data['within'], 0)} of the best "
            "rate.\n\n")
    return head + table(
        ["format", "peak", *(f"{r['chunk']} tokens" for r in data["formats"][0]["rows"]), "pick"],
        [[f["format"], f"{f['peak_kind']} {f['peak_ops_per_s'] / 1e9:.0f} G op/s",
          *(f"{r['tokens_per_s']:.0f} tok/s, {pct(r['fraction_of_peak'], 0)}" for r in f["rows"]),
          f["pick"]]
         for f in data["formats"]])


RENDERERS = [
    (r"peak.*\.json", peak),
    (r"chunks.*\.json", chunks),
    (r"tensor_parallel_projection.*\.json", tensor_parallel_projection),
    (r"decode.*\.json", decode),
    (r"context.*\.json", context),
    (r"moe.*\.json", moe),
    (r"load.*\.json", load),
    (r"architectures.*\.json", architectures),
    (r"stream.*\.json", stream),
    (r"lora.*\.json", lora),
    (r"structured.*\.json", structured),
    (r"batching.*\.json", batching),
    (r"calibration.*\.json", calibration),
    (r"kv_quality.*\.json", kv_quality),
    (r"quant_quality.*\.json", quant_quality),
    (r"imatrix_quality.*\.json", imatrix_quality),
    (r"sampling.*\.json", sampling),
    (r"revisions.*\.json", revisions),
    (r"all_reduce.*\.json", all_reduce),
    (r"tensor_parallel.*\.json", tensor_parallel),
]
