"""One Prometheus schema for every service: prefix ``modalmesh_``, label ``service``.

The schema is data (``SCHEMA``) and is documented in docs/metrics.md (a test
keeps the two in step). Services fill the values; the names do not change.

    metrics = Metrics("llm")
    metrics.queue_depth.set(3)
    metrics.requests_total.labels(rpc="Generate", code="OK").inc()
    port = metrics.start_exporter("0.0.0.0", 9400)
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)

log = logging.getLogger(__name__)

PREFIX = "modalmesh_"

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_LATENCY = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1)
_GC_PAUSE = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)
# A whole request, arrival to last token: long generations run for minutes to hours, which _LATENCY's
# 120 s top would put in +Inf.
_REQUEST_LATENCY = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400)
_REQUEST_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000,
                   500000, 1000000)


@dataclass(frozen=True)
class MetricSpec:
    name: str  # exposed name, with the prefix (and _total for counters)
    kind: str  # "counter" | "gauge" | "histogram"
    doc: str
    labels: tuple[str, ...] = ()  # besides "service", which every metric carries
    buckets: tuple[float, ...] | None = None


SCHEMA: tuple[MetricSpec, ...] = (
    # Service identity and readiness.
    MetricSpec("modalmesh_service_info", "gauge", "Always 1; labels describe the served model.",
               ("model_id", "version", "dtype", "device")),
    MetricSpec("modalmesh_ready", "gauge", "1 while health is SERVING, else 0."),
    # RPCs.
    MetricSpec("modalmesh_requests_total", "counter",
               "RPCs finished, by method and gRPC status code (the gateway's, deprecated: HTTP route and status; "
               "use modalmesh_http_requests_total).",
               ("rpc", "code")),
    MetricSpec("modalmesh_request_duration_seconds", "histogram",
               "RPC wall time, by method and status code (the gateway's, deprecated: use "
               "modalmesh_http_request_duration_seconds).",
               ("rpc", "code"), _LATENCY),
    MetricSpec("modalmesh_requests_in_flight", "gauge", "RPCs being handled now.", ("rpc",)),
    MetricSpec("modalmesh_queue_depth", "gauge", "Work items waiting to be scheduled."),
    MetricSpec("modalmesh_batch_size", "histogram", "Items (sequences, images, clips, latents) per executed batch.",
               (), _BATCH),
    MetricSpec("modalmesh_batch_tokens", "histogram", "Tokens (or patches / frames) per executed batch.",
               (), _BATCH),
    # LLM tokens and latency.
    MetricSpec("modalmesh_prompt_tokens_total", "counter", "Prompt tokens prefilled."),
    MetricSpec("modalmesh_generation_tokens_total", "counter", "Tokens generated."),
    MetricSpec("modalmesh_time_to_first_token_seconds", "histogram",
               "LLM engine: request arrival at the engine to first output token.", (), _LATENCY),
    MetricSpec("modalmesh_time_per_output_token_seconds", "histogram",
               "LLM engine: per request, (last token - first token) / (output tokens - 1), observed once when it "
               "finishes with 2 or more tokens.", (), _TOKEN_LATENCY),
    MetricSpec("modalmesh_gc_pause_seconds", "histogram",
               "Python garbage-collector pauses of this process (the GIL is held throughout), by generation.",
               ("generation",), _GC_PAUSE),
    MetricSpec("modalmesh_inter_token_latency_seconds", "histogram",
               "LLM engine: gap between consecutive output tokens of a request, one observation per token.",
               (), _TOKEN_LATENCY),
    # The gateway's HTTP side, as a client sees it.
    MetricSpec("modalmesh_http_requests_total", "counter", "Gateway: HTTP requests finished, by route and HTTP "
               "status (499: the client went away).", ("route", "status")),
    MetricSpec("modalmesh_http_request_duration_seconds", "histogram",
               "Gateway: HTTP request wall time, to the last byte of a stream, by route and HTTP status.",
               ("route", "status"), _REQUEST_LATENCY),
    MetricSpec("modalmesh_gateway_time_to_first_token_seconds", "histogram",
               "Gateway: HTTP request arrival to the first output token received from the LLM.", (), _LATENCY),
    MetricSpec("modalmesh_gateway_inter_token_latency_seconds", "histogram",
               "Gateway: gap between output tokens received from the LLM (a message's gap spread over its tokens).",
               (), _TOKEN_LATENCY),
    # LLM requests (vLLM's request metrics under modalmesh_ names), observed by the engine when a request
    # finishes, whatever the reason; labelled with the served model (--model-id).
    MetricSpec("modalmesh_num_requests_running", "gauge",
               "Requests in the running batch now (the waiting ones are modalmesh_queue_depth).", ("model_name",)),
    MetricSpec("modalmesh_requests_finished_total", "counter",
               "Requests the engine finished, by reason: stop (EOS, stop token or string), length (max_tokens or "
               "the model's limit), abort (client gone, deadline, shutdown), error (the engine step failed).",
               ("model_name", "finished_reason")),
    MetricSpec("modalmesh_engine_steps_total", "counter",
               "LLM engine: steps launched, by path: decode_graph (a decode step replayed from its batch bucket's CUDA "
               "graph), mixed_graph (a step with prompt tokens replayed from its token bucket's graph), eager.",
               ("path",)),
    MetricSpec("modalmesh_engine_step_phase_seconds_total", "counter",
               "LLM engine: the worker thread's seconds by step phase: schedule, model (the step's inputs, "
               "launching its forward and sampling, and waiting for its tokens), post (stop checks, "
               "detokenising, emitting: this runs while the device computes the next step).", ("phase",)),
    MetricSpec("modalmesh_num_preemptions_total", "counter",
               "Running requests preempted for KV pages (their pages freed, recomputed later).", ("model_name",)),
    MetricSpec("modalmesh_prefix_cache_queries_total", "counter",
               "Prompt tokens of the requests scheduled for the first time, looked up in the prefix cache.",
               ("model_name",)),
    MetricSpec("modalmesh_prefix_cache_hits_total", "counter",
               "Of those prompt tokens, the ones found in the prefix cache (their K/V not computed again).",
               ("model_name",)),
    MetricSpec("modalmesh_request_queue_time_seconds", "histogram",
               "Arrival at the engine to first scheduled.", ("model_name",), _REQUEST_LATENCY),
    MetricSpec("modalmesh_request_prefill_time_seconds", "histogram",
               "First scheduled to first output token.", ("model_name",), _REQUEST_LATENCY),
    MetricSpec("modalmesh_request_decode_time_seconds", "histogram",
               "First output token to the last.", ("model_name",), _REQUEST_LATENCY),
    MetricSpec("modalmesh_e2e_request_latency_seconds", "histogram",
               "Arrival at the engine to finished.", ("model_name",), _REQUEST_LATENCY),
    MetricSpec("modalmesh_request_prompt_tokens", "histogram", "Prompt tokens per finished request.",
               ("model_name",), _REQUEST_TOKENS),
    MetricSpec("modalmesh_request_generation_tokens", "histogram", "Output tokens per finished request.",
               ("model_name",), _REQUEST_TOKENS),
    MetricSpec("modalmesh_request_params_max_tokens", "histogram",
               "max_tokens per finished request (the model's remaining length when the request left it 0).",
               ("model_name",), _REQUEST_TOKENS),
    # Encoders and VAE.
    MetricSpec("modalmesh_encoded_items_total", "counter", "Items encoded (images, audio clips).", ("modality",)),
    MetricSpec("modalmesh_encode_stage_seconds", "histogram",
               "Time an Encode call spends in each stage: prepare (cache keys, decoding, preprocessing), batch "
               "(waiting for a batch and launching it), device (the batch's work on the GPU), respond (the "
               "answers out: shared or copied, serialized).", ("stage",), _LATENCY),
    MetricSpec("modalmesh_encoder_batch_seconds", "histogram",
               "An encoder's batches, by phase: launch (the worker queuing the batch's work: decoding, uploads, "
               "the forward's launches), wait (the worker waiting for the batch before last to finish on the GPU), "
               "idle (the worker between two batches), device (the stream's span from reaching the batch to "
               "finishing it, CUDA events; observed once the batch has finished).", ("phase",), _LATENCY),
    MetricSpec("modalmesh_encode_call_seconds", "histogram",
               "LLM: one item's Encode call to its encoder pool, by stage: rpc (the call, the encoder's own stages "
               "included: the rest is transport and both event loops), take (its embedding read onto the LLM's "
               "device), by the pool's modality.", ("modality", "stage"), _LATENCY),
    MetricSpec("modalmesh_generate_setup_seconds", "histogram",
               "LLM: a Generate call's time before its choices reach the engine (where "
               "modalmesh_time_to_first_token_seconds starts), by stage: link (the edge handing the call to the "
               "engine process), validate (sampling parameters, tokenising, limits), prefix (item digests and "
               "the prefix cache's hold), encode (the items' Encode calls and reads, or a client's embeddings "
               "decoded, and their finiteness checked), admit (the structured-output grammar, splicing the "
               "embeddings in and adding the choices to the engine).", ("stage",), _LATENCY),
    MetricSpec("modalmesh_decoded_images_total", "counter", "Images decoded by the VAE."),
    MetricSpec("modalmesh_decoded_pixels_total", "counter", "Pixels decoded by the VAE."),
    MetricSpec("modalmesh_vae_tiles_total", "counter", "Tiles decoded by tiled VAE decoding."),
    # Embedding transfer between services.
    MetricSpec("modalmesh_transfer_bytes_total", "counter",
               "Embedding bytes sent or received, by path: grpc (message bytes), shared_memory or cuda_ipc (same host).",
               ("direction", "path")),
    MetricSpec("modalmesh_transfer_seconds", "histogram", "Time to move one tensor payload.",
               ("direction",), _LATENCY),
    # Weights.
    MetricSpec("modalmesh_weight_load_seconds", "gauge", "Seconds spent loading weights."),
    MetricSpec("modalmesh_weight_load_bytes", "gauge", "Bytes of weights loaded."),
    MetricSpec("modalmesh_weight_load_bytes_per_second", "gauge", "Weight loading throughput."),
    # Attention backends.
    MetricSpec("modalmesh_attention_backend_info", "gauge",
               "Always 1; the attention backend chosen per component and why.",
               ("component", "backend", "reason")),
    MetricSpec("modalmesh_attention_fallback_total", "counter",
               "Calls rerouted from the selected backend to another one.",
               ("component", "from", "to", "reason")),
    # Token / embedding pools: the LLM's KV pool ("kv"), encoders' embedding cache.
    MetricSpec("modalmesh_kv_pool_capacity_tokens", "gauge",
               "Tokens (or cached rows; bytes for vae_workspace) the pool can hold.", ("pool",)),
    MetricSpec("modalmesh_kv_pool_used_tokens", "gauge", "Tokens (or cached rows; bytes for vae_workspace) held now.",
               ("pool",)),
    MetricSpec("modalmesh_kv_pool_usage_ratio", "gauge", "used / capacity.", ("pool",)),
    MetricSpec("modalmesh_kv_pool_bytes", "gauge", "Bytes reserved by the pool.", ("pool",)),
    MetricSpec("modalmesh_kv_pool_page_size", "gauge", "Tokens per page (0 when not paged).", ("pool",)),
    MetricSpec("modalmesh_kv_pool_info", "gauge", "Always 1; labels describe the pool layout.",
               ("pool", "dtype", "layers", "kv_heads", "head_dim", "v_head_dim")),
    MetricSpec("modalmesh_cache_hits_total", "counter", "Pool lookups that hit.", ("pool",)),
    MetricSpec("modalmesh_cache_misses_total", "counter", "Pool lookups that missed.", ("pool",)),
)

SCHEMA_BY_NAME = {spec.name: spec for spec in SCHEMA}
# The histograms --metrics-buckets overrides: whole requests, whose range depends on the workload
# (seconds for a chat turn, hours for a long generation).
REQUEST_LATENCY_METRICS = frozenset(spec.name for spec in SCHEMA if spec.buckets == _REQUEST_LATENCY)


@dataclass(frozen=True)
class MetricsOptions:
    """How a process's metrics are built, from its flags (run_process) down to `Metrics`."""

    request_latency_buckets: tuple[float, ...] = _REQUEST_LATENCY  # REQUEST_LATENCY_METRICS' upper bounds

    @classmethod
    def from_flags(cls, buckets: str | None, flag: str = "--metrics-buckets") -> MetricsOptions:
        if buckets is None or not buckets.strip():
            return cls()
        return cls(request_latency_buckets=parse_buckets(buckets, flag))


def parse_buckets(text: str, flag: str) -> tuple[float, ...]:
    """``"0.5,1,5,60"`` as histogram upper bounds: positive, finite, strictly increasing (+Inf is implied)."""
    from modalmesh.errors import ConfigError  # grpc: only when a flag is parsed

    try:
        bounds = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected comma-separated seconds, e.g. 1,10,60,600,3600") from None
    if not all(0 < b < float("inf") for b in bounds):
        raise ConfigError(f"{flag} {text!r}: bucket bounds must be positive and finite (+Inf is always added)")
    if any(b >= c for b, c in zip(bounds, bounds[1:])):
        raise ConfigError(f"{flag} {text!r}: bucket bounds must be strictly increasing")
    return bounds


class BoundMetric:
    """A metric with its ``service`` label filled in."""

    def __init__(self, metric, service: str, labelnames: tuple[str, ...]):
        self.metric = metric
        self.service = service
        self.labelnames = labelnames
        # Children looked up once per label values: hot paths observe per token and per call, and
        # prometheus_client's labels() takes a lock and rebuilds its key every time (4.6 % of an
        # encoder's event loop under load, py-spy, issue 18).
        self._children: dict[tuple, object] = {}

    def labels(self, **labels):
        key = tuple(labels.items())
        child = self._children.get(key)
        if child is None:
            child = self.metric.labels(service=self.service, **{k: str(v) for k, v in labels.items()})
            self._children[key] = child
        return child

    def remove(self, **labels) -> None:
        values = [self.service] + [str(labels[name]) for name in self.labelnames]
        wanted = {name: str(labels[name]) for name in self.labelnames}
        for key in [k for k in list(self._children) if {n: str(v) for n, v in k} == wanted]:
            del self._children[key]
        try:
            self.metric.remove(*values)
        except KeyError:
            pass

    def clear(self) -> None:
        """Every label set of the metric gone (the cached children too: set again, they would be orphans)."""
        self._children.clear()
        self.metric.clear()

    # Shorthands for metrics whose only label is "service".
    def inc(self, amount: float = 1) -> None:
        self.labels().inc(amount)

    def dec(self, amount: float = 1) -> None:
        self.labels().dec(amount)

    def set(self, value: float) -> None:
        self.labels().set(value)

    def observe(self, value: float) -> None:
        self.labels().observe(value)

    def observe_many(self, value: float, count: int) -> None:
        """What `count` calls of `observe(value)` record, for two locked adds instead of 2 × `count`: the
        LLM's tokens of one engine step share their inter-token gap, and a step at batch 256 observed it 256
        times. prometheus_client has no such call, so this adds into the histogram's own values
        (`_upper_bounds`, `_buckets`, `_sum`; tests/test_metrics.py checks it against `observe`)."""
        child = self.labels()
        child._sum.inc(value * count)
        child._buckets[bisect_left(child._upper_bounds, value)].inc(count)  # observe's bucket: the first bound >= value


def _build(spec: MetricSpec, registry: CollectorRegistry, options: MetricsOptions):
    labelnames = ("service", *spec.labels)
    if spec.kind == "counter":
        return Counter(spec.name.removesuffix("_total"), spec.doc, labelnames, registry=registry)
    if spec.kind == "gauge":
        return Gauge(spec.name, spec.doc, labelnames, registry=registry)
    if spec.kind == "histogram":
        buckets = options.request_latency_buckets if spec.name in REQUEST_LATENCY_METRICS else spec.buckets
        return Histogram(spec.name, spec.doc, labelnames, buckets=buckets, registry=registry)
    raise ValueError(f"unknown metric kind {spec.kind!r}")


class Metrics:
    """The schema's metrics for one service on one registry."""

    def __init__(self, service: str, registry: CollectorRegistry | None = None, *, process_metrics: bool = True,
                 options: MetricsOptions = MetricsOptions()):
        self.service = service
        self.options = options
        self.registry = registry if registry is not None else CollectorRegistry()
        if process_metrics and registry is None:
            ProcessCollector(registry=self.registry)
            PlatformCollector(registry=self.registry)
        self._bound = {
            spec.name.removeprefix(PREFIX): BoundMetric(_build(spec, self.registry, options), service,
                                                             spec.labels)
            for spec in SCHEMA
        }
        # Service-only metrics exist from the start, so a scrape shows 0, not nothing.
        for spec in SCHEMA:
            if not spec.labels:
                self._bound[spec.name.removeprefix(PREFIX)].labels()
        self._attention: dict[str, tuple[str, str]] = {}
        self._servers: list = []

    def __getattr__(self, short_name: str) -> BoundMetric:
        try:
            return self.__dict__["_bound"][short_name]
        except KeyError:
            raise AttributeError(f"no metric {PREFIX}{short_name} in the schema") from None

    # Helpers for the info-style gauges, which must drop stale label sets.
    def set_service_info(self, *, model_id: str, version: str, dtype: str, device: str) -> None:
        self.service_info.clear()
        self.service_info.labels(model_id=model_id, version=version, dtype=dtype, device=device).set(1)

    def set_attention_backend(self, component: str, backend: str, reason: str) -> None:
        old = self._attention.get(component)
        if old is not None:
            self.attention_backend_info.remove(component=component, backend=old[0], reason=old[1])
        self._attention[component] = (backend, reason)
        self.attention_backend_info.labels(component=component, backend=backend, reason=reason).set(1)

    def set_pool(self, pool: str, *, capacity_tokens: int, used_tokens: int, nbytes: int, page_size: int) -> None:
        self.kv_pool_capacity_tokens.labels(pool=pool).set(capacity_tokens)
        self.kv_pool_used_tokens.labels(pool=pool).set(used_tokens)
        self.kv_pool_usage_ratio.labels(pool=pool).set(used_tokens / capacity_tokens if capacity_tokens else 0.0)
        self.kv_pool_bytes.labels(pool=pool).set(nbytes)
        self.kv_pool_page_size.labels(pool=pool).set(page_size)

    def fold_in(self, fetch: Callable[[], list]) -> None:
        """Show another process's registry (same schema) in this one's scrapes: `fetch` returns its metric families
        as `plain_families` made them there (not exposition text, whose parser would split each `_created`
        sample into a family of its own), called at each scrape from the exporter's thread (the LLM's edge asks
        its engine process)."""
        self._folded = fetch

    def collect(self):
        """What a scrape shows: this registry, with the folded-in process's families merged (`merge_families`)."""
        fetch = self.__dict__.get("_folded")
        if fetch is None:
            return self.registry.collect()
        try:
            theirs = families_from_plain(fetch())
        except Exception as exc:  # noqa: BLE001 - a scrape while that process stops: this process's alone
            log.debug("metrics of the folded-in process unavailable: %s", exc)
            return self.registry.collect()
        return merge_families(list(self.registry.collect()), theirs)

    def restricted_registry(self, names):
        """A scrape asking for some series only (`?name[]=...`), as prometheus_client's registries answer it."""
        wanted = set(names)
        metrics = self

        class Restricted:
            def collect(self):
                for family in metrics.collect():
                    samples = [s for s in family.samples if s.name in wanted]
                    if samples:
                        family.samples = samples
                        yield family

        return Restricted()

    def start_exporter(self, host: str, port: int) -> int:
        """Serve /metrics over HTTP; returns the bound port (port 0 picks one). A scrape reads `collect`."""
        server, _thread = start_http_server(port, addr=host, registry=self)
        self._servers.append(server)
        bound = server.server_port
        log.info("metrics exporter on http://%s:%d/metrics", host, bound)
        return bound

    def stop_exporter(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()
        self._servers.clear()


# How one service's processes add up: counters, histograms and most gauges sum (tokens, bytes, memory,
# CPU seconds, pauses); info gauges are 1 wherever set; these few are not amounts.
_MERGE_MIN = frozenset({"process_start_time_seconds", "process_max_fds"})


def plain_families(registry: CollectorRegistry) -> list:
    """A registry's metric families as plain lists, for another process (`Metrics.fold_in`, `families_from_plain`)."""
    return [[f.name, f.documentation, f.type, f.unit, [[s.name, s.labels, s.value] for s in f.samples]]
            for f in registry.collect()]


def families_from_plain(plain) -> list:
    from prometheus_client.metrics_core import Metric
    from prometheus_client.samples import Sample

    families = []
    for name, documentation, kind, unit, samples in plain:
        family = Metric(name, documentation, kind, unit)
        family.samples = [Sample(sample, dict(labels), value) for sample, labels, value in samples]
        families.append(family)
    return families


def merge_families(ours: list, theirs: list) -> list:
    """Metric families of two processes of one service as one exposition: samples with the same name and
    labels are added, except info gauges (max), `_created` and the start time / fd limit (min)."""
    from prometheus_client.metrics_core import Metric
    from prometheus_client.samples import Sample

    merged: dict[str, tuple[Metric, dict]] = {}
    for family in [*ours, *theirs]:
        entry = merged.get(family.name)
        if entry is None:
            entry = merged[family.name] = (Metric(family.name, family.documentation, family.type, family.unit), {})
        samples = entry[1]
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            old = samples.get(key)
            if old is None:
                samples[key] = sample
                continue
            if sample.name.endswith("_created") or family.name in _MERGE_MIN:
                value = min(old.value, sample.value)
            elif family.type in ("gauge", "info") and family.name.endswith("_info"):
                value = max(old.value, sample.value)
            else:
                value = old.value + sample.value
            samples[key] = Sample(sample.name, sample.labels, value, old.timestamp, old.exemplar)
    out = []
    for metric, samples in merged.values():
        metric.samples = list(samples.values())
        out.append(metric)
    return out


_current: Metrics | None = None


def install(metrics: Metrics) -> Metrics:
    """Make `metrics` the process's registry, reachable from deep code via current()."""
    global _current
    _current = metrics
    return metrics


def current() -> Metrics:
    """The process's Metrics (a detached one labelled "modalmesh" before install())."""
    global _current
    if _current is None:
        _current = Metrics("modalmesh", process_metrics=False)
    return _current
