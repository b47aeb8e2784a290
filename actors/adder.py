"""Adder: forms every batch. Owns the running set, KV allocation, the prefix cache and its locks
(its KV accounting is the `KVLedger`, actors/kv_ledger.py; why the queue is another actor's, see
actors/policy.py).

When the Policy's queue was empty, a `Pull` blocks there until a request arrives, and meanwhile
the Adder forms rounds without asking: a decode step costs no round trip.

A request that leaves the running set (finished, aborted, retracted, preempted) keeps its KV and
request row until the last launched step that includes it has completed; then they are released
exactly once (`_release_done`). The token pool and KV slots are only touched by later steps,
which run after that one, so nothing is overwritten under a step that still reads it.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from actors.fairness import generated_by_tenant
from actors.kv_ledger import KVLedger
from actors.priority import PriorityRule
from actors.running_set import RunningSet
from actors.prefill_adder import (
    RETRACT_DECODE_STEPS,
    AddResult,
    Admission,
    NewTokenRatio,
    PrefillAdder,
    match_for_admission,
    match_key,
    prefix_tokens,
    select_preemption_victims,
    select_retraction_victims,
)
from cache import PrefixCache
from cache.storage_tier import StorageTier
from gpu.model_runner import ModelRunner
from runtime.actor import Actor, Mailbox
from runtime.config import CoreConfig
from runtime.forward_mode import ForwardMode
from runtime.messages import AdderMsg, Batch, FlushCache, PolicyMsg, Pull, Ranked, Requeue, Served, StepDone, Wake
from runtime.req import FinishReason, Req, end_request

PREFILL_SAMPLE_MIN_TOKENS = 64


@dataclass(slots=True)
class _Ending:
    req: Req
    kind: str  # "finish" | "abort" | "retract" | "preempt"


class Adder(Actor[AdderMsg]):
    def __init__(
        self, config: CoreConfig, runner: ModelRunner, cache: PrefixCache,
        *, inbox: Mailbox[AdderMsg], policy: Mailbox[PolicyMsg], executor: Mailbox[Batch],
        storage: StorageTier | None = None,
    ):
        super().__init__("adder", inbox)
        self.config = config
        self.storage = storage  # read for its stats only (the Executor and Policy drive it)
        self.priority_rule = PriorityRule.of(config)
        self.kv = KVLedger(runner.allocator, runner.req_to_token, cache)
        self.executor = executor
        self.policy = policy
        self.page_size = config.page_size
        self.running = RunningSet()  # prompt fully launched: one decode token per step
        self.chunked: Req | None = None  # prompt partly launched
        self.ending: list[_Ending] = []
        self.ratio = NewTokenRatio(config.schedule_conservativeness)
        self.in_flight = 0
        self.next_step = 0
        self.done_step = -1
        self._pull_sent = False  # a Pull the Policy has not answered yet
        self._pull_parked = False  # ... and it blocks until a request waits: rounds go on without it
        self._queue_empty = True  # the Policy's last answer said nothing else waits
        self._candidates: list[Req] | None = None  # an answer (maybe empty) not yet used by a round
        self._stalled = False  # the last round launched nothing: wait for a StepDone
        # SGLang's batch_is_full: set when a prefill round ran out of KV (NO_TOKEN) or rows, cleared
        # when a request leaves the running set; while set, rounds take no new request. With
        # priority scheduling SGLang clears it at every round, to try preemption.
        self._batch_full = False
        self._to_requeue: list[Req] = []  # retracted / preempted, released, not yet sent back
        self.counters: Counter[str] = Counter()
        self.scheduler_s = 0.0
        self.prefill_tokens_per_s: float | None = None  # EWMA over recent prefill steps
        self.decode_step_s: float | None = None  # EWMA over recent decode-only steps
        # With fairness: tokens each launched step generates per tenant, reported when it is done.
        self._generating: dict[int, Counter[str]] = {}

    def start(self, on_exit) -> None:
        super().start(on_exit)
        self.mailbox.put_nowait(Wake())  # the first pull; after that every message ends in one

    async def handle(self, msg: AdderMsg) -> None:
        start = time.perf_counter()
        if isinstance(msg, Ranked):
            self._pull_sent = self._pull_parked = False
            self._queue_empty = msg.num_waiting == 0
            self._candidates = (self._candidates or []) + msg.reqs
        elif isinstance(msg, StepDone):
            self.in_flight -= 1
            self.done_step = msg.step
            self._stalled = False
            self._leave_all(msg.finished, "finish")
            self._release_done()
            self._measure_prefill(msg)
            self._measure_decode(msg)
            generated = self._generating.pop(msg.step, None)
            if generated:
                await self.policy.send(Served(dict(generated)))
        elif isinstance(msg, Wake):
            self._collect_aborts()
            self._stalled = False
        elif isinstance(msg, FlushCache):
            msg.done.set_result(self._flush_cache() if msg.what == "cache" else self._clear_storage())
        await self._schedule()
        await self._requeue_released()
        self.scheduler_s += time.perf_counter() - start

    async def _schedule(self) -> None:
        while self.in_flight < self.config.overlap_depth and not (self._stalled and self.in_flight > 0):
            if self._candidates is not None or self._pull_parked:
                candidates, self._candidates = self._candidates or [], None
                if not await self._round(candidates):
                    if self._idle() and not (self._pull_sent or self._pull_parked):
                        # An empty answer came after the last step ended: wait at the Policy
                        # for the next arrival, or nothing would ever wake this actor again.
                        await self._pull()
                    return
            elif self._pull_sent:
                return
            else:
                await self._requeue_released()  # before the Pull: the Policy ranks them too
                await self._pull()
                if not self._pull_parked:
                    return

    async def _pull(self) -> None:
        rows = 0 if self._latched() and self.chunked is None else self.kv.rows_free()
        preempt_priority = self._least_important_running() if rows == 0 else None
        if preempt_priority is not None:
            rows = 1  # the best waiting request, if it may preempt a running one
        block = self._idle() or self._queue_empty
        self._pull_sent, self._pull_parked = True, block
        await self.policy.send(Pull(
            max_reqs=rows, running_routing_keys=self._routing_keys(), block=block, preempt_priority=preempt_priority,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            kv_free=self.kv.free_slots() + self.kv.cache.evictable_size(), first_exit_s=self._first_exit_s(),
        ))

    def _first_exit_s(self) -> float | None:
        rounds = self.running.rounds_to_first_exit()
        if rounds is None or self.decode_step_s is None:
            return None
        return max(rounds, 0) * self.decode_step_s

    def _measure_decode(self, done: StepDone) -> None:
        if done.prefill_tokens or done.forward_s <= 0:
            return
        last = self.decode_step_s
        self.decode_step_s = done.forward_s if last is None else 0.8 * last + 0.2 * done.forward_s

    def _latched(self) -> bool:
        return self._batch_full and not self.config.enable_priority_scheduling

    def _measure_prefill(self, done: StepDone) -> None:
        # Steps of a few prompt tokens are mostly launch and decode time: they would understate
        # the rate.
        if done.prefill_tokens < PREFILL_SAMPLE_MIN_TOKENS or done.forward_s <= 0:
            return
        sample = done.prefill_tokens / done.forward_s
        last = self.prefill_tokens_per_s
        self.prefill_tokens_per_s = sample if last is None else 0.8 * last + 0.2 * sample

    def _idle(self) -> bool:
        return not (self.running or self._candidates) and self.chunked is None and self.in_flight == 0 and not self.ending

    def _least_important_running(self) -> int | None:
        """With every row taken, the priority a waiting request must beat to preempt (None: no
        preemption possible)."""
        if not self.config.enable_priority_scheduling or not self.running:
            return None
        return max((r.asked.priority for r in self.running), key=self.priority_rule.level)

    def _routing_keys(self) -> dict[str, int]:
        if self.config.effective_schedule_policy != "routing-key":
            return {}
        return dict(Counter(r.asked.routing_key for r in self.running if r.asked.routing_key is not None))

    async def _round(self, candidates: list[Req]) -> bool:
        """Form and launch one batch; False if there was nothing to launch."""
        # Running requests that an abort reaches are collected on the Wake that follows it.
        candidates = self._drop_aborted(candidates)
        batch, leftover = self._form_prefill(candidates)
        if batch is None and leftover and self._idle():
            # Nothing runs and the best candidate still does not fit: it never will. Refuse it
            # instead of pulling it again forever. (The Receiver's clamp makes this unreachable
            # for a request alone; it stays as the guard against pulling forever.)
            self._refuse_unfittable(leftover.pop(0))
        if leftover:
            await self._requeue(leftover, front=True)
        if batch is None:
            batch = self._form_decode()
        if batch is None and self._idle() and self.kv.has_kv_copies():
            # The host tier's copies travel with the next step, and an idle engine has none: a
            # step of copies alone, so the last request's blocks reach the host and storage now
            # (an engine stopped or restarted after it finds them there).
            batch = self._batch(ForwardMode.IDLE, [], [], [], [], [], [torch.empty(0, dtype=torch.int64)], [], [])
        if batch is None:
            self._stalled = True
            if self._idle():
                self.ratio.reset()
                self._batch_full = False
            return False
        self._stalled = False
        await self._launch(batch)
        return True

    async def _launch(self, batch: Batch) -> None:
        if self.config.fairness != "none":
            self._generating[batch.step] = generated_by_tenant(batch.reqs, batch.produces_token)
        self.in_flight += 1
        self.next_step += 1
        self.counters["steps"] += 1
        await self.executor.send(batch)

    async def _requeue_released(self) -> None:
        if self._to_requeue:
            reqs, self._to_requeue = self._to_requeue, []
            await self._requeue(reqs, front=False)

    async def _requeue(self, reqs: list[Req], front: bool) -> None:
        if reqs:
            # The queue is not empty now: the next Pull waits for its answer (a prefill of them
            # comes before another decode-only round).
            self._queue_empty = False
            await self.policy.send(Requeue(reqs=reqs, front=front))

    def _form_prefill(self, candidates: list[Req]) -> tuple[Batch | None, list[Req]]:
        """A prefill batch from the chunked request and the candidates; returns it and the
        candidates not admitted (in order)."""
        if not candidates and self.chunked is None:
            return None, []
        self._cache_chunked_prefix()
        mixed = self.config.enable_mixed_chunk and self.config.chunking_enabled and bool(self.running)
        adder = PrefillAdder(
            page_size=self.page_size,
            cache=self.kv.cache,
            free_slots=self.kv.free_slots(),
            running=self.running.synced(),
            new_token_ratio=self.ratio.value,
            max_prefill_tokens=self.config.max_prefill_tokens,
            chunked_prefill_size=self.config.chunked_prefill_size if self.config.chunking_enabled else None,
            mixed_decode_tokens=len(self.running) if mixed else 0,
            prefill_max_requests=self.config.prefill_max_requests,
            locks=self.kv,
        )
        if self.chunked is not None:
            adder.add_chunked_req(self.chunked)
        leftover = self._admit_candidates(adder, candidates)
        if not adder.admitted:
            return None, leftover
        # As SGLang: the decodes join only when neither they nor the new requests want logprobs.
        mixed = mixed and not any(r.asked.return_logprob for r in [*self.running, *adder.can_run])
        return self._prefill_batch(adder, mixed), leftover

    def _admit_candidates(self, adder: PrefillAdder, candidates: list[Req]) -> list[Req]:
        """SGLang's admission loop: with every row taken, a candidate may only preempt; a
        NO_TOKEN result (KV short) sets the batch-full latch and ends the round."""
        if self._latched():
            return candidates  # the chunked request alone goes on
        rows_left = self.kv.rows_free()
        for i, req in enumerate(candidates):
            if rows_left == 0:
                self._batch_full = True
                rows_left = self._preempt_for(adder, req)
                if rows_left == 0:
                    return candidates[i:]  # not matched, as SGLang breaks before matching
            # After a preemption too: releasing victims may have evicted what an earlier match found.
            prefetch, req.sched.prefetch = req.sched.prefetch, None
            free_before = self.kv.free_slots()
            match = self.kv.match(match_key(req), req.asked.extra_key, prefetch)  # type: ignore[arg-type]
            # A match continued from the host tier took free slots (SGLang's budget reads the pool live).
            adder.free_slots += self.kv.free_slots() - free_before
            result = adder.add_one_req(req, match, has_chunked_req=adder.new_chunked_req is not None)
            admitted = bool(adder.admitted) and adder.admitted[-1].req is req
            rows_left -= admitted
            if result != AddResult.CONTINUE:
                if result == AddResult.NO_TOKEN:
                    self._batch_full = True
                return candidates[i + admitted :]
        return []

    def _preempt_for(self, adder: PrefillAdder, req: Req) -> int:
        """Priority preemption (SGLang's `preempt_to_schedule`): running requests less important
        than `req` by more than the threshold leave and are requeued. Victims with no step in
        flight give their row and KV back now, so `req` is admitted in this same round, as in
        SGLang; a victim in an in-flight step keeps them until that step is done (the Adder's
        release rule), and `req` waits for that. Returns the rows freed now."""
        if not self.config.enable_priority_scheduling or any(e.kind in ("preempt", "retract") for e in self.ending):
            return 0  # while earlier victims still hold KV, preempting more would over-preempt
        need = adder.preemption_need(req, match_for_admission(self.kv.cache, req))
        victims = select_preemption_victims(req, adder.running, need, self.priority_rule, adder.reserved_tokens)
        if not victims:
            return 0
        survivors = len(adder.running)
        rows_before = self.kv.rows_free()
        for victim in victims:
            free_before = self.kv.free_slots()
            self._leave(victim, "preempt")
            self._release_done()
            survivors -= 1
            if victim.sched.req_row is None:  # released now: SGLang evicts for the survivors' decodes
                self.kv.make_room(survivors * RETRACT_DECODE_STEPS)
            adder.remove_running([victim], freed_slots=self.kv.free_slots() - free_before)
            self.counters["preemptions"] += 1
        return self.kv.rows_free() - rows_before

    def _cache_chunked_prefix(self) -> None:
        """Reference step 1: the computed part of the chunked request goes into the prefix cache."""
        if self.chunked is not None and self.chunked.sched.computed_len:
            self._cache_prefix(self.chunked, self.chunked.sched.computed_len)

    def _cache_prefix(self, req: Req, length: int) -> None:
        """The first `length` tokens of a running request go into the cache, so later requests
        match them before it finishes."""
        assert req.sched.req_row is not None
        self.kv.cache_prefix(req.sched.req_row, prefix_tokens(req, length), req.asked.extra_key)

    def _prefill_batch(self, adder: PrefillAdder, mixed: bool) -> Batch:
        step = self.next_step
        reqs: list[Req] = []
        rows: list[int] = []
        prefix_lens: list[int] = []
        lens: list[int] = []
        ids: list[list[int] | None] = []
        slots: list[torch.Tensor] = []
        produces: list[bool] = []
        done: list[Req] = []
        # Room for the whole batch at once, as SGLang's alloc_for_extend: the extends, and a page
        # per request where pages are larger than a token.
        pages = len(adder.admitted) * self.page_size if self.page_size > 1 else 0
        self.kv.make_room(sum(adm.extend_len for adm in adder.admitted) + pages)
        for adm in adder.admitted:
            req = adm.req
            slots.append(self._allocate_admission(adm))
            reqs.append(req)
            rows.append(req.sched.req_row)  # type: ignore[arg-type]
            prefix_lens.append(req.sched.computed_len)
            lens.append(adm.extend_len)
            ids.append(req.fill_ids[adm.prefix_len : adm.prefix_len + adm.extend_len])
            produces.append(not adm.truncated)
            req.sched.computed_len += adm.extend_len
            req.sched.last_step = step
            if not adm.truncated:
                req.sched.launched_outputs += 1
                if req.sched.launched_outputs >= req.asked.sampling.max_new_tokens:
                    done.append(req)
        was_chunked, self.chunked = self.chunked, adder.new_chunked_req
        mode = ForwardMode.EXTEND
        if mixed and self.kv.make_room(self._decode_slots_needed()) >= self._decode_slots_needed():
            n = len(self.running)
            slots.append(self.kv.extend_decode(self.running.rows, self.running.positions))
            reqs += self.running.reqs
            rows += self.running.rows_list
            prefix_lens += self.running.positions.tolist()
            lens += [1] * n
            ids += [None] * n
            produces += [True] * n
            done += self.running.advance(step)
            mode = ForwardMode.MIXED
        self.running.add(adm.req for adm in adder.admitted if not adm.truncated and (adm.req is was_chunked or adm.match is not None))
        # As SGLang does after a prefill: prompts are cached now, not when they finish. Last, so
        # that duplicate slots it frees are not handed to another row of this same step.
        for adm in adder.admitted:
            if not adm.truncated:
                self._cache_prefix(adm.req, adm.prefix_len + adm.extend_len)
        return self._batch(mode, reqs, rows, prefix_lens, lens, ids, slots, produces, done)

    def _allocate_admission(self, adm: Admission) -> torch.Tensor:
        req = adm.req
        if adm.match is not None:
            req.sched.req_row = self.kv.open_row(adm.match)
            if req.sched.admitted_time is None:
                req.sched.cached_tokens = adm.prefix_len
                req.sched.admitted_time = time.monotonic()
        assert req.sched.req_row is not None
        new_slots = self.kv.extend(req.sched.req_row, adm.extend_len)
        assert new_slots is not None, "the PrefillAdder budget guarantees the KV"
        return new_slots

    def _form_decode(self) -> Batch | None:
        """One token for every running request (each still needs one: a request leaves the
        running set when its last token is launched)."""
        retractions = self.counters["retractions"]
        if not self.running or not self._ensure_decode_memory() or not self.running:
            return None
        retracted = self.counters["retractions"] > retractions
        running = self.running
        n = len(running)
        slots = self.kv.extend_decode(self.running.rows, self.running.positions)
        prefix_lens = running.positions.tolist()
        reqs, rows = running.reqs, running.rows_list
        done = running.advance(self.next_step)
        if not retracted:
            self.ratio.decay()  # SGLang sets the ratio on a retracting step and decays it otherwise
        return self._batch(ForwardMode.DECODE, reqs, rows, prefix_lens, [1] * n, [None] * n, [slots], [True] * n, done)

    def _ensure_decode_memory(self) -> bool:
        """Make room for one more token per request: evict cache, else retract as SGLang's
        `retract_decode` does, one victim at a time until the next decode step fits (never the
        last request)."""
        if self._decode_fits():
            return True
        if self.in_flight > 0 or self.ending:
            return False  # memory comes back when in-flight steps report; wait for them

        def release_and_check(victims: list[Req], stays: list[Req]) -> bool:
            self._leave(victims[-1], "retract")
            self._release_done()  # nothing is in flight: the victim's KV is free now
            self.kv.make_room(len(stays) * RETRACT_DECODE_STEPS)  # as SGLang's release_req
            return self._decode_fits()

        victims, new_ratio = select_retraction_victims(self.running.synced(), release_and_check)
        self.counters["retractions"] += len(victims)
        if victims:
            self.ratio.set(new_ratio)
        if self._decode_fits():
            return True
        # One request alone cannot fit: it cannot finish, so it ends now (SGLang raises instead).
        for req in list(self.running):
            self._finish_with_error(req, "the KV pool is too small for this request to continue")
        self._release_done()
        return False

    def _decode_fits(self) -> bool:
        need = self._decode_slots_needed()
        return self.kv.make_room(need) >= need

    def _decode_slots_needed(self) -> int:
        return self.kv.decode_slots_needed(self.running.positions)

    def _batch(
        self,
        mode: ForwardMode,
        reqs: list[Req],
        rows: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        extend_ids: list[list[int] | None],
        slots: list[torch.Tensor],
        produces_token: list[bool],
        done: list[Req],
    ) -> Batch:
        """The step's batch; `done` are the requests whose last token it launches: they leave
        the running set now and are released once the step has reported (no wasted step)."""
        if done:
            self._leave_all(done, "finish")
        ending = {id(req) for req in done}
        return Batch(
            step=self.next_step,
            mode=mode,
            reqs=reqs,
            rows=rows,
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            extend_ids=extend_ids,
            out_cache_loc=slots[0] if len(slots) == 1 else torch.cat(slots),
            produces_token=produces_token,
            final_token=[id(req) in ending for req in reqs],
            kv_copies=self.kv.take_kv_copies(),
        )

    def _leave_all(self, reqs: list[Req], kind: str) -> None:
        """Take requests out of the running set (or the chunked slot); their KV is released
        after their last step is done. A request already leaving, or listed twice, leaves once."""
        if not reqs:
            return
        left = self.running.remove(reqs)
        if left:
            self._batch_full = False  # SGLang clears batch_is_full when the batch shrinks
        leaving = {e.req for e in self.ending}
        for req in reqs:
            if req in left:
                left.discard(req)
            elif self.chunked is req:
                self.chunked = None
            elif req in leaving:
                continue
            leaving.add(req)
            self.ending.append(_Ending(req, kind))

    def _leave(self, req: Req, kind: str) -> None:
        self._leave_all([req], kind)

    def _release_done(self) -> None:
        keep: list[_Ending] = []
        requeue: list[Req] = []
        for ending in self.ending:
            if ending.req.sched.last_step > self.done_step:
                keep.append(ending)
                continue
            req = ending.req
            self._release(req, cache_it=ending.kind == "finish" and not req.sched.abort_requested)
            if ending.kind == "finish" and req.sched.abort_requested and not req.finished:
                # Its last token was launched, then the abort came: the OutputProcessor skips an
                # aborted request's tokens, so it ends here.
                self._abort(req)
            elif ending.kind in ("retract", "preempt") and not req.finished:
                if req.sched.abort_requested:
                    self._abort(req)
                else:
                    self._reset_for_requeue(req)
                    requeue.append(req)
        self.ending = keep
        self._to_requeue.extend(requeue)

    def _release(self, req: Req, cache_it: bool) -> None:
        if req.sched.req_row is not None:
            self.kv.close_row(req.sched.req_row, req.fill_ids if cache_it else None, req.asked.extra_key)
            req.sched.req_row = None

    def _reset_for_requeue(self, req: Req) -> None:
        req.sched.computed_len = 0
        req.sched.launched_outputs = len(req.out.output_ids)
        req.sched.enqueue_time = time.monotonic()

    def _collect_aborts(self) -> None:
        for req in [r for r in self.running if r.sched.abort_requested] + ([self.chunked] if self.chunked and self.chunked.sched.abort_requested else []):
            self._leave(req, "abort")
            self._abort(req)
        self._release_done()

    def _drop_aborted(self, candidates: list[Req]) -> list[Req]:
        keep = []
        for req in candidates:
            if req.sched.abort_requested:
                self._abort(req)
            else:
                keep.append(req)
        return keep

    def _refuse_unfittable(self, req: Req) -> None:
        pool = self.kv.allocator.size
        self._abort(req, FinishReason(
            "abort", status=400, code="invalid_request_error", param="max_new_tokens",
            message=f"the request needs {len(req.fill_ids)} prompt tokens and up to {req.max_new_tokens} new tokens "
            f"of KV, which an idle engine with a KV pool of {pool} tokens cannot hold",
        ))

    def _finish_with_error(self, req: Req, message: str) -> None:
        if req.sched.req_row is not None:
            self._leave(req, "abort")
        self._abort(req, FinishReason("abort", message=message, status=500))

    def _abort(self, req: Req, reason: FinishReason | None = None) -> None:
        end_request(req, reason or FinishReason("abort"))
        self.counters["aborted"] += 1

    def _host_tier_stats(self) -> dict[str, int | float]:
        host = self.kv.host_tier
        if host is None:
            return {}
        return {
            "hicache_host_tokens": host.size, "hicache_host_cached": host.stored_tokens(),
            "hicache_host_hit_tokens": host.stats.loaded_tokens, "hicache_stored_tokens": host.stats.stored_tokens,
            "hicache_evicted_tokens": host.stats.evicted_tokens,
            **self._storage_tier_stats(),
        }

    def _storage_tier_stats(self) -> dict[str, int | float]:
        storage = self.storage
        if storage is None or self.kv.host_tier is None:
            return {}
        stats = storage.stats
        return {
            "hicache_storage_hit_tokens": self.kv.host_tier.stats.adopted_tokens,
            "hicache_storage_written_blocks": stats.written_blocks, "hicache_storage_written_bytes": stats.written_bytes,
            "hicache_storage_write_s": stats.write_s, "hicache_storage_dropped_writes": stats.dropped_writes,
            "hicache_storage_read_blocks": stats.read_blocks, "hicache_storage_read_bytes": stats.read_bytes,
            "hicache_storage_read_s": stats.read_s, "hicache_storage_corrupt_blocks": stats.corrupt_blocks,
        }

    def _flush_cache(self) -> bool:
        if self.running or self.chunked or self.ending or self.in_flight:
            return False
        self.kv.flush_cache()
        return True

    def _clear_storage(self) -> bool:
        if self.storage is None:
            return False
        self.storage.clear()
        return True

    def stats(self) -> dict[str, Any]:
        """The Adder's part of the core's `CoreStats` (runtime/stats.py), by field name."""
        return {
            "kv_pool_size": self.kv.allocator.size,
            "kv_free": self.kv.free_slots(),
            "kv_cached": self.kv.cache.total_size(),
            "kv_evictable": self.kv.cache.evictable_size(),
            "num_running": len(self.running) + (self.chunked is not None),
            "new_token_ratio": self.ratio.value,
            "steps": self.counters["steps"],
            "retractions": self.counters["retractions"],
            "preemptions": self.counters["preemptions"],
            "aborted": self.counters["aborted"],
            "scheduler_s": self.scheduler_s,
            "rows_free": self.kv.rows_free(),
            "rows_total": self.kv.req_to_token.max_requests,
            "kv_protected": self.kv.cache.protected_size(),
            **self._host_tier_stats(),
            "adder_idle": self._idle(),
        }
