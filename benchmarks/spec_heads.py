"""Trained-head speculation (issue 15): every method's acceptance and speed on the demo model, then the cost
side on the TinyLlama shape at the demo model's acceptance.

demo: the demo base (numaserve/assets/demo/base) on held-out standard-library code (plain continuation
    prompts), greedy, batch 1 and 16, one engine per configuration: no speculation, n-gram, the draft
    model, Medusa (chain; tree of width TREE_WIDTH), EAGLE (chain; tree of width TREE_WIDTH; `auto`: depth
    and width by the policy), speculating ones in mode "on" at depth --depth (Medusa: its 3 heads). Per
    engine: decode tokens/s (median of alternating samples), tokens per verification (1 + accepted drafts /
    verifications, the engine's own counters) and whether its tokens equal no speculation's. Each
    trained-head proposer's counts of what every tree width would have kept are saved for the next part.
tinyllama: the TinyLlama-shaped random checkpoint (q8_0) with random Medusa heads and a random EAGLE head
    of its width (benchmarks/checkpoints.py): the heads run for real, so drafting costs what it costs at
    that shape, and their drafts are then rewritten so that what a verification keeps follows the demo
    model's measured counts for that method and width (AcceptanceReplay). Tokens are checked against the
    target's own greedy continuation.

    python -m benchmarks.bench_speculation heads demo         # about 6 minutes on 2 cores
    python -m benchmarks.bench_speculation heads tinyllama    # about 20 minutes; run demo first
    python -m benchmarks.bench_speculation heads rows         # what a TinyLlama forward of n rows costs

Writes benchmarks/results/speculation_heads.json (both parts) and speculation_heads.png.
"""

import json
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import numba
import numpy as np

import numaserve as ns
from benchmarks.checkpoints import SHAPES, with_random_heads
from benchmarks.heldout_prompts import build_prompts
from benchmarks.spec_common import find_proposer, run_decode, share_weights
from models.proposers.base import Proposer, SpecRequest
from models.proposers.token_tree import TokenTree

RESULTS = Path(__file__).parent / "results"
OUT = RESULTS / "speculation_heads.json"
DEMO = Path(ns.__file__).parent / "assets" / "demo"
PROMPT_TOKENS = 192  # the demo models were trained on 256-token windows: prompt + output stay inside one
TREE_WIDTH = 3
# engines whose counts of what each width keeps are replayed, a width from the first that measured it (the
# tree engines measure up to their width at the full depth; eagle-auto's explorations the widest, at its
# depths)
COUNTS_FROM = {"medusa": ("medusa-tree",), "eagle": ("eagle-tree", "eagle-auto")}
GOAL_TOKENS_PER_VERIFICATION, GOAL_SPEEDUP_B1 = 3.0, 2.5


def configs(depth: int, draft_model: str | None) -> dict[str, dict | None]:
    on = {"mode": "on", "num_speculative_tokens": depth}
    medusa = {"method": "medusa", "mode": "on", "num_speculative_tokens": 3}
    eagle = {"method": "eagle"} | on
    auto = {"method": "auto", "mode": "auto", "num_speculative_tokens": depth}
    return {"off": None,
            **({"ngram": {"method": "ngram"} | on,
                "draft": {"method": "draft", "draft_model": draft_model} | on}
               if draft_model else {}),
            "medusa-chain": medusa | {"tree_width": 1}, "medusa-tree": medusa | {"tree_width": TREE_WIDTH},
            "eagle-chain": eagle | {"tree_width": 1}, "eagle-tree": eagle | {"tree_width": TREE_WIDTH},
            "eagle-auto": eagle | {"mode": "auto"},
            # every method the model has (the draft model where there is one), one chosen per step
            "auto": auto | ({"draft_model": draft_model} if draft_model else {})}


def counters(llm: ns.LLM) -> np.ndarray:
    stats = llm.stats()
    return np.array([stats.get(k, 0)
                     for k in ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens")])


def compare(llms: dict[str, ns.LLM], batches: Sequence[int], samples: int, run_one) -> list[dict]:
    """run_one(llm, batch) -> (decode tokens, seconds, outputs); engines alternate sample by sample."""
    rows = []
    for batch in batches:
        names = list(llms)
        times = {name: [] for name in names}
        spec = {name: np.zeros(3, np.int64) for name in names}
        outputs, widths = {}, {name: [] for name in names}
        for s in range(samples):
            for name in (names if s % 2 == 0 else names[::-1]):
                before = counters(llms[name])
                tokens, seconds, outputs[name] = run_one(llms[name], batch)
                spec[name] += counters(llms[name]) - before
                times[name].append(tokens / seconds)
                widths[name] += [d["choice"] for d in llms[name].diagnostics()
                                 if d["choice"].startswith("tree width")]
        off = statistics.median(times["off"])
        for name in names:
            verifications, drafted, accepted = (int(x) for x in spec[name])
            tok_s = statistics.median(times[name])
            row = {"batch": batch, "engine": name, "tokens_per_s": tok_s, "speedup_vs_off": tok_s / off,
                   "samples_tokens_per_s": times[name], "same_tokens_as_off": outputs[name] == outputs["off"]}
            if verifications:
                row |= {"verifications": verifications, "mean_draft_depth": drafted / verifications,
                        "tokens_per_verification": 1 + accepted / verifications,
                        "depth_last_step": llms[name].stats()["spec_depth"],
                        **({"drafts_by_method": llms[name].stats()["spec_num_drafts_by_method"]}
                           if name == "auto" else {}),
                        # width decisions in the engine's log so far (earlier batch sizes included)
                        "tree_widths_chosen": list(dict.fromkeys(widths[name]))}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def demo(args) -> None:
    # no prefix cache: every sample computes its prompts, so an EAGLE head sees every feature each time
    llms = {name: ns.LLM(DEMO / "base", max_num_seqs=16, max_model_len=512, max_num_batched_tokens=2048,
                         enable_prefix_caching=False,
                         **({"speculation": spec} if spec else {}))
            for name, spec in configs(args.depth, str(DEMO / "draft")).items()}
    prompts = build_prompts(llms["off"].tokenizer, "plain", args.num_prompts, PROMPT_TOKENS)
    params = ns.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    def run_one(llm: ns.LLM, batch: int):
        tokens, seconds, outputs = 0, 0.0, []
        for i in range(0, len(prompts), batch):
            run = run_decode(llm.engine, prompts[i:i + batch], params)
            tokens, seconds, outputs = (tokens + run["tokens"], seconds + run["seconds"],
                                        outputs + run["outputs"])
        return tokens, seconds, outputs

    for llm in llms.values():  # warm-up: numba compiles every kernel signature once
        run_decode(llm.engine, prompts[:2], params.model_copy(update={"max_tokens": 8}))
    rows = compare(llms, (1, args.batch), args.samples, run_one)
    counts = {}
    for method, names in COUNTS_FROM.items():
        measured = [getattr(*find_proposer(llms[name].engine)).accepted_counts for name in names]
        counts[method] = [next((m[w] for m in measured if m[w].sum()), measured[0][w]).tolist()
                          for w in range(len(measured[0]))]
    meta = {"model": str(DEMO / "base"), "draft_model": str(DEMO / "draft"), "depth": args.depth,
            "tree_width": TREE_WIDTH, "num_prompts": args.num_prompts, "prompt_tokens": PROMPT_TOKENS,
            "max_tokens": args.max_tokens, "samples": args.samples, "weight_dtype": "auto (bfloat16)",
            "threads": numba.get_num_threads()}
    save("demo", {"meta": meta | machine(), "rows": rows, "accepted_counts": counts})


class AcceptanceReplay(Proposer):
    """Wraps a trained-head proposer with random heads: its drafting runs (the cost), then each draft tree
    (a chain: width 1) gets the target's own continuation along a random root path for as many levels as a
    draw from the demo model's counts for that width keeps, and other tokens everywhere else. The policy
    sees the demo model's counts as the width measurement."""

    def __init__(self, inner: Proposer, continuations: dict[tuple[int, ...], list[int]], counts: np.ndarray,
                 prompt_len: int, vocab_size: int, seed: int = 0):
        super().__init__()
        self.inner, self.continuations, self.prompt_len, self.vocab_size = (inner, continuations,
                                                                            prompt_len, vocab_size)
        self.cost_prior, self.catches_up, self.needs_hidden = (inner.cost_prior, inner.catches_up,
                                                               inner.needs_hidden)
        self.accepted_counts, self.tree_sizes, self.fixed_width = counts, inner.tree_sizes, inner.fixed_width
        self.rng = np.random.default_rng(seed)

    @property
    def width(self) -> int:
        return self.inner.width

    @width.setter
    def width(self, value: int) -> None:
        self.inner.width = value

    def observe_hidden(self, request_id: str, first: int, features: np.ndarray) -> None:
        self.inner.observe_hidden(request_id, first, features)

    def free(self, request_id: str) -> None:
        self.inner.free(request_id)

    def propose(self, requests: Sequence[SpecRequest], depths: Sequence[int]) -> list:
        drafts = self.inner.propose(requests, depths)
        self.last_passes = self.inner.last_passes
        out = []
        for req, draft in zip(requests, drafts):
            tree = draft if isinstance(draft, TokenTree) else TokenTree.chain(draft)
            if not tree.tokens:
                out.append(draft)
                continue
            ranks = tree.ranks or (0,) * len(tree.tokens)
            row = self.accepted_counts[max(ranks)]
            kept = min(int(self.rng.choice(len(row), p=row / row.sum())), max(tree.depths))
            done = len(req.token_ids) - self.prompt_len
            truth = self.continuations[tuple(req.token_ids[:self.prompt_len])][done:done + max(tree.depths)]
            replayed = self._replay(tree, truth, kept)
            out.append(list(replayed.tokens) if isinstance(draft, list) else replayed)
        return out

    def _replay(self, tree: TokenTree, truth: list[int], kept: int) -> TokenTree:
        children: dict[int, list[int]] = {}
        for i, p in enumerate(tree.parents):
            children.setdefault(p, []).append(i)
        path, node = set(), -1
        for _ in range(kept):
            node = int(self.rng.choice(children[node]))
            path.add(node)
        tokens = tuple(truth[d - 1] if i in path
                       else (truth[d - 1] + int(self.rng.integers(1, self.vocab_size))) % self.vocab_size
                       for i, d in enumerate(tree.depths))
        return TokenTree(tokens, tree.parents, tree.ranks)


def tinyllama(args) -> None:
    results = json.loads(OUT.read_text()) if OUT.exists() else {}
    if "demo" not in results:
        raise SystemExit(f"{OUT} has no demo part: "
                         "run `python -m benchmarks.bench_speculation heads demo` first")
    counts = {m: np.asarray(c, np.int64) for m, c in results["demo"]["accepted_counts"].items()}
    name, vocab = "tinyllama-1.1b", SHAPES["tinyllama-1.1b"]["vocab_size"]
    path = with_random_heads(name)
    share_weights()
    num_cont = args.max_tokens + args.depth + 2
    common = {"weight_dtype": "q8_0", "max_num_seqs": args.batch, "max_num_batched_tokens": 1024,
              "max_model_len": args.prompt_len + num_cont + 16}
    continuations: dict[tuple[int, ...], list[int]] = {}
    llms = {}
    for engine, spec in configs(args.depth, None).items():
        llms[engine] = ns.LLM(path, **common, **({"speculation": spec} if spec else {}))
        speculator = llms[engine].engine.speculation
        # method "auto": each trained-head candidate replays its own method's counts; n-gram runs as it is
        for method, candidate in (speculator.candidates.items() if spec and spec["method"] == "auto"
                                  else [(spec["method"], speculator)] if spec else []):
            if method in counts:
                candidate.proposer = AcceptanceReplay(candidate.proposer, continuations, counts[method],
                                                      args.prompt_len, vocab)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab, args.prompt_len).tolist() for _ in range(args.batch)]
    params = ns.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    reference = run_decode(llms["off"].engine, prompts, params.model_copy(update={"max_tokens": num_cont}))
    for prompt, out in zip(prompts, reference["outputs"]):
        continuations[tuple(prompt)] = out
    for llm in llms.values():  # warm-up: compiles, and gives auto's cost fit a few steps
        run_decode(llm.engine, prompts[:1], params.model_copy(update={"max_tokens": 8}))

    def run_one(llm: ns.LLM, batch: int):
        run = run_decode(llm.engine, prompts[:batch], params)
        exact = all(out == continuations[tuple(p)][:len(out)] for p, out in zip(prompts, run["outputs"]))
        assert exact, "a speculating engine appended tokens other than the target's greedy continuation"
        return run["tokens"], run["seconds"], run["outputs"]

    rows = compare(llms, (1, args.batch), args.samples, run_one)
    meta = {"model": f"{name} random (benchmarks/checkpoints.py), q8_0, random heads of its width",
            "acceptance": "the demo part's accepted_counts, replayed",
            "depth": args.depth, "tree_width": TREE_WIDTH,
            "prompt_tokens": args.prompt_len, "max_tokens": args.max_tokens, "samples": args.samples,
            "threads": numba.get_num_threads()}
    save("tinyllama", {"meta": meta | machine(), "rows": rows})


def rows(args) -> None:
    """The cost side's shape: one TinyLlama-shaped (q8_0) forward of n rows (a prefill of n tokens, no prefix
    cache), fastest of 4, for the row counts a verification takes."""
    llm = ns.LLM(with_random_heads("tinyllama-1.1b"), weight_dtype="q8_0", max_num_seqs=1, max_model_len=256,
                 enable_prefix_caching=False)
    rng, params = np.random.default_rng(0), ns.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ms = {}
    for n in (1, 2, 4, 8, 16, 24, 40, 64):
        times = []
        for s in range(4):
            llm.engine.add_request(f"rows-{n}-{s}", rng.integers(3, 32000, n).tolist(), params)
            start = time.perf_counter()
            llm.engine.step()  # the whole prompt in one forward
            times.append(time.perf_counter() - start)
            while llm.engine.has_unfinished():
                llm.engine.step()
        ms[n] = round(min(times) * 1e3, 1)
        print(json.dumps({"rows": n, "ms": ms[n]}), flush=True)
    save("rows", {"meta": {"model": "tinyllama-1.1b random, q8_0",
                           "threads": numba.get_num_threads()} | machine(),
                  "forward_ms_by_rows": ms})


def machine() -> dict:
    return {"cpu": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d %H:%M")}


def save(part: str, result: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    results = json.loads(OUT.read_text()) if OUT.exists() else {}
    results[part] = result
    results["goals"] = goals(results)
    OUT.write_text(json.dumps(results, indent=2))
    print(json.dumps(results["goals"], indent=2))
    plot(results, OUT.with_suffix(".png"))


def goals(results: dict) -> dict:
    out = {}
    for part in ("demo", "tinyllama"):
        rows = results.get(part, {}).get("rows", [])
        for batch in sorted({r["batch"] for r in rows}):
            at = [r for r in rows if r["batch"] == batch]
            best = max(at, key=lambda r: r["speedup_vs_off"])
            out[f"{part}_batch{batch}_best"] = f"{best['engine']} {best['speedup_vs_off']:.2f}x"
            for engine in ("eagle-auto", "auto"):
                row = next((r for r in at if r["engine"] == engine), None)
                if row is not None:
                    out[f"{part}_batch{batch}_{engine.replace('-', '_')}"] = (
                        f"{row['speedup_vs_off']:.2f}x "
                        f"({row['speedup_vs_off'] / best['speedup_vs_off']:.2f} of the best)")
    demo_tree = [r for r in results.get("demo", {}).get("rows", [])
                 if r["engine"] == "eagle-tree" and r["batch"] == 1]
    if demo_tree:
        value = demo_tree[0]["tokens_per_verification"]
        out["eagle_tree_tokens_per_verification"] = {"value": round(value, 3),
                                                     "goal": GOAL_TOKENS_PER_VERIFICATION,
                                                     "met": value >= GOAL_TOKENS_PER_VERIFICATION}
    # the speed goal holds at the EAGLE acceptance goal: the fastest EAGLE configuration (tree, chain or auto)
    # keeping >= GOAL_TOKENS_PER_VERIFICATION tokens per verification
    tiny_eagle = [r for r in results.get("tinyllama", {}).get("rows", []) if r["engine"].startswith("eagle")
                  and r["batch"] == 1 and r.get("tokens_per_verification", 0) >= GOAL_TOKENS_PER_VERIFICATION]
    if tiny_eagle:
        best = max(tiny_eagle, key=lambda r: r["speedup_vs_off"])
        out["tinyllama_batch1_eagle_speedup"] = {
            "engine": best["engine"], "value": round(best["speedup_vs_off"], 3),
            "tokens_per_verification": round(best["tokens_per_verification"], 3), "goal": GOAL_SPEEDUP_B1,
            "met": best["speedup_vs_off"] >= GOAL_SPEEDUP_B1}
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [p for p in ("demo", "tinyllama") if p in results]
    fig, axes = plt.subplots(1, len(parts) + 1, figsize=(6 * (len(parts) + 1), 4.5))
    demo_rows = results.get("demo", {}).get("rows", [])
    ax = axes[0]
    for j, batch in enumerate(sorted({r["batch"] for r in demo_rows})):
        rows = [r for r in demo_rows if r["batch"] == batch and "tokens_per_verification" in r]
        ax.bar([i + 0.4 * j for i in range(len(rows))], [r["tokens_per_verification"] for r in rows], 0.4,
               label=f"batch {batch}")
        ax.set_xticks([i + 0.2 for i in range(len(rows))], [r["engine"] for r in rows], rotation=30,
                      fontsize=8)
    ax.axhline(GOAL_TOKENS_PER_VERIFICATION, color="k", lw=0.8, ls="--")
    ax.set_ylabel("tokens per verification")
    ax.set_title("Demo model, held-out stdlib code, greedy")
    ax.legend(fontsize=8)
    for ax, part in zip(axes[1:], parts):
        rows = results[part]["rows"]
        engines = [e for e in dict.fromkeys(r["engine"] for r in rows) if e != "off"]
        for j, batch in enumerate(sorted({r["batch"] for r in rows})):
            speedup = {r["engine"]: r["speedup_vs_off"] for r in rows if r["batch"] == batch}
            ax.bar([i + 0.4 * j for i in range(len(engines))], [speedup[e] for e in engines], 0.4,
                   label=f"batch {batch}")
        ax.set_xticks([i + 0.2 for i in range(len(engines))], engines, rotation=30, fontsize=8)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_ylabel("decode tokens/s vs no speculation")
        ax.set_title("Demo model" if part == "demo" else "TinyLlama shape, q8_0, demo acceptance replayed")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_arguments(p) -> None:
    p.add_argument("which", choices=["demo", "tinyllama", "rows"])
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=16, help="demo: held-out prompts")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--prompt-len", type=int, default=16, help="tinyllama: random prompt tokens")


def main(args) -> None:
    {"demo": demo, "tinyllama": tinyllama, "rows": rows}[args.which](args)
