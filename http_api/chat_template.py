"""A model's chat template, rendered the way Hugging Face's apply_chat_template renders it.

The template comes from the model: chat_template.jinja beside tokenizer_config.json (transformers >= 4.43
saves it there), else tokenizer_config.json's "chat_template" (a string, or a list of named templates:
"default"), or a GGUF file's tokenizer.chat_template. It runs in jinja2's immutable sandbox with transformers'
settings (trim_blocks, lstrip_blocks, loop controls, {% generation %} blocks, a tojson that does not escape
HTML, raise_exception, strftime_now) and sees what apply_chat_template passes: the messages,
add_generation_prompt, tools, documents, the tokenizer's special tokens and any other template kwargs.
"""

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from cluster_configs.errors import InvalidRequest

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    special_tokens: dict[str, str] = field(default_factory=dict)  # e.g. {"bos_token": "<s>", ...}

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, documents: list[dict] | None = None, **kwargs) -> str:
        """The prompt text of a conversation; InvalidRequest when the template refuses it.

        tools, documents and kwargs (enable_thinking, controls, ...) reach the template as apply_chat_template
        passes them: a kwarg named like a special token overrides it."""
        try:
            return _compile(self.source).render(messages=_template_messages(messages),
                                                add_generation_prompt=add_generation_prompt, tools=tools,
                                                documents=documents, **(self.special_tokens | kwargs))
        except jinja2.TemplateError as e:  # raise_exception(...) in the template, a syntax or sandbox error
            raise InvalidRequest(f"the model's chat template refused the messages: {e}; send messages the "
                                 "template accepts (roles, order)") from None
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise InvalidRequest("the model's chat template failed on the messages "
                                 f"({type(e).__name__}: {e}); "
                                 "send plain string contents and the usual roles") from None


# a message's reasoning, under the names clients send it: templates read the first (and gpt-oss's "thinking")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _template_messages(messages: list[dict]) -> list[dict]:
    # as apply_chat_template: keys whose value is None dropped (templates test for a missing key), reasoning
    # under any of its names copied to reasoning_content and thinking
    out = []
    for message in messages:
        if isinstance(message, dict):
            message = {k: v for k, v in message.items() if v is not None}
            reasoning = next((message[k] for k in REASONING_FIELDS if k in message), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def load_chat_template(model: str | Path) -> ChatTemplate | None:
    """The chat template of a model directory or GGUF file; None when it has none."""
    path = Path(model)
    if path.suffix == ".gguf":
        return _from_gguf(path)
    config = _read_json(path / "tokenizer_config.json")
    jinja_file = path / "chat_template.jinja"
    source = jinja_file.read_text() if jinja_file.is_file() else config.get("chat_template")
    if isinstance(source, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        source = next((t.get("template") for t in source
                       if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(source, str) or not source:
        return None
    specials = _read_json(path / "special_tokens_map.json") | config
    return ChatTemplate(source, {k: _token_text(specials[k])
                                 for k in SPECIAL_TOKENS if specials.get(k) is not None})


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _token_text(token) -> str:
    # AddedToken dicts carry content
    return token.get("content", "") if isinstance(token, dict) else str(token)


def _from_gguf(path: Path) -> ChatTemplate | None:
    from gguf import GGUFReader

    reader = GGUFReader(path)

    def value(key: str):
        f = reader.get_field(key)
        return f.contents() if f is not None else None

    source = value("tokenizer.chat_template")
    if not isinstance(source, str) or not source:
        return None
    tokens = value("tokenizer.ggml.tokens") or []
    specials = {}
    for name in ("bos", "eos", "unk", "pad"):
        token_id = value(f"tokenizer.ggml.{name}_token_id")
        if token_id is not None and 0 <= token_id < len(tokens):
            specials[f"{name}_token"] = tokens[token_id]
    return ChatTemplate(source, specials)


_compiled: dict[str, jinja2.Template] = {}


def _compile(source: str) -> jinja2.Template:
    if source not in _compiled:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_Generation, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _compiled[source] = env.from_string(source)
    return _compiled[source]


class _Generation(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %} (SmolLM3's template): transformers' marker of the assistant's
    tokens for training masks. Its body renders as a call block, as in transformers; nothing is tracked."""

    tags = frozenset({"generation"})

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)
