"""OpenAIServing: the OpenAI endpoints over a deployment, without HTTP or Ray (actors/http_server.py wires it
to both; tests drive it with a stub deployment).

A request of n choices over several prompts is one deployment request per choice. Each is opened before any
answer goes out: admitted by the router and its first output back, so a refusal (Overloaded, a prompt too
long, ...) is an HTTP error rather than a broken stream. Every exit path cancels every stream still running,
which aborts it on its worker and frees its KV blocks at once.
"""

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Protocol

import numpy as np

from actors import tool_calls
from actors.chat_template import ChatTemplate
from actors.fill_in_middle import fim_prompt
from actors.openai_errors import APIError, as_api_error
from actors.openai_format import (
    ChoiceState,
    ResponseHeader,
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    usage,
    vllm_prompt_logprobs,
)
from actors.openai_limits import ANONYMOUS, Caller, Tenancy, release_after
from actors.openai_protocol import (
    MAX_CHOICES,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoraAdapterRequest,
    TokenizeRequest,
)
from cluster_configs.cluster_config import HttpConfig
from cluster_configs.errors import InvalidRequest
from cluster_configs.sampling_params import SamplingParams
from scheduling.best_of import best
from scheduling.outputs import RequestOutput


class RequestStream(Protocol):
    async def next(self) -> list[int] | RequestOutput: ...  # the prompt's token ids first, then outputs
    def cancel(self) -> None: ...  # abort the request unless it has finished


class Deployment(Protocol):
    def generate(self, prompt, params: SamplingParams, adapter: str | None,
                 cache_salt: str | None = None) -> RequestStream: ...
    async def model_info(self) -> dict: ...  # tokenizer, vocab_size, max_model_len
    async def adapter_path(self, name: str) -> str | None: ...
    async def adapters(self) -> dict[str, str]: ...
    async def register_adapter(self, name: str, path: str) -> str: ...
    async def num_serving_workers(self) -> int: ...
    async def metrics(self) -> list[dict]: ...  # each worker's snapshot (actors/metrics.py)
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

    # ---- endpoints ---------------------------------------------------------------------------------------

    async def completions(self, req: CompletionRequest,
                          caller: Caller = ANONYMOUS) -> dict | AsyncIterator[str]:
        return await self._limited(req, caller, self._completions)

    async def chat(self, req: ChatCompletionRequest, caller: Caller = ANONYMOUS) -> dict | AsyncIterator[str]:
        return await self._limited(req, caller, self._chat)

    async def _limited(self, req, caller: Caller, endpoint: Callable) -> dict | AsyncIterator[str]:
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

    async def _completions(self, req: CompletionRequest, salt: str | None) -> dict | AsyncIterator[str]:
        adapter = await self._adapter(req.model)
        await self.info()
        prompts = req.prompts()
        if req.suffix:
            prompts = [fim_prompt(self._info["tokenizer"], p, req.suffix) for p in prompts]
        req.check_best_of()
        _check_num_choices(len(prompts), req.num_candidates)
        if req.max_tokens is not None:
            self.tenancy.check_max_tokens(req.max_tokens)
        deadline_s = self.tenancy.deadline_s(req.deadline_s)
        # echo with logprobs scores the prompt's tokens too (OpenAI's shape: the first one's logprob null)
        echo_k = req.logprobs if req.echo and req.logprobs is not None else None
        asked = [k for k in (echo_k, req.prompt_logprobs) if k is not None]
        prompt_k = max(asked) if asked else None
        constraint, constraint_param = req.constraint()
        params = req.sampling_params(req.max_tokens, req.logprobs, deadline_s, constraint, prompt_k)
        header = ResponseHeader.new("cmpl", "text_completion", req.model or self.model_name, self.fingerprint)
        requests = [(p, sp) for p in prompts for sp in params]
        choices, streams, firsts = await self._open(requests, adapter, "prompt", salt, deadline_s,
                                                    constraint_param)
        if req.echo:
            for c, (prompt, _) in zip(choices, requests):
                c.prompt_text = prompt if isinstance(prompt, str) else self._decode(c.prompt_ids)

        def logprobs_of(c: ChoiceState, token_ids: list[int], logprobs: list | None, offset: int,
                        with_prompt: bool) -> dict | None:
            generated = (completion_logprobs(self._texts, token_ids, logprobs, offset)
                         if logprobs is not None and req.logprobs is not None else None)
            if echo_k is not None and with_prompt:
                return echo_logprobs(self._texts, c.prompt_ids, c.prompt_logprobs, generated)
            return generated

        def extra(c: ChoiceState, first: bool) -> dict:
            if req.prompt_logprobs is None or not first:
                return {}
            return {"prompt_logprobs": vllm_prompt_logprobs(self._texts, c.prompt_logprobs, prompt_k)}

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
            return self._stream(header, choices, streams, firsts, delta, [], req)
        await _collect(choices, streams, firsts)
        if any(c.finish_reason == "abort" for c in choices):  # nothing was sent: an error, not a cut answer
            raise self.tenancy.deadline_error(deadline_s)
        billed = usage(choices, req.num_candidates)  # every candidate's tokens, as OpenAI bills best_of
        if req.ranks_candidates:
            choices = _best_choices(choices, req.n, req.best_of)
        return header.body([{"index": c.index, "text": (c.prompt_text or "") + c.text,
                             "logprobs": logprobs_of(c, c.token_ids, c.logprobs, len(c.prompt_text or ""),
                                                     True),
                             "finish_reason": c.finish_reason} | extra(c, True) for c in choices],
                           usage=billed)

    async def _chat(self, req: ChatCompletionRequest, salt: str | None) -> dict | AsyncIterator[str]:
        adapter = await self._adapter(req.model)
        info = await self.info()
        req.check_best_of()
        _check_num_choices(1, req.num_candidates)
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
        prompt_ids = self._chat_prompt(req.messages, plan.tools)
        k = req.num_logprobs()
        if req.max_new_tokens() is not None:
            self.tenancy.check_max_tokens(req.max_new_tokens())
        max_tokens = req.max_new_tokens() or min(max((info["max_model_len"] or 0) - len(prompt_ids), 1),
                                                 self.tenancy.config.max_tokens_cap)
        deadline_s = self.tenancy.deadline_s(req.deadline_s)
        params = req.sampling_params(max_tokens, k, deadline_s, constraint)
        header = ResponseHeader.new("chatcmpl", "chat.completion", req.model or self.model_name,
                                    self.fingerprint)
        choices, streams, firsts = await self._open([(prompt_ids, sp) for sp in params], adapter, "messages",
                                                    salt, deadline_s, constraint_param)
        calls = [tool_calls.ToolCallStream(plan.new_parser()) if plan.new_parser is not None else None
                 for _ in choices]

        def delta(c: ChoiceState, out: RequestOutput) -> dict | None:
            logprobs = (chat_logprobs(self._texts, out.token_ids, out.logprobs, k)
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
            return self._stream(header, choices, streams, firsts, delta, roles, req)
        await _collect(choices, streams, firsts)
        if any(c.finish_reason == "abort" for c in choices):
            raise self.tenancy.deadline_error(deadline_s)

        def choice(c: ChoiceState) -> dict:
            message, reason = {"role": "assistant", "content": c.text}, c.finish_reason
            if plan.new_parser is not None:
                parsed = plan.new_parser().parse(c.text, final=True)
                message = tool_calls.message(parsed, [tool_calls.new_call_id() for _ in parsed.calls])
                reason = tool_calls.finish_reason(parsed, reason)
            return {"index": c.index, "message": message,
                    "logprobs": (chat_logprobs(self._texts, c.token_ids, c.logprobs, k)
                                 if c.logprobs is not None and k is not None else None),
                    "finish_reason": reason}

        billed = usage(choices, req.num_candidates)
        if req.ranks_candidates:
            choices = _best_choices(choices, req.n, req.best_of)
        # vLLM's: the prompt's logprobs once, beside the choices
        scored = ({"prompt_logprobs": vllm_prompt_logprobs(self._texts, choices[0].prompt_logprobs,
                                                           req.prompt_logprobs)}
                  if req.prompt_logprobs is not None else {})
        return header.body([choice(c) for c in choices], usage=billed, **scored)

    async def tokenize(self, req: TokenizeRequest) -> dict:
        """vLLM's shape: count, max_model_len, tokens (and token_strs if asked)."""
        info = await self.info()
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "send a prompt or messages (exactly one)", param="prompt")
        if info["tokenizer"] is None:
            raise APIError(400, f"model {self.model_name!r} has no tokenizer.json; it takes token ids only",
                           param="prompt")
        if req.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            ids = self._chat_prompt(req.messages, tools, req.add_generation_prompt,
                                    bool(req.add_special_tokens))
        else:
            special = req.add_special_tokens is not False
            ids = info["tokenizer"].hf_tokenizer.encode(req.prompt, add_special_tokens=special).ids
        return {"count": len(ids), "max_model_len": info["max_model_len"], "tokens": ids,
                "token_strs": [self._texts.text(t) for t in ids] if req.return_token_strs else None}

    async def detokenize(self, req: DetokenizeRequest) -> dict:
        info = await self.info()
        if info["tokenizer"] is None:
            raise APIError(400, f"model {self.model_name!r} has no tokenizer.json", param="tokens")
        if any(not 0 <= t < info["vocab_size"] for t in req.tokens):
            raise APIError(400, f"tokens must be ids in [0, {info['vocab_size']})", param="tokens")
        return {"prompt": info["tokenizer"].decode(req.tokens)}

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
            raise APIError(400, str(e), param="input" if e.param == "prompt" else e.param,
                           code="context_length_exceeded" if "max_model_len" in str(e) else "invalid_value"
                           ) from None
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
        if not self.enable_lora_loading:
            raise APIError(403, "loading adapters over HTTP is disabled in this deployment; set "
                                "http: {enable_lora_loading: true} in its config, or register adapters from "
                                "Python with client.register_adapter(name, path)", type="permission_error",
                           code="lora_loading_disabled")
        if req.lora_name == self.model_name:
            raise APIError(400, f"lora_name {req.lora_name!r} is the served model's name; pick another",
                           param="lora_name")
        await self.deployment.register_adapter(req.lora_name, req.lora_path)
        return f"Success: LoRA adapter '{req.lora_name}' added successfully."

    async def health(self) -> bool:
        return await self.deployment.num_serving_workers() > 0

    # ---- requests to the deployment ----------------------------------------------------------------------

    async def _adapter(self, model: str | None) -> str | None:
        if model is None or model == self.model_name:
            return None
        if await self.deployment.adapter_path(model) is not None:
            return model
        raise APIError(404, f"model {model!r} does not exist; GET /v1/models lists the served model "
                            f"({self.model_name!r}) and the registered adapters", param="model",
                       code="model_not_found")

    async def _open(self, requests: list[tuple], adapter: str | None, prompt_param: str,
                    salt: str | None = None, deadline_s: float | None = None,
                    constraint_param: str | None = None):
        """Start every choice's request and wait until each is admitted and has its first output (a request
        aborted by its deadline before then is an error: nothing has been sent). An invalid constraint is a
        400 naming the request field that set it (constraint_param)."""
        streams = [self.deployment.generate(prompt, sp, adapter, salt) for prompt, sp in requests]
        try:
            prompt_ids = await asyncio.gather(*(s.next() for s in streams))
            for ids in prompt_ids:
                self.tenancy.check_prompt(len(ids), prompt_param)
            firsts = await asyncio.gather(*(s.next() for s in streams))
            if any(f.finish_reason == "abort" for f in firsts):
                raise self.tenancy.deadline_error(deadline_s)
        except InvalidRequest as e:  # the router's or the engine's validation (scheduling/validation.py)
            for s in streams:
                s.cancel()
            message = str(e)
            code = "context_length_exceeded" if "max_model_len" in message else "invalid_value"
            # chat: the prompt is the rendered messages
            param = prompt_param if e.param == "prompt" else e.param
            if param == "structured_outputs" and constraint_param is not None:
                param = constraint_param
                if constraint_param != "structured_outputs":
                    message = f"{constraint_param}: {message}"
            raise APIError(400, message, param=param, code=code) from None
        except BaseException:
            for s in streams:
                s.cancel()
            raise
        return [ChoiceState(i, ids) for i, ids in enumerate(prompt_ids)], streams, firsts

    async def _stream(self, header: ResponseHeader, choices: list[ChoiceState], streams: list[RequestStream],
                      firsts: list[RequestOutput], delta: Callable, opening: list[dict],
                      req) -> AsyncIterator[str]:
        """The SSE data of a stream: each choice's deltas as they come, finish_reason on its last chunk, the
        usage chunk if asked, [DONE]. A client that goes away cancels this generator: every request is
        aborted."""
        queue: asyncio.Queue = asyncio.Queue()
        tasks: list[asyncio.Task] = []
        extra = {"usage": None} if req.include_usage else {}
        try:
            for chunk in opening:
                yield _dumps(header.body([chunk], **extra))
            for i, first in enumerate(firsts):
                queue.put_nowait((i, first))
                if not first.finished:
                    tasks.append(asyncio.create_task(_pump(i, streams[i], queue)))
            num_running = len(choices)
            while num_running:
                i, out = await queue.get()
                if isinstance(out, Exception):
                    raise out
                chunk = delta(choices[i], out)
                choices[i].add(out)
                if chunk is not None:
                    yield _dumps(header.body([chunk], **extra))
                num_running -= out.finished
            if req.include_usage:
                yield _dumps(header.body([], usage=usage(choices, req.n)))
        except Exception as e:  # noqa: BLE001  (after the 200 an error can only go into the stream)
            yield _dumps(as_api_error(e).sse_data())
        finally:  # no await here: a cancelled generator cannot
            for t in tasks:
                t.cancel()
            for s in streams:
                s.cancel()
        yield "[DONE]"

    def _chat_prompt(self, messages: list, tools: list[dict] | None, add_generation_prompt: bool = True,
                     add_special_tokens: bool = False) -> list[int]:
        """The token ids of messages rendered by the model's chat template (whose own special tokens count:
        none are added unless asked)."""
        tokenizer = self._info["tokenizer"]
        if self.chat_template is None or tokenizer is None:
            raise APIError(400, f"model {self.model_name!r} has no chat template (no chat_template.jinja or "
                                "chat_template in tokenizer_config.json, or no tokenizer); use "
                                "/v1/completions with the model's own prompt format, or add a template to "
                                "the model directory",
                           param="messages", code="no_chat_template")
        text = self.chat_template.render([m.template_message() for m in messages],
                                         add_generation_prompt=add_generation_prompt, tools=tools)
        return tokenizer.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def _decode(self, token_ids: list[int]) -> str:
        tokenizer = self._info["tokenizer"]
        return tokenizer.decode(token_ids) if tokenizer is not None else ""


async def _pump(i: int, stream: RequestStream, queue: asyncio.Queue) -> None:
    try:
        while not (out := await stream.next()).finished:
            queue.put_nowait((i, out))
        queue.put_nowait((i, out))
    except Exception as e:  # noqa: BLE001  (handed to the stream's consumer)
        queue.put_nowait((i, e))


async def _collect(choices: list[ChoiceState], streams: list[RequestStream],
                   firsts: list[RequestOutput]) -> None:
    async def drain(c: ChoiceState, stream: RequestStream, first: RequestOutput) -> None:
        c.add(first)
        while c.finish_reason is None:
            c.add(await stream.next())

    try:
        await asyncio.gather(*(drain(c, s, f) for c, s, f in zip(choices, streams, firsts)))
    finally:
        for s in streams:
            s.cancel()


def _best_choices(choices: list[ChoiceState], n: int, best_of: int) -> list[ChoiceState]:
    """Of each prompt's best_of candidates (consecutive), the n best (scheduling/best_of.py), indexed as
    choices 0, 1, ... in that order."""
    kept = []
    for first in range(0, len(choices), best_of):
        group = choices[first:first + best_of]
        kept += [group[i] for i in best(n, [(c.token_ids, c.logprobs) for c in group])]
    return [replace(c, index=i) for i, c in enumerate(kept)]


def _check_num_choices(num_prompts: int, n: int) -> None:
    if num_prompts * n > MAX_CHOICES:
        raise APIError(400, f"{num_prompts} prompts x n={n} asks for {num_prompts * n} completions; at most "
                            f"{MAX_CHOICES} per request: send fewer prompts or a smaller n", param="n")


def _dumps(body: dict) -> str:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))
