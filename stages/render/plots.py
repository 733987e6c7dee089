"""The loss-curve PNG, drawn by matplotlib's Agg renderer on a Figure of its own (no display, no pyplot: a
figure nobody shows needs neither pyplot's global state nor its import, and matplotlib itself is imported only
when a curve is drawn, not by every training process that imports this module)."""

from __future__ import annotations

import io
from collections.abc import Sequence

from PIL import Image

SIZE = (640, 360)
DPI = 100


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average (the raw per-step loss of diffusion training is mostly timestep noise)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _finite(v: float) -> bool:
    return v == v and abs(v) != float("inf")


def loss_curve(
    losses: Sequence[float], title: str = "training loss", eval_losses: Sequence[dict] | None = None
) -> Image.Image:
    """Raw loss per step in light grey, its moving average in blue, and eval loss points ({step, loss}) in orange."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(SIZE[0] / DPI, SIZE[1] / DPI), dpi=DPI)  # savefig draws it with Agg
    ax = fig.subplots()
    steps = [i + 1 for i, v in enumerate(losses) if _finite(v)]
    raw = [v for v in losses if _finite(v)]
    if raw:
        ax.plot(steps, raw, color="0.8", linewidth=0.8, label="loss per step")
        ax.plot(steps, smooth(raw, max(1, len(raw) // 20)), color="tab:blue", linewidth=1.8, label="moving average")
    points = [(e["step"], e["loss"]) for e in eval_losses or () if _finite(e["loss"])]
    if points:
        ax.plot(*zip(*points), "o-", color="tab:orange", label="eval loss")
    if not raw and not points:
        ax.text(0.5, 0.5, "no finite loss values", ha="center", va="center", transform=ax.transAxes)
    else:
        ax.legend(loc="upper right", fontsize=8)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    buf.seek(0)
    return Image.open(buf).convert("RGB")
