"""Medusa heads for the tiny test models, written beside a copy of a model: random, or fitted in a few
seconds to the model's own greedy continuations of some prompts (so drafts from them pass often on those
prompts and fail sometimes: both sides of verification get exercised)."""

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, GenerationConfig

from models.proposers.medusa_head import CONFIG_FILE, HEADS_FILE
from scripts.head_modules import medusa_heads


def make_heads(hidden: int, vocab: int, num_heads: int, num_layers: int = 1,
               seed: int = 0) -> torch.nn.ModuleList:
    """Medusa heads as the Medusa repository builds them, randomly initialized."""
    torch.manual_seed(seed)
    return medusa_heads(hidden, vocab, num_heads, num_layers).eval()


def save_heads(directory: Path, heads: torch.nn.ModuleList, num_layers: int = 1) -> None:
    save_file({k: v.contiguous() for k, v in heads.state_dict().items()}, directory / HEADS_FILE)
    (directory / CONFIG_FILE).write_text(json.dumps({"medusa_num_heads": len(heads),
                                                     "medusa_num_layers": num_layers}))


def model_with_heads(model_dir: Path, out_dir: Path, num_heads: int, prompts: list[list[int]] | None = None,
                     new_tokens: int = 32, steps: int = 300) -> Path:
    """A copy of model_dir with Medusa heads beside it: random, or (prompts given) fitted with Adam to
    predict the model's greedy continuation of each prompt k + 2 tokens ahead of every position."""
    shutil.copytree(model_dir, out_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = model.config
    heads = make_heads(cfg.hidden_size, cfg.vocab_size, num_heads)
    if prompts:
        generation = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=None,
                                      pad_token_id=0)
        features, targets = [], []
        with torch.no_grad():
            for prompt in prompts:
                ids = model.generate(torch.tensor([prompt]),
                                     attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                     generation_config=generation)
                features.append(model.model(ids).last_hidden_state[0])  # [L, H], what the heads read
                targets.append(ids[0])
        for head in heads:  # start each projection from the model's own LM head, as Medusa does
            head[-1].weight.data.copy_(model.lm_head.weight.data)
            torch.nn.init.zeros_(head[0].linear.weight)
            torch.nn.init.zeros_(head[0].linear.bias)
        optimizer = torch.optim.Adam(heads.parameters(), lr=3e-3)
        for _ in range(steps):
            loss = 0.0
            for k, head in enumerate(heads):
                for h, ids in zip(features, targets):
                    n = len(ids) - k - 2  # position t predicts token t + k + 2
                    loss = loss + torch.nn.functional.cross_entropy(head(h[:n]), ids[k + 2:k + 2 + n])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    save_heads(out_dir, heads.eval())
    return out_dir
