"""train.init_from previous: scheduled retraining on new data continues the last model, not the base one; the
version it continues is part of the run's key and kept by gc."""

from __future__ import annotations

import shutil

import torch
from safetensors.torch import load_file

from tests.integration.test_train_support import build_upstream, small_config, train
from tuneline.schemas.families import FAMILY_FACTS
from tuneline.schemas.train_manifest import TrainManifest
from tuneline.stages.common import gc
from tuneline.stages.common.stage import StageContext, status
from tuneline.stages.families.folders import tiny_dir
from tuneline.stages.pipeline import PIPELINE


def _unet(folder) -> dict[str, torch.Tensor]:
    return load_file(str(next((folder / "unet").glob("*.safetensors"))))


def test_init_from_previous_continues_the_last_model_on_new_data(tmp_path):
    cfg = small_config(tmp_path / "w", {"steps": 2, "processes": 1, "init_from": "previous"})
    first = train_after(cfg)
    m1 = StageContext(cfg).store.read(first, TrainManifest)
    assert m1.initialized_from is None  # nothing earlier: the base model

    # Same data again: fresh, nothing stacks on itself.
    assert {r.stage: r.state for r in status(StageContext(cfg), PIPELINE)}["train"] == "fresh"

    # New data: the next run starts from the first run's weights. A learning rate too small to move them
    # shows where it started.
    data = cfg.resolve(cfg.dataset.path)
    src = sorted(data.glob("*.png"))[0]
    shutil.copy(src, data / "extra.png")
    (data / "extra.txt").write_text("a red square extra")
    cfg2 = small_config(tmp_path / "w", {"steps": 2, "processes": 1, "init_from": "previous", "learning_rate": 1e-12})
    second = train_after(cfg2)
    m2 = StageContext(cfg2).store.read(second, TrainManifest)
    assert m2.initialized_from == m1.fingerprint
    after, before = _unet(second / "final"), _unet(first / "final")
    base = _unet(tiny_dir(FAMILY_FACTS["tiny"], StageContext(cfg).workdir / "models"))
    name = next(k for k in after if not torch.equal(before[k], base[k]))
    torch.testing.assert_close(after[name], before[name], rtol=0, atol=1e-6)

    # Back to the first data: the first run was trained from the base model, but a rerun would now start from
    # the second run's weights; the source is in the key, so the first run is not taken for this one.
    (data / "extra.png").unlink()
    (data / "extra.txt").unlink()
    build_upstream(cfg)
    rows = {r.stage: r for r in status(StageContext(cfg), PIPELINE)}
    assert rows["latents"].state == "fresh" and rows["train"].state == "stale", rows["train"]
    assert "init_from" in rows["train"].reason
    third = train(cfg)
    assert StageContext(cfg).store.read(third, TrainManifest).initialized_from == m2.fingerprint

    # gc keeps what the fresh run continued from, even with keep 0, but not that run's own history and data.
    store = StageContext(cfg).store
    fresh = {r.stage: r.version for r in status(StageContext(cfg), PIPELINE)}
    plan = gc.plan(store, [s.name for s in PIPELINE], fresh, keep=0)
    assert second in plan.keep and first in plan.remove, plan.keep.get(first)
    assert store.version_dir("latents", m2.upstream["latents"]) in plan.remove
    gc.collect(plan)
    assert {r.stage: r.state for r in status(StageContext(cfg), PIPELINE)}["train"] == "fresh"


def train_after(cfg):
    build_upstream(cfg)  # not the shared store: the test changes its own dataset
    return train(cfg)
