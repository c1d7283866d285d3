"""How every modalmesh process logs: `--log-format text` (the default) or `json`, one object per line.

    configure_logging("llm", level="INFO", fmt="json")

Records carry the request id of the request being served (modalmesh.tracing.request_id: the gateway's
X-Request-Id, passed to the LLM in gRPC metadata) as ``request_id`` in JSON and ``[rid=...]`` in text,
and, while tracing is on, the current span's ``trace_id`` (JSON), so a log line leads to its trace.
"""

from __future__ import annotations

import json
import logging
import sys
import time

from modalmesh import tracing

TEXT_FORMAT = "%(asctime)s %(levelname)s {service} %(name)s: %(message)s%(request_tag)s"


class RequestContextFilter(logging.Filter):
    """Adds `request_id` (None outside a request), `request_tag` (text's " [rid=...]") and `trace_id`."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = tracing.request_id.get()
        record.request_id = rid
        record.request_tag = f" [rid={rid}]" if rid else ""
        record.trace_id = _current_trace_id()
        return True


def _current_trace_id() -> str | None:
    if not tracing.enabled():
        return None
    from opentelemetry import trace

    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in ("request_id", "trace_id"):
            value = getattr(record, key, None)
            if value:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(service: str, *, level: str = "INFO", fmt: str = "text", stream=None) -> logging.Handler:
    """One handler on the root logger for this process (stderr unless `stream`); returns it."""
    handler = logging.StreamHandler(stream or sys.stderr)
    if fmt == "json":
        formatter = JsonFormatter(service)
        formatter.converter = time.gmtime  # the "Z" it writes: UTC
        handler.setFormatter(formatter)
    elif fmt == "text":
        handler.setFormatter(logging.Formatter(TEXT_FORMAT.format(service=service)))
    else:
        from modalmesh.errors import ConfigError

        raise ConfigError(f"--log-format {fmt!r}: choose text or json")
    handler.addFilter(RequestContextFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]  # as logging.basicConfig, once per process
    root.setLevel(level)
    return handler
