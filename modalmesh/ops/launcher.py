"""Start a service as a child process and follow it to SERVING and back.

Used by `modalmesh up` (the stack on local processes) and by the tests. The child's half
(die with the launcher) is `modalmesh.process`, which the runtime uses. A child
logs one line ``listening grpc=HOST:PORT metrics=HOST:PORT`` once bound; the
launcher reads the ports from it, so ``--port 0`` works.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from modalmesh.process import PARENT_PID_ENV

# grpc= for the gRPC services, http= for the gateway.
_LISTENING = re.compile(
    r"listening (?:grpc|http)=(?P<ghost>[^\s:]+|\[[^\]]+\]):(?P<gport>\d+) metrics=\S+:(?P<mport>-?\d+)")


class ServiceProcess:
    def __init__(self, service: str, args: Sequence[str] = (), *, env: dict[str, str] | None = None,
                 echo: bool = False, python: str = sys.executable, module: str | None = None):
        self.service = service
        self.argv = [python, "-m", module or f"services.{service}", *args]
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", PARENT_PID_ENV: str(os.getpid()), **(env or {})}
        self.echo = echo
        self.proc: subprocess.Popen | None = None
        self.grpc_port: int | None = None
        self.metrics_port: int | None = None
        self.lines: deque[str] = deque(maxlen=500)
        self._events: queue.Queue[str | None] = queue.Queue()
        self._sigterm_sent = False

    # -- life cycle ---------------------------------------------------------
    def start(self) -> ServiceProcess:
        self.proc = subprocess.Popen(
            self.argv, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            start_new_session=True,  # Ctrl-C in a terminal reaches the launcher only; it drains children itself
        )
        threading.Thread(target=self._pump, name=f"{self.service}-log", daemon=True).start()
        return self

    def pids(self) -> list[int]:
        """The service's processes: the one started and its descendants (the LLM's engine process and ranks)."""
        if self.proc is None:
            return []
        return [self.proc.pid, *_descendants(self.proc.pid)]

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for line in self.proc.stderr:
            line = line.rstrip("\n")
            self.lines.append(line)
            if self.echo:
                print(line, file=sys.stderr, flush=True)
            self._events.put(line)
        self._events.put(None)

    def wait_listening(self, timeout: float = 60.0) -> tuple[int, int]:
        deadline = time.monotonic() + timeout
        while self.grpc_port is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self.service} did not start listening within {timeout}s:\n{self.log_tail()}")
            try:
                line = self._events.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                code = self.proc.wait() if self.proc else None
                raise RuntimeError(f"{self.service} exited with {code} before listening:\n{self.log_tail()}")
            match = _LISTENING.search(line)
            if match:
                self.grpc_port, self.metrics_port = int(match["gport"]), int(match["mport"])
        return self.grpc_port, self.metrics_port

    def wait_serving(self, timeout: float = 120.0, host: str = "127.0.0.1") -> None:
        """Block until health says SERVING (watching the health stream, no polling)."""
        self.wait_listening(timeout)
        with grpc.insecure_channel(f"{host}:{self.grpc_port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            try:
                for reply in stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=timeout):
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
            except grpc.RpcError as exc:
                raise RuntimeError(f"{self.service} never became SERVING: {exc.code().name}\n{self.log_tail()}") from exc
        raise RuntimeError(f"{self.service} health stream ended before SERVING\n{self.log_tail()}")

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM (graceful drain), then SIGKILL after `timeout`; returns the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.send_sigterm()
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()

    def send_sigterm(self) -> None:
        # Once only: a second SIGTERM could land after the child restored default handlers.
        if self.proc is not None and self.proc.poll() is None and not self._sigterm_sent:
            self._sigterm_sent = True
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def error_line(self) -> str | None:
        """The one-line reason a service printed before exiting at start-up (``error: ...``), if any."""
        return next((line for line in reversed(self.lines) if line.startswith("error: ")), None)

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(list(self.lines)[-n:])

    def __enter__(self) -> ServiceProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.terminate(timeout=30)


class GatewayProcess(ServiceProcess):
    """The OpenAI gateway (`python -m services.gateway`): it logs ``listening http=HOST:PORT metrics=HOST:PORT``
    once bound; its readiness is ``GET /health`` == 200 (every backend SERVING), not gRPC health."""

    def __init__(self, args=(), **kwargs):
        super().__init__("gateway", args, module="services.gateway", **kwargs)

    @property
    def http_port(self) -> int | None:
        return self.grpc_port  # the launcher's slot for the main port; here it speaks HTTP

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def health(self, timeout: float = 5.0) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def wait_serving(self, timeout: float = 120.0, host: str = "127.0.0.1", poll: float = 0.05) -> None:
        """Poll /health (bounded by `timeout`) until it answers 200."""
        self.wait_listening(timeout)
        deadline = time.monotonic() + timeout
        status, body = 0, {}
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode}:\n{self.log_tail()}")
            status, body = self.health()
            if status == 200:
                return
            time.sleep(poll)
        raise TimeoutError(f"gateway /health still {status} {body} after {timeout}s\n{self.log_tail()}")


def _descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (Linux /proc; none elsewhere)."""
    from pathlib import Path

    found = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return found
    for task in tasks:
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in children:
            found += [int(child), *_descendants(int(child))]
    return found
