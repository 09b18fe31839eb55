"""Scheduler: collects workers' StepTelemetry and answers each with its batching Policy (scheduling/policy.py).

Workers call `report` about every 100 ms and apply the answer whenever it arrives; the router polls
`policies` for the admission bounds. Nothing here blocks a request.
"""

import time

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
        now = time.time()
        return {worker_id: {"policy": vars(self.policy.policy(worker_id)), "telemetry": vars(t),
                            "telemetry_age_s": now - received}
                for worker_id, (t, received) in self.telemetry.items()}
