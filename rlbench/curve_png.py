"""A learning curve as a PNG file, drawn with the standard library only (no plotting package to install).

    write_curve_png("runs/demo-x/curve.png", {"pass@1": [(0, 0.3), (20, 0.5)]}, title="GRPO", xlabel="step")

Lines on a white canvas with axes, grid, tick labels, a title, axis labels and a legend, written as an 8-bit
RGB PNG (zlib). Text uses a 5x7 pixel font (the classic HD44780 / glcdfont glyphs) scaled 2x: enough for labels,
no font files needed. `eval_curve_series` turns a run's eval history into the series the demo plots.
"""

from __future__ import annotations

import math
import os
import struct
import zlib
from collections.abc import Sequence

# 5 columns per glyph, bit 0 at the top (bit 7 is a descender row below the 7-pixel cell).
_GLYPHS: dict[str, tuple[int, ...]] = {
    " ": (0, 0, 0, 0, 0), "%": (0x23, 0x13, 0x08, 0x64, 0x62), "(": (0, 0x1C, 0x22, 0x41, 0),
    ")": (0, 0x41, 0x22, 0x1C, 0), "+": (8, 8, 0x3E, 8, 8), ",": (0, 0x80, 0x70, 0x30, 0), "-": (8, 8, 8, 8, 8),
    ".": (0, 0, 0x60, 0x60, 0), "/": (0x20, 0x10, 8, 4, 2), ":": (0, 0, 0x14, 0, 0), "=": (0x14,) * 5,
    "@": (0x3E, 0x41, 0x5D, 0x59, 0x4E), "_": (0x40,) * 5, "x": (0x44, 0x28, 0x10, 0x28, 0x44),
    "0": (0x3E, 0x51, 0x49, 0x45, 0x3E), "1": (0, 0x42, 0x7F, 0x40, 0), "2": (0x72, 0x49, 0x49, 0x49, 0x46),
    "3": (0x21, 0x41, 0x49, 0x4D, 0x33), "4": (0x18, 0x14, 0x12, 0x7F, 0x10), "5": (0x27, 0x45, 0x45, 0x45, 0x39),
    "6": (0x3C, 0x4A, 0x49, 0x49, 0x31), "7": (0x41, 0x21, 0x11, 0x09, 0x07), "8": (0x36, 0x49, 0x49, 0x49, 0x36),
    "9": (0x46, 0x49, 0x49, 0x29, 0x1E),
    "A": (0x7C, 0x12, 0x11, 0x12, 0x7C), "B": (0x7F, 0x49, 0x49, 0x49, 0x36), "C": (0x3E, 0x41, 0x41, 0x41, 0x22),
    "D": (0x7F, 0x41, 0x41, 0x41, 0x3E), "E": (0x7F, 0x49, 0x49, 0x49, 0x41), "F": (0x7F, 9, 9, 9, 1),
    "G": (0x3E, 0x41, 0x41, 0x51, 0x73), "H": (0x7F, 8, 8, 8, 0x7F), "I": (0, 0x41, 0x7F, 0x41, 0),
    "J": (0x20, 0x40, 0x41, 0x3F, 1), "K": (0x7F, 8, 0x14, 0x22, 0x41), "L": (0x7F, 0x40, 0x40, 0x40, 0x40),
    "M": (0x7F, 2, 0x1C, 2, 0x7F), "N": (0x7F, 4, 8, 0x10, 0x7F), "O": (0x3E, 0x41, 0x41, 0x41, 0x3E),
    "P": (0x7F, 9, 9, 9, 6), "Q": (0x3E, 0x41, 0x51, 0x21, 0x5E), "R": (0x7F, 9, 0x19, 0x29, 0x46),
    "S": (0x26, 0x49, 0x49, 0x49, 0x32), "T": (3, 1, 0x7F, 1, 3), "U": (0x3F, 0x40, 0x40, 0x40, 0x3F),
    "V": (0x1F, 0x20, 0x40, 0x20, 0x1F), "W": (0x3F, 0x40, 0x38, 0x40, 0x3F), "X": (0x63, 0x14, 8, 0x14, 0x63),
    "Y": (3, 4, 0x78, 4, 3), "Z": (0x61, 0x59, 0x49, 0x4D, 0x43),
    "a": (0x20, 0x54, 0x54, 0x78, 0x40), "b": (0x7F, 0x28, 0x44, 0x44, 0x38), "c": (0x38, 0x44, 0x44, 0x44, 0x28),
    "d": (0x38, 0x44, 0x44, 0x28, 0x7F), "e": (0x38, 0x54, 0x54, 0x54, 0x18), "f": (0, 8, 0x7E, 9, 2),
    "g": (0x18, 0xA4, 0xA4, 0x9C, 0x78), "h": (0x7F, 8, 4, 4, 0x78), "i": (0, 0x44, 0x7D, 0x40, 0),
    "j": (0x20, 0x40, 0x40, 0x3D, 0), "k": (0x7F, 0x10, 0x28, 0x44, 0), "l": (0, 0x41, 0x7F, 0x40, 0),
    "m": (0x7C, 4, 0x78, 4, 0x78), "n": (0x7C, 8, 4, 4, 0x78), "o": (0x38, 0x44, 0x44, 0x44, 0x38),
    "p": (0xFC, 0x18, 0x24, 0x24, 0x18), "q": (0x18, 0x24, 0x24, 0x18, 0xFC), "r": (0x7C, 8, 4, 4, 8),
    "s": (0x48, 0x54, 0x54, 0x54, 0x24), "t": (4, 4, 0x3F, 0x44, 0x24), "u": (0x3C, 0x40, 0x40, 0x20, 0x7C),
    "v": (0x1C, 0x20, 0x40, 0x20, 0x1C), "w": (0x3C, 0x40, 0x30, 0x40, 0x3C), "y": (0x4C, 0x90, 0x90, 0x90, 0x7C),
    "z": (0x44, 0x64, 0x54, 0x4C, 0x44),
}
SCALE = 2
"""Font pixels per glyph pixel."""
ADVANCE = 6 * SCALE
"""Horizontal pixels per character (5 glyph columns + 1 space)."""
COLORS = ((31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14))
"""Line colours, in series order."""
Color = tuple[int, int, int]


class Canvas:
    """An RGB raster `width` x `height`, white, with pixel, line, rectangle and text drawing."""

    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(b"\xff" * (width * height * 3))

    def dot(self, x: int, y: int, color: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = (y * self.width + x) * 3
            self.pixels[i : i + 3] = bytes(color)

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        """Fill the rectangle with corners (x0, y0) and (x1, y1), both included."""
        for y in range(min(y0, y1), max(y0, y1) + 1):
            for x in range(min(x0, x1), max(x0, x1) + 1):
                self.dot(x, y, color)

    def line(self, x0: float, y0: float, x1: float, y1: float, color: Color, width: int = 1) -> None:
        """A straight line `width` pixels thick (square pen), sampled every half pixel."""
        n = max(1, int(2 * max(abs(x1 - x0), abs(y1 - y0))))
        lo = -(width // 2)
        for s in range(n + 1):
            x, y = round(x0 + (x1 - x0) * s / n), round(y0 + (y1 - y0) * s / n)
            self.rect(x + lo, y + lo, x + lo + width - 1, y + lo + width - 1, color)

    def text(self, x: int, y: int, text: str, color: Color = (0, 0, 0), anchor: str = "left") -> None:
        """`text` with its top at `y`, starting at `x` ("left"), centred on it ("center") or ending at it ("right").
        The font has letters, digits and `% ( ) + , - . / : = @ _`; any other character is drawn as a blank."""
        if anchor != "left":
            x -= text_width(text) // (2 if anchor == "center" else 1)
        for k, ch in enumerate(text):
            for col, bits in enumerate(_GLYPHS.get(ch, _GLYPHS[" "])):
                for row in range(8):
                    if bits >> row & 1:
                        px, py = x + k * ADVANCE + col * SCALE, y + row * SCALE
                        self.rect(px, py, px + SCALE - 1, py + SCALE - 1, color)

    def png(self) -> bytes:
        """The canvas as PNG bytes (8-bit RGB, no filter, zlib level 9)."""
        stride = self.width * 3
        raw = b"".join(b"\x00" + bytes(self.pixels[y * stride : (y + 1) * stride]) for y in range(self.height))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def text_width(text: str) -> int:
    """Pixels `Canvas.text` draws `text` across."""
    return len(text) * ADVANCE - SCALE


def nice_ticks(lo: float, hi: float, target: int = 6) -> list[float]:
    """Round tick values (steps of 1, 2 or 5 x 10^k) covering [lo, hi], about `target` of them."""
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / max(1, target - 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step + 1e-9) * step
    return [round(first + i * step, 10) for i in range(int((hi - first) / step + 1e-9) + 1)]


def write_curve_png(path: str, series: dict[str, Sequence[tuple[float, float]]], *, title: str, xlabel: str,
                    ylabel: str, y_range: tuple[float, float] | None = None, size: tuple[int, int] = (720, 440),
                    thin: Sequence[str] = ()) -> str:
    """Draw each series (label -> [(x, y), ...], in order) as a line with dots on shared axes; write the PNG.

    Args:
        path: the .png file to write (its directory is created).
        series: at least one non-empty series; x and y finite.
        y_range: the y axis (lo, hi); None: from the data.
        thin: labels drawn as a thin line without dots (a noisy per-step series behind the main ones).

    Returns `path`.
    """
    points = [p for pts in series.values() for p in pts]
    if not points:
        raise ValueError("write_curve_png: no points to draw (every series is empty)")
    if not all(math.isfinite(v) for p in points for v in p):
        raise ValueError(f"write_curve_png: non-finite values in {series}")
    width, height = size
    left, right, top, bottom = 78, 24, 64, 64
    canvas = Canvas(width, height)
    xs = nice_ticks(min(p[0] for p in points), max(p[0] for p in points))
    ys = nice_ticks(*(y_range or (min(p[1] for p in points), max(p[1] for p in points))))
    x_lo, x_hi, y_lo, y_hi = xs[0], xs[-1], ys[0], ys[-1]

    def at(x: float, y: float) -> tuple[float, float]:
        return (left + (x - x_lo) / (x_hi - x_lo) * (width - left - right),
                height - bottom - (y - y_lo) / (y_hi - y_lo) * (height - top - bottom))

    grid, axis = (225, 225, 225), (60, 60, 60)
    for y in ys:
        py = round(at(x_lo, y)[1])
        canvas.line(left, py, width - right, py, grid)
        canvas.text(left - 8, py - 7, f"{y:g}", axis, anchor="right")
    for x in xs:
        px = round(at(x, y_lo)[0])
        canvas.line(px, top, px, height - bottom, grid)
        canvas.text(px, height - bottom + 8, f"{x:g}", axis, anchor="center")
    canvas.line(left, top, left, height - bottom, axis, 2)
    canvas.line(left, height - bottom, width - right, height - bottom, axis, 2)
    canvas.text(width // 2, 10, title, anchor="center")
    canvas.text((left + width - right) // 2, height - 26, xlabel, axis, anchor="center")
    canvas.text(8, top - 26, ylabel, axis)
    # Thin series in a lighter shade: they sit behind the main ones.
    colors = {label: tuple(c // 2 + 128 for c in COLORS[k % len(COLORS)]) if label in thin else COLORS[k % len(COLORS)]
              for k, label in enumerate(series)}
    for label, pts in series.items():
        color = colors[label]
        xy = [at(x, y) for x, y in pts]
        for (x0, y0), (x1, y1) in zip(xy, xy[1:]):
            canvas.line(x0, y0, x1, y1, color, 1 if label in thin else 3)
        if label not in thin:
            for x, y in xy:
                canvas.rect(round(x) - 3, round(y) - 3, round(x) + 3, round(y) + 3, color)
    # The legend, on white in the plot's bottom-right corner: rising curves leave that corner empty.
    legend_x = width - right - 48 - max(text_width(label) for label in series)
    legend_y = height - bottom - 8 - 20 * len(series)
    canvas.rect(legend_x - 6, legend_y - 4, width - right - 4, height - bottom - 6, (255, 255, 255))
    for k, label in enumerate(series):
        ly = legend_y + 20 * k
        canvas.line(legend_x, ly + 7, legend_x + 24, ly + 7, colors[label], 1 if label in thin else 3)
        canvas.text(legend_x + 32, ly, label)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as f:
        f.write(canvas.png())
    return path


def eval_curve_series(eval_history: Sequence[dict], history: Sequence[dict] = ()) -> dict[str, list[tuple[float, float]]]:
    """The demo's plotted series: held-out `eval/pass@k` per eval (x = `rollout/id`, the RL steps before it),
    then the training reward per step (`rollout/raw_reward`, x = the step it was sampled at, 0-based)."""
    keys = sorted({k for h in eval_history for k in h if k.startswith("eval/pass@")}, key=lambda k: int(k[10:]))
    out = {f"held-out {k[5:]}": [(h["rollout/id"], h[k]) for h in eval_history if k in h] for k in keys}
    reward = [(k, h["rollout/raw_reward"]) for k, h in enumerate(history) if "rollout/raw_reward" in h]
    if reward:
        out["train reward"] = reward
    return out


def write_run_curve(trainer) -> str | None:
    """`curve.png` beside the run's metrics jsonl: held-out pass@k per eval and the training reward per step
    (`eval_curve_series`). Returns its path; None when the run logs no jsonl or evaluated fewer than twice."""
    cfg = trainer.cfg
    if not cfg.logging.jsonl_path or len(trainer.eval_history) < 2:
        return None
    samples, prompts = cfg.eval.n_samples_per_prompt, len(trainer.eval_items)  # items: already max_prompts-capped
    series = eval_curve_series(trainer.eval_history, trainer.history)
    unit = all(0.0 <= y <= 1.0 for pts in series.values() for _, y in pts)  # pass@k always; rewards often
    task = f"{cfg.task.name} level {cfg.task.level}" if cfg.task and cfg.task.name == "arithmetic" else \
        os.path.basename(cfg.data.path)
    return write_curve_png(
        os.path.join(os.path.dirname(cfg.logging.jsonl_path), "curve.png"),
        series, title=f"{cfg.loss.advantage_estimator.upper()} on {task}, rollout seed {cfg.rollout.seed}",
        xlabel="RL step", ylabel=f"held-out pass@k ({prompts} prompts x {samples} samples), train reward",
        y_range=(0.0, 1.0) if unit else None, thin=("train reward",))
