"""One benchmarked engine in its own long-lived process, driven over a pipe with JSON lines.

The parent starts a worker module (`python -m benchmarks.<module> ...`) with an environment of its own
choosing, sends `{"cmd": name, "args": {...}}` lines and reads `{"result": ...}` or `{"error": ...}` back.
A worker loads its model once and then answers commands until `quit` or end of input. Each worker module
imports only its own engine: the parent imports neither, so no engine's thread pools or environment leak
into another's. Between its commands a worker is stopped (SIGSTOP): threads that spin while waiting
(OMP_WAIT_POLICY=ACTIVE, an OpenMP runtime's default spin) cannot take cores from the engine being timed,
as on cores dedicated to one engine.
"""

import atexit
import json
import os
import re
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable


def peak_rss_bytes() -> int:
    """This process's peak resident memory since it started (VmHWM; ru_maxrss would count the parent's, which
    a forked child inherits)."""
    with open("/proc/self/status") as status:
        return int(re.search(r"VmHWM:\s+(\d+) kB", status.read())[1]) * 1024


def serve(handlers: dict[str, Callable]) -> None:
    """The worker's loop. Protocol replies go to the original stdout; anything the engine prints (C
    libraries included) goes to stderr, so it cannot corrupt a reply."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    replies.write(json.dumps({"result": "ready"}) + "\n")
    handlers = handlers | {"peak_rss": peak_rss_bytes}
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["cmd"] == "quit":
            break
        try:
            reply = {"result": handlers[msg["cmd"]](**msg.get("args", {}))}
        except Exception:  # noqa: BLE001  (any failure goes back to the parent, which raises it)
            reply = {"error": traceback.format_exc()}
        replies.write(json.dumps(reply) + "\n")


class EngineProcess:
    """The parent's handle on one worker process."""

    def __init__(self, name: str, module: str, args: list[str], env: dict[str, str], cwd: str | None = None):
        """cwd: the source tree whose module runs (default: this one)."""
        self.name = name
        self.proc = subprocess.Popen([sys.executable, "-m", module, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, text=True, bufsize=1,
                                     cwd=cwd or os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        atexit.register(self.kill)  # a stopped worker would outlive a parent that failed
        self._read()  # "ready": the model is loaded
        self.proc.send_signal(signal.SIGSTOP)

    def _read(self):
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name}: the worker exited (code {self.proc.wait()}); "
                               "see its stderr above")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{self.name}: {reply['error']}")
        return reply["result"]

    def call(self, cmd: str, **args):
        self.proc.send_signal(signal.SIGCONT)
        self.proc.stdin.write(json.dumps({"cmd": cmd, "args": args}) + "\n")
        try:
            return self._read()
        finally:
            self.proc.send_signal(signal.SIGSTOP)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
