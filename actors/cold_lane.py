"""The cold lane (`--cold-lane-share F`): under lpm and dfs-weight, a share of admissions for the
oldest waiting requests that the prefix cache does not help.

lpm hands every freed slot to the best cache match, so while hot requests keep arriving a cold
prompt waits until the hot queue is empty: without bound above capacity. Aging only lets it
catch up with the oldest waiting request. The lane serves cold prompts ahead of older hot ones, in
a bounded share, so a cold request waits for the cold backlog ahead of it and not for the hot
queue, while the hot requests keep at least 1 - F of the admissions (and their cache locality).

The rule. A waiting request is *cold* in a round while its cached prefix covers less than
`cold_lane_threshold` (θ) of its prompt; the lane is the cold requests, oldest enqueue time first.
A credit c in [0, 1] (it starts at 0) is carried from round to round. Walking the positions of the
policy's order, each position adds F to c; then if c >= 1 and the lane holds a request not yet
placed, the lane's oldest takes the position and c drops by 1, otherwise the policy's next
request does, and if the lane is empty c is capped at 1 (no credit is banked while nothing cold
waits: a later burst of cold prompts cannot take a run of slots). Only positions the Adder
admitted count: the next round reads them off the queue it orders (the requests of the last plan
gone from its front, or back with a new enqueue time, were admitted) and restores c to what it was
after them, so candidates the Adder handed back cost the lane nothing.

The bounds (F in (0, 1]; n counts admissions, A is the admission rate in requests/s):

- Share. c stays in [0, 1], so in any n consecutive admissions the lane takes at most
  floor(n * F) + 1: at most that many admissions leave the policy's order, which bounds the cache
  thrash the lane can add, and the others keep at least 1 - F of the admissions.
- Cold wait. Let R be a request that stays cold from its arrival, and C_R the requests enqueued
  before it and still waiting when it arrived that the lane serves before it (at most the cold
  backlog ahead of it: the lane is oldest first, so nothing younger goes first). While R waits the
  lane is never empty, so after n admissions c = c0 + n * F - k < 1 with k the lane's picks, i.e.
  k > n * F - 1, and each of those picks is one of the C_R. So R is among the first
  ceil((C_R + 1) / F) admissions after its arrival, a wait of at most (C_R + 1) / (F * A)
  whatever the hot queue holds (plain lpm: no bound; aging: (B + L * S) / A with B *every*
  request queued ahead of R and L the arrival rate).
- With aging (`--priority-aging-s S`). The lane passes aging levels, so aging's bound of
  actors/policy_order.py holds for every admission except the lane's: nothing from outside R's
  window (D + 1) * S is admitted before R other than a lane pick. By the share bound at least
  n * (1 - F) - 1 of n admissions follow the aged order, and at most B_R + W_R of those come
  before R (B_R queued at its arrival, W_R arriving in its window), so for F < 1 R is among the
  first floor((B_R + W_R + 1) / (1 - F)) + 1 admissions after its arrival. Aging keeps lpm's own
  starvation inside the hot class in check (a hot request one matched token short of the others
  waits until the hot queue drains, which with a lane serving the cold ones may be never).

Priority scheduling: the lane only takes requests of the best priority waiting, so it never moves
a request ahead of a more important one; the cold wait bound holds while R's priority is the best
waiting. Requests held back by lpm's in-batch prefix check may still be taken by the lane (its
bounds do not depend on them). tests/test_cold_lane.py checks the bounds on a simulated clock with
the real QueueOrderer.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from fractions import Fraction

from runtime.req import Req

# F is kept as the nearest fraction with at most this denominator (at least 1 / it): the bounds
# hold for that fraction exactly.
SHARE_DENOMINATOR = 10_000


class ColdLane:
    """Interleaves the lane into each round's order; owned by the Policy's QueueOrderer."""

    def __init__(self, share: float) -> None:
        assert 0.0 < share <= 1.0
        # Integer credit in units of 1/unit: a float sum of 0.1s falls short of 1 after ten
        # positions and would break the bound by a position.
        step = max(Fraction(share).limit_denominator(SHARE_DENOMINATOR), Fraction(1, SHARE_DENOMINATOR))
        self.share = step
        self._step, self._unit = step.numerator, step.denominator
        self._credit = 0
        # The last round's placement: each request with its enqueue time then, and the credit
        # before each position (one more entry than requests: the credit after the last).
        self._plan: list[tuple[Req, float]] = []
        self._trace: list[int] = []

    @property
    def credit(self) -> Fraction:
        return Fraction(self._credit, self._unit)

    def interleave(self, order: Sequence[Req], cold: set[int], priorities: Sequence[int] | None) -> list[Req]:
        """`order` (the policy's, levels applied) with the lane's picks moved forward. `cold`
        holds the id() of each cold request; `priorities` (lower first, None: priority
        scheduling off) keep the lane to the best priority still waiting."""
        self._settle(order)
        credit, step, unit = self._credit, self._step, self._unit
        lanes, best = _lanes(order, cold, priorities)
        placed = bytearray(len(order))
        out: list[Req] = []
        trace = [credit]
        p = 0  # the policy's next unplaced position
        for _ in range(len(order)):
            while placed[p]:
                p += 1
            lane = lanes.get(best.first())
            while lane and placed[lane[0]]:
                lane.popleft()  # the policy placed it already
            credit += step
            if lane and credit >= unit:
                i = lane.popleft()
                credit -= unit
            else:
                i = p
                if not lane:
                    credit = min(credit, unit)
            placed[i] = 1
            best.remove(priorities[i] if priorities is not None else 0)
            out.append(order[i])
            trace.append(credit)
        self._plan = [(req, req.enqueue_time) for req in out]
        self._trace = trace
        return out

    def pause(self) -> None:
        """A round without the lane (lpm fell back to fcfs): settle nothing later against it."""
        self._plan, self._trace = [], []

    def _settle(self, queue: Sequence[Req]) -> None:
        """Set the credit to what it was after the positions of the last plan that were admitted:
        the Adder admits a prefix of what it is handed and gives the rest back unchanged, so the
        admitted ones are the leading requests of the plan no longer queued as they were."""
        if not self._plan:
            return
        queued = {id(req): req.enqueue_time for req in queue}
        taken = 0
        for req, enqueued in self._plan:
            if queued.get(id(req)) == enqueued:
                break
            taken += 1
        self._credit = self._trace[taken]
        self.pause()


def _lanes(order: Sequence[Req], cold: set[int], priorities: Sequence[int] | None) -> tuple[dict[int, deque[int]], _Best]:
    """Positions of the cold requests, oldest first (ties keep the policy's order), per priority;
    and the count of requests per priority."""
    keys = priorities if priorities is not None else [0] * len(order)
    positions = sorted((i for i, req in enumerate(order) if id(req) in cold), key=lambda i: order[i].enqueue_time)
    lanes: dict[int, deque[int]] = {}
    for i in positions:
        lanes.setdefault(keys[i], deque()).append(i)
    return lanes, _Best(keys)


class _Best:
    """The best (lowest) priority among the requests not placed yet."""

    def __init__(self, keys: Sequence[int]) -> None:
        self.left = Counter(keys)
        self.keys = sorted(self.left)
        self.at = 0

    def first(self) -> int | None:
        return self.keys[self.at] if self.at < len(self.keys) else None

    def remove(self, key: int) -> None:
        self.left[key] -= 1
        while self.at < len(self.keys) and not self.left[self.keys[self.at]]:
            self.at += 1
