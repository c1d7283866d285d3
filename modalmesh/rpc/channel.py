"""Client channels to modalmesh services.

Targets: ``host:port`` becomes ``dns:///host:port``; explicit schemes
(``dns:///``, ``ipv4:a:p,b:p``, ``unix:``) pass through. Every channel balances
with round_robin over the resolved addresses and retries UNAVAILABLE on the
idempotent methods it is told about (e.g. Encode) on another replica. With
``health_check=True`` it also follows each replica's gRPC health and stops
sending to one that says NOT_SERVING (a draining replica) at once.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import grpc

from modalmesh import pb

MiB = 1 << 20

# Idempotent RPCs: safe to retry on another replica when it is UNAVAILABLE.
IDEMPOTENT_METHODS: tuple[tuple[str, str], ...] = (
    (pb.ENCODER_SERVICE, "Encode"),
    (pb.ENCODER_SERVICE, "Info"),
    (pb.LLM_SERVICE, "Info"),
    (pb.VAE_SERVICE, "Decode"),
    (pb.VAE_SERVICE, "Info"),
)


def normalize_target(target: str) -> str:
    target = target.strip()
    if not target:
        raise ValueError("empty gRPC target")
    if "://" in target or target.split(":", 1)[0] in {"dns", "ipv4", "ipv6", "unix", "unix-abstract", "vsock"}:
        return target
    return f"dns:///{target}"


def service_config(retry_methods: Iterable[tuple[str, str]] = IDEMPOTENT_METHODS, max_attempts: int = 5,
                   health_check: bool = False) -> str:
    """`health_check`: client-side health checking (gRPC A17; grpcio honours it under round_robin): one
    Watch of the server's health ("") per connection, and round_robin picks only replicas that answer
    SERVING. A draining replica (GrpcServer.drain: NOT_SERVING first, grpc's GOAWAY only once its calls
    have ended) then gets no new call from this channel well before its GOAWAY, so none of this channel's
    calls is cut by it or races it. Off by default, because every call on such a channel, Health.Check
    and Health.Watch included, fails UNAVAILABLE ("backend unhealthy") while no replica says SERVING:
    during a service's start-up a readiness probe through it (the gateway's health watch, `modalmesh
    health`) would see UNAVAILABLE instead of NOT_SERVING and notice readiness only on its next retry.
    For channels that only send work, never probe readiness."""
    config = {
        "loadBalancingConfig": [{"round_robin": {}}],
        "methodConfig": [
            {
                "name": [{"service": s, "method": m} for s, m in retry_methods],
                "retryPolicy": {
                    "maxAttempts": max_attempts,
                    "initialBackoff": "0.05s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ],
    }
    if health_check:
        config["healthCheckConfig"] = {"serviceName": ""}
    return json.dumps(config)


def channel_options(max_message_bytes: int, retry_methods=IDEMPOTENT_METHODS,
                    health_check: bool = False) -> list[tuple[str, object]]:
    return [
        ("grpc.service_config", service_config(retry_methods, health_check=health_check)),
        ("grpc.enable_retries", 1),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        # Retries buffer the request; allow the large tensors Encode carries.
        ("grpc.per_rpc_retry_buffer_size", max_message_bytes),
        ("grpc.retry_buffer_size", 4 * max_message_bytes),
    ]


def aio_channel(target: str, *, max_message_bytes: int = 256 * MiB, retry_methods=IDEMPOTENT_METHODS,
                security=None, health_check: bool = False) -> grpc.aio.Channel:
    """`security` (modalmesh.rpc.security.Security): TLS when it has a CA, its token sent on every call.
    `health_check`: see service_config (not for a channel that probes readiness)."""
    options = channel_options(max_message_bytes, retry_methods, health_check)
    credentials = security.channel_credentials() if security is not None else None
    interceptors = (security.client_interceptors() if security is not None else []) or None
    if credentials is not None:
        return grpc.aio.secure_channel(normalize_target(target), credentials, options=options,
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(normalize_target(target), options=options, interceptors=interceptors)


def sync_channel(target: str, *, max_message_bytes: int = 256 * MiB, retry_methods=IDEMPOTENT_METHODS,
                 security=None, health_check: bool = False) -> grpc.Channel:
    """Blocking channel (the CLI): TLS when `security` has a CA; its callers send `security.call_metadata()`.
    `health_check`: see service_config (not for a channel that probes readiness: `modalmesh health` does)."""
    options = channel_options(max_message_bytes, retry_methods, health_check)
    credentials = security.channel_credentials() if security is not None else None
    if credentials is not None:
        return grpc.secure_channel(normalize_target(target), credentials, options=options)
    return grpc.insecure_channel(normalize_target(target), options=options)
