"""Tables for speculative decoding: acceptance on the demo family, speed against acceptance, trained heads,
the sampled-draft coupling. Renderers as in renderers_engine.py."""

from result_tables import labelled, num, table, times


def goals_table(goals: dict) -> str:
    def value(v) -> str:
        if isinstance(v, dict):
            return ", ".join(f"{k}: {value(x)}" for k, x in v.items())
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    return labelled("Goals as the run recorded them", table(["goal", "value"],
                                                            [[k, value(v)] for k, v in goals.items()]))


def acceptance(data: dict) -> str:
    rows = data["rows"]
    engines = [e for e in dict.fromkeys(r["engine"] for r in rows) if e != "off"]
    by = {(r["kind"], r["batch"], r["engine"]): r for r in rows}
    keys = list(dict.fromkeys((r["kind"], r["batch"]) for r in rows))
    body = []
    for kind, batch in keys:
        off = by.get((kind, batch, "off"))
        body.append([kind, batch, num(off["tokens_per_s"], 0) if off else ""]
                    + [times(by[(kind, batch, e)]["speedup_vs_off"]) if (kind, batch, e) in by else ""
                       for e in engines])
    blocks = ["Tokens/s of no speculation, and each engine's ratio to it:",
              table(["prompts", "batch", "off tok/s"] + engines, body)]
    per_position = []
    for kind, batch in keys:
        for e in ("ngram", "draft"):
            rates = by.get((kind, batch, e), {}).get("accept_rate_per_position") or [None]
            if batch == 1 and None not in rates:
                per_position.append([kind, e, " / ".join(f"{a:.2f}" for a in rates)])
    if per_position:
        blocks.append(labelled("Acceptance per position at batch 1 (mode on), given the earlier ones "
                               "accepted", table(["prompts", "proposer", "acceptance"], per_position)))
    same = all(r.get("same_tokens_as_off", True) for r in rows)
    blocks.append(f"Every engine gave the same tokens as `off`: {'yes' if same else 'no'}.")
    return "\n\n".join(blocks)


def sweep(data: dict) -> str:
    rows = data["rows"]
    depths = sorted({r["depth"] for r in rows if r["mode"] == "on"})
    off = {(r["dtype"], r["batch"]): r["tokens_per_s"] for r in rows if r["mode"] == "off"}
    on = {(r["dtype"], r["batch"], str(r["accept_rate"]), r["depth"]): r["speedup_vs_off"]
          for r in rows if r["mode"] == "on"}
    auto = {(r["dtype"], r["batch"], str(r["accept_rate"])): r for r in rows if r["mode"] == "auto"}
    rates = list(dict.fromkeys(str(r["accept_rate"]) for r in rows if r["mode"] == "on"))
    body = []
    for (dtype, batch), off_tok_s in off.items():
        for rate in rates:
            a = auto.get((dtype, batch, rate))
            ran = [d for d in depths if (dtype, batch, rate, d) in on]
            depth_cells = (" / ".join(num(on[(dtype, batch, rate, d)], 2) for d in ran) if ran == depths
                           else ", ".join(f"depth {d}: {num(on[(dtype, batch, rate, d)], 2)}" for d in ran))
            auto_cell = (f"{times(a['speedup_vs_off'])} ({a['tokens_per_step_per_request']:.2f} tok/step)"
                         if a else "")
            body.append([dtype, batch, num(off_tok_s), rate, depth_cells, auto_cell])
    head = ("Ratio to `off` in the same run; `measured` replays the acceptance per position that n-gram "
            "lookup reached on the demo family's copy-heavy prompts (run at one depth only):")
    blocks = [head, table(["weights", "batch", "off tok/s", "acceptance",
                           "`on` at depth " + " / ".join(str(d) for d in depths), "`auto` (tokens per step)"],
                          body)]
    goals = data.get("goals") or {}
    if goals:
        blocks.append(goals_table(goals))
    return "\n\n".join(blocks)


def heads_rows(part: dict, batches: tuple[int, ...]) -> str:
    by = {(r["engine"], r["batch"]): r for r in part["rows"]}
    engines = list(dict.fromkeys(r["engine"] for r in part["rows"]))
    body = []
    for e in engines:
        cells = [e]
        for b in batches:
            r = by.get((e, b))
            cells.append("" if r is None else num(r["tokens_per_s"]) + ("" if e == "off" else
                                                                       f" ({times(r['speedup_vs_off'])})"))
        cells.append(" / ".join(num(by[(e, b)].get("tokens_per_verification"), 2) for b in batches
                                if (e, b) in by and "tokens_per_verification" in by[(e, b)]))
        body.append(cells)
    return table(["method"] + [f"batch {b} tok/s" for b in batches]
                 + ["tokens per verification (" + " / ".join(f"b{b}" for b in batches) + ")"], body)


def heads(data: dict) -> str:
    blocks = []
    for key, label in (("demo", "Demo model"), ("tinyllama", "TinyLlama-1.1B shape, replayed acceptance")):
        part = data.get(key)
        if part:
            batches = tuple(sorted({r["batch"] for r in part["rows"]}))
            blocks.append(labelled(label, heads_rows(part, batches)))
    forward = (data.get("rows") or {}).get("forward_ms_by_rows") or {}
    if forward:
        blocks.append(labelled("A TinyLlama-shaped q8_0 forward of n rows (ms)", table(
            list(forward), [[num(v) for v in forward.values()]])))
    goals = data.get("goals") or {}
    if goals:
        blocks.append(goals_table(goals))
    return "\n\n".join(blocks)


def coupling(data: dict) -> str:
    return "Acceptance of the draft model's sampled drafts:\n\n" + table(
        ["sampling", "positions", "race (shipped)", "rejection rule"],
        [[", ".join(f"{k} {v}" for k, v in r["params"].items()), r["num_positions"],
          f"{r['race_acceptance']:.2f}", f"{r['rejection_rule_acceptance']:.2f}"] for r in data["rows"]])


RENDERERS = [
    (r"speculation_acceptance.*\.json", acceptance),
    (r"speculation_sweep.*\.json", sweep),
    (r"speculation_heads.*\.json", heads),
    (r"speculation_coupling.*\.json", coupling),
]
