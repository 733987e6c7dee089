"""A LoKr trained by schedule-free AdamW through the real train stage (2-process gloo DDP): the manifest lists the
LyCORIS file and records the diffusers file's absence; the file holds schedule-free's eval-mode weights; a run
resumed from the middle checkpoint (after an in-training validation) ends with the uninterrupted run's weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.integration.test_train_support import small_config, train
from tuneline.stages.train.export import KOHYA_FILE

pytestmark = pytest.mark.ddp(reason="a LoKr and schedule-free AdamW under DDP, resumed across ranks")

LOKR = {
    "mode": "lora",
    "adapter": "lokr",
    "optimizer": "adamw_schedulefree",
    "lora_rank": 4,
    "lora_alpha": 4,
    "steps": 4,
    "processes": 2,
    "batch_size": 2,
    "checkpoint_every": 2,
    "validate_every": 2,
    "learning_rate": 1e-2,
    "lora_format": "both",
    "keep_checkpoints": 3,
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, upstream_store, demo_data):
    wd = tmp_path_factory.mktemp("lokr")
    cfg = small_config(wd, LOKR, dataset={"path": str(demo_data)})
    upstream_store.upstream(cfg)
    straight = train(cfg)
    resume = str(straight / "checkpoints" / "step-0000002")
    resumed = train(small_config(wd, {**LOKR, "resume": resume}, dataset={"path": str(demo_data)}))
    return straight, resumed


def test_lokr_manifest_lists_the_lycoris_file_and_the_absent_diffusers_one(runs):
    straight, _ = runs
    m = json.loads((straight / "manifest.json").read_text())
    assert m["adapter"] == "lokr"
    assert [e["file"] for e in m["exports"]] == [f"final/{KOHYA_FILE}"]
    assert [n["format"] for n in m["not_exported"]] == ["diffusers"] and "lokr" in m["not_exported"][0]["reason"]
    assert not (straight / "final" / "pytorch_lora_weights.safetensors").exists()
    from safetensors import safe_open

    with safe_open(str(straight / "final" / KOHYA_FILE), "pt") as f:
        meta = f.metadata()
        keys = list(f.keys())
    assert meta["ss_network_module"] == "lycoris.kohya" and json.loads(meta["ss_network_args"])["algo"] == "lokr"
    assert meta["modelspec.architecture"].endswith("/lora") and meta["ss_network_dim"] == "4"
    assert keys and all(k.startswith("lora_unet_") and ".lokr_" in k or k.endswith(".alpha") for k in keys)


def test_exported_weights_are_schedule_free_eval_weights(runs):
    """x = y + (1 - 1/beta1) (z - y) from the last checkpoint's training weights y and state z."""
    straight, _ = runs
    last = straight / "checkpoints" / "step-0000004"
    y, opt = load_file(str(last / "trainable.safetensors")), load_file(str(last / "optimizer.safetensors"))
    beta1 = json.loads((last / "state.json").read_text())["optimizer"]["param_groups"][0]["betas"][0]
    exported = load_file(str(straight / "final" / KOHYA_FILE))
    checked = 0
    for name in y:
        if name.endswith(".lokr_w1.default"):
            key = "lora_unet_" + name.removesuffix(".lokr_w1.default").replace(".", "_") + ".lokr_w1"
            x = y[name] + (1 - 1 / beta1) * (opt[f"{name}/z"] - y[name])
            torch.testing.assert_close(exported[key], x, rtol=1e-5, atol=1e-6)
            assert not torch.allclose(exported[key], y[name])
            checked += 1
    assert checked


def test_resumed_run_reaches_the_uninterrupted_weights(runs):
    straight, resumed = runs
    m = json.loads((resumed / "manifest.json").read_text())
    assert m["resumed_from"] and m["resumed_from"].endswith("step-0000002")
    a, b = load_file(str(straight / "final" / KOHYA_FILE)), load_file(str(resumed / "final" / KOHYA_FILE))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0)
