"""Training outputs and failures on one process: LoRA with every option on, loaded by stock diffusers and
validated; a NaN loss stopping with the step and the images; a missing resume target refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.integration.family_runs import render_latents
from tests.integration.test_train_support import RecordingReporter, small_config, train
from tuneline.stages.common import markdown as md
from tuneline.stages.common.stage import StageContext, run_stage
from tuneline.stages.families import resolve as models
from tuneline.stages.pipeline import PIPELINE, stage
from tuneline.stages.train.failures import TrainingFailed

LORA = {
    "mode": "lora",
    "lora_rank": 4,
    "lora_alpha": 8,
    "steps": 4,
    "processes": 1,
    "batch_size": 4,
    "grad_accumulation": 2,
    "ema": True,
    "gradient_checkpointing": True,
    "loss_weighting": "min_snr",
    "noise_offset": 0.05,
    "latent_sampling": "sample",
    "lr_schedule": "linear",
    "warmup_steps": 1,
    "checkpoint_every": 2,
    "validate_every": 4,
    "learning_rate": 1e-2,
}


@pytest.fixture(scope="module")
def lora(tmp_path_factory, upstream_store, demo_data):
    wd = tmp_path_factory.mktemp("lora")
    cfg = small_config(wd, LORA, latents={"flip": True}, dataset={"path": str(demo_data)})
    ctx = upstream_store.upstream(cfg)
    reporter = RecordingReporter()
    return ctx, train(cfg, reporter), reporter


def _pipe(folder):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(folder, safety_checker=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_lora_final_loads_with_load_lora_weights_and_changes_the_render(lora):
    ctx, path, _ = lora
    assert (path / "final" / "pytorch_lora_weights.safetensors").is_file()
    pipe = _pipe(models.model_dir(ctx))
    before = render_latents(pipe)
    pipe.load_lora_weights(path / "final")
    after = render_latents(pipe)
    assert after.shape == before.shape and not torch.allclose(after, before)
    image = pipe("a red square", num_inference_steps=2, height=64, width=64).images[0]
    assert image.size == (64, 64)


def test_lora_exports_both_formats_listed_with_metadata(lora):
    """train.lora_format's default `both`: each file in final/, listed in the manifest's exports with the size and
    checksum the store verifies, its header naming this train version, the base model and the run's facts."""
    from safetensors import safe_open

    from tuneline.stages.common.hashing import file_sha256

    ctx, path, _ = lora
    manifest = json.loads((path / "manifest.json").read_text())
    assert [(e["file"], e["format"]) for e in manifest["exports"]] == [
        ("final/pytorch_lora_weights.safetensors", "diffusers"),
        ("final/lora_kohya.safetensors", "kohya"),
    ]
    for e in manifest["exports"]:
        assert e["bytes"] == (path / e["file"]).stat().st_size and e["sha256"] == file_sha256(path / e["file"])
        with safe_open(str(path / e["file"]), framework="pt") as f:
            meta = f.metadata()
        assert meta["tuneline.train_version"] == path.name == manifest["fingerprint"]
        assert meta["tuneline.base_identity"] == manifest["inputs"]["denoiser"]
        assert meta["ss_steps"] == "4" and meta["ss_network_dim"] == "4" and float(meta["ss_network_alpha"]) == 8
        assert int(meta["ss_num_train_images"]) > 0 and meta["ss_resolution"] == "(64, 64)"
        assert "ss_tag_frequency" not in meta


def test_lora_checkpoints_hold_adapter_optimizer_and_ema(lora):
    _, path, reporter = lora
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["mode"] == "lora" and manifest["ema"] and manifest["global_batch"] == 8
    assert manifest["checkpoints"] == ["checkpoints/step-0000002", "checkpoints/step-0000004"]
    assert manifest["samples"] == ["samples/step-0000004.png"] and (path / "samples/step-0000004.png").is_file()
    last = path / "checkpoints" / "step-0000004"
    assert sorted(p.name for p in last.iterdir()) == [
        "ema.safetensors",
        "optimizer.safetensors",
        "state.json",
        "trainable.safetensors",
    ]
    trained, ema = load_file(str(last / "trainable.safetensors")), load_file(str(last / "ema.safetensors"))
    assert trained and all("lora_" in k for k in trained) and trained.keys() == ema.keys()
    assert any(not torch.equal(trained[k], ema[k]) for k in trained)
    state = json.loads((last / "state.json").read_text())
    assert state["step"] == 4 and state["grad_accumulation"] == 2 and len(state["losses"]) == 4
    assert ("train-progress", 1.0) in reporter.progress_calls
    assert "final" in reporter.markdowns["train-outputs"]


def test_validate_renders_the_lora_result(lora):
    ctx, _, _ = lora
    reporter = RecordingReporter()
    out = run_stage(StageContext(ctx.cfg, reporter=reporter), stage("validate"), PIPELINE)[0]
    manifest = json.loads((out / "manifest.json").read_text())
    files = sorted(p.name for p in out.iterdir())
    assert files == ["000-seed0.png", "001-seed1.png", "002-seed2.png", "003-seed3.png", "grid.png", "manifest.json"]
    assert [i["prompt"] for i in manifest["images"]] == [p.prompt for p in ctx.cfg.validate_.prompts]
    assert manifest["class_separation_accuracy"] is None
    table = reporter.markdowns["validate-images"]
    # File names as text, never links: a browser opens neither a relative nor a file:// link from Prefect's UI.
    assert all(md.text(i["file"]) in table for i in manifest["images"]) and "loss.png" in table
    assert "file://" not in table and "](" not in table
    assert reporter.progress_calls[-1] == ("validate-progress", 1.0)


def test_nan_loss_stops_naming_the_step_and_images_and_keeps_the_last_good_checkpoint(
    tmp_path, upstream_store, demo_data
):
    cfg = small_config(
        tmp_path,
        {
            "steps": 6,
            "processes": 1,
            "batch_size": 4,
            "checkpoint_every": 1,
            "learning_rate": 0.1,  # the largest AdamW's bound lets through: in the first steps, the likelier cause
            "weight_decay": 1e4,  # decoupled decay multiplies every weight by 1 - 1e3 at the first step
            "max_grad_norm": None,
        },
        dataset={"path": str(demo_data)},
    )
    upstream_store.upstream(cfg)
    with pytest.raises(TrainingFailed) as err:
        train(cfg)
    msg = str(err.value)
    assert "loss is" in msg and ".png" in msg and "last good checkpoint" in msg
    assert "the likelier cause is train.learning_rate 0.1 (train.optimizer adamw): lower it tenfold" in msg
    step = int(msg.split(" at step ")[1].split()[0])
    partial = next(tmp_path.glob("artifacts/train/.*.partial"))
    kept = sorted(p.name for p in (partial / "checkpoints").iterdir())
    assert kept[-1] == f"step-{step - 1:07d}" and f"step-{step - 1:07d}" in msg
    assert not list(tmp_path.glob("artifacts/train/[!.]*"))


def test_missing_resume_target_is_an_error(tmp_path, upstream_store, demo_data):
    cfg = small_config(tmp_path, {"steps": 2, "processes": 1, "resume": "latest"}, dataset={"path": str(demo_data)})
    upstream_store.upstream(cfg)
    with pytest.raises(TrainingFailed, match="no checkpoint"):
        train(cfg)
    cfg = small_config(
        tmp_path, {"steps": 2, "processes": 1, "resume": "checkpoints/step-0000009"}, dataset={"path": str(demo_data)}
    )
    with pytest.raises(TrainingFailed, match="not a checkpoint directory"):
        train(cfg)
