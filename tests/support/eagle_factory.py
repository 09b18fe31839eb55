"""An EAGLE head for the tiny test models, written beside a copy of a model: random, or fitted in a few
seconds to the model's own greedy continuations of some prompts (so its drafts pass often on those
prompts and fail sometimes); and a recorder of the tokens an engine's proposer drafts."""

import json
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, GenerationConfig

import numaserve as ns
from models.proposers.eagle_head import CONFIG_FILE, HEAD_FILE
from scripts.head_modules import EagleHead


def model_with_eagle(model_dir: Path, out_dir: Path, prompts: list[list[int]] | None = None,
                     new_tokens: int = 32, steps: int = 300, seed: int = 0) -> Path:
    shutil.copytree(model_dir, out_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    head = EagleHead(model.config)
    if prompts:
        generation = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=None,
                                      pad_token_id=0)
        data = []
        with torch.no_grad():
            for prompt in prompts:
                ids = model.generate(torch.tensor([prompt]),
                                     attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                     generation_config=generation)
                data.append((ids, model.model(ids).last_hidden_state, model.model.embed_tokens(ids)))
        optimizer = torch.optim.Adam(head.parameters(), lr=3e-3)
        for _ in range(steps):
            loss = 0.0
            for ids, features, embeds in data:
                guess = head(embeds[:, 1:-1], features[:, :-2])
                loss = loss + F.smooth_l1_loss(guess, features[:, 1:-1]) + 0.1 * F.cross_entropy(
                    model.lm_head(guess)[0], ids[0, 2:])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    save_file(head.eval().head_state_dict(), out_dir / HEAD_FILE)
    (out_dir / CONFIG_FILE).write_text(json.dumps({"eagle_num_layers": 1}))
    return out_dir


def record_drafts(llm: ns.LLM) -> list[int]:
    """A list that collects every token llm's proposer drafts from now on (before any cut: the grammar's,
    the verification's)."""
    proposer, drafted = llm.engine.speculation.proposer, []
    propose = proposer.propose

    def recording(requests, depths):
        drafts = propose(requests, depths)
        drafted.extend(t for d in drafts for t in (d if isinstance(d, list) else d.tokens))
        return drafts

    proposer.propose = recording
    return drafted
