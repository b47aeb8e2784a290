"""bench/scheduling.py: its figures on hand-made outcomes, and one small run through the engine."""

from __future__ import annotations

import pytest

from bench import scheduling
from bench.scheduling import Job, Outcome, fairness, overtaken_from_outside_window
from bench.workloads import Request


def _outcome(klass: str, sent: float, admitted: float, prompt: int = 10, tokens: list[tuple[float, int]] | None = None, priority: int = 0) -> Outcome:
    job = Job(Request(0, [1] * prompt, 4, priority=priority), klass)
    times = tokens if tokens is not None else [(admitted + 0.01, 1)]
    return Outcome(job, sent, times[-1][0], admitted - sent, prompt, 0, times)


def test_overtaking_counts_only_requests_from_outside_the_window():
    outs = [
        _outcome("p0", sent=0.0, admitted=5.0),  # waited 5 s
        _outcome("p10", sent=0.5, admitted=1.0, priority=10),  # overtook it from 0.5 s after it...
        _outcome("p10", sent=3.0, admitted=3.5, priority=10),  # ...and from 3 s after it
    ]
    # With S = 0.1 s the priority-0 request's window is (10 + 1) * 0.1 = 1.1 s: one overtaker is outside.
    assert overtaken_from_outside_window(outs, 0.1, best=10) == 1
    assert overtaken_from_outside_window(outs, 1.0, best=10) == 0  # an 11 s window holds both


def test_the_service_gap_counts_from_the_start_of_each_common_backlog():
    a = [_outcome("a", 0.0, 0.02, prompt=100, tokens=[(0.1, 10)]), _outcome("a", 0.0, 1.0, prompt=100, tokens=[(1.1, 10)])]
    b = [_outcome("b", 0.0, 0.5, prompt=30, tokens=[(0.6, 5)])]
    # Both wait from 0 to 0.5 s (a's second request until 1.0, b's until 0.5): a's first request
    # is admitted at 0.02 (100) and streams 10 tokens at 0.1 (20): 120 against b's nothing.
    assert fairness(a + b, step_s=0.05).gap == pytest.approx(120.0)
    assert fairness(a + b, step_s=0.05).jain == pytest.approx(0.5)  # a got all of it
    late_b = [_outcome("b", 2.0, 2.5, prompt=30, tokens=[(2.6, 5)]), _outcome("b", 2.0, 3.0, prompt=30, tokens=[(3.1, 5)])]
    late_a = [_outcome("a", 2.0, 4.0, prompt=100, tokens=[(4.1, 10)])]
    # A second common backlog (2.0 to 3.0 s) counts from its own start: b gets 30 + 2 * 5 = 40 by
    # 2.6, nothing of a's earlier 120 counts.
    assert fairness(late_b + late_a, step_s=0.05).gap == pytest.approx(40.0)


@pytest.mark.parametrize("workload", ["tenants", "w5"])
def test_a_small_run_prints_its_table(workload, capsys):
    small = ["--w5-requests", "60", "--w5-aging", "0.5", "--tenant-requests", "60", "--max-running", "16", "--pool-tokens", "20000"]
    scheduling.main(["--workload", workload, "--device-model", "h100-qwen3-8b", *small])
    out = capsys.readouterr().out
    assert ("lpm + vtc" in out) if workload == "tenants" else ("+ aging 0.5 s" in out and "largest wait / bound" in out)


def test_a_small_lpm_run_compares_the_cold_lane_with_plain_lpm(capsys):
    small = ["--lpm-requests", "60", "--lpm-aging", "", "--lpm-cold-lane", "0.5", "--lpm-cold-lane-aging", "0.1",
             "--max-running", "16", "--pool-tokens", "40000"]
    scheduling.main(["--workload", "lpm", "--device-model", "h100-qwen3-8b", *small])
    out = capsys.readouterr().out
    for name in ("lpm", "lpm + cold lane 0.5", "lpm + cold lane 0.5 + aging 0.1 s"):
        assert out.count(f"| {name} |") == 3, name  # the cold and hot rows, and the summary's
    # The summary compares each setting with plain lpm: lpm's own row is the reference.
    reference = next(line for line in out.splitlines() if line.startswith("| lpm |") and "x |" in line)
    assert "| +0.0 |" in reference and "| 1.0x |" in reference


def test_the_slo_needs_both_ttft_and_tpot():
    def run(first: float, last: float, tokens: int) -> Outcome:
        return _outcome("x", 0.0, 0.0, tokens=[(first, 1), (last, tokens - 1)])

    assert scheduling.meets_slo(run(0.1, 0.1 + 10 * 0.03, 11))  # 100 ms, 30 ms per token
    assert not scheduling.meets_slo(run(0.1, 0.1 + 10 * 0.06, 11))  # 60 ms per token
    assert not scheduling.meets_slo(run(0.6, 0.6 + 10 * 0.03, 11))  # first token at 600 ms
