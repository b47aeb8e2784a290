"""Policy: owns the waiting queue; orders it when the Adder pulls candidates.

Why a separate actor and not part of the Adder: the queue's work (ordering thousands of waiting
requests by prefix match, admission limits, grammar compiles, deadlines, tenant fairness) scales
with the backlog, the Adder's with the batch; apart, each stays small enough to read and to test
alone, and the Adder's batch loop never waits on a sort. What the Policy needs from the Adder
comes as plain data in `Pull` (rows free, routing keys running, the priority a candidate must beat
to preempt, the measured prefill rate); what it gives back is `Ranked`. The one thing shared is
the prefix cache, which the Adder owns and writes: the Policy reads match lengths from it through
the read-only `PrefixMatcher` view, on the same event loop, so it never sees a half-made change.
Both compare priorities with the one `PriorityRule` (actors/priority.py).

Admission limits that depend on the queue live here because the queue does: `max_queued_requests`
(with priority scheduling, a strictly better newcomer evicts the worst queued request; otherwise
the newcomer is refused) and `queue_timeout_s`. Refused, evicted and timed-out requests end with
status 503; aborted ones with finish_reason "abort".

With `--reject-infeasible` (edf), a request whose first token is due before the queue ahead of
it and its own prefill could be done is refused at once, 503 `deadline_infeasible`, instead of
running late: the estimate is the larger of (requests ahead / the rate the Adder took requests
while the queue stayed backlogged) and (their prompt tokens / the measured prefill rate), plus its
own prompt at that rate, plus, when every row is taken (and its priority may not preempt) or the
KV cannot hold it, the time until the first running request leaves (the Adder's Pull reports it
from the measured decode step). Until something is measured nothing is refused.

A constrained request (json_schema, regex, ebnf) whose grammar is not compiled yet waits in the
grammar queue (`compiling`), as in SGLang, while a worker thread compiles it (actors/grammar.py);
it joins the waiting queue when that is done, or ends with 400 if the grammar does not compile.

With a storage tier (cache/storage_tier.py), a request starts reading the blocks that continue
its device match from storage as it is queued; with `--hicache-storage-prefetch-policy
wait_complete` or `timeout` it waits in the prefetch queue (`prefetching`) until the read is done
(or its time is up), as SGLang's scheduler skips such a request; `best_effort` does not hold it.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter

from actors.fairness import VirtualTokenCounter, tenant_of
from actors.grammar import Compiled, GrammarCompiler
from actors.policy_order import QueueOrderer
from actors.prefill_adder import match_key
from actors.priority import PriorityRule
from cache import PrefixMatcher
from cache.storage_tier import Prefetch, StorageTier
from runtime.actor import Actor, Mailbox
from runtime.config import CoreConfig
from runtime.messages import AdderMsg, Enqueue, GrammarCompiled, PolicyMsg, Pull, Ranked, Requeue, Served, Wake
from runtime.req import FinishReason, Req, end_request
from runtime.service import parse_tenant_weights

QUEUE_FULL = "The request queue is full."


class Policy(Actor[PolicyMsg]):
    def __init__(
        self, config: CoreConfig, prefix_cache: PrefixMatcher, grammars: GrammarCompiler | None = None,
        *, inbox: Mailbox[PolicyMsg], adder: Mailbox[AdderMsg], storage: StorageTier | None = None,
    ):
        super().__init__("policy", inbox)
        self.config = config
        self.prefix_cache = prefix_cache
        self.storage = storage
        self.prefetching: dict[str, Req] = {}  # the prefetch queue, by rid
        self._prefetch_waits: set[asyncio.Task[None]] = set()
        self.priority_rule = PriorityRule.of(config)
        self.adder = adder
        self.grammars = grammars
        self.compiling: dict[str, Req] = {}  # the grammar queue, by rid
        self._compiles: set[asyncio.Task[None]] = set()
        self.orderer = QueueOrderer(config, prefix_cache, random.Random(config.random_seed))
        self.waiting: list[Req] = []
        self._parked: Pull | None = None
        self.rejected = 0
        self.timed_out = 0
        self.aborted = 0
        self.infeasible = 0
        self.backlog_rate = BacklogRate()
        self.fairness = VirtualTokenCounter(parse_tenant_weights(config.tenant_weights)) if config.fairness == "vtc" else None
        self.prefill_tokens_per_s: float | None = None  # the Adder's measure, from its Pulls
        self._capacity: Pull | None = None  # the last Pull: rows, KV and the first exit it reported

    def start(self, on_exit) -> None:
        super().start(on_exit)
        if self.config.queue_timeout_s is not None:
            self.spawn(self._tick(self.config.queue_timeout_s / 4), "timeout-ticker")

    async def handle(self, msg: PolicyMsg) -> None:
        if isinstance(msg, Enqueue):
            self._enqueue(msg.req)
        elif isinstance(msg, GrammarCompiled):
            self._grammar_compiled(msg.req, msg.compiled)
        elif isinstance(msg, Requeue):
            self._requeue(msg)
        elif isinstance(msg, Pull):
            self._parked = self._capacity = msg
            self.prefill_tokens_per_s = msg.prefill_tokens_per_s or self.prefill_tokens_per_s
        elif isinstance(msg, Served) and self.fairness is not None:
            self.fairness.charge_outputs(msg.tokens)
        if isinstance(msg, (Wake, Pull)):
            # Aborts and the timeout ticker send a Wake; a Pull must not hand out what is gone.
            # Not per Enqueue: a burst of n arrivals would rescan the queue n times.
            self._drop_aborted_and_expired()
            self._release_prefetched()
        if self._parked is not None and self._may_answer(self._parked):
            pull, self._parked = self._parked, None
            await self._answer(pull)

    def _may_answer(self, pull: Pull) -> bool:
        """A blocking Pull waits for a request, and then for the rest of a burst that is already
        in the mailbox: answering the first arrival alone would split one burst into many rounds."""
        return not pull.block or (bool(self.waiting) and self.mailbox.empty())

    async def on_stop(self) -> None:
        for task in [*self._compiles, *self._prefetch_waits]:
            task.cancel()
        for req in [*self.waiting, *self.compiling.values(), *self.prefetching.values()]:
            _end_prefetch(req)
            end_request(req, FinishReason("abort", message="the engine is shutting down", status=503, code="shutting_down"))
        self.waiting.clear()
        self.compiling.clear()
        self.prefetching.clear()
        if self.grammars is not None:
            self.grammars.shutdown()

    async def _answer(self, pull: Pull) -> None:
        given: list[Req] = []
        if pull.max_reqs and self.waiting:
            ordered = self.orderer.order(self.waiting, Counter(pull.running_routing_keys))
            if self.fairness is not None:
                ordered = self.fairness.interleave(ordered)
            given, self.waiting = ordered[: pull.max_reqs], ordered[pull.max_reqs :]
            if pull.preempt_priority is not None and not self.priority_rule.may_preempt(given[0].asked.priority, pull.preempt_priority):
                given, self.waiting = [], ordered  # it stays here, where a better newcomer can evict it
            self._charge(given)
        self.backlog_rate.answered(time.monotonic(), len(given), backlogged=bool(self.waiting))
        await self.adder.send(Ranked(reqs=given, num_waiting=len(self.waiting)))

    def _enqueue(self, req: Req) -> None:
        grammar = req.asked.sampling.grammar
        if grammar is None:
            self._admit(req)
            return
        if self.grammars is None:
            end_request(req, FinishReason("abort", message="constrained decoding is not available in this engine", status=400, code="invalid_request_error", param=grammar[0]))
            return
        compiled = self.grammars.cached(*grammar)
        if compiled is not None:
            self._grammar_compiled(req, compiled)
            return
        self.compiling[req.rid] = req
        task = asyncio.get_running_loop().create_task(self._compile(req, *grammar), name=f"policy.compile.{req.rid}")
        self._compiles.add(task)
        task.add_done_callback(self._compiles.discard)
        task.add_done_callback(self._task_done)  # a compile that raises fails the actor: nothing waits forever

    async def _compile(self, req: Req, kind: str, text: str) -> None:
        assert self.grammars is not None
        await self.send(GrammarCompiled(req, await self.grammars.compile(kind, text)))

    def _grammar_compiled(self, req: Req, compiled: Compiled) -> None:
        self.compiling.pop(req.rid, None)
        kind = req.asked.sampling.grammar[0] if req.asked.sampling.grammar else "grammar"
        if req.finished:
            return  # the abort scan ended it while it compiled
        if req.sched.abort_requested:  # aborted, and this came before the Wake that says so
            self.aborted += 1
            end_request(req, FinishReason("abort"))
            return
        if compiled.error is not None:
            end_request(req, FinishReason("abort", message=f"{kind} does not compile: {compiled.error}", status=400, code="invalid_request_error", param=kind))
            return
        assert self.grammars is not None
        req.sched.constraint = self.grammars.constraint(compiled)
        self._admit(req)

    def _requeue(self, msg: Requeue) -> None:
        if self.fairness is not None:
            if msg.front:  # candidates the Adder did not admit: they were charged when handed out
                self.fairness.charge_prompts(msg.reqs, sign=-1.0)
            else:  # preempted or retracted: back in the queue as if they arrived now
                queued = self._queued_tenants()
                for req in msg.reqs:
                    self.fairness.arrived(tenant_of(req), queued)
                    queued.add(tenant_of(req))
        if msg.front:
            self.backlog_rate.gave_back(len(msg.reqs))
            self.waiting = msg.reqs + self.waiting
            return
        for req in msg.reqs:  # as SGLang: a retracted or preempted request meets the queue limit as an arrival
            self._join_queue(req)

    def _charge(self, given: list[Req]) -> None:
        """VTC: prompts handed out are service received; a tenant with nothing left queued left."""
        if self.fairness is None or not given:
            return
        self.fairness.charge_prompts(given)
        for tenant in {tenant_of(r) for r in given} - self._queued_tenants():
            self.fairness.left(tenant)

    def _queued_tenants(self) -> set[str]:
        return {tenant_of(w) for w in self.waiting}

    def _admit(self, req: Req) -> None:
        if self._held_for_prefetch(req):
            return
        if self.config.reject_infeasible and self._late(req):
            self.infeasible += 1
            end_request(req, FinishReason("abort", message="the request cannot get its first token by its deadline behind the queue ahead of it", status=503, code="deadline_infeasible"))
            return
        if self.fairness is not None:
            self.fairness.arrived(tenant_of(req), self._queued_tenants())
        self._join_queue(req)

    def _held_for_prefetch(self, req: Req) -> bool:
        """Start reading the request's blocks past its device match from the storage tier; with
        wait_complete or timeout, hold it in the prefetch queue until the read may end."""
        storage = self.storage
        if storage is None or req.sched.prefetch is not None:
            return False
        key = match_key(req)
        prefetch = storage.prefetch(key, req.asked.extra_key, self.prefix_cache.match_prefix(key, req.asked.extra_key).length)
        req.sched.prefetch = prefetch
        if prefetch is None or prefetch.may_end(storage.prefetch_policy, time.monotonic()):
            return False
        self.prefetching[req.rid] = req
        task = asyncio.get_running_loop().create_task(self._await_prefetch(prefetch), name=f"policy.prefetch.{req.rid}")
        self._prefetch_waits.add(task)
        task.add_done_callback(self._prefetch_waits.discard)
        task.add_done_callback(self._task_done)
        return True

    async def _await_prefetch(self, prefetch: Prefetch) -> None:
        """Wake the Policy once the read is done, or (timeout) once its deadline passed."""
        assert prefetch.future is not None and self.storage is not None
        timeout = max(prefetch.deadline - time.monotonic(), 0.0) if self.storage.prefetch_policy == "timeout" else None
        await asyncio.wait([asyncio.wrap_future(prefetch.future)], timeout=timeout)
        await self.send(Wake())

    def _release_prefetched(self) -> None:
        if not self.prefetching:
            return
        assert self.storage is not None
        now, policy = time.monotonic(), self.storage.prefetch_policy
        for rid in [rid for rid, req in self.prefetching.items() if req.sched.prefetch.may_end(policy, now)]:  # type: ignore[union-attr]
            self._admit(self.prefetching.pop(rid))

    def _join_queue(self, req: Req) -> None:
        """SGLang's `_abort_on_queued_limit`: past `max_queued_requests`, a strictly better
        request (priority scheduling) evicts the worst queued one, else it is refused."""
        limit = self.config.max_queued_requests
        if limit is None or len(self.waiting) < limit:
            self.waiting.append(req)
            return
        worst = self._worst_waiting() if self.config.enable_priority_scheduling else None
        if worst is not None and self._better(req, worst):
            self.waiting.remove(worst)
            self.rejected += 1
            end_request(worst, FinishReason("abort", message="evicted from the queue by a higher-priority request", status=503, code="evicted"))
            self.waiting.append(req)
        else:
            self.rejected += 1
            end_request(req, FinishReason("abort", message=QUEUE_FULL, status=503, code="queue_full"))

    def _late(self, req: Req) -> bool:
        default = self.config.default_slo_ttft_ms
        due = req.asked.service.first_token_due(req.asked.arrival_time, default)
        if due == math.inf:
            return False
        ahead = [w for w in self.waiting if w.asked.service.first_token_due(w.asked.arrival_time, default) <= due]
        wait = estimated_first_token_s(
            len(ahead), sum(len(w.asked.input_ids) for w in ahead), len(req.asked.input_ids),
            self.backlog_rate.per_s, self.prefill_tokens_per_s,
        )
        blocked = self._blocked_s(req)
        if wait is None and blocked is None:
            return False
        return time.monotonic() + (wait or 0.0) + (blocked or 0.0) > due

    def _blocked_s(self, req: Req) -> float | None:
        """How long the running batch keeps `req` out at least: with every row taken (and no
        preemption its priority allows), or too little KV for its prompt and output, until the
        first running request leaves."""
        pull = self._capacity
        if pull is None or pull.first_exit_s is None:
            return None
        rows_full = pull.max_reqs == 0 and not (
            pull.preempt_priority is not None and self.priority_rule.may_preempt(req.asked.priority, pull.preempt_priority)
        )
        kv_short = len(req.asked.input_ids) + req.max_new_tokens > pull.kv_free
        return pull.first_exit_s if rows_full or kv_short else None

    def _worst_waiting(self) -> Req | None:
        if not self.waiting:
            return None
        level = self.priority_rule.level
        return max(self.waiting, key=lambda r: (level(r.asked.priority), r.sched.enqueue_time))

    def _better(self, a: Req, b: Req) -> bool:
        return self.priority_rule.level(a.asked.priority) < self.priority_rule.level(b.asked.priority)

    def _drop_aborted_and_expired(self) -> None:
        for rid in [rid for rid, req in self.compiling.items() if req.sched.abort_requested]:
            self.aborted += 1
            end_request(self.compiling.pop(rid), FinishReason("abort"))
        for rid in [rid for rid, req in self.prefetching.items() if req.sched.abort_requested]:
            self.aborted += 1
            end_request(_end_prefetch(self.prefetching.pop(rid)), FinishReason("abort"))
        timeout = self.config.queue_timeout_s
        now = time.monotonic()
        keep: list[Req] = []
        for req in self.waiting:
            if req.sched.abort_requested:
                self.aborted += 1
                end_request(_end_prefetch(req), FinishReason("abort"))
            elif timeout is not None and now - req.sched.enqueue_time > timeout:
                self.timed_out += 1
                end_request(_end_prefetch(req), FinishReason("abort", message=f"the request waited in the queue longer than {timeout} s", status=503, code="queue_timeout"))
            else:
                keep.append(req)
        self.waiting = keep

    async def _tick(self, period: float) -> None:
        while True:
            await asyncio.sleep(period)
            await self.send(Wake())


def _end_prefetch(req: Req) -> Req:
    """Stop a storage read nobody will use (the request ends before the Adder took it)."""
    prefetch, req.sched.prefetch = req.sched.prefetch, None
    if isinstance(prefetch, Prefetch):
        prefetch.take()
    return req


class BacklogRate:
    """Requests per second the Adder kept from the queue while it stayed backlogged (an EWMA;
    None until two backlogged answers in a row were seen): each interval between answers counts
    what the first of them handed out, less what the Adder gave back. An answer that leaves
    nothing waiting ends the measuring: arrivals, not the engine, set the pace then."""

    def __init__(self) -> None:
        self.per_s: float | None = None
        self._since: float | None = None
        self._kept = 0  # handed out by the last answer, less what came back since

    def answered(self, now: float, given: int, backlogged: bool) -> None:
        if self._since is not None and now > self._since:
            sample = max(self._kept, 0) / (now - self._since)
            self.per_s = sample if self.per_s is None else 0.8 * self.per_s + 0.2 * sample
        self._kept = given
        self._since = now if backlogged else None

    def gave_back(self, count: int) -> None:
        self._kept -= count


def estimated_first_token_s(
    ahead: int, ahead_tokens: int, own_tokens: int, reqs_per_s: float | None, prefill_tokens_per_s: float | None
) -> float | None:
    """Seconds until a request's first token: the queue ahead (bound by how fast requests are
    taken, or by prefilling their prompts, whichever is slower), then its own prefill. None
    until both rates are known."""
    if not reqs_per_s or not prefill_tokens_per_s:
        return None
    return max(ahead / reqs_per_s, ahead_tokens / prefill_tokens_per_s) + own_tokens / prefill_tokens_per_s

