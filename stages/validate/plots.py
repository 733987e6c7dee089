"""The loss-curve PNG, drawn with PIL (no plotting library needed at run time)."""
from __future__ import annotations

from collections.abc import Sequence

from PIL import Image, ImageDraw

SIZE = (640, 360)
MARGIN = (56, 16, 16, 36)  # left, top, right, bottom


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average (the raw per-step loss of diffusion training is mostly timestep noise)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def loss_curve(losses: Sequence[float], title: str = "training loss") -> Image.Image:
    """Raw loss per step in light grey, its moving average in blue, min/max and step labels on the axes."""
    img = Image.new("RGB", SIZE, "white")
    draw = ImageDraw.Draw(img)
    left, top, right, bottom = MARGIN[0], MARGIN[1], SIZE[0] - MARGIN[2], SIZE[1] - MARGIN[3]
    draw.rectangle((left, top, right, bottom), outline=(160, 160, 160))
    draw.text((left + 6, top + 4), title, fill="black")
    finite = [v for v in losses if v == v and abs(v) != float("inf")]
    if not finite:
        draw.text((left + 6, top + 24), "no finite loss values", fill="black")
        return img
    lo, hi = min(finite), max(finite)
    span = (hi - lo) or 1.0
    n = max(1, len(losses) - 1)

    def point(i: int, v: float) -> tuple[float, float]:
        return left + (right - left) * i / n, bottom - (bottom - top) * (v - lo) / span

    curves = ((losses, (200, 200, 200), 1), (smooth(losses, max(1, len(losses) // 20)), (30, 90, 200), 2))
    for series, colour, width in curves:
        pts = [point(i, v) for i, v in enumerate(series) if v == v and abs(v) != float("inf")]
        if len(pts) > 1:
            draw.line(pts, fill=colour, width=width)
    draw.text((4, top), f"{hi:.4g}", fill="black")
    draw.text((4, bottom - 10), f"{lo:.4g}", fill="black")
    draw.text((left, bottom + 8), "step 1", fill="black")
    draw.text((right - 60, bottom + 8), f"step {len(losses)}", fill="black")
    return img
