"""`--plot out.png|out.svg|out.pdf` figures of bench.serving and bench.scheduling, drawn with
matplotlib (the optional `plot` extra: `pip install 'actorserve[plot]'`, which `make setup`
installs). The file's extension picks the format; without matplotlib `--plot` is refused with the
install line, before anything runs.

- bench.serving: six panels, one line per run (one per rate of a sweep): TTFT, TPOT, ITL and E2E
  CDFs, their x axes up to the largest p99 so that one outlier cannot flatten a curve (or
  log-scaled with `--plot-log-x`, which shows the tail whole); output tokens/s and requests in
  flight over time.
- bench.scheduling: one TTFT CDF panel per request class (priority, tenant, SLO class), one line
  per setting.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from bench.serving_metrics import RequestOutput, throughput_over_time

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

FORMATS = (".png", ".svg", ".pdf")
INSTALL = "pip install 'actorserve[plot]'"
SERVING_TITLES = ("TTFT CDF", "TPOT CDF", "ITL CDF", "E2E CDF", "Output tokens/s", "Requests in flight")
PANEL_INCHES = (4.2, 3.0)


def plot_problem(path: Path) -> str | None:
    """Why `--plot path` cannot be written here (a message naming the fix), or None."""
    if path.suffix.lower() not in FORMATS:
        return f"--plot writes {', '.join(FORMATS)} files (the extension picks the format), got {path.name!r}"
    if importlib.util.find_spec("matplotlib") is None:
        return f"--plot needs matplotlib, the optional `plot` extra: {INSTALL}"
    return None


def cdf_ms(seconds: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """The empirical CDF of `seconds`, in ms: (sorted values, share of samples <= each)."""
    xs = np.sort(np.asarray(seconds, dtype=float)) * 1000.0
    return xs, np.arange(1, len(xs) + 1) / max(len(xs), 1)


def serving_figure(runs: Sequence[tuple[str, Sequence[RequestOutput]]], log_x: bool = False) -> Figure:
    """The six panels for `runs` ((legend label, outputs) each), one line per run and panel."""
    fig, axes = _grid(len(SERVING_TITLES), cols=3)
    p99: dict[str, float] = {}
    for run, (label, outputs) in enumerate(runs):
        ok = [o for o in outputs if o.success]
        latencies = {
            "TTFT CDF": [o.ttft for o in ok],
            "TPOT CDF": [t for o in ok if (t := o.tpot) is not None],
            "ITL CDF": [gap for o in ok for gap in o.itl],
            "E2E CDF": [o.e2e for o in ok],
        }
        for ax, (title, values) in zip(axes, latencies.items()):
            ax.step(*cdf_ms(values), where="post", label=label, gid=f"run{run}")
            if values:
                p99[title] = max(p99.get(title, 0.0), float(np.percentile(values, 99)) * 1000.0)
        t, tok_s, in_flight = throughput_over_time(outputs)
        axes[4].plot(t, tok_s, label=label, gid=f"run{run}")
        axes[5].plot(t, in_flight, label=label, gid=f"run{run}")
    for ax, title in zip(axes[:4], SERVING_TITLES[:4]):
        _latency_axes(ax, title, log_x, p99.get(title))
    for ax, title, ylabel in ((axes[4], SERVING_TITLES[4], "tokens/s"), (axes[5], SERVING_TITLES[5], "requests")):
        ax.set(title=title, xlabel="seconds from start", ylabel=ylabel)
    _legend(fig, axes)
    return fig


def class_figure(title: str, results: Mapping[str, Mapping[str, Sequence[float]]], log_x: bool = False) -> Figure:
    """TTFT CDFs: one panel per class, one line per setting; `results[setting][class]` are the
    TTFTs in seconds of that class's served requests."""
    classes = sorted({klass for by_class in results.values() for klass in by_class})
    fig, axes = _grid(len(classes), cols=min(3, len(classes)))
    for ax, klass in zip(axes, classes):
        for run, (setting, by_class) in enumerate(results.items()):
            ax.step(*cdf_ms(by_class.get(klass, ())), where="post", label=setting, gid=f"run{run}")
        largest = max((float(np.percentile(v, 99)) * 1000.0 for by in results.values() if len(v := by.get(klass, ()))), default=None)
        _latency_axes(ax, f"TTFT CDF: {klass}", log_x, largest)
    fig.suptitle(title)
    _legend(fig, axes)
    return fig


def hit_rate_figure(series: Mapping[str, tuple[Sequence[float], Sequence[float]]], title: str) -> Figure:
    """bench.trace_replay's figure: hit rate over the trace's time, one line per cache;
    `series[cache]` is (minutes, hit rate) per window."""
    fig, (ax,) = _grid(1, cols=1)
    fig.set_size_inches(2 * PANEL_INCHES[0], 1.5 * PANEL_INCHES[1])
    for run, (name, (minutes, rates)) in enumerate(series.items()):
        ax.plot(minutes, [100.0 * r for r in rates], label=name, gid=f"run{run}")
    ax.set_title(title)
    ax.set_xlabel("trace time (min)")
    ax.set_ylabel("prompt tokens found in the cache (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="upper left")
    return fig


TRACE_TITLES = ("Prompt tokens found in the cache", "TTFT p50", "TTFT p99")


class OverTime(NamedTuple):
    """One setting of a trace replay, per window of trace time."""

    minutes: list[float]  # window starts
    hit_rate: list[float]  # share of the window's prompt tokens found in any tier
    ttft_p50_ms: list[float | None]  # None: no request of the window got a first token
    ttft_p99_ms: list[float | None]


def trace_figure(series: Mapping[str, OverTime], title: str) -> Figure:
    """bench.trace_serving's figure: hit rate and TTFT over the trace's time, one line per
    setting (cache configuration) in each panel."""
    fig, axes = _grid(len(TRACE_TITLES), cols=3)
    for run, (name, s) in enumerate(series.items()):
        values = ([100.0 * r for r in s.hit_rate], s.ttft_p50_ms, s.ttft_p99_ms)
        for ax, ys in zip(axes, values):
            shown = [(x, y) for x, y in zip(s.minutes, ys) if y is not None]
            ax.plot([x for x, _ in shown], [y for _, y in shown], marker=".", label=name, gid=f"run{run}")  # a lone window shows too
    for ax, panel, unit in zip(axes, TRACE_TITLES, ("%", "ms", "ms")):
        ax.set(title=panel, xlabel="trace time (min)", ylabel=unit)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylim(0, 100)
    fig.suptitle(title, y=0.9, fontsize="small")
    _legend(fig, axes)
    return fig


def save(fig: Figure, path: Path | str) -> Path:
    """Write `fig` to `path` in the format its extension names, and release it."""
    import matplotlib
    import matplotlib.pyplot as plt

    out = Path(path)
    # SVG text stays text (searchable, restylable), not glyph outlines.
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        fig.savefig(out, format=out.suffix.lower().lstrip("."), bbox_inches="tight")
    plt.close(fig)
    return out


def plot_runs(path: Path | str, runs: Sequence[tuple[str, Sequence[RequestOutput]]], log_x: bool = False) -> Path:
    """bench.serving's figure for `runs`, written to `path`."""
    return save(serving_figure(runs, log_x), path)


def _grid(panels: int, cols: int) -> tuple[Figure, list[Axes]]:
    import matplotlib

    matplotlib.use("Agg")  # files only: never a window, whatever backend the user's config names
    import matplotlib.pyplot as plt

    rows = -(-panels // cols)
    fig, grid = plt.subplots(rows, cols, figsize=(PANEL_INCHES[0] * cols, PANEL_INCHES[1] * rows + 0.6), squeeze=False)
    axes = list(grid.flat)
    for spare in axes[panels:]:
        spare.remove()
    for k, ax in enumerate(axes[:panels]):
        ax.set_gid(f"panel{k}")  # the SVG's group ids: a reader finds each panel and its runs' lines (run<i>)
    return fig, axes[:panels]


def _latency_axes(ax: Axes, title: str, log_x: bool, p99_ms: float | None) -> None:
    ax.set(title=title, ylabel="share of requests", ylim=(0.0, 1.02))
    if log_x:
        ax.set_xscale("log")
        ax.set_xlabel("ms (log scale)")
    else:
        ax.set_xlabel("ms (axis to the largest p99)")
        if p99_ms:  # one outlier would otherwise squeeze every curve to the left edge
            ax.set_xlim(0.0, p99_ms)
    ax.grid(True, alpha=0.3)


def _legend(fig: Figure, axes: Sequence[Axes]) -> None:
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="upper center", ncol=min(len(labels), 6), bbox_to_anchor=(0.5, 1.0), frameon=False)
    fig.tight_layout(rect=(0.0, 0.0, 1.0, 0.93))
