"""A loopback port for a server a benchmark or test deploys."""

import random
import socket

# Below the kernel's ephemeral range (Linux: 32768-60999), where outgoing connections (Ray's own, many) take
# their local ports, and above Ray's worker ports (10002-19999): a port bound to 0 could be taken by a
# connection before the server binds it (CI, and bench_http's second deployment, saw "Address already in use"
# that way).
FREE_PORTS = range(20000, 32768)


def free_port() -> int:
    """A TCP port free on loopback now that no outgoing connection will take."""
    for port in random.sample(FREE_PORTS, 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port on 127.0.0.1 in {FREE_PORTS}")
