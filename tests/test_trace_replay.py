"""bench/trace_replay.py on a small trace whose hits can be counted by hand."""

from __future__ import annotations

import json
from pathlib import Path

from bench.trace_replay import BLOCK, TraceRequest, hit_rate_over_time, main, prompt_tokens, read_trace, replay

# Request 2 repeats request 0's two blocks and adds one; request 3 shares request 1's first block.
TRACE = [
    {"timestamp": 0, "input_length": 2 * BLOCK, "output_length": 4, "hash_ids": [0, 1]},
    {"timestamp": 10, "input_length": 2 * BLOCK, "output_length": 4, "hash_ids": [2, 3]},
    {"timestamp": 20, "input_length": 3 * BLOCK, "output_length": 4, "hash_ids": [0, 1, 4]},
    {"timestamp": 30, "input_length": BLOCK + 100, "output_length": 4, "hash_ids": [2, 5]},
]


def _trace(tmp_path: Path) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in TRACE))
    return str(path)


def test_prompts_are_built_from_their_blocks():
    a, b = (prompt_tokens(TraceRequest(**r)) for r in TRACE[:2])
    assert len(a) == 2 * BLOCK and a[:2] == [1, 2] and a[BLOCK] == BLOCK + 1
    assert b[0] == 2 * BLOCK + 1


def test_hits_add_up_for_an_unbounded_and_a_small_pool(tmp_path: Path):
    trace = read_trace(_trace(tmp_path))
    total = sum(r["input_length"] for r in TRACE)
    unbounded = replay(trace, "unbounded", total + BLOCK, page_size=16)
    # request 2 finds request 0's 1,024 tokens; request 3 finds request 1's first block
    assert unbounded.device_hit_tokens == 2 * BLOCK + BLOCK and unbounded.host_hit_tokens == 0
    assert unbounded.prompt_tokens == total
    small = replay(trace, "small", 3 * BLOCK + 64, page_size=16)
    assert small.device_hit_tokens < unbounded.device_hit_tokens
    tiered = replay(trace, "tiered", 3 * BLOCK + 64, host_tokens=8 * BLOCK, page_size=16)
    assert tiered.device_hit_tokens + tiered.host_hit_tokens == unbounded.device_hit_tokens
    assert tiered.host_hit_tokens > 0


def test_the_command_prints_a_row_per_cache_and_writes_json(tmp_path: Path, capsys):
    out = tmp_path / "out.jsonl"
    assert main(["--trace", _trace(tmp_path), "--device-tokens", str(3 * BLOCK + 64), "--page-size", "16",
                 "--host-ratio", "2", "--output", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["cache"].split(",")[0] for r in rows] == ["unbounded", "radix", "+ host 2x"]
    assert all(abs(r["prefill_tokens_saved"] / r["prompt_tokens"] - r["hit_rate"]) < 1e-4 for r in rows)
    assert "unbounded" in capsys.readouterr().out


def test_the_plot_has_a_hit_rate_line_per_cache(tmp_path: Path):
    """Issue 41's trace-replay figure: read back from the SVG, a line (gid run<i>) per cache."""
    out = tmp_path / "hits.svg"
    assert main(["--trace", _trace(tmp_path), "--device-tokens", str(3 * BLOCK + 64), "--page-size", "16",
                 "--host-ratio", "2", "--plot", str(out), "--plot-window-s", "0.01"]) == 0
    svg = out.read_text()
    assert [f'id="run{i}"' in svg for i in range(4)] == [True, True, True, False]
    assert "unbounded" in svg and "+ host 2x" in svg and "trace time (min)" in svg


def test_hit_rate_over_time_divides_each_window():
    r = replay(read_trace_from(TRACE), "unbounded", 100 * BLOCK, page_size=16)
    minutes, rates = hit_rate_over_time(r, window_s=0.015)  # requests at 0, 10, 20, 30 ms: windows 0, 0, 1, 2
    assert [round(m * 60, 3) for m in minutes] == [0.0, 0.015, 0.03]
    assert rates == [0.0, 2 * BLOCK / (3 * BLOCK), BLOCK / (BLOCK + 100)]


def read_trace_from(rows: list[dict]) -> list[TraceRequest]:
    return [TraceRequest(**row) for row in rows]
