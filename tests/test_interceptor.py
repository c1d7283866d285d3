"""modalmesh.rpc.interceptor: the handler around each service method is made once per method, not per call."""

import asyncio

import grpc

from modalmesh.rpc.interceptor import StatusInterceptor


class _Details:
    def __init__(self, method):
        self.method = method


def test_the_wrapped_handler_is_made_once_per_method_and_again_when_the_service_changes_it():
    async def echo(request, context):
        return request

    first = grpc.unary_unary_rpc_method_handler(echo)
    second = grpc.unary_unary_rpc_method_handler(echo)
    interceptor = StatusInterceptor()

    async def wrapped(handler, method="/modalmesh.v1.Encoder/Encode"):
        async def continuation(details):
            return handler

        return await interceptor.intercept_service(continuation, _Details(method))

    async def body():
        a, b = await wrapped(first), await wrapped(first)
        c = await wrapped(second)  # another handler for the same method: wrapped afresh
        health = await wrapped(first, "/grpc.health.v1.Health/Check")  # not wrapped at all
        return a, b, c, health

    a, b, c, health = asyncio.run(body())
    assert a is b and c is not a and health is first
    assert a.unary_unary is not echo and c.unary_unary is not echo  # ours around the service's
