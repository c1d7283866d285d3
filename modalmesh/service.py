"""What every service shares: common flags (also MODALMESH_* env), the process shell, life cycle, Info.

A service subclasses `Service`, registers the one servicer (`ForwardingServicer` in
rpc/servicer.py: each RPC forwards to a method of the service), loads its model in
`load()` (run before health turns SERVING) and describes itself in `info()`.
`run(ServiceClass)` is the whole of a service's ``__main__``. `run_process` is the
process shell under it, which the HTTP gateway shares: die-with-parent, flags
(modalmesh/flags.py), logging, metrics, signals, exit codes.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import torch

import modalmesh
from modalmesh import attention, compile_cache
from modalmesh import metrics as metrics_mod
from modalmesh import heap, pb
from modalmesh import tracing
from modalmesh.errors import ConfigError, FailedPrecondition, ModalmeshError, Unavailable
from modalmesh.flags import DTYPE_NAMES, env_name, service_parser
from modalmesh.logs import configure_logging
from modalmesh.process import die_with_parent, end_multiprocessing
from modalmesh.rpc.security import INSECURE, Security
from modalmesh.rpc.server import FOREVER_MS, BindError, MiB, GrpcServer, ServerConfig, serve_until_signal

log = logging.getLogger("modalmesh")

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # the flags' choices, declared without torch
build_parser = service_parser  # the flags of `python -m services.<service>` (modalmesh/flags.py)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible to this process")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, auto: torch.dtype | None = None) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if auto is not None:
        return auto
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def check_model_dir(path: str) -> Path:
    """A readable checkpoint directory, or a ConfigError saying what is wrong with it."""
    model = Path(path).expanduser()
    if not model.exists():
        raise ConfigError(f"--model {path}: no such directory")
    if not model.is_dir():
        raise ConfigError(f"--model {path}: not a directory")
    if not os.access(model, os.R_OK | os.X_OK):
        raise ConfigError(f"--model {path}: directory is not readable")
    configs = [model / "config.json", model / "vae" / "config.json"]
    if not any(c.is_file() for c in configs):
        raise ConfigError(f"--model {path}: no config.json (nor vae/config.json): not a checkpoint directory")
    for config in configs:
        if config.is_file() and not os.access(config, os.R_OK):
            raise ConfigError(f"--model {path}: {config.name} is not readable")
    return model


class Service:
    """Base of the four services. Subclasses set the class attributes and override hooks."""

    name: str = ""  # "llm", "vision_encoder", "audio_encoder", "vae"
    grpc_service: str = ""  # full service name, e.g. pb.LLM_SERVICE
    description: str = ""
    max_message_mb: int = 64
    modality: int = pb.MODALITY_UNSPECIFIED
    auto_dtype: torch.dtype | None = None  # dtype for --dtype auto; None: bf16 on CUDA, fp32 on CPU

    def __init__(self, args: argparse.Namespace, metrics: metrics_mod.Metrics):
        self.args = args
        self.metrics = metrics
        self.model_dir = check_model_dir(args.model) if args.model else None
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.device, self.auto_dtype)
        self.model_id = args.model_id or (self.model_dir.name if self.model_dir else "")
        # Before any model is built: a bad or unrunnable override fails start-up here.
        self.attention = attention.configure(args.attention_backend, device=self.device, metrics=metrics)
        # TLS and the shared token, for this service's server and for the services it calls.
        self.security = Security.from_args(args)
        self.weights_fingerprint = ""
        self.ready = False

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Service-specific flags."""

    def register(self, server: GrpcServer) -> None:
        raise NotImplementedError

    async def load(self) -> None:
        """Load weights and warm up; health turns SERVING when this returns."""
        if self.model_dir is not None:
            from modalmesh.weights.fingerprint import checkpoint_fingerprint

            self.weights_fingerprint = await asyncio.to_thread(checkpoint_fingerprint, self.model_dir)

    async def close(self) -> None:
        """Release resources after the drain."""

    def not_ready(self, what: str) -> ModalmeshError:
        """The error for a call that finds no model loaded: UNAVAILABLE while the configured model is still
        loading (the server listens before it is SERVING, and a client or load balancer may try another
        replica or retry), FAILED_PRECONDITION when no model was configured at all."""
        if self.model_dir is not None:
            return Unavailable(f"{self.name} is still loading its model; retry, or wait for SERVING")
        return FailedPrecondition(f"{what} serves no model: start it with --model DIR")

    def info(self) -> pb.ServiceInfo:
        return pb.ServiceInfo(
            service=self.name,
            version=modalmesh.__version__,
            model_id=self.model_id,
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            modality=self.modality,
            weights_fingerprint=self.weights_fingerprint,
            ready=self.ready,
            attention=attention.attention_choices(self.attention),
        )

    async def _startup(self) -> None:
        await self.load()
        if getattr(self.args, "gc_freeze", True):
            heap.freeze_startup_heap()  # before the first request: serving's collections skip the model's objects
        self.ready = True
        self.metrics.set_service_info(
            model_id=self.model_id,
            version=modalmesh.__version__,
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
        )


def run_process(name: str, parser: argparse.ArgumentParser,
                setup: Callable[[argparse.Namespace, metrics_mod.Metrics], Callable[[asyncio.Event], Awaitable[int]]],
                argv: Sequence[str] | None = None) -> int:
    """The process shell every modalmesh server runs in (the four services and the gateway); returns the exit code.

    Dies with its launcher, parses the flags (MODALMESH_* too), sets up logging and the metrics
    registry, then calls ``setup(args, metrics)``: it checks the configuration (a ConfigError is
    exit 2 with one line, before anything binds) and returns ``serve(stop)``, which serves until
    `stop` is set by SIGTERM / SIGINT, drains, and returns the exit code. A late second signal
    after the drain is ignored, so a clean exit stays 0.
    """
    die_with_parent()
    args = parser.parse_args(argv)
    configure_logging(name, level=args.log_level, fmt=getattr(args, "log_format", "text"))
    try:
        # The flags' value flows down into the registry (buckets are fixed when a histogram is made).
        options = metrics_mod.MetricsOptions.from_flags(args.metrics_buckets)
        metrics = metrics_mod.install(metrics_mod.Metrics(name, options=options))
        heap.observe_pauses(metrics.gc_pause_seconds)
        # Before the service is built: --otlp-traces-endpoint without the [tracing] extra is exit 2 here.
        tracing.start(tracing.TracingConfig.from_args(args, service=name))
        serve = setup(args, metrics)
    except ConfigError as exc:
        log.error("%s", exc)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        code = asyncio.run(_until_signal(serve))
    except PortInUse as exc:  # one line naming the port and its flag, not a traceback
        log.error("%s", exc)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        tracing.stop()  # the spans the batch processor still holds go out before exit
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    end_multiprocessing()  # nothing of ours (the resource tracker) outlives the exit code
    return code


async def _until_signal(serve: Callable[[asyncio.Event], Awaitable[int]]) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return await serve(stop)


def run(service_cls: type[Service], argv: Sequence[str] | None = None) -> int:
    """A service's whole ``__main__``: its flags, then `run_process` serving it over gRPC."""
    parser = build_parser(service_cls.name, service_cls.description, max_message_mb=service_cls.max_message_mb)
    service_cls.add_arguments(parser)

    def setup(args: argparse.Namespace, metrics: metrics_mod.Metrics) -> Callable[[asyncio.Event], Awaitable[int]]:
        compile_cache.configure(args.compile_cache)  # before anything compiles; children inherit it
        service = service_cls(args, metrics)
        config = server_config(args, service.security)
        return lambda stop: _serve(service, config, args, metrics, stop)

    return run_process(service_cls.name, parser, setup, argv)


def server_config(args: argparse.Namespace, security: Security = INSECURE) -> ServerConfig:
    """The gRPC server's settings from the common flags."""
    if args.max_connection_age < 0 or (args.max_connection_age_grace is not None and args.max_connection_age_grace < 0):
        raise ConfigError("--max-connection-age and --max-connection-age-grace must be >= 0")
    grace = args.max_connection_age_grace
    return ServerConfig(
        host=args.host,
        port=args.port,
        max_message_bytes=args.max_message_mb * MiB,
        grace_seconds=args.grace_period,
        max_connection_age_ms=int(args.max_connection_age * 1000),
        max_connection_age_grace_ms=FOREVER_MS if grace is None else min(FOREVER_MS, int(grace * 1000)),
        reflection=getattr(args, "reflection", True),
        security=security,
    )


async def _serve(service: Service, config: ServerConfig, args: argparse.Namespace,
                 metrics: metrics_mod.Metrics, stop: asyncio.Event) -> int:
    server = GrpcServer(config, metrics)
    service.register(server)
    metrics_port = start_metrics_exporter(metrics, args.host, args.metrics_port)

    def listening(port: int) -> None:
        # One machine-readable line: the stack launcher and tests read the bound ports here.
        log.info("listening grpc=%s:%d metrics=%s:%d", args.host, port, args.host, metrics_port)

    try:
        return await serve_until_signal(server, service._startup, service.close, on_listening=listening,
                                        stop_event=stop)
    except BindError as exc:
        raise PortInUse("gRPC", exc.address, "--port", exc.reason) from None
    finally:
        metrics.stop_exporter()


def start_metrics_exporter(metrics: metrics_mod.Metrics, host: str, port: int) -> int:
    """The /metrics port bound (-1: none asked for); PortInUse naming --metrics-port when it cannot be
    bound. Every process of the shell (the gRPC services and the HTTP gateway) starts its exporter here."""
    if port < 0:
        return -1
    try:
        return metrics.start_exporter(host, port)
    except OSError as exc:
        raise PortInUse("metrics", f"{host}:{port}", "--metrics-port", exc.strerror) from None


class PortInUse(ConfigError):
    """A port the service was told to bind cannot be bound: says which (gRPC, HTTP or metrics) and its flag."""

    def __init__(self, what: str, address: str, flag: str, reason: str | None):
        super().__init__(f"cannot bind the {what} port {address} ({reason or 'in use, or not an address here'}): "
                         f"change {flag} ({env_name(flag[2:].replace('-', '_'))}), 0 picks a free port")

