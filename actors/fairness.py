"""Tenant fairness (`--fairness vtc`): the Virtual Token Counter of Sheng et al., "Fairness in
Serving Large Language Models" (OSDI'24). Owned by the Policy actor.

A tenant's counter is its service, prompt tokens at INPUT_WEIGHT and generated tokens at
OUTPUT_WEIGHT (the paper's w_p = 1, w_q = 2), over its `--tenant-weights` weight. Each pick goes to
the backlogged tenant with the smallest counter, charged its prompt in advance; inside a tenant
the policy's order is kept (lpm keeps its locality). A tenant that was not backlogged is lifted on
arrival to the smallest backlogged counter, so idle time earns no credit.

Bound (Theorem 4.4): two backlogged tenants' weighted services differ by at most
2 * max(INPUT_WEIGHT * L, OUTPUT_WEIGHT * M), L the longest prompt and M the KV pool's tokens.
A request requeued in front is refunded its prompt; a preempted or retracted one keeps its charges
(its prompt is computed, and charged, again).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from runtime.req import Req

INPUT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0
DEFAULT_TENANT = ""  # requests that name no tenant share one


def tenant_of(req: Req) -> str:
    return req.asked.service.tenant or DEFAULT_TENANT


class VirtualTokenCounter:
    def __init__(self, weights: Mapping[str, float]) -> None:
        self.weights = dict(weights)
        self.counters: dict[str, float] = {}
        self._last_left = 0.0  # the counter of the tenant that left the backlog last

    def arrived(self, tenant: str, backlogged: set[str]) -> None:
        """`tenant` has a new request; `backlogged`: tenants with requests queued before it."""
        if tenant in backlogged:
            return
        floor = min((self.counters.get(t, 0.0) for t in backlogged), default=self._last_left)
        self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)

    def left(self, tenant: str) -> None:
        """`tenant` has nothing queued any more."""
        self._last_left = self.counters.get(tenant, 0.0)

    def interleave(self, ordered: Sequence[Req]) -> list[Req]:
        """`ordered` (the policy's order) re-ordered least-served tenant first, each pick
        charged its prompt in this simulation only; the counters do not change."""
        queues: dict[str, list[Req]] = {}
        for req in ordered:
            queues.setdefault(tenant_of(req), []).append(req)
        heap = [(self.counters.get(t, 0.0), t, 0) for t in queues]
        heapq.heapify(heap)
        out: list[Req] = []
        while heap:
            counter, tenant, head = heapq.heappop(heap)
            req = queues[tenant][head]
            out.append(req)
            if head + 1 < len(queues[tenant]):
                heapq.heappush(heap, (counter + self._cost(tenant, INPUT_WEIGHT * len(req.asked.input_ids)), tenant, head + 1))
        return out

    def charge_prompts(self, reqs: Iterable[Req], sign: float = 1.0) -> None:
        for req in reqs:
            tenant = tenant_of(req)
            self.counters[tenant] = self.counters.get(tenant, 0.0) + sign * self._cost(tenant, INPUT_WEIGHT * len(req.asked.input_ids))

    def charge_outputs(self, tokens: Mapping[str, int]) -> None:
        for tenant, n in tokens.items():
            self.counters[tenant] = self.counters.get(tenant, 0.0) + self._cost(tenant, OUTPUT_WEIGHT * n)

    def _cost(self, tenant: str, tokens: float) -> float:
        return tokens / self.weights.get(tenant, 1.0)


def generated_by_tenant(reqs: Sequence[Req], produces_token: Sequence[bool]) -> Counter[str]:
    return Counter(tenant_of(req) for req, produced in zip(reqs, produces_token) if produced)
