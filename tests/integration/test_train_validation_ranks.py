"""In-training validation with 2 gloo processes: each rank renders its share of the prompts (prompt i on rank
i mod 2, the shorter share padded so both run the same forwards), and rank 0's grid is the one a single process
renders from the same weights, in prompt order."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from tests.integration.test_train_support import small_config, train
from tests.tracing import tuneline_trace
from tuneline.stages.common.jsonl import read_jsonl
from tuneline.stages.families.registry import get_family
from tuneline.stages.render.renderer import Renderer, Sample, grid, render_size_for

PROMPTS = [
    {"prompt": "a red square", "seed": 1},
    {"prompt": "a blue circle", "seed": 2},
    {"prompt": "a green square", "seed": 3},
]
TRAIN = {"steps": 2, "processes": 2, "batch_size": 2, "checkpoint_every": 2, "validate_every": 2, "ema": False}


def test_validation_renders_split_over_ranks_and_the_grid_is_the_one_process_render(
    tmp_path, monkeypatch, upstream_store, demo_data
):
    cfg = small_config(tmp_path, TRAIN, validate={"prompts": PROMPTS, "steps": 2}, dataset={"path": str(demo_data)})
    upstream_store.upstream(cfg)
    tuneline_trace.enable(monkeypatch, tmp_path)
    out = train(cfg)
    shares = [[row["prompts"] for row in read_jsonl(tmp_path / f"render-rank{r}.jsonl")] for r in (0, 1)]
    assert shares == [[["a red square", "a green square"]], [["a blue circle", "a green square"]]]
    saved = np.asarray(Image.open(out / "samples" / "step-0000002.png").convert("RGB"), dtype=np.int16)

    fam = get_family(cfg.model.family)
    v = cfg.validate_
    with torch.no_grad():
        images = Renderer.load(fam, out / "final", torch.device("cpu"), torch.float32).render(
            [Sample(p["prompt"], "", p["seed"]) for p in PROMPTS], *render_size_for(cfg), v.steps, v.guidance_scale
        )
    alone = np.asarray(grid(images).convert("RGB"), dtype=np.int16)
    assert saved.shape == alone.shape
    assert np.abs(saved - alone).max() <= 2, "the 2-rank grid differs from the one-process render"
