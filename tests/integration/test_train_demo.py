"""The demo's train and validate artifacts, read from the README quick start's run (the session's `demo_run`: the
demo config, a full fine-tune on 2 gloo processes with the learning check on), so the suite trains the demo once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from tuneline.schemas.config import parse_config
from tuneline.schemas.demo import DEMO_CONFIG
from tuneline.stages.common.jsonl import read_jsonl

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo(demo_run):
    """(config, {stage: published artifact}) of the quick start's run, found through each stage's one version."""
    workdir = demo_run["workdir"]
    cfg = parse_config({**DEMO_CONFIG, "workdir": str(workdir)})
    paths = {}
    for stage in ("train", "validate"):
        (version,) = [p for p in (workdir / "artifacts" / stage).iterdir() if not p.name.startswith(".")]
        paths[stage] = version
    return cfg, paths


def _manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def test_learning_check_separates_the_classes(demo):
    _, paths = demo
    m = _manifest(paths["validate"])
    assert m["class_separation_accuracy"] >= 0.9, m
    assert m["untrained_class_separation_accuracy"] <= 0.5, m
    assert m["color_accuracy"] >= 0.9 and m["untrained_color_accuracy"] < m["color_accuracy"], m


def test_train_artifact_layout(demo):
    cfg, paths = demo
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


def test_validate_artifact(demo):
    cfg, paths = demo
    out = paths["validate"]
    m = _manifest(out)
    prompts = cfg.validate_.prompts
    assert [(i["prompt"], i["seed"]) for i in m["images"]] == [(p.prompt, p.seed) for p in prompts]
    for item in m["images"]:
        assert Image.open(out / item["file"]).size == (item["width"], item["height"]) == (64, 64)
    assert Image.open(out / m["grid"]).size == (64 * len(prompts), 64)
    assert sorted(p.name for p in out.glob("*.png")) == sorted([i["file"] for i in m["images"]] + [m["grid"]])
