"""Each stage holds only what it needs: latents the VAE (encoder), text the text encoders, training the denoiser;
in-training validation reuses the training denoiser and holds the VAE and text encoders only while it renders."""

from __future__ import annotations

import os

import pytest

from tests.integration.test_train_support import small_config, train
from tests.tracing import tuneline_trace
from tests.tracing.tuneline_trace import LOADED
from tuneline.stages.common.jsonl import read_jsonl
from tuneline.stages.common.stage import StageContext, run_stage
from tuneline.stages.pipeline import PIPELINE, stage

pytestmark = pytest.mark.slow


def test_each_stage_loads_only_its_models(tmp_path, monkeypatch):
    from tuneline.stages.scan.demo import write_demo_dataset

    cfg = small_config(tmp_path, {"steps": 3, "processes": 1, "validate_every": 1, "checkpoint_every": 3})
    write_demo_dataset(cfg.resolve(cfg.dataset.path))
    ctx = StageContext(cfg)
    tuneline_trace.install()  # this process records what it loads (LOADED); the training processes too, below
    run_stage(ctx, stage("scan"), PIPELINE)
    loaded = {}
    for name in ("latents", "text"):
        LOADED.clear()
        run_stage(ctx, stage(name), PIPELINE)
        loaded[name] = list(LOADED)
    assert loaded == {"latents": ["vae"], "text": ["text_encoder"]}

    trace = tmp_path / "trace"
    trace.mkdir()
    tuneline_trace.enable(monkeypatch, trace)
    out = train(cfg)
    rows = list(read_jsonl(trace / "trace-rank0.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # between steps, after each step's validation render
        assert r["models"].get("UNet2DConditionModel") == 1, r["models"]  # the training denoiser, no second one
        assert "AutoencoderKL" not in r["models"] and "CLIPTextModel" not in r["models"], r["models"]
    # Each render loaded the VAE and the text encoder (never a denoiser); training loaded the denoiser once.
    assert rows[-1]["loaded"] == ["unet", "vae", "text_encoder", "vae", "text_encoder"]
    assert sorted(os.listdir(out / "samples")) == [f"step-{s:07d}.png" for s in (1, 2, 3)]
