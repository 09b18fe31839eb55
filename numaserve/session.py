"""Session and Sequence: conversations that keep their KV between turns (scheduling/sessions.py).

    session = llm.session(adapter=None, cache_salt=None)
    seq = session.sequence()
    seq.generate("turn 1", params); seq.generate("turn 2", params)   # turn 2 prefills only its new input
    branch = seq.fork(); seq.reset(); session.close()

A sequence's turns run one at a time (a second thread's turn waits for the first); different sequences,
of one session or several, run from any threads at once and batch together.
"""

import itertools
import threading
from collections.abc import Iterator

from cluster_configs.errors import EngineClosed, InvalidRequest
from cluster_configs.sampling_params import SamplingParams
from scheduling.engine_loop import EngineLoop, texts
from scheduling.outputs import Completion
from scheduling.sessions import SequenceKV
from scheduling.validation import encode_prompt

_ids = itertools.count()


class Session:
    def __init__(self, loop: EngineLoop, engine, adapter: str | None, cache_salt: str | None):
        self._loop, self._engine, self.adapter, self.cache_salt = loop, engine, adapter, cache_salt
        self._sequences: list[Sequence] = []
        self._closed = False

    def sequence(self) -> "Sequence":
        """A new, empty sequence."""
        return self._add(SequenceKV())

    def close(self) -> None:
        """Free every sequence's blocks; the sequences serve no more turns. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for seq in self._sequences:
            with seq._lock:
                self._loop.call(lambda engine, kv=seq._kv: engine.sessions.reset(kv))

    def _add(self, kv: SequenceKV) -> "Sequence":
        if self._closed:
            raise EngineClosed("this session is closed; open a new one with llm.session()")
        seq = Sequence(self, kv)
        self._sequences.append(seq)
        return seq


class Sequence:
    def __init__(self, session: Session, kv: SequenceKV):
        self._session, self._kv = session, kv
        self._lock = threading.Lock()  # one turn at a time

    @property
    def token_ids(self) -> list[int]:
        """The history: every turn's input and output."""
        return list(self._kv.token_ids)

    def generate(self, text_or_ids, params: SamplingParams | None = None) -> Completion:
        """Append text_or_ids to the history and generate from it. -> the turn's Completion (prompt_token_ids:
        the whole history before its output)."""
        with self._lock:
            [req] = self._session._loop.run([self._turn(text_or_ids, params)])
            return Completion.from_request(req)

    def stream(self, text_or_ids, params: SamplingParams | None = None) -> Iterator[str]:
        """generate's text deltas; closing the iterator aborts the turn (what it generated stays in the
        history)."""
        with self._lock:
            req = self._turn(text_or_ids, params)
            yield from texts(self._session._loop.stream(req))

    def reset(self) -> None:
        """Drop the history and its KV."""
        with self._lock:
            self._call(lambda engine: engine.sessions.reset(self._kv))

    def fork(self) -> "Sequence":
        """A new sequence of the same session with this one's history, sharing its KV blocks."""
        with self._lock:
            return self._session._add(self._call(lambda engine: engine.sessions.fork(self._kv)))

    def _turn(self, text_or_ids, params):
        session, engine = self._session, self._session._engine
        if session._closed:
            raise EngineClosed("this session is closed; open a new one with llm.session()")
        if params is not None and params.prompt_logprobs is not None:
            # its earlier turns' KV is not recomputed, so their positions are not scored
            raise InvalidRequest("a session turn does not take prompt_logprobs; use llm.generate",
                                 param="prompt_logprobs")
        new_ids = encode_prompt(text_or_ids, engine.tokenizer, engine.spec.vocab_size)
        req = engine.make_request(f"seq-{next(_ids)}", self._kv.token_ids + new_ids, params,
                                      adapter=session.adapter, cache_salt=session.cache_salt)
        req.sequence = self._kv
        return req

    def _call(self, fn):
        if self._session._closed:
            raise EngineClosed("this session is closed; open a new one with llm.session()")
        return self._session._loop.call(fn)
