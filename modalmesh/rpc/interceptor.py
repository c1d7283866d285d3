"""Server interceptor: project errors -> gRPC status, per-RPC metrics, and each call's trace and request id.

Clients get a status code and a one-line message, never a traceback; the
traceback of an unexpected error stays in the server log. While tracing is on
(modalmesh.tracing) every call is a server span, child of the caller's W3C
traceparent from the metadata; the caller's x-request-id is the call's request
id (modalmesh.tracing.request_id), which log records carry.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import time

import grpc

from modalmesh import tracing
from modalmesh.errors import InvalidArgument, ModalmeshError, Unauthenticated, one_line
from modalmesh.metrics import Metrics
from modalmesh.rpc.security import INSECURE, Security

log = logging.getLogger(__name__)


class _Outcome:
    __slots__ = ("code",)

    def __init__(self) -> None:
        self.code = "OK"


class _Undecodable:
    """A request the method's deserializer refused: the handler answers INVALID_ARGUMENT (and counts it)
    instead of grpc's UNKNOWN with a traceback logged for every call."""

    __slots__ = ("error",)

    def __init__(self, error: Exception):
        self.error = error


def _lenient(deserializer):
    if deserializer is None:
        return None

    def parse(data: bytes):
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError, bad UTF-8, anything a parser raises
            return _Undecodable(exc)

    return parse


def _check_decoded(request, rpc: str) -> None:
    if isinstance(request, _Undecodable):
        # The parser's own words ("String field had bad UTF-8", "Wire format was corrupt"), minus its type name.
        why = str(request.error).rsplit(":", 1)[-1].strip() or type(request.error).__name__
        raise InvalidArgument(f"the request is not a valid {rpc} message: {why}")


class StatusInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, metrics: Metrics | None = None, security: Security = INSECURE):
        self._metrics = metrics
        self._security = security
        self.active = 0  # the services' own calls not yet ended (health and reflection not counted)
        # Of them, the calls answered with one reply (unary and client-streaming), and when the last ended
        # (time.monotonic()): what the drain's GOAWAY waits for (GrpcServer.drain)
        self.replying = 0
        self.last_reply_end: float | None = None
        self._idle: asyncio.Event | None = None
        self._replies_idle: asyncio.Event | None = None
        # method -> (the service's handler, ours around it): made once per method, not per call (making it
        # for every call was 7 % of an encoder's busy event loop under load on the H200)
        self._wrapped: dict[str, tuple[object, object]] = {}
        self._span_names: dict[str, str] = {}

    async def wait_idle(self) -> None:
        """Until no call of the services' own is in flight (health watches may stay open)."""
        while self.active:
            self._idle = self._idle or asyncio.Event()
            self._idle.clear()
            await self._idle.wait()

    async def wait_quiet(self, quiet: float, since: float) -> None:
        """Until no call answered with one reply is in flight and none has ended for `quiet` seconds, counted
        from `since` (a time.monotonic()) at the earliest: a client that sends its next call on each reply
        has had `quiet` to send it (GrpcServer.drain says why that matters). Streams of replies do not count."""
        while True:
            while self.replying:
                self._replies_idle = self._replies_idle or asyncio.Event()
                self._replies_idle.clear()
                await self._replies_idle.wait()
            remaining = max(since, self.last_reply_end or since) + quiet - time.monotonic()
            if remaining <= 0:
                return
            await asyncio.sleep(remaining)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith("/grpc."):  # health, reflection
            return handler
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(handler, method)
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _wrap(self, handler, method: str):
        rpc = method.rsplit("/", 1)[-1]
        self._span_names[rpc] = method.lstrip("/")  # OpenTelemetry's rpc span name: package.Service/Method
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(handler.unary_unary, rpc),
                request_deserializer=_lenient(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_stream(handler.unary_stream, rpc),
                request_deserializer=_lenient(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                self._wrap_unary(handler.stream_unary, rpc),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return grpc.stream_stream_rpc_method_handler(
            self._wrap_stream(handler.stream_stream, rpc),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _wrap_unary(self, behavior, rpc: str):
        async def wrapped(request, context):
            outcome = _Outcome()
            start = self._begin(rpc, context, one_reply=True)
            entered = self._enter_request(rpc, context)
            try:
                self._check_caller(context)
                _check_decoded(request, rpc)
                result = behavior(request, context)
                if inspect.isawaitable(result):
                    result = await result
                return result
            except BaseException as exc:  # noqa: BLE001 - mapped, then re-raised
                await self._handle(exc, context, rpc, outcome)
                raise
            finally:
                self._end(rpc, start, outcome, context)
                self._exit_request(entered, outcome)

        return wrapped

    def _wrap_stream(self, behavior, rpc: str):
        async def wrapped(request, context):
            outcome = _Outcome()
            start = self._begin(rpc, context, one_reply=False)
            entered = self._enter_request(rpc, context)
            try:
                self._check_caller(context)
                _check_decoded(request, rpc)
                result = behavior(request, context)
                if inspect.isasyncgen(result):
                    async for item in result:
                        yield item
                else:
                    if inspect.isawaitable(result):
                        result = await result
                    if result is not None:
                        for item in result:
                            yield item
            except BaseException as exc:  # noqa: BLE001 - mapped, then re-raised
                await self._handle(exc, context, rpc, outcome)
                raise
            finally:
                self._end(rpc, start, outcome, context)
                self._exit_request(entered, outcome)

        return wrapped

    def _enter_request(self, rpc: str, context):
        """The call's request id and server span (a no-op scope while tracing is off), entered."""
        metadata = context.invocation_metadata() or ()
        token = tracing.request_id.set(tracing.request_id_from(metadata))
        if not tracing.enabled():  # no span scope to make per call while tracing is off
            return token, None, None
        scope = tracing.span(self._span_names.get(rpc, rpc), parent=tracing.extract(metadata), kind="server",
                             attributes={"rpc.system": "grpc", "rpc.method": rpc})
        return token, scope, scope.__enter__()

    @staticmethod
    def _exit_request(entered, outcome: _Outcome) -> None:
        token, scope, current = entered
        if scope is None:
            with contextlib.suppress(ValueError):
                tracing.request_id.reset(token)
            return
        tracing.set_attributes(current, **{"rpc.grpc.status_code": outcome.code})
        if outcome.code not in ("OK", "CANCELLED"):
            tracing.mark_error(current, outcome.code)
        scope.__exit__(None, None, None)
        # A stream closed from another context (aclose by grpc) cannot reset its own token: nothing to undo there.
        with contextlib.suppress(ValueError):
            tracing.request_id.reset(token)

    def _check_caller(self, context) -> None:
        if self._security.token is not None and not self._security.authorized(context.invocation_metadata()):
            raise Unauthenticated("missing or wrong authorization token (authorization: Bearer <token>)")

    async def _handle(self, exc: BaseException, context, rpc: str, outcome: _Outcome) -> None:
        """Record the outcome; convert project and unexpected errors into an abort."""
        if isinstance(exc, grpc.aio.AbortError):
            code = _context_code(context)
            outcome.code = code.name if code is not None else "UNKNOWN"
            return
        if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
            outcome.code = "CANCELLED"
            return
        if isinstance(exc, ModalmeshError):
            outcome.code = exc.status.name
            await context.abort(exc.status, one_line(str(exc) or type(exc).__name__))
        if isinstance(exc, Exception):
            outcome.code = "INTERNAL"
            log.exception("unexpected error in %s", rpc)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {rpc}: {type(exc).__name__} (details in the server log)")

    def _begin(self, rpc: str, context, one_reply: bool) -> float:
        # In flight until grpc has taken the call's last reply and status (the done callback), not merely
        # until the handler returned. That is still before the client has them all: the drain must not
        # force-close connections on idle (see GrpcServer.drain).
        self.active += 1
        self.replying += one_reply
        context.add_done_callback(functools.partial(self._call_done, one_reply))
        if self._metrics is not None:
            self._metrics.requests_in_flight.labels(rpc=rpc).inc()
        return time.perf_counter()

    def _call_done(self, one_reply: bool, context) -> None:
        self.active -= 1
        if not self.active and self._idle is not None:
            self._idle.set()
        if one_reply:
            self.replying -= 1
            self.last_reply_end = time.monotonic()
            if not self.replying and self._replies_idle is not None:
                self._replies_idle.set()

    def _end(self, rpc: str, start: float, outcome: _Outcome, context) -> None:
        if outcome.code == "OK":  # a handler may set a code without raising
            code = _context_code(context)
            if code is not None and code != grpc.StatusCode.OK:
                outcome.code = code.name
        if self._metrics is None:
            return
        m = self._metrics
        m.requests_in_flight.labels(rpc=rpc).dec()
        m.requests_total.labels(rpc=rpc, code=outcome.code).inc()
        m.request_duration_seconds.labels(rpc=rpc, code=outcome.code).observe(time.perf_counter() - start)


def _context_code(context) -> grpc.StatusCode | None:
    try:
        code = context.code()
    except Exception:  # noqa: BLE001 - older grpc without ServicerContext.code()
        return None
    if isinstance(code, int):
        return next((c for c in grpc.StatusCode if c.value[0] == code), None)
    return code
