"""Typed errors of the public API. Each message says what is wrong and how to fix it."""


class NumaserveError(Exception):
    """Base class of every error numaserve raises on purpose."""


class InvalidRequest(NumaserveError, ValueError):
    """A request that cannot be served as given: bad prompt, bad params, unknown adapter."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        # the request field at fault, if one is ("prompt", "max_tokens", ...): HTTP errors name it
        self.param = param


class CheckpointError(NumaserveError):
    """A model directory that cannot be loaded: missing file or tensor, wrong shape, unsafe format."""


class AdapterError(NumaserveError):
    """A LoRA adapter that cannot be registered or applied."""


class Overloaded(NumaserveError):
    """Admission refused because every worker's queue is full; retry later."""


class Unavailable(Overloaded):
    """No worker is alive to serve (all are down or restarting); retry in a few seconds."""


class EngineClosed(NumaserveError, RuntimeError):
    """The LLM was closed: its engine serves no more requests."""


class RankLost(NumaserveError, RuntimeError):
    """A rank of a tensor-parallel group died or stopped answering: the group's step failed; the group must
    restart (all its ranks) before it serves again."""
