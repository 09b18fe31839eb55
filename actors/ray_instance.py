"""The Ray instance a deployment runs on: finding a live one without hanging, starting a local one bound to
loopback, and stopping one a detached deployment started itself.

ray.init on an address whose GCS is gone retries for a long time (a stale /tmp/ray/ray_current_cluster after
an unclean stop made `serve` and `ray.init("auto")` hang), so an address is first probed with a TCP connect to
its GCS port, answered or refused within PROBE_TIMEOUT_S.
"""

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import ray
from ray._common.utils import get_ray_address_file
from ray.experimental import internal_kv

from cluster_configs.errors import NumaserveError

NAMESPACE = "numaserve"
LOOPBACK = "127.0.0.1"
PROBE_TIMEOUT_S = 2.0
STOP_TIMEOUT_S = 10.0
log = logging.getLogger("numaserve")


class RayAddressError(NumaserveError):
    """A Ray address that was asked for explicitly and does not answer."""


def answers(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether something accepts TCP connections at address's host:port (a Ray GCS when it is one)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]") or LOOPBACK, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def find_address(address: str | None) -> str | None:
    """The address of the live Ray cluster to join, or None: start a local instance. address (--address)
    or else RAY_ADDRESS must answer (RayAddressError naming the fix if not); without either, the cluster
    `ray start` last recorded is joined if it answers ("auto": ray.init then takes the cluster's token from
    ~/.ray/auth_token, as it does for a cluster it finds itself but not for one named), and a stale record
    is removed."""
    source, explicit = ("--address", address) if address not in (None, "auto") else (
        "RAY_ADDRESS", os.environ.get("RAY_ADDRESS") or None)
    if explicit == "local":
        return None
    if explicit is not None:
        if explicit.startswith("ray://") or answers(explicit):
            return explicit
        raise RayAddressError(f"no Ray cluster answers at {explicit} ({source}) within "
                              f"{PROBE_TIMEOUT_S:.0f} s; start it there (`ray start --head`), "
                              f"give {source} a live cluster's address, "
                              f"or leave {source} unset to start a local instance")
    record = get_ray_address_file(None)
    recorded = Path(record).read_text().strip() if Path(record).is_file() else ""
    if not recorded:
        return None
    if answers(recorded):
        return "auto"
    log.warning("numaserve: %s names %s, where no Ray cluster answers (left by an unclean stop); removed it, "
                "starting a local instance", record, recorded)
    Path(record).unlink(missing_ok=True)
    return None


def join(address: str) -> None:
    ray.init(address=address, namespace=NAMESPACE)


def start_local(resources: dict, persistent: bool) -> None:
    """A single-machine Ray instance declaring `resources`, its node address and dashboard on loopback: in
    this process (its processes end with it), or, when persistent, with `ray start --head` (they outlive
    it; stop_session stops them)."""
    if persistent:
        ray_cli = Path(sys.executable).with_name("ray")
        # the dashboard and its job server stay on for `ray job submit`: whoever reaches them can run code on
        # the cluster (README, "What binds where"); --port=0: a free GCS port, not 6379 beside another cluster
        subprocess.run([str(ray_cli), "start", "--head", f"--resources={json.dumps(resources)}",
                        f"--node-ip-address={LOOPBACK}", f"--dashboard-host={LOOPBACK}", "--port=0"],
                       check=True, stdout=subprocess.DEVNULL)
        join("auto")  # the cluster it recorded
    else:
        ray.init(namespace=NAMESPACE, resources=resources, _node_ip_address=LOOPBACK, include_dashboard=False)


# ---- a detached deployment's own Ray instance -----------------------------------------------------------

def _key(name: str) -> bytes:
    return f"{name}.started_ray".encode()


def current_session() -> str:
    """The session name of the Ray instance this process is connected to."""
    return ray._private.worker.global_worker.node.session_name


def record_started(name: str) -> None:
    """Notes in the cluster that deployment `name` started this Ray instance (`ray start`), by its session."""
    internal_kv._internal_kv_put(_key(name), current_session().encode(), namespace=NAMESPACE.encode())


def started_session(name: str) -> str | None:
    """The session of the Ray instance deployment `name` started, None if it joined one."""
    value = internal_kv._internal_kv_get(_key(name), namespace=NAMESPACE.encode())
    return value.decode() if value else None


def stop_session(session: str) -> int:
    """Disconnects, then terminates this machine's Ray processes of `session` (the GCS, raylet and agents
    name its session directory on their command lines; the actors' workers, renamed `ray::<class>`, are the
    raylet's children), the GCS last, as `ray stop` does (terminated beside the rest it outlived
    STOP_TIMEOUT_S and was killed; alone it exits), killing those left after STOP_TIMEOUT_S; -> how many there
    were. Other Ray instances on the machine are left alone (`ray stop` would end them all)."""
    address = ray._private.worker.global_worker.node.gcs_address
    ray.shutdown()
    roots = [p for p in psutil.process_iter(["cmdline"])
             if p.pid != os.getpid() and any(session in part for part in p.info["cmdline"] or ())]
    processes = list({p.pid: p for root in roots for p in _with_children(root)}.values())
    gcs = [p for p in processes if _name(p) == "gcs_server"]
    _terminate([p for p in processes if p not in gcs])
    _terminate(gcs)
    record = Path(get_ray_address_file(None))
    if record.is_file() and record.read_text().strip() == address:
        record.unlink()
    return len(processes)


def _terminate(processes: list[psutil.Process]) -> None:
    """SIGTERM, then SIGKILL to those alive after STOP_TIMEOUT_S; returns once they are gone."""
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
    _, alive = psutil.wait_procs(processes, timeout=STOP_TIMEOUT_S)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(alive, timeout=STOP_TIMEOUT_S)


def _name(process: psutil.Process) -> str | None:
    try:
        return process.name()
    except psutil.NoSuchProcess:
        return None


def _with_children(process: psutil.Process) -> list[psutil.Process]:
    try:
        return [process, *process.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
