"""`--plot` figures (bench/serving_plot.py, matplotlib), read back from the files: the SVG parsed
for its panels' titles and their lines (matplotlib writes an artist's gid as its group's id),
the PNG decoded by matplotlib, the PDF by its header."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from xml.etree import ElementTree

import matplotlib.image  # the `plot` extra, which `make setup` installs: a missing one fails here, not skips
import pytest

from bench import scheduling, serving, trace_serving
from bench.serving_metrics import RequestOutput
from bench.serving_plot import INSTALL, SERVING_TITLES, TRACE_TITLES, class_figure, plot_runs, save, serving_figure, trace_figure
from bench.trace_serving import Outcome, Result

SVG = "{http://www.w3.org/2000/svg}"


def svg_panels(path: Path) -> dict[str, int]:
    """Each panel of an SVG figure as its title -> how many run lines it draws."""
    root = ElementTree.parse(path).getroot()
    panels: dict[str, int] = {}
    for group in root.iter(f"{SVG}g"):
        if not group.get("id", "").startswith("panel"):
            continue
        texts = ["".join(t.itertext()).strip() for t in group.iter(f"{SVG}text")]
        [title] = [t for t in texts if t in SERVING_TITLES or t in TRACE_TITLES or t.startswith("TTFT CDF: ")]
        panels[title] = sum(1 for g in group.iter(f"{SVG}g") if g.get("id", "").startswith("run"))
    return panels


def check_png(path: Path) -> None:
    """A PNG matplotlib can decode, with ink on it: axes, text and lines."""
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 400 and pixels.shape[1] > 800
    assert (pixels[..., :3].mean(axis=-1) < 0.5).sum() > 1000


def _outputs(n: int) -> list[RequestOutput]:
    return [RequestOutput(success=True, output_len=3, ttft=0.01 * i, e2e=0.05 * i + 0.1, itl=[0.01, 0.02], start=0.1 * i,
                          chunk_times=[0.1 * i + 0.01, 0.1 * i + 0.02]) for i in range(1, n)]


def test_the_six_titled_panels_have_one_line_per_run_in_svg_png_and_pdf(tmp_path: Path) -> None:
    runs = [("a", _outputs(20)), ("b", _outputs(6)), ("failed", [RequestOutput(success=False)])]
    assert svg_panels(plot_runs(tmp_path / "p.svg", runs)) == {title: 3 for title in SERVING_TITLES}
    check_png(plot_runs(tmp_path / "p.png", runs))
    assert plot_runs(tmp_path / "p.pdf", runs).read_bytes()[:5] == b"%PDF-"


def test_latency_axes_end_at_the_largest_p99_or_are_log_scaled() -> None:
    outputs = _outputs(100)
    linear, log = serving_figure([("a", outputs)]), serving_figure([("a", outputs)], log_x=True)
    for k in range(4):
        assert linear.axes[k].get_xscale() == "linear" and log.axes[k].get_xscale() == "log"
    # TTFT 10 ms .. 990 ms: its p99 (numpy's linear interpolation) is 980.2 ms.
    assert linear.axes[0].get_xlim() == pytest.approx((0.0, 980.2))
    assert [ax.get_xscale() for ax in log.axes[4:]] == ["linear", "linear"]  # time panels stay linear


def test_class_figure_has_a_panel_per_class_and_a_line_per_setting(tmp_path: Path) -> None:
    results = {"fcfs": {"priority 0": [0.1, 0.2], "priority 10": [0.5]}, "+ aging 1 s": {"priority 0": [0.3], "priority 10": [0.05]}}
    out = save(class_figure("w5: TTFT by class", results), tmp_path / "w5.svg")
    assert svg_panels(out) == {"TTFT CDF: priority 0": 2, "TTFT CDF: priority 10": 2}


def test_trace_figure_has_hit_rate_and_ttft_over_time_a_line_per_setting(tmp_path: Path) -> None:
    """bench.trace_serving's figure from two settings' outcomes: windows by arrival, TTFT in
    modelled ms (times the simulation speed-up), a window where no request got a token left out."""
    radix = Result("radix", [Outcome(100, 0, 0.010, 5.0), Outcome(100, 50, 0.030, 30.0), Outcome(100, 100, 0.002, 70.0)], 0, 0.0, 0, 1.0)
    host = Result("host 2x", [Outcome(100, 100, 0.001, 5.0), Outcome(100, 0, None, 65.0, "queue_full")], 0, 0.0, 0, 1.0)
    over = radix.over_time(60.0, sim_speed=2.0)
    assert over.minutes == [0.0, 1.0] and over.hit_rate == [0.25, 1.0]
    assert over.ttft_p50_ms == pytest.approx([40.0, 4.0]) and over.ttft_p99_ms == pytest.approx([60.0, 4.0])
    assert host.over_time(60.0, sim_speed=2.0).ttft_p50_ms == [pytest.approx(2.0), None]
    out = save(trace_figure({"radix": over, "host 2x": host.over_time(60.0, 2.0)}, "trace"), tmp_path / "t.svg")
    assert svg_panels(out) == {title: 2 for title in TRACE_TITLES}


@pytest.mark.parametrize("module", [serving, scheduling, trace_serving])
def test_plot_is_refused_before_the_run_with_the_fix(module, monkeypatch, capsys, tmp_path: Path) -> None:
    parse = {serving: serving.parse_args, scheduling: scheduling.main, trace_serving: trace_serving.main}[module]
    with pytest.raises(SystemExit):
        parse(["--plot", str(tmp_path / "out.jpg")])
    assert "--plot writes .png, .svg, .pdf files" in capsys.readouterr().err
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(SystemExit):
        parse(["--plot", str(tmp_path / "out.png")])
    assert f"--plot needs matplotlib, the optional `plot` extra: {INSTALL}" in capsys.readouterr().err


def test_scheduling_writes_one_figure_per_workload(tmp_path: Path, capsys) -> None:
    small = ["--tenant-requests", "40", "--tenant-load", "2", "--max-running", "8", "--pool-tokens", "20000"]
    scheduling.main(["--workload", "tenants", "--device-model", "h100-qwen3-8b", *small, "--plot", str(tmp_path / "t.svg")])
    assert f"plot: {tmp_path / 't.svg'}" in capsys.readouterr().out
    assert svg_panels(tmp_path / "t.svg") == {"TTFT CDF: a (4x)": 2, "TTFT CDF: b": 2}  # lpm, lpm + vtc
