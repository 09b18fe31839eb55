"""Input processing: a caller's prompt and options into a validated Request, on the caller's own thread
(tokenizing, compiling a grammar, setting up the detokenizer are never work of the loop that steps the
engine)."""

from cluster_configs.sampling_params import SamplingParams
from models.tokenizer import IncrementalDetokenizer
from scheduling.lora.adapter_store import AdapterStore
from scheduling.request import Request
from scheduling.sampling.structured import Grammars
from scheduling.validation import RequestLimits, validate_request

Prompt = str | list[int]


class InputProcessor:
    def __init__(self, limits: RequestLimits, tokenizer, adapters: AdapterStore,
                 eos_token_ids: tuple[int, ...]):
        """limits: what a request is validated against (max_model_len set); tokenizer: None for a model
        without one (prompts are token ids then)."""
        self.limits = limits
        self.tokenizer = tokenizer
        self.adapters = adapters
        self.grammars = Grammars(tokenizer, limits.vocab_size, eos_token_ids)

    def make_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None, *,
                     adapter: str | None = None, cache_salt: str | None = None,
                     prompt_logits: bool = False, pooling: bool = False,
                     remote_adapter: bool = False) -> Request:
        """A validated request, not yet queued: every InvalidRequest of its content is raised here.
        remote_adapter: adapter is an id registered and checked elsewhere whose weights come with the request
        (a worker's), so this engine's registry is not asked; else adapter is a name, served as its current
        version's id."""
        registry = None if remote_adapter else self.adapters.served
        prompt_ids, params = validate_request(prompt, params, self.limits, tokenizer=self.tokenizer,
                                              adapter=adapter, adapters=registry,
                                              cache_salt=cache_salt, prompt_only=prompt_logits or pooling)
        adapter_id = adapter if remote_adapter or adapter is None else registry[adapter]  # its version now
        req = Request(request_id, prompt_ids, params, adapter_id=adapter_id, cache_salt=cache_salt,
                      prompt_logits=prompt_logits, pooling=pooling, max_model_len=self.limits.max_model_len)
        if self.tokenizer is not None and not req.prompt_only:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids)
        if params.structured_outputs is not None:
            req.matcher = self.grammars.matcher(params.structured_outputs)
        return req
