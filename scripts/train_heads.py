"""Train Medusa heads on the frozen demo base model (numaserve/assets/demo/base), seeded.

    python scripts/train_heads.py --seed 0 --threads 2              # a few minutes on 2 cores
    python scripts/train_heads.py --quick --out /tmp/demo-heads      # smoke run

Writes medusa_heads.safetensors (bf16) and medusa_config.json into base/ (or --out), and the heads'
held-out greedy acceptance into metrics.json under "medusa" (the model card renders it). The data is
train_demo.py's: the standard library's .py files, its held-out files never trained on. Head k reads the
base's final-norm hidden state at position t and learns the token at t + k + 2 (cross-entropy), its
projection starting from the base's LM head and its residual block from zero, as in the Medusa paper.
"""

import json
import time
from pathlib import Path

import demo_eval
import torch
import torch.nn.functional as F
import transformers
from head_modules import medusa_heads
from head_training import frozen_base_and_data, parse_args, record, train_loop
from safetensors.torch import save_file
from train_demo import ASSETS

NUM_HEADS, NUM_LAYERS = 3, 1
STEPS, QUICK_STEPS = 600, 20
ACCEPT_POSITIONS, ACCEPT_CONTEXT = 512, 64


def new_heads(base: transformers.LlamaForCausalLM) -> torch.nn.ModuleList:
    heads = medusa_heads(base.config.hidden_size, base.config.vocab_size, NUM_HEADS, NUM_LAYERS)
    for head in heads:
        for block in head[:-1]:
            torch.nn.init.zeros_(block.linear.weight)
            torch.nn.init.zeros_(block.linear.bias)
        head[-1].weight.data.copy_(base.lm_head.weight.data)
    return heads


def heads_loss(heads: torch.nn.ModuleList, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """hidden [B, S, H] at every position, ids [B, S]: mean over heads of head k's cross-entropy against
    the token k + 2 places on."""
    losses = []
    for k, head in enumerate(heads):
        n = ids.shape[1] - k - 2
        logits = head(hidden[:, :n])
        losses.append(F.cross_entropy(logits.flatten(0, 1), ids[:, k + 2:k + 2 + n].flatten()))
    return torch.stack(losses).mean()


def train(heads, base, stream: torch.Tensor, steps: int, seed: int) -> list[float]:
    """The heads on random windows of the stream (head_training.train_loop); the base stays frozen."""
    def step_loss(ids: torch.Tensor) -> tuple[torch.Tensor, str]:
        with torch.no_grad():
            hidden = base.model(input_ids=ids).last_hidden_state
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return heads_loss(heads, hidden, ids), ""

    return train_loop(heads, stream, steps, seed, step_loss)


@torch.no_grad()
def acceptance(heads, base, stream: torch.Tensor, num_positions: int, context_len: int) -> dict:
    """Greedy chain speculation, one round per held-out position: the base's next token from the context,
    then the heads' guesses for the tokens after it (head k: k + 2 places on) against the base's own
    greedy continuation; a round accepts the longest matching prefix of the guesses."""
    contexts = demo_eval.eval_windows(stream, num_positions, context_len)
    accepted = []
    for i in range(0, len(contexts), 64):
        ctx = contexts[i:i + 64]
        hidden = base.model(input_ids=ctx).last_hidden_state[:, -1]  # [B, H]: the row giving the next token
        guesses = torch.stack([head(hidden).argmax(-1) for head in heads], dim=1)  # [B, K]
        target = demo_eval.greedy_tokens(base, ctx, len(heads) + 1)[:, 1:]  # after the next token
        accepted.append((guesses == target).long().cumprod(dim=1).sum(dim=1))
    accepted = torch.cat(accepted).double()
    per_position = [round(v, 4) for v in (torch.stack([accepted > k for k in range(len(heads))]).double()
                                          .mean(dim=1)).tolist()]
    return {"heads": len(heads), "positions": len(accepted), "context_tokens": context_len,
            "mean_accepted_per_round": round(accepted.mean().item(), 4),
            "tokens_per_round": round(accepted.mean().item() + 1, 4), "accepted_at_depth": per_position}


def save(heads: torch.nn.ModuleList, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in heads.state_dict().items()},
              out / "medusa_heads.safetensors")
    (out / "medusa_config.json").write_text(json.dumps({"medusa_num_heads": NUM_HEADS,
                                                        "medusa_num_layers": NUM_LAYERS}, indent=2) + "\n")


def main() -> None:
    args = parse_args(__doc__)
    start = time.perf_counter()
    base, streams = frozen_base_and_data(args)
    heads = new_heads(base)
    before = acceptance(heads, base, streams["heldout", "all"], ACCEPT_POSITIONS, ACCEPT_CONTEXT)
    losses = train(heads, base, streams["train", "all"], QUICK_STEPS if args.quick else STEPS, args.seed)
    heads.eval()
    result = acceptance(heads, base, streams["heldout", "all"], ACCEPT_POSITIONS, ACCEPT_CONTEXT)
    save(heads, args.out or ASSETS / "base")
    record("medusa", result | {"untrained_mean_accepted_per_round": before["mean_accepted_per_round"]},
           losses, args, "train_heads.py", start)


if __name__ == "__main__":
    main()
