"""ClientSession and ClientSequence: ns.LLM's sessions (numaserve/session.py) over a deployment.

    with client.session(adapter=None, cache_salt=None) as session:
        seq = session.sequence()
        seq.generate("turn 1", params); seq.generate("turn 2", params)   # turn 2 prefills only its new input
        branch = seq.fork(); seq.reset()

The caller holds each sequence's history (token ids) and sends it whole with every turn; the session is
pinned to one worker (the router places its first turn, then every turn goes there while the worker is
alive), which keeps each sequence's live KV between turns under an id this side holds
(actors/worker_sequences.py), so a turn prefills only its new input. A worker lost between turns: the router
places the next turn elsewhere and that worker builds the sequence from its history (one prefill); lost
mid-turn: the turn resumes there as any client stream does (actors/request_stream.py). The session is then
pinned to the new worker. Tokens equal an undisturbed run's, greedy or seeded.

A sequence's turns run one at a time; different sequences run from any threads at once. Closing the session,
or its garbage collection or the interpreter's exit, frees its sequences on every worker it used.
"""

import threading
import uuid
import weakref
from collections.abc import Iterator
from typing import Self

import ray

from actors.client_streams import ClientStreams, complete
from actors.messages import ForkSequence, FreeSequences, Placement
from actors.ray_errors import WORKER_LOST, unwrap
from cluster_configs.errors import EngineClosed, InvalidRequest
from cluster_configs.sampling_params import SamplingParams
from scheduling.outputs import Completion, RequestOutput
from scheduling.validation import encode_prompt

CALL_TIMEOUT_S = 10.0  # a fork or free waits this long for its worker (a lost worker's sequences are gone)


class ClientSession:
    def __init__(self, streams: ClientStreams, adapter: str | None, cache_salt: str | None):
        self._streams, self.adapter, self.cache_salt = streams, adapter, cache_salt
        self._lock = threading.Lock()
        self._placement: Placement | None = None  # the worker it is pinned to (None: no turn yet)
        self._placements: dict[str, Placement] = {}  # every worker its turns went to, by id
        self._sequences: list[ClientSequence] = []
        self._sequence_ids: list[str] = []
        self._closed = False
        self._finalizer = weakref.finalize(self, _free, self._placements, self._sequence_ids)

    def sequence(self) -> "ClientSequence":
        """A new, empty sequence."""
        return self._add([])

    def close(self) -> None:
        """Free every sequence's KV on the workers, once their running turns end; the sequences serve no more
        turns. Idempotent."""
        with self._lock:
            self._closed = True
            sequences = list(self._sequences)
        for seq in sequences:
            with seq._lock:  # its running turn has ended
                pass
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def worker_id(self) -> str | None:
        """The worker the session is pinned to (None before its first turn)."""
        return None if self._placement is None else self._placement.worker_id

    def _add(self, token_ids: list[int]) -> "ClientSequence":
        with self._lock:
            self._check_open()
            seq = ClientSequence(self, uuid.uuid4().hex, token_ids)
            self._sequences.append(seq)
            self._sequence_ids.append(seq.sequence_id)
            return seq

    def _pin(self, placement: Placement) -> None:
        with self._lock:
            self._placement = self._placements[placement.worker_id] = placement

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosed("this session is closed; open a new one with client.session()")


class ClientSequence:
    def __init__(self, session: ClientSession, sequence_id: str, token_ids: list[int]):
        self._session, self.sequence_id = session, sequence_id
        self._token_ids = token_ids  # every turn's input and output so far
        self._lock = threading.Lock()  # one turn at a time

    @property
    def token_ids(self) -> list[int]:
        """The history: every turn's input and output."""
        return list(self._token_ids)

    def generate(self, text_or_ids, params: SamplingParams | None = None) -> Completion:
        """Append text_or_ids to the history and generate from it. -> the turn's Completion (prompt_token_ids:
        the whole history before its output)."""
        with self._lock:
            prompt_ids, chunks = self._turn(text_or_ids, params)
            return complete(prompt_ids, chunks)

    def stream(self, text_or_ids, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """generate's deltas, the records client.stream yields; closing the iterator aborts the turn (what
        this side received stays in the history)."""
        with self._lock:
            yield from self._turn(text_or_ids, params)[1]

    def reset(self) -> None:
        """Drop the history and its KV."""
        with self._lock:
            self._session._check_open()
            _free(self._session._placements, [self.sequence_id])
            self._token_ids = []

    def fork(self) -> "ClientSequence":
        """A new sequence of the same session with this one's history, sharing its KV blocks on the session's
        worker."""
        with self._lock:
            fork = self._session._add(list(self._token_ids))
            placement = self._session._placement
            if placement is not None and self._token_ids:
                call = ForkSequence(self.sequence_id, fork.sequence_id)
                _wait([placement.worker.fork_sequence.remote(call)])
            return fork

    def _turn(self, text_or_ids, params: SamplingParams | None) -> tuple[list[int], Iterator[RequestOutput]]:
        """Open the turn's stream -> (its prompt: history + new input, its chunks, each appended to the
        history as it comes)."""
        session, streams = self._session, self._session._streams
        session._check_open()
        if params is not None and params.prompt_logprobs is not None:
            # its earlier turns' KV is not recomputed, so their positions are not scored
            raise InvalidRequest("a session turn does not take prompt_logprobs; use client.generate",
                                 param="prompt_logprobs")
        model = streams.run(streams.ingress.model_info())
        new_ids = encode_prompt(text_or_ids, model["tokenizer"], model["vocab_size"])
        stream = streams.open(self._token_ids + new_ids, params, session.adapter, None, session.cache_salt,
                              pinned=session.worker_id, sequence_id=self.sequence_id)
        self._token_ids = list(stream.admission.prompt_token_ids)
        session._pin(stream.placement)

        def chunks() -> Iterator[RequestOutput]:
            for chunk in streams.deltas(stream):
                self._token_ids += chunk.token_ids
                session._pin(stream.placement)  # moved, if its worker was lost
                yield chunk

        return self._token_ids[:], chunks()


def _free(placements: dict[str, Placement], sequence_ids: list[str]) -> None:
    """Free sequence_ids on every worker in placements (waiting for their answers, up to CALL_TIMEOUT_S);
    nothing once Ray is shut down (at the interpreter's exit: the workers' LRU eviction frees them)."""
    if not ray.is_initialized():
        return
    call = FreeSequences(tuple(sequence_ids))
    _wait([p.worker.free_sequences.remote(call) for p in list(placements.values())])


def _wait(refs: list) -> None:
    """The workers' answers; a lost (or not answering) worker's sequences are gone with it."""
    for ref in refs:
        try:
            ray.get(ref, timeout=CALL_TIMEOUT_S)
        except (*WORKER_LOST, ray.exceptions.GetTimeoutError):
            pass
        except ray.exceptions.RayTaskError as e:
            raise unwrap(e, "worker") from None
