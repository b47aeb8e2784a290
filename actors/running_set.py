"""RunningSet: the Adder's requests whose prompt is fully launched, kept as columns.

Every decode round adds one token to each member, so their progress is one shared count: a
round is a few array operations, not a Python pass over hundreds of requests (positions are numpy:
on the scheduling loop a numpy call costs less than a torch call).

A request's own counters (`computed_len`, `launched_outputs`, `last_step`) lag behind while it
runs; the Adder calls `synced()` before any decision that reads them, and a leaving request is
synced.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import torch

from runtime.req import Req


class RunningSet:
    def __init__(self) -> None:
        self._reqs: list[Req] = []  # never mutated in place: a Batch may hold it
        self._rows_list: list[int] = []  # likewise
        self._rows = torch.empty(0, dtype=torch.int64)
        self._positions = np.empty(0, dtype=np.int64)  # each request's computed_len, now
        self._round = 0
        self._round_step = -1  # the step of the latest round
        self._synced_round: dict[Req, int] = {}  # the members, and the round their counters show
        self._last_round: dict[Req, int] = {}  # the round that launches a member's last token
        self._ending_at: dict[int, list[Req]] = {}  # round -> members whose last token it launches

    def __len__(self) -> int:
        return len(self._reqs)

    def __bool__(self) -> bool:
        return bool(self._reqs)

    def __iter__(self) -> Iterator[Req]:
        return iter(self._reqs)

    def __contains__(self, req: Req) -> bool:
        return req in self._synced_round

    @property
    def reqs(self) -> list[Req]:
        """The members in order (counters possibly behind: see `synced`). Do not mutate."""
        return self._reqs

    @property
    def rows(self) -> torch.Tensor:
        return self._rows

    @property
    def rows_list(self) -> list[int]:
        return self._rows_list

    @property
    def positions(self) -> np.ndarray:
        """The position each member's next token goes to (its computed_len). Do not mutate."""
        return self._positions

    def add(self, reqs: Iterable[Req]) -> None:
        added = [r for r in reqs if r not in self._synced_round]
        if not added:
            return
        for req in added:
            assert req.sched.req_row is not None, "a running request holds a row"
            self._synced_round[req] = self._round
            last = self._round + req.asked.sampling.max_new_tokens - req.sched.launched_outputs
            if last > self._round:
                self._last_round[req] = last
                self._ending_at.setdefault(last, []).append(req)
        self._reqs = self._reqs + added
        self._rows_list = self._rows_list + [r.sched.req_row for r in added]  # type: ignore[misc]
        self._rows = torch.tensor(self._rows_list, dtype=torch.int64)
        self._positions = np.concatenate([self._positions, np.array([r.sched.computed_len for r in added], dtype=np.int64)])

    def remove(self, reqs: Iterable[Req]) -> set[Req]:
        """Take these requests out (the others in `reqs` are ignored); returns the ones that were
        members, their counters synced."""
        gone = {r for r in reqs if r in self._synced_round}
        if not gone:
            return gone
        for req in gone:
            self.sync(req)
            del self._synced_round[req]
            self._last_round.pop(req, None)
        keep = [r not in gone for r in self._reqs]
        self._reqs = [r for r, k in zip(self._reqs, keep) if k]
        self._rows_list = [row for row, k in zip(self._rows_list, keep) if k]
        self._rows, self._positions = self._rows[torch.tensor(keep)], self._positions[np.array(keep)]
        return gone

    def advance(self, step: int) -> list[Req]:
        """Every member gets one more token, launched by `step`; returns the members whose last
        token that is (still members: the caller removes them)."""
        self._positions += 1
        self._round += 1
        self._round_step = step
        done = []
        for req in self._ending_at.pop(self._round, []):
            if self._last_round.get(req) == self._round:  # not an entry from an earlier stay
                del self._last_round[req]
                done.append(req)
        return done

    def rounds_to_first_exit(self) -> int | None:
        """Decode rounds until the first member's last token is launched (a lower bound: entries
        of requests that left are not pruned)."""
        return min(self._ending_at) - self._round if self._ending_at else None

    def sync(self, req: Req) -> None:
        behind = self._round - self._synced_round[req]
        if behind:
            req.sched.computed_len += behind
            req.sched.launched_outputs += behind
            req.sched.last_step = self._round_step
            self._synced_round[req] = self._round

    def synced(self) -> list[Req]:
        for req in self._reqs:
            self.sync(req)
        return self._reqs
