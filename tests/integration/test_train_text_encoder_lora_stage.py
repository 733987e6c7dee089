"""train.text_encoder_lora through the real train and validate stages (2-process gloo DDP, the tiny family's CLIP):
the manifest says the text cache was not read, the text encoder's LoRA trained (its output moved) and went into
both files, stock diffusers loading the diffusers file encodes prompts as the trained encoder does, and the
validate stage rendered with the trained encoder."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.integration.test_train_support import small_config, train
from tuneline.stages.common.stage import StageContext, run_stage
from tuneline.stages.families import resolve as models
from tuneline.stages.families.registry import get_family
from tuneline.stages.pipeline import PIPELINE, stage
from tuneline.stages.text.variants import TagAugment
from tuneline.stages.train.export import DIFFUSERS_FILE, KOHYA_FILE
from tuneline.stages.train.textlora import TrainedText

CPU = torch.device("cpu")
PROMPTS = ["a red square", "a blue circle", ""]
# A text-encoder LoRA once crashed on its first 2-process run (a module whose output the loss never sees gets no
# gradient, and DDP stops): this capability is proven with the process count users run.
pytestmark = pytest.mark.ddp(reason="text-encoder LoRA under DDP: every trainable parameter gets a gradient")

TE = {
    "mode": "lora",
    "text_encoder_lora": True,
    "text_encoder_lr": 5e-2,
    "learning_rate": 1e-2,
    "lora_rank": 4,
    "steps": 4,
    "processes": 2,
    "batch_size": 2,
    "caption_dropout": 0.5,
    "checkpoint_every": 2,
    "keep_checkpoints": 2,
    "validate_every": 2,
}


@pytest.fixture(scope="module")
def run(tmp_path_factory, upstream_store, demo_data):
    cfg = small_config(tmp_path_factory.mktemp("te-lora"), TE, validate={"steps": 2}, dataset={"path": str(demo_data)})
    upstream_store.upstream(cfg)
    out = train(cfg)
    ctx = StageContext(cfg)
    validated = run_stage(ctx, stage("validate"), PIPELINE)[0]
    resume = str(out / "checkpoints" / "step-0000002")
    resumed = train(small_config(cfg.workdir, {**TE, "resume": resume}, dataset={"path": str(demo_data)}))
    return cfg, ctx, out, validated, resumed


def _trained_text(cfg, ctx, out) -> TrainedText:
    """The text encoders as the run ended: a fresh LoRA with the last checkpoint's weights."""
    fam = get_family(cfg.model.family)
    text = TrainedText(fam, models.model_dir(ctx), CPU, cfg.train, fam.facts.max_length, TagAugment())
    saved = load_file(out / "checkpoints" / "step-0000004" / "trainable.safetensors")
    with torch.no_grad():
        for name, p in text.params().items():
            p.copy_(saved[name])
    return text


def test_manifest_says_the_text_cache_was_not_read(run):
    _, _, out, validated, _ = run
    m = json.loads((out / "manifest.json").read_text())
    assert m["text_encoder_lora"] is True and m["text_cache_read"] is False
    assert {e["format"] for e in m["exports"]} == {"diffusers", "kohya"}
    assert json.loads((validated / "manifest.json").read_text())["prompts_encoded_by"] == "trained text encoders"


def test_text_encoder_lora_trained_and_exported(run):
    cfg, ctx, out, _, _ = run
    kohya = load_file(out / "final" / KOHYA_FILE)
    te = [k for k in kohya if k.startswith("lora_te_text_model_encoder_layers_")]
    assert te and any(k.startswith("lora_unet_") for k in kohya)
    assert any(k.endswith(".lora_up.weight") and kohya[k].abs().max() > 0 for k in te), "the TE LoRA never moved"

    fam = get_family(cfg.model.family)
    trained = _trained_text(cfg, ctx, out).get(PROMPTS)["prompt_embeds"]
    base = fam.encode_text(fam.load_text_encoders(models.model_dir(ctx), torch.float32, CPU), PROMPTS)
    assert not torch.allclose(trained, base["prompt_embeds"], atol=1e-5), "training left the encoder's output as is"

    pipe = fam.load_pipeline(models.model_dir(ctx), torch.float32, CPU)
    pipe.load_lora_weights(out / "final", weight_name=DIFFUSERS_FILE)  # stock diffusers
    with torch.no_grad():
        got = fam.encode_text(fam.text_encoders_of(pipe), PROMPTS)["prompt_embeds"]
    torch.testing.assert_close(got, trained, rtol=1e-4, atol=1e-5)


def test_resumed_run_reaches_the_uninterrupted_weights(run):
    """Both LoRAs, the text encoders' optimizer group (its own rate) included, continue exactly from a checkpoint."""
    _, _, out, _, resumed = run
    assert json.loads((resumed / "manifest.json").read_text())["resumed_from"].endswith("step-0000002")
    a, b = load_file(out / "final" / KOHYA_FILE), load_file(resumed / "final" / KOHYA_FILE)
    assert a.keys() == b.keys() and any(k.startswith("lora_te_") for k in a)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0)
