"""The LLM's fan-out to the encoder pools: raw image / audio items -> embeddings.

Each item of a request is sent as its own Encode call, all concurrently, so a
round_robin channel spreads one request's images over the replicas. The
caller's deadline bounds the calls and cancelling the Generate call cancels
them. UNAVAILABLE (a replica that died or is draining) is retried on another
replica while the deadline allows. Every answer is checked before it is
spliced: it must come from the same checkpoint (weights fingerprint) and have
the right modality; the splicer then checks width, dtype and row count.

With a `ShmProbe`, each call offers the same-host path (modalmesh.rpc.shm): an
encoder that shares this host's /dev/shm answers with shared-memory refs, copied
out here (off the event loop when large). A ref that is gone or stale gets that
item asked again as bytes; one that cannot be read at all (not this user's)
turns the path off for the pool. Answers with bytes are parsed without them
(modalmesh.rpc.wire): the embedding is a view into the received buffer.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import torch

from modalmesh import pb
from modalmesh.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, ModalmeshError, Unavailable
from modalmesh.metrics import Metrics
from modalmesh.rpc.channel import MiB, aio_channel
from modalmesh.rpc import wire
from modalmesh.rpc.codec import dtype_name, from_payload, payload_nbytes
from modalmesh.rpc.security import Security
from modalmesh.rpc.shm import SharedMemoryGone, ShmProbe, ShmReader

log = logging.getLogger(__name__)

FLAGS = {pb.IMAGE: "--vision-encoder", pb.AUDIO: "--audio-encoder"}
_MAX_ATTEMPTS = 4
_INLINE_BYTES = 4 << 20  # shared-memory answers this small are copied out on the event loop


_FLOAT_WIRE = (pb.FLOAT32, pb.FLOAT16, pb.BFLOAT16)


class _Unparseable:
    def __init__(self, why: str):
        self.why = why


def _parse_encode_response(data: bytes) -> tuple[pb.EncodeResponse, list[memoryview | None]] | _Unparseable:
    # Never raises: grpc would log the exception and hand back None.
    try:
        rest, payloads = wire.strip(data, wire.ENCODE_RESPONSE_BYTES)
        return pb.EncodeResponse.FromString(rest), payloads
    except Exception:  # noqa: BLE001 - e.g. a group field: let protobuf itself try, bytes and all
        pass
    try:
        reply = pb.EncodeResponse.FromString(data)
    except Exception as exc:  # noqa: BLE001
        return _Unparseable(f"{type(exc).__name__}: {exc}")
    return reply, [None] * len(reply.embeddings)


class EncoderPool:
    """One modality's encoder replicas behind one gRPC target."""

    def __init__(self, modality: int, target: str, *, max_message_bytes: int = 256 * MiB,
                 probe: ShmProbe | None = None, reader: ShmReader | None = None,
                 device: torch.device | None = None, security: Security | None = None):
        self.modality = modality
        self.device = device  # where embeddings read from shared memory go (the LLM's device)
        self.target = target
        self.channel = aio_channel(target, max_message_bytes=max_message_bytes, security=security)
        # Encode's answer is parsed without its embeddings' bytes, which stay views into the
        # received buffer (modalmesh.rpc.wire): protobuf would copy them twice.
        self._encode = self.channel.unary_unary(
            f"/{pb.ENCODER_SERVICE}/Encode", request_serializer=pb.EncodeRequest.SerializeToString,
            response_deserializer=_parse_encode_response)
        self.probe = probe
        self.reader = reader if reader is not None else ShmReader()

    async def encode_one(self, item: pb.EncodeItem, index: int,
                         timeout: float) -> tuple[pb.EncodeResponse, torch.Tensor | None]:
        # None only with a count of embeddings other than one, which the fan-out refuses.
        """The encoder's answer for one item (without the embedding's bytes) and the embedding."""
        deadline = time.monotonic() + timeout
        attempt = 0
        offer = True  # off for this item after a shared-memory answer went stale
        while attempt < _MAX_ATTEMPTS:
            attempt += 1
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            request = pb.EncodeRequest(items=[item])
            if offer and self.probe is not None:
                request.transfer.CopyFrom(self.probe.options())
            try:
                # Not wait_for_ready: with every replica down (the channel in TRANSIENT_FAILURE) the call fails
                # at once instead of holding the request to its deadline; while connecting it still waits.
                parsed = await self._encode(request, timeout=remaining, wait_for_ready=False)
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.UNAVAILABLE and attempt < _MAX_ATTEMPTS:
                    log.warning("encoder %s unavailable for items[%d] (attempt %d): %s", self.target, index,
                                attempt, exc.details())
                    continue
                detail = (exc.details() or code.name).replace("items[0]", f"items[{index}]")
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise InvalidArgument(detail) from None
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise DeadlineExceeded(f"items[{index}]: the encoder did not answer in time") from None
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise Unavailable(f"items[{index}]: the encoder pool is overloaded: {detail}") from None
                raise Unavailable(f"items[{index}]: encoder {self.target} failed: {code.name}: {detail}") from None
            if isinstance(parsed, _Unparseable):
                raise ModalmeshError(f"items[{index}]: encoder {self.target} sent an unparseable answer: {parsed.why}")
            reply, payloads = parsed
            if len(reply.embeddings) != 1:
                return reply, None  # a count the fan-out refuses
            meta = reply.embeddings[0].embedding
            if meta.dtype not in _FLOAT_WIRE:
                raise ModalmeshError(f"items[{index}]: encoder {self.target} sent an embedding of dtype "
                                     f"{dtype_name(meta.dtype)}, not a float one")
            if not meta.HasField("shared_memory"):
                try:
                    data = payloads[0] if payloads[0] is not None else meta.data
                    view = from_payload(meta, data, name=f"items[{index}].embedding")
                    # Out of the received message (read-only, any alignment, kept alive whole by a view),
                    # onto the LLM's device in the same copy.
                    return reply, view.to(self.device, copy=True) if self.device is not None else view.clone()
                except InvalidArgument as exc:
                    raise ModalmeshError(f"encoder {self.target} sent a malformed embedding: {exc}") from None
            if not request.HasField("transfer"):
                raise ModalmeshError(f"items[{index}]: encoder {self.target} answered with shared memory unasked")
            try:
                message, where = reply.embeddings[0].embedding, f"items[{index}].embedding"
                if message.shared_memory.nbytes <= _INLINE_BYTES:  # a thread hop would cost more than the copy
                    tensor = self.reader.read(message, name=where, device=self.device)
                else:
                    tensor = await asyncio.to_thread(self.reader.read, message, name=where, device=self.device)
            except (InvalidArgument, SharedMemoryGone) as exc:
                # A late read (the slab was retired) or a malformed ref: this item again, as bytes.
                log.warning("encoder %s: %s; asking again for bytes", self.target, exc)
                offer = False
                attempt -= 1
                continue
            except OSError as exc:
                log.warning("encoder %s: shared-memory answer unreadable (%s); using message bytes from now on",
                            self.target, exc)
                self.probe = None
                attempt -= 1  # not the replica's fault: ask again as bytes
                continue
            return reply, tensor
        raise DeadlineExceeded(f"items[{index}]: no encoder replica answered before the deadline")

    async def close(self) -> None:
        await self.channel.close()
        self.reader.close()


class EncoderFanout:
    def __init__(self, pools: dict[int, EncoderPool], *, fingerprint: str, check_fingerprint: bool,
                 default_timeout: float, metrics: Metrics, probe: ShmProbe | None = None):
        self.pools = pools
        self.probe = probe  # shared by the pools; removed on close
        self.fingerprint = fingerprint
        self.check_fingerprint = check_fingerprint
        self.default_timeout = default_timeout
        self.metrics = metrics

    async def resolve(self, items: list[pb.MultimodalItem],
                      timeout: float | None) -> tuple[list[pb.MultimodalItem], dict[int, torch.Tensor]]:
        """Items with raw input replaced by their encoders' answers (the rest unchanged), and those
        answers' embeddings by item index: the messages carry no bytes (shared memory, or views
        into the received buffer)."""
        todo = [(i, item) for i, item in enumerate(items) if item.WhichOneof("source") == "input"]
        if not todo:
            return items, {}
        for i, item in todo:
            if item.modality not in self.pools:
                flag = FLAGS.get(item.modality, "an encoder flag")
                raise FailedPrecondition(f"items[{i}]: raw input needs an encoder pool, and this LLM service was "
                                         f"started without {flag}; send a precomputed embedding instead")
        budget = timeout if timeout is not None else self.default_timeout
        started = time.perf_counter()
        tasks = [asyncio.ensure_future(self.pools[item.modality].encode_one(item.input, i, budget))
                 for i, item in todo]
        try:
            replies = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()  # one item failed or the caller went away: stop the rest
            raise
        self.metrics.transfer_seconds.labels(direction="received").observe(time.perf_counter() - started)
        out = list(items)
        decoded: dict[int, torch.Tensor] = {}
        for (i, item), (reply, tensor) in zip(todo, replies):
            self._check(reply, item.modality, i)
            embedding = reply.embeddings[0]
            decoded[i] = tensor
            path = "shared_memory" if embedding.embedding.HasField("shared_memory") else "grpc"
            self.metrics.transfer_bytes_total.labels(direction="received", path=path).inc(
                payload_nbytes(embedding.embedding))
            out[i] = pb.MultimodalItem(modality=item.modality, embedding=embedding)
        return out, decoded

    def _check(self, reply: pb.EncodeResponse, modality: int, index: int) -> None:
        name = pb.Modality.Name(modality).lower()
        if len(reply.embeddings) != 1:
            raise ModalmeshError(f"items[{index}]: the {name} encoder returned {len(reply.embeddings)} embeddings "
                                 "for one item")
        if reply.modality not in (modality, pb.MODALITY_UNSPECIFIED):
            raise FailedPrecondition(f"items[{index}]: {FLAGS[modality]} points at a "
                                     f"{pb.Modality.Name(reply.modality).lower()} encoder")
        if self.check_fingerprint and reply.weights_fingerprint != self.fingerprint:
            raise FailedPrecondition(
                f"items[{index}]: the {name} encoder serves checkpoint {reply.model_id!r} "
                f"({reply.weights_fingerprint or 'no fingerprint'}), not this LLM's ({self.fingerprint}); point "
                f"{FLAGS[modality]} at encoders of the same checkpoint, or pass --allow-foreign-encoders")

    async def close(self) -> None:
        await asyncio.gather(*(pool.close() for pool in self.pools.values()))
        if self.probe is not None:
            self.probe.close()
