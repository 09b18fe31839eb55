"""Tool-call parsers for tool_choice "auto", chosen with --tool-call-parser (vLLM's names): each reads calls
in a model's own format from its text (http_api/tool_parsers/base.py says what they return)."""

from http_api.tool_parsers.base import ToolParser
from http_api.tool_parsers.hermes import HermesToolParser
from http_api.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}
