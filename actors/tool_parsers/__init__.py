"""Tool-call parsers for tool_choice "auto", chosen with --tool-call-parser (vLLM's names): each reads calls
in a model's own format from its text (actors/tool_parsers/base.py says what they return)."""

from actors.tool_parsers.base import ToolParser
from actors.tool_parsers.hermes import HermesToolParser
from actors.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}
