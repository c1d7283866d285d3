"""Start the gateway as a child process (tests, local stacks): `modalmesh.ops.launcher.GatewayProcess`, here too
so tests and tools that start a gateway keep one import."""

from __future__ import annotations

from modalmesh.ops.launcher import GatewayProcess

__all__ = ["GatewayProcess"]
