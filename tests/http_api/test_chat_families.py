"""The chat templates of the architectures numaserve serves render as transformers' apply_chat_template does.

Each family's template (tests/chat_templates/) is saved with a tiny tokenizer carrying that model's special
tokens; load_chat_template(dir).render(...) must equal AutoTokenizer.from_pretrained(dir).apply_chat_template(
..., tokenize=False) character for character, and refuse (InvalidRequest) what transformers refuses.
"""

from datetime import datetime
from pathlib import Path

import jinja2
import pytest
from transformers import AutoTokenizer
from transformers.utils import chat_template_utils

import http_api.chat_template
from cluster_configs.errors import InvalidRequest
from http_api.chat_template import load_chat_template
from tests.support.model_factory import build_tokenizer

TEMPLATES = Path(__file__).parents[1] / "chat_templates"

# fixture -> the named special tokens of its model's tokenizer (None: the model has none)
FAMILIES = {
    "qwen3": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},  # and Qwen3-MoE
    "gemma2": {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
    "gemma3": {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
    "phi3": {"bos_token": "<s>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
    "phi4_mini": dict.fromkeys(("bos_token", "eos_token", "pad_token"), "<|endoftext|>"),
    "granite3": dict.fromkeys(("bos_token", "eos_token", "pad_token"), "<|end_of_text|>"),
    "olmo2": {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|pad|>"},
    "smollm3": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|im_end|>"},
    "mixtral": {"bos_token": "<s>", "eos_token": "</s>"},
}
NO_SYSTEM_ROLE = {"gemma2"}  # its template raises on a system message

SYSTEM = {"role": "system", "content": "You are a terse assistant."}
CONVERSATIONS = {
    "system_user": [SYSTEM, {"role": "user", "content": "What is 2 + 2?"}],
    "user_assistant_user": [
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "  And an even one?\n"},  # spaces and a newline: templates that trim
    ],
    "unicode": [
        SYSTEM,
        {"role": "user", "content": "Grüße aus Köln! 日本語 🙂 ∑ — \"quotes\" <tags> & \\n"},
        {"role": "assistant", "content": "Ünïcödé tëxt 👍"},
        {"role": "user", "content": "Ещё раз, пожалуйста."},
    ],
}
FROZEN_NOW = datetime(2025, 3, 7, 9, 30)  # a one-digit day: strftime's %d pads it


class _FrozenDatetime(datetime):
    @classmethod
    def now(cls, tz=None):
        return FROZEN_NOW


@pytest.fixture(autouse=True)
def frozen_today(monkeypatch):
    """strftime_now (Granite 3, SmolLM3 print today's date) reads the same fixed clock in both renderers."""
    monkeypatch.setattr(chat_template_utils, "datetime", _FrozenDatetime)
    monkeypatch.setattr(http_api.chat_template, "datetime", _FrozenDatetime)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    """family -> a directory with a tiny tokenizer saved with that family's template and special tokens."""
    dirs = {}
    for family, tokens in FAMILIES.items():
        directory = tmp_path_factory.mktemp(family)
        fast = build_tokenizer(directory)
        fast.add_special_tokens({k: v for k, v in tokens.items() if v is not None})
        for name, token in tokens.items():
            if token is None:
                setattr(fast, name, None)
        fast.chat_template = (TEMPLATES / f"{family}.jinja").read_text()
        fast.save_pretrained(directory)
        dirs[family] = directory
    return dirs


def both(directory: Path, messages: list[dict], add_generation_prompt: bool, **kwargs) -> tuple[str, str]:
    """(ours, transformers') prompt text of the conversation."""
    theirs = AutoTokenizer.from_pretrained(directory).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)
    ours = load_chat_template(directory).render(messages, add_generation_prompt, **kwargs)
    return ours, theirs


def refused_by_both(directory: Path, messages: list[dict], **kwargs) -> None:
    with pytest.raises(jinja2.TemplateError):  # raise_exception(...) in the template
        AutoTokenizer.from_pretrained(directory).apply_chat_template(messages, tokenize=False, **kwargs)
    with pytest.raises(InvalidRequest):
        load_chat_template(directory).render(messages, **kwargs)


def test_every_fixture_is_tested():
    assert sorted(p.stem for p in TEMPLATES.glob("*.jinja")) == sorted(FAMILIES)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_renders_as_transformers(family_dirs, family, conversation, add_generation_prompt):
    messages = CONVERSATIONS[conversation]
    if family in NO_SYSTEM_ROLE and messages[0]["role"] == "system":
        messages = messages[1:]
    ours, theirs = both(family_dirs[family], messages, add_generation_prompt)
    assert ours == theirs
    assert messages[-1]["content"].strip() in ours
    tokens = FAMILIES[family]
    if tokens.get("bos_token") and "bos_token" in (TEMPLATES / f"{family}.jinja").read_text():
        assert ours.startswith(tokens["bos_token"])


@pytest.mark.parametrize("family, messages", [
    ("mixtral", [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]),
    ("mixtral", [SYSTEM, {"role": "assistant", "content": "I speak first"}]),
    ("mixtral", [{"role": "user", "content": "hi"}, {"role": "tool", "content": "{}"}]),
    ("gemma2", [SYSTEM, {"role": "user", "content": "hi"}]),
    ("gemma2", [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]),
    ("gemma3", [SYSTEM, {"role": "user", "content": "one"}, {"role": "user", "content": "two"}]),
])
def test_refuses_as_transformers(family_dirs, family, messages):
    refused_by_both(family_dirs[family], messages, add_generation_prompt=True)


def test_gemma3_folds_the_system_prompt_into_the_first_turn(family_dirs):
    ours, theirs = both(family_dirs["gemma3"], CONVERSATIONS["system_user"], True)
    assert ours == theirs == ("<bos><start_of_turn>user\nYou are a terse assistant.\n\nWhat is 2 + 2?"
                              "<end_of_turn>\n<start_of_turn>model\n")


def test_mixtral_prompt(family_dirs):
    ours, theirs = both(family_dirs["mixtral"], CONVERSATIONS["unicode"], False)
    assert ours == theirs
    assert ours.startswith("<s> [INST] You are a terse assistant.\n\nGrüße")
    assert " Ünïcödé tëxt 👍</s> [INST] Ещё раз, пожалуйста. [/INST]" in ours


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, today.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "e.g. Köln"}},
                   "required": ["city"]}}}]
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Köln?"},
    {"role": "assistant", "content": "", "reasoning_content": "The user wants the weather; call the tool.",
     "tool_calls": [{"type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Köln"}}}]},
    {"role": "tool", "content": "{\"temp_c\": 11, \"sky\": \"cloudy\"}"},
    {"role": "assistant", "content": "<think>\nIt is 11 °C.\n</think>\n\nCloudy, 11 °C."},
    {"role": "user", "content": "Thanks!"},
]


@pytest.mark.parametrize("enable_thinking", [None, True, False])
def test_qwen3_thinking_switch(family_dirs, enable_thinking):
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    ours, theirs = both(family_dirs["qwen3"], CONVERSATIONS["user_assistant_user"], True, **kwargs)
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n" if enable_thinking is False
                         else "<|im_start|>assistant\n")


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_qwen3_tools_and_reasoning(family_dirs, add_generation_prompt):
    messages = [SYSTEM] + TOOL_TURNS[:-1]  # the turns after the last user query keep their reasoning
    ours, theirs = both(family_dirs["qwen3"], messages, add_generation_prompt, tools=TOOLS)
    assert ours == theirs
    assert '"description": "e.g. Köln"' in ours  # tojson: no ASCII escapes
    assert "<think>\nThe user wants the weather; call the tool.\n</think>\n\n<tool_call>" in ours
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln"}}\n</tool_call>' in ours
    assert '<|im_start|>user\n<tool_response>\n{"temp_c": 11' in ours
    ours, theirs = both(family_dirs["qwen3"], TOOL_TURNS, add_generation_prompt, tools=TOOLS)
    assert ours == theirs
    assert "The user wants the weather" not in ours  # dropped before the last user query


def test_qwen3_reasoning_under_other_names(family_dirs):
    """transformers copies a message's "reasoning" (or "thinking") to "reasoning_content", which templates
    read."""
    for name in ("reasoning", "thinking"):
        turns = [dict(m) for m in TOOL_TURNS[:2]]
        turns[1][name] = turns[1].pop("reasoning_content")
        ours, theirs = both(family_dirs["qwen3"], turns, False)
        assert ours == theirs
        assert "<think>\nThe user wants the weather; call the tool.\n</think>" in ours


@pytest.mark.parametrize("kwargs", [
    {}, {"enable_thinking": False}, {"tools": TOOLS},
    {"xml_tools": TOOLS, "python_tools": ["def search(query: str) -> list[str]: ..."]},
])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_smollm3(family_dirs, conversation, kwargs):
    """Its metadata header (today's date, reasoning mode), enable_thinking, tools, {% generation %} blocks."""
    ours, theirs = both(family_dirs["smollm3"], CONVERSATIONS[conversation], True, **kwargs)
    assert ours == theirs
    assert "Today Date: 07 March 2025\n" in ours
    mode = "/no_think" if kwargs.get("enable_thinking") is False else "/think"
    assert f"Reasoning Mode: {mode}\n" in ours


@pytest.mark.parametrize("system", ["Be brief. /no_think", "Be brief. /think", "/system_override Only this."])
def test_smollm3_system_prompt_flags(family_dirs, system):
    messages = [{"role": "system", "content": system}] + CONVERSATIONS["user_assistant_user"]
    ours, theirs = both(family_dirs["smollm3"], messages, True)
    assert ours == theirs
    assert ("<think>\n\n</think>\n" in ours) == ("/no_think" in system)


DOCUMENTS = [{"title": "Köln", "text": "Köln lies on the Rhine."}, {"title": "Bonn", "text": "Bonn too."}]


@pytest.mark.parametrize("kwargs", [
    {}, {"tools": TOOLS}, {"documents": DOCUMENTS},
    {"tools": TOOLS, "documents": DOCUMENTS, "controls": {"citations": True, "hallucinations": True}},
])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_granite3(family_dirs, conversation, kwargs):
    """Its default system prompt (today's date), tools, documents and the controls template variable."""
    ours, theirs = both(family_dirs["granite3"], CONVERSATIONS[conversation], True, **kwargs)
    assert ours == theirs
    if CONVERSATIONS[conversation][0]["role"] != "system":
        assert "Today's Date: March 07, 2025.\n" in ours


def test_phi4_mini_tools_in_the_system_message(family_dirs):
    messages = [SYSTEM | {"tools": '[{"name": "get_weather", "parameters": {"city": "string"}}]'},
                {"role": "user", "content": "Weather in Köln?"}]
    ours, theirs = both(family_dirs["phi4_mini"], messages, True)
    assert ours == theirs
    assert ours == ('<|system|>You are a terse assistant.<|tool|>[{"name": "get_weather", "parameters": '
                    '{"city": "string"}}]<|/tool|><|end|><|user|>Weather in Köln?<|end|><|assistant|>')


def test_template_in_tokenizer_config(family_dirs, tmp_path):
    """Saved the pre-4.43 way, as tokenizer_config.json's "chat_template", the template renders the same."""
    fast = AutoTokenizer.from_pretrained(family_dirs["qwen3"])
    fast.save_pretrained(tmp_path, save_jinja_files=False)
    assert not (tmp_path / "chat_template.jinja").exists()
    ours, theirs = both(tmp_path, TOOL_TURNS, True, tools=TOOLS)
    assert ours == theirs
