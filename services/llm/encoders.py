"""The LLM's fan-out to the encoder pools: raw image / audio / video items -> embeddings (video: the vision pool).

Each item of a request is sent as its own Encode call, all concurrently, so a
round_robin channel spreads one request's images over the replicas. The
caller's deadline bounds the calls and cancelling the Generate call cancels
them. UNAVAILABLE (a replica that died or is draining) is retried on another
replica while the deadline allows. Every answer is checked before it is
spliced: it must come from the same checkpoint (weights fingerprint) and have
the right modality; the splicer then checks width, dtype and row count.

How an answer's embedding travels (message bytes, or the same-host paths), what each
call offers and what happens when a path fails are modalmesh.rpc.transfer's
(`EmbeddingReceiver`); this module asks again when it says so. Answers are parsed
without their bytes (modalmesh.rpc.wire): the embedding is read from a view into the
received buffer. Every embedding leaves here as one `Embedding` value on the LLM's
device, a client's precomputed ones included.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

import grpc
import torch

from modalmesh import pb
from modalmesh import tracing
from modalmesh.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, ModalmeshError, Unavailable
from modalmesh.metrics import Metrics
from modalmesh.rpc.channel import MiB, aio_channel
from modalmesh.rpc import wire
from modalmesh.rpc.codec import dtype_name
from modalmesh.rpc.security import Security
from modalmesh.rpc.shm import ShmProbe, ShmReader
from modalmesh.rpc.transfer import AskAgain, EmbeddingReceiver, path_of
from services.llm.embedding import FLOAT_WIRE, Embedding, from_client, known_finite

log = logging.getLogger(__name__)

FLAGS = {pb.IMAGE: "--vision-encoder", pb.AUDIO: "--audio-encoder", pb.VIDEO: "--vision-encoder"}
# The pool each modality's raw items go to: video to the vision encoder, which answers as IMAGE.
POOL_MODALITY = {pb.IMAGE: pb.IMAGE, pb.AUDIO: pb.AUDIO, pb.VIDEO: pb.IMAGE}
_MAX_ATTEMPTS = 4


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
                 device: torch.device | None = None, security: Security | None = None, metrics: Metrics | None = None):
        self.modality = modality
        self.device = device  # where embeddings go (the LLM's device); None: the CPU
        self.target = target
        self.channel = aio_channel(target, max_message_bytes=max_message_bytes, security=security)
        # Encode's answer is parsed without its embeddings' bytes, which stay views into the
        # received buffer (modalmesh.rpc.wire): protobuf would copy them twice.
        self._encode = self.channel.unary_unary(
            f"/{pb.ENCODER_SERVICE}/Encode", request_serializer=pb.EncodeRequest.SerializeToString,
            response_deserializer=_parse_encode_response)
        self.receiver = EmbeddingReceiver(probe=probe, reader=reader, device=device, metrics=metrics)
        # Each call's rpc and take, against the encoder's own stages: where a request's wait for its items goes.
        self._stage_seconds = None if metrics is None else functools.partial(
            metrics.encode_call_seconds.labels, modality=pb.Modality.Name(modality).lower())

    @property
    def probe(self) -> ShmProbe | None:
        """The shared-memory probe this pool still offers (None once the path is off)."""
        return self.receiver.probe

    async def encode_one(self, item: pb.EncodeItem, index: int,
                         timeout: float) -> tuple[pb.EncodeResponse, torch.Tensor | None]:
        # None only with a count of embeddings other than one, which the fan-out refuses.
        """The encoder's answer for one item (without the embedding's bytes) and the embedding."""
        deadline = time.monotonic() + timeout
        attempt = 0
        refused: set[str] = set()  # paths that failed for this item: it is asked again without them
        while attempt < _MAX_ATTEMPTS:
            attempt += 1
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            request = pb.EncodeRequest(items=[item])
            offered = self.receiver.offer(request, refused)
            called = time.perf_counter()
            try:
                # Not wait_for_ready: with every replica down (the channel in TRANSIENT_FAILURE) the call fails
                # at once instead of holding the request to its deadline; while connecting it still waits.
                # The Generate's request id and trace context: the encoder's span joins the request's trace.
                parsed = await self._encode(request, timeout=remaining, wait_for_ready=False,
                                            metadata=tracing.outgoing_metadata())
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
            if meta.dtype not in FLOAT_WIRE:
                raise ModalmeshError(f"items[{index}]: encoder {self.target} sent an embedding of dtype "
                                     f"{dtype_name(meta.dtype)}, not a float one")
            if path_of(meta) not in offered:
                raise ModalmeshError(f"items[{index}]: encoder {self.target} answered by {path_of(meta)} unasked")
            taking = time.perf_counter()
            try:
                tensor = await self.receiver.take(meta, payloads[0], name=f"items[{index}].embedding")
            except InvalidArgument as exc:
                raise ModalmeshError(f"encoder {self.target} sent a malformed embedding: {exc}") from None
            except AskAgain as exc:
                log.warning("encoder %s: %s", self.target, exc)
                refused.add(exc.path)
                attempt -= 1  # not the replica's fault
                continue
            if self._stage_seconds is not None:
                self._stage_seconds(stage="rpc").observe(taking - called)
                self._stage_seconds(stage="take").observe(time.perf_counter() - taking)
            return reply, tensor
        raise DeadlineExceeded(f"items[{index}]: no encoder replica answered before the deadline")

    async def close(self) -> None:
        await self.channel.close()
        self.receiver.close()


class EncoderFanout:
    def __init__(self, pools: dict[int, EncoderPool], *, fingerprint: str, check_fingerprint: bool,
                 default_timeout: float, metrics: Metrics, probe: ShmProbe | None = None,
                 device: torch.device | None = None):
        self.pools = pools
        self.probe = probe  # shared by the pools; removed on close
        self.fingerprint = fingerprint
        self.check_fingerprint = check_fingerprint
        self.default_timeout = default_timeout
        self.metrics = metrics
        self.device = device  # where clients' embeddings go (the encoders' go there through their pools)

    async def resolve(self, items: list[pb.MultimodalItem], timeout: float | None,
                      skip: set[int] = frozenset()) -> list[Embedding | None]:
        """Every item's `Embedding`, in order: a client's decoded here (before any Encode, so a malformed
        one is refused first), raw input through its encoder pool. Items in `skip` (their rows are in the
        prefix cache) are neither decoded nor encoded: None."""
        out: list[Embedding | None] = [
            from_client(item, i, self.device) if item.WhichOneof("source") != "input" and i not in skip else None
            for i, item in enumerate(items)]
        todo = [(i, item) for i, item in enumerate(items) if out[i] is None and i not in skip]
        if not todo:
            return await known_finite(out)
        for i, item in todo:
            if POOL_MODALITY.get(item.modality) not in self.pools:
                flag = FLAGS.get(item.modality, "an encoder flag")
                raise FailedPrecondition(f"items[{i}]: raw input needs an encoder pool, and this LLM service was "
                                         f"started without {flag}; send a precomputed embedding instead")
        budget = timeout if timeout is not None else self.default_timeout
        started = time.perf_counter()
        tasks = [asyncio.ensure_future(self.pools[POOL_MODALITY[item.modality]].encode_one(item.input, i, budget))
                 for i, item in todo]
        try:
            replies = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()  # one item failed or the caller went away: stop the rest
            raise
        self.metrics.transfer_seconds.labels(direction="received").observe(time.perf_counter() - started)
        for (i, item), (reply, tensor) in zip(todo, replies):
            self._check(reply, item.modality, i)
            out[i] = Embedding.of(reply.embeddings[0], tensor, item.modality)
        return await known_finite(out)

    def _check(self, reply: pb.EncodeResponse, modality: int, index: int) -> None:
        name = pb.Modality.Name(modality).lower()
        if len(reply.embeddings) != 1:
            raise ModalmeshError(f"items[{index}]: the {name} encoder returned {len(reply.embeddings)} embeddings "
                                 "for one item")
        if reply.modality not in (POOL_MODALITY[modality], pb.MODALITY_UNSPECIFIED):
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
