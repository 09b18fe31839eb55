"""What training a draft head on the frozen demo base shares (train_heads.py, train_eagle.py): the command
line, the frozen base and train_demo.py's data, and recording the result in metrics.json and the model
card."""

import argparse
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import demo_eval
import torch
import transformers
from tokenizers import Tokenizer
from train_demo import ASSETS, collect_corpus, encode_corpus, load_model

LR, BATCH, SEQ_LEN = 1e-3, 8, 256  # AdamW's peak rate; random windows per step, tokens per window


def parse_args(doc: str,
               extra: Callable[[argparse.ArgumentParser], object] | None = None) -> argparse.Namespace:
    """The scripts' shared options; extra(parser) adds a script's own."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0, help="seed of the windows sampled for training")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch threads")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: a few steps on a sixteenth of the files")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write the head (default: the demo base)")
    if extra is not None:
        extra(parser)
    return parser.parse_args()


def frozen_base_and_data(args: argparse.Namespace) -> tuple[transformers.LlamaForCausalLM, dict]:
    """The demo base (float32, frozen) and the token streams by (split, subset); seeds torch with
    args.seed."""
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    base = load_model(ASSETS / "base")
    base.requires_grad_(False)
    tokenizer = Tokenizer.from_file(str(ASSETS / "base" / "tokenizer.json"))
    streams = encode_corpus(tokenizer, collect_corpus(args.quick))
    torch.manual_seed(args.seed)
    return base, streams


def record(key: str, result: dict, losses: list[float], args: argparse.Namespace, script: str,
           start: float) -> None:
    """Print the result; for the shipped family (no --out), also into metrics.json[key] and the model card."""
    result = result | {"steps": len(losses), "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4),
                       "seed": args.seed, "threads": args.threads,
                       "reproduce": f"python scripts/{script} --seed {args.seed} --threads {args.threads}",
                       "runtime_s": round(time.perf_counter() - start, 1)}
    print(json.dumps(result, indent=2))
    if args.out is None:
        metrics_path = ASSETS / "metrics.json"
        metrics = json.loads(metrics_path.read_text()) | {key: result}
        metrics_path.write_text(json.dumps(metrics, indent=2) + "\n")
        (ASSETS / "MODEL_CARD.md").write_text(demo_eval.model_card(metrics))


def train_loop(module: torch.nn.Module, stream: torch.Tensor, steps: int, seed: int,
               step_loss: Callable[[torch.Tensor], tuple[torch.Tensor, str]]) -> list[float]:
    """AdamW with a cosine decay over `steps` batches of BATCH random SEQ_LEN-token windows of the stream
    (seeded); step_loss(ids [BATCH, SEQ_LEN]) -> (the loss, words for the progress line). -> the losses."""
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                 lambda s: 0.1 + 0.45 * (1 + math.cos(math.pi * s / steps)))
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for step in range(steps):
        starts = torch.randint(0, len(stream) - SEQ_LEN, (BATCH,), generator=generator)
        ids = torch.stack([stream[s:s + SEQ_LEN] for s in starts.tolist()])
        loss, detail = step_loss(ids)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step}: loss {loss.item():.3f}{detail}", flush=True)
    return losses
