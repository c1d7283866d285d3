"""LLMService: the LLM's gRPC edge, a thin servicer in front of its engine process.

The edge (this process) serves gRPC: Generate streams, Info, health, the drain, TLS and the token. The
engine process (core.py) holds the model, the engine and the encoders' clients; it validates each
request and sends each step's deltas for every call in one frame over the link (link.py), which the
edge turns into each stream's messages. A cancelled call (client gone, deadline passed) is ended in the
engine too, which frees its KV pages.
"""

from __future__ import annotations

import argparse
import logging
import time

from modalmesh import pb
from modalmesh import tracing
from modalmesh.service import Service
from modalmesh.rpc.servicer import ForwardingServicer
from services.llm.config import LLMConfig
from services.llm.core import EngineSettings
from services.llm.engine_client import EngineClient
from services.llm.link import CallFailed, raise_error
from services.llm import flags as llm_flags

_FINISH = {"stop": pb.STOP, "length": pb.LENGTH, "abort": pb.ABORT}
log = logging.getLogger("modalmesh.llm")


class LLMService(Service):
    name = llm_flags.NAME
    grpc_service = pb.LLM_SERVICE
    description = llm_flags.DESCRIPTION
    max_message_mb = llm_flags.MAX_MESSAGE_MB

    def __init__(self, args: argparse.Namespace, metrics):
        super().__init__(args, metrics)
        # The one place the LLM reads its flags: everything below (the engine process, every rank) takes this value.
        self.config = (LLMConfig.from_args(args, self.model_dir, device=self.device, dtype=self.dtype,
                                           security=self.security)
                       if self.model_dir is not None else None)
        self._tracing = tracing.TracingConfig.from_args(args, service=self.name)
        self.client: EngineClient | None = None

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        llm_flags.add_arguments(parser)

    def register(self, server) -> None:
        server.add_service(self.grpc_service, pb.llm_pb2_grpc.add_LLMServiceServicer_to_server,
                           ForwardingServicer(self, Generate=self.generate))

    async def load(self) -> None:
        await super().load()
        if self.config is None:
            return
        client = self.client = EngineClient(self.config, EngineSettings(
            model_id=self.model_id, weights_fingerprint=self.weights_fingerprint, metrics=self.metrics.options,
            tracing=self._tracing))
        await client.start()
        # A scrape of this service shows the engine process's registry folded into the edge's.
        self.metrics.fold_in(lambda: client.query_blocking("metrics"))

    async def close(self) -> None:
        if self.client is not None:
            await self.client.stop()

    async def info(self) -> pb.ServiceInfo:
        info = super().info()
        if self.client is not None and self.client.ready:
            del info.attention[:]  # the engine's ranks' own selections, not this process's
            info.MergeFrom(pb.ServiceInfo.FromString(await self.client.query("info")))
        return info

    async def generate(self, request: pb.GenerateRequest, timeout: float | None = None):
        """Generate: the request's deltas as they come; `timeout` is what the caller's deadline leaves."""
        client = self.client
        if client is None or not client.ready:
            raise self.not_ready("this LLM service")
        open_at = (time.time_ns(), time.perf_counter())
        # Choices still running. An n the engine refuses (0 is 1; negative, too many) gets its CallFailed first: the
        # call waits for at least one item whatever n says.
        remaining = max(request.sampling.n, 1)
        call = client.open_call(request, timeout, tracing.outgoing_metadata())
        first_token_ns = None
        try:
            while remaining > 0:
                items = [await call.queue.get()]
                while not call.queue.empty():  # behind the engine: what has piled up, as one message per choice
                    items.append(call.queue.get_nowait())
                for item in items:  # refused while its first choices were already running (n > 1)
                    if isinstance(item, CallFailed):
                        raise_error(item.error)
                if first_token_ns is None:
                    first_token_ns = tracing.now_ns()
                    _queue_and_prefill_spans(open_at, items[0][6], first_token_ns)
                by_choice: dict[int, list] = {}
                for row in items:
                    by_choice.setdefault(row[1], []).append(row)
                for index, rows in by_choice.items():
                    response, finished = _response(index, rows)
                    remaining -= finished
                    yield response
        finally:
            if first_token_ns is not None:
                tracing.timed_span("llm.decode", first_token_ns, tracing.now_ns(),
                                   {"modalmesh.finished": remaining <= 0})
            client.end_call(call, complete=remaining <= 0)


def _queue_and_prefill_spans(open_at: tuple[int, float], extra: dict | None, first_token_ns: int) -> None:
    """llm.queue (added to the engine -> first in a step) and llm.prefill (-> first token). The engine marks
    both with time.perf_counter (one clock for the service's processes); spans take wall-clock ns, so the
    marks are placed relative to the call's opening."""
    open_ns, open_perf = open_at
    extra = extra or {}
    arrival = extra.get("arrival")
    added_ns = open_ns if arrival is None else max(open_ns, open_ns + int((arrival - open_perf) * 1e9))
    if extra.get("scheduled_at") is None:  # ended before any step: queued until then, no prefill
        scheduled_ns = first_token_ns
    else:
        scheduled_ns = min(first_token_ns, max(added_ns, open_ns + int((extra["scheduled_at"] - open_perf) * 1e9)))
    tracing.timed_span("llm.queue", added_ns, scheduled_ns)
    tracing.timed_span("llm.prefill", scheduled_ns, first_token_ns)


def _response(index: int, rows: list) -> tuple[pb.GenerateResponse, bool]:
    """One message of a choice from its piled-up rows (link.DeltaRow); whether the choice has finished.
    An error row raises it, with its status."""
    _, _, token_ids, text, logprobs, finish, extra = rows[0]
    if len(rows) == 1 and extra is None:  # the common case: one step's token
        response = pb.GenerateResponse(token_ids=token_ids, text=text, logprobs=logprobs, index=index)
    else:
        response = pb.GenerateResponse(index=index)
        texts = []
        for _, _, token_ids, text, logprobs, finish, extra in rows:
            response.token_ids.extend(token_ids)
            texts.append(text)
            response.logprobs.extend(logprobs)
            if extra:
                if "error" in extra:
                    raise_error(extra["error"])
                response.tokens.extend(extra.get("tokens", ()))
                for ids, values, tokens in extra.get("top", ()):
                    response.top_logprobs.append(pb.TopLogprobs(token_ids=ids, logprobs=values, tokens=tokens))
                if "prompt" in extra:
                    ids, texts_, values, ranks, top = extra["prompt"]
                    response.prompt_logprobs.CopyFrom(pb.PromptLogprobs(
                        token_ids=ids, tokens=texts_, logprobs=values, ranks=ranks,
                        top=[pb.TopLogprobs(token_ids=i, logprobs=v, tokens=t) for i, v, t in top]))
            if finish is not None:
                break  # nothing follows the last delta of a request
        response.text = "".join(texts)
    if finish is None:
        return response, False
    reason, prompt_tokens, completion_tokens, cached_tokens = finish
    response.finish_reason = _FINISH[reason]
    response.usage.prompt_tokens = prompt_tokens
    response.usage.completion_tokens = completion_tokens
    response.usage.cached_tokens = cached_tokens
    return response, True
