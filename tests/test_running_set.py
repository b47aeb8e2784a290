"""RunningSet against a plain model: per-request counters advanced one by one."""

from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from actors.running_set import RunningSet
from runtime.req import CallerRequest, Req
from runtime.sampling_params import SamplingParams


def _req(row: int, computed: int, launched: int, max_new: int) -> Req:
    req = Req(CallerRequest(rid=f"r{row}", input_ids=[1] * computed, sampling=SamplingParams(max_new_tokens=max_new)))
    req.sched.req_row, req.sched.computed_len, req.sched.launched_outputs = row, computed, launched
    return req


class RunningSetMachine(RuleBasedStateMachine):
    """The model keeps each member's counters as plain ints and advances them every round; the
    set must report the same members, positions, finished requests and (once synced) counters."""

    def __init__(self) -> None:
        super().__init__()
        self.running = RunningSet()
        self.members: list[Req] = []
        self.model: dict[Req, list[int]] = {}  # req -> [computed_len, launched_outputs, last_step]
        self.outside: list[Req] = []  # removed requests that may come back (retracted, requeued)
        self.next_row = 1
        self.step = 0

    @rule(computed=st.integers(1, 50), launched=st.integers(0, 3), extra=st.integers(1, 6))
    def add_new(self, computed: int, launched: int, extra: int) -> None:
        req = _req(self.next_row, computed, launched, launched + extra)
        self.next_row += 1
        self._add(req)

    @rule(data=st.data())
    def add_back(self, data: st.DataObject) -> None:
        """A request that left comes back with reset counters (a retracted one, re-prefilled)."""
        if not self.outside:
            return
        req = self.outside.pop(data.draw(st.integers(0, len(self.outside) - 1)))
        req.sched.computed_len = data.draw(st.integers(1, 80))
        req.sched.launched_outputs = data.draw(st.integers(0, req.asked.sampling.max_new_tokens - 1))
        self._add(req)

    def _add(self, req: Req) -> None:
        self.running.add([req])
        self.members.append(req)
        self.model[req] = [req.sched.computed_len, req.sched.launched_outputs, req.sched.last_step]

    @rule()
    def advance(self) -> None:
        self.step += 1
        done = self.running.advance(self.step)
        expected = []
        for req in self.members:
            counters = self.model[req]
            counters[0] += 1
            counters[1] += 1
            counters[2] = self.step
            if counters[1] >= req.asked.sampling.max_new_tokens:
                expected.append(req)
        # In any order (a request added back may precede one that stayed), each one once.
        assert sorted(r.rid for r in done) == sorted(r.rid for r in expected)
        self._remove(done)  # as the Adder does: a request whose last token launched leaves

    @rule(data=st.data())
    def remove_some(self, data: st.DataObject) -> None:
        chosen = data.draw(st.lists(st.sampled_from(self.members), max_size=4)) if self.members else []
        self._remove(chosen)

    def _remove(self, reqs: list[Req]) -> None:
        stranger = _req(10_000, 5, 0, 3)  # never added: ignored
        gone = self.running.remove([*reqs, stranger])
        assert gone == set(reqs)
        for req in dict.fromkeys(reqs):  # in a fixed order: hypothesis replays the draws
            assert [req.sched.computed_len, req.sched.launched_outputs, req.sched.last_step] == self.model.pop(req)
            self.members.remove(req)
            self.outside.append(req)

    @rule()
    def sync_all(self) -> None:
        for req in self.running.synced():
            assert [req.sched.computed_len, req.sched.launched_outputs, req.sched.last_step] == self.model[req]

    @invariant()
    def columns_match(self) -> None:
        assert self.running.reqs == self.members
        assert len(self.running) == len(self.members)
        assert self.running.rows_list == [r.sched.req_row for r in self.members]
        assert self.running.rows.tolist() == self.running.rows_list
        assert self.running.positions.tolist() == [self.model[r][0] for r in self.members]
        assert self.running.positions.dtype == np.int64
        assert all(r in self.running for r in self.members)
        assert not any(r in self.running for r in self.outside)


TestRunningSet = RunningSetMachine.TestCase
TestRunningSet.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_a_batch_keeps_its_request_list_after_the_set_changes() -> None:
    """A launched Batch holds `reqs` and `rows_list`: later changes must not alter them."""
    running = RunningSet()
    a, b = _req(1, 4, 1, 5), _req(2, 6, 1, 5)
    running.add([a, b])
    reqs, rows = running.reqs, running.rows_list
    running.remove([a])
    running.add([_req(3, 2, 0, 2)])
    assert reqs == [a, b] and rows == [1, 2]
