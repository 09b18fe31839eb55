"""Train the demo model family shipped in numaserve/assets/demo from the Python standard library.

    python scripts/train_demo.py --seed 0 --threads 2      # about 20 minutes on 2 cores
    python scripts/train_demo.py --quick --out /tmp/demo   # smoke run, a minute

Writes base/ and draft/ (HF Llama checkpoints, bf16 safetensors, with tokenizer), adapters/tests/ and
adapters/library/ (PEFT LoRA), metrics.json and MODEL_CARD.md. Needs torch, transformers, tokenizers.
"""

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import demo_eval
import demo_lora
import tokenizers
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from numaserve import demo_corpus

ASSETS = Path(__file__).resolve().parents[1] / "numaserve" / "assets" / "demo"
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2 as in Llama
CHAT_TEMPLATE = Path(__file__).parent / "demo_chat_template.jinja"  # conversations as a Python file
SHAPES = {  # LlamaConfig fields
    "base": {"hidden_size": 256, "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 4,
             "intermediate_size": 768},
    "draft": {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 384},
}
LORA_R, LORA_ALPHA = 8, 16
SAMPLE_PROMPT = "def"


@dataclasses.dataclass(frozen=True)
class Plan:
    vocab_size: int = 8192
    seq_len: int = 256
    batch_size: int = 8
    base_steps: int = 1200
    draft_steps: int = 500
    adapter_steps: int = 150
    base_lr: float = 2e-3
    draft_lr: float = 3e-3
    adapter_lr: float = 2e-3
    eval_windows: int = 128
    accept_positions: int = 512
    accept_context: int = 64
    accept_depth: int = 4
    sample_tokens: int = 48


QUICK = Plan(vocab_size=1024, base_steps=10, draft_steps=10, adapter_steps=5, eval_windows=8,
             accept_positions=16, sample_tokens=16)


@dataclasses.dataclass
class Corpus:
    """Source texts by split ("train"/"heldout") and subset ("tests"/"library")."""
    root: Path
    texts: dict[tuple[str, str], list[str]]

    def all(self, split: str) -> list[str]:
        return self.texts[split, "tests"] + self.texts[split, "library"]


def collect_corpus(quick: bool) -> Corpus:
    """The demo corpus (numaserve/demo_corpus.py) by split and subset."""
    texts = {(split, subset): [] for split in ("train", "heldout") for subset in ("tests", "library")}
    for kept, (path, text) in enumerate(demo_corpus.kept_files()):
        if not quick or kept % 16 == 0:  # --quick: every 16th file
            split = "heldout" if demo_corpus.is_heldout(kept) else "train"
            texts[split, demo_corpus.subset(path)].append(text)
    return Corpus(demo_corpus.stdlib_root(), texts)


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))])
    return tokenizer


def encode_stream(tokenizer: Tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts as one token stream, each file as <s> tokens </s>."""
    eos_id = tokenizer.token_to_id("</s>")
    encodings = tokenizer.encode_batch(texts)  # the post-processor prepends <s>
    return torch.tensor([i for e in encodings for i in [*e.ids, eos_id]], dtype=torch.long)


def encode_corpus(tokenizer: Tokenizer, corpus: Corpus) -> dict[tuple[str, str], torch.Tensor]:
    """Token streams by (split, subset), subset "all" included."""
    streams = {key: encode_stream(tokenizer, texts) for key, texts in corpus.texts.items()}
    for split in ("train", "heldout"):
        streams[split, "all"] = torch.cat([streams[split, "tests"], streams[split, "library"]])
    return streams


def new_model(shape: str, tokenizer: Tokenizer, seed: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(), max_position_embeddings=1024, rope_theta=10000.0,
        tie_word_embeddings=True, bos_token_id=tokenizer.token_to_id("<s>"),
        eos_token_id=tokenizer.token_to_id("</s>"), **SHAPES[shape])
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def train(model: LlamaForCausalLM, stream: torch.Tensor, plan: Plan, steps: int, lr: float,
          weight_decay: float, seed: int, name: str) -> None:
    """AdamW with linear warmup and cosine decay to lr/10 on random windows of the stream.

    Matmuls run in bfloat16 (torch autocast, AVX512-BF16 where the CPU has it: ~1.5x faster on 2 cores);
    weights, gradients and optimizer state stay float32.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(
        (step + 1) / warmup, 0.1 + 0.45 * (1 + math.cos(math.pi * step / steps))))
    generator = torch.Generator().manual_seed(seed)
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        starts = torch.randint(0, len(stream) - plan.seq_len, (plan.batch_size,), generator=generator)
        batch = torch.stack([stream[s:s + plan.seq_len] for s in starts.tolist()])  # [B, seq_len]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = demo_eval.lm_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps - 1:
            elapsed = time.perf_counter() - start
            print(f"[{name}] step {step + 1}/{steps} loss {loss.item():.3f} "
                  f"{(step + 1) * batch.numel() / elapsed:.0f} tok/s {elapsed:.0f}s", flush=True)
    model.eval()


def save_model(model: LlamaForCausalLM, tokenizer: Tokenizer, path: Path) -> None:
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            model_max_length=model.config.max_position_embeddings).save_pretrained(path)
    # transformers 5 writes rope_theta under rope_parameters and names its own tokenizer class;
    # the classic keys keep the checkpoint readable by transformers 4 and other loaders.
    _update_json(path / "config.json", rope_theta=model.config.rope_parameters["rope_theta"])
    _update_json(path / "tokenizer_config.json", tokenizer_class="PreTrainedTokenizerFast",
                 chat_template=CHAT_TEMPLATE.read_text())


def _update_json(path: Path, **updates) -> None:
    path.write_text(json.dumps(json.loads(path.read_text()) | updates, indent=2, sort_keys=True) + "\n")


def load_model(path: Path, adapter: Path | None = None) -> LlamaForCausalLM:
    """A saved (bf16) checkpoint in float32, with a LoRA adapter merged in if given."""
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return demo_lora.merge_adapter(model, adapter) if adapter else model


def train_adapter(out: Path, subset: str, streams: dict, plan: Plan, seed: int) -> int:
    """Train a LoRA on one subset over the saved base; returns its parameter count."""
    model = load_model(out / "base")
    wrapped = demo_lora.add_lora(model, LORA_R, LORA_ALPHA)
    train(model, streams["train", subset], plan, plan.adapter_steps, plan.adapter_lr, 0.0, seed,
          f"adapter/{subset}")
    demo_lora.save_adapter(out / "adapters" / subset, wrapped, LORA_R, LORA_ALPHA, torch.bfloat16)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def evaluate(out: Path, tokenizer: Tokenizer, streams: dict, corpus: Corpus, plan: Plan) -> dict:
    heldout = demo_eval.eval_windows(streams["heldout", "all"], plan.eval_windows, plan.seq_len)
    base, draft = load_model(out / "base"), load_model(out / "draft")
    metrics = {
        "heldout": {
            "windows": len(heldout), "tokens": heldout[:, 1:].numel(),
            "unigram_ppl": demo_eval.unigram_perplexity(streams["train", "all"], heldout,
                                                       tokenizer.get_vocab_size()),
            "base_ppl": demo_eval.perplexity(base, heldout),
            "draft_ppl": demo_eval.perplexity(draft, heldout),
        },
        "speculation": demo_eval.draft_acceptance(draft, base, streams["heldout", "all"],
                                                  plan.accept_positions, plan.accept_context,
                                                  plan.accept_depth),
        "adapters": {},
        "samples": {"prompt": SAMPLE_PROMPT, "continuations": {
            "base": demo_eval.continuation(base, tokenizer, SAMPLE_PROMPT, plan.sample_tokens)}},
    }
    subset_windows = {s: demo_eval.eval_windows(streams["heldout", s], plan.eval_windows, plan.seq_len)
                      for s in ("tests", "library")}
    for subset, other in (("tests", "library"), ("library", "tests")):
        adapted = load_model(out / "base", out / "adapters" / subset)
        metrics["adapters"][subset] = {
            "heldout_files": len(corpus.texts["heldout", subset]),
            "base_ppl": demo_eval.perplexity(base, subset_windows[subset]),
            "adapter_ppl": demo_eval.perplexity(adapted, subset_windows[subset]),
            "other_subset_base_ppl": demo_eval.perplexity(base, subset_windows[other]),
            "other_subset_adapter_ppl": demo_eval.perplexity(adapted, subset_windows[other]),
        }
        metrics["samples"]["continuations"][subset] = demo_eval.continuation(
            adapted, tokenizer, SAMPLE_PROMPT, plan.sample_tokens)
    return metrics


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch and tokenizers threads")
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (writes to --out)")
    parser.add_argument("--out", type=Path, default=None, help=f"output directory (default {ASSETS})")
    args = parser.parse_args()
    if args.out is None:
        if args.quick:
            parser.error("--quick needs an explicit --out, so the shipped checkpoints are not overwritten")
        args.out = ASSETS
    return args


class Stopwatch:
    """Seconds per named phase, printed as each phase ends."""

    def __init__(self):
        self.times: dict[str, float] = {}
        self._start = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.times[name] = round(now - self._start, 1)
        self._start = now
        print(f"== {name} done in {self.times[name]:.0f}s", flush=True)


def run_info(args: argparse.Namespace, plan: Plan, corpus: Corpus, streams: dict,
             tokenizer: Tokenizer) -> dict:
    quick = " --quick" if args.quick else ""
    out = "" if args.out == ASSETS else f" --out {args.out}"
    return {
        "reproduce": f"python scripts/train_demo.py --seed {args.seed} --threads {args.threads}{quick}{out}",
        "seed": args.seed, "threads": args.threads, "plan": dataclasses.asdict(plan),
        "vocab_size": tokenizer.get_vocab_size(), "seq_len": plan.seq_len, "shapes": SHAPES,
        "lora": {"r": LORA_R, "alpha": LORA_ALPHA, "target_modules": demo_lora.TARGET_MODULES},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__},
        "data": {
            "source": "Python standard library .py files", "license": "Python Software Foundation License",
            "python_version": sys.version.split()[0], "stdlib_root": str(corpus.root),
            "max_file_bytes": demo_corpus.MAX_FILE_BYTES, "heldout_every": demo_corpus.HELDOUT_EVERY,
            "files": sum(map(len, corpus.texts.values())), "heldout_files": len(corpus.all("heldout")),
            "train_tokens": len(streams["train", "all"]), "heldout_tokens": len(streams["heldout", "all"]),
        },
    }


def main() -> None:
    args = parse_args()
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)  # tokenizers' thread pool, read on first use
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    plan, out, seed = QUICK if args.quick else Plan(), args.out, args.seed
    stopwatch = Stopwatch()

    corpus = collect_corpus(args.quick)
    tokenizer = train_tokenizer(corpus.all("train"), plan.vocab_size)
    streams = encode_corpus(tokenizer, corpus)
    stopwatch.lap("data")

    params = {}
    for shape, steps, lr, model_seed in (("base", plan.base_steps, plan.base_lr, seed),
                                         ("draft", plan.draft_steps, plan.draft_lr, seed + 1)):
        model = new_model(shape, tokenizer, model_seed)
        params[shape] = sum(p.numel() for p in model.parameters())
        train(model, streams["train", "all"], plan, steps, lr, 0.1, model_seed, shape)
        save_model(model, tokenizer, out / shape)
        stopwatch.lap(shape)
    for i, subset in enumerate(("tests", "library")):
        params["adapter"] = train_adapter(out, subset, streams, plan, seed + 2 + i)
        stopwatch.lap(f"adapter/{subset}")

    metrics = evaluate(out, tokenizer, streams, corpus, plan)
    stopwatch.lap("eval")
    stopwatch.times["total"] = round(sum(stopwatch.times.values()), 1)
    metrics |= run_info(args, plan, corpus, streams, tokenizer) | {"params": params,
                                                                    "runtime_s": stopwatch.times}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    (out / "MODEL_CARD.md").write_text(demo_eval.model_card(metrics))
    print(json.dumps({k: metrics[k] for k in ("heldout", "speculation", "adapters", "samples")}, indent=2))


if __name__ == "__main__":
    main()
