"""Line charts as hand-written SVG: no plotting library, readable in a browser and on GitHub.

A tool, not a chapter file: `make chapter` (tools/chapter.py) draws its figures with it.
Read first: `line_chart`.
"""
import math

COLORS = ["#4e79a7", "#f28e2b", "#e15759", "#59a14f", "#b07aa1", "#76b7b2", "#edc948"]
WIDTH, HEIGHT, LEFT, RIGHT, TOP, BOTTOM = 820, 420, 70, 230, 40, 50


def _esc(text):
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _ticks(low, high, count=5, log=False):
    """About `count` round numbers spanning [low, high] (on a log axis: 1, 2, 5 x 10^k, as logs)."""
    if log:
        decades = range(math.floor(low) - 1, math.ceil(high) + 1)
        marks = [math.log10(m * 10 ** d) for d in decades for m in (1, 2, 5)]
        inside = [v for v in marks if low - 1e-9 <= v <= high + 1e-9]
        return inside if len(inside) >= 2 else _ticks(low, high, count)
    if high <= low:
        return [low]
    step = 10 ** math.floor(math.log10((high - low) / count))
    for factor in (1, 2, 5, 10):
        if (high - low) / (step * factor) <= count:
            step *= factor
            break
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step) + 1)]


def moving_average(points, window):
    """[(x, mean of the last `window` y's)]: a readable line through a noisy loss curve."""
    out = []
    for i, (x, _) in enumerate(points):
        recent = [y for _, y in points[max(0, i - window + 1):i + 1]]
        out.append((x, sum(recent) / len(recent)))
    return out


def line_chart(series, title, x_label, y_label, log=False, marks=()):
    """series: [(name, [(x, y), ...])]. log: log-log axes (x and y > 0). marks: [(series name, x)]
    drawn as a small cross on that series' line (e.g. skipped optimizer steps). Returns SVG text."""
    points = [(x, y) for _, pts in series for x, y in pts if y is not None and math.isfinite(y)]
    scale = (lambda v: math.log10(v)) if log else (lambda v: v)
    xs, ys = [scale(x) for x, _ in points], [scale(y) for _, y in points]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    if y1 == y0:
        y0, y1 = y0 - 1, y1 + 1
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    px = lambda x: LEFT + (scale(x) - x0) / ((x1 - x0) or 1) * plot_w
    py = lambda y: TOP + plot_h - (scale(y) - y0) / (y1 - y0) * plot_h
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" '
           f'font-size="12">', f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
           f'<text x="{LEFT}" y="22" font-size="14" font-weight="bold">{_esc(title)}</text>',
           f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#999"/>']
    for value in _ticks(y0, y1, log=log):
        y = TOP + plot_h - (value - y0) / (y1 - y0) * plot_h
        label = f"{10 ** value:.3g}" if log else f"{value:.3g}"
        out.append(f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>'
                   f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{label}</text>')
    for value in _ticks(x0, x1, log=log):
        x = LEFT + (value - x0) / ((x1 - x0) or 1) * plot_w
        label = f"{10 ** value:.3g}" if log else f"{value:.3g}"
        out.append(f'<text x="{x:.1f}" y="{TOP + plot_h + 16}" text-anchor="middle">{label}</text>')
    out.append(f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 12}" text-anchor="middle">{_esc(x_label)}</text>')
    out.append(f'<text x="16" y="{TOP + plot_h / 2}" transform="rotate(-90 16 {TOP + plot_h / 2})" '
               f'text-anchor="middle">{_esc(y_label)}</text>')
    for i, (name, pts) in enumerate(series):
        color = COLORS[i % len(COLORS)]
        good = [(x, y) for x, y in pts if y is not None and math.isfinite(y)]
        path = " ".join(f"{'M' if j == 0 else 'L'}{px(x):.1f},{py(y):.1f}" for j, (x, y) in enumerate(good))
        out.append(f'<path d="{path}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        if len(good) <= 12:
            out += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{color}"/>' for x, y in good]
        at = dict(good)
        for mark_name, x in marks:
            if mark_name == name and x in at:
                cx, cy = px(x), py(at[x])
                out.append(f'<path d="M{cx - 4:.1f},{cy - 4:.1f}L{cx + 4:.1f},{cy + 4:.1f}M{cx - 4:.1f},{cy + 4:.1f}'
                           f'L{cx + 4:.1f},{cy - 4:.1f}" stroke="{color}" stroke-width="1.5"/>')
        ly = TOP + 14 + 18 * i
        out.append(f'<rect x="{WIDTH - RIGHT + 12}" y="{ly - 9}" width="12" height="3" fill="{color}"/>'
                   f'<text x="{WIDTH - RIGHT + 28}" y="{ly - 4}">{_esc(name)}</text>')
    if marks:
        out.append(f'<text x="{WIDTH - RIGHT + 12}" y="{TOP + 22 + 18 * len(series)}">x = a skipped step</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
