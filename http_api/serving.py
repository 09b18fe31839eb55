"""OpenAIServing: the OpenAI endpoints over a deployment, without HTTP or Ray (actors/http_server.py wires it
to both; tests drive it with a stub deployment).

A request of n choices over several prompts is one deployment request per choice, opened, streamed and
collected together (http_api/choices.py).
"""

import asyncio
import base64
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from cluster_configs.cluster_config import HttpConfig
from cluster_configs.errors import InvalidRequest
from cluster_configs.sampling_params import SamplingParams
from http_api import tool_calls
from http_api.chat_template import ChatTemplate
from http_api.choices import (
    RequestStream,
    best_choices,
    check_num_choices,
    collect,
    open_choices,
    sse_stream,
)
from http_api.console_stats import ConsoleStats, console_stats
from http_api.errors import APIError, invalid_request, shown
from http_api.fill_in_middle import fim_prompt
from http_api.limits import ANONYMOUS, Caller, Tenancy, release_after
from http_api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoraAdapterRequest,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
)
from http_api.responses import (
    ChoiceState,
    ResponseHeader,
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    usage,
    vllm_prompt_logprobs,
)
from http_api.tokens import chat_prompt_ids, detokenize_body, tokenize_body
from scheduling.outputs import RequestOutput


@dataclass(frozen=True)
class CompletionInputs:
    """A completion request, checked."""
    prompts: list  # texts or token id lists (with a suffix: their fill-in-the-middle prompts)
    params: list[SamplingParams]  # one per choice of each prompt
    deadline_s: float | None
    constraint_param: str | None  # the request field a structured-output constraint came from
    echo_k: int | None  # the prompt logprobs echo asks for
    prompt_k: int | None  # the prompt logprobs to compute


@dataclass(frozen=True)
class ChatInputs:
    """A chat request, checked."""
    plan: tool_calls.ToolPlan
    prompt_ids: list[int]  # the rendered chat template's tokens
    k: int | None  # the logprobs asked for
    params: list[SamplingParams]  # one per choice
    deadline_s: float | None
    constraint_param: str | None  # the request field (or "tools") the constraint came from


class Deployment(Protocol):
    def generate(self, prompt, params: SamplingParams, adapter: str | None,
                 cache_salt: str | None = None) -> RequestStream: ...
    async def model_info(self) -> dict: ...  # tokenizer, vocab_size, max_model_len
    async def adapter_path(self, name: str) -> str | None: ...
    async def adapters(self) -> dict[str, str]: ...
    async def register_adapter(self, name: str, path: str) -> str: ...
    async def unload_adapter(self, name: str) -> None: ...
    async def num_serving_workers(self) -> int: ...
    async def metrics(self) -> list[dict]: ...  # each worker's snapshot (actors/metrics.py)
    async def live(self) -> dict: ...  # a recent copy of the router's live view (Router.live), or {"error"}
    # each prompt's token ids and its final hidden states pooled (scheduling/embedding.py), L2-normalized
    async def embed(self, prompts: list, pooling: str, adapter: str | None,
                    cache_salt: str | None = None) -> tuple[list[list[int]], np.ndarray]: ...


class OpenAIServing:
    def __init__(self, deployment: Deployment, model_name: str, model_path: str,
                 chat_template: ChatTemplate | None, enable_lora_loading: bool, fingerprint: str,
                 limits: HttpConfig | None = None):
        self.deployment = deployment
        self.tenancy = Tenancy(limits or HttpConfig())
        self.model_name, self.model_path = model_name, model_path
        self.chat_template = chat_template
        self.enable_lora_loading = enable_lora_loading
        self.fingerprint = fingerprint
        self._info: dict | None = None
        self._texts: TokenTexts | None = None
        self.created = int(time.time())  # /v1/models' created: when this server began serving the model

    async def info(self) -> dict:
        if self._info is None:
            self._info = await self.deployment.model_info()
            self._texts = TokenTexts(self._info["tokenizer"])
        return self._info

    async def max_model_len(self) -> int | None:
        return (await self.info())["max_model_len"]

    # ---- endpoints ---------------------------------------------------------------------------------------

    async def completions(self, req: CompletionRequest,
                          caller: Caller = ANONYMOUS) -> dict | AsyncIterator[bytes]:
        return await self._limited(req, caller, self._completions)

    async def chat(self, req: ChatCompletionRequest,
                   caller: Caller = ANONYMOUS) -> dict | AsyncIterator[bytes]:
        return await self._limited(req, caller, self._chat)

    async def _limited(self, req, caller: Caller, endpoint: Callable) -> dict | AsyncIterator[bytes]:
        """endpoint(req, cache_salt) counted against its client's concurrency bound until its answer is
        done."""
        release = self.tenancy.admit(self.tenancy.client(caller, req.user))
        try:
            salt = self.tenancy.cache_salt(caller.api_key, req.user, getattr(req, "cache_salt", None))
            result = await endpoint(req, salt)
        except BaseException:
            release()
            raise
        if isinstance(result, dict):
            release()
            return result
        return release_after(result, release)

    async def _completion_inputs(self, req: CompletionRequest) -> CompletionInputs:
        """A completion request checked."""
        await self.info()
        prompts = req.prompts()
        if req.suffix:
            prompts = [fim_prompt(self._info["tokenizer"], p, req.suffix) for p in prompts]
        req.check_best_of()
        check_num_choices(len(prompts), req.num_candidates)
        if req.max_tokens is not None:
            self.tenancy.check_max_tokens(req.max_tokens)
        deadline_s = self.tenancy.deadline_s(req.deadline_s)
        # echo with logprobs scores the prompt's tokens too (OpenAI's shape: the first one's logprob null)
        echo_k = req.logprobs if req.echo and req.logprobs is not None else None
        asked = [k for k in (echo_k, req.prompt_logprobs) if k is not None]
        prompt_k = max(asked) if asked else None
        constraint, constraint_param = req.constraint()
        params = req.sampling_params(req.max_tokens, req.logprobs, deadline_s, constraint, prompt_k)
        return CompletionInputs(prompts, params, deadline_s, constraint_param, echo_k, prompt_k)

    async def _completions(self, req: CompletionRequest, salt: str | None) -> dict | AsyncIterator[bytes]:
        adapter = await self._adapter(req.model)
        inputs = await self._completion_inputs(req)
        header = ResponseHeader.new("cmpl", "text_completion", req.model or self.model_name, self.fingerprint)
        requests = [(p, sp) for p in inputs.prompts for sp in inputs.params]
        choices, streams, firsts = await self._open(requests, adapter, "prompt", salt, inputs.deadline_s,
                                                    inputs.constraint_param)
        if req.echo:
            for c, (prompt, _) in zip(choices, requests):
                c.prompt_text = prompt if isinstance(prompt, str) else self._decode(c.prompt_ids)

        def logprobs_of(c: ChoiceState, token_ids: list[int], logprobs: list | None, offset: int,
                        with_prompt: bool) -> dict | None:
            generated = (completion_logprobs(self._texts, token_ids, logprobs, offset)
                         if logprobs is not None and req.logprobs is not None else None)
            if inputs.echo_k is not None and with_prompt:
                return echo_logprobs(self._texts, c.prompt_ids, c.prompt_logprobs, generated)
            return generated

        def extra(c: ChoiceState, first: bool) -> dict:
            if req.prompt_logprobs is None or not first:
                return {}
            return {"prompt_logprobs": vllm_prompt_logprobs(self._texts, c.prompt_logprobs,
                                                            inputs.prompt_k)}

        def delta(c: ChoiceState, out: RequestOutput) -> dict | None:
            first = c.num_outputs == 0
            if first and out.prompt_logprobs is not None:
                c.prompt_logprobs = out.prompt_logprobs
            echo = (c.prompt_text or "") if first else ""
            logprobs = logprobs_of(c, out.token_ids, out.logprobs, len(c.prompt_text or "") + len(c.text),
                                   first)
            if not (echo + out.text or out.token_ids and logprobs or out.finished):
                return None
            return {"index": c.index, "text": echo + out.text, "logprobs": logprobs,
                    "finish_reason": out.finish_reason} | extra(c, first)

        if req.stream:
            return sse_stream(header, choices, streams, firsts, delta, [], req)
        await collect(choices, streams, firsts)
        if any(c.finish_reason == "abort" for c in choices):  # nothing was sent: an error, not a cut answer
            raise self.tenancy.deadline_error(inputs.deadline_s)
        billed = usage(choices, req.num_candidates)  # every candidate's tokens, as OpenAI bills best_of
        if req.ranks_candidates:
            choices = best_choices(choices, req.n, req.best_of)
        return header.body([{"index": c.index, "text": (c.prompt_text or "") + c.text,
                             "logprobs": logprobs_of(c, c.token_ids, c.logprobs, len(c.prompt_text or ""),
                                                     True),
                             "finish_reason": c.finish_reason} | extra(c, True) for c in choices],
                           usage=billed)

    async def _chat_inputs(self, req: ChatCompletionRequest) -> ChatInputs:
        """A chat request checked."""
        info = await self.info()
        req.check_best_of()
        check_num_choices(1, req.num_candidates)
        plan = tool_calls.plan_tools([t.model_dump(exclude_none=True) for t in req.tools or ()],
                                     req.tool_choice if isinstance(req.tool_choice, str | None)
                                     else req.tool_choice.model_dump(), req.parallel_tool_calls,
                                     self.tenancy.config.tool_call_parser)
        constraint, constraint_param = req.constraint()
        if plan.constraint is not None:
            if constraint is not None:
                raise APIError(400, f"tool_choice constrains the output to tool calls and {constraint_param} "
                                    "to another format; send one", param=constraint_param)
            constraint, constraint_param = plan.constraint, "tools"
        # rendered and tokenized in a thread: a long chat in the event loop held up every stream it serves
        prompt_ids = await asyncio.to_thread(chat_prompt_ids, info, self.chat_template, self.model_name,
                                             req.messages, plan.tools, for_generation=True)
        k = req.num_logprobs()
        if req.max_new_tokens() is not None:
            self.tenancy.check_max_tokens(req.max_new_tokens())
        max_tokens = req.max_new_tokens() or min(max((info["max_model_len"] or 0) - len(prompt_ids), 1),
                                                 self.tenancy.config.max_tokens_cap)
        deadline_s = self.tenancy.deadline_s(req.deadline_s)
        params = req.sampling_params(max_tokens, k, deadline_s, constraint)
        return ChatInputs(plan, prompt_ids, k, params, deadline_s, constraint_param)

    async def _chat(self, req: ChatCompletionRequest, salt: str | None) -> dict | AsyncIterator[bytes]:
        adapter = await self._adapter(req.model)
        inputs = await self._chat_inputs(req)
        header = ResponseHeader.new("chatcmpl", "chat.completion", req.model or self.model_name,
                                    self.fingerprint)
        requests = [(inputs.prompt_ids, sp) for sp in inputs.params]
        choices, streams, firsts = await self._open(requests, adapter, "messages", salt, inputs.deadline_s,
                                                    inputs.constraint_param)
        new_parser = inputs.plan.new_parser
        calls = [tool_calls.ToolCallStream(new_parser()) if new_parser is not None else None
                 for _ in choices]

        def delta(c: ChoiceState, out: RequestOutput) -> dict | None:
            logprobs = (chat_logprobs(self._texts, out.token_ids, out.logprobs, inputs.k)
                        if out.logprobs is not None else None)
            reason = out.finish_reason
            if calls[c.index] is None:
                message = {"content": out.text} if out.text else {}
            else:
                message, parsed = calls[c.index].delta(c.text + out.text, out.finished)
                reason = tool_calls.finish_reason(parsed, reason)
            if not (message or out.token_ids and logprobs or out.finished):
                return None
            return {"index": c.index, "delta": message, "logprobs": logprobs, "finish_reason": reason}

        if req.stream:
            header = ResponseHeader(header.id, "chat.completion.chunk", header.model,
                                    header.system_fingerprint, header.created)
            roles = [{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for c in choices]
            return sse_stream(header, choices, streams, firsts, delta, roles, req)
        await collect(choices, streams, firsts)
        if any(c.finish_reason == "abort" for c in choices):
            raise self.tenancy.deadline_error(inputs.deadline_s)

        def choice(c: ChoiceState) -> dict:
            message, reason = {"role": "assistant", "content": c.text}, c.finish_reason
            if new_parser is not None:
                parsed = new_parser().parse(c.text, final=True)
                message = tool_calls.message(parsed, [tool_calls.new_call_id() for _ in parsed.calls])
                reason = tool_calls.finish_reason(parsed, reason)
            return {"index": c.index, "message": message,
                    "logprobs": (chat_logprobs(self._texts, c.token_ids, c.logprobs, inputs.k)
                                 if c.logprobs is not None and inputs.k is not None else None),
                    "finish_reason": reason}

        billed = usage(choices, req.num_candidates)
        if req.ranks_candidates:
            choices = best_choices(choices, req.n, req.best_of)
        # vLLM's: the prompt's logprobs once, beside the choices
        scored = ({"prompt_logprobs": vllm_prompt_logprobs(self._texts, choices[0].prompt_logprobs,
                                                           req.prompt_logprobs)}
                  if req.prompt_logprobs is not None else {})
        return header.body([choice(c) for c in choices], usage=billed, **scored)

    async def tokenize(self, req: TokenizeRequest) -> dict:
        info = await self.info()  # then tokenized in a thread, as a chat is
        return await asyncio.to_thread(tokenize_body, info, self._texts, self.chat_template, self.model_name,
                                       req)

    async def detokenize(self, req: DetokenizeRequest) -> dict:
        return detokenize_body(await self.info(), self.model_name, req)

    async def embeddings(self, req: EmbeddingRequest, caller: Caller = ANONYMOUS) -> dict:
        return await self._limited(req, caller, self._embeddings)

    async def _embeddings(self, req: EmbeddingRequest, salt: str | None) -> dict:
        adapter = await self._adapter(req.model)
        await self.info()
        inputs = req.inputs()
        try:
            pooling = self.tenancy.config.pooling
            prompt_ids, vectors = await self.deployment.embed(inputs, pooling, adapter, salt)
        except InvalidRequest as e:
            raise invalid_request(str(e), "input" if e.param == "prompt" else e.param) from None
        for ids in prompt_ids:
            self.tenancy.check_prompt(len(ids), "input")
        vectors = np.asarray(vectors, "<f4")
        data = [{"object": "embedding", "index": i,
                 "embedding": (base64.b64encode(v.tobytes()).decode() if req.encoding_format == "base64"
                               else v.tolist())} for i, v in enumerate(vectors)]
        num_tokens = sum(len(ids) for ids in prompt_ids)
        return {"object": "list", "data": data, "model": req.model or self.model_name,
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}

    async def models(self) -> dict:
        info = await self.info()
        adapters = await self.deployment.adapters()

        def card(name: str, root: str, parent: str | None) -> dict:
            return {"id": name, "object": "model", "created": self.created, "owned_by": "numaserve",
                    "root": root, "parent": parent, "max_model_len": info["max_model_len"]}

        return {"object": "list", "data": [card(self.model_name, self.model_path, None)] + [
            card(name, path, self.model_name) for name, path in sorted(adapters.items())]}

    async def load_lora_adapter(self, req: LoadLoraAdapterRequest) -> str:
        self._check_lora_loading("loading")
        if req.lora_name == self.model_name:
            raise APIError(400, f"lora_name {shown(req.lora_name)} is the served model's name; pick another",
                           param="lora_name")
        await self.deployment.register_adapter(req.lora_name, req.lora_path)
        return f"Success: LoRA adapter '{req.lora_name}' added successfully."

    async def unload_lora_adapter(self, req: UnloadLoraAdapterRequest) -> str:
        """Requests admitted before finish on the adapter's weights; later ones naming it get a 404."""
        self._check_lora_loading("unloading")
        if await self.deployment.adapter_path(req.lora_name) is None:
            raise APIError(404, f"the LoRA adapter {shown(req.lora_name)} cannot be found; GET /v1/models "
                                "lists the registered adapters", param="lora_name", code="lora_not_found")
        await self.deployment.unload_adapter(req.lora_name)
        return f"Success: LoRA adapter '{req.lora_name}' removed successfully."

    def _check_lora_loading(self, what: str) -> None:
        if not self.enable_lora_loading:
            raise APIError(403, f"{what} adapters over HTTP is disabled in this deployment; set "
                                "http: {enable_lora_loading: true} in its config, or manage adapters from "
                                "Python with client.register_adapter(name, path) and "
                                "client.unload_adapter(name)", type="permission_error",
                           code="lora_loading_disabled")

    async def health(self) -> bool:
        return await self.deployment.num_serving_workers() > 0

    async def console_stats(self) -> ConsoleStats:
        return console_stats(self.model_name, await self.deployment.live())

    # ---- requests to the deployment ----------------------------------------------------------------------

    async def _adapter(self, model: str | None) -> str | None:
        if model is None or model == self.model_name:
            return None
        if await self.deployment.adapter_path(model) is not None:
            return model
        raise APIError(404, f"model {shown(model)} does not exist; GET /v1/models lists the served model "
                            f"({self.model_name!r}) and the registered adapters", param="model",
                       code="model_not_found")

    async def _open(self, requests: list[tuple], adapter: str | None, prompt_param: str,
                    salt: str | None = None, deadline_s: float | None = None,
                    constraint_param: str | None = None):
        """Start every choice's request (prompt, params) and wait until each is admitted and has its first
        output (http_api/choices.py) -> (choices, streams, first outputs)."""
        streams = [self.deployment.generate(prompt, sp, adapter, salt) for prompt, sp in requests]
        choices, firsts = await open_choices(streams, self.tenancy, prompt_param, deadline_s,
                                             constraint_param)
        return choices, streams, firsts

    def _decode(self, token_ids: list[int]) -> str:
        tokenizer = self._info["tokenizer"]
        return tokenizer.decode(token_ids) if tokenizer is not None else ""
