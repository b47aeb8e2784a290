"""Prometheus metrics of one server, named like SGLang's with our own prefix
(`sglang:num_running_reqs` -> `actorserve:num_running_reqs`).

Each app has its own registry, so several servers in one process (tests) never share counts.
Per-request latencies are labelled by class: `priority`, `tenant` and `slo_class` (the TTFT target
asked for, e.g. `ttft<=500ms`, or `none`); each label keeps at most MAX_LABEL_VALUES distinct
values (later ones are counted as `other`), so clients cannot blow up the series count. Requests
that asked for a TTFT target (or a deadline) count as met or missed, and the tokens of those that
met theirs are the goodput.
Two sources: what the server observes per request (tokens, latencies, aborts) is recorded as it
happens; what the engine owns (running/queued requests, KV, preemptions, retractions) is read from
`Engine.stats()` at scrape time by a collector, so the engine needs no knowledge of Prometheus.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from runtime.service import ServiceClass
from runtime.stream import Delta

PREFIX = "actorserve"
CLASS_LABELS = ("priority", "tenant", "slo_class")
MAX_LABEL_VALUES = 64
# Seconds. Wide on purpose: a CPU test model and a loaded GPU server both land inside.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                   1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05,
               0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict[str, Any]]):
        self.registry = CollectorRegistry()
        reg, p = self.registry, PREFIX
        by_class = {"labelnames": CLASS_LABELS, "registry": reg}
        self.ttft = Histogram(f"{p}:time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, **by_class)
        self.itl = Histogram(f"{p}:inter_token_latency_seconds", "Inter-token latency", buckets=ITL_BUCKETS, **by_class)
        self.tpot = Histogram(f"{p}:time_per_output_token_seconds", "Time per output token after the first, per request", buckets=ITL_BUCKETS, **by_class)
        self.e2e = Histogram(f"{p}:e2e_request_latency_seconds", "End-to-end request latency", buckets=LATENCY_BUCKETS, **by_class)
        self.queue_time = Histogram(f"{p}:request_queue_time_seconds", "Time waiting in the queue", buckets=LATENCY_BUCKETS, **by_class)
        self.slo_met = Counter(f"{p}:slo_met_requests", "Requests with a TTFT target or deadline that met it", **by_class)
        self.slo_missed = Counter(f"{p}:slo_missed_requests", "Requests with a TTFT target or deadline that missed it", **by_class)
        self.goodput_tokens = Counter(f"{p}:goodput_tokens", "Generated tokens of requests that met their target", **by_class)
        self._label_values: dict[str, set[str]] = {name: set() for name in CLASS_LABELS}
        self.prompt_tokens = Counter(f"{p}:prompt_tokens", "Prompt tokens of finished requests", registry=reg)
        self.generation_tokens = Counter(f"{p}:generation_tokens", "Generated tokens", registry=reg)
        self.cached_tokens = Counter(f"{p}:cached_tokens", "Prompt tokens served from the prefix cache", registry=reg)
        self.requests = Counter(f"{p}:num_requests", "Requests that reached the engine", registry=reg)
        self.aborted = Counter(f"{p}:num_aborted_requests", "Requests that ended without finishing", registry=reg)
        # Plain copies for the cache hit rate: reading a Counter's value back is not public API.
        self.prompt_total = 0
        self.cached_total = 0
        reg.register(_EngineCollector(stats, self))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self, service: ServiceClass = ServiceClass(), priority: int | None = None) -> RequestTracker:
        self.requests.inc()
        labels = {"priority": "none" if priority is None else str(priority), "tenant": service.tenant or "", "slo_class": service.slo_class()}
        return RequestTracker(self, {name: self._bounded(name, value) for name, value in labels.items()}, service)

    def _bounded(self, label: str, value: str) -> str:
        seen = self._label_values[label]
        if value in seen or len(seen) < MAX_LABEL_VALUES:
            seen.add(value)
            return value
        return "other"

    def cache_hit_rate(self) -> float:
        return self.cached_total / self.prompt_total if self.prompt_total else 0.0


class RequestTracker:
    """Latency bookkeeping of one engine request, fed every delta it yields."""

    __slots__ = ("metrics", "labels", "service", "start", "first", "last", "tokens", "ended", "_itl")

    def __init__(self, metrics: ServerMetrics, labels: dict[str, str], service: ServiceClass):
        self.metrics = metrics
        self.labels = labels
        self.service = service
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0
        self.ended = False
        self._itl: Any = None  # this class's ITL series, looked up once: every later delta observes it

    def on_delta(self, delta: Delta) -> None:
        m, now, n = self.metrics, time.perf_counter(), len(delta.output_ids)
        if n:
            if self.first is None:
                self.first = now
                m.ttft.labels(**self.labels).observe(now - self.start)
            else:
                # A delta may carry several tokens (stream_interval): spread the gap over them.
                gap = (now - self.last) / n  # type: ignore[operator]
                if self._itl is None:
                    self._itl = m.itl.labels(**self.labels)
                for _ in range(n):
                    self._itl.observe(gap)
            self.last = now
            self.tokens += n
            m.generation_tokens.inc(n)
        if delta.finish_reason is not None:
            self._end(delta, now)

    def refused(self) -> None:
        """The engine refused the input (a 400): not an abort."""
        self.ended = True

    def on_exit(self) -> None:
        """The request left without a final delta: the client went away or it was refused."""
        if not self.ended:
            self.ended = True
            self.metrics.aborted.inc()

    def _end(self, delta: Delta, now: float) -> None:
        m = self.metrics
        self.ended = True
        m.e2e.labels(**self.labels).observe(now - self.start)
        if self.first is not None and self.tokens > 1:
            m.tpot.labels(**self.labels).observe((now - self.first) / (self.tokens - 1))
        self._count_slo(now)
        m.prompt_tokens.inc(delta.prompt_tokens)
        m.cached_tokens.inc(delta.cached_tokens)
        m.prompt_total += delta.prompt_tokens
        m.cached_total += delta.cached_tokens
        if delta.queue_time is not None:
            m.queue_time.labels(**self.labels).observe(delta.queue_time)
        if delta.finish_reason == "abort":
            m.aborted.inc()


    def _count_slo(self, now: float) -> None:
        ttft_due, end_due = self.service.slo_ttft_ms, self.service.deadline_ms
        if ttft_due is None and end_due is None:
            return
        first_ok = ttft_due is None or (self.first is not None and (self.first - self.start) * 1e3 <= ttft_due)
        end_ok = end_due is None or (now - self.start) * 1e3 <= end_due
        m = self.metrics
        if first_ok and end_ok:
            m.slo_met.labels(**self.labels).inc()
            m.goodput_tokens.labels(**self.labels).inc(self.tokens)
        else:
            m.slo_missed.labels(**self.labels).inc()


class _EngineCollector:
    """Engine-owned numbers, read at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, Any]], metrics: ServerMetrics):
        self.stats = stats
        self.metrics = metrics
        self._last_tokens: tuple[float, int] | None = None  # (time, generated) at the last scrape

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        if not s.get("running", True):
            return
        p = PREFIX
        pool = max(1, s.get("kv_pool_size", 0))
        used = pool - s.get("kv_free", pool) - s.get("kv_evictable", 0)  # evictable cache is free for the taking
        gauges = [
            ("num_running_reqs", "Requests in the running batch", s.get("num_running", 0)),
            ("num_queue_reqs", "Requests waiting in the queue", s.get("num_waiting", 0)),
            ("num_used_tokens", "KV slots held (not free, not evictable)", used),
            ("token_usage", "Fraction of the KV pool held", used / pool),
            ("cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens", self.metrics.cache_hit_rate()),
            ("gen_throughput", "Generated tokens per second since the last scrape", self._throughput(s)),
        ]
        counters = [
            ("num_preemptions", "Requests preempted by higher-priority ones", "preemptions"),
            ("num_retractions", "Requests retracted on KV shortage", "retractions"),
            ("num_rejected_requests", "Requests refused by a full queue or evicted from it", "rejected"),
            ("num_queue_timeouts", "Requests that waited longer than the queue timeout", "queue_timeouts"),
            ("num_deadline_infeasible", "Requests refused because the queue ahead would make them late", "deadline_infeasible"),
            ("forward_steps", "Forward steps run", "forward_steps"),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(f"{p}:{name}", doc, value=value)
        for name, doc, key in counters:
            yield CounterMetricFamily(f"{p}:{name}", doc, value=s.get(key, 0))
        for name, doc, key in _HICACHE_COUNTERS:
            if key in s:  # only with the tier (--enable-hierarchical-cache, --hicache-storage-backend)
                yield CounterMetricFamily(f"{p}:{name}", doc, value=s[key])
        yield from _per_replica(s.get("replicas", []))

    def _throughput(self, s: dict[str, Any]) -> float:
        now, tokens = time.monotonic(), s.get("generated_tokens", 0)
        last, self._last_tokens = self._last_tokens, (now, tokens)
        if last is None or now <= last[0]:
            return 0.0
        return (tokens - last[1]) / (now - last[0])


# Per tier of the hierarchical cache: (series, doc, Engine.stats() key).
_HICACHE_COUNTERS = (
    ("hicache_host_hit_tokens", "Prompt tokens loaded back into the KV pool from the host tier (L2)", "hicache_host_hit_tokens"),
    ("hicache_host_stored_tokens", "Tokens copied from the KV pool to the host tier", "hicache_stored_tokens"),
    ("hicache_storage_hit_tokens", "Prompt tokens read from the storage tier (L3) into the host tier", "hicache_storage_hit_tokens"),
    ("hicache_storage_written_bytes", "Bytes written to the storage tier", "hicache_storage_written_bytes"),
    ("hicache_storage_write_seconds", "Seconds the storage tier's writer spent on writes", "hicache_storage_write_s"),
    ("hicache_storage_read_bytes", "Bytes read from the storage tier", "hicache_storage_read_bytes"),
    ("hicache_storage_read_seconds", "Seconds the storage tier's reader spent on reads", "hicache_storage_read_s"),
    ("hicache_storage_corrupt_blocks", "Storage blocks that failed their checksum (removed, served as misses)", "hicache_storage_corrupt_blocks"),
)


def _per_replica(replicas: list[dict[str, Any]]) -> Iterator[Metric]:
    """With dp_size > 1: each replica's health and load, labelled by its index."""
    if not replicas:
        return
    families = [
        (GaugeMetricFamily(f"{PREFIX}:replica_up", "1 while the replica serves", labels=["replica"]), lambda r: float(r["up"])),
        (GaugeMetricFamily(f"{PREFIX}:replica_num_running_reqs", "Requests in the replica's running batch", labels=["replica"]), lambda r: r.get("num_running", 0)),
        (GaugeMetricFamily(f"{PREFIX}:replica_num_queue_reqs", "Requests waiting in the replica's queue", labels=["replica"]), lambda r: r.get("num_waiting", 0)),
        (CounterMetricFamily(f"{PREFIX}:replica_generated_tokens", "Tokens the replica generated", labels=["replica"]), lambda r: r.get("generated_tokens", 0)),
    ]
    for family, value in families:
        for r in replicas:
            family.add_metric([str(r["replica"])], value(r))
        yield family
