"""The demo's pixel-space learning check: is the rendered image's dominant non-background color the prompted one?

The demo draws one palette-colored shape on a grey background, so the background has (almost) no saturation and
the shape a lot: the most saturated pixels are the shape's. Each of them votes for its nearest palette color (RGB
distance); the majority is the image's color. An image without saturated pixels (a grey or noisy render) has no
color and counts as a miss, so chance is at most 1 / number of colors.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from PIL import Image

from tuneline.schemas.demo import DEMO_COLORS, RGB

# max-min over RGB: the demo's backgrounds are grey (0), its shapes 150-205; 60 leaves room for decoder blur.
MIN_SATURATION = 60
# Of the saturated pixels, the most saturated quarter votes: the shape's core, not its blurred edge.
TOP_FRACTION = 0.25


def dominant_color(image: Image.Image, palette: dict[str, tuple[int, int, int]] | None = None) -> str | None:
    """The palette color of the image's most saturated pixels, or None when no pixel is saturated."""
    palette = palette or {c: RGB[c] for c in DEMO_COLORS}
    px = np.asarray(image.convert("RGB"), dtype=np.float32).reshape(-1, 3)
    sat = px.max(axis=1) - px.min(axis=1)
    px, sat = px[sat >= MIN_SATURATION], sat[sat >= MIN_SATURATION]
    if not len(px):
        return None
    keep = px[sat >= np.quantile(sat, 1 - TOP_FRACTION)]
    names = list(palette)
    centers = np.array([palette[n] for n in names], dtype=np.float32)
    nearest = ((keep[:, None, :] - centers[None]) ** 2).sum(axis=2).argmin(axis=1)
    return names[Counter(nearest.tolist()).most_common(1)[0][0]]


def color_accuracy(images: list[Image.Image], prompted: list[str]) -> float:
    """Fraction of images whose dominant color is the prompted one."""
    hits = sum(dominant_color(img) == color for img, color in zip(images, prompted, strict=True))
    return hits / max(1, len(images))
