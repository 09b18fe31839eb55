"""The in-process side of bench_http: numaserve.LLM in its own process (benchmarks/engine_process.py), running
the same closed-loop load as the HTTP clients: `concurrency` requests in flight, the next one added as one
finishes, each token's time taken when the engine step that made it returns.

    python -m benchmarks.llm_load_worker MODEL_DIR '{"weight_dtype": "q8_0", ...}' [CPU_IDS, e.g. 1 or 0,1]
"""

import itertools
import os
import sys
import time

if len(sys.argv) > 3:  # pinned before numba starts its threads, which inherit the affinity
    os.sched_setaffinity(0, [int(c) for c in sys.argv[3].split(",")])

import numaserve as ns
from benchmarks.engine_process import serve

_ids = itertools.count()


class LoadRunner:
    def __init__(self, model_dir: str, engine_json: str):
        self.llm = ns.LLM(model_dir, **ns.EngineConfig.model_validate_json(engine_json).model_dump())

    def run(self, prompts: list[list[int]], max_tokens: int, concurrency: int) -> dict:
        """-> {"seconds": first add to last token, "requests": [{"start", "times", "num_tokens"}]}
        (perf_counter seconds; times: when each step that gave the request tokens returned)."""
        engine = self.llm.engine
        params = ns.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        pending, active, done = list(prompts), {}, []

        def admit() -> None:
            while pending and len(active) < concurrency:
                request_id = f"load-{next(_ids)}"
                active[request_id] = {"start": time.perf_counter(), "times": [], "num_tokens": 0}
                engine.add_request(request_id, pending.pop(0), params)

        start = time.perf_counter()
        admit()
        while active:
            outputs = engine.step().outputs
            now = time.perf_counter()
            for out in outputs:
                record = active[out.request_id]
                if out.token_ids:
                    record["times"].append(now)
                    record["num_tokens"] += len(out.token_ids)
                if out.finished:
                    done.append(active.pop(out.request_id))
            admit()
        return {"seconds": time.perf_counter() - start, "requests": done}


if __name__ == "__main__":
    runner = LoadRunner(sys.argv[1], sys.argv[2])
    serve({"run": runner.run})
