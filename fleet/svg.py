"""Line charts as SVG, written by hand so that the report's plots need nothing
beyond the standard library (the short test must not depend on a plotting
package being installable)."""

from __future__ import annotations

from html import escape
from typing import Sequence

COLORS = ["#d62728", "#ff7f0e", "#2ca02c", "#1f77b4", "#9467bd", "#8c564b", "#17becf", "#7f7f7f"]


def _nice_max(value: float) -> float:
    if value <= 0:
        return 1.0
    magnitude = 10 ** len(str(int(value))) / 10
    for step in (1, 2, 2.5, 5, 10):
        if value <= step * magnitude:
            return step * magnitude
    return 10 * magnitude


def line_chart(
    path: str,
    title: str,
    series: Sequence[tuple[str, Sequence[float], Sequence[float]]],
    *,
    shade: tuple[float, float] | None = None,
    shade_label: str = "fault",
    marks: Sequence[tuple[float, str]] = (),
    xlabel: str = "seconds",
    ylabel: str = "requests / s",
    reference: tuple[float, str] | None = None,
) -> None:
    """One chart: ``series`` is (label, xs, ys); ``shade`` a window on x;
    ``marks`` vertical lines with labels; ``reference`` a dashed horizontal line."""
    width, height = 900, 380
    left, right, top, bottom = 64, 290, 36, 48
    plot_w, plot_h = width - left - right, height - top - bottom
    xs_all = [x for _, xs, _ in series for x in xs] or [0.0, 1.0]
    ys_all = [y for _, _, ys in series for y in ys] or [1.0]
    x0, x1 = min(xs_all), max(xs_all)
    if x1 <= x0:
        x1 = x0 + 1
    y1 = _nice_max(max(ys_all + ([reference[0]] if reference else [])) * 1.05)

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * plot_w

    def sy(y: float) -> float:
        return top + plot_h - y / y1 * plot_h

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{left}" y="22" font-size="14" font-weight="bold">{escape(title)}</text>',
    ]
    if shade:
        a, b = sx(max(shade[0], x0)), sx(min(shade[1], x1))
        out.append(f'<rect x="{a:.1f}" y="{top}" width="{b - a:.1f}" height="{plot_h}" fill="#f4cccc" opacity="0.6"/>')
        out.append(f'<text x="{a + 4:.1f}" y="{top + 14}" fill="#a33">{escape(shade_label)}</text>')
    for i in range(6):
        y = y1 * i / 5
        out.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{sy(y):.1f}" y2="{sy(y):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{sy(y) + 4:.1f}" text-anchor="end">{y:g}</text>')
    step = max(1, round((x1 - x0) / 10))
    x = int(x0)
    while x <= x1:
        out.append(f'<line x1="{sx(x):.1f}" x2="{sx(x):.1f}" y1="{top + plot_h}" y2="{top + plot_h + 4}" stroke="#333"/>')
        out.append(f'<text x="{sx(x):.1f}" y="{top + plot_h + 18}" text-anchor="middle">{x:g}</text>')
        x += step
    out.append(f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#333"/>')
    out.append(f'<text x="{left + plot_w / 2}" y="{height - 10}" text-anchor="middle">{escape(xlabel)}</text>')
    out.append(f'<text transform="translate(16,{top + plot_h / 2}) rotate(-90)" text-anchor="middle">{escape(ylabel)}</text>')
    for at, label in marks:
        out.append(f'<line x1="{sx(at):.1f}" x2="{sx(at):.1f}" y1="{top}" y2="{top + plot_h}" stroke="#555" stroke-dasharray="3,3"/>')
        out.append(f'<text x="{sx(at) + 3:.1f}" y="{top + plot_h - 6}" fill="#555">{escape(label)}</text>')
    if reference:
        out.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{sy(reference[0]):.1f}" y2="{sy(reference[0]):.1f}" '
                   f'stroke="#000" stroke-dasharray="6,4"/>')
    legend_y = top + 8
    for index, (label, xs, ys) in enumerate(series):
        color = COLORS[index % len(COLORS)]
        points = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(xs, ys))
        out.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="2"/>')
        out.append(f'<line x1="{left + plot_w + 12}" x2="{left + plot_w + 32}" y1="{legend_y}" y2="{legend_y}" '
                   f'stroke="{color}" stroke-width="3"/>')
        out.append(f'<text x="{left + plot_w + 38}" y="{legend_y + 4}">{escape(label)}</text>')
        legend_y += 18
    if reference:
        out.append(f'<line x1="{left + plot_w + 12}" x2="{left + plot_w + 32}" y1="{legend_y}" y2="{legend_y}" '
                   f'stroke="#000" stroke-dasharray="6,4"/>')
        out.append(f'<text x="{left + plot_w + 38}" y="{legend_y + 4}">{escape(reference[1])}</text>')
    out.append("</svg>")
    with open(path, "w") as file:
        file.write("\n".join(out) + "\n")


def bar_chart(
    path: str,
    title: str,
    groups: Sequence[str],
    series: Sequence[tuple[str, Sequence[float]]],
    *,
    ylabel: str = "",
    reference: tuple[float, str] | None = None,
) -> None:
    """Grouped bars on a log axis (1× to 100×): ``groups`` along x, one bar per
    ``series`` entry (label, one value per group) in each group, its value
    written above it. Log, because 27× and 1.2× must both be readable."""
    import math

    width, height = 900, 400
    left, right, top, bottom = 64, 200, 36, 48
    plot_w, plot_h = width - left - right, height - top - bottom
    lo, hi = 0.0, 2.0  # log10 of 1× and 100×

    def sy(value: float) -> float:
        v = min(hi, max(lo, math.log10(max(value, 1.0))))
        return top + plot_h - (v - lo) / (hi - lo) * plot_h

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{left}" y="22" font-size="14" font-weight="bold">{escape(title)}</text>',
    ]
    for tick in (1, 2, 5, 10, 20, 50, 100):
        out.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{sy(tick):.1f}" y2="{sy(tick):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{sy(tick) + 4:.1f}" text-anchor="end">{tick}×</text>')
    group_w = plot_w / max(1, len(groups))
    bar_w = group_w * 0.8 / max(1, len(series))
    for g, group in enumerate(groups):
        x0 = left + g * group_w + group_w * 0.1
        for s, (_, values) in enumerate(series):
            value = values[g]
            x = x0 + s * bar_w
            y = sy(value)
            out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar_w - 2:.1f}" height="{top + plot_h - y:.1f}" '
                       f'fill="{COLORS[s % len(COLORS)]}"/>')
            out.append(f'<text x="{x + (bar_w - 2) / 2:.1f}" y="{y - 4:.1f}" text-anchor="middle" font-size="11">'
                       f'{value:.2f}</text>')
        out.append(f'<text x="{left + (g + 0.5) * group_w:.1f}" y="{top + plot_h + 18}" text-anchor="middle">'
                   f'{escape(group)}</text>')
    out.append(f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#333"/>')
    out.append(f'<text transform="translate(16,{top + plot_h / 2}) rotate(-90)" text-anchor="middle">{escape(ylabel)}</text>')
    if reference:
        out.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{sy(reference[0]):.1f}" y2="{sy(reference[0]):.1f}" '
                   f'stroke="#000" stroke-dasharray="6,4"/>')
    legend_y = top + 8
    for index, (label, _) in enumerate(series):
        out.append(f'<rect x="{left + plot_w + 12}" y="{legend_y - 6}" width="20" height="12" '
                   f'fill="{COLORS[index % len(COLORS)]}"/>')
        out.append(f'<text x="{left + plot_w + 38}" y="{legend_y + 4}">{escape(label)}</text>')
        legend_y += 18
    if reference:
        out.append(f'<line x1="{left + plot_w + 12}" x2="{left + plot_w + 32}" y1="{legend_y}" y2="{legend_y}" '
                   f'stroke="#000" stroke-dasharray="6,4"/>')
        out.append(f'<text x="{left + plot_w + 38}" y="{legend_y + 4}">{escape(reference[1])}</text>')
    out.append("</svg>")
    with open(path, "w") as file:
        file.write("\n".join(out) + "\n")
