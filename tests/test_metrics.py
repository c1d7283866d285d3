"""The metric schema: documented, prefixed, labelled by service, and behaving as gauges/counters should."""

import re

import msgpack
import pytest
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from modalmesh.metrics import SCHEMA, Metrics, plain_families

DOC = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"


def test_docs_table_matches_schema_exactly():
    rows = re.findall(r"^\| `(modalmesh_[a-z0-9_]+)` \| (\w+) \| ([^|]+) \|", DOC.read_text(), re.M)
    documented = {name: (kind, tuple(l.strip() for l in labels.split(","))) for name, kind, labels in rows}
    expected = {s.name: (s.kind, ("service", *s.labels)) for s in SCHEMA}
    assert documented == expected


def test_names_are_prefixed_and_counters_end_in_total():
    for spec in SCHEMA:
        assert spec.name.startswith("modalmesh_")
        assert spec.name.endswith("_total") == (spec.kind == "counter"), spec.name


def test_info_gauges_replace_stale_label_sets():
    m = Metrics("llm", process_metrics=False)
    m.set_attention_backend("llm", "sdpa_math", "auto: cpu")
    m.set_attention_backend("llm", "fa3", "override")
    m.set_attention_backend("vae", "sdpa_math", "component default")
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(m.registry).decode())}
    samples = [(s.labels["component"], s.labels["backend"], s.labels["reason"], s.value)
               for s in families["modalmesh_attention_backend_info"].samples]
    assert sorted(samples) == [("llm", "fa3", "override", 1.0), ("vae", "sdpa_math", "component default", 1.0)]


def test_pool_gauges_and_ratio():
    m = Metrics("llm", process_metrics=False)
    m.set_pool("kv", capacity_tokens=1024, used_tokens=256, nbytes=4096, page_size=16)
    get = m.registry.get_sample_value
    assert get("modalmesh_kv_pool_usage_ratio", {"service": "llm", "pool": "kv"}) == 0.25
    assert get("modalmesh_kv_pool_capacity_tokens", {"service": "llm", "pool": "kv"}) == 1024
    m.set_pool("kv", capacity_tokens=0, used_tokens=0, nbytes=0, page_size=16)
    assert get("modalmesh_kv_pool_usage_ratio", {"service": "llm", "pool": "kv"}) == 0.0


def test_service_only_metrics_start_at_zero():
    m = Metrics("vae", process_metrics=False)
    assert m.registry.get_sample_value("modalmesh_queue_depth", {"service": "vae"}) == 0
    assert m.registry.get_sample_value("modalmesh_generation_tokens_total", {"service": "vae"}) == 0


def test_cached_label_children_survive_remove_and_clear():
    # BoundMetric caches the child per label set; a removed or cleared label set set again must be exported,
    # not written into an orphan child (the cache would hand back the one prometheus dropped).
    m = Metrics("llm", process_metrics=False)
    get = m.registry.get_sample_value
    m.set_attention_backend("llm", "sdpa_math", "auto: cpu")
    m.set_attention_backend("llm", "fa3", "override")
    m.set_attention_backend("llm", "sdpa_math", "auto: cpu")  # back to the first: removed, then set again
    assert get("modalmesh_attention_backend_info",
               {"service": "llm", "component": "llm", "backend": "sdpa_math", "reason": "auto: cpu"}) == 1
    for _ in range(2):  # cleared, then the same label set again
        m.set_service_info(model_id="m", version="1", dtype="float32", device="cpu")
    assert get("modalmesh_service_info", {"service": "llm", "model_id": "m", "version": "1", "dtype": "float32",
                                          "device": "cpu"}) == 1
    stage = m.encode_stage_seconds
    assert stage.labels(stage="prepare") is stage.labels(stage="prepare")  # looked up once


def test_metrics_buckets_override_the_request_latency_histograms_only():
    from modalmesh.metrics import REQUEST_LATENCY_METRICS, MetricsOptions

    assert "modalmesh_e2e_request_latency_seconds" in REQUEST_LATENCY_METRICS
    assert "modalmesh_http_request_duration_seconds" in REQUEST_LATENCY_METRICS
    default = Metrics("llm", process_metrics=False)
    default.e2e_request_latency_seconds.labels(model_name="m").observe(5400)  # 1.5 h: a bucket, not only +Inf
    get = default.registry.get_sample_value
    labels = {"service": "llm", "model_name": "m", "le": "7200.0"}
    assert get("modalmesh_e2e_request_latency_seconds_bucket", labels) == 1
    m = Metrics("llm", process_metrics=False, options=MetricsOptions.from_flags("1, 60,3600"))
    m.e2e_request_latency_seconds.labels(model_name="m").observe(30)
    m.time_to_first_token_seconds.observe(0.01)
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(m.registry).decode())}
    bounds = lambda name: [s.labels["le"] for s in families[name].samples if s.name.endswith("_bucket")]
    assert bounds("modalmesh_e2e_request_latency_seconds") == ["1.0", "60.0", "3600.0", "+Inf"]
    assert "0.001" in bounds("modalmesh_time_to_first_token_seconds")  # token-scale histograms keep theirs
    assert MetricsOptions.from_flags(None) == MetricsOptions() == MetricsOptions.from_flags("")


def test_bad_metrics_buckets_are_a_config_error_naming_the_flag():
    import pytest

    from modalmesh.errors import ConfigError
    from modalmesh.metrics import MetricsOptions

    for value in ("1,1", "10,5", "-1,2", "1,inf", "a,b"):
        with pytest.raises(ConfigError, match="--metrics-buckets"):
            MetricsOptions.from_flags(value)


def _raw(port: int, accept: str = "text/plain") -> str:
    import urllib.request

    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Accept": accept})
    return urllib.request.urlopen(request, timeout=10).read().decode()


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    import urllib.request

    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}


def test_a_scrape_shows_the_folded_in_process_summed_into_this_one():
    """The LLM's edge folds its engine process's registry into its scrapes: amounts add up across the two
    processes, info gauges stay 1, and a process start time is the earliest."""
    edge, engine = Metrics("llm"), Metrics("llm")
    engine.generation_tokens_total.inc(7)
    engine.time_to_first_token_seconds.observe(0.02)
    edge.time_to_first_token_seconds.observe(0.3)
    engine.set_pool("kv", capacity_tokens=4096, used_tokens=16, nbytes=1 << 20, page_size=16)
    edge.ready.set(1)
    for m in (edge, engine):
        m.set_service_info(model_id="m", version="1", dtype="float32", device="cpu")
        m.gc_pause_seconds.labels(generation=2).observe(0.004)
    # As the LLM's link carries them: plain values through msgpack.
    edge.fold_in(lambda: msgpack.unpackb(msgpack.packb(plain_families(engine.registry)), use_list=False))
    port = edge.start_exporter("127.0.0.1", 0)
    try:
        got = _scrape(port)
        text, open_metrics = _raw(port), _raw(port, "application/openmetrics-text; version=1.0.0")
        mine = {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in edge.registry.collect() for s in family.samples}
        theirs = {(s.name, tuple(sorted(s.labels.items()))): s.value
                  for family in engine.registry.collect() for s in family.samples}
    finally:
        edge.stop_exporter()

    def value(name, **labels):
        return got[(name, tuple(sorted({"service": "llm", **labels}.items())))]

    assert value("modalmesh_generation_tokens_total") == 7
    assert value("modalmesh_ready") == 1
    assert value("modalmesh_kv_pool_capacity_tokens", pool="kv") == 4096
    assert value("modalmesh_time_to_first_token_seconds_count") == 2
    assert value("modalmesh_time_to_first_token_seconds_bucket", le="0.025") == 1
    assert value("modalmesh_time_to_first_token_seconds_bucket", le="0.5") == 2
    assert value("modalmesh_gc_pause_seconds_count", generation="2") == 2
    assert value("modalmesh_service_info", model_id="m", version="1", dtype="float32", device="cpu") == 1
    start = ("process_start_time_seconds", ())
    assert got[start] == min(mine[start], theirs[start])
    rss = ("process_resident_memory_bytes", ())
    assert got[rss] > max(mine[rss], theirs[rss])  # the service's memory: both processes'
    # One family per name and one value per series, in both formats (Prometheus asks for OpenMetrics first, and
    # drops a scrape whose series repeat); _created is the earlier of the two.
    helps = [line for line in text.splitlines() if line.startswith("# HELP")]
    assert len(helps) == len(set(helps))
    series = [line.rsplit(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#")]
    assert len(series) == len(set(series))
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_open_metrics

    assert list(parse_open_metrics(open_metrics))
    created = ("modalmesh_generation_tokens_created", (("service", "llm"),))
    assert got[created] == min(mine[created], theirs[created])


def test_a_scrape_while_the_folded_in_process_is_gone_shows_this_one():
    edge = Metrics("llm", process_metrics=False)
    edge.ready.set(1)

    def gone():
        raise ConnectionError("the LLM engine process is not serving")

    edge.fold_in(gone)
    port = edge.start_exporter("127.0.0.1", 0)
    try:
        assert _scrape(port)[("modalmesh_ready", (("service", "llm"),))] == 1
    finally:
        edge.stop_exporter()


def test_observe_many_records_what_as_many_observes_do():
    """`observe_many` writes into prometheus_client's own histogram values: a release that renamed them
    would fail here, not skew the LLM's inter-token latency. Values on, between, under and over the bounds."""
    many, one = Metrics("llm", process_metrics=False), Metrics("llm", process_metrics=False)
    bounds = many.inter_token_latency_seconds.labels()._upper_bounds
    values = [0.0, bounds[0], bounds[0] * 1.5, bounds[3], (bounds[3] + bounds[4]) / 2, bounds[-2], bounds[-2] * 10]
    for count, value in enumerate(values, start=1):
        many.inter_token_latency_seconds.observe_many(value, count)
        for _ in range(count):
            one.inter_token_latency_seconds.observe(value)

    def samples(m):
        text = generate_latest(m.registry).decode()
        fam = next(f for f in text_string_to_metric_families(text) if f.name == "modalmesh_inter_token_latency_seconds")
        return {(s.name, s.labels.get("le")): s.value for s in fam.samples if not s.name.endswith("_created")}

    got, want = samples(many), samples(one)
    assert got.keys() == want.keys() and len(got) == len(bounds) + 2  # every bucket, _count and _sum
    for key in got:
        assert got[key] == (pytest.approx(want[key], rel=1e-12) if key[0].endswith("_sum") else want[key]), key
    assert want[("modalmesh_inter_token_latency_seconds_count", None)] == sum(range(1, len(values) + 1))
