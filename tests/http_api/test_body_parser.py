"""The body parser's process (http_api/body_parser.py) gives read_json's answer for every body, in the
same order for concurrent callers, and one that dies is started again without losing the body it held."""

import asyncio
import json
import os
import signal

from http_api.body_parser import BodyParser
from http_api.json_values import BodyError, read_json

BODIES = [json.dumps({"prompt": list(range(50_000)), "stop": ["\\u00e9", "x"], "n": 2}).encode(),
          json.dumps({"messages": [{"role": "user", "content": "w" * 300_000}] * 4}).encode(),
          b'{"prompt": "hi", "temperature": NaN}', b'{"prompt": [1, 2', b"", b'{"prompt": "a\\ud800b"}',
          json.dumps({"prompt": list(range(5_000))}).encode()]


def answer(fn, body: bytes, max_ids):
    try:
        return "value", fn(body, max_ids)
    except BodyError as e:
        return "error", e.message, e.param, e.code


def test_every_body_gets_read_jsons_answer_concurrent_callers_included():
    async def main(parser):
        async def parsed(body, max_ids):
            try:
                return "value", await parser.read_json(body, max_ids)
            except BodyError as e:
                return "error", e.message, e.param, e.code
        return await asyncio.gather(*(parsed(b, m) for b in BODIES for m in (None, 4096)))

    parser = BodyParser()
    try:
        got = asyncio.run(main(parser))
    finally:
        parser.close()
    assert got == [answer(read_json, b, m) for b in BODIES for m in (None, 4096)]
    assert got[-1][0] == "error" and got[-1][3] == "context_length_exceeded"  # 5,000 ids past 4,096


def test_a_parser_whose_process_died_answers_the_next_body_from_a_new_one():
    parser = BodyParser()
    try:
        assert asyncio.run(parser.read_json(BODIES[0])) == json.loads(BODIES[0])
        first = parser.pid
        os.kill(first, signal.SIGKILL)
        assert asyncio.run(parser.read_json(BODIES[-1])) == json.loads(BODIES[-1])  # here or by a new one
        assert asyncio.run(parser.read_json(BODIES[0])) == json.loads(BODIES[0])
        assert parser.pid not in (None, first)
    finally:
        parser.close()
    assert parser.pid is None


def test_the_parsers_process_imports_no_web_framework():
    import subprocess
    import sys
    code = ("import sys, runpy; sys.argv = ['x']; sys.stdin = open('/dev/null'); "
            "runpy.run_module('http_api.body_parser', run_name='__main__'); "
            "print(sorted(m for m in ('fastapi', 'starlette', 'pydantic', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_prompt_of_max_ids_token_ids_passes_and_one_more_is_refused():
    parser = BodyParser()
    try:
        for n, refused in ((4096, False), (4097, True)):
            body = json.dumps({"prompt": [[5] * 3, [7] * n]}).encode()
            if refused:
                try:
                    asyncio.run(parser.read_json(body, 4096))
                except BodyError as e:
                    assert (e.param, e.code) == ("prompt[1]", "context_length_exceeded"), e
                else:
                    raise AssertionError("a prompt of 4,097 ids passed a bound of 4,096")
            else:
                assert asyncio.run(parser.read_json(body, 4096)) == json.loads(body)
    finally:
        parser.close()
