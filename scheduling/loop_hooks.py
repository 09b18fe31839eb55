"""LoopHooks: what a front door adds to the engine loop (scheduling/engine_loop.py). Every method runs on the
loop thread; the defaults add nothing, which is what numaserve.LLM uses. The worker actor's hooks
(actors/worker_hooks.py) warm up its kernels, keep its metrics, report telemetry and hand outputs to its
event loop."""

from collections.abc import Callable, Sequence

from scheduling.outputs import RequestOutput, StepOutput
from scheduling.request import Request


class LoopHooks:
    def started(self, engine) -> None:
        """Once, on the loop thread, before it takes any message."""

    def submitted(self, requests: Sequence[Request]) -> None:
        """Requests were queued in the engine."""

    def stepped(self, step: StepOutput, started_at: float) -> None:
        """A step ran (started_at: its time.perf_counter() at the start)."""

    def ended(self, outputs: list[RequestOutput]) -> None:
        """Requests ended outside a step: aborted, or past their deadline while paused."""

    def tick(self, engine, post: Callable[[Callable], None]) -> float | None:
        """Between steps, and when the inbox's wait ends: periodic work. post(fn), from any thread, runs
        fn(engine) on the loop thread later (EngineLoop.post): where an answer to the work goes. -> seconds
        until it is due again (None: never)."""
        return None

    def failure(self, error: Exception) -> Exception:
        """What the requests a failing step held are failed with."""
        return error

    def fatal(self, error: Exception) -> None:
        """A step raised an error after which the engine cannot step again (RankLost: a tensor-parallel rank
        is gone), before its requests are failed. The default adds nothing: later steps raise it again."""

    def deliver(self, items: list[tuple]) -> None:
        """Hand on (outbox, output or RequestFailed) pairs, a step's at once, in order."""
        for outbox, item in items:
            outbox.put(item)
