"""The messages between a deployment's processes (STYLE 8, 16): the router's answers to a caller and a
caller's requests to a worker. (A worker's event loop and its engine loop: scheduling/loop_messages.py.)"""

from dataclasses import dataclass
from typing import Any

from actors.resume import Resume
from cluster_configs.sampling_params import SamplingParams

# ---- router -> caller ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """Where an admitted request runs."""

    worker_id: str
    worker: Any  # its NumaWorker handle


@dataclass(frozen=True)
class Admission:
    """A request the router admitted: the caller streams it from placement's worker, then calls
    Router.finish(request_id)."""

    request_id: str
    placement: Placement
    prompt_token_ids: list[int]
    params: SamplingParams  # validated by the caller
    adapter: str | None  # the id of the adapter's version (AdapterCache.resolve)
    cache_salt: str | None
    # where the caller goes, in turn, while workers refuse it at their own bound (other routers filled them)
    fallbacks: tuple[Placement, ...] = ()


# ---- caller -> worker -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerateRequest:
    """One attempt at a request on one worker (NumaWorker.submit). With resume, prompt_token_ids end in the
    output a lost worker had streamed."""

    request_id: str  # the attempt's id, unique on its worker
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: str | None = None  # an adapter id (Admission.adapter)
    cache_salt: str | None = None
    resume: Resume | None = None
    admission_id: str | None = None  # Admission.request_id (None: not admitted by a router)
    # a session sequence's turn: prompt_token_ids are its history + the new input, and the worker goes on from
    # the live KV it keeps under this id (or builds it: the first turn, or after a worker's loss)
    sequence_id: str | None = None
    # the caller: its deltas go to the caller's stream (NumaWorker.caller_stream), and the request is aborted
    # once the caller stops renewing its lease (actors/caller_lease.py); required by submit
    caller_id: str | None = None


@dataclass(frozen=True)
class ForkSequence:
    """NumaWorker.fork_sequence's argument: fork_id starts as sequence_id's copy, sharing its full KV blocks
    (nothing, if this worker does not hold sequence_id: the fork's first turn builds its KV)."""

    sequence_id: str
    fork_id: str


@dataclass(frozen=True)
class FreeSequences:
    """NumaWorker.free_sequences's argument: forget these sequences and free their KV (reset, a session's
    close)."""

    sequence_ids: tuple[str, ...]


@dataclass(frozen=True)
class EmbedRequest:
    """NumaWorker.embed's argument: one prompt's pooled final hidden states (/v1/embeddings)."""

    request_id: str  # unique on its worker
    prompt_token_ids: list[int]
    pooling: str  # scheduling/embedding.POOLINGS
    adapter: str | None = None  # an adapter id (Admission.adapter)
    admission_id: str | None = None  # Admission.request_id
