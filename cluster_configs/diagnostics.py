"""Decisions an engine took and why (kernel paths, fallbacks, speculation depth, ...), in a bounded ring.

`LLM.diagnostics()` and a worker's stats read it; a fallback is also logged, so it shows without asking.
"""

import logging
import time
from collections import deque
from dataclasses import asdict, dataclass

log = logging.getLogger("numaserve")


@dataclass(frozen=True)
class Decision:
    topic: str  # what was decided: "activation_dtype", "threading", "speculation", "preemption", ...
    choice: str  # what was chosen
    reason: str  # why, in words a user can act on
    subject: str = ""  # what it applies to: a matrix name, a request id, ... ("" = the whole engine)
    time: float = 0.0  # time.time() when recorded


class DecisionLog:
    def __init__(self, maxlen: int = 512):
        self._ring: deque[Decision] = deque(maxlen=maxlen)

    def record(self, topic: str, choice: str, reason: str, subject: str = "", *, warn: bool = False) -> None:
        self._ring.append(Decision(topic, choice, reason, subject, time.time()))
        if warn:
            log.warning("%s%s: %s (%s)", topic, f" [{subject}]" if subject else "", choice, reason)

    def recent(self, topic: str | None = None) -> list[dict]:
        return [asdict(d) for d in self._ring if topic is None or d.topic == topic]
