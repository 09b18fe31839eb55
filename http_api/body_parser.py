"""Large request bodies parsed in a process of their own, so that parsing one does not hold up the streams
this process writes.

A thread does not do: json.loads of a 5 MB body of ~750k token ids and the check of its values hold the
interpreter's lock for ~90 ms (the Zen 4 VM), and the server's event loop, which writes every running
stream's chunks, waits that long (benchmarks/bench_stall.py). A child process (`python -m
http_api.body_parser`, importing only json, msgpack and http_api/json_values.py) reads each body from its
stdin and answers on its stdout, msgpack of ("value", value) or ("error", message, param, code); with max_ids
it refuses a list of more token ids than the context holds itself, so such a body never crosses back. Not
multiprocessing: a spawned child of a Ray worker would import Ray's worker script as its main module.

One body at a time per parser (a lock held by the exchanging thread). The child starts at the first body; a
child that dies (killed, out of memory) is started again for the next, and the body it held is parsed in a
thread of this process.
"""

import asyncio
import os
import struct
import subprocess
import sys
import threading
import weakref

import msgpack

from http_api.json_values import BodyError, read_json

_REQUEST = struct.Struct("<QQ")  # the body's bytes, max_ids (0: no bound); then the body
_ANSWER = struct.Struct("<Q")  # the answer's bytes (msgpack); then the answer


def parse(body: bytes, max_ids: int | None) -> tuple:
    """("value", read_json's value) or ("error", message, param, code)."""
    try:
        return ("value", read_json(body, max_ids))
    except BodyError as e:
        return ("error", e.message, e.param, e.code)


def answer_value(answer: tuple):
    """parse's answer as read_json would give it: its value, or the BodyError it raised."""
    if answer[0] == "error":
        raise BodyError(*answer[1:])
    return answer[1]


class BodyParser:
    def __init__(self):
        self._child: subprocess.Popen | None = None
        # one exchange at a time, held by the thread that runs it: a caller cancelled mid-exchange (its
        # coroutine gone) does not let the next body's bytes interleave with its own in the pipe
        self._lock = threading.RLock()

    async def read_json(self, body: bytes, max_ids: int | None = None):
        """read_json(body, max_ids) in the child process: the value, or BodyError."""
        return answer_value(await asyncio.to_thread(self._answer, body, max_ids))

    def _answer(self, body: bytes, max_ids: int | None) -> tuple:
        with self._lock:
            try:
                return self._exchange(body, max_ids)
            except (OSError, EOFError, struct.error, ValueError):  # msgpack's errors are ValueErrors
                self.close()  # the child died: the next body starts another
        return parse(body, max_ids)  # this one here, in this thread

    def _exchange(self, body: bytes, max_ids: int | None) -> tuple:
        child = self._started()
        child.stdin.write(_REQUEST.pack(len(body), max_ids or 0))
        child.stdin.write(body)
        child.stdin.flush()
        (size,) = _ANSWER.unpack(_read(child.stdout, _ANSWER.size))
        return msgpack.unpackb(_read(child.stdout, size), strict_map_key=False)

    def _started(self) -> subprocess.Popen:
        if self._child is None or self._child.poll() is not None:
            env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            self._child = subprocess.Popen([sys.executable, "-m", "http_api.body_parser"],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
            weakref.finalize(self, _end, self._child)  # a parser dropped unclosed ends its child
        return self._child

    @property
    def pid(self) -> int | None:
        """The child's process id (None: not started, or ended)."""
        return None if self._child is None or self._child.poll() is not None else self._child.pid

    def close(self) -> None:
        """End the child (the next body starts another; one mid-exchange first finishes). Idempotent."""
        with self._lock:
            child, self._child = self._child, None
            if child is not None:
                _end(child)


def _end(child: subprocess.Popen) -> None:
    if child.poll() is None:
        child.kill()
        child.wait()
    for pipe in (child.stdin, child.stdout):
        pipe.close()


def _read(stream, n: int) -> bytes:
    data = stream.read(n)
    if len(data) != n:
        raise EOFError(f"the body parser's process ended ({len(data)} of {n} bytes)")
    return data


def main() -> None:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        request = stdin.read(_REQUEST.size)
        if len(request) < _REQUEST.size:
            return  # the server closed the pipe: it ended
        size, max_ids = _REQUEST.unpack(request)
        answer = msgpack.packb(parse(_read(stdin, size), max_ids or None))
        stdout.write(_ANSWER.pack(len(answer)))
        stdout.write(answer)
        stdout.flush()


if __name__ == "__main__":
    main()
