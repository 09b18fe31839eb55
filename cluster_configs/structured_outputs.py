"""StructuredOutputs: the constraint a request's output must match (vLLM's StructuredOutputsParams names).

Exactly one of json (a JSON Schema, as a dict or its JSON text), regex, choice (the output is one of these
strings), grammar (llguidance's Lark syntax) or json_object (any JSON object). Whether the schema, regex or
grammar compiles is checked when the request is validated (scheduling/sampling/structured.py), not here.
"""

import warnings

from pydantic import BaseModel, ConfigDict, model_validator

# the field named `json` (vLLM's name) shadows pydantic v1's deprecated .json(), which nothing here calls
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", 'Field name "json"', UserWarning)

    class StructuredOutputs(BaseModel):
        model_config = ConfigDict(frozen=True, extra="forbid")

        json: dict | str | None = None
        regex: str | None = None
        choice: tuple[str, ...] | None = None
        grammar: str | None = None
        json_object: bool = False

        @model_validator(mode="after")
        def _exactly_one(self) -> "StructuredOutputs":
            if len(self.kinds) != 1:
                raise ValueError("set exactly one of json, regex, choice, grammar, json_object; got "
                                 + (", ".join(self.kinds) or "none"))
            return self

        @property
        def kinds(self) -> list[str]:
            """The fields set (one, once constructed)."""
            return [name for name in ("json", "regex", "choice", "grammar", "json_object")
                    if getattr(self, name) not in (None, False)]

        @property
        def kind(self) -> str:
            """The constraint's field name."""
            return self.kinds[0]
