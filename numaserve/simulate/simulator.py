"""The discrete-event simulation of one deployment: callers, the router, the scheduler's policy loop and the
modelled workers, wired as actors/ wires them.

Per request (times are simulated seconds):
  arrival -> its caller tokenizes and validates (caller CPU; "relay": the router does, as today) -> the
  router's admission (router CPU), where the real RoutingPolicy.route picks the worker or raises Overloaded
  -> a cold adapter is fetched first (adapter_load_s; the request waits, the worker's others do not, as
  #27 asks) -> the worker's Scheduler queue.
A worker steps while it has requests: plan (real Scheduler.schedule, Speculator.propose), its StepCostModel
seconds, then the real OutputProcessor. Each step's deltas coalesce into chunks per request (the first at
once, the next after stream_interval_s, the last at once), and each chunk is its own item with its own
caller CPU: the per-request streams before caller channels (actors/caller_channel.py, which send one batch
per caller per release), so at many streams this charges the caller more than it now costs. A chunk then
crosses the router ("relay", the deployment before #27: router CPU per chunk, finish after the last) or
not ("placement": the caller calls the router once more at the end), then its caller (caller CPU), where
the caller sees its tokens. Every telemetry_interval_s each worker's StepTelemetry goes to the real
BatchingPolicy, whose Policy the worker applies (Engine.apply) and the router takes its admission bound from.

Not modelled: the network and Ray's own overheads beyond the per-call CPU, worker failures and restarts,
stop strings and EOS (every request generates max_tokens), the scheduler's reply delay (a policy applies at
the tick that computed it).
"""

from dataclasses import dataclass, field

import numpy as np

from cluster_configs.errors import Overloaded
from cluster_configs.sampling_params import SamplingParams
from memory.block_pool import prefix_cache_key
from numaserve.simulate.config import SimConfig
from numaserve.simulate.events import EventQueue, FifoServer
from numaserve.simulate.sim_proposer import SimProposer
from numaserve.simulate.sim_worker import SimWorker
from numaserve.simulate.traces import Arrival, make_trace
from scheduling.outputs import RequestOutput
from scheduling.policy import BatchingPolicy, PolicyLimits, admission_bound
from scheduling.request import Request
from scheduling.routing import RoutingPolicy

UNBOUNDED = 1 << 30  # the admission bound with admission off


class NoPrefixAffinity(RoutingPolicy):
    """RoutingPolicy with prefix affinity off: no prompt's blocks are hashed, remembered or followed."""

    def prefix_hashes(self, prompt_ids, extra=()) -> list[int]:
        return []


@dataclass
class _Stream:
    """One request as its caller and its worker see it."""
    arrival: Arrival
    index: int  # in the trace
    arrived_at: float
    caller: int
    worker_id: str | None = None
    hold_until: float = 0.0
    num_pending: int = 0  # tokens ready on the worker, not yet sent as a chunk
    finished: bool = False  # the worker's last delta was put
    release_pending: bool = False
    first_at: float | None = None
    last_at: float = 0.0


@dataclass
class _Totals:
    num_arrived: int = 0
    num_completed: int = 0
    num_rejected: int = 0
    num_delivered_tokens: int = 0
    num_window_tokens: int = 0  # delivered within [warmup_s, duration_s)
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)  # per token: its chunk's gap over the chunk's tokens


class Simulation:
    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        self.events = EventQueue()
        engine = cfg.engine_config()
        self.arrivals = make_trace(cfg.trace, cfg.rate, cfg.duration_s, cfg.seed, cfg.prompt_len,
                                   cfg.max_tokens)
        self.sampler = SimProposer(cfg.accept_rate, cfg.seed, cfg.step_cost.draft_pass_s)
        ids = [f"m{i * cfg.machines // cfg.workers}-w{i}" for i in range(cfg.workers)]
        self.workers = {w: SimWorker(w, engine, cfg.worker_cost(), self.sampler, engine.max_model_len,
                                     cfg.tensor_parallel) for w in ids}
        bound = (admission_bound(engine.max_num_seqs, cfg.max_queued_per_worker) if cfg.admission
                 else UNBOUNDED)
        routing = RoutingPolicy if cfg.prefix_affinity else NoPrefixAffinity
        self.routing = routing(ids, engine.block_size, bound)
        self.batching = BatchingPolicy(PolicyLimits(engine.max_num_batched_tokens, engine.max_num_seqs,
                                                    cfg.max_queued_per_worker, cfg.target_step_s))
        self.params = SamplingParams(max_tokens=cfg.max_tokens, temperature=0.0, ignore_eos=True, seed=0)
        self.router = FifoServer()
        self.callers = [FifoServer() for _ in range(cfg.machines)]
        self.streams: dict[str, _Stream] = {}
        self.next_turns: dict[str, list[tuple[int, Arrival]]] = {}  # request id -> the turns that follow it
        self.totals = _Totals()

    def run(self) -> dict:
        for i, a in enumerate(self.arrivals):
            if a.previous is None:
                self.events.at(a.time, self._arrive, i, a)
            else:
                self.next_turns.setdefault(a.previous, []).append((i, a))
        self.events.at(0.0, self._tick)
        self.events.run()
        return self.results()

    # ---- a request's way in ----------------------------------------------------------------------------

    def _arrive(self, index: int, a: Arrival) -> None:
        """Placement: the caller tokenizes and validates; relay (today): the router does."""
        now, cost = self.events.now, self.cfg.deployment_cost
        self.totals.num_arrived += 1
        s = self.streams[a.request_id] = _Stream(a, index, now, index % self.cfg.machines)
        tokenize_s = 0.0 if self.cfg.routing == "relay" else cost.caller_admission_s
        self.events.at(self.callers[s.caller].serve(now, tokenize_s), self._to_router, s)

    def _to_router(self, s: _Stream) -> None:
        cost = self.cfg.deployment_cost
        tokenize_s = cost.caller_admission_s if self.cfg.routing == "relay" else 0.0
        done = self.router.serve(self.events.now, cost.router_admission_s + tokenize_s)
        self.events.at(done, self._admit, s)

    def _admit(self, s: _Stream) -> None:
        a, cfg = s.arrival, self.cfg
        try:
            s.worker_id = self.routing.route(a.request_id, a.prompt_ids, cfg.max_tokens,
                                             session=a.session if cfg.stickiness else None,
                                             extra=prefix_cache_key(a.adapter, None), adapter=a.adapter)
        except Overloaded:
            self.totals.num_rejected += 1
            return
        worker = self.workers[s.worker_id]
        req = Request(a.request_id, list(a.prompt_ids), self.params, adapter_id=a.adapter,
                      max_model_len=cfg.engine.max_model_len)
        self.sampler.register(a.request_id, a.output_ids, s.index)
        if a.adapter is not None and not worker.holds_adapter(a.adapter):
            self.events.at(self.events.now + cfg.adapter_load_s, self._enter, worker, req)
        else:
            self._enter(worker, req)

    def _enter(self, worker: SimWorker, req: Request) -> None:
        worker.submit(req)
        if not worker.busy:
            self._step(worker)

    # ---- workers -------------------------------------------------------------------------------------------

    def _step(self, worker: SimWorker) -> None:
        plan, seconds = worker.plan_step()
        worker.busy = bool(plan.scheduled)
        if worker.busy:
            self.events.at(self.events.now + seconds, self._step_done, worker, plan, seconds)

    def _step_done(self, worker: SimWorker, plan, seconds: float) -> None:
        for out in worker.finish_step(plan, seconds):
            self._put(out)
        worker.busy = False
        if worker.has_unfinished():
            self._step(worker)

    def _tick(self) -> None:
        """The policy loop: each worker's telemetry -> BatchingPolicy -> the worker and the router."""
        for worker_id, worker in self.workers.items():
            policy = self.batching.update(worker.telemetry())
            worker.apply(policy)
            if self.cfg.admission:
                self.routing.set_admission_bound(worker_id, policy.admission_bound)
        if len(self.events):  # something else is still to happen
            self.events.at(self.events.now + self.cfg.telemetry_interval_s, self._tick)

    # ---- a request's way out ------------------------------------------------------------------------

    def _put(self, out: RequestOutput) -> None:
        """A step's delta joins the request's pending chunk."""
        s, now = self.streams[out.request_id], self.events.now
        s.num_pending += len(out.token_ids)
        s.finished = out.finished
        if out.finished or now >= s.hold_until:
            self._send(s)
        elif not s.release_pending:
            s.release_pending = True
            self.events.at(s.hold_until, self._hold_over, s)

    def _hold_over(self, s: _Stream) -> None:
        s.release_pending = False
        if s.num_pending:
            self._send(s)

    def _send(self, s: _Stream) -> None:
        now, n = self.events.now, s.num_pending
        s.num_pending, s.hold_until = 0, now + self.cfg.stream_interval_s
        if self.cfg.routing == "relay":
            done = self.router.serve(now, self.cfg.deployment_cost.router_chunk_s)
            self.events.at(done, self._relayed, s, n, s.finished)
        else:
            self._to_caller(s, n, s.finished)

    def _relayed(self, s: _Stream, n: int, finished: bool) -> None:
        request_id = s.arrival.request_id
        if finished:
            self.routing.finish(request_id)
        self._to_caller(s, n, finished)

    def _to_caller(self, s: _Stream, n: int, finished: bool) -> None:
        done = self.callers[s.caller].serve(self.events.now, self.cfg.deployment_cost.caller_chunk_s)
        self.events.at(done, self._deliver, s, n, finished)

    def _deliver(self, s: _Stream, n: int, finished: bool) -> None:
        now, t = self.events.now, self.totals
        if s.first_at is None:
            s.first_at = now
            t.ttft_s.append(now - s.arrived_at)
        elif n:
            t.itl_s.extend([(now - s.last_at) / n] * n)
        s.last_at = now
        t.num_delivered_tokens += n
        if self.cfg.warmup_s <= now < self.cfg.duration_s:
            t.num_window_tokens += n
        if not finished:
            return
        t.num_completed += 1
        if self.cfg.routing == "placement":
            done = self.router.serve(now, self.cfg.deployment_cost.router_finish_s)
            self.events.at(done, self.routing.finish, s.arrival.request_id)
        for index, nxt in self.next_turns.get(s.arrival.request_id, ()):
            if now + nxt.think_s < self.cfg.duration_s:
                self.events.at(now + nxt.think_s, self._arrive, index, nxt)

    # ---- figures ------------------------------------------------------------------------------------

    def results(self) -> dict:
        t, cfg = self.totals, self.cfg
        generated = [w.num_generated_tokens for w in self.workers.values()]
        lookups = sum(w.num_prefix_lookup_tokens for w in self.workers.values())
        hits = sum(w.num_prefix_hit_tokens for w in self.workers.values())
        makespan = self.events.now
        return {
            "throughput_tok_s": t.num_window_tokens / (cfg.duration_s - cfg.warmup_s),
            "ttft_p50_s": _percentile(t.ttft_s, 50), "ttft_p99_s": _percentile(t.ttft_s, 99),
            "itl_p50_s": _percentile(t.itl_s, 50), "itl_p99_s": _percentile(t.itl_s, 99),
            "imbalance": max(generated) / np.mean(generated) if sum(generated) else 1.0,
            "session_hit_rate": self.session_hit_rate(),
            "prefix_hit_rate": hits / lookups if lookups else None,
            "completed": t.num_completed, "rejected": t.num_rejected, "arrived": t.num_arrived,
            "generated_tokens": sum(generated), "delivered_tokens": t.num_delivered_tokens,
            "preemptions": sum(w.num_preemptions for w in self.workers.values()),
            "routed": dict(self.routing.num_routed),
            "router_calls_per_request": self.router.num_calls / max(t.num_arrived, 1),
            "router_utilization": self.router.busy_s / makespan if makespan else 0.0,
            "caller_utilization_max": max(c.busy_s for c in self.callers) / makespan if makespan else 0.0,
            "makespan_s": makespan,
            "config": cfg.model_dump(mode="json"),
        }

    def session_hit_rate(self) -> float | None:
        """Of the later session turns a worker took, the share that found at least their previous turn's
        prompt (its full blocks) in that worker's prefix cache; None without such turns."""
        by_id = {a.request_id: a for a in self.arrivals}
        cached = {}
        for w in self.workers.values():
            cached |= w.cached_on_admission
        bs = self.cfg.engine.block_size
        turns = [(cached[r], len(by_id[a.previous].prompt_ids) // bs * bs) for r, a in by_id.items()
                 if a.previous is not None and r in cached]
        return sum(c >= need for c, need in turns) / len(turns) if turns else None


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def simulate(cfg: SimConfig) -> dict:
    return Simulation(cfg).run()
