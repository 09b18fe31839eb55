"""Tables for the serving benchmarks: the Python client and workers, llama-server, the HTTP API, the soaks,
the simulator's validation and sweep, and the fitted step-cost model. Renderers as in renderers_engine.py."""

from result_tables import labelled, num, pct, table, times

RUN_COLUMNS = ["tok/s", "CPU ms / token, all processes", "tokens / chunk"]


def runs_table(runs: dict) -> str:
    return table(["configuration"] + RUN_COLUMNS,
                 [[name, num(r["median_tokens_per_s"], 1), num(r["median_cpu_ms_per_token"], 2),
                   num(r["tokens_per_chunk"], 1)] for name, r in runs.items()])


def serving(data: dict) -> str:
    meta = data.get("meta", {})
    blocks = [(f"{meta.get('model', '?')}, {meta.get('prompt_len', '?')}-token prompts, "
               f"{meta.get('max_tokens', '?')} greedy tokens each, medians of {meta.get('repeats', '?')} "
               "interleaved runs; `0 ms` is a chunk per step.")]
    if "overhead" in data:
        blocks.append(labelled("Client and worker against the in-process engine",
                               runs_table(data["overhead"]["runs"])))
    if "scaling" in data:
        speedups = ", ".join(f"{k} ms chunks {times(v)}" for k, v in data["scaling"]["speedup"].items())
        blocks.append(labelled(f"Workers pinned to one core each (2 workers over 1: {speedups})",
                               runs_table(data["scaling"]["runs"])))
    return "\n\n".join(blocks)


def serving_peers(data: dict) -> str:
    rows = []
    for streams, lv in data["levels"].items():
        ns, peer = lv["numaserve"], lv["llama-server"]
        rows.append([streams, num(ns["tokens_per_s"]), num(peer["tokens_per_s"]),
                     times(lv["throughput_ratio"]),
                     f"{ns['ttft_p50_s']:.2f} / {peer['ttft_p50_s']:.2f} ({lv['ttft_p50_ratio']:.2f})",
                     f"{ns['itl_p50_s'] * 1e3:.0f} / {peer['itl_p50_s'] * 1e3:.0f}"])
    return table(["streams", "numaserve tok/s", "llama-server tok/s", "ratio",
                  "TTFT p50 (s), numaserve / llama-server (ratio)", "ITL p50 (ms)"], rows)


def http(data: dict) -> str:
    levels = [(str(k), v) for k, v in data["levels"].items()]
    levels += [(f"{k}, worker on a core of its own", v) for k, v in (data.get("dedicated") or {}).items()]
    tpot = any("tpot_p50_ms" in v["http"] for _, v in levels)
    header = ["streams", "HTTP tok/s", "in-process tok/s", "HTTP / in-process",
              "TTFT p50 (ms), HTTP / in-process", "ITL p50 (ms)", "ITL p99 (ms)"]
    header += (["TPOT p50 (ms)"] if tpot else []) + ["CPU ms / token"]
    rows = []
    for name, lv in levels:
        h, p = lv["http"], lv["in-process"]
        row = [name, num(h["median_tokens_per_s"]), num(p["median_tokens_per_s"]),
               f"{lv['http_over_in_process']:.3f}", f"{h['ttft_p50_ms']:.0f} / {p['ttft_p50_ms']:.0f}",
               f"{h['itl_p50_ms']:.0f} / {p['itl_p50_ms']:.0f}",
               f"{h['itl_p99_ms']:.0f} / {p['itl_p99_ms']:.0f}"]
        if tpot:
            row.append(f"{h.get('tpot_p50_ms', 0):.1f} / {p.get('tpot_p50_ms', 0):.1f}")
        row.append(f"{h['median_cpu_ms_per_token']:.1f} / {p['median_cpu_ms_per_token']:.1f}")
        rows.append(row)
    meta = data.get("meta", {})
    head = (f"{meta.get('prompt_len', '?')}-token prompts, {meta.get('max_tokens', '?')} greedy tokens, "
            f"stream interval {meta.get('stream_interval_ms', '?')} ms, {meta.get('repeats', '?')} repeats.")
    return head + "\n\n" + table(header, rows)


# "open": the first runs' name of "browser"
CONSOLE_STATES = {"closed": "no console", "polled": "stats polled 1/s",
                  "browser": "Chromium on the same cores", "open": "Chromium on the same cores"}


def console(data: dict) -> str:
    rows = []
    for streams, lv in data["levels"].items():
        for state, label in CONSOLE_STATES.items():
            if state not in lv:
                continue
            r = lv[state]
            ratio = "1" if state == "closed" else f"{lv[f'{state}_over_closed']:.3f}"
            rows.append([streams, label, num(r["median_tokens_per_s"]), ratio, f"{r['ttft_p50_ms']:.0f}",
                         f"{r['itl_p99_ms']:.0f}", f"{r['median_cpu_ms_per_token']:.1f}",
                         f"{r['median_console_polls_per_s']:.2f}"])
    meta = data.get("meta", {})
    head = (f"{meta.get('prompt_len', '?')}-token prompts, {meta.get('max_tokens', '?')} greedy tokens, "
            f"medians of {meta.get('repeats', '?')} samples per state, the states alternating.")
    return head + "\n\n" + table(["streams", "console", "tok/s", "/ no console", "TTFT p50 (ms)",
                                   "ITL p99 (ms)", "CPU ms / token, all processes", "stats polls / s"], rows)


def prefix_disk(data: dict) -> str:
    meta = data["meta"]
    rows = [[name, f"{seconds:.2f}", "1" if name == "cold" else pct(data["ttft_ratios"][name])]
            for name, seconds in data["ttft_medians_s"].items()]
    head = (f"{meta['checkpoint']} q8_0, KV {meta['kv_dtype']}, a {meta['prefix']}-token prefix and "
            f"{meta['suffix']} tokens of suffix, {meta['threads']} threads, medians of {meta['samples']} "
            "samples "
            "(each a fresh process per row, in the order of the rows).")
    beside = (f"Beside {meta['streams']} decoding streams, {meta['reads']} reads of a "
              f"{meta['prefix']}-token prefix took {data['read_seconds_median']:.2f} s each (median); the "
              f"streams' decode rate during a read, over the rate just before it: "
              f"{data['decode_rate_ratio_median']:.3f} (median over reads).")
    return head + "\n\n" + table(["start", "time to first token (s)", "of cold"], rows) + "\n\n" + beside


def soak(data: dict) -> str:
    def ms(*keys: str) -> str:
        return " / ".join(f"{data[k] * 1e3:.1f}" if isinstance(data.get(k), (int, float)) else ""
                          for k in keys)

    facts = [("requests (rate, duration)",
              f"{data['num_requests']} ({data['rate_per_s']:g}/s, {data['duration_s']:g} s)"),
             ("by kind", ", ".join(f"{k} {v}" for k, v in data["by_kind"].items()))]
    if "by_api" in data:
        facts.append(("by API", ", ".join(f"{k} {v}" for k, v in data["by_api"].items())))
    facts += [("completed", data["num_completed"]),
              ("closed by the client", data.get("num_disconnected", ""))]
    if "num_deadline_408" in data:
        facts.append(("deadline: 408 / aborted mid-stream",
                      f"{data['num_deadline_408']} / {data['num_deadline_aborted_mid_stream']}"))
    else:
        facts.append(("deadline aborts", data.get("num_deadline_aborted", "")))
    facts += [("errors", data["num_errors"]), ("hung", data["num_hung"]),
              ("TTFT p50 / p99 (ms)", ms("ttft_p50_s", "ttft_p99_s")),
              ("ITL p50 / p99 (ms)", ms("itl_p50_s", "itl_p99_s"))]
    if "latency_p50_s" in data:
        facts.append(("latency p50 / p99, not streamed (ms)", ms("latency_p50_s", "latency_p99_s")))
    facts.append(("KV blocks leaked, requests left",
                  f"{data['num_blocks_leaked']}, {data['num_requests_left']}"))
    before, after = data["rss_before_bytes"], data["rss_after_bytes"]
    facts += [(f"RSS of {w}", f"{before[w] / 1e6:.0f} -> {after[w] / 1e6:.0f} MB") for w in before]
    if "chaos" in data:
        facts += chaos_facts(data)
    return table(["", ""], [[k, v] for k, v in facts])


def chaos_facts(data: dict) -> list[tuple[str, object]]:
    chaos = data["chaos"]
    recovery = chaos["recovery_by_kind"]
    return [
        ("kills (by kind)", f"{chaos['num_kills']} ("
                            + ", ".join(f"{k} {n}" for k, n in chaos["kills_by_kind"].items()) + ")"),
        ("recovery p50 / p99 (s)", f"{chaos['recovery_p50_s']:.1f} / {chaos['recovery_p99_s']:.1f}"),
        ("recovery p50 / max by kind (s)", ", ".join(f"{k} {r['p50_s']:.1f} / {r['max_s']:.1f}"
                                                     for k, r in recovery.items())),
        ("not recovered", chaos["num_not_recovered"]),
        ("5xx (all typed 503 during a restart)", f"{data['num_5xx']} ({data['num_503_during_restart']})"),
        ("connections lost to an HTTP actor's kill", data["num_connection_lost_to_http_kill"]),
        ("greedy answers checked undisturbed / differing",
         f"{data['num_greedy_checked']} / {data['num_greedy_mismatched']}")]


def simulate_validation(data: dict) -> str:
    def pair(r, key, scale, digits):
        s, real, err = r["simulated"][key], r["real"][key], r["relative_error"][key]
        return f"{s * scale:.{digits}f} / {real * scale:.{digits}f} ({pct(err, 1, sign=True)})"

    return "Simulated / real (relative error):\n\n" + table(
        ["requests/s", "throughput tok/s", "TTFT p50 (s)", "ITL p50 (ms)", "completed (simulated / real)"],
        [[r["rate"], pair(r, "throughput_tok_s", 1, 1), pair(r, "ttft_p50_s", 1, 2),
          pair(r, "itl_p50_s", 1e3, 0), f"{r['simulated']['completed']} / {r['real']['completed']}"]
         for r in data["rows"]])


def simulate_sweep(data: dict) -> str:
    rows = data["rows"]
    workers = sorted({r["workers"] for r in rows})
    eff = {(r["trace"], r["variant"], r["workers"]): r["efficiency"] for r in rows}
    pairs = list(dict.fromkeys((r["trace"], r["variant"]) for r in rows))
    breakdown = data.get("breakdown") or {}
    meta = data.get("meta", {})
    head = (f"Throughput of N workers over N x one worker's at the same load ({meta.get('load', '?')} of one "
            "worker's capacity), by trace and policy variant; last column: the smallest N from which every "
            "larger N stays below 0.9 (none: no breakdown).")
    return head + "\n\n" + table(
        ["trace", "variant"] + [str(w) for w in workers] + ["breaks down at"],
        [[t, v] + [num(eff.get((t, v, w)), 2) for w in workers]
         + [(breakdown.get(t) or {}).get(v) or "none"] for t, v in sorted(pairs)])


def step_cost(data: dict) -> str:
    m = data["model"]
    blocks = [table(["fixed per step (ms)", "weights stream (ms)", "per row (ms)", "sharpness p",
                     "per decode context token (us)", "per prefill pair (us)"],
                    [[f"{m['fixed_s'] * 1e3:.1f}", f"{m['weights_s'] * 1e3:.1f}", f"{m['row_s'] * 1e3:.2f}",
                      f"{m['sharpness']:.2f}", f"{m['context_token_s'] * 1e6:.1f}",
                      f"{m['prefill_pair_s'] * 1e6:.1f}"]])]
    fit = data.get("meta", {}).get("fit") or {}
    if fit:
        blocks.append(labelled("Error of the model per sample, |modelled / measured - 1|", table(
            ["group", "median", "max", "samples"],
            [[g.replace("_", " "), pct(v["median"]), pct(v["max"]), v.get("samples", "")]
             for g, v in fit.items()])))
    blocks.append(f"Fitted to {len(data.get('samples') or [])} measured steps.")
    return "\n\n".join(blocks)


RENDERERS = [
    (r"serving_peers.*\.json", serving_peers),
    (r"serving.*\.json", serving),
    (r"http.*\.json", http),
    (r"console.*\.json", console),
    (r"soak.*\.json", soak),
    (r"prefix_disk.*\.json", prefix_disk),
    (r"simulate_validation.*\.json", simulate_validation),
    (r"simulate_sweep.*\.json", simulate_sweep),
    (r"step_cost.*\.json", step_cost),
]
