"""A request body's JSON value as the OpenAI endpoints take it: a JSON object in UTF-8 of values every later
stage can take. Python's json reads more than JSON (NaN, Infinity, lone UTF-16 surrogates, nesting as deep as
the stack, integers of 4,300 digits) and each of those reached the tokenizer, the sampler or the stack limit
as a 500; here each is a BodyError naming where it is (a 400 once http_api/json_bodies.py answers it), before
the endpoint runs.

Nothing here imports the web framework: http_api/body_parser.py runs read_json in a process of its own."""

import json
import math

MAX_DEPTH = 64  # objects in objects: a JSON Schema of a tool or response_format nests a few levels a field
INT64 = 2 ** 63  # every integer field fits in 64 bits (token ids, seeds, counts)
SHOWN_CHARS = 100  # the most of a client's value an error message echoes
PROMPT_FIELDS = ("prompt", "input")  # a list of token ids there is a prompt (completions, embeddings)


class BodyError(ValueError):
    """A body no endpoint takes: its message, the OpenAI param it is about (None: the body) and code."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def param_of(loc: tuple) -> str:
    """The OpenAI param of a location: ("messages", 0, "content") -> messages[0].content."""
    param = str(loc[0])
    for part in loc[1:]:
        param += f"[{part}]" if isinstance(part, int) else f".{part}"
    return param if len(param) <= SHOWN_CHARS else param[:SHOWN_CHARS - 3] + "..."


def read_json(body: bytes, max_ids: int | None = None):
    """The body's JSON value, else BodyError saying what is wrong and where. max_ids: no list of token ids
    may be longer (none takes more than max_model_len); None: no bound."""
    if not body.strip():
        raise BodyError("the body is empty; send a JSON object of this endpoint's fields",
                        code="invalid_json")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(f"the body is not UTF-8 (byte {e.start}); send JSON in UTF-8",
                        code="invalid_json") from None
    try:
        value = json.loads(text)
    except RecursionError:
        raise BodyError(f"the body nests deeper than {MAX_DEPTH} levels", code="invalid_json") from None
    except json.JSONDecodeError as e:
        raise BodyError(f"the body is not valid JSON ({e.msg} at character {e.pos}); send a JSON object",
                        code="invalid_json") from None
    except ValueError:  # an integer longer than sys.get_int_max_str_digits()
        raise BodyError("the body holds an integer of thousands of digits; integers here fit in 64 bits",
                        code="invalid_value") from None
    check_values(value, max_ids)
    return value


def check_values(value, max_ids: int | None = None) -> None:
    """BodyError at the first value no field takes: a lone surrogate, a non-finite number, an integer past
    64 bits, nesting past MAX_DEPTH, a list of token ids longer than max_ids. Walks with a stack (no
    recursion: the depth is the input's)."""
    stack = [(value, ())]
    while stack:
        v, loc = stack.pop()
        if isinstance(v, str):
            _check_text(v, loc)
        elif isinstance(v, float) and not math.isfinite(v):
            raise _bad(loc, f"NaN and Infinity are not JSON numbers (got {v})")
        elif isinstance(v, int) and not isinstance(v, bool) and not -INT64 <= v < INT64:
            raise _bad(loc, f"an integer of {len(str(abs(v)))} digits is out of range; integers here fit in "
                            "64 bits")
        elif isinstance(v, dict | list):
            if len(loc) >= MAX_DEPTH:
                raise _bad(loc, f"the body nests deeper than {MAX_DEPTH} levels")
            if isinstance(v, list) and v and set(map(type, v)) <= {int}:  # token ids: one pass at C speed
                if max_ids is not None and len(v) > max_ids:
                    raise _too_many_ids(loc, len(v), max_ids)
                if not (-INT64 <= min(v) and max(v) < INT64):
                    raise _bad(loc, "an integer is out of range; integers here fit in 64 bits")
                continue
            for key, item in (v.items() if isinstance(v, dict) else enumerate(v)):
                if isinstance(key, str):
                    _check_text(key, loc)
                stack.append((item, (*loc, key)))


def _check_text(s: str, loc: tuple) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _bad(loc, f"a string holds a lone UTF-16 surrogate (U+{ord(s[e.start]):04X}); send valid "
                        "Unicode") from None


def _bad(loc: tuple, message: str, code: str = "invalid_value") -> BodyError:
    param = param_of(loc) if loc else None
    return BodyError(f"{param}: {message}" if param else message, param, code)


def _too_many_ids(loc: tuple, n: int, max_ids: int) -> BodyError:
    """A list of more token ids than the model's context holds: a prompt's is context_length_exceeded."""
    if loc and loc[0] in PROMPT_FIELDS:
        return _bad(loc, f"{n} token ids, more than max_model_len={max_ids} tokens of context hold; shorten "
                         "the prompt", code="context_length_exceeded")
    return _bad(loc, f"{n} token ids; no field takes more than max_model_len={max_ids}")
