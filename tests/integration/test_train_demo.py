"""The demo's training and validation for real, in process: the demo config (full fine-tune, 2 gloo processes, the
learning check on), one run shared by every test here, then stock diffusers loading the result."""

from __future__ import annotations

import copy
import json

import pytest
from PIL import Image

from tests.integration.test_train_support import RecordingReporter
from tuneline.schemas.config import parse_config
from tuneline.schemas.demo import DEMO_CONFIG
from tuneline.stages.common.jsonl import read_jsonl
from tuneline.stages.common.stage import StageContext, run_stage
from tuneline.stages.pipeline import PIPELINE, stages_for
from tuneline.stages.scan.demo import write_demo_dataset


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    wd = tmp_path_factory.mktemp("demo")
    data = copy.deepcopy(DEMO_CONFIG)
    data["workdir"] = str(wd)
    cfg = parse_config(data)
    write_demo_dataset(cfg.resolve(cfg.dataset.path))
    reporter = RecordingReporter()
    ctx = StageContext(cfg, reporter=reporter)
    paths = {sd.name: run_stage(ctx, sd, PIPELINE)[0] for sd in stages_for(ctx.cfg)}
    return cfg, paths, reporter


def _manifest(path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def test_learning_check_separates_the_classes(demo):
    _, paths, _ = demo
    m = _manifest(paths["validate"])
    assert m["class_separation_accuracy"] >= 0.9, m
    assert m["untrained_class_separation_accuracy"] <= 0.5, m
    assert m["color_accuracy"] >= 0.9 and m["untrained_color_accuracy"] < m["color_accuracy"], m


def test_train_artifact_layout(demo):
    cfg, paths, reporter = demo
    t, out = cfg.train, paths["train"]
    m = _manifest(out)
    assert (m["step"], m["world_size"], m["mode"]) == (t.steps, 2, "full")
    assert m["global_batch"] == t.batch_size * 2 * t.grad_accumulation
    every = t.effective_checkpoint_every()
    kept = [f"checkpoints/step-{s:07d}" for s in range(every, t.steps + 1, every)][-t.keep_checkpoints :]
    assert m["checkpoints"] == kept and m["checkpoint"] == kept[-1]
    assert sorted(p.name for p in (out / kept[-1]).iterdir()) == [
        "optimizer.safetensors",
        "state.json",
        "trainable.safetensors",
    ]
    assert len(list(read_jsonl(out / "losses.jsonl"))) == t.steps
    assert Image.open(out / "loss.png").size == (640, 360)
    assert m["losses"][-1] < m["losses"][0]
    assert (out / "final" / "model_index.json").is_file()
    assert ("train-progress", 1.0) in reporter.progress_calls


def test_final_loads_with_stock_diffusers_and_renders(demo):
    from diffusers import DiffusionPipeline

    _, paths, _ = demo
    pipe = DiffusionPipeline.from_pretrained(paths["train"] / "final")
    pipe.set_progress_bar_config(disable=True)
    image = pipe("a blue square", num_inference_steps=2, height=64, width=64).images[0]
    assert image.size == (64, 64)


def test_validate_artifact_and_report(demo):
    cfg, paths, reporter = demo
    out = paths["validate"]
    m = _manifest(out)
    prompts = cfg.validate_.prompts
    assert [(i["prompt"], i["seed"]) for i in m["images"]] == [(p.prompt, p.seed) for p in prompts]
    for item in m["images"]:
        assert Image.open(out / item["file"]).size == (item["width"], item["height"]) == (64, 64)
    assert Image.open(out / m["grid"]).size == (64 * len(prompts), 64)
    assert sorted(p.name for p in out.glob("*.png")) == sorted([i["file"] for i in m["images"]] + [m["grid"]])
    text = reporter.markdowns["validate-images"]
    assert "Learning check" in text and all(i["file"] in text for i in m["images"])
    assert (paths["train"] / "loss.png").as_uri() in text
