"""Line charts as PNG with numpy and zlib only: tokens/s against context for `ds4 bench --plot`.

A canvas is a uint8 [H, W, 3] array; lines are stamped point by point, text is a 5×7 bitmap
font scaled by pixel repetition, and the PNG is written chunk by chunk (IHDR, IDAT, IEND, each
with its CRC-32), one filter-0 scanline per row.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass

import numpy as np

# 5×7 glyphs: 7 rows of 5 bits (bit 4 = left column), as 14 hex digits.
_FONT_TABLE = """
0 0E11131519110E 1 040C040404040E 2 0E11010204081F 3 1F02040201110E 4 02060A121F0202 5 1F101E0101110E
6 0608101E11110E 7 1F010204080808 8 0E11110E11110E 9 0E11110F01020C A 0E1111111F1111 B 1E11111E11111E
C 0E11101010110E D 1C12111111121C E 1F10101E10101F F 1F10101E101010 G 0E11101711110F H 1111111F111111
I 0E04040404040E J 0702020202120C K 11121418141211 L 1010101010101F M 111B1515111111 N 11111915131111
O 0E11111111110E P 1E11111E101010 Q 0E11111115120D R 1E11111E141211 S 0F10100E01011E T 1F040404040404
U 1111111111110E V 11111111110A04 W 1111111515150A X 11110A040A1111 Y 1111110A040404 Z 1F01020408101F
a 00000E010F110F b 1010161911111E c 00000E1010110E d 01010D1311110F e 00000E111F100E f 0609081C080808
g 000F11110F010E h 10101619111111 i 04000C0404040E j 0200060202120C k 10101214181412 l 0C04040404040E
m 00001A15151111 n 00001619111111 o 00000E1111110E p 00001E111E1010 q 00000D130F0101 r 00001619101010
s 00000E100E011E t 08081C08080906 u 0000111111130D v 00001111110A04 w 0000111115150A x 0000110A040A11
y 000011110F010E z 00001F0204081F . 00000000000C0C , 000000000C0408 - 0000001F000000 / 00010204081000
: 000C0C000C0C00 ( 02040808080402 ) 08040202020408 _ 0000000000001F % 18190204081303 + 0004041F040400
= 00001F001F0000 ? 0E110102040004 [ 0E08080808080E ] 0E02020202020E * 00040E1F0E0400 ' 04040800000000
# 0A0A1F0A1F0A0A
"""


def _parse_font(table: str) -> dict[str, np.ndarray]:
    words = table.split()
    font: dict[str, np.ndarray] = {}
    i = 0
    while i < len(words):
        ch, hexes = words[i], ""
        i += 1
        while len(hexes) < 14:  # a glyph's hex digits may be split by spaces
            hexes += words[i]
            i += 1
        rows = [int(hexes[k:k + 2], 16) for k in range(0, 14, 2)]
        font[ch] = np.array([[(r >> (4 - c)) & 1 for c in range(5)] for r in rows], dtype=bool)
    font[" "] = np.zeros((7, 5), dtype=bool)
    return font


FONT = _parse_font(_FONT_TABLE)
GLYPH_W, GLYPH_H, ADVANCE = 5, 7, 6  # pixels at scale 1

# Series colors (the familiar ten-color cycle); none is the black, grey or white of the frame.
PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
           (140, 86, 75), (227, 119, 194), (188, 189, 34), (23, 190, 207), (127, 127, 127)]
WHITE, BLACK, GRID, AXIS_TEXT = (255, 255, 255), (0, 0, 0), (228, 228, 228), (40, 40, 40)


# ---- canvas -------------------------------------------------------------------------------------

class Canvas:
    def __init__(self, width: int, height: int, background=WHITE):
        self.px = np.empty((height, width, 3), dtype=np.uint8)
        self.px[:] = background

    @property
    def width(self) -> int:
        return self.px.shape[1]

    @property
    def height(self) -> int:
        return self.px.shape[0]

    def rect(self, x0: int, y0: int, x1: int, y1: int, color) -> None:
        """Fill [x0, x1) × [y0, y1), clipped to the canvas."""
        x0, x1 = max(0, int(x0)), min(self.width, int(x1))
        y0, y1 = max(0, int(y0)), min(self.height, int(y1))
        if x0 < x1 and y0 < y1:
            self.px[y0:y1, x0:x1] = color

    def line(self, x0: float, y0: float, x1: float, y1: float, color, width: int = 1) -> None:
        """A straight line `width` pixels thick, stamped at every pixel step along it."""
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        xs = np.rint(np.linspace(x0, x1, n)).astype(int)
        ys = np.rint(np.linspace(y0, y1, n)).astype(int)
        lo = -(width // 2)
        for dy in range(lo, lo + width):
            for dx in range(lo, lo + width):
                x, y = xs + dx, ys + dy
                ok = (x >= 0) & (x < self.width) & (y >= 0) & (y < self.height)
                self.px[y[ok], x[ok]] = color

    def text(self, x: int, y: int, s: str, color=BLACK, scale: int = 2, anchor: str = "left") -> int:
        """Draw `s` with its top at y; anchor left/center/right at x. Returns the width drawn."""
        w = text_width(s, scale)
        x = int(x - (w / 2 if anchor == "center" else w if anchor == "right" else 0))
        for i, ch in enumerate(s):
            glyph = FONT.get(ch, FONT["?"])
            block = np.kron(glyph, np.ones((scale, scale), dtype=bool))
            gx = x + i * ADVANCE * scale
            ys, xs = np.nonzero(block)
            xs, ys = xs + gx, ys + int(y)
            ok = (xs >= 0) & (xs < self.width) & (ys >= 0) & (ys < self.height)
            self.px[ys[ok], xs[ok]] = color
        return w

    def png(self) -> bytes:
        return encode_png(self.px)


def text_width(s: str, scale: int = 2) -> int:
    return max(0, len(s) * ADVANCE * scale - scale)


def encode_png(rgb: np.ndarray) -> bytes:
    """An 8-bit RGB PNG of a uint8 [H, W, 3] array."""
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"expected a uint8 [H, W, 3] array, got {rgb.dtype} {rgb.shape}")
    h, w, _ = rgb.shape

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    scanlines = np.concatenate([np.zeros((h, 1), dtype=np.uint8), rgb.reshape(h, w * 3)], axis=1)
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # 8 bits, truecolor, no interlace
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(scanlines.tobytes(), 9)) + chunk(b"IEND", b""))


# ---- axes ---------------------------------------------------------------------------------------

def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About n round values (1, 2, 5 × 10^k steps) covering [lo, hi]."""
    if not hi > lo:
        hi = lo + 1
    raw = (hi - lo) / max(1, n)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step + 1e-9) * step
    ticks, t = [], first
    while t < hi + step * 0.999:
        ticks.append(round(t, 12))
        t += step
    return ticks


def log2_ticks(lo: float, hi: float, max_ticks: int = 9) -> list[float]:
    a, b = math.floor(math.log2(lo)), math.ceil(math.log2(hi))
    every = max(1, math.ceil((b - a + 1) / max_ticks))
    return [2.0 ** e for e in range(a, b + 1, every)]


def fmt_tick(v: float) -> str:
    if v >= 1024 and v == int(v) and int(v) % 1024 == 0:
        return f"{int(v) // 1024}k"
    if v == int(v):
        return str(int(v))
    return f"{v:.3g}"


@dataclass
class Series:
    label: str
    xs: list[float]
    ys: list[float]
    color: tuple[int, int, int] | None = None


@dataclass
class Panel:
    title: str
    xlabel: str
    series: list[Series]


def render_chart(panels: list[Panel], width: int = 1280, panel_height: int = 440,
                 title: str | None = None) -> bytes:
    """Panels side by side (shared legend below them); x is log2 for geometric x values."""
    scale = 2
    line_h = GLYPH_H * scale + 8
    labels: dict[str, tuple[int, int, int]] = {}
    for p in panels:
        for s in p.series:
            if s.label not in labels:
                labels[s.label] = s.color or PALETTE[len(labels) % len(PALETTE)]

    # Legend: swatch + label entries flowed into rows.
    legend_rows: list[list[str]] = [[]]
    x = 0
    for label in labels:
        w = 40 + text_width(label, scale) + 30
        if legend_rows[-1] and x + w > width - 40:
            legend_rows.append([])
            x = 0
        legend_rows[-1].append(label)
        x += w
    top = 10 + (line_h + 6 if title else 0)
    height = top + panel_height + 14 + len(legend_rows) * line_h + 10
    c = Canvas(width, height)
    if title:
        c.text(width // 2, 10, title, BLACK, scale, anchor="center")

    pw = width // max(1, len(panels))
    for i, p in enumerate(panels):
        _draw_panel(c, p, labels, i * pw, top, pw, panel_height, scale)

    y = top + panel_height + 14
    for row in legend_rows:
        x = 60
        for label in row:
            color = labels[label]
            c.line(x, y + GLYPH_H, x + 28, y + GLYPH_H, color, width=3)
            c.rect(x + 11, y + GLYPH_H - 3, x + 18, y + GLYPH_H + 4, color)
            x += 40
            x += c.text(x, y, label, AXIS_TEXT, scale) + 30
        y += line_h
    return c.png()


def _draw_panel(c: Canvas, p: Panel, colors: dict, x0: int, y0: int, w: int, h: int,
                scale: int) -> None:
    pts = [(x, y) for s in p.series for x, y in zip(s.xs, s.ys) if _finite(x) and _finite(y)]
    xs = [x for x, _ in pts] or [1.0]
    ys = [y for _, y in pts] or [1.0]
    xlo, xhi = min(xs), max(xs)
    # A geometric walk (×2 frontiers) reads best on a log axis, an arithmetic one on a linear one.
    ux = sorted(set(xs))
    steps = sorted(b / a for a, b in zip(ux, ux[1:])) if xlo > 0 else []
    logx = bool(steps) and xhi / xlo >= 8 and steps[len(steps) // 2] >= 1.5
    if logx:
        xt = log2_ticks(xlo, xhi)
        xlo, xhi = xt[0], xt[-1]
        fx = math.log2
    else:
        xt = nice_ticks(xlo, xhi) if xhi > xlo else [xlo - 1, xlo, xlo + 1]
        xlo, xhi = xt[0], xt[-1]
        fx = float
    yt = nice_ticks(0.0, max(ys) * 1.05 if max(ys) > 0 else 1.0)
    ylo, yhi = 0.0, yt[-1]

    ylab_w = max(text_width(fmt_tick(t), scale) for t in yt)
    left, right = x0 + ylab_w + 22, x0 + w - 24
    top, bottom = y0 + GLYPH_H * scale + 16, y0 + h - 2 * (GLYPH_H * scale + 8) - 4

    def px(x: float) -> float:
        return left + (fx(x) - fx(xlo)) / (fx(xhi) - fx(xlo)) * (right - left)

    def py(y: float) -> float:
        return bottom - (y - ylo) / (yhi - ylo) * (bottom - top)

    c.text((left + right) // 2, y0, p.title, BLACK, scale, anchor="center")
    for t in yt:
        y = round(py(t))
        c.line(left, y, right, y, GRID)
        c.text(left - 8, y - GLYPH_H * scale // 2, fmt_tick(t), AXIS_TEXT, scale, anchor="right")
    for t in xt:
        x = round(px(t))
        c.line(x, top, x, bottom, GRID)
        c.line(x, bottom, x, bottom + 5, BLACK)
        c.text(x, bottom + 8, fmt_tick(t), AXIS_TEXT, scale, anchor="center")
    c.line(left, top, left, bottom, BLACK)
    c.line(left, bottom, right, bottom, BLACK)
    xl = p.xlabel + (", log scale" if logx else "")
    c.text((left + right) // 2, bottom + GLYPH_H * scale + 16, xl, AXIS_TEXT, scale, anchor="center")

    for s in p.series:
        color = colors[s.label]
        pts = [(px(x), py(y)) for x, y in sorted(zip(s.xs, s.ys)) if _finite(x) and _finite(y)]
        for (ax, ay), (bx, by) in zip(pts, pts[1:]):
            c.line(ax, ay, bx, by, color, width=3)
        for ax, ay in pts:
            c.rect(round(ax) - 4, round(ay) - 4, round(ax) + 5, round(ay) + 5, color)


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


# ---- bench rows ---------------------------------------------------------------------------------

def bench_series_label(backend: str, device: str, model: str, with_model: bool) -> str:
    return f"{backend} on {device}" + (f" ({model})" if with_model else "")


def plot_bench(groups: list[list], path=None, title: str | None = None) -> bytes:
    """Prefill and generation tokens/s against context, one series per group of `BenchRow`s
    (e.g. one per backend or per CSV); writes the PNG to `path` when given and returns it."""
    groups = [g for g in groups if g]
    models = {r.model for g in groups for r in g}
    labels: list[str] = []
    for g in groups:
        r = g[0]
        label = bench_series_label(r.backend, r.device, r.model, len(models) > 1)
        n, base = 2, label
        while label in labels:
            label, n = f"{base} #{n}", n + 1
        labels.append(label)
    panels = [
        Panel("prefill tokens/s", "context (tokens)",
              [Series(lab, [r.frontier for r in g], [r.prefill_tok_s for r in g])
               for lab, g in zip(labels, groups)]),
        Panel("generation tokens/s", "context (tokens)",
              [Series(lab, [r.frontier for r in g], [r.gen_tok_s for r in g])
               for lab, g in zip(labels, groups)]),
    ]
    if title is None and len(models) == 1:
        title = f"ds4 bench: {next(iter(models))}"
    data = render_chart(panels, title=title)
    if path is not None:
        from .core.atomic import atomic_file

        with atomic_file(path, private=False) as f:
            f.write(data)
    return data


def group_rows(rows: list) -> list[list]:
    """Split rows into runs: a new group whenever backend/device/model changes or the frontier
    does not increase (so two runs of the same backend stay two series)."""
    groups: list[list] = []
    for r in rows:
        g = groups[-1] if groups else None
        if (g is None or (r.backend, r.device, r.model) != (g[-1].backend, g[-1].device, g[-1].model)
                or r.frontier <= g[-1].frontier):
            groups.append([r])
        else:
            g.append(r)
    return groups
