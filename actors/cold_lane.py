"""The cold lane (`--cold-lane-share F`): under lpm and dfs-weight, a share of admissions for the
oldest waiting requests that the prefix cache does not help.

Why: lpm hands every freed slot to the best cache match, so above capacity a cold prompt waits
without bound while hot requests keep arriving; aging only lets it catch up with the oldest
waiting request. The lane serves cold prompts ahead of older hot ones in a bounded share.

Rule: a request is cold while its cached prefix covers less than `cold_lane_threshold` of its
prompt; the lane is the cold requests, oldest first. A credit c (starts at 0) is carried across
rounds; each position of the policy's order adds F, then the lane's oldest takes the position if
c >= 1 (c -= 1), else the policy's next does; with the lane empty c is capped at 1, so no credit
is banked for a later burst. Only admitted positions count: the next round restores c to its
value after the last plan's admitted prefix (read off the queue), so handed-back candidates cost
the lane nothing.

Bounds (n admissions, A admissions/s; tests/test_cold_lane.py checks them on a simulated clock):
- Share: the lane takes at most floor(n * F) + 1 of any n consecutive admissions.
- Cold wait: a request R cold from arrival, with C_R cold requests queued ahead of it, is among
  the first ceil((C_R + 1) / F) admissions after it arrives, whatever the hot queue holds (plain
  lpm: no bound; aging alone: (B + L * S) / A with B every request queued ahead).
- With aging: aging's bound (actors/policy_order.py) holds for every admission except the lane's,
  so for F < 1 R is among the first floor((B_R + W_R + 1) / (1 - F)) + 1 admissions (B_R queued at
  its arrival, W_R arriving within (D + 1) * S). Aging then bounds lpm's starvation inside the hot
  class, which a lane alone exposes.

The lane only takes requests of the best priority waiting, so it never passes a more important
request; requests held back by lpm's in-batch check may still be taken.
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
        self._plan = [(req, req.sched.enqueue_time) for req in out]
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
        queued = {id(req): req.sched.enqueue_time for req in queue}
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
    positions = sorted((i for i, req in enumerate(order) if id(req) in cold), key=lambda i: order[i].sched.enqueue_time)
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
