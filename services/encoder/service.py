"""EncoderService, shared by the vision and the audio encoder.

Encode: prepare every item in a thread pool (bad input fails the request with
INVALID_ARGUMENT naming the item), answer cached items from the embedding
cache, batch the misses with other requests' (`Batcher`), run the model, and
return one `Embedding` per item in request order. A subclass only builds its
model (`build_model`) and may add flags.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from modalmesh import pb
from modalmesh import tracing
from modalmesh.errors import InvalidArgument
from modalmesh.interpreter import set_switch_interval
from modalmesh.rpc.codec import describe, nbytes
from modalmesh.rpc.servicer import ForwardingServicer
from modalmesh.rpc.shm import ShmExporter, shm_available
from modalmesh.rpc.transfer import EmbeddingSender
from modalmesh.service import Service
from services.encoder.batcher import Batcher
from services.encoder.cache import Answer, EmbeddingCache
from services.encoder import flags as encoder_flags
from services.encoder.config import EncoderServiceConfig
from services.encoder.model import EncodedItem, EncoderModel, PreparedItem


def _serialize(response: pb.EncodeResponse | bytes) -> bytes:
    return response if isinstance(response, bytes) else response.SerializeToString()


def add_encoder_service(servicer, server) -> None:
    """The generated registration, except that Encode may return its wire bytes already made
    (the sender splices the embeddings' bytes in with one copy instead of protobuf's two)."""
    handlers = {
        "Encode": grpc.unary_unary_rpc_method_handler(
            servicer.Encode, request_deserializer=pb.EncodeRequest.FromString, response_serializer=_serialize),
        "Info": grpc.unary_unary_rpc_method_handler(
            servicer.Info, request_deserializer=pb.InfoRequest.FromString,
            response_serializer=pb.ServiceInfo.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(pb.ENCODER_SERVICE, handlers),))
    server.add_registered_method_handlers(pb.ENCODER_SERVICE, handlers)


class EncoderService(Service):
    grpc_service = pb.ENCODER_SERVICE
    max_message_mb = encoder_flags.MAX_MESSAGE_MB

    def __init__(self, args: argparse.Namespace, metrics):
        super().__init__(args, metrics)
        # The one place an encoder reads its flags: everything below takes this value.
        self.config = config = EncoderServiceConfig.from_args(args, self.model_options(args))
        set_switch_interval(config.switch_interval_s)
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.model: EncoderModel | None = None
        self.cache: EmbeddingCache | None = None
        self.batcher: Batcher | None = None
        # (begun, ready) CUDA events of the batches queued on the device
        self._inflight: collections.deque = collections.deque()
        self._last_batch_end: float | None = None  # when the worker last finished with a batch
        self._begun_free: list = []  # timed CUDA events of batches already timed, to record again (worker only)
        self._on_cuda = torch.device(self.device).type == "cuda"
        self._pool = ThreadPoolExecutor(max_workers=config.preprocess_threads, thread_name_prefix=f"{self.name}-prep")
        self.shm = (ShmExporter(ttl_s=config.shared_memory_ttl_s, max_bytes=config.shared_memory_bytes)
                    if config.shared_memory and shm_available() else None)
        # Its own threads, for answers too large to copy on the event loop (EmbeddingSender.respond).
        self._send_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix=f"{self.name}-send")
        # Same-host callers on CUDA too may read answers straight from this GPU (CUDA IPC, on top of shm).
        self.sender = EmbeddingSender(shm=self.shm, executor=self._send_pool, metrics=metrics,
                                      cuda_ipc=self._on_cuda)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        encoder_flags.add_arguments(parser)

    # -- hooks for the vision / audio subclass ---------------------------------------------
    @classmethod
    def model_options(cls, args: argparse.Namespace) -> dict:
        """The tower's own settings, from its own flags (they become `config.model_options`)."""
        return {}

    def build_model(self) -> EncoderModel:
        """Build and load the model from self.model_dir with self.config (runs in a thread)."""
        raise NotImplementedError

    # -- life cycle -------------------------------------------------------------------------
    def register(self, server) -> None:
        server.add_service(pb.ENCODER_SERVICE, add_encoder_service, ForwardingServicer(self, Encode=self.encode))

    async def load(self) -> None:
        await super().load()
        if self.model_dir is None:
            return
        self.model = await asyncio.to_thread(self.build_model)
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        config = self.config
        self.cache = EmbeddingCache(config.cache_bytes, bytes_per_row=self.model.output_hidden_size * itemsize,
                                    metrics=self.metrics)
        self.batcher = Batcher(self._encode_batch, max_batch_tokens=config.max_batch_tokens,
                               max_batch_items=config.max_batch_items, window_s=config.batch_window_s,
                               max_queue=config.max_queue, metrics=self.metrics)
        self.batcher.start()

    async def close(self) -> None:
        if self.batcher is not None:
            await self.batcher.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._send_pool.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(self.sender.close)  # waits for its waiter thread: not on the loop
        if self.shm is not None:
            self.shm.close()

    def info(self) -> pb.ServiceInfo:
        info = super().info()
        if self.model is not None:
            info.architecture = self.model.architecture
            info.hidden_size = self.model.hidden_size
            info.output_hidden_size = self.model.output_hidden_size
        if self.cache is not None:
            info.pools.append(self.cache.info(str(self.dtype).removeprefix("torch.")))
        return info

    # -- Encode -----------------------------------------------------------------------------
    def _encode_batch(self, batch: list[PreparedItem], abandoned) -> list[Answer | Exception]:
        """Worker thread: one model call, then the answers, left where the model made them (on its device):
        the transport copies each one once, by the path its caller takes (modalmesh.rpc.transfer).
        One forward has no point to stop at: `abandoned` is not consulted. The batch's phases are timed
        (`encoder_batch_seconds`): where a service under load loses its GPU's time shows there."""
        started = time.perf_counter()
        phases = self.metrics.encoder_batch_seconds
        if self._last_batch_end is not None:
            phases.labels(phase="idle").observe(started - self._last_batch_end)
        begun = None
        if self._on_cuda:
            # Reused once their batch has been timed: py-spy showed the worker blocked about 2.6 ms a batch
            # recording a new one on the H200 host, where the rest of a 14-image launch took about 17.
            begun = self._begun_free.pop() if self._begun_free else torch.cuda.Event(enable_timing=True)
            begun.record(torch.cuda.current_stream(self.device))
        try:
            answers = self._run_batch(batch)
            launched = time.perf_counter()
            phases.labels(phase="launch").observe(launched - started)
            ready = next((a.ready for a in answers if isinstance(a, Answer) and a.ready is not None), None)
            if ready is not None:
                self._bound_inflight(begun, ready)
                phases.labels(phase="wait").observe(time.perf_counter() - launched)
            return answers
        finally:
            self._last_batch_end = time.perf_counter()

    def _run_batch(self, batch: list[PreparedItem]) -> list[Answer | Exception]:
        with torch.inference_mode():
            results: list[EncodedItem] = self.model.encode(batch)
            answers: list[Answer | Exception] = []
            for r in results:
                if r.error is not None:  # that item's caller alone gets it (BatchQueue)
                    answers.append(r.error)
                    continue
                tensor = r.embedding.detach()
                if not tensor.is_contiguous() or tensor.untyped_storage().nbytes() != nbytes(tensor):
                    # A view into the batch's output: its own copy (on the device), so the cache holds and
                    # counts exactly its bytes, not the whole batch's.
                    tensor = tensor.clone(memory_format=torch.contiguous_format)
                meta = pb.Embedding(embedding=describe(tensor), grid_thw=list(r.grid_thw),
                                    num_placeholder_tokens=int(tensor.shape[0]), valid_length=int(r.valid_length),
                                    second_per_grid_t=float(r.second_per_grid_t))
                answers.append(Answer(meta, tensor))
            devices = {a.tensor.device for a in answers if isinstance(a, Answer) and a.tensor.device.type == "cuda"}
            if devices:
                ready = torch.cuda.Event(enable_timing=True)  # timed: the batch's span on the device
                # On the stream the batch ran on, after it: transfer copies wait for this alone.
                ready.record(torch.cuda.current_stream(next(iter(devices))))
                answers = [dataclasses.replace(a, ready=ready) if isinstance(a, Answer) else a for a in answers]
        return answers

    def _bound_inflight(self, begun: torch.cuda.Event | None, ready: torch.cuda.Event) -> None:
        """Pipelining with a bound: the worker hands a batch's answers over as soon as its work is queued, so
        the next batch is prepared and uploaded while the GPU runs this one; but it waits for the batch
        before last, so at most `config.batches_in_flight` batches are queued on the device. Without the bound
        a worker that never waits launches every few arriving items as a batch of its own: many small
        batches where the queue would have made a few full ones. A batch waited for has its device span
        observed (`begun` to `ready`)."""
        self._inflight.append((begun, ready))
        while len(self._inflight) > self.config.batches_in_flight:
            begun, ready = self._inflight.popleft()
            ready.synchronize()
            if begun is not None:
                seconds = begun.elapsed_time(ready) / 1e3
                self.metrics.encoder_batch_seconds.labels(phase="device").observe(seconds)
                self._begun_free.append(begun)  # done with: the next batch records it again

    async def encode(self, request: pb.EncodeRequest) -> pb.EncodeResponse | bytes:
        """The answer, or its wire bytes when embeddings travel in it (see `add_encoder_service`)."""
        if self.model is None:
            raise self.not_ready(self.name)
        n = len(request.items)
        if n == 0:
            raise InvalidArgument("items: the request has no items")
        if n > self.config.max_items_per_request:
            raise InvalidArgument(f"items: {n} items exceed --max-items-per-request {self.config.max_items_per_request}")
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        started_ns = tracing.now_ns()  # wall clock, for the stages' spans (no-ops while tracing is off)
        keys = await asyncio.gather(
            *(loop.run_in_executor(self._pool, self.model.cache_key, item, i) for i, item in enumerate(request.items))
        )
        out: list[Answer | None] = [None] * n
        first: dict[bytes, int] = {}  # key -> first index: repeats of known content are prepared once
        repeats: dict[int, int] = {}
        for i, key in enumerate(keys):
            if key is None:
                continue
            if key in first:
                repeats[i] = first[key]
                continue
            first[key] = i
            out[i] = self.cache.get(key)  # a hit skips decoding and preprocessing
        todo = [i for i in range(n) if out[i] is None and i not in repeats]
        prepared = await asyncio.gather(
            *(loop.run_in_executor(self._pool, self.model.prepare, request.items[i], i, keys[i]) for i in todo)
        )
        misses: dict[bytes, list[int]] = {}
        by_key: dict[bytes, PreparedItem] = {}
        for i, p in zip(todo, prepared):
            if p.cache_key in misses:  # the same content twice in one request: encode once
                misses[p.cache_key].append(i)
                continue
            hit = self.cache.get(p.cache_key) if keys[i] is None else None
            if hit is not None:
                out[i] = hit
            else:
                misses[p.cache_key] = [i]
                by_key[p.cache_key] = p
        stages = {"prepare": time.perf_counter() - started}
        mark_ns = tracing.now_ns()
        tracing.timed_span("encoder.prepare", started_ns, mark_ns, {"modalmesh.items": n, "modalmesh.prepared": len(todo)})
        if misses:
            mark = time.perf_counter()
            encoded = await self.batcher.submit([by_key[key] for key in misses])
            stages["batch"] = time.perf_counter() - mark
            # Queued in the batcher and run in a batch, maybe with other requests' items.
            tracing.timed_span("encoder.forward", mark_ns, tracing.now_ns(), {"modalmesh.items": len(misses)})
            for (key, indices), answer in zip(misses.items(), encoded):
                self.cache.put(key, answer)
                for i in indices:
                    out[i] = answer
        for i, j in repeats.items():
            out[i] = out[j]
        response = pb.EncodeResponse(model_id=self.model_id, weights_fingerprint=self.weights_fingerprint,
                                     modality=self.modality)
        modality = pb.Modality.Name(self.modality).lower()
        self.metrics.encoded_items_total.labels(modality=modality).inc(n)
        outgoing = self.sender.plan(out, request.transfer if request.HasField("transfer") else None)
        mark = time.perf_counter()
        transfer_ns = tracing.now_ns()
        # Answers that go by CUDA IPC do not wait for their batch here: the reader's copy waits on the GPU.
        if await self.sender.ready(outgoing.waiting) or (misses and outgoing.waiting):
            stages["device"] = time.perf_counter() - mark  # a hit may be an answer of a batch still running, too
        mark = time.perf_counter()
        answer = await self.sender.send(response, outgoing)
        stages["respond"] = time.perf_counter() - mark
        tracing.timed_span("encoder.transfer", transfer_ns, tracing.now_ns())
        for stage, seconds in stages.items():
            self.metrics.encode_stage_seconds.labels(stage=stage).observe(seconds)
        return answer
