"""The request fields that constrain a completion's output, and the one StructuredOutputs they make.

OpenAI's response_format ({"type": "text" | "json_object" | "json_schema", "json_schema": {"name",
"schema", "strict"}}), vLLM's structured_outputs object ({"json" | "regex" | "choice" | "grammar" |
"json_object"}) and its older guided_json / guided_regex / guided_choice / guided_grammar: at most one per
request. `strict` changes nothing: every constraint here is enforced token by token (llguidance).
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr

from cluster_configs.structured_outputs import StructuredOutputs
from http_api.errors import APIError

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: StrictStr = Field(max_length=64)
    description: StrictStr | None = None
    json_schema: dict | None = Field(None, alias="schema")  # None: any JSON object
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredFields(BaseModel):
    """Mixed into both endpoints' requests."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None

    def constraint(self) -> tuple[StructuredOutputs | None, str | None]:
        """The output's constraint and the field that set it (None, None: unconstrained)."""
        found = []
        if self.response_format is not None and self.response_format.type != "text":
            found.append(("response_format", _from_response_format(self.response_format)))
        if self.structured_outputs is not None:
            found.append(("structured_outputs", self.structured_outputs))
        for name, kind in GUIDED_FIELDS.items():
            if getattr(self, name) is not None:
                found.append((name, StructuredOutputs(**{kind: getattr(self, name)})))
        if len(found) > 1:
            raise APIError(400, f"{' and '.join(n for n, _ in found)} each constrain the output; send one",
                           param=found[1][0])
        return (found[0][1], found[0][0]) if found else (None, None)


def _from_response_format(fmt: ResponseFormat) -> StructuredOutputs:
    if fmt.type == "json_object":
        return StructuredOutputs(json_object=True)
    if fmt.json_schema is None:
        raise APIError(400, 'response_format of type "json_schema" needs json_schema: {"name": ..., '
                            '"schema": {...}}', param="response_format.json_schema")
    if fmt.json_schema.json_schema is None:
        return StructuredOutputs(json_object=True)
    return StructuredOutputs(json=fmt.json_schema.json_schema)
