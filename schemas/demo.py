"""The built-in demo: `tuneline run` without a config runs exactly this (and `config example` prints it)."""
from __future__ import annotations

# Colors are the demo's classes: the learning check asks whether "a <color> ..." samples land nearest
# to that color's mean cached latent.
DEMO_COLORS = ("red", "green", "blue", "yellow")
DEMO_SHAPES = ("square", "circle")

DEMO_CONFIG: dict = {
    "workdir": "./tuneline-work",
    "dataset": {"path": "demo-data", "demo": True},
    "model": {"family": "tiny", "path": None},
    "buckets": {"resolution": 64, "resolution_type": "pixel"},
    "train": {"steps": 300, "batch_size": 8, "processes": 2, "learning_rate": 1e-3},
    "validate": {
        "prompts": [{"prompt": f"a {c} {s}", "negative_prompt": "", "seed": i}
                    for i, (c, s) in enumerate(zip(DEMO_COLORS, DEMO_SHAPES * 2))],
        "steps": 20,
        "learning_check": True,
    },
}
