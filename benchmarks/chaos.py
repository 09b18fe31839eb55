"""The chaos loop of `bench_soak --http --chaos`: while the HTTP soak runs, it kills an actor of the
deployment every 20-60 s (seeded), Ray restarts it, and it measures the recovery: kill to the next successful
request through that path. Kinds come in shuffled rounds (each round kills each kind once, in a random order)
and a kill waits until the one before has recovered, so every kind is hit and no two restarts overlap.

Recovery, per kind (each probe polled every PROBE_INTERVAL_S):
- worker: the router has it alive again in a new process, then a completion is served over HTTP;
- router: a completion is served over HTTP (admitted by the restarted router);
- scheduler: the router's stats show every worker's policy again, from the restarted scheduler;
- adapters (the adapter cache): a completion on the adapter is served over HTTP (its name resolved by the
  restarted cache);
- http (one of the HTTP actors sharing the port): a completion is served over HTTP.
"""

import threading
import time
from dataclasses import dataclass

import numpy as np
import openai
import ray

from actors.deployment_actors import deployment_actor_names
from actors.ray_instance import NAMESPACE

KINDS = ("worker", "router", "scheduler", "adapters", "http")
PROBE_INTERVAL_S = 0.2
RECOVERY_BOUND_S = 180.0  # a path not back by then is recorded as not recovered (None)


@dataclass
class Kill:
    kind: str  # one of KINDS
    actor: str  # the actor's name
    at_s: float  # since the soak's arrivals started
    recovered_s: float | None = None  # kill -> the next successful request through that path


def actors_of(name: str, kind: str) -> list[str]:
    """The deployment's actors of one kind, by name (actors/deploy.py names them)."""
    names = deployment_actor_names(name)
    if kind in ("worker", "router", "http"):
        return sorted(n for n in names if n.startswith(f"{name}.{kind}"))
    return [n for n in names if n == f"{name}.{kind}"]


def kill_times(seed: np.random.SeedSequence | int, interval_s: tuple[float, float]):
    """The kills' times from the start: each the one before plus a uniform draw from interval_s."""
    rng = np.random.default_rng(seed)
    at_s = 0.0
    while True:
        at_s += float(rng.uniform(*interval_s))
        yield at_s


class Chaos:
    def __init__(self, client, adapter: str | None, seed: int = 0,
                 interval_s: tuple[float, float] = (20.0, 60.0)):
        self.client, self.adapter = client, adapter
        schedule, picks = np.random.SeedSequence(seed).spawn(2)
        self.times = kill_times(schedule, interval_s)  # the kills' times (from t0), as long as needed
        self.rng = np.random.default_rng(picks)  # which kind, which actor
        self.kills: list[Kill] = []
        self.api = openai.OpenAI(base_url=f"{client.http_url}/v1", api_key="unused", max_retries=0,
                                 timeout=10)
        self.model = None
        self._round: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, t0: float) -> None:
        """Kill from now on (times counted from t0), in a thread of its own, until stop()."""
        self.model = self.api.models.list().data[0].id
        self._thread = threading.Thread(target=self._run, args=(t0,), name="chaos", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """No more kills; returns once the last one has recovered (or RECOVERY_BOUND_S has passed)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.api.close()

    def _run(self, t0: float) -> None:
        for at_s in self.times:
            if self._stop.wait(max(0.0, t0 + at_s - time.monotonic())):
                return  # (a kill due while the one before recovered comes right after it)
            kind = self._next_kind()
            victims = actors_of(self.client.name, kind)
            if not victims:
                continue
            actor = victims[int(self.rng.integers(len(victims)))]
            old_pid = self._worker_pid(actor) if kind == "worker" else None
            kill = Kill(kind, actor, time.monotonic() - t0)
            try:
                ray.kill(ray.get_actor(actor, namespace=NAMESPACE), no_restart=False)
            except ValueError:  # gone meanwhile (restarting): the next interval picks again
                continue
            self.kills.append(kill)
            kill.recovered_s = self._recovery(kind, actor, old_pid, t0 + kill.at_s)

    def short_of_a_round(self) -> bool:
        """Whether some kind has not been killed and recovered yet (a short soak goes on until each has)."""
        return {k.kind for k in self.kills if k.recovered_s is not None} != set(KINDS)

    def _next_kind(self) -> str:
        if not self._round:
            self._round = [str(k) for k in self.rng.permutation(KINDS)]
        return self._round.pop()

    def _recovery(self, kind: str, actor: str, old_pid: int | None, killed_at: float) -> float | None:
        deadline = killed_at + RECOVERY_BOUND_S
        while time.monotonic() < deadline:
            if self._recovered(kind, actor, old_pid):
                return time.monotonic() - killed_at
            time.sleep(PROBE_INTERVAL_S)
        return None

    def _recovered(self, kind: str, actor: str, old_pid: int | None) -> bool:
        try:
            if kind == "worker":
                pid = self._worker_pid(actor)
                return pid is not None and pid != old_pid and self._served(self.model)
            if kind == "scheduler":
                stats = self.client.stats()  # (one call: it asks every worker and the scheduler)
                return "error" not in stats["policies"] and len(stats["policies"]) == len(stats["workers"])
            return self._served(self.adapter if kind == "adapters" else self.model)
        except Exception:  # noqa: BLE001  (anything short of an answer: not recovered yet)
            return False

    def _served(self, model: str) -> bool:
        r = self.api.completions.create(model=model, prompt=[5, 6, 7], max_tokens=2,
                                        extra_body={"ignore_eos": True})
        return r.usage.completion_tokens == 2

    def _worker_pid(self, actor: str) -> int | None:
        worker_id = actor.rsplit(".", 1)[-1]
        try:
            stats = self.client.stats()["workers"].get(worker_id, {})
        except Exception:  # noqa: BLE001  (the router restarting)
            return None
        return stats["info"]["pid"] if stats.get("alive") and "info" in stats else None

    def summary(self) -> dict:
        """Kills by kind, recovery percentiles (all kills, and per kind), every kill."""
        recovered = [k.recovered_s for k in self.kills if k.recovered_s is not None]

        def pct(xs, q):
            return float(np.percentile(xs, q)) if xs else None

        return {
            "num_kills": len(self.kills),
            "kills_by_kind": {kind: sum(k.kind == kind for k in self.kills) for kind in KINDS},
            "num_not_recovered": sum(k.recovered_s is None for k in self.kills),
            "recovery_p50_s": pct(recovered, 50), "recovery_p99_s": pct(recovered, 99),
            "recovery_by_kind": {kind: {"p50_s": pct(xs, 50), "max_s": max(xs) if xs else None}
                                 for kind in KINDS
                                 if (xs := [k.recovered_s for k in self.kills
                                            if k.kind == kind and k.recovered_s is not None])},
            "kills": [vars(k) for k in self.kills],
        }

    def during_restart(self, start_s: float, end_s: float, kinds: tuple[str, ...] = KINDS,
                       slack_s: float = 5.0) -> bool:
        """Whether a kill of one of these kinds, or the restart after it, overlapped [start_s, end_s]."""
        return any(k.kind in kinds and k.at_s <= end_s and
                   (k.recovered_s is None or start_s <= k.at_s + k.recovered_s + slack_s)
                   for k in self.kills)
