"""Which worker serves a request: session stickiness, then prefix-cache affinity, then least outstanding
tokens.

The router keeps, per worker, the requests it admitted there and not yet finished, and what they may cost
(prompt + max_tokens each): it learns of a request twice (its admission, its end; a third time if its worker
is lost), never from its tokens, which go from the worker straight to the caller. A request is admitted only
to a live worker below its admission bound (from the workers' telemetry, through the scheduler); if there is
none, Overloaded. Among those:

1. session: a session's turns go to the first worker of its ranking (scheduling/session_hash.py) that admits
   them, the one that holds its earlier turns' KV blocks; every router ranks alike, with no shared table. A
   client session (actors/client_session.py) names its worker (pinned), and goes there while it is alive;
2. prefix: the first blocks of the prompt are hashed as the block pool hashes them; the worker that last
   took the longest matching chain probably still caches it, and keeps it while the extra load it
   carries is no more than the prefill the hit saves plus half the lightest load;
3. adapter: a request with a LoRA adapter goes to the worker that last took one with that adapter (it
   probably holds it among its max_loras, no fetch needed), while the extra load it carries is no more
   than ADAPTER_LOAD_TOKENS plus half the lightest load;
4. load: otherwise the worker with the fewest outstanding tokens (then requests, then declaration order).

Several routers may admit to one worker, each counting only its own requests there; the worker enforces its
bound itself (actors/worker.py) and a refused caller tries the `fallbacks` of its admission in order.
"""

import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from cluster_configs.errors import Overloaded, Unavailable
from memory.block_pool import hash_block
from scheduling.session_hash import session_ranking

NUM_AFFINITY_BLOCKS = 4  # prompt blocks hashed for affinity: enough to tell system prompts apart
MAX_ENTRIES = 1 << 16  # prefix chains and adapters remembered (LRU)
# what loading an adapter onto a worker costs, in tokens of load: fetching it through the object store and
# copying it into a slot takes about as long as a short prefill (a rank-16 TinyLlama adapter: 50 MB)
ADAPTER_LOAD_TOKENS = 128


@dataclass
class WorkerLoad:
    worker_id: str
    admission_bound: int
    alive: bool = True
    request_ids: set[str] = field(default_factory=set)
    num_tokens: int = 0  # outstanding tokens of those requests

    @property
    def num_requests(self) -> int:
        return len(self.request_ids)

    @property
    def admits(self) -> bool:
        return self.alive and self.num_requests < self.admission_bound


@dataclass
class _Route:
    worker_id: str
    num_tokens: int  # outstanding
    assigned_at: float  # the policy's clock


class _LRU(OrderedDict):
    def put(self, key, value) -> None:
        self[key] = value
        self.move_to_end(key)
        if len(self) > MAX_ENTRIES:
            self.popitem(last=False)


class RoutingPolicy:
    def __init__(self, worker_ids: Sequence[str], block_size: int, admission_bound: int,
                 clock: Callable[[], float] = time.monotonic):
        self.block_size = block_size
        self.clock = clock
        self.workers = {w: WorkerLoad(w, admission_bound) for w in worker_ids}
        self.routes: dict[str, _Route] = {}
        self.prefixes = _LRU()  # block chain hash -> worker id
        self.adapters = _LRU()  # adapter -> the worker that last took a request with it
        self.num_routed = {"session": 0, "prefix": 0, "adapter": 0, "load": 0, "reroute": 0}
        # calls per request: what the router handles for each (a caller's admit, finish, reroute)
        self.num_calls = {"admit": 0, "finish": 0, "reroute": 0}
        self.num_swept = 0  # requests released because their caller went away without finishing them

    # ---- decisions ---------------------------------------------------------------------------------

    def route(self, request_id: str, prompt_ids: Sequence[int], max_new_tokens: int, *,
              session: str | None = None, extra: tuple = (), adapter: str | None = None,
              pinned: str | None = None) -> str:
        """Admit a request to a worker and account for it there; Overloaded if no live worker admits it
        (Unavailable, a kind of Overloaded, if no worker is alive), or if pinned is alive and does not."""
        self.num_calls["admit"] += 1
        hashes = self.prefix_hashes(prompt_ids, extra)
        if pinned in self.workers and self.workers[pinned].alive:
            worker, reason = self.workers[pinned], "session"
            if not worker.admits:
                raise Overloaded(f"the session's worker {pinned} has {worker.num_requests} requests "
                                 f"outstanding, its bound; retry later")
        else:
            candidates = [w for w in self.workers.values() if w.admits]
            if not candidates:
                error = Overloaded if any(w.alive for w in self.workers.values()) else Unavailable
                raise error(self._overloaded_message())
            worker, reason = self._choose(candidates, hashes, session, adapter)
        self.num_routed[reason] += 1
        self._assign(request_id, worker, len(prompt_ids) + max_new_tokens)
        self._remember(worker.worker_id, hashes, adapter)
        return worker.worker_id

    def fallbacks(self, worker_id: str, session: str | None = None) -> list[str]:
        """The other workers this router would admit a request to, in the order its caller tries them when
        worker_id refuses it at its own bound (other routers filled it): the session's ranking, else the least
        loaded first. The router keeps counting the request on worker_id until it ends."""
        others = [w for w in self.workers.values() if w.admits and w.worker_id != worker_id]
        if session is not None:
            return session_ranking(session, [w.worker_id for w in others])
        return [w.worker_id for w in sorted(others, key=self._load_key)]

    def reroute(self, request_id: str, num_tokens_left: int) -> str | None:
        """Move an admitted request off its (dead) worker to the least loaded live one, bound or not."""
        self.num_calls["reroute"] += 1
        self._release(request_id)
        alive = [w for w in self.workers.values() if w.alive]
        if not alive:
            return None
        worker = min(alive, key=self._load_key)
        self.num_routed["reroute"] += 1
        self._assign(request_id, worker, num_tokens_left)
        return worker.worker_id

    def _choose(self, candidates: list[WorkerLoad], hashes: list[int], session: str | None,
                adapter: str | None) -> tuple[WorkerLoad, str]:
        by_id = {w.worker_id: w for w in candidates}
        if session is not None:
            return by_id[session_ranking(session, by_id)[0]], "session"
        least = min(candidates, key=self._load_key)
        for num_blocks in range(len(hashes), 0, -1):
            holder = by_id.get(self.prefixes.get(hashes[num_blocks - 1]))
            if holder is not None:
                saved = num_blocks * self.block_size
                if holder.num_tokens - least.num_tokens <= saved + least.num_tokens // 2:
                    return holder, "prefix"
                break
        holder = by_id.get(self.adapters.get(adapter)) if adapter is not None else None
        if holder is not None and holder is not least and \
                holder.num_tokens - least.num_tokens <= ADAPTER_LOAD_TOKENS + least.num_tokens // 2:
            return holder, "adapter"
        return least, "load"

    @staticmethod
    def _load_key(w: WorkerLoad) -> tuple[int, int]:
        return w.num_tokens, w.num_requests

    def prefix_hashes(self, prompt_ids: Sequence[int], extra: tuple = ()) -> list[int]:
        """Chained hashes of the prompt's first full blocks (at most NUM_AFFINITY_BLOCKS)."""
        hashes, parent = [], None
        num_blocks = min(NUM_AFFINITY_BLOCKS, len(prompt_ids) // self.block_size)
        for i in range(num_blocks):
            parent = hash_block(parent, prompt_ids[i * self.block_size:(i + 1) * self.block_size], extra)
            hashes.append(parent)
        return hashes

    # ---- accounting --------------------------------------------------------------------------------

    def finish(self, request_id: str) -> None:
        """The request ended (finished, aborted or failed); unknown ids (a restarted router's) are ignored."""
        self.num_calls["finish"] += 1
        self._release(request_id)

    def sweep(self, worker_id: str, running_ids: Collection[str], grace_s: float) -> list[str]:
        """Release the requests placed on worker_id more than grace_s ago that it does not run (any more):
        their caller went away without finish. -> their ids. running_ids: the worker's, asked after the
        placements it is checked against (a request placed later is younger than grace_s)."""
        oldest = self.clock() - grace_s
        gone = [request_id for request_id, route in self.routes.items() if route.worker_id == worker_id
                and route.assigned_at < oldest and request_id not in running_ids]
        for request_id in gone:
            self._release(request_id)
        self.num_swept += len(gone)
        return gone

    def mark_down(self, worker_id: str) -> None:
        self.workers[worker_id].alive = False

    def mark_up(self, worker_id: str) -> None:
        self.workers[worker_id].alive = True

    def set_admission_bound(self, worker_id: str, bound: int) -> None:
        if worker_id in self.workers:
            self.workers[worker_id].admission_bound = bound

    def _assign(self, request_id: str, worker: WorkerLoad, num_tokens: int) -> None:
        self.routes[request_id] = _Route(worker.worker_id, num_tokens, self.clock())
        worker.request_ids.add(request_id)
        worker.num_tokens += num_tokens

    def _release(self, request_id: str) -> None:
        route = self.routes.pop(request_id, None)
        if route is not None:
            worker = self.workers[route.worker_id]
            worker.request_ids.discard(request_id)
            worker.num_tokens -= route.num_tokens

    def _remember(self, worker_id: str, hashes: list[int], adapter: str | None) -> None:
        if adapter is not None:
            self.adapters.put(adapter, worker_id)
        for h in hashes:
            self.prefixes.put(h, worker_id)

    def _overloaded_message(self) -> str:
        alive = [w for w in self.workers.values() if w.alive]
        if not alive:
            return (f"no worker is available (all {len(self.workers)} are down or restarting); "
                    "retry in a few seconds")
        loads = ", ".join(f"{w.worker_id}: {w.num_requests}/{w.admission_bound}" for w in alive)
        return (f"every worker's queue is full ({loads} requests outstanding/admitted); retry later, "
                "or raise max_queued_per_worker or add workers")
