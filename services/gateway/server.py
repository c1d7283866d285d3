"""The OpenAI-compatible HTTP front: aiohttp in front of the LLM and VAE gRPC services.

    python -m services.gateway --llm 127.0.0.1:50053 --vae 127.0.0.1:50054 --port 8000

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``
(and ``/v1/models/{id}``), ``POST /v1/images/decode`` (our extension: latents ->
PNG through the VAE), ``GET /health``. Metrics (the shared ``modalmesh_`` schema,
``service="gateway"``) are on ``--metrics-port`` like every service's, and on the HTTP port's ``GET /metrics``.

Life cycle as the other services (the same process shell, ``modalmesh.service.run_process``):
flags also read from ``MODALMESH_*``, one ``listening http=HOST:PORT metrics=HOST:PORT`` line once bound, ``/health`` 503
until every backend reports SERVING through gRPC health, and on SIGTERM/SIGINT a
drain (``/health`` 503, no new connections, in-flight requests finish within
``--grace-period``) before exit 0.

A client that goes away cancels its handler (aiohttp ``handler_cancellation``),
which cancels the gRPC Generate call: the LLM aborts the request and frees its KV
pages.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import Callable

import grpc
from aiohttp import web

import modalmesh
from modalmesh import metrics as metrics_mod
from modalmesh import pb
from modalmesh import tracing
from modalmesh.service import PortInUse, run_process, start_metrics_exporter
from services.gateway import latents as latents_mod
from services.gateway import protocol, tools
from services.gateway.backends import Backend
from services.gateway.config import GatewayConfig, build_parser
from services.gateway.errors import APIError, bad_request, from_grpc
from services.gateway.fetch import MediaFetcher, fetch_all

log = logging.getLogger("modalmesh.gateway")

MiB = 1 << 20
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}
PARSE_IN_THREAD_BYTES = 256 * 1024  # bodies this large are decoded off the event loop
CLIENT_CLOSED = 499  # nginx's code for "client closed the request", used in metrics only
_ITEM = re.compile(r"items\[(\d+)\]")


def error_response(err: APIError, headers: dict | None = None) -> web.Response:
    return web.json_response(err.body(), status=err.status, headers=headers)


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _lone_surrogate(value, path: str, depth: int = 0) -> str | None:
    """The path ("messages[0].content") of the first string or key that cannot be UTF-8, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if depth > 64:
        return None
    if isinstance(value, dict):
        children = ((f"{path}.{key}" if path else str(key), key, child) for key, child in value.items())
    elif isinstance(value, list):
        children = ((f"{path}[{i}]", None, child) for i, child in enumerate(value))
    else:
        return None
    for here, key, child in children:
        if isinstance(key, str) and _lone_surrogate(key, here) is not None:
            return here
        found = _lone_surrogate(child, here, depth + 1)
        if found is not None:
            return found
    return None


class Gateway:
    def __init__(self, config: GatewayConfig, metrics: metrics_mod.Metrics):
        self.config = config
        self.metrics = metrics
        self.started = int(time.time())
        self.draining = False
        self._bodies = 0  # bytes reserved by request bodies in flight (_body_budget)
        self.limits = protocol.Limits(max_image_bytes=int(config.max_image_mb * MiB),
                                      max_audio_bytes=int(config.max_audio_mb * MiB),
                                      local_media_root=config.local_media_root, fetch=config.fetch,
                                      low_detail_max_pixels=config.low_detail_max_pixels,
                                      max_video_bytes=int(config.max_video_mb * MiB))
        self.fetcher = MediaFetcher(config.fetch)
        max_message = config.max_message_mb * MiB
        security = config.security
        self.llm = Backend("llm", config.llm, pb.llm_pb2_grpc.LLMServiceStub, max_message_bytes=max_message,
                           on_change=self._health_changed, security=security) if config.llm else None
        # --more-llms: each serves its own model id; a request's `model` picks one (self.llm: when it names none).
        self.more_llms = [Backend(f"llm{i}", target, pb.llm_pb2_grpc.LLMServiceStub, max_message_bytes=max_message,
                                  on_change=self._health_changed, security=security)
                          for i, target in enumerate(config.more_llms, start=1)]
        self.vae = Backend("vae", config.vae, pb.vae_pb2_grpc.VAEServiceStub, max_message_bytes=max_message,
                           on_change=self._health_changed, security=security) if config.vae else None
        self.app = web.Application(client_max_size=int(config.max_request_mb * MiB),
                                   middlewares=[self._middleware])
        r = self.app.router
        r.add_post("/v1/chat/completions", self.chat_completions)
        r.add_post("/v1/completions", self.completions)
        r.add_get("/v1/models", self.list_models)
        r.add_get("/v1/models/{model:.+}", self.get_model)
        r.add_post("/v1/images/decode", self.images_decode)
        r.add_get("/health", self.health)
        # Also on the HTTP port: where only the API port is exposed (one Service, an ingress), Prometheus
        # still scrapes it. No API key, as /health (it carries no request data).
        r.add_get("/metrics", self.metrics_page)

    @property
    def backends(self) -> list[Backend]:
        return [b for b in (self.llm, *self.more_llms, self.vae) if b is not None]

    # -- life cycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        for backend in self.backends:
            backend.start()
        self.fetcher.start()

    async def close(self) -> None:
        for backend in self.backends:
            await backend.close()
        await self.fetcher.close()

    @property
    def ready(self) -> bool:
        return not self.draining and all(b.ready for b in self.backends)

    def _health_changed(self) -> None:
        self.metrics.ready.set(1 if self.ready else 0)
        if self.llm is not None and self.llm.info is not None:
            info = self.llm.info
            self.metrics.set_service_info(model_id=self.model_id or "", version=modalmesh.__version__,
                                          dtype=info.dtype, device=info.device)

    @property
    def model_id(self) -> str | None:
        if self.config.served_model_name:
            return self.config.served_model_name
        return self.llm.info.model_id if self.llm is not None and self.llm.info is not None else None

    async def _read_body(self, request: web.Request) -> bytes:
        """The whole body, or 408 once --body-timeout has passed (a client sending a byte a minute)."""
        try:
            return await asyncio.wait_for(request.read(), self.config.body_timeout)
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive within {self.config.body_timeout:g} s "
                                "(--body-timeout)", code="request_timeout") from None

    @contextlib.contextmanager
    def _body_budget(self, request: web.Request):
        """Reserve the request body's bytes (its declared length, or the largest allowed) from one budget for
        every request in flight: eight 53 MB bodies at once took the gateway to 2.4 GB."""
        if request.method not in ("POST", "PUT", "PATCH"):
            yield
            return
        limit = int(self.config.max_request_mb * MiB)
        size = min(request.content_length, limit) if request.content_length is not None else limit
        if self._bodies + size > int(self.config.max_inflight_body_mb * MiB) and self._bodies:
            raise APIError(503, f"the gateway is reading {self._bodies / MiB:.0f} MB of other request bodies "
                                f"(--max-inflight-body-mb {self.config.max_inflight_body_mb:g}); retry shortly",
                           code="server_busy", headers={"Retry-After": "1"})
        self._bodies += size
        try:
            yield
        finally:
            self._bodies -= size

    # -- middleware: errors in OpenAI's shape, auth, metrics ----------------------------------------
    @web.middleware
    async def _middleware(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "other"
        m = self.metrics
        m.requests_in_flight.labels(rpc=route).inc()
        start = time.perf_counter()
        request["start"] = start
        status = 500
        # The client's X-Request-Id, or ours: echoed in the response, sent to the LLM, in every log record.
        rid = request["request_id"] = tracing.request_id_from(request.headers) or uuid.uuid4().hex
        rid_token = tracing.request_id.set(rid)
        # A server span, child of the client's W3C traceparent when it sent one (no-op while tracing is off).
        scope = tracing.span(f"{request.method} {route}", parent=tracing.extract(request.headers), kind="server",
                             attributes={"http.request.method": request.method, "http.route": route,
                                         "modalmesh.request_id": rid})
        current = scope.__enter__()
        try:
            if self.config.api_key and request.path.startswith("/v1/"):
                given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
                if not hmac.compare_digest(given, f"Bearer {self.config.api_key}".encode()):  # constant time
                    raise APIError(401, "invalid or missing API key (Authorization: Bearer KEY)",
                                   code="invalid_api_key")
            with self._body_budget(request):
                response = await handler(request)
            status = request.get("status_override", response.status)
            if not response.prepared:  # a stream sent its headers already, X-Request-Id among them
                response.headers["X-Request-Id"] = rid
            return response
        except APIError as err:
            status = err.status
            return error_response(err, headers={**(err.headers or {}), "X-Request-Id": rid})
        except web.HTTPException as exc:  # unknown route, wrong method, body over --max-request-mb
            status = exc.status
            message = {404: f"no route {request.method} {request.path}",
                       413: f"request body over {self.config.max_request_mb:g} MB (--max-request-mb)"}.get(
                           exc.status, exc.reason)
            return error_response(APIError(exc.status, message), headers={
                **{k: v for k, v in exc.headers.items() if k.lower() == "allow"}, "X-Request-Id": rid})
        except asyncio.CancelledError:
            status = CLIENT_CLOSED  # the client went away (or the drain ran out of time)
            raise
        except Exception:  # noqa: BLE001 - logged here, never sent to the client
            log.exception("unexpected error in %s %s", request.method, request.path)
            return error_response(APIError(500, f"internal error in {route} (details in the gateway log)"),
                                  headers={"X-Request-Id": rid})
        finally:
            tracing.set_attributes(current, **{"http.response.status_code": status})
            if status >= 500:
                tracing.mark_error(current, f"HTTP {status}")
            elapsed = time.perf_counter() - start
            # The request's one line, with its request id and trace id: DEBUG, as an access log.
            log.debug("%s %s %d %.3fs", request.method, request.path, status, elapsed)
            scope.__exit__(None, None, None)
            tracing.request_id.reset(rid_token)
            m.requests_in_flight.labels(rpc=route).dec()
            m.http_requests_total.labels(route=route, status=str(status)).inc()
            m.http_request_duration_seconds.labels(route=route, status=str(status)).observe(elapsed)
            # Deprecated for the gateway (docs/metrics.md): the same, with the HTTP status in gRPC's `code`.
            m.requests_total.labels(rpc=route, code=str(status)).inc()
            m.request_duration_seconds.labels(rpc=route, code=str(status)).observe(elapsed)

    # -- helpers --------------------------------------------------------------------------------------
    def _require(self, backend: Backend | None, flag: str) -> Backend:
        if backend is None:
            raise APIError(501, f"this gateway has no {flag[2:].upper()} service: start it with {flag} TARGET",
                           code="not_configured")
        if self.draining:
            raise APIError(503, "the gateway is shutting down", code="draining")
        if not backend.ready:
            raise APIError(503, f"the {backend.name} service is not ready ({backend.status}"
                                f"{': ' + backend.detail if backend.detail else ''})", code="not_ready")
        return backend

    def _served(self) -> list[tuple[str, Backend]]:
        """(model id, LLM) for every LLM whose model id is known, --llm first."""
        out = [(self.model_id, self.llm)] if self.llm is not None and self.model_id else []
        out += [(b.info.model_id, b) for b in self.more_llms if b.info is not None]
        return out

    def _route(self, model: str | None) -> tuple[Backend, str]:
        """The LLM serving `model` (None: --llm's), ready, and the model id to answer with."""
        if model is None or not self.more_llms:
            return self._require(self.llm, "--llm"), self._check_model(model)
        for served, backend in self._served():
            if served == model:
                flag = "--llm" if backend is self.llm else "--more-llms"
                return self._require(backend, flag), served
        return self._require(self.llm, "--llm"), self._check_model(model)  # the 404 names what is served

    def _check_model(self, model: str | None) -> str:
        served = self.model_id or ""
        ids = [m for m, _ in self._served()] or [served]
        if model is not None and model not in ids:
            raise APIError(404, f"The model `{model}` does not exist. This server serves "
                                f"{', '.join(f'`{m}`' for m in ids)}.", param="model", code="model_not_found")
        return model if model is not None else served

    async def _json(self, request: web.Request) -> dict:
        raw = await self._read_body(request)
        if not raw:
            raise bad_request("the request body is empty: send a JSON object", code="invalid_json")
        try:
            if len(raw) > PARSE_IN_THREAD_BYTES:
                body = await asyncio.to_thread(json.loads, raw)
            else:
                body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise bad_request(f"the request body is not valid JSON ({exc})", code="invalid_json") from None
        except RecursionError:
            raise bad_request("the request body is nested too deeply", code="invalid_json") from None
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object", code="invalid_json")
        if _SURROGATE_ESCAPE.search(raw):  # valid pairs are fine; a lone half cannot become UTF-8 (gRPC)
            where = _lone_surrogate(body, "")
            if where is not None:
                raise bad_request(f"{where or 'the body'} holds a lone UTF-16 surrogate (\\ud800-\\udfff): "
                                  "not valid Unicode text", where or None, code="invalid_json")
        return body

    # -- /v1/chat/completions, /v1/completions ------------------------------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        body = await self._json(request)
        llm, model = self._route(protocol.requested_model(body))
        rid = protocol.new_id(kind)
        if kind == "chat":
            parse = lambda: protocol.chat_request(body, self.limits, rid)  # noqa: E731
        else:
            parse = lambda: protocol.completion_request(body, rid)  # noqa: E731
        parsed = await asyncio.to_thread(parse) if (request.content_length or 0) > PARSE_IN_THREAD_BYTES else parse()
        if parsed.fetches:
            await self._fetch_media(parsed)
        fingerprint = llm.info.weights_fingerprint or None
        timeout = self.config.request_timeout or None
        # The request id and the trace context go to the LLM in the call's metadata.
        call = llm.stub.Generate(parsed.grpc, timeout=timeout, metadata=tracing.outgoing_metadata())
        try:
            first = await self._read(call, parsed.item_params)
            if first is grpc.aio.EOF:
                raise APIError(500, "the LLM ended the stream without a result")
            acc = protocol.Choices(kind, parsed)
            if not parsed.stream:
                message = first
                while message is not grpc.aio.EOF:
                    self._observe(request, message)
                    _choice(acc, message).add(message)
                    if message.finish_reason == pb.ABORT:
                        raise APIError(503, "the LLM aborted the request", code="aborted")
                    message = await self._read(call, parsed.item_params)
                if not acc.finished:
                    raise APIError(500, "the LLM ended the stream without a finish reason")
                return web.json_response(protocol.completion_body(kind, rid, model, acc, fingerprint),
                                         headers={"X-Request-Id": request["request_id"]},
                                         dumps=lambda o: json.dumps(o, ensure_ascii=False))
            return await self._stream(request, call, first, acc, parsed, rid, model, fingerprint)
        finally:
            call.cancel()  # no-op once the call finished; a client gone mid-request aborts it (KV freed)

    async def _fetch_media(self, parsed: protocol.ParsedRequest) -> None:
        """The request's http(s) images and videos, fetched concurrently into their items (a 400 names a refused
        one)."""
        limits = {"image": self.limits.max_image_bytes, "video": self.limits.max_video_bytes}
        bodies = await fetch_all(self.fetcher.fetch(f.url, what=f.param, param=f.param, max_bytes=limits[f.kind],
                                                    kind=f.kind)
                                 for f in parsed.fetches)
        for f, data in zip(parsed.fetches, bodies):
            item = parsed.grpc.chat.messages[f.message].content[f.part].item.input
            if f.kind == "video":
                item.video = data
            else:
                item.data = data

    @staticmethod
    async def _read(call, item_params: list[str]):
        try:
            return await call.read()
        except grpc.RpcError as exc:
            err = from_grpc(exc, "llm")
            # The LLM names a bad image / clip "items[i]": point the client at its place in the request.
            match = _ITEM.match(err.message)
            if match and int(match[1]) < len(item_params):
                err.param = item_params[int(match[1])]
                err.message = err.message.replace(match[0], err.param, 1)
            raise err from None

    def _observe(self, request: web.Request, message: pb.GenerateResponse) -> None:
        """Client-visible latency and token counts, in the shared schema."""
        n = len(message.token_ids)
        now = time.perf_counter()
        if n:
            last = request.get("last_token")
            if last is None:
                self.metrics.gateway_time_to_first_token_seconds.observe(now - request["start"])
            else:
                gap = (now - last) / n
                for _ in range(n):
                    self.metrics.gateway_inter_token_latency_seconds.observe(gap)
            request["last_token"] = now
        if message.finish_reason:
            self.metrics.prompt_tokens_total.inc(message.usage.prompt_tokens)
            self.metrics.generation_tokens_total.inc(message.usage.completion_tokens)

    async def _stream(self, request, call, first, acc, parsed, rid, model, fingerprint) -> web.StreamResponse:
        response = web.StreamResponse(status=200, headers={**SSE_HEADERS, "X-Request-Id": request["request_id"]})
        chunks = protocol.ChunkMaker(parsed.kind, rid, model, parsed.include_usage, fingerprint)
        try:
            await response.prepare(request)
            for index in range(len(acc.by_index)):
                if parsed.kind == "chat":
                    await response.write(_sse(chunks.role(index)))
                elif parsed.echo and not parsed.logprobs:  # with logprobs it leads the first message (its scores)
                    await response.write(_sse(chunks.content(parsed.echo, None, index=index)))
            message = first
            # With tools, each choice's text goes through a tool-call parser: content, then calls as they close.
            parsers = [tools.StreamParser(acc.tools.parallel) for _ in acc.by_index] if acc.tools else None
            try:
                while message is not grpc.aio.EOF:
                    self._observe(request, message)
                    choice = _choice(acc, message)
                    text, logprobs = choice.add(message)
                    if message.finish_reason == pb.ABORT:
                        raise APIError(503, "the LLM aborted the request", code="aborted")
                    calls: list[dict] = []
                    if parsers is not None:
                        parser = parsers[message.index]
                        text, calls = parser.feed(text)
                        if message.finish_reason:
                            text += parser.finish()
                    if text or logprobs:
                        await response.write(_sse(chunks.content(text, logprobs, index=message.index)))
                    if calls:
                        await response.write(_sse(chunks.tool_calls(calls, message.index)))
                    if message.finish_reason:
                        finish = choice.finish_reason
                        if parsers is not None and parsers[message.index].calls and finish == "stop":
                            finish = "tool_calls"
                        await response.write(_sse(chunks.finish(finish, message.index)))
                        if parsed.include_usage and acc.finished:
                            await response.write(_sse(chunks.usage(acc.usage)))
                    message = await self._read(call, parsed.item_params)
            except APIError as err:  # mid-stream: the status is sent; OpenAI clients raise on an error event
                request["status_override"] = err.status
                await response.write(_sse(err.body()))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:  # aiohttp raises its ClientConnectionResetError, a subclass
            request["status_override"] = CLIENT_CLOSED
            call.cancel()
        return response

    # -- /v1/models ---------------------------------------------------------------------------------
    def _model_card(self, model: str, backend: Backend) -> dict:
        info = backend.info
        return {"id": model, "object": "model", "created": self.started, "owned_by": "modalmesh",
                "root": info.model_id, "parent": None, "max_model_len": info.max_model_len}

    async def list_models(self, request: web.Request) -> web.Response:
        self._require(self.llm, "--llm")
        cards = [self._model_card(m, b) for m, b in self._served() if b.ready]
        return web.json_response({"object": "list", "data": cards})

    async def get_model(self, request: web.Request) -> web.Response:
        backend, model = self._route(request.match_info["model"])
        return web.json_response(self._model_card(model, backend))

    # -- /v1/images/decode --------------------------------------------------------------------------
    async def images_decode(self, request: web.Request) -> web.Response:
        vae = self._require(self.vae, "--vae")
        options: dict = dict(request.query)
        if request.content_type.startswith("multipart/"):
            try:
                tensor = await asyncio.wait_for(self._latents_multipart(request, options), self.config.body_timeout)
            except asyncio.TimeoutError:
                raise APIError(408, f"the upload did not arrive within {self.config.body_timeout:g} s (--body-timeout)",
                               code="request_timeout") from None
        elif request.content_type == "application/json":
            body = await self._json(request)
            latents = body.pop("latents", None)
            options.update(body)
            if not isinstance(latents, str) or not latents:
                raise bad_request("latents must be base64: of a .npy / .safetensors file, or raw bytes with "
                                  "dtype and shape", "latents")
            try:
                data = base64.b64decode(latents, validate=True)
            except ValueError:
                raise bad_request("latents is not valid base64", "latents") from None
            if "shape" in options:
                tensor = latents_mod.from_raw(data, options.pop("dtype", "float32"), options.pop("shape"))
            else:
                tensor = latents_mod.from_file(data)
        else:  # the file itself as the body (application/octet-stream)
            data = await self._read_body(request)
            if not data:
                raise bad_request("no latents: send a .npy / .safetensors file as the body, as multipart field "
                                  "'file', or base64 in JSON", "latents")
            tensor = latents_mod.from_file(data)
        decode, fmt = latents_mod.decode_request(tensor, options)
        try:
            reply = await vae.stub.Decode(decode, timeout=self.config.decode_timeout,
                                          metadata=tracing.outgoing_metadata())
        except grpc.RpcError as exc:
            raise from_grpc(exc, "vae") from None
        if fmt == "png":
            return web.Response(body=reply.png[0], content_type="image/png")
        return web.json_response({"created": int(time.time()), "tiles": reply.tiles,
                                  "data": [{"b64_json": base64.b64encode(png).decode()} for png in reply.png]})

    async def _latents_multipart(self, request: web.Request, options: dict) -> pb.Tensor:
        limit = int(self.config.max_request_mb * MiB)
        reader = await request.multipart()
        data = None
        while (part := await reader.next()) is not None:
            if part.name in ("file", "latents"):
                buf = bytearray()
                while chunk := await part.read_chunk(1 << 16):
                    buf += chunk
                    if len(buf) > limit:
                        raise APIError(413, f"latents file over {self.config.max_request_mb:g} MB (--max-request-mb)")
                data = bytes(buf)
            elif part.filename is not None:
                raise bad_request(f"unexpected file field {part.name!r}; send the latents as field 'file'", part.name)
            else:
                options[part.name] = await part.text()
        if not data:
            raise bad_request("multipart upload without a 'file' field holding .npy or .safetensors latents", "file")
        return latents_mod.from_file(data, "file")

    # -- /health ------------------------------------------------------------------------------------
    async def metrics_page(self, request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health(self, request: web.Request) -> web.Response:
        services = {b.name: {"target": b.target, "status": b.status, **({"detail": b.detail} if b.detail else {})}
                    for b in self.backends}
        if self.draining:
            state = "draining"
        else:
            state = "ok" if self.ready else "unavailable"
        body = {"status": state, "model": self.model_id, "services": services}
        return web.json_response(body, status=200 if state == "ok" else 503)


def _choice(choices: protocol.Choices, message: pb.GenerateResponse) -> protocol.Accumulator:
    try:
        return choices[message.index]
    except ValueError as exc:
        raise APIError(500, str(exc)) from None


async def serve(config: GatewayConfig, metrics: metrics_mod.Metrics, stop: asyncio.Event) -> int:
    """Serve HTTP until `stop` is set (SIGTERM / SIGINT, by the process shell), then drain."""
    gateway = Gateway(config, metrics)
    # aiohttp closes a connection whose request has not arrived (or that idles) after keepalive_timeout:
    # that is the header timeout (half-sent requests once stayed open).
    runner = web.AppRunner(gateway.app, handler_cancellation=True, shutdown_timeout=config.grace_period,
                           keepalive_timeout=config.header_timeout)
    await runner.setup()
    ssl_context = None
    if config.ssl_certfile or config.ssl_keyfile:
        import ssl

        ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ssl_context.load_cert_chain(config.ssl_certfile, config.ssl_keyfile)
    try:
        try:
            await web.TCPSite(runner, config.host, config.port, ssl_context=ssl_context).start()
        except OSError as exc:
            raise PortInUse("HTTP", f"{config.host}:{config.port}", "--port", exc.strerror) from None
        metrics_port = start_metrics_exporter(metrics, config.host, config.metrics_port)
    except PortInUse:  # the shell says it in one line and exits 2, as for every service
        await runner.cleanup()
        await gateway.close()
        raise
    port = runner.addresses[0][1]
    metrics.ready.set(0)
    gateway.start()
    # One machine-readable line, as the other services log theirs (launch.GatewayProcess reads it).
    log.info("listening http=%s:%d metrics=%s:%d", config.host, port, config.host, metrics_port)
    try:
        await stop.wait()
        log.info("draining (grace %.1fs)", config.grace_period)
        gateway.draining = True
        metrics.ready.set(0)
        await runner.cleanup()  # stops listening, lets in-flight requests finish within the grace period
    finally:
        await gateway.close()
        metrics.stop_exporter()
    log.info("stopped")
    return 0


def main(argv=None) -> int:
    """`python -m services.gateway`: the process shell every service runs in (modalmesh.service.run_process)."""

    def setup(args: argparse.Namespace, metrics: metrics_mod.Metrics):
        config = GatewayConfig.from_args(args)  # consistent flags, readable files: checked before serving
        return lambda stop: serve(config, metrics, stop)

    return run_process("gateway", build_parser(), setup, argv)
