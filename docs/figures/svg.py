"""A small SVG writer for the documentation's figures: shapes, text, axes.

Plain SVG 1.1, no dependency beyond the standard library, and deterministic:
the same calls give the same bytes (numbers are written with at most two
decimals, attributes in a fixed order, no timestamps or random ids), so the
committed figures can be compared with freshly made ones.

Text is laid out without font metrics: ``text_width`` estimates a line's width
from its length (a sans-serif face averages about 0.56 em per character), and
the figures leave room for the estimate to be off by a tenth.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from xml.sax.saxutils import escape, quoteattr

FONT = "system-ui, -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif"
INK = "#1f2328"  # text and axes
MUTED = "#59636e"  # secondary text, grid labels
GRID = "#d8dee4"

# Okabe and Ito's palette: told apart with every common colour-vision deficiency.
BLUE = "#0072b2"
ORANGE = "#e69f00"
SKY = "#56b4e9"
GREEN = "#009e73"
YELLOW = "#f0e442"
VERMILION = "#d55e00"
PURPLE = "#cc79a7"
GREY = "#999999"


def num(v: float) -> str:
    """A coordinate as the file writes it: two decimals at most, no trailing zeros."""
    s = f"{v:.2f}".rstrip("0").rstrip(".")
    return "0" if s in ("-0", "") else s


def text_width(s: str, size: float) -> float:
    """Estimated width of one line of text in a sans-serif face."""
    return 0.56 * size * len(s)


class Svg:
    """One SVG document, written element by element in drawing order."""

    def __init__(self, width: float, height: float, title: str, desc: str = "") -> None:
        self.width = width
        self.height = height
        self._head = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{num(width)}" '
            f'height="{num(height)}" viewBox="0 0 {num(width)} {num(height)}" '
            f'font-family="{escape(FONT)}" font-size="13" fill="{INK}">',
            f"<title>{escape(title)}</title>",
        ]
        if desc:
            self._head.append(f"<desc>{escape(desc)}</desc>")
        self._defs: list[str] = []
        self._body: list[str] = []
        self._markers: set[str] = set()
        # A white ground: the figures stay readable on a dark page too.
        self.rect(0, 0, width, height, fill="#ffffff")

    def _add(self, tag: str, attrs: dict[str, object], content: str | None = None) -> None:
        parts = [tag]
        for key, value in attrs.items():
            if value is None:
                continue
            text = num(value) if isinstance(value, float | int) else str(value)
            parts.append(f"{key}={quoteattr(text)}")
        if content is None:
            self._body.append(f"<{' '.join(parts)}/>")
        else:
            self._body.append(f"<{' '.join(parts)}>{content}</{tag}>")

    def rect(
        self,
        x: float,
        y: float,
        w: float,
        h: float,
        fill: str = "none",
        stroke: str | None = None,
        stroke_width: float = 1,
        rx: float = 0,
        dash: str | None = None,
    ) -> None:
        self._add(
            "rect",
            {
                "x": x,
                "y": y,
                "width": w,
                "height": h,
                "rx": rx or None,
                "fill": fill,
                "stroke": stroke,
                "stroke-width": stroke_width if stroke else None,
                "stroke-dasharray": dash,
            },
        )

    def line(
        self,
        x1: float,
        y1: float,
        x2: float,
        y2: float,
        stroke: str = INK,
        width: float = 1,
        dash: str | None = None,
        arrow: bool = False,
    ) -> None:
        self._add(
            "line",
            {
                "x1": x1,
                "y1": y1,
                "x2": x2,
                "y2": y2,
                "stroke": stroke,
                "stroke-width": width,
                "stroke-dasharray": dash,
                "marker-end": f"url(#{self._arrowhead(stroke)})" if arrow else None,
            },
        )

    def polyline(
        self,
        points: Iterable[tuple[float, float]],
        stroke: str,
        width: float = 1.5,
        dash: str | None = None,
        arrow: bool = False,
    ) -> None:
        self._add(
            "polyline",
            {
                "points": " ".join(f"{num(x)},{num(y)}" for x, y in points),
                "fill": "none",
                "stroke": stroke,
                "stroke-width": width,
                "stroke-dasharray": dash,
                "stroke-linejoin": "round",
                "marker-end": f"url(#{self._arrowhead(stroke)})" if arrow else None,
            },
        )

    def circle(self, x: float, y: float, r: float, fill: str, stroke: str = "#ffffff") -> None:
        self._add("circle", {"cx": x, "cy": y, "r": r, "fill": fill, "stroke": stroke})

    def text(
        self,
        x: float,
        y: float,
        s: str,
        size: float = 13,
        anchor: str = "start",
        fill: str | None = None,
        bold: bool = False,
        italic: bool = False,
    ) -> None:
        """One line of text; ``y`` is its baseline."""
        self._add(
            "text",
            {
                "x": x,
                "y": y,
                "font-size": size if size != 13 else None,
                "text-anchor": anchor if anchor != "start" else None,
                "fill": fill,
                "font-weight": "bold" if bold else None,
                "font-style": "italic" if italic else None,
            },
            escape(s),
        )

    def lines(
        self,
        x: float,
        y: float,
        rows: Sequence[str],
        size: float = 13,
        leading: float = 1.3,
        fill: str | None = None,
    ) -> None:
        """Several lines, the first baseline at ``y``."""
        for i, row in enumerate(rows):
            self.text(x, y + i * size * leading, row, size=size, fill=fill)

    def _arrowhead(self, color: str) -> str:
        name = "arrow-" + color.lstrip("#")
        if name not in self._markers:
            self._markers.add(name)
            self._defs.append(
                f'<marker id="{name}" viewBox="0 0 10 10" refX="9" refY="5" '
                f'markerWidth="7" markerHeight="7" orient="auto-start-reverse">'
                f'<path d="M0,0 L10,5 L0,10 z" fill="{color}"/></marker>'
            )
        return name

    def render(self) -> str:
        defs = ["<defs>", *sorted(self._defs), "</defs>"] if self._defs else []
        return "\n".join([*self._head, *defs, *self._body, "</svg>"]) + "\n"


class Axis:
    """A data range mapped onto a pixel range, linear or logarithmic."""

    def __init__(self, lo: float, hi: float, p0: float, p1: float, log: bool = False) -> None:
        if log and (lo <= 0 or hi <= 0):
            raise ValueError(f"a log axis needs a positive range, not {lo}..{hi}")
        if lo == hi:
            raise ValueError(f"an axis needs a range, not {lo}..{hi}")
        self.lo, self.hi, self.p0, self.p1, self.log = lo, hi, p0, p1, log

    def __call__(self, v: float) -> float:
        if self.log:
            t = (math.log10(v) - math.log10(self.lo)) / (math.log10(self.hi) - math.log10(self.lo))
        else:
            t = (v - self.lo) / (self.hi - self.lo)
        return self.p0 + t * (self.p1 - self.p0)

    def decades(self) -> list[float]:
        """The powers of ten within a log axis's range."""
        k0, k1 = math.ceil(math.log10(self.lo) - 1e-9), math.floor(math.log10(self.hi) + 1e-9)
        return [10.0**k for k in range(k0, k1 + 1)]

    def steps(self, step: float) -> list[float]:
        """Multiples of ``step`` within a linear axis's range."""
        first = math.ceil(self.lo / step - 1e-9)
        last = math.floor(self.hi / step + 1e-9)
        return [k * step for k in range(first, last + 1)]


def frame(
    svg: Svg,
    x: Axis,
    y: Axis,
    xticks: Sequence[tuple[float, str]],
    yticks: Sequence[tuple[float, str]],
    xlabel: str,
    ylabel: str,
) -> None:
    """Grid lines, tick labels and axis titles of a chart's plot area."""
    left, right = min(x.p0, x.p1), max(x.p0, x.p1)
    top, bottom = min(y.p0, y.p1), max(y.p0, y.p1)
    for v, label in yticks:
        py = y(v)
        svg.line(left, py, right, py, stroke=GRID)
        svg.text(left - 8, py + 4, label, size=12, anchor="end", fill=MUTED)
    for v, label in xticks:
        px = x(v)
        svg.line(px, top, px, bottom, stroke=GRID)
        svg.text(px, bottom + 18, label, size=12, anchor="middle", fill=MUTED)
    svg.line(left, bottom, right, bottom, stroke=INK)
    svg.line(left, top, left, bottom, stroke=INK)
    svg.text((left + right) / 2, bottom + 40, xlabel, anchor="middle")
    svg.text(left, top - 12, ylabel, anchor="start")


def duration_label(us: float) -> str:
    """A tick's duration in the unit that reads best: 10 µs, 1 ms, 100 ms, 1 s."""
    if us >= 1e6:
        return f"{us / 1e6:g} s"
    if us >= 1e3:
        return f"{us / 1e3:g} ms"
    return f"{us:g} µs"
