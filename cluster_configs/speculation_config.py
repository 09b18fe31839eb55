"""SpeculationConfig: how an engine drafts tokens and verifies them in one target forward.

Nested in EngineConfig as `speculation` (a SpeculationConfig or a dict). Off by default. "medusa" and "eagle"
draft with trained heads beside the model (models/proposers/medusa_head.py, models/proposers/eagle_head.py).
"auto" weighs every method the model has (n-gram; Medusa and EAGLE when their heads are beside it; the draft
model when draft_model is set) and lets the best one draft each step
(scheduling/speculation/method_chooser.py).
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SpeculationMethod = Literal["off", "ngram", "draft", "medusa", "eagle", "auto"]
SpeculationMode = Literal["auto", "on", "latency_first", "throughput_first"]
MAX_TREE_WIDTH = 4  # the widest token tree a trained-head proposer drafts and measures


class SpeculationConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    method: SpeculationMethod = "off"
    num_speculative_tokens: int = Field(4, ge=1, le=16)  # the maximum draft depth k
    # n-gram prompt lookup: match the last n tokens, n from prompt_lookup_max down to prompt_lookup_min
    prompt_lookup_min: int = Field(2, ge=1, le=64)
    prompt_lookup_max: int = Field(4, ge=1, le=64)
    draft_model: str | None = None  # a model directory or GGUF file with the target's tokenizer
    # medusa: heads to draft with (None: every head in the file)
    num_heads: int | None = Field(None, ge=1, le=8)
    # medusa, eagle: the token tree's width, pinned (1: a chain); None: the policy chooses it per step
    tree_width: int | None = Field(None, ge=1, le=MAX_TREE_WIDTH)
    # "auto" picks the depth per step and request that maximizes measured goodput; "on" always drafts
    # num_speculative_tokens; "latency_first" / "throughput_first" bias auto's trade-off
    mode: SpeculationMode = "auto"
    # the share of a step's tokens that draft tokens may take (1.0 = no cap beyond the goodput model)
    max_compute_fraction: float = Field(1.0, gt=0.0, le=1.0)

    @model_validator(mode="after")
    def _consistent(self) -> "SpeculationConfig":
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("draft_model is required when method='draft'; "
                             "pass a model directory or GGUF file")
        if self.method not in ("draft", "auto") and self.draft_model is not None:
            raise ValueError(f"draft_model is set but method={self.method!r}; use method='draft' (or 'auto') "
                             "or drop draft_model")
        if self.method not in ("medusa", "auto") and self.num_heads is not None:
            raise ValueError(f"num_heads is set but method={self.method!r}; use method='medusa' (or 'auto') "
                             "or drop num_heads")
        if self.method not in ("medusa", "eagle", "auto") and self.tree_width is not None:
            raise ValueError(f"tree_width is set but method={self.method!r}; token trees are drafted by "
                             "method='medusa' or 'eagle' (or 'auto'): use one of them or drop tree_width")
        return self

    def for_method(self, method: str) -> "SpeculationConfig":
        """This config for one of the methods "auto" weighs: the fields that method does not take dropped."""
        return SpeculationConfig.model_validate(self.model_dump() | {
            "method": method, "draft_model": self.draft_model if method == "draft" else None,
            "num_heads": self.num_heads if method == "medusa" else None,
            "tree_width": self.tree_width if method in ("medusa", "eagle") else None})

    @property
    def enabled(self) -> bool:
        return self.method != "off"
