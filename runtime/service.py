"""What a request asks of the scheduler besides its priority: whose it is and how soon it is due.

Plain data: it travels from the caller to the core process unchanged (runtime/ipc.py)."""

from __future__ import annotations

import math

import msgspec

MAX_TENANT_CHARS = 256


class ServiceClass(msgspec.Struct, frozen=True, kw_only=True):
    tenant: str | None = None  # fairness (--fairness vtc) and per-tenant metrics
    slo_ttft_ms: float | None = None  # the first token is due this many ms after arrival
    deadline_ms: float | None = None  # the whole answer is due this many ms after arrival

    def first_token_due(self, arrival_time: float, default_slo_ttft_ms: float | None) -> float:
        """When the first token is due (time.monotonic's clock); inf when nothing is asked. A
        deadline for the whole answer is also one for its first token."""
        due = [ms for ms in (self.slo_ttft_ms, self.deadline_ms) if ms is not None]
        if not due and default_slo_ttft_ms is not None:
            due = [default_slo_ttft_ms]
        return arrival_time + min(due) / 1e3 if due else math.inf

    def slo_class(self) -> str:
        """A label for metrics: the TTFT target asked for, or "none"."""
        return "none" if self.slo_ttft_ms is None else f"ttft<={self.slo_ttft_ms:g}ms"


def service_error(service: ServiceClass) -> tuple[str, str] | None:
    """(message, field) when the request's service class is invalid."""
    tenant = service.tenant
    if tenant is not None and not (isinstance(tenant, str) and 0 < len(tenant) <= MAX_TENANT_CHARS):
        return f"tenant must be a string of 1 to {MAX_TENANT_CHARS} characters, got {tenant!r:.80}", "tenant"
    for name in ("slo_ttft_ms", "deadline_ms"):
        value = getattr(service, name)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if value is not None and not (number and math.isfinite(value) and value > 0):
            return f"{name} must be a positive number of milliseconds, got {value!r:.80}", name
    return None


def parse_tenant_weights(text: str | None) -> dict[str, float]:
    """`a=2,b=0.5` -> {"a": 2.0, "b": 0.5}; raises ValueError naming the bad entry."""
    weights: dict[str, float] = {}
    for entry in (text or "").split(","):
        if not entry.strip():
            continue
        name, sep, value = entry.partition("=")
        try:
            weight = float(value) if sep else float("nan")
        except ValueError:
            weight = float("nan")
        if not name.strip() or not weight > 0 or weight == float("inf"):
            raise ValueError(f"tenant_weights entry {entry!r}: expected tenant=positive_number")
        weights[name.strip()] = weight
    return weights
