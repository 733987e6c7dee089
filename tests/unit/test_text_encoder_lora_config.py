"""train.text_encoder_lora and train.text_encoder_lr are refused at load, naming the fields, where they cannot apply:
a family without a CLIP text-encoder LoRA layout, a full fine-tune, a non-LoRA adapter, a rate without the LoRA."""

from __future__ import annotations

from tests.unit.test_config_checks import refused
from tuneline.schemas.config import parse_config
from tuneline.schemas.demo import DEMO_CONFIG

ON = {"mode": "lora", "text_encoder_lora": True}


def test_text_encoder_lora_refusals_name_the_fields():
    msg = refused({"model": {"family": "flux"}, "train": ON}, "train.text_encoder_lora", "model.family flux")
    assert "sd15" in msg and "sdxl" in msg
    refused({"train": {"mode": "full", "text_encoder_lora": True}}, "train.text_encoder_lora", "train.mode")
    refused({"train": {**ON, "adapter": "lokr"}}, "train.text_encoder_lora", "train.adapter")
    refused({"train": {"mode": "lora", "text_encoder_lr": 1e-4}}, "train.text_encoder_lr")


def test_text_encoder_lora_accepted_for_clip_families():
    for family in ("tiny", "sd15", "sdxl"):
        data = {**DEMO_CONFIG, "model": {**DEMO_CONFIG["model"], "family": family}}
        cfg = parse_config({**data, "train": {**DEMO_CONFIG["train"], **ON, "text_encoder_lr": 1e-4}})
        assert cfg.train.text_encoder_lora and cfg.train.text_encoder_lr == 1e-4
