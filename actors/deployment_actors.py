"""A running deployment's actors by name (actors/deploy.py names them): list them, drain its HTTP actors, shut
it down. Kept apart from deploy.py so that a Client can shut its deployment down without importing what
starts one."""

import logging
import re
import time

import ray

from actors.ray_instance import NAMESPACE

DRAIN_GRACE_S = 10.0  # past the drain timeout: the cancelled requests' unwinding (5 s) and the calls
log = logging.getLogger("numaserve")


def shutdown(name: str = "numaserve", timeout_s: float = 30.0) -> None:
    for actor_name in deployment_actor_names(name):
        try:
            ray.kill(ray.get_actor(actor_name, namespace=NAMESPACE))
        except ValueError:
            pass  # already gone
    deadline = time.monotonic() + timeout_s
    while deployment_actor_names(name) and time.monotonic() < deadline:
        time.sleep(0.1)  # names are released once the actors are dead


def drain(name: str, timeout_s: float) -> int:
    """Drains the deployment's HTTP actors together (http_api/lifecycle.py): new requests get 503, those
    in flight finish up to timeout_s, then are cancelled; -> how many were."""
    https = [ray.get_actor(n, namespace=NAMESPACE) for n in replica_names(name, "http")]
    refs = [h.drain.remote(timeout_s) for h in https]
    try:
        return sum(ray.get(refs, timeout=timeout_s + DRAIN_GRACE_S))
    except ray.exceptions.RayError as e:  # an HTTP actor lost meanwhile: its requests went with it
        log.warning("numaserve: draining %s: %s", name, type(e).__name__)
        return 0


def deployment_names() -> list[str]:
    """The deployments running in this cluster (a deployment's name has no ".")."""
    return sorted({a["name"].split(".")[0] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["namespace"] == NAMESPACE})


def deployment_actor_names(name: str) -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == NAMESPACE and a["name"].startswith(f"{name}.")]


def replica_name(name: str, role: str, replica: int) -> str:
    """`<name>.router`, `<name>.router.1`, ... (role "router" or "http")."""
    return f"{name}.{role}" if replica == 0 else f"{name}.{role}.{replica}"


def replica_names(name: str, role: str) -> list[str]:
    """The deployment's routers' (role "router") or HTTP actors' ("http") names, in replica order."""
    pattern = re.compile(rf"{re.escape(name)}\.{role}(?:\.(\d+))?")
    found = [(int(m.group(1) or 0), n) for n in deployment_actor_names(name) if (m := pattern.fullmatch(n))]
    return [n for _, n in sorted(found)]
