"""A small EncoderService used to exercise the RPC plumbing, in-process or as a process.

Encode's behaviour is chosen by request_id:
  "echo"     decode items[0].pcm with the real codec and send it back as the embedding
  "boom"     raise an unexpected RuntimeError (must become INTERNAL, no traceback)
  "busy"     raise ResourceExhausted
  "unavail"  raise Unavailable (a replica that cannot serve; clients retry elsewhere)
  "hold"     wait until the server starts draining, then answer (a slow in-flight call)

Run as a process: python -m tests.helpers.echo_service --port 0 [--grace 10]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import sys

from modalmesh import pb
from modalmesh.errors import ResourceExhausted, Unavailable
from modalmesh.metrics import Metrics
from modalmesh.rpc.codec import from_proto, to_proto
from modalmesh.rpc.server import GrpcServer, ServerConfig, serve_until_signal


class EchoEncoder(pb.encoder_pb2_grpc.EncoderServiceServicer):
    def __init__(self, server: GrpcServer, name: str = "echo"):
        self.server = server
        self.name = name
        self.encode_calls = 0
        self.refuse = False  # behave like a replica that lost its model: UNAVAILABLE
        # Answers to requests that offer shared memory: None = bytes, an ShmExporter = through it,
        # "gone" = a ref to an object that does not exist, "fifo" = one that is not a regular file, ("stale", ShmExporter) = a ref whose slab
        # holds other content by the time the client reads it.
        self.shared_memory = None
        self.planted: list[str] = []  # files the "fifo" mode made, for the test to remove
        # An ShmExporter: requests that offer CUDA IPC get a ref with a made-up handle and a real lease.
        self.cuda_ipc = None
        self.cuda_ipc_offers = 0

    async def Encode(self, request, context):
        self.encode_calls += 1
        mode = request.request_id
        if mode == "boom":
            raise RuntimeError("secret internal detail\nTraceback line that must not leak")
        if mode == "busy":
            raise ResourceExhausted("queue is full (8 waiting)")
        if mode == "unavail" or self.refuse:
            raise Unavailable("this replica is draining")
        if mode == "hold":
            await self.server.draining.wait()
        tensor = from_proto(request.items[0].pcm, name="items[0].pcm") if request.items else None
        reply = pb.EncodeResponse(model_id=self.name)
        if tensor is not None:
            message = to_proto(tensor)
            if request.transfer.cuda_ipc and self.cuda_ipc is not None:  # a made-up handle: the client's reader is faked
                lease = self.cuda_ipc.export(pb.Tensor(dtype=pb.UINT8, shape=[0]), b"")
                self.cuda_ipc_offers += 1
                message = pb.Tensor(dtype=message.dtype, shape=message.shape, cuda_ipc=pb.CudaIpcRef(
                    handle=b"\x07" * 64, nbytes=len(message.data), storage_size_bytes=len(message.data),
                    lease=lease.shared_memory))
            elif request.HasField("transfer") and self.shared_memory in ("gone", "fifo"):
                name = "modalmesh-emb-" + secrets.token_hex(16)
                if self.shared_memory == "fifo":  # not a regular file: unreadable, not merely gone
                    os.mkfifo(f"/dev/shm/{name}")
                    self.planted.append(f"/dev/shm/{name}")
                message = pb.Tensor(dtype=message.dtype, shape=message.shape, shared_memory=pb.SharedMemoryRef(
                    name=name, nbytes=len(message.data), offset=64, lease=1))
            elif request.HasField("transfer") and isinstance(self.shared_memory, tuple):  # ("stale", exporter)
                message = self.shared_memory[1].export(message, message.data)
                message.shared_memory.lease ^= 1  # as if the slab had been taken back before the read
            elif request.HasField("transfer") and self.shared_memory is not None:
                message = self.shared_memory.export(message, message.data)
            reply.embeddings.add(embedding=message, num_placeholder_tokens=tensor.shape[0] if tensor.dim() else 1)
        return reply

    async def Info(self, request, context):
        return pb.ServiceInfo(service=self.name, ready=True)


def build(port: int = 0, grace: float = 10.0, metrics: Metrics | None = None, name: str = "echo", **config):
    server = GrpcServer(ServerConfig(host="127.0.0.1", port=port, grace_seconds=grace, **config), metrics)
    servicer = EchoEncoder(server, name)
    server.add_service(pb.ENCODER_SERVICE, pb.encoder_pb2_grpc.add_EncoderServiceServicer_to_server, servicer)
    return server, servicer


async def _main(port: int, grace: float) -> int:
    server, _ = build(port, grace, Metrics("echo"))

    def listening(bound: int) -> None:
        print(f"listening grpc=127.0.0.1:{bound} metrics=127.0.0.1:-1", file=sys.stderr, flush=True)

    return await serve_until_signal(server, on_listening=listening)


if __name__ == "__main__":
    from modalmesh.process import die_with_parent

    die_with_parent()
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--grace", type=float, default=10.0)
    args = parser.parse_args()
    logging.basicConfig(level="INFO")
    sys.exit(asyncio.run(_main(args.port, args.grace)))
