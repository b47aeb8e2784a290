"""Smoke runs of the benchmark modules that had no test (bench/dp, gpu_check, grammar,
http_overhead, prefix_cache, router_http), each on its smallest settings: it runs to the end, and
the numbers it prints agree with each other (counts add up, ratios follow from the printed times)
and with what the workload fixes (tokens asked for, hits the tree was built to give)."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from bench.workloads import make_workload


def _rows(out: str, first_cell: str = "") -> list[list[str]]:
    """The cells of every Markdown table row whose first cell starts with `first_cell` (header
    rows, the ones above a `| --- |` rule, and the rules excluded)."""
    lines = out.splitlines()
    rows = []
    for line, below in zip(lines, [*lines[1:], ""]):
        if not line.startswith("| ") or line.startswith("| ---") or below.startswith("| ---"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0].startswith(first_cell):
            rows.append(cells)
    return rows


def _number(cell: str) -> float:
    return float(cell.split()[0].replace(",", "").rstrip("%x"))


def _run_main(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], module, *argv: str) -> str:
    monkeypatch.setattr(sys, "argv", [module.__name__, *argv])
    module.main()
    return capsys.readouterr().out


def _ratio_fits(ratio: float, num: float, den: float, steps: tuple[float, float, float]) -> bool:
    """`ratio` can be num / den, each printed rounded to its step in `steps` (num, den, ratio)."""
    num_step, den_step, ratio_step = steps
    low = (num - num_step / 2) / (den + den_step / 2)
    high = (num + num_step / 2) / max(den - den_step / 2, 1e-12)
    return low - ratio_step / 2 <= ratio <= high + ratio_step / 2


# --- bench.prefix_cache -------------------------------------------------------------------------
def test_prefix_cache_hits_are_the_ones_the_tree_was_built_for(monkeypatch, capsys):
    from bench import prefix_cache

    out = _run_main(monkeypatch, capsys, prefix_cache, "--rounds", "1", "--trees", "200")
    matches = {row[0]: row for row in _rows(out) if len(row) == 9}
    # sys+new L: the longest system prompt (64, 256, 1024, 4096) shorter than L; turn L: the
    # conversation cached for it, L - min(256, L / 2); the named cases carry hit/prompt.
    want = {
        "sys+new 128": (64, None), "sys+new 2048": (1024, None), "sys+new 8192": (4096, None),
        "turn 128": (64, None), "turn 2048": (1792, None), "turn 8192": (7936, None),
        "2 nodes 1984/2048": (1984, 2), "33-node chain 1980/2048": (1980, 33), "512 hit/513": (512, 1), "512 hit/2048": (512, 1),
    }
    assert set(matches) == set(want)
    for name, (hit, nodes) in want.items():
        row = matches[name]
        assert int(row[2]) == hit, row
        if nodes is not None:
            assert int(row[3]) == nodes, row
        listed, naive, ratio = _number(row[4]), _number(row[7]), _number(row[8])
        assert _ratio_fits(ratio, naive, listed, (0.1, 0.1, 0.1)), row
    inserts = [row for row in _rows(out, "insert ") if len(row) == 4]
    assert [(r[0], int(r[2])) for r in inserts] == [("insert 128", 64), ("insert 2048", 1024), ("insert 8192", 4096)]
    [evict] = [row for row in _rows(out) if len(row) == 6]
    pool, target = int(evict[1]), int(evict[2])
    assert evict[0] == "0k" and target == pool // 10 > 0


# --- bench.dp -------------------------------------------------------------------------------------
def test_dp_counts_add_up_and_the_table_shows_them(monkeypatch, capsys):
    from bench import dp

    full = make_workload("W2-shared-prefix", vocab_size=4096)
    small = dataclasses.replace(full, requests=full.requests[::16][:6])  # group 0: one system prompt
    result = asyncio.run(dp.run_workload(small, 2, "cache_aware", max_total_tokens=4096, max_running=2))
    assert result.requests == 6
    assert result.prompt_tokens == sum(len(r.input_ids) for r in small.requests)
    assert result.output_tokens == sum(r.max_new_tokens for r in small.requests)  # ignore_eos: all of them
    assert 0 < result.cached_tokens < result.prompt_tokens  # later requests find the system prompt cached
    [row] = _rows(dp._table([result]), "W2")
    assert row[:4] == ["W2-shared-prefix", "2", "cache_aware", "6"]
    assert _number(row[4]) == pytest.approx(100 * result.cached_tokens / result.prompt_tokens, abs=0.05)
    assert _ratio_fits(_number(row[5]), result.output_tokens, _number(row[6]), (0, 0.1, 1))  # tok/s, wall s

    out = _run_main(monkeypatch, capsys, dp, "--router-only", "--workloads", "W2-shared-prefix")
    from runtime.config import ROUTER_POLICIES

    rows = _rows(out, "W2")
    assert [(r[1], r[2]) for r in rows] == [(p, n) for p in ROUTER_POLICIES for n in ("2", "8")]
    assert all(_number(r[3]) > 0 for r in rows)


# --- bench.grammar --------------------------------------------------------------------------------
def test_grammar_masking_per_row_and_w1_counts(monkeypatch, capsys):
    from bench import grammar

    def first_three(name: str, vocab_size: int):
        workload = make_workload(name, vocab_size)
        return dataclasses.replace(workload, requests=workload.requests[:3])

    monkeypatch.setattr(grammar, "make_workload", first_three)
    out = _run_main(monkeypatch, capsys, grammar, "--model", "tiny-qwen3", "--dtype", "float32", "--rows", "2,4",
                    "--steps", "2", "--repeats", "1")
    masking = [row for row in _rows(out) if len(row) == 3]
    assert [int(r[0]) for r in masking] == [2, 4]
    for rows, ms, per_row in ((int(r[0]), _number(r[1]), _number(r[2])) for r in masking):
        assert abs(per_row - ms * 1e3 / rows) <= 5e-3 * 1e3 / rows + 0.5, (rows, ms, per_row)
    w1 = {r[0]: r for r in _rows(out) if len(r) == 4}
    asked = sum(r.max_new_tokens for r in first_three("W1-mixed-64", 4096).requests)
    assert int(w1["free"][1]) == int(w1["json_schema"][1]) == asked  # minItems 1000: no early stop
    ratio = float(re.search(r"json_schema / free: ([0-9.]+)", out).group(1))
    assert _ratio_fits(ratio, _number(w1["json_schema"][3]), _number(w1["free"][3]), (0.1, 0.1, 0.001))


# --- bench.gpu_check ------------------------------------------------------------------------------
def test_gpu_check_without_cuda_says_so_and_exits_2(capsys):
    from bench import gpu_check

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the full check is `python -m bench.gpu_check`")
    assert gpu_check.main(["--skip-tests"]) == 2
    assert "No CUDA device here" in capsys.readouterr().out


def test_gpu_check_tables_on_a_cpu(monkeypatch, tiny_llama: Path):
    """The measuring code run on a CPU (DEVICE is a module constant for this): tok/s follows from
    the printed ms, and the engine table counts every token asked for."""
    from bench import gpu_check

    monkeypatch.setattr(gpu_check, "DEVICE", "cpu")
    monkeypatch.setattr(gpu_check, "DTYPE", "float32")
    monkeypatch.setattr(gpu_check, "STEPS", 2)
    monkeypatch.setattr(gpu_check, "REPEATS", 1)
    monkeypatch.setattr(gpu_check, "PROMPT_LEN", 8)
    monkeypatch.setattr(gpu_check, "NEW_TOKENS", 4)
    torch_only = tuple(v for v in gpu_check.RUNNER_VARIANTS if v.backend == "torch")
    decode = gpu_check._decode_table({"tiny": str(tiny_llama)}, [1, 3], torch_only)
    rows = _rows(decode, "tiny")
    assert [int(r[1]) for r in rows] == [1, 3]
    for row in rows:
        batch, ms, tok_s = int(row[1]), _number(row[2]), _number(row[3])
        assert _ratio_fits(tok_s, batch * 1e3, ms, (0, 1e-3, 1)), row
        assert row[4] == "100%"  # torch eager against itself
    tok_s, wall, answers = asyncio.run(gpu_check._engine_run(str(tiny_llama), torch_only[0], True, 2, 3))
    assert [len(a) for a in answers] == [4, 4, 4]  # min_new_tokens = max_new_tokens: all of them
    assert tok_s == pytest.approx(12 / wall)


# --- bench.host_tier_overlap ----------------------------------------------------------------------
def test_host_tier_overlap_times_each_way_and_loads_the_prefix(tmp_path: Path, monkeypatch):
    """On a CPU (nothing overlaps there): four timings, and the layer-by-layer forward reads the
    prefix the loads brought in, giving the logits of a forward whose prefix was already there."""
    from bench import host_tier_overlap

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    args = host_tier_overlap._args(["--device", "cpu", "--backend", "torch", "--dtype", "float32", "--prefix", "48", "--new", "8", "--layers", "2", "--hidden", "128", "--repeats", "1"])
    runner = host_tier_overlap._runner(args)
    t = host_tier_overlap.measure(runner, 48, 8, 1)
    assert min(t.forward_ms, t.loads_ms, t.serial_ms, t.layered_ms) > 0 and t.same_logits
    assert runner.allocator.available_size() == runner.allocator.total_slots - 1  # slot 0 is the padding slot


# --- bench.http_overhead --------------------------------------------------------------------------
def test_http_overhead_rows_are_consistent(monkeypatch, capsys):
    from bench import http_overhead

    out = _run_main(monkeypatch, capsys, http_overhead, "--requests", "6", "--warmup", "1", "--repeats", "1", "--concurrency", "1")
    rows = {r[0]: r for r in _rows(out) if len(r) == 6}
    assert set(rows) == {"Engine.generate", "HTTP /generate", "HTTP /v1/completions"}
    for path, row in rows.items():
        req_s, p50, p99, cpu = (_number(c) for c in row[2:])
        # CPU per request is printed to 0.01 ms: a short request can show 0.00
        assert row[1] == "1" and 0 < p50 <= p99 and cpu >= 0, row
        # One in flight: the wall time is at least the sum of the latencies, and half of them are
        # at least the median, so req/s <= 2 / p50.
        assert req_s <= 2 * 1e3 / (p50 - 0.005) + 0.5, row


# --- bench.router_http ----------------------------------------------------------------------------
def test_router_http_added_latency_is_the_difference_of_the_printed_medians(monkeypatch, capsys):
    from bench import router_http

    out = _run_main(monkeypatch, capsys, router_http, "--requests", "20", "--rate", "200", "--workers", "1", "--repeats", "1", "--warmup", "4")
    assert out.startswith("20 requests at 200/s, 1 null workers")
    rows = [r for r in _rows(out) if len(r) == 6]
    names = [r[0] for r in rows]
    assert names[0].startswith("null worker") and any("compiled" in n for n in names) and any("python" in n for n in names)
    direct_ms = _number(rows[0][3])
    assert rows[0][4] == "-"
    for row in rows:
        cpu, kernel, median_ms, p99_ms = _number(row[1]), _number(row[2]), _number(row[3]), _number(row[5])
        assert 0 <= kernel <= cpu + 1 and median_ms <= p99_ms, row
        if row is not rows[0]:
            assert abs(_number(row[4]) - (median_ms - direct_ms) * 1e3) <= 10 + 1, row  # medians printed to 0.01 ms


# --- bench.decode_attention ---------------------------------------------------------------------
@pytest.mark.parametrize("layout", [[], ["--scatter", "--width", "0"]])
def test_decode_attention_bandwidth_follows_from_the_bytes_and_times(monkeypatch, capsys, kernels, layout):
    from bench import decode_attention

    args = ["--batch", "4", "--context", "40", "--layers", "3", "--repeats", "2", "--rounds", "1", *layout]
    out = _run_main(monkeypatch, capsys, decode_attention, *args)
    rows = {r[0]: r for r in _rows(out) if len(r) == 3}
    assert set(rows) == {"kernel", "plain read", "kernel, in cache"}
    # What a layer reads: 4 requests x 40 keys, K and V, 3 K/V heads x 64 bfloat16 values.
    mb = 2 * 4 * 40 * 3 * 64 * 2 / 1e6
    for name in ("kernel", "plain read"):
        ms, gbs = (_number(c) for c in rows[name][1:])
        assert _ratio_fits(gbs, mb, ms, (0, 0.001, 0.1)), rows[name]
    share = re.search(r"kernel at (\d+)% of the plain read's bandwidth", out)
    assert share, out
    kernel_ms, read_ms = _number(rows["kernel"][1]), _number(rows["plain read"][1])
    assert _ratio_fits(int(share.group(1)) / 100, read_ms, kernel_ms, (0.001, 0.001, 0.01)), out
    assert "scattered" in out if layout else "contiguous" in out
    assert "vectors of at most 0 bits" in out if layout else f"at most {torch.ops.actorserve.decode_attention_widths()[0]} bits" in out


# --- bench.int8_matmul --------------------------------------------------------------------------
def test_int8_matmul_covers_every_shape_and_row_count(monkeypatch, capsys):
    from bench import int8_matmul
    from gpu.packed_linear import int8_kernels

    kernels = int8_kernels()
    if kernels is None or kernels.matmul is None:
        pytest.skip("no int8 kernel on this CPU (AVX512-VNNI or AVX2)")
    out = _run_main(monkeypatch, capsys, int8_matmul, "--rows", "1,6", "--repeats", "1", "--calls", "1")
    rows = _rows(out)
    assert [(r[0], r[1]) for r in rows] == [(f"{k} x {n}", str(m)) for k, n in int8_matmul.SHAPES for m in (1, 6)], out
    widths = torch.ops.actorserve.int8_matmul_widths()
    for row in rows:
        onednn_us, ours_us, speedups = _number(row[2]), row[3 : 3 + len(widths)], row[3 + len(widths) :]
        for us, speedup in zip(ours_us, speedups, strict=True):
            assert _ratio_fits(_number(speedup), onednn_us, _number(us), (1, 1, 0.01)), row


# --- bench.gguf_matmul --------------------------------------------------------------------------
def test_gguf_matmul_ratios_follow_from_the_times(monkeypatch, capsys):
    from bench import gguf_matmul
    from gpu.gguf_linear import kernel_available

    if not kernel_available():
        pytest.skip("no gguf_matmul kernel on this CPU (AVX2 or AVX512-VNNI)")
    out = _run_main(monkeypatch, capsys, gguf_matmul, "--layers", "1", "--rows", "1,3", "--repeats", "1", "--rounds", "1")
    widths = torch.ops.actorserve.gguf_matmul_widths()
    rows = _rows(out)
    assert [r[0] for r in rows] == ["1", "3"], out
    for row in rows:
        gguf_ms, int8_ms = [_number(c) for c in row[1 : 1 + len(widths)]], _number(row[1 + len(widths)])
        for ms, ratio in zip(gguf_ms, row[2 + len(widths) :], strict=True):
            assert _ratio_fits(_number(ratio), int8_ms, ms, (0.01, 0.01, 0.01)), row
    # One layer of SmolLM2 (q/k/v, o, gate/up, down) and the Q8_0 output layer: 576 inputs each but down's 1536.
    int8_mb = (576 * (960 + 576 + 3072) + 1536 * 576 + 576 * 49152) / 1e6
    assert f"{int8_mb:.0f} MB of int8 weights" in out, out


# --- bench.ab -------------------------------------------------------------------------------------
def test_ab_runs_each_checkouts_own_code_alternately(monkeypatch, capsys, tmp_path):
    from bench import ab

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(ab, "KERNEL_BUILDS", ())  # the kernels' builds take minutes; their code is not what this checks
    # Which checkout's `bench` package the command imported: the base's lives in the temporary folder.
    probe = "import bench; print('rate', 2.0 if bench.__file__.startswith(sys.argv[1]) else 3.0)"
    out = _run_main(monkeypatch, capsys, ab, "--base", "HEAD", "--pairs", "3", "--metric", r"rate ([0-9.]+)", "--",
                    "python", "-c", f"import sys; {probe}", str(tmp_path))
    rows = [r for r in _rows(out) if len(r) == 4]
    assert [r[1:] for r in rows] == [["2", "3", "1.500"]] * 3, out
    assert "median ratio over 3 pairs: 1.500" in out
    base = next(tmp_path.glob("actorserve-ab-*"))
    assert (base / "bench" / "offline.py").is_file() and (base / ".venv").resolve() == (ab.ROOT / ".venv").resolve()


def test_ab_refuses_what_it_cannot_compare(monkeypatch, capsys):
    from bench import ab

    with pytest.raises(SystemExit, match="not a commit here"):
        _run_main(monkeypatch, capsys, ab, "--base", "no-such-revision", "--metric", "x", "--", "python", "-c", "pass")
    with pytest.raises(SystemExit, match="is not in the output"):
        ab.read_metric("nothing to see", re.compile(r"rate ([0-9.]+)"))
