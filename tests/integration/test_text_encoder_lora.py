"""train.text_encoder_lora's files, read by independent readers: the diffusers file through stock diffusers'
`load_lora_weights` gives the trained encoders' prompt embeddings, and so does the kohya file (diffusers converts
kohya's `lora_te_` / `lora_te1_` / `lora_te2_` names itself), for sd15 (one CLIP) and sdxl (two).

The LoRAs are real peft adapters on each family's tiny encoders with random nonzero up weights (what training
would reach), written by the same `save_final` the train stage calls."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tuneline.schemas.train import TrainConfig
from tuneline.stages.families.registry import get_family
from tuneline.stages.text.variants import TagAugment
from tuneline.stages.train.export import DIFFUSERS_FILE, KOHYA_FILE
from tuneline.stages.train.model import prepare_denoiser, save_final
from tuneline.stages.train.textlora import TrainedText

CPU = torch.device("cpu")
PROMPTS = ["a red square", "a blue circle", ""]
PREFIXES = {"sd15": ["lora_te_"], "sdxl": ["lora_te1_", "lora_te2_"]}


def _trained(family: str, model_dir, out):
    fam = get_family(family)
    t = TrainConfig(mode="lora", lora_rank=4, lora_alpha=2.0, text_encoder_lora=True)
    den, _ = prepare_denoiser(fam, model_dir, t, torch.float32, CPU)
    text = TrainedText(fam, model_dir, CPU, t, fam.facts.max_length, TagAugment())
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in text.params().items():
            if "lora_B" in name:  # peft starts B at zero; training would have moved it
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    exports = save_final(fam, model_dir, den, t, out, None, text)
    return fam, text, exports


def _pipeline_embeds(fam, model_dir, final, weight_name):
    pipe = fam.load_pipeline(model_dir, torch.float32, CPU)
    pipe.load_lora_weights(final, weight_name=weight_name)  # stock diffusers: unet and text encoder(s)
    with torch.no_grad():
        return fam.encode_text(fam.text_encoders_of(pipe), PROMPTS)


@pytest.mark.parametrize("family", ["sd15", "sdxl"])
def test_text_encoder_lora_files_give_the_trained_embeddings(family, tmp_path):
    model_dir = get_family(family).ensure_model(None, tmp_path / "models")
    final = tmp_path / "final"
    fam, text, exports = _trained(family, model_dir, final)
    trained = text.get(PROMPTS)
    base = fam.encode_text(fam.load_text_encoders(model_dir, torch.float32, CPU), PROMPTS)
    assert not torch.allclose(trained["prompt_embeds"], base["prompt_embeds"], atol=1e-4), "LoRA changed nothing"

    kohya = load_file(final / KOHYA_FILE)
    for prefix in PREFIXES[family]:
        stem = f"{prefix}text_model_encoder_layers_0_self_attn_q_proj"
        assert {f"{stem}.lora_down.weight", f"{stem}.lora_up.weight", f"{stem}.alpha"} <= kohya.keys()
        assert float(kohya[f"{stem}.alpha"]) == 2.0
    assert not any(k.startswith("lora_te2_") for k in kohya) or family == "sdxl"
    assert any(k.startswith("lora_unet_") for k in kohya)
    comps = {k.split(".")[0] for k in load_file(final / DIFFUSERS_FILE)}
    assert comps == {"unet", *fam.text_components}
    assert {e["format"] for e in exports} == {"diffusers", "kohya"}

    for weight_name in (DIFFUSERS_FILE, KOHYA_FILE):
        got = _pipeline_embeds(fam, model_dir, final, weight_name)
        for key, value in trained.items():
            torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=f"{weight_name}: {key}")
