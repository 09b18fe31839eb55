"""Train an EAGLE head on the frozen demo base model (numaserve/assets/demo/base), seeded.

    python scripts/train_eagle.py --seed 0 --threads 2              # a few minutes on 2 cores
    python scripts/train_eagle.py --quick --out /tmp/demo-eagle      # smoke run
    python scripts/train_eagle.py --vocabulary-only                  # the shipped head: its draft
                                                                     # vocabulary set anew and its
                                                                     # acceptance measured again

Writes eagle_head.safetensors (bf16) and eagle_config.json into base/ (or --out) and the head's held-out
greedy acceptance into metrics.json under "eagle" (the model card renders it). Data: train_demo.py's (the
standard library's .py files; held-out files never trained on). At position i the head reads the base's
final-norm feature f_i and the embedding of token i + 1 and learns f_{i+1} (smooth L1) and token i + 2
through the base's LM head (cross-entropy, weight 0.1), as in the EAGLE paper; its layer starts as a copy
of the base's last layer. Its draft vocabulary (FR-Spec; `d2t` in the file, models/proposers/eagle_head.py) is
the DRAFT_VOCAB tokens most frequent in the training data, a quarter of the vocabulary: it guesses among those
only, so a pass reads a quarter of the LM head; the acceptance below is measured with it.
"""

import json
import time
from pathlib import Path

import demo_eval
import torch
import torch.nn.functional as F
import transformers
from head_modules import EagleHead
from head_training import frozen_base_and_data, parse_args, record, train_loop
from safetensors.torch import load_file, save_file
from train_demo import ASSETS

STEPS, QUICK_STEPS, TOKEN_WEIGHT = 2000, 20, 0.1
DRAFT_VOCAB = 2048
ACCEPT_POSITIONS, ACCEPT_CONTEXT, ACCEPT_DEPTH, TREE_WIDTH = 512, 64, 5, 3


def new_head(base: transformers.LlamaForCausalLM) -> EagleHead:
    head = EagleHead(base.config)
    last = base.model.layers[-1].state_dict()
    head.model.layers[0].load_state_dict(last)
    head.model.norm.load_state_dict(base.model.norm.state_dict())
    return head


def train(head: EagleHead, base, stream: torch.Tensor, steps: int, seed: int) -> list[float]:
    """The head on random windows of the stream (head_training.train_loop); the base stays frozen."""
    def step_loss(ids: torch.Tensor) -> tuple[torch.Tensor, str]:
        with torch.no_grad():
            features = base.model(input_ids=ids).last_hidden_state  # [B, S, H]
            embeds = base.model.embed_tokens(ids)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            guess = head(embeds[:, 1:-1], features[:, :-2])  # position i: t_{i+1}, f_i -> f_{i+1}
            regression = F.smooth_l1_loss(guess.float(), features[:, 1:-1])
            logits = base.lm_head(guess)
            tokens = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 2:].flatten())
            loss = regression + TOKEN_WEIGHT * tokens
        return loss, f" (features {regression.item():.3f}, tokens {tokens.item():.3f})"

    return train_loop(head, stream, steps, seed, step_loss)


def draft_vocabulary(stream: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The DRAFT_VOCAB ids most frequent in the stream, ascending (ties to the lower id)."""
    counts = torch.bincount(stream, minlength=vocab_size)
    order = sorted(range(vocab_size), key=lambda i: (-int(counts[i]), i))
    return torch.tensor(sorted(order[:DRAFT_VOCAB]), dtype=torch.long)


@torch.no_grad()
def acceptance(head: EagleHead, base, stream: torch.Tensor, draft_ids: torch.Tensor) -> dict:
    """Greedy speculation, one round per held-out position, as the engine runs it: the context's last token
    came from feature f_{c-2}; the head drafts from there, feeding each guess back with its own feature.
    Chain: each step's argmax. Tree: the top TREE_WIDTH of the first two steps (every pair), argmax after;
    the round keeps the path matching the base's greedy continuation. Guesses come from the draft
    vocabulary."""
    contexts = demo_eval.eval_windows(stream, ACCEPT_POSITIONS, ACCEPT_CONTEXT)
    kept = {"chain": [], "tree": []}
    for i in range(0, len(contexts), 64):
        ctx = contexts[i:i + 64]
        features = base.model(input_ids=ctx).last_hidden_state[:, :-1]  # f_0 .. f_{c-2}
        truth = demo_eval.greedy_tokens(base, ctx, ACCEPT_DEPTH)  # [B, depth]: t_c, t_{c+1}, ...
        for name, width in (("chain", 1), ("tree", TREE_WIDTH)):
            tokens, feats = ctx[:, 1:], features  # position j: t_{j+1}, f_j
            alive = torch.ones(len(ctx), dtype=torch.bool)
            count = torch.zeros(len(ctx), dtype=torch.long)
            for d in range(ACCEPT_DEPTH):
                out = head(base.model.embed_tokens(tokens), feats)[:, -1]  # the guess of the next feature
                top = draft_ids[(out @ base.lm_head.weight[draft_ids].T)
                                .topk(width if d < 2 else 1, dim=-1).indices]
                hit = alive & (top == truth[:, d:d + 1]).any(dim=1)
                count += hit.long()
                alive = hit  # follow the base's own token: in a tree it is the matching child, if any
                tokens = torch.cat([tokens, truth[:, d:d + 1]], dim=1)
                feats = torch.cat([feats, out[:, None]], dim=1)
            kept[name].append(count)
    result = {"positions": len(contexts), "context_tokens": ACCEPT_CONTEXT, "depth": ACCEPT_DEPTH,
              "tree_width": TREE_WIDTH, "draft_vocab": len(draft_ids),
              "heldout_tokens_in_draft_vocab": round(torch.isin(stream, draft_ids).double().mean().item(), 4)}
    for name, counts in kept.items():
        counts = torch.cat(counts).double()
        result[f"{name}_mean_accepted_per_round"] = round(counts.mean().item(), 4)
        result[f"{name}_tokens_per_round"] = round(counts.mean().item() + 1, 4)
    return result


def save(head: EagleHead, draft_ids: torch.Tensor, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(torch.bfloat16) for k, v in head.head_state_dict().items()}
    tensors["d2t"] = draft_ids - torch.arange(len(draft_ids))  # EAGLE-3's convention: target id - draft id
    save_file(tensors, out / "eagle_head.safetensors")
    (out / "eagle_config.json").write_text(json.dumps({"eagle_num_layers": 1}, indent=2) + "\n")


def load_shipped(base) -> EagleHead:
    """The head in the demo base's directory (its draft vocabulary left out)."""
    head = EagleHead(base.config)
    state = load_file(ASSETS / "base" / "eagle_head.safetensors")
    state.pop("d2t", None)
    head.load_state_dict({k: v.float() for k, v in state.items()})
    return head.eval()


def main() -> None:
    args = parse_args(__doc__, extra=lambda p: p.add_argument(
        "--vocabulary-only", action="store_true",
        help="keep the shipped head's weights: set its draft vocabulary from the data and measure it again"))
    start = time.perf_counter()
    base, streams = frozen_base_and_data(args)
    if args.vocabulary_only:
        head, trained = load_shipped(base), json.loads((ASSETS / "metrics.json").read_text())["eagle"]
        losses = []
    else:
        head = new_head(base)
        losses = train(head, base, streams["train", "all"], QUICK_STEPS if args.quick else STEPS, args.seed)
        head.eval()
    draft_ids = draft_vocabulary(streams["train", "all"], base.config.vocab_size)
    result = acceptance(head, base, streams["heldout", "all"], draft_ids)
    save(head, draft_ids, args.out or ASSETS / "base")
    # the training's own record stands; only the draft vocabulary and acceptance are new
    if args.vocabulary_only:
        result = {k: v for k, v in trained.items() if k not in result} | result | {
            "vocabulary_set_by": "python scripts/train_eagle.py --vocabulary-only"}
        metrics = json.loads((ASSETS / "metrics.json").read_text()) | {"eagle": result}
        (ASSETS / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        (ASSETS / "MODEL_CARD.md").write_text(demo_eval.model_card(metrics))
        print(json.dumps(result, indent=2))
        return
    record("eagle", result, losses, args, "train_eagle.py", start)


if __name__ == "__main__":
    main()
