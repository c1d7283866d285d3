"""Start the gateway as a child process (tests, local stacks), as `modalmesh.ops.launcher` does for services.

The gateway logs ``listening http=HOST:PORT metrics=HOST:PORT`` once bound; its
readiness is ``GET /health`` == 200 (every backend SERVING), not gRPC health.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from modalmesh.ops.launcher import ServiceProcess

class GatewayProcess(ServiceProcess):
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
