"""Speculation: the one interface the engine drafts through, and the engine's choice of it.

`make_speculation` gives a Speculator (one method), a MethodChooser (method "auto": one of several per
step) or NoSpeculation (off): the engine calls the same methods on each, every step, and never asks
which it has.
"""

from dataclasses import replace
from pathlib import Path
from typing import Protocol

from cluster_configs.diagnostics import DecisionLog
from cluster_configs.engine_config import EngineConfig
from cluster_configs.speculation_config import SpeculationConfig
from models.checkpoint import load_vocabulary
from models.decoder import DecoderModel
from models.model_spec import ModelSpec
from models.proposers import auto_candidates, make_proposer
from models.tensor_parallel.collectives import WHOLE
from scheduling.batcher import Batcher
from scheduling.model_runner import RunOutput
from scheduling.outputs import SamplerOutput
from scheduling.plan import StepPlan
from scheduling.sampling.sampler import sample_batch
from scheduling.speculation.depth_policy import SpecTelemetry, SpeculationPolicy
from scheduling.speculation.method_chooser import MethodChooser
from scheduling.speculation.speculator import Speculator, spec_stats_off
from scheduling.step_stats import StepStats


class Speculation(Protocol):
    needs_hidden: bool  # the model runner keeps every row's final hidden state for the proposers

    def propose(self, plan: StepPlan, batcher: Batcher) -> StepPlan:
        """The plan with this step's drafts scheduled (where budget and blocks allow); preempted requests'
        draft state is dropped."""

    def observe(self, plan: StepPlan, run: RunOutput, out: SamplerOutput, stats: StepStats) -> None:
        """After the step: what was verified and what the step cost."""

    def free(self, request_id: str) -> None:
        """The request finished: drop its draft state."""

    def telemetries(self) -> tuple[SpecTelemetry, ...] | None:
        """What a scheduler decides this engine's policies from, one record per method (None: off)."""

    def push_policies(self, policies: tuple[SpeculationPolicy, ...]) -> None:
        """The scheduler's answer to telemetries(): in force from the next step."""

    def stats(self) -> dict:
        """The spec_* entries of the engine's stats()."""


class NoSpeculation:
    """Speculation off: plain decode steps."""

    needs_hidden = False

    def propose(self, plan: StepPlan, batcher: Batcher) -> StepPlan:
        return plan

    def observe(self, plan: StepPlan, run: RunOutput, out: SamplerOutput, stats: StepStats) -> None:
        pass

    def free(self, request_id: str) -> None:
        pass

    def telemetries(self) -> None:
        return None

    def push_policies(self, policies: tuple[SpeculationPolicy, ...]) -> None:
        pass

    def stats(self) -> dict:
        return spec_stats_off()


def make_speculation(config: EngineConfig, spec: ModelSpec, tokenizer, model_path: str | Path,
                     model: DecoderModel, *, kv_cache_tokens: int, decisions: DecisionLog) -> Speculation:
    """An engine's speculation: a Speculator for one method, a MethodChooser over every candidate for method
    "auto", NoSpeculation when off. Proposers get the engine's dtypes and KV geometry and the target's
    weights, and find their side files (Medusa heads, ...) beside the model (a GGUF file's directory)."""
    spec_config = config.speculation
    if not spec_config.enabled:
        return NoSpeculation()
    model_dir = Path(model_path).parent if Path(model_path).suffix == ".gguf" else Path(model_path)
    window = min((w for w in spec.layer_windows if w > 0), default=0)

    target_weights = model.weights
    auto = spec_config.method == "auto"
    methods = auto_candidates(spec_config, model_dir) if auto else [spec_config.method]
    if model.collectives is not WHOLE and "eagle" in methods:
        # a tensor-parallel rank holds a share of the vocabulary: an EAGLE head, which runs on rank 0 alone,
        # gets the whole embedding and LM head
        embed, lm_head = load_vocabulary(model_path, "bfloat16" if config.weight_dtype == "auto"
                                         else config.weight_dtype)
        target_weights = replace(model.weights, embed=embed, lm_head=lm_head)

    def speculator(method_config: SpeculationConfig) -> Speculator:
        proposer = make_proposer(method_config, spec, tokenizer, kv_cache_tokens=kv_cache_tokens,
                                 block_size=config.block_size, weight_dtype=config.weight_dtype,
                                 kv_dtype=config.resolved_kv_dtype, activation_dtype=config.activation_dtype,
                                 decisions=decisions, sampler=sample_batch, model_dir=model_dir,
                                 target_weights=target_weights, target_weight_dtype=model.weight_dtype,
                                 max_model_len=config.max_model_len or spec.max_position_embeddings)
        return Speculator(method_config, proposer, decisions, window)

    if spec_config.method != "auto":
        return speculator(spec_config)
    return MethodChooser(spec_config, {m: speculator(spec_config.for_method(m))
                                       for m in auto_candidates(spec_config, model_dir)}, decisions)
