"""modalmesh.batching (the skeleton the encoders and the VAE share) and modalmesh.rpc.servicer (the one servicer)."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from modalmesh import pb
from modalmesh.batching import BatchQueue
from modalmesh.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from modalmesh.metrics import Metrics
from modalmesh.rpc.server import GrpcServer, ServerConfig
from modalmesh.rpc.servicer import ForwardingServicer
from services.encoder.batcher import Batcher
from services.encoder.model import PreparedItem


class Fifo(BatchQueue[int, int]):
    """The simplest policy: up to three waiting items, in order."""

    def _take(self):
        return [self._queue.popleft() for _ in range(min(3, len(self._queue)))]

    def _batch_full(self):
        return len(self._queue) >= 3


def _run(body):
    asyncio.run(asyncio.wait_for(body(), 30))


def test_batches_follow_the_policy_results_go_back_in_order_and_depth_is_published():
    async def body():
        seen = []
        metrics = Metrics("test", process_metrics=False)
        q = Fifo(lambda items, abandoned: seen.append(list(items)) or [i * 10 for i in items], name="test",
                 max_queue=10, window_s=0.05, metrics=metrics)
        q.start()
        results = await asyncio.gather(q.wait_for([1, 2]), q.wait_for([3]), q.wait_for([4]))
        assert results == [[10, 20], [30], [40]]
        assert seen == [[1, 2, 3], [4]]  # the window let the first three share a batch
        assert q.batches_run == 2
        assert metrics.registry.get_sample_value("modalmesh_queue_depth", {"service": "test"}) == 0
        await q.stop()

    _run(body)


def test_a_full_queue_is_resource_exhausted_and_a_wrong_result_count_fails_the_batch():
    async def body():
        q = Fifo(lambda items, abandoned: [0], name="test", max_queue=2)
        with pytest.raises(ResourceExhausted, match="test queue is full .*limit 2"):
            await q.wait_for([1, 2, 3])
        q.start()
        with pytest.raises(RuntimeError, match="1 results for 2 items"):
            await q.wait_for([1, 2])
        assert await q.wait_for([5]) == [0]  # the worker carried on
        await q.stop()

    _run(body)


def test_status_errors_reach_every_caller_of_the_batch():
    async def body():
        def run(items, abandoned):
            raise InvalidArgument("bad batch")

        q = Fifo(run, name="test", max_queue=8, window_s=0.05)
        q.start()
        errors = await asyncio.gather(q.wait_for([1]), q.wait_for([2]), return_exceptions=True)
        assert [str(e) for e in errors] == ["bad batch", "bad batch"]
        await q.stop()

    _run(body)


def test_a_result_that_is_an_exception_fails_that_items_caller_alone():
    async def body():
        q = Fifo(lambda items, abandoned: [InvalidArgument(f"items[0]: bad {i}") if i == 2 else i for i in items],
                 name="test", max_queue=8, window_s=0.05)
        q.start()
        results = await asyncio.gather(q.wait_for([1]), q.wait_for([2]), q.wait_for([3]), return_exceptions=True)
        assert results[0] == [1] and results[2] == [3]
        assert isinstance(results[1], InvalidArgument) and str(results[1]) == "items[0]: bad 2"
        assert q.batches_run == 1  # all three shared one batch
        await q.stop()

    _run(body)


def test_abandoned_turns_true_once_every_caller_of_the_batch_is_gone():
    async def body():
        started, saw = threading.Event(), []

        def run(items, abandoned):
            started.set()
            for _ in range(3000):  # a long decode checking between blocks
                if abandoned():
                    saw.append("stopped")
                    return [0] * len(items)
                threading.Event().wait(0.01)
            saw.append("ran to the end")
            return [0] * len(items)

        q = Fifo(run, name="test", max_queue=8)
        q.start()
        call = asyncio.ensure_future(q.wait_for([1, 2]))
        await asyncio.to_thread(started.wait, 10)
        call.cancel()  # the client went away
        while not saw:
            await asyncio.sleep(0.01)
        assert saw == ["stopped"]
        await q.stop()

    _run(body)


def test_stop_fails_waiting_callers_instead_of_leaving_them_waiting_forever():
    # The encoders' Batcher.stop once cancelled its worker and left queued callers awaiting forever.
    async def body():
        batcher = Batcher(lambda items, abandoned: [0] * len(items), max_batch_tokens=4)
        waiting = asyncio.ensure_future(batcher.submit([PreparedItem({}, cost=1, cache_key=b"k")]))
        await asyncio.sleep(0)
        assert batcher.depth == 1
        await batcher.stop()
        with pytest.raises(FailedPrecondition, match="shutting down"):
            await asyncio.wait_for(waiting, 5)
        assert batcher.depth == 0

    _run(body)


# -- the forwarding servicer ----------------------------------------------------------------------
class _Service:
    def __init__(self):
        self.timeouts = []

    def info(self):
        return pb.ServiceInfo(service="toy", ready=True)

    async def encode(self, request):
        if not request.items:
            raise InvalidArgument("items: the request has no items")
        return pb.EncodeResponse(model_id=f"{len(request.items)} items")

    async def generate(self, request, timeout=None):
        self.timeouts.append(timeout)
        for text in request.text.split():
            yield pb.GenerateResponse(text=text)


def test_forwarding_servicer_forwards_each_rpc_with_its_deadline_and_errors_keep_their_status():
    async def body():
        service = _Service()
        server = GrpcServer(ServerConfig(host="127.0.0.1", port=0))
        server.add_service(pb.ENCODER_SERVICE, pb.encoder_pb2_grpc.add_EncoderServiceServicer_to_server,
                           ForwardingServicer(service, Encode=service.encode))
        llm = ForwardingServicer(service, Generate=service.generate)
        assert llm.rpcs == ["Generate", "Info"]
        server.add_service(pb.LLM_SERVICE, pb.llm_pb2_grpc.add_LLMServiceServicer_to_server, llm)
        port = await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                encoder = pb.encoder_pb2_grpc.EncoderServiceStub(channel)
                reply = await encoder.Encode(pb.EncodeRequest(items=[pb.EncodeItem(), pb.EncodeItem()]))
                assert reply.model_id == "2 items"
                assert (await encoder.Info(pb.InfoRequest())).service == "toy"
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await encoder.Encode(pb.EncodeRequest())
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                stub = pb.llm_pb2_grpc.LLMServiceStub(channel)
                texts = [r.text async for r in stub.Generate(pb.GenerateRequest(text="a b c"), timeout=20)]
                assert texts == ["a", "b", "c"]
                [r async for r in stub.Generate(pb.GenerateRequest(text="x"))]
        finally:
            await server.stop(0)
        assert 0 < service.timeouts[0] <= 21 and service.timeouts[1] is None

    _run(body)


def test_forwarding_servicer_refuses_a_name_that_is_not_an_rpc():
    with pytest.raises(ValueError, match="CamelCase"):
        ForwardingServicer(_Service(), encode=_Service().encode)
