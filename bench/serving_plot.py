"""`bench.serving --plot out.png`: latency CDFs and throughput over time, as a PNG written with
numpy and zlib only.

matplotlib is not a dependency of the project, and a benchmark's plot should not need one: the
figure is six line charts (TTFT, TPOT, ITL and E2E CDFs, their x axes up to the largest p99 so
one outlier cannot flatten a curve; output tokens/s and requests in flight over time), one coloured line per run (one per rate in a sweep), drawn into an RGB array with a
built-in 5x7 bitmap font for titles, tick labels and the legend, then encoded as an 8-bit RGB PNG.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bench.serving_metrics import RequestOutput, throughput_over_time

PANEL_W, PANEL_H = 420, 300
COLS, ROWS = 3, 2
LEGEND_H = 40
MARGIN_L, MARGIN_R, MARGIN_T, MARGIN_B = 62, 16, 30, 34
COLORS = [
    (31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
    (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207),
]
BLACK, GREY, WHITE = (0, 0, 0), (210, 210, 210), (255, 255, 255)

# 5x7 glyphs, rows top to bottom; lowercase is drawn as uppercase.
_GLYPHS = {
    "0": ".###. #...# #..## #.#.# ##..# #...# .###.", "1": "..#.. .##.. ..#.. ..#.. ..#.. ..#.. .###.",
    "2": ".###. #...# ....# ...#. ..#.. .#... #####", "3": "##### ...#. ..#.. ...#. ....# #...# .###.",
    "4": "...#. ..##. .#.#. #..#. ##### ...#. ...#.", "5": "##### #.... ####. ....# ....# #...# .###.",
    "6": "..##. .#... #.... ####. #...# #...# .###.", "7": "##### ....# ...#. ..#.. .#... .#... .#...",
    "8": ".###. #...# #...# .###. #...# #...# .###.", "9": ".###. #...# #...# .#### ....# ...#. .##..",
    "A": ".###. #...# #...# ##### #...# #...# #...#", "B": "####. #...# #...# ####. #...# #...# ####.",
    "C": ".###. #...# #.... #.... #.... #...# .###.", "D": "###.. #..#. #...# #...# #...# #..#. ###..",
    "E": "##### #.... #.... ####. #.... #.... #####", "F": "##### #.... #.... ####. #.... #.... #....",
    "G": ".###. #...# #.... #.### #...# #...# .####", "H": "#...# #...# #...# ##### #...# #...# #...#",
    "I": ".###. ..#.. ..#.. ..#.. ..#.. ..#.. .###.", "J": "..### ...#. ...#. ...#. ...#. #..#. .##..",
    "K": "#...# #..#. #.#.. ##... #.#.. #..#. #...#", "L": "#.... #.... #.... #.... #.... #.... #####",
    "M": "#...# ##.## #.#.# #.#.# #...# #...# #...#", "N": "#...# #...# ##..# #.#.# #..## #...# #...#",
    "O": ".###. #...# #...# #...# #...# #...# .###.", "P": "####. #...# #...# ####. #.... #.... #....",
    "Q": ".###. #...# #...# #...# #.#.# #..#. .##.#", "R": "####. #...# #...# ####. #.#.. #..#. #...#",
    "S": ".#### #.... #.... .###. ....# ....# ####.", "T": "##### ..#.. ..#.. ..#.. ..#.. ..#.. ..#..",
    "U": "#...# #...# #...# #...# #...# #...# .###.", "V": "#...# #...# #...# #...# #...# .#.#. ..#..",
    "W": "#...# #...# #...# #.#.# #.#.# #.#.# .#.#.", "X": "#...# #...# .#.#. ..#.. .#.#. #...# #...#",
    "Y": "#...# #...# .#.#. ..#.. ..#.. ..#.. ..#..", "Z": "##### ....# ...#. ..#.. .#... #.... #####",
    ".": "..... ..... ..... ..... ..... .##.. .##..", "-": "..... ..... ..... ##### ..... ..... .....",
    "/": "..... ....# ...#. ..#.. .#... #.... .....", "%": "##... ##..# ...#. ..#.. .#... #..## ...##",
    "(": "...#. ..#.. .#... .#... .#... ..#.. ...#.", ")": ".#... ..#.. ...#. ...#. ...#. ..#.. .#...",
    ":": "..... .##.. .##.. ..... .##.. .##.. .....", "=": "..... ..... ##### ..... ##### ..... .....",
    ",": "..... ..... ..... ..... .##.. ..#.. .#...", "+": "..... ..#.. ..#.. ##### ..#.. ..#.. .....",
    "_": "..... ..... ..... ..... ..... ..... #####", " ": "..... ..... ..... ..... ..... ..... .....",
}
FONT = {ch: np.array([[c == "#" for c in row] for row in rows.split()], dtype=bool) for ch, rows in _GLYPHS.items()}


class Canvas:
    def __init__(self, width: int, height: int):
        self.pixels = np.full((height, width, 3), 255, dtype=np.uint8)

    @property
    def size(self) -> tuple[int, int]:
        return self.pixels.shape[1], self.pixels.shape[0]

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: tuple[int, int, int]) -> None:
        w, h = self.size
        self.pixels[max(0, y0) : min(h, y1), max(0, x0) : min(w, x1)] = color

    def line(self, x0: float, y0: float, x1: float, y1: float, color: tuple[int, int, int], width: int = 2) -> None:
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        xs = np.rint(np.linspace(x0, x1, n)).astype(int)
        ys = np.rint(np.linspace(y0, y1, n)).astype(int)
        w, h = self.size
        for dx in range(width):
            for dy in range(width):
                x, y = xs + dx - width // 2, ys + dy - width // 2
                keep = (x >= 0) & (x < w) & (y >= 0) & (y < h)
                self.pixels[y[keep], x[keep]] = color

    def polyline(self, xs: Sequence[float], ys: Sequence[float], color: tuple[int, int, int]) -> None:
        for i in range(len(xs) - 1):
            self.line(xs[i], ys[i], xs[i + 1], ys[i + 1], color)

    def text(self, x: int, y: int, s: str, color: tuple[int, int, int] = BLACK, scale: int = 1) -> int:
        """Draw `s` with its top-left corner at (x, y); returns the x after the last glyph."""
        for ch in s.upper():
            glyph = FONT.get(ch, FONT["_"])
            big = np.kron(glyph, np.ones((scale, scale), dtype=bool))
            gh, gw = big.shape
            w, h = self.size
            if 0 <= x and x + gw <= w and 0 <= y and y + gh <= h:
                self.pixels[y : y + gh, x : x + gw][big] = color
            x += (5 + 1) * scale
        return x


def text_width(s: str, scale: int = 1) -> int:
    return len(s) * 6 * scale - scale


def encode_png(pixels: np.ndarray) -> bytes:
    """An 8-bit RGB PNG of an (height, width, 3) uint8 array: filter 0 on every row."""
    height, width, _ = pixels.shape
    raw = np.concatenate([np.zeros((height, 1), dtype=np.uint8), pixels.reshape(height, width * 3)], axis=1)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw.tobytes(), 6)) + chunk(b"IEND", b"")


def _tick(v: float) -> str:
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:.3g}M"
    if a >= 1e4:
        return f"{v / 1e3:.3g}K"
    if a >= 100 or v == int(v):
        return f"{v:.0f}"
    return f"{v:.3g}"


def _panel(
    canvas: Canvas, ox: int, oy: int, title: str, xlabel: str, series: list[tuple[np.ndarray, np.ndarray, tuple[int, int, int]]],
    ymax: float | None = None, xmax: float | None = None,
) -> None:
    """One chart with its top-left corner at (ox, oy): axes from 0, ticks at 0, half and max;
    points beyond `xmax` (default: the largest x) are drawn at the right edge."""
    x0, y0 = ox + MARGIN_L, oy + MARGIN_T
    x1, y1 = ox + PANEL_W - MARGIN_R, oy + PANEL_H - MARGIN_B
    canvas.text(ox + (PANEL_W - text_width(title, 2)) // 2, oy + 6, title, scale=2)
    xs_all = [x for x, _, _ in series if len(x)]
    if xmax is None:
        xmax = max((float(np.max(x)) for x in xs_all), default=1.0)
    xmax = xmax or 1.0
    top = ymax if ymax is not None else max((float(np.max(y)) for _, y, _ in series if len(y)), default=1.0) or 1.0
    for frac in (0.0, 0.5, 1.0):
        gx = x0 + frac * (x1 - x0)
        gy = y1 - frac * (y1 - y0)
        canvas.line(gx, y0, gx, y1, GREY, width=1)
        canvas.line(x0, gy, x1, gy, GREY, width=1)
        xt = _tick(frac * xmax)
        canvas.text(int(gx - text_width(xt) / 2), y1 + 6, xt)
        yt = _tick(frac * top)
        canvas.text(x0 - 6 - text_width(yt), int(gy - 3), yt)
    canvas.text(x0 + (x1 - x0 - text_width(xlabel)) // 2, y1 + 18, xlabel)
    canvas.line(x0, y0, x0, y1, BLACK, width=1)
    canvas.line(x0, y1, x1, y1, BLACK, width=1)
    for x, y, color in series:
        if not len(x):
            continue
        px = x0 + np.clip(np.asarray(x, dtype=float) / xmax, 0.0, 1.0) * (x1 - x0)
        py = y1 - np.clip(np.asarray(y, dtype=float) / top, 0.0, 1.0) * (y1 - y0)
        canvas.polyline(px.tolist(), py.tolist(), color)


def _cdf(values: Sequence[float], points: int = 400) -> tuple[np.ndarray, np.ndarray]:
    """The empirical CDF in ms at `points` + 1 evenly spaced probabilities (quantiles), from
    (0, 0): enough for a chart, and cheap however many samples (ITL has one per chunk)."""
    if not len(values):
        return np.zeros(0), np.zeros(0)
    probs = np.linspace(0.0, 1.0, points + 1)
    xs = np.quantile(np.asarray(values, dtype=float) * 1000.0, probs)
    return np.concatenate([[0.0], xs]), np.concatenate([[0.0], probs])


def plot_runs(path: Path | str, runs: Sequence[tuple[str, Sequence[RequestOutput]]]) -> Path:
    """Write the six charts for `runs` ((legend label, outputs) each) to `path` as a PNG."""
    canvas = Canvas(COLS * PANEL_W, ROWS * PANEL_H + LEGEND_H)
    x = 12
    for i, (label, _) in enumerate(runs):
        color = COLORS[i % len(COLORS)]
        canvas.rect(x, 14, x + 18, 26, color)
        x = canvas.text(x + 24, 14, label, scale=2) + 18
    latency: dict[str, list] = {"TTFT": [], "TPOT": [], "ITL": [], "E2E": []}
    timeline: dict[str, list] = {"OUTPUT TOK/S": [], "IN FLIGHT": []}
    p99: dict[str, float] = {}  # CDFs are drawn up to the largest p99: a lone outlier would flatten them
    for i, (_, outputs) in enumerate(runs):
        color = COLORS[i % len(COLORS)]
        ok = [o for o in outputs if o.success]
        values = {
            "TTFT": [o.ttft for o in ok],
            "TPOT": [t for o in ok if (t := o.tpot) is not None],
            "ITL": [g for o in ok for g in o.itl],
            "E2E": [o.e2e for o in ok],
        }
        for name, v in values.items():
            latency[name].append((*_cdf(v), color))
            if len(v):
                p99[name] = max(p99.get(name, 0.0), float(np.percentile(v, 99)) * 1000.0)
        t, tok_s, in_flight = throughput_over_time(outputs)
        timeline["OUTPUT TOK/S"].append((t, tok_s, color))
        timeline["IN FLIGHT"].append((t, in_flight, color))
    panels = [(f"{name} CDF", "MS (AXIS TO THE LARGEST P99)", s, 1.0, p99.get(name)) for name, s in latency.items()]
    panels += [(name, "SECONDS FROM START", s, None, None) for name, s in timeline.items()]
    for k, (title, xlabel, series, ymax, xmax) in enumerate(panels):
        _panel(canvas, (k % COLS) * PANEL_W, LEGEND_H + (k // COLS) * PANEL_H, title, xlabel, series, ymax, xmax)
    out = Path(path)
    out.write_bytes(encode_png(canvas.pixels))
    return out
