"""How often a sampled draft is accepted: the keyed race against the standard rejection rule (issue 11).

A draft model guesses a sampled request's next token by sampling its own logits with the target's keyed
randomness (kernels/sampling/race.py); the target accepts the guess when it equals the target's own draw. The
standard rejection rule would accept a draft drawn from q with probability sum(min(p, q)) = 1 - TV(p, q),
but its tokens depend on whether a request drafted (scheduling/sampling/step_sampler.py says why numaserve
does not use it). This measures both on the demo family: at every position of held-out windows (the model
card's held-out set, numaserve/demo_eval.py) the base's p and the draft's q under the request's sampling
(temperature, top-p), then 1 - TV, and the race's agreement averaged over `--draws` keys per position by the
engine's own sampler (sample_batch). No timing.

    python -m benchmarks.bench_speculation coupling      # about a minute
"""

import json
from pathlib import Path

import numpy as np

import numaserve as ns
from models.sampling_batch import SamplingBatch
from numaserve.demo_eval import card_windows
from scheduling.sampling.sampler import sample_batch
from tests.support.reference_sampler import sampling_probs

SETTINGS = ({"temperature": 1.0}, {"temperature": 0.7}, {"temperature": 0.7, "top_p": 0.9})


def coupling(args) -> dict:
    demo = Path(ns.__file__).parent / "assets" / "demo"
    base = ns.LLM(demo / "base", weight_dtype="float32", kv_dtype="float32")
    draft = ns.LLM(demo / "draft", weight_dtype="float32", kv_dtype="float32")
    windows = card_windows(base.tokenizer, args.num_windows)
    rows = []
    for setting in SETTINGS:
        params = ns.SamplingParams(**setting)
        one_minus_tv, agreement = [], []
        for window in windows:
            ids = window.tolist()
            p_logits, q_logits = base.score(ids), draft.score(ids)
            for pos in range(0, len(ids), args.stride):
                p, q = sampling_probs(p_logits[pos], params), sampling_probs(q_logits[pos], params)
                one_minus_tv.append(float(np.minimum(p, q).sum()))
                # one row per seed: the position's draw as a request seeded so samples it, from each model
                n, history = args.draws, ids[:pos + 1]
                batch = SamplingBatch.build([params] * n, range(n), [pos + 1] * n, [history] * n,
                                            [pos + 1] * n)
                ours = sample_batch(np.repeat(p_logits[pos:pos + 1], n, axis=0), batch)
                theirs = sample_batch(np.repeat(q_logits[pos:pos + 1], n, axis=0), batch)
                agreement.append(float(np.mean(ours == theirs)))
        rows.append({"params": setting, "num_positions": len(agreement),
                     "rejection_rule_acceptance": float(np.mean(one_minus_tv)),
                     "race_acceptance": float(np.mean(agreement))})
        print(json.dumps(rows[-1]), flush=True)
    out = {"meta": {"models": "demo base (target) and draft, float32", "windows": len(windows),
                    "stride": args.stride, "draws_per_position": args.draws}, "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return out


def add_arguments(parser) -> None:
    parser.add_argument("--num-windows", type=int, default=16)
    parser.add_argument("--stride", type=int, default=4, help="every n-th position of a window")
    parser.add_argument("--draws", type=int, default=64, help="race keys per position")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "speculation_coupling.json"))
