"""Decisions an engine took and why (kernel paths, fallbacks, speculation depth, adapter paths, preemptions),
in a bounded ring.

A decision is keyed by (topic, subject). Recording the same choice again for a key whose latest entry is
still in the ring counts a repeat on that entry (its reason and time become the latest) instead of adding
one: the ring holds changes of decision, not one entry per step. `LLM.diagnostics()` and a worker's
stats ("decisions") read it; a fallback is also logged, so it shows without asking.
"""

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

log = logging.getLogger("numaserve")


@dataclass
class Decision:
    # what was decided: "kernel", "activation_dtype", "speculation", "lora_path", "preemption", ...
    topic: str
    choice: str  # what was chosen
    reason: str | Callable[[], str]  # why, in words a user can act on (a callable: worded when read)
    # what it applies to: a layer type, a matrix, an adapter, a request id ("" = the engine)
    subject: str = ""
    time: float = 0.0  # time.time() when last recorded
    count: int = 1  # times this choice was recorded in a row for (topic, subject)


class DecisionLog:
    def __init__(self, maxlen: int = 512):
        if maxlen < 1:
            raise ValueError(f"DecisionLog maxlen={maxlen}: must be at least 1")
        self._ring: deque[Decision] = deque(maxlen=maxlen)
        self._latest: dict[tuple[str, str], Decision] = {}  # (topic, subject) -> its entry still in the ring

    def record(self, topic: str, choice: str, reason: str | Callable[[], str], subject: str = "", *,
               warn: bool = False) -> None:
        """reason: words, or a callable that words them when the log is read (a decision recorded every step
        need not format its reason every step)."""
        key = (topic, subject)
        latest = self._latest.get(key)
        if latest is not None and latest.choice == choice:
            latest.count += 1
            latest.reason, latest.time = reason, time.time()
            return
        if len(self._ring) == self._ring.maxlen:
            evicted = self._ring[0]
            if self._latest.get((evicted.topic, evicted.subject)) is evicted:
                del self._latest[(evicted.topic, evicted.subject)]
        decision = Decision(topic, choice, reason, subject, time.time())
        self._ring.append(decision)
        self._latest[key] = decision
        if warn:
            log.warning("%s%s: %s (%s)", topic, f" [{subject}]" if subject else "", choice, _words(reason))

    def recent(self, topic: str | None = None) -> list[dict]:
        return [asdict(d) | {"reason": _words(d.reason)} for d in self._ring
                if topic is None or d.topic == topic]


def _words(reason: str | Callable[[], str]) -> str:
    return reason() if callable(reason) else reason
