"""Draft proposers for speculative decoding, behind one interface (base.Proposer)."""

from pathlib import Path

from cluster_configs.diagnostics import DecisionLog
from cluster_configs.speculation_config import SpeculationConfig
from memory.weights import ModelWeights
from models.model_spec import ModelSpec
from models.proposers.base import Proposer, SpecRequest
from models.proposers.draft import DraftModelProposer, DraftSampler, argmax_sampler, check_same_vocabulary
from models.proposers.eagle import EagleProposer
from models.proposers.eagle_head import CONFIG_FILE as EAGLE_CONFIG
from models.proposers.medusa import MedusaProposer
from models.proposers.medusa_head import CONFIG_FILE as MEDUSA_CONFIG
from models.proposers.ngram import NgramProposer
from models.tokenizer import Tokenizer


def make_proposer(config: SpeculationConfig, target_spec: ModelSpec, target_tokenizer: Tokenizer | None, *,
                  kv_cache_tokens: int, block_size: int, weight_dtype: str = "auto",
                  kv_dtype: str = "float32", activation_dtype: str = "auto",
                  decisions: DecisionLog | None = None, sampler: DraftSampler = argmax_sampler,
                  model_dir: str | None = None, target_weights: ModelWeights | None = None,
                  target_weight_dtype: str = "float32", max_model_len: int | None = None) -> Proposer | None:
    """The proposer of config.method (None when off). A draft model gets a KV pool of kv_cache_tokens
    tokens in blocks of block_size; pass the engine's weight, KV and activation dtypes so that a draft
    model equal to the target drafts exactly the target's greedy tokens; sampler: how a draft model picks
    its token from its logits (the engine's batched sampler; else the argmax). Medusa heads and an EAGLE head
    are read from beside the target in model_dir and stored in its served weight dtype (target_weight_dtype);
    an EAGLE head shares the target's embedding and LM head (target_weights). max_model_len: the engine's,
    which picks LongRoPE's factors (Phi-3) for a draft model and an EAGLE head as for the target (None: each
    model's own context)."""
    if config.method == "ngram":
        return NgramProposer(config)
    if config.method == "draft":
        return DraftModelProposer(config.draft_model, target_spec, target_tokenizer,
                                  kv_cache_tokens=kv_cache_tokens, block_size=block_size,
                                  weight_dtype=weight_dtype, kv_dtype=kv_dtype,
                                  activation_dtype=activation_dtype, decisions=decisions, sampler=sampler,
                                  max_model_len=max_model_len)
    if config.method == "medusa":
        return MedusaProposer(model_dir, target_spec, target_weight_dtype, config.num_heads,
                              config.tree_width)
    if config.method == "eagle":
        return EagleProposer(model_dir, target_spec, target_weights, target_weight_dtype,
                             kv_cache_tokens=kv_cache_tokens, block_size=block_size, kv_dtype=kv_dtype,
                             max_depth=config.num_speculative_tokens, fixed_width=config.tree_width,
                             activation_dtype=activation_dtype, max_model_len=max_model_len)
    return None


def auto_candidates(config: SpeculationConfig, model_dir: str | Path | None) -> list[str]:
    """The methods speculation method "auto" weighs: n-gram lookup always, Medusa and EAGLE where their heads
    sit beside the model, the draft model where one is configured."""
    beside = Path(model_dir) if model_dir is not None else None
    return (["ngram"] + (["medusa"] if beside and (beside / MEDUSA_CONFIG).is_file() else [])
            + (["eagle"] if beside and (beside / EAGLE_CONFIG).is_file() else [])
            + (["draft"] if config.draft_model else []))


__all__ = ["DraftModelProposer", "EagleProposer", "MedusaProposer", "NgramProposer", "Proposer",
           "SpecRequest", "auto_candidates", "check_same_vocabulary", "make_proposer"]
