"""`numaserve serve` in the foreground, as `vllm serve` runs: the actors' logs and the HTTP access log on this
process's output, and Ctrl-C / SIGTERM drain the HTTP servers (new requests 503, those in flight finish up to
the drain timeout, then are cancelled), then stop the deployment and the Ray instance if this process
started it (ray.init's own: its processes end with ray.shutdown)."""

import logging
import signal
import threading
import time
from collections.abc import Callable

import ray

from actors import deploy, deployment_actors
from actors.client import Client
from cluster_configs.cluster_config import ClusterConfig

log = logging.getLogger("numaserve")
# Ray's log monitor reads the actors' log files every 0.1 s and ships new lines through the GCS: with the
# actors killed at once after the drain, their last access lines were lost
LOG_SETTLE_S = 1.0


def serve_foreground(config: ClusterConfig, name: str, address: str | None, drain_timeout_s: float,
                     announce: Callable[[Client], None]) -> None:
    """Serves until SIGINT or SIGTERM, then drains and stops everything it started."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    started = deploy.init_ray(config, address=address)
    try:
        client = deploy.serve(config, name=name)  # stops what it started if it fails
    except BaseException:
        ray.shutdown()
        raise
    stop = threading.Event()

    def on_signal(signum: int, frame) -> None:
        stop.set()
        for s in (signal.SIGINT, signal.SIGTERM):  # a second one ends the drain
            signal.signal(s, signal.default_int_handler)

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, on_signal)
    try:
        announce(client)
        print("numaserve: serving in the foreground; Ctrl-C or SIGTERM stops it (--detach to leave it "
              "running)", flush=True)
        while not stop.wait(0.1):
            pass
        log.info("numaserve: stopping: draining the HTTP servers (up to %g s)", drain_timeout_s)
        num_cancelled = deployment_actors.drain(name, drain_timeout_s)
        log.info("numaserve: drained (%d requests cancelled at the timeout)", num_cancelled)
        time.sleep(LOG_SETTLE_S)
    except KeyboardInterrupt:
        log.info("numaserve: interrupted during the drain")
    finally:
        deployment_actors.shutdown(name)
        ray.shutdown()  # the Ray instance itself when this process started it
        log.info("numaserve: %r stopped%s", name, ", and the Ray instance it started" if started else "")
