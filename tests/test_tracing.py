"""modalmesh.tracing and modalmesh.logs without a stack: off by default and importing nothing, a clear error
when asked for without the extra, W3C context and the request id through the server interceptor, JSON logs.

The whole request path's trace (gateway -> LLM -> vision encoder, as processes) is tests/test_tracing_stack.py.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import subprocess
import sys
import textwrap

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from modalmesh import tracing
from modalmesh.errors import ConfigError
from modalmesh.logs import configure_logging
from modalmesh.rpc.interceptor import StatusInterceptor

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"

# Run in a child python in which `import opentelemetry` fails, as in an install without the [tracing] extra.
BLOCK_OPENTELEMETRY = textwrap.dedent("""
    import sys

    class _NoOpenTelemetry:
        def find_spec(self, name, path=None, target=None):
            if name == "opentelemetry" or name.startswith("opentelemetry."):
                raise ImportError(f"No module named {name!r} (blocked by the test)")

    sys.meta_path.insert(0, _NoOpenTelemetry())
""")


@pytest.fixture
def exporter():
    spans = InMemorySpanExporter()
    assert tracing.start(tracing.TracingConfig(service="test"), exporter=spans)
    yield spans
    tracing.stop()


def _without_opentelemetry(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_OPENTELEMETRY + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=120)


def test_tracing_is_off_by_default_and_nothing_imports_opentelemetry():
    done = _without_opentelemetry("""
        import sys
        from modalmesh import tracing
        import modalmesh.service, modalmesh.logs, modalmesh.rpc.interceptor, services.gateway.server
        import services.llm.server, services.encoder.service
        from services.gateway.config import build_parser
        args = build_parser().parse_args(["--llm", "127.0.0.1:1"])
        assert args.otlp_traces_endpoint is None and args.log_format == "text"
        assert not tracing.start(tracing.TracingConfig.from_args(args, service="gateway"))
        with tracing.span("x") as current:
            assert current is None
        tracing.timed_span("y", 0, 1)
        assert tracing.outgoing_metadata() is None and tracing.extract({"traceparent": "00-..."}) is None
        assert not [m for m in sys.modules if m.startswith("opentelemetry")], "opentelemetry was imported"
        print("ok")
    """)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_the_endpoint_without_the_extra_is_a_config_error_naming_it():
    done = _without_opentelemetry("""
        from modalmesh import tracing
        from modalmesh.errors import ConfigError
        try:
            tracing.start(tracing.TracingConfig(otlp_endpoint="http://127.0.0.1:4317", service="llm"))
        except ConfigError as exc:
            print(exc)
    """)
    assert done.returncode == 0, done.stderr
    assert "--otlp-traces-endpoint" in done.stdout and "modalmesh[tracing]" in done.stdout


def test_a_service_started_with_the_endpoint_but_without_the_extra_exits_2_naming_it(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(BLOCK_OPENTELEMETRY)
    done = subprocess.run(
        [sys.executable, "-m", "services.gateway", "--llm", "127.0.0.1:1", "--port", "0", "--metrics-port", "-1",
         "--otlp-traces-endpoint", "http://127.0.0.1:4317"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.getcwd()}"})
    assert done.returncode == 2, done.stderr
    assert "error: --otlp-traces-endpoint needs OpenTelemetry: pip install 'modalmesh[tracing]'" in done.stderr


@pytest.mark.parametrize("endpoint", ["127.0.0.1:4317", "grpc://collector:4317", "collector"])
def test_an_endpoint_that_is_not_a_url_is_a_config_error(endpoint):
    with pytest.raises(ConfigError, match="--otlp-traces-endpoint .*give a URL"):
        tracing.TracingConfig(otlp_endpoint=endpoint)


class _Details:
    def __init__(self, method):
        self.method = method


class _Context:
    """What the interceptor uses of a grpc.aio ServicerContext."""

    def __init__(self, metadata):
        self.metadata = metadata

    def invocation_metadata(self):
        return self.metadata

    def add_done_callback(self, callback):
        self.done = callback

    def code(self):
        return grpc.StatusCode.OK


def _call_through_interceptor(metadata, behavior):
    interceptor = StatusInterceptor()

    async def body():
        async def continuation(details):
            return grpc.unary_unary_rpc_method_handler(behavior)

        handler = await interceptor.intercept_service(continuation, _Details("/modalmesh.v1.LLMService/Info"))
        return await handler.unary_unary(b"", _Context(metadata))

    return asyncio.run(body())


def test_the_interceptor_makes_a_server_span_child_of_the_callers_traceparent_and_sets_its_request_id(exporter):
    seen = {}

    async def behavior(request, context):
        seen["request_id"] = tracing.request_id.get()
        seen["metadata"] = tracing.outgoing_metadata()  # what a call made from here would send on
        return b"answer"

    assert _call_through_interceptor((("traceparent", TRACEPARENT), ("x-request-id", "client-7")), behavior) == b"answer"
    (server,) = exporter.get_finished_spans()
    assert server.name == "modalmesh.v1.LLMService/Info" and server.kind.name == "SERVER"
    assert format(server.context.trace_id, "032x") == TRACE_ID
    assert server.parent is not None and format(server.parent.span_id, "016x") == PARENT_SPAN_ID
    assert server.attributes["rpc.grpc.status_code"] == "OK"
    assert seen["request_id"] == "client-7"
    sent = dict(seen["metadata"])
    assert sent["x-request-id"] == "client-7"
    # The call onward carries the server span as its parent, in the same trace.
    assert sent["traceparent"] == f"00-{TRACE_ID}-{format(server.context.span_id, '016x')}-01"
    assert tracing.request_id.get() is None  # reset when the call ended


def test_without_a_traceparent_the_server_span_starts_a_trace_and_an_error_marks_it(exporter):
    async def behavior(request, context):
        raise RuntimeError("boom")

    class _Aborted(Exception):
        pass

    async def abort(code, details):
        raise _Aborted(details)

    interceptor = StatusInterceptor()

    async def body():
        async def continuation(details):
            return grpc.unary_unary_rpc_method_handler(behavior)

        handler = await interceptor.intercept_service(continuation, _Details("/modalmesh.v1.LLMService/Info"))
        context = _Context(())
        context.abort = abort
        with pytest.raises(_Aborted):
            await handler.unary_unary(b"", context)

    asyncio.run(body())
    (server,) = exporter.get_finished_spans()
    assert server.parent is None and server.status.status_code.name == "ERROR" and server.status.description == "INTERNAL"
    assert server.attributes["rpc.grpc.status_code"] == "INTERNAL"


@pytest.mark.parametrize("value, want", [("abc-123", "abc-123"), ("x" * 500, "x" * 128), ("bad\nid", None),
                                         ("é", None), ("", None)])
def test_a_clients_request_id_is_kept_only_printable_ascii_and_cut_to_128(value, want):
    assert tracing.request_id_from({"x-request-id": value}) == want
    assert tracing.request_id_from((("x-request-id", value),)) == want


def test_json_logs_are_one_object_a_line_with_the_request_id_where_known():
    stream = io.StringIO()
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging("llm", level="INFO", fmt="json", stream=stream)
        logging.getLogger("modalmesh.llm").info("outside any request")
        token = tracing.request_id.set("rid-42")
        try:
            logging.getLogger("modalmesh.llm").warning("inside %s", "one")
        finally:
            tracing.request_id.reset(token)
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["message"] == "outside any request" and "request_id" not in first
    assert (first["service"], first["logger"], first["level"]) == ("llm", "modalmesh.llm", "INFO")
    assert first["time"].endswith("Z")
    assert second["message"] == "inside one" and second["request_id"] == "rid-42" and second["level"] == "WARNING"


def test_text_logs_tag_the_request_id():
    stream = io.StringIO()
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging("gateway", fmt="text", stream=stream)
        token = tracing.request_id.set("rid-9")
        logging.getLogger("modalmesh.gateway").info("hello")
        tracing.request_id.reset(token)
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    assert stream.getvalue().rstrip().endswith("gateway modalmesh.gateway: hello [rid=rid-9]")


def test_log_format_is_a_flag_of_every_service_and_refuses_other_values():
    from modalmesh.flags import service_parser
    from services.gateway.config import build_parser

    for parser in (service_parser("llm", "d"), build_parser()):
        args = parser.parse_args(["--log-format", "json", "--otlp-traces-endpoint", "http://c:4317"])
        assert (args.log_format, args.otlp_traces_endpoint) == ("json", "http://c:4317")
        with pytest.raises(SystemExit):
            parser.parse_args(["--log-format", "xml"])
