"""GET /v1/numaserve/stats: the deployment now, as typed records (the web console's live view reads them; so
can any script). Built from the router's live view (Router.live: per worker its placement, its engine's stats
and its CPU seconds), never from scraped Prometheus text."""

import time

from pydantic import BaseModel


class StageTimes(BaseModel):
    """Seconds of the mean engine step of the last few seconds, by stage (scheduling/step_stats.py)."""

    schedule: float
    propose: float
    run: float
    sample: float
    process: float


class EngineView(BaseModel):
    """What a worker's engine is doing (scheduling/recent_steps.py for the rates)."""

    num_running: int
    num_waiting: int
    tokens_per_s: float  # generated, over the last window_s
    prompt_tokens_per_s: float  # prefilled, over the last window_s
    window_s: float
    num_generated_tokens: int  # since the worker started
    kv_used_blocks: int
    kv_total_blocks: int
    kv_usage: float  # used / total
    prefix_hit_rate: float  # prompt tokens found in the prefix cache, of those looked up, since start
    spec_method: str  # "off", "ngram", "eagle", ...
    spec_acceptance: float | None  # accepted draft tokens of those verified since start; None: none yet
    adapters_loaded: list[str]  # LoRA adapters resident in the worker
    lora_slots_held: list[str]  # of those, the ones in the low-rank slots now
    stage_seconds: StageTimes
    cpu_seconds: float | None  # of the worker's processes since start; None: not measured (in process)
    tensor_parallel_size: int


class WorkerView(BaseModel):
    worker_id: str
    alive: bool  # the router's view: False while it is down or restarting
    machine: str | None
    numa_node: int | None
    cpu_ids: list[int]
    engine: EngineView | None  # None: it did not answer (see error)
    error: str | None


class ConsoleStats(BaseModel):
    model: str
    time: float  # seconds since the epoch, when gathered (a copy served twice keeps its time)
    num_routed: int  # requests the router placed since it started
    workers: list[WorkerView]
    error: str | None  # the router did not answer: no workers listed


def console_stats(model: str, stats: dict) -> ConsoleStats:
    """stats: the router's live view (Router.live; Router.stats has its shape too, without "time"), or
    {"error": ...} when it did not answer."""
    workers = [_worker(worker_id, w) for worker_id, w in sorted(stats.get("workers", {}).items())]
    return ConsoleStats(model=model, time=stats.get("time", time.time()),
                        num_routed=sum(stats.get("routed", {}).values()), workers=workers,
                        error=stats.get("error"))


def _worker(worker_id: str, w: dict) -> WorkerView:
    info = w.get("info", {})
    engine = _engine(w) if "num_running" in w else None
    alive = w.get("alive", True)
    error = None if engine is not None else w.get("error", "no answer" if alive else "down")
    return WorkerView(worker_id=worker_id, alive=alive, machine=info.get("machine"),
                      numa_node=info.get("numa_node"), cpu_ids=info.get("cpu_ids", []), engine=engine,
                      error=error)


def _engine(w: dict) -> EngineView:
    recent = w["recent"]
    drafted = w.get("spec_num_draft_tokens", 0)
    return EngineView(
        num_running=w["num_running"], num_waiting=w["num_waiting"], tokens_per_s=recent["tokens_per_s"],
        prompt_tokens_per_s=recent["prompt_tokens_per_s"], window_s=recent["window_s"],
        num_generated_tokens=w["num_generated_tokens"], kv_used_blocks=w["num_used_blocks"],
        kv_total_blocks=w["num_blocks"], kv_usage=w["kv_usage"], prefix_hit_rate=w["prefix_hit_rate"],
        spec_method=w.get("spec_method", "off"),
        spec_acceptance=w["spec_num_accepted_tokens"] / drafted if drafted else None,
        adapters_loaded=w.get("adapters_loaded", []), lora_slots_held=w.get("lora_slots_held", []),
        stage_seconds=StageTimes(**recent["stage_seconds"]),
        cpu_seconds=w.get("cpu_seconds"),
        tensor_parallel_size=w.get("tensor_parallel", {}).get("size", 1))
