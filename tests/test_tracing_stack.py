"""One request's trace across the services it touched: gateway -> LLM Generate -> vision encoder Encode.

The services run as processes (as tests/test_gateway.py starts them, tiny Qwen2-VL), so an in-memory
exporter cannot see their spans: they export by OTLP/gRPC to a small collector in this test process
(opentelemetry-proto's TraceService), which keeps what it receives. The test sends an HTTP traceparent
and an X-Request-Id; the trace must continue the client's, and the LLM's JSON log must carry the id.
"""

from __future__ import annotations

import base64
import io
import json
import threading
import urllib.error
import urllib.request
from concurrent import futures

import grpc
import numpy as np
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from PIL import Image

from modalmesh.ops.launcher import ServiceProcess
from modalmesh.testing import tiny
from services.gateway.launch import GatewayProcess

COMMON = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--device", "cpu"]
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN_ID = "b7ad6b7169203331"
# Spans leave the services' batch processors every 100 ms (and on exit), not every 5 s.
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100"}


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace collector that keeps every span it is sent, with its resource's service.name."""

    def __init__(self):
        self.spans: list[tuple[str, object]] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                service = next((a.value.string_value for a in resource_spans.resource.attributes
                                if a.key == "service.name"), "")
                for scope in resource_spans.scope_spans:
                    self.spans.extend((service, span) for span in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def collector():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    keeper = Collector()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(keeper, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield keeper, f"http://127.0.0.1:{port}"
    server.stop(None)


def _png(h, w, seed):
    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def test_one_requests_trace_spans_gateway_llm_and_vision_encoder_correctly_parented(tmp_path, collector):
    keeper, endpoint = collector
    vl = tiny.ensure("qwen2_vl", tmp_path)
    traced = ["--otlp-traces-endpoint", endpoint]
    vision = ServiceProcess("vision_encoder", [*COMMON, *traced, "--model", str(vl)], env=FAST_EXPORT).start()
    procs = [vision]
    try:
        vision.wait_listening()
        llm = ServiceProcess("llm", [*COMMON, *traced, "--model", str(vl), "--kv-cache-tokens", "4096",
                                     "--vision-encoder", f"ipv4:{vision.target}", "--log-format", "json",
                                     "--log-level", "DEBUG"], env=FAST_EXPORT).start()
        procs.append(llm)
        llm.wait_listening()
        gw = GatewayProcess(["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--grace-period", "10",
                             *traced, "--llm", llm.target, "--log-format", "json", "--log-level", "DEBUG"],
                            env=FAST_EXPORT).start()
        procs.append(gw)
        for p in procs:
            p.wait_serving(timeout=180)
        image = "data:image/png;base64," + base64.b64encode(_png(56, 56, 5)).decode()
        body = {"model": "qwen2_vl", "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                                          {"type": "text", "text": "What is it?"}]}]}
        request = urllib.request.Request(
            f"{gw.base_url}/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
            headers={"Content-Type": "application/json", "traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01",
                     "X-Request-Id": "trace-test-1"})
        with urllib.request.urlopen(request, timeout=120) as response:
            assert response.status == 200
            assert response.headers["X-Request-Id"] == "trace-test-1"  # the client's, echoed
            json.load(response)
        # A request without an id gets one of the gateway's, in its response.
        with urllib.request.urlopen(f"{gw.base_url}/v1/models", timeout=30) as response:
            assert len(response.headers["X-Request-Id"]) == 32
        with pytest.raises(urllib.error.HTTPError) as refused:  # errors echo it too
            urllib.request.urlopen(urllib.request.Request(f"{gw.base_url}/v1/nowhere",
                                                          headers={"X-Request-Id": "lost-1"}), timeout=30)
        assert refused.value.code == 404 and refused.value.headers["X-Request-Id"] == "lost-1"
    finally:
        for p in reversed(procs):
            p.send_sigterm()
        codes = [p.terminate(timeout=60) for p in reversed(procs)]  # exit flushes what is still batched
    assert codes == [0, 0, 0], [p.log_tail() for p in procs]
    # A span's context is attached and detached in the same task (streams included): OpenTelemetry logs
    # "Failed to detach context" otherwise; and the exporter reached the collector.
    assert not [line for p in procs for line in p.lines if "detach" in line or "Failed to export" in line]

    ours = [(service, span) for service, span in keeper.spans if span.trace_id.hex() == TRACE_ID]
    by_id = {span.span_id.hex(): (service, span) for service, span in ours}
    names = {(service, span.name) for service, span in ours}

    def one(service, name):
        found = [span for s, span in ours if (s, span.name) == (service, name)]
        assert len(found) == 1, (service, name, sorted(names))
        return found[0]

    def parent_of(span):
        return by_id[span.parent_span_id.hex()][1]

    gateway = one("gateway", "POST /v1/chat/completions")
    generate = one("llm", "modalmesh.v1.LLMService/Generate")
    encode_items = one("llm", "llm.encode_items")
    encode = one("vision_encoder", "modalmesh.v1.EncoderService/Encode")
    assert gateway.parent_span_id.hex() == CLIENT_SPAN_ID  # the incoming traceparent was honoured
    assert parent_of(generate) is gateway and parent_of(encode_items) is generate and parent_of(encode) is encode_items
    stages = [one("llm", stage) for stage in ("llm.queue", "llm.prefill", "llm.decode")]
    for stage in stages:
        assert parent_of(stage) is generate
    # One after another: queued until the engine's first step with the request, prefill to its first token.
    for before, after in zip(stages, stages[1:]):
        assert before.start_time_unix_nano <= before.end_time_unix_nano == after.start_time_unix_nano
    assert generate.start_time_unix_nano <= stages[0].start_time_unix_nano
    for stage in ("encoder.prepare", "encoder.forward", "encoder.transfer"):
        assert parent_of(one("vision_encoder", stage)) is encode
    assert {service for service, _ in ours} == {"gateway", "llm", "vision_encoder"}
    # Every span of the request is in the one trace; nothing of it was exported under another trace id.
    assert all(span.parent_span_id.hex() in by_id for _, span in ours if span is not gateway)

    # JSON logs, one object a line: the gateway's access line and the LLM's record of the request both carry
    # the client's request id (the LLM got it in the Generate call's metadata), and the trace id.
    logged = {}
    for name, p in (("gateway", gw), ("llm", llm)):
        logged[name] = [json.loads(line) for line in p.lines if line.strip()]
    access = [r for r in logged["gateway"] if r["message"].startswith("POST /v1/chat/completions 200 ")]
    assert [(r["request_id"], r["trace_id"]) for r in access] == [("trace-test-1", TRACE_ID)]
    assert any(r.get("request_id") == "trace-test-1" and r.get("trace_id") == TRACE_ID
               and r["message"].startswith("generate ") for r in logged["llm"])
