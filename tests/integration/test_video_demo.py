"""The video demo (dataset.demo: video) and the suite's cheap check of its learning check: a short full fine-tune of
the wan tiny flavor, in this process (tests/trainer.py) on the session's cached upstreams of the video demo, makes
the clips rendered for "a <color> square moving <direction>" move the prompted way clearly more often than the
untrained model's (validate's motion_accuracy, stages/validate/motion.py). Measured: 1200 steps pass; with no step
taken the test fails (0.25 trained, 0.25 untrained). Whole-demo runs are bench/learning.py's (`--only video`).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.trainer import steps, trainer_for
from tuneline.schemas.config import ConfigError, parse_config
from tuneline.schemas.demo import DEMO_CONFIG
from tuneline.schemas.latents import LatentsManifest
from tuneline.stages.families import resolve as models
from tuneline.stages.render.renderer import Renderer, render_size_for
from tuneline.stages.scan import video_demo
from tuneline.stages.scan.demo import write_demo_for
from tuneline.stages.text import effective_max_length
from tuneline.stages.validate.clips import clip_frames
from tuneline.stages.validate.motion import direction_means, motion_accuracy

# The short run (one process, the example's batch of 8) and the margin it must clear over the untrained model.
STEPS, RATE, MARGIN = 1200, 1e-2, 0.25


def _config(workdir, **train):
    data = copy.deepcopy(DEMO_CONFIG)
    data["workdir"] = str(workdir)
    data["dataset"] = {"path": "demo-data", "demo": "video"}
    data["model"] = {"family": "wan", "path": None, "device": "cpu"}
    data["train"] |= {"steps": STEPS, "processes": 1, "learning_rate": RATE, "validate_every": 0} | train
    data["validate"] |= {"check_seeds": 2}
    return parse_config(data)


def test_an_image_family_is_refused_with_the_fix():
    data = copy.deepcopy(DEMO_CONFIG) | {"dataset": {"path": "demo-data", "demo": "video"}}
    with pytest.raises(ConfigError, match=r"dataset.demo video .* model.family 'tiny' .* \(wan, wan22\)"):
        parse_config(data)


def test_the_clips_move_as_captioned_and_are_drawn_alike_every_time(tmp_path):
    import random

    import av
    import numpy as np

    video_demo.write_video_demo(tmp_path)
    assert len(list(tmp_path.glob("*.mp4"))) == len(video_demo.clips()) == 48
    assert (tmp_path / "red_left_0.txt").read_text() == "a red square moving left\n"
    assert {t.split()[-1] for t in video_demo.showcase(4)} == set(video_demo.DIRECTIONS)
    drawn = [[np.asarray(f) for f in video_demo.draw_clip("red", "up", random.Random(7))] for _ in range(2)]
    assert all((a == b).all() for a, b in zip(*drawn))
    for stem, axis, sign in (("red_left_0", 1, -1), ("blue_down_1", 0, 1)):
        with av.open(str(tmp_path / f"{stem}.mp4")) as clip:
            frames = [f.to_ndarray(format="rgb24").astype(int) for f in clip.decode(video=0)]
        assert len(frames) == video_demo.FRAMES
        # the square's centre (its pixels are far from the dark background) moves the captioned way
        centres = [np.argwhere(f.max(axis=2) > 120).mean(axis=0)[axis] for f in (frames[0], frames[-1])]
        assert sign * (centres[1] - centres[0]) > 25, (stem, centres)


@pytest.mark.slow
def test_a_short_run_moves_the_prompted_way(upstream_store, tmp_path):
    cfg = _config(tmp_path / "w")
    write_demo_for(cfg)
    ctx = upstream_store.upstream(cfg)
    upstream = {"latents": ctx.store.read(ctx.store.latest("latents"), LatentsManifest)}
    size, frames = render_size_for(cfg, aspect=1.0), clip_frames(cfg)
    means = direction_means(ctx, upstream, size, frames)
    fam, model_dir, cpu = models.family(cfg), models.model_dir(ctx), torch.device("cpu")

    def accuracy(**trained) -> float:
        renderer = Renderer.load(fam, model_dir, cpu, torch.float32, max_length=effective_max_length(cfg), **trained)
        return motion_accuracy(renderer, cfg, size, frames, means)

    untrained = accuracy()
    trainer = trainer_for(cfg, ctx)
    steps(trainer, STEPS)
    trained = accuracy(denoiser=trainer.denoiser)
    assert trained - untrained >= MARGIN, (trained, untrained)
