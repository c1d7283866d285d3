"""OpenTelemetry tracing across the services, off by default; and the request id every log line can carry.

    config = TracingConfig.from_args(args, service="llm")   # --otlp-traces-endpoint (modalmesh.flags); ConfigError when
    start(config)                                          # set and the [tracing] extra is missing
    with span("llm.generate", parent=extract(metadata)):   # no-ops while tracing is off
        ...
    metadata = inject([("x-request-id", rid)])             # + traceparent of the current span

Nothing here imports opentelemetry until `start` is given an endpoint (or a test's exporter): a
service without the ``tracing`` extra starts and serves as before. The tracer provider is process
wide, set once at start-up, as OpenTelemetry expects; everything else (which endpoint, which service)
flows down from the frozen `TracingConfig`.

W3C trace context (``traceparent`` / ``tracestate``) travels in gRPC metadata: the gateway injects
it into its Generate call, the LLM into each Encode call; the servers' interceptor
(modalmesh.rpc.interceptor) extracts it. The gateway honours an incoming HTTP ``traceparent``.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from modalmesh.errors import ConfigError

log = logging.getLogger(__name__)

EXTRA = "tracing"  # pip install 'modalmesh[tracing]'
REQUEST_ID_HEADER = "x-request-id"  # HTTP header and gRPC metadata key (gRPC keys are lower case)
MAX_REQUEST_ID = 128  # longer client ids are cut: they go into every log line of the request

# The request being served on this task (the gateway's HTTP request, the LLM's Generate): log records
# carry it (RequestIdFilter). A contextvar, so concurrent requests on one event loop each see their own.
request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("modalmesh_request_id", default=None)

_tracer = None  # opentelemetry Tracer once `start` turned tracing on; None: every call here is a no-op
_provider = None  # its TracerProvider (flushed by `stop`)


@dataclass(frozen=True)
class TracingConfig:
    otlp_endpoint: str | None = None  # --otlp-traces-endpoint, e.g. http://collector:4317; None: off
    service: str = ""  # service.name of this process's spans ("gateway", "llm", "vision_encoder", ...)

    def __post_init__(self):
        if self.otlp_endpoint is not None and not self.otlp_endpoint.startswith(("http://", "https://")):
            raise ConfigError(f"--otlp-traces-endpoint {self.otlp_endpoint!r}: give a URL, http://HOST:4317 "
                              "(plaintext) or https://HOST:4317 (TLS)")

    @property
    def enabled(self) -> bool:
        return self.otlp_endpoint is not None

    @classmethod
    def from_args(cls, args, *, service: str) -> TracingConfig:
        endpoint = getattr(args, "otlp_traces_endpoint", None) or None
        return cls(otlp_endpoint=endpoint, service=service)


def _import_sdk():
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise ConfigError(f"--otlp-traces-endpoint needs OpenTelemetry: pip install 'modalmesh[{EXTRA}]' "
                          f"({exc})") from None
    return trace, Resource, TracerProvider, BatchSpanProcessor


def start(config: TracingConfig, *, exporter=None) -> bool:
    """Turn tracing on for this process when `config` asks for it, or when a test passes its own
    `exporter` (e.g. the SDK's InMemorySpanExporter, exported synchronously). Returns whether it is on."""
    global _tracer, _provider
    if not config.enabled and exporter is None:
        return False
    trace, Resource, TracerProvider, BatchSpanProcessor = _import_sdk()
    provider = TracerProvider(resource=Resource.create({"service.name": config.service or "modalmesh"}))
    if exporter is None:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise ConfigError(f"--otlp-traces-endpoint needs the OTLP exporter: pip install 'modalmesh[{EXTRA}]' "
                              f"({exc})") from None
        endpoint = config.otlp_endpoint
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(
            endpoint=endpoint, insecure=endpoint.startswith("http://"))))
        log.info("tracing on: OTLP to %s as service %s", endpoint, config.service)
    else:
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor

        provider.add_span_processor(SimpleSpanProcessor(exporter))
    # OpenTelemetry's global provider can be set once per process; a test's provider is kept as ours.
    # Our spans come from our provider whatever the global one is (a second start in a test cannot replace it).
    trace.set_tracer_provider(provider)
    _provider, _tracer = provider, provider.get_tracer("modalmesh")
    return True


def stop() -> None:
    """Flush and turn tracing off (the process shell calls it on exit; tests between cases)."""
    global _tracer, _provider
    if _provider is None:
        return
    provider, _provider, _tracer = _provider, None, None
    with contextlib.suppress(Exception):
        provider.shutdown()  # exports what the batch processor still holds


def enabled() -> bool:
    return _tracer is not None


def extract(carrier: Iterable[tuple[str, str | bytes]] | Mapping[str, str] | None):
    """The remote parent in gRPC metadata (pairs) or HTTP headers (a mapping), or None (tracing off, none sent)."""
    if _tracer is None or carrier is None:
        return None
    from opentelemetry.propagate import extract as otel_extract

    if not isinstance(carrier, Mapping):
        carrier = {key.lower(): value for key, value in carrier if isinstance(value, str)}
    else:
        # aiohttp's headers are case-insensitive already; a plain dict is looked up in lower case
        carrier = {key.lower(): value for key, value in carrier.items()}
    return otel_extract(carrier)


def inject(metadata: list[tuple[str, str]] | None = None) -> list[tuple[str, str]]:
    """`metadata` (a new list) plus the current span's traceparent / tracestate when tracing is on."""
    out = list(metadata or ())
    if _tracer is None:
        return out
    from opentelemetry.propagate import inject as otel_inject

    carrier: dict[str, str] = {}
    otel_inject(carrier)
    out.extend(carrier.items())
    return out


@contextlib.contextmanager
def span(name: str, *, parent=None, attributes: Mapping | None = None, kind: str = "internal") -> Iterator[object]:
    """A span, current inside the block, child of `parent` (an extracted context) or of the current span.
    Yields the span (None while tracing is off): `event(span, ...)` and `set_attributes` take either."""
    if _tracer is None:
        yield None
        return
    from opentelemetry import trace

    otel_kind = {"server": trace.SpanKind.SERVER, "client": trace.SpanKind.CLIENT}.get(kind, trace.SpanKind.INTERNAL)
    with _tracer.start_as_current_span(name, context=parent, kind=otel_kind,
                                       attributes=dict(attributes or {})) as current:
        yield current


@contextlib.contextmanager
def within(parent) -> Iterator[None]:
    """Make `parent` (a context `extract`ed from another process's metadata) current inside the block: spans
    started there are its children and log records carry its trace id. The LLM's engine process continues
    each Generate call its gRPC edge took this way. A no-op while tracing is off or without a parent."""
    if _tracer is None or parent is None:
        yield
        return
    from opentelemetry import context

    token = context.attach(parent)
    try:
        yield
    finally:
        context.detach(token)


def timed_span(name: str, start_ns: int, end_ns: int, attributes: Mapping | None = None) -> None:
    """A finished child span of the current span from wall-clock marks (time.time_ns): stages whose code is
    not one block (the encoder's prepare / forward / transfer, the LLM's queue / prefill / decode)."""
    if _tracer is None:
        return
    child = _tracer.start_span(name, start_time=start_ns, attributes=dict(attributes or {}))
    child.end(end_time=max(end_ns, start_ns))


def set_attributes(current, **attributes) -> None:
    if current is not None:
        current.set_attributes({k: v for k, v in attributes.items() if v is not None})


def mark_error(current, description: str) -> None:
    """Status ERROR on `current` (None: tracing off), with a short description ("INTERNAL", "HTTP 503")."""
    if current is None:
        return
    from opentelemetry.trace import Status, StatusCode

    current.set_status(Status(StatusCode.ERROR, description[:200]))


def now_ns() -> int:
    return time.time_ns()


def outgoing_metadata() -> tuple[tuple[str, str], ...] | None:
    """The metadata of a call made for the current request: its x-request-id and, while tracing is on,
    the current span's traceparent; None when there is neither (a call outside any request)."""
    rid = request_id.get()
    pairs = inject([(REQUEST_ID_HEADER, rid)] if rid else [])
    return tuple(pairs) or None


def request_id_from(carrier: Iterable[tuple[str, str | bytes]] | Mapping[str, str] | None) -> str | None:
    """The caller's X-Request-Id (HTTP headers or gRPC metadata), printable ASCII and at most MAX_REQUEST_ID
    characters, or None: a client's id goes into log lines, so control characters are refused."""
    if carrier is None:
        return None
    if isinstance(carrier, Mapping):
        value = carrier.get(REQUEST_ID_HEADER) or carrier.get("X-Request-Id")
    else:
        value = next((v for k, v in carrier if k.lower() == REQUEST_ID_HEADER and isinstance(v, str)), None)
    if not value or not value.isascii() or not value.isprintable():
        return None
    return value.strip()[:MAX_REQUEST_ID] or None
