"""Evaluation of the demo model family: perplexities, speculative acceptance, greedy samples, model card."""

import math

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers import LlamaForCausalLM


def eval_windows(stream: torch.Tensor, num_windows: int, seq_len: int) -> torch.Tensor:
    """Evenly spaced, non-overlapping windows of a token stream -> [num_windows, seq_len]."""
    num_chunks = len(stream) // seq_len
    starts = torch.linspace(0, num_chunks - 1, min(num_windows, num_chunks)).long() * seq_len
    return torch.stack([stream[s:s + seq_len] for s in starts.tolist()])


def lm_loss(model: LlamaForCausalLM, ids: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy over every position of ids: [B, S] -> scalar."""
    logits = model(input_ids=ids).logits[:, :-1]  # [B, S-1, vocab]
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction=reduction)


@torch.no_grad()
def perplexity(model: LlamaForCausalLM, windows: torch.Tensor, batch_size: int = 16) -> float:
    total_nll = sum(lm_loss(model, windows[i:i + batch_size], "sum").item()
                    for i in range(0, len(windows), batch_size))
    return math.exp(total_nll / windows[:, 1:].numel())


def unigram_perplexity(train_stream: torch.Tensor, windows: torch.Tensor, vocab_size: int) -> float:
    """Perplexity of an add-one-smoothed unigram model fitted on the training tokens."""
    counts = torch.bincount(train_stream, minlength=vocab_size).double() + 1.0
    log_probs = (counts / counts.sum()).log()
    return math.exp(-log_probs[windows[:, 1:]].mean().item())


@torch.no_grad()
def greedy_tokens(model: LlamaForCausalLM, ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Greedy continuation of every row of ids: [B, S] -> [B, num_tokens] (no early stop)."""
    out = model(input_ids=ids, use_cache=True)
    new_ids = [out.logits[:, -1].argmax(-1)]
    for _ in range(num_tokens - 1):
        out = model(input_ids=new_ids[-1][:, None], past_key_values=out.past_key_values, use_cache=True)
        new_ids.append(out.logits[:, -1].argmax(-1))
    return torch.stack(new_ids, dim=1)


@torch.no_grad()
def draft_acceptance(draft: LlamaForCausalLM, target: LlamaForCausalLM, stream: torch.Tensor,
                     num_positions: int, context_len: int, depth: int, batch_size: int = 64) -> dict:
    """Greedy speculative decoding, one round per held-out position: the draft proposes `depth`
    greedy tokens after the context, the target keeps the longest prefix equal to its own greedy
    choices. Returns accepted tokens per proposed token, averaged over positions."""
    contexts = eval_windows(stream, num_positions, context_len)
    accepted = []
    for i in range(0, len(contexts), batch_size):
        ctx = contexts[i:i + batch_size]
        proposed = greedy_tokens(draft, ctx, depth)  # [B, depth]
        logits = target(input_ids=torch.cat([ctx, proposed], dim=1)).logits
        verified = logits[:, context_len - 1:-1].argmax(-1)  # target's choice at each proposed slot
        accepted.append((verified == proposed).long().cumprod(dim=1).sum(dim=1))
    accepted = torch.cat(accepted).double()
    return {"depth": depth, "positions": len(accepted), "context_tokens": context_len,
            "accepted_per_proposed": round(accepted.mean().item() / depth, 4),
            "mean_accepted_per_round": round(accepted.mean().item(), 4)}


def continuation(model: LlamaForCausalLM, tokenizer: Tokenizer, prompt: str, max_tokens: int) -> str:
    """Greedy continuation of BOS + prompt, cut at the first EOS."""
    ids = torch.tensor([tokenizer.encode(prompt).ids])
    new_ids = greedy_tokens(model, ids, max_tokens)[0].tolist()
    eos_id = tokenizer.token_to_id("</s>")
    return tokenizer.decode(new_ids[:new_ids.index(eos_id)] if eos_id in new_ids else new_ids)


def _fence(text: str) -> str:
    return "```python\n" + text + "\n```"


def _medusa_paragraph(medusa: dict | None) -> str:
    if medusa is None:
        return ""
    depths = ", ".join(f"{a:.3f}" for a in medusa["accepted_at_depth"])
    return f"""
**Medusa heads** (`base/medusa_heads.safetensors`, {medusa['heads']} heads of one residual block and their own
projection, trained on the frozen base by `{medusa['reproduce']}` in {medusa['runtime_s']:.0f} s,
{medusa['steps']} steps): greedy chain acceptance {medusa['mean_accepted_per_round']:.2f} of {medusa['heads']}
guesses per round ({medusa['tokens_per_round']:.2f} tokens per verification; untrained heads, the base's
LM head copied: {medusa['untrained_mean_accepted_per_round']:.2f}), over {medusa['positions']} held-out
positions with {medusa['context_tokens']} tokens of context; share of rounds accepting at least 1, 2, ...
guesses: {depths}. Head k guesses the token k + 2 places on from the hidden state that gives the next one.
"""


def _eagle_paragraph(eagle: dict | None) -> str:
    if eagle is None:
        return ""
    return f"""
**EAGLE head** (`base/eagle_head.safetensors`: fc over [token embedding; feature], one decoder layer of the
base's shape and a norm, sharing the base's embedding and LM head; trained on the frozen base by
`{eagle['reproduce']}` in {eagle['runtime_s']:.0f} s, {eagle['steps']} steps). It drafts from the
{eagle.get('draft_vocab', 'all')} tokens most frequent in the training data (`d2t`, set by
`{eagle.get('vocabulary_set_by', eagle['reproduce'])}`; \
{100 * eagle.get('heldout_tokens_in_draft_vocab', 1.0):.1f}% of the held-out
tokens). Greedy acceptance over {eagle['positions']} held-out positions with \
{eagle['context_tokens']} tokens of context, depth {eagle['depth']}:
chain {eagle['chain_mean_accepted_per_round']:.2f} drafts kept per round \
({eagle['chain_tokens_per_round']:.2f} tokens
per verification); tree (top {eagle['tree_width']} of the first two steps, every pair)
{eagle['tree_mean_accepted_per_round']:.2f} ({eagle['tree_tokens_per_round']:.2f} tokens per verification).
"""


def model_card(m: dict) -> str:
    """The MODEL_CARD.md text for the metrics dict written by train_demo.py."""
    data, held, spec = m["data"], m["heldout"], m["speculation"]
    adapter_rows = "\n".join(
        f"| `{name}` | {a['heldout_files']} | {a['base_ppl']:.2f} | {a['adapter_ppl']:.2f} "
        f"| {a['other_subset_base_ppl']:.2f} | {a['other_subset_adapter_ppl']:.2f} |"
        for name, a in m["adapters"].items())
    samples = "\n\n".join(f"**{name}**, prompt `{m['samples']['prompt']!r}`:\n\n"
                          f"{_fence(m['samples']['prompt'] + text)}"
                          for name, text in m["samples"]["continuations"].items())
    return f"""# numaserve demo model family

Tiny Llama-architecture models trained from scratch by `scripts/train_demo.py` so that the engine has
real weights to serve without downloading anything. They write Python-looking code; they are a
demonstration of serving, not a useful code model.

| dir | what | parameters |
|---|---|---|
| `base/` | LlamaForCausalLM, hidden {m['shapes']['base']['hidden_size']}, \
{m['shapes']['base']['num_hidden_layers']} layers, {m['shapes']['base']['num_attention_heads']} heads / \
{m['shapes']['base']['num_key_value_heads']} KV heads, tied embeddings | {m['params']['base']:,} |
| `draft/` | same tokenizer, hidden {m['shapes']['draft']['hidden_size']}, \
{m['shapes']['draft']['num_hidden_layers']} layers, for speculative decoding | {m['params']['draft']:,} |
| `adapters/tests/` | LoRA (PEFT format) on `base`, trained on test modules | {m['params']['adapter']:,} |
| `adapters/library/` | LoRA (PEFT format) on `base`, trained on library modules \
| {m['params']['adapter']:,} |

Weights are bfloat16 safetensors in Hugging Face format; each model directory carries the tokenizer
(byte-level BPE, {m['vocab_size']} tokens, `<unk>`=0 `<s>`=1 `</s>`=2; `encode` prepends `<s>`).
Training context is {m['seq_len']} tokens (`max_position_embeddings` says 1024; quality past
{m['seq_len']} is not trained). LoRA: r={m['lora']['r']}, alpha={m['lora']['alpha']}, on
{', '.join(m['lora']['target_modules'])}.

## Data

The `.py` source files of the Python {data['python_version']} standard library (`{data['stdlib_root']}`),
excluding site-packages, files over {data['max_file_bytes']:,} bytes, files that are not UTF-8 and
files whose header says they are generated: {data['files']} files, {data['train_tokens']:,} training tokens.
License of the data: Python Software Foundation License (PSF-2.0). Every
{data['heldout_every']}th file in sorted path order ({data['heldout_files']} files) is held out and never
trained on. Subsets: **tests** (paths under a `test`/`tests`/`idle_test` directory or named `test_*.py`)
and **library** (the rest).

## Results (held-out files, weights as saved in bf16, evaluated in float32)

| model | perplexity per token |
|---|---|
| unigram baseline (add-one smoothing, fitted on training tokens) | {held['unigram_ppl']:.1f} |
| draft | {held['draft_ppl']:.2f} |
| base | {held['base_ppl']:.2f} |

Over {held['tokens']:,} predicted tokens ({held['windows']} windows of {m['seq_len']} tokens).

**Greedy draft acceptance at depth {spec['depth']}:** {spec['accepted_per_proposed']:.3f} accepted tokens
per proposed token ({spec['mean_accepted_per_round']:.2f} of {spec['depth']} per round), over
{spec['positions']} held-out positions with {spec['context_tokens']} tokens of context each; the
draft proposes {spec['depth']} greedy tokens and the base keeps the prefix that matches its own
greedy choices.
{_medusa_paragraph(m.get("medusa"))}{_eagle_paragraph(m.get("eagle"))}
**Adapters** (perplexity on held-out files of their own subset, and of the other subset):

| adapter | own held-out files | base | base + adapter | other subset: base | other subset: + adapter |
|---|---|---|---|---|---|
{adapter_rows}

## Greedy continuations

{samples}

## Reproduce

```bash
{m['reproduce']}
```

Deterministic for a given seed, thread count, library versions ({', '.join(f'{k} {v}' for k, v in
m['versions'].items())}) and Python standard library. This run took {m['runtime_s']['total']:.0f} s
with {m['threads']} thread(s); `metrics.json` holds every number above.
"""
