"""Scheduler: collects workers' StepTelemetry and answers each with its Policy (scheduling/policy.py): the
batching limits and, for a speculating worker, the SpeculationPolicy computed from its SpecTelemetry.

Workers call `report` about every 100 ms and apply the answer whenever it arrives (a worker keeps the
last answer while this actor is dead or restarting); the router polls `policies` for the admission
bounds. Nothing here blocks a request.
"""

import time
from dataclasses import asdict

import ray

from scheduling.policy import BatchingPolicy, Policy, PolicyLimits, StepTelemetry


@ray.remote(num_cpus=0)
class Scheduler:
    def __init__(self, limits: PolicyLimits):
        self.policy = BatchingPolicy(limits)
        self.telemetry: dict[str, tuple[StepTelemetry, float]] = {}  # worker id -> (latest, when received)

    def report(self, telemetry: StepTelemetry) -> Policy:
        self.telemetry[telemetry.worker_id] = (telemetry, time.time())
        return self.policy.update(telemetry)

    def policies(self) -> dict[str, Policy]:
        return dict(self.policy.policies)

    def stats(self) -> dict:
        """Per worker: the policy last sent (batching limits; speculation, None for a worker without it),
        the telemetry it came from (speculation's cost windows counted, not listed) and that telemetry's
        age."""
        now, out = time.time(), {}
        for worker_id, (t, received) in self.telemetry.items():
            policy = self.policy.policy(worker_id)
            telemetry = vars(t) | {"speculation": ([m.summary() for m in t.speculation]
                                                   if t.speculation else None)}
            out[worker_id] = {"policy": {k: v for k, v in vars(policy).items() if k != "speculation"},
                              "speculation": ([asdict(p) for p in policy.speculation]
                                              if policy.speculation else None),
                              "telemetry": telemetry, "telemetry_age_s": now - received}
        return out
