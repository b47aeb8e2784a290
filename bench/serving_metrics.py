"""The arithmetic of `bench.serving`: per-request timings in, one run's metrics out.

Definitions follow SGLang's bench_serving and vLLM's `bench serve` (see the reference's "Serving
benchmark conventions"):

- TTFT: from sending the request to its first non-empty chunk (a chunk that carries output).
- ITL: the gaps between consecutive non-empty chunks, pooled over all requests. A chunk may carry
  several tokens (stream_interval > 1): the gap is still one ITL sample, as in SGLang.
- TPOT: (e2e - ttft) / (output_len - 1), per request with output_len > 1. For goodput a
  one-token request has TPOT 0 (it meets any TPOT SLO), as in vLLM.
- E2E: from sending the request to the end of its stream.
- Queue time: from arrival to first admission, as the engine reports it (`--engine` only: the
  HTTP APIs do not carry it); absent from the metrics when no request reported one.
- Percentiles: numpy's linear interpolation (`np.percentile`), the mean and the median.
- Throughput: completed requests, input tokens and output tokens over the run's duration (from
  the first request's scheduled start to the last answer).
- Concurrency: sum(e2e) / duration, the mean number of requests in flight.
- Goodput (vLLM): completed requests meeting every SLO given, per second of the run. A request
  with a TTFT target of its own (`--slo-classes`) is held to that target instead of
  `--slo-ttft-ms`; one with no target at all meets the TTFT SLO. SLO attainment: the share of
  all requests sent (failed ones included) that met them.
- Cache hit rate: prompt tokens the server reported as served from its prefix cache / prompt tokens.

Failed requests count in `failed` and nowhere else. With requests of several classes,
`metrics_by_class` gives the same figures per class: by priority (W5), by tenant (`--tenants`) and
by SLO class (`--slo-classes`), each dimension split when the run has two or more values of it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (90, 95, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2e")
# The per-class split's dimensions, in the table's order; /metrics names them priority, tenant and
# slo_class, with the same values.
CLASS_DIMENSIONS = ("priority", "tenant", "slo")


@dataclass(slots=True)
class RequestOutput:
    """What one request measured. Times are seconds; `start` and `chunk_times` are offsets from
    the run's start (for the throughput-over-time plot)."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0  # as the server counted it (the local count where it reports none)
    output_len: int = 0  # as the server counted it
    requested_output_len: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # offsets of the non-empty chunks
    output_ids: list[int] | None = None  # when the backend returns them (native, engine)
    text: str = ""
    # The request's class in each dimension it has one in (e.g. {"priority": "10", "tenant": "a"}),
    # for the per-class split.
    classes: dict[str, str] = field(default_factory=dict)
    slo_ttft_ms: float | None = None  # the request's own TTFT target (--slo-classes)
    queue_time: float | None = None  # seconds, where the backend reports it

    @property
    def tpot(self) -> float | None:
        """None for a one-token answer: there is no second token to time."""
        if self.output_len <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_len - 1)

    @property
    def end(self) -> float:
        return self.start + self.e2e


def summarize(values: Sequence[float], scale: float = 1000.0) -> dict[str, float]:
    """mean, median, std and the PERCENTILES of `values` times `scale` (seconds -> ms by
    default); zeros for an empty sequence, so a table never breaks."""
    if not len(values):
        return {"mean": 0.0, "median": 0.0, "std": 0.0, **{f"p{p}": 0.0 for p in PERCENTILES}}
    a = np.asarray(values, dtype=np.float64) * scale
    out = {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std())}
    for p, v in zip(PERCENTILES, np.percentile(a, PERCENTILES)):
        out[f"p{p}"] = float(v)
    return out


def meets_slo(o: RequestOutput, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """Did `o` succeed within its TTFT target (its own, else `slo_ttft_ms`) and `slo_tpot_ms`?"""
    if not o.success:
        return False
    ttft_target = o.slo_ttft_ms if o.slo_ttft_ms is not None else slo_ttft_ms
    if ttft_target is not None and o.ttft * 1000.0 > ttft_target:
        return False
    tpot = o.tpot or 0.0
    return slo_tpot_ms is None or tpot * 1000.0 <= slo_tpot_ms


def compute_metrics(
    outputs: Sequence[RequestOutput],
    duration_s: float,
    *,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    with_slo: bool = False,
) -> dict[str, Any]:
    """One flat dict of a run's metrics (latencies in ms): the JSON line's numbers. Goodput and
    SLO attainment when an SLO is given, a request has a target of its own, or `with_slo` (a
    class of a run that has targets, so that its classes add up to the run)."""
    ok = [o for o in outputs if o.success]
    duration = max(duration_s, 1e-9)
    prompt = sum(o.prompt_len for o in ok)
    output = sum(o.output_len for o in ok)
    cached = sum(o.cached_tokens for o in ok)
    tpots = [t for o in ok if (t := o.tpot) is not None]
    series = {
        "ttft": [o.ttft for o in ok],
        "tpot": tpots,
        "itl": [gap for o in ok for gap in o.itl],
        "e2e": [o.e2e for o in ok],
    }
    m: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "requested_output_tokens": sum(o.requested_output_len for o in outputs),
        "cached_tokens": cached,
        "cache_hit_rate": cached / prompt if prompt else 0.0,
        "request_throughput": len(ok) / duration,
        "input_throughput": prompt / duration,
        "output_throughput": output / duration,
        "total_token_throughput": (prompt + output) / duration,
        "concurrency": sum(series["e2e"]) / duration,
    }
    for name in LATENCIES:
        for stat, value in summarize(series[name]).items():
            m[f"{stat}_{name}_ms"] = value
    queued = [o.queue_time for o in ok if o.queue_time is not None]
    if queued:
        for stat, value in summarize(queued).items():
            m[f"{stat}_queue_ms"] = value
    own_targets = sorted({o.slo_ttft_ms for o in outputs if o.slo_ttft_ms is not None})
    if with_slo or slo_ttft_ms is not None or slo_tpot_ms is not None or own_targets:
        good = sum(meets_slo(o, slo_ttft_ms, slo_tpot_ms) for o in outputs)
        m["slo_ttft_ms"] = slo_ttft_ms
        m["slo_tpot_ms"] = slo_tpot_ms
        if own_targets:
            m["slo_ttft_ms_per_request"] = own_targets
        m["slo_attained"] = good / len(outputs) if outputs else 0.0
        m["goodput"] = good / duration
    return m


def metrics_by_class(
    outputs: Sequence[RequestOutput], duration_s: float, *, slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None
) -> dict[str, dict[str, Any]]:
    """compute_metrics per request class, keyed "<dimension> <value>" ("priority 10", "tenant a",
    "slo ttft<=500ms"): dimension by dimension (CLASS_DIMENSIONS), values in natural order. A
    dimension with fewer than two values is left out (its one class is the whole run); empty
    when no dimension has two. Throughputs and goodput are over the whole run's duration."""
    out: dict[str, dict[str, Any]] = {}
    with_slo = slo_ttft_ms is not None or slo_tpot_ms is not None or any(o.slo_ttft_ms is not None for o in outputs)
    for dim in CLASS_DIMENSIONS:
        values = sorted({o.classes[dim] for o in outputs if dim in o.classes}, key=_natural)
        if len(values) < 2:
            continue
        for value in values:
            mine = [o for o in outputs if o.classes.get(dim) == value]
            out[f"{dim} {value}"] = compute_metrics(mine, duration_s, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms, with_slo=with_slo)
    return out


def _natural(label: str) -> tuple[Any, ...]:
    """Numbers inside a label compare as numbers: priority 2 before 10, ttft<=500ms before 2000ms."""
    return tuple(float(part) if i % 2 else part for i, part in enumerate(re.split(r"(-?\d+(?:\.\d+)?)", label)))


def distserve_goodput(rows: Sequence[tuple[float, float]], target: float = 0.9) -> float | None:
    """DistServe's goodput over a rate sweep: the highest request rate whose share of requests
    meeting every SLO is >= `target`. `rows` are (rate, slo_attained); None when no rate does."""
    good = [rate for rate, attained in rows if attained >= target]
    return max(good) if good else None


def throughput_over_time(outputs: Sequence[RequestOutput], bins: int = 60) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bin centres s, output tokens/s, requests in flight) over the run, for the plot.

    A request's output tokens are spread evenly over its non-empty chunks (exact when every chunk
    carries one token; the openai backends do not say how many tokens a chunk carries)."""
    ok = [o for o in outputs if o.success]
    end = max((o.end for o in ok), default=0.0)
    if end <= 0:
        return np.zeros(0), np.zeros(0), np.zeros(0)
    edges = np.linspace(0.0, end, bins + 1)
    width = edges[1] - edges[0]
    tokens = np.zeros(bins)
    for o in ok:
        times = o.chunk_times or [o.end]
        idx = np.minimum((np.asarray(times) / width).astype(int), bins - 1)
        np.add.at(tokens, idx, o.output_len / len(times))
    centres = (edges[:-1] + edges[1:]) / 2
    starts = np.array([o.start for o in ok])
    ends = np.array([o.end for o in ok])
    in_flight = ((starts[None, :] <= centres[:, None]) & (ends[None, :] > centres[:, None])).sum(axis=1)
    return centres, tokens / width, in_flight.astype(float)


def format_rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"
