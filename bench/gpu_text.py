"""Text encoders for the GPU figures of families whose shipped config holds none (Z-Image, FLUX.2 [klein],
Qwen-Image): the family's tiny-flavor tokenizer and text-encoder class, at the released encoder's width and depth
(so the text cache holds embeddings of the released shape, as the denoiser's text width requires), random weights.

The figures time the denoiser's training step on cached embeddings; the text encoder runs only while caching and
is gone before the step, so its vocabulary (the tiny tokenizer's) does not touch the figure."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

# The released text encoders' sizes (their config.json): Qwen3-4B (Z-Image Turbo; FLUX.2 [klein] 4B) and
# Qwen2.5-VL-7B-Instruct's language model (Qwen-Image; its vision tower is never fed here and stays tiny).
QWEN3_4B = {
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
}
QWEN25_VL_7B = {
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
}
QWEN25_VL_MROPE = [16, 24, 24]  # its rotary sections: head dim 128 / 2
RELEASED = {"z_image": QWEN3_4B, "flux2_klein": QWEN3_4B, "qwen_image": QWEN25_VL_7B}


def text_width(folder: Path) -> int:
    """The width of the text features a pipeline folder's denoiser takes."""
    cfg = json.loads((folder / "transformer" / "config.json").read_text())
    return cfg.get("joint_attention_dim") or cfg["cap_feat_dim"]


def released_config(family: str, tiny_folder: Path):
    """The tiny flavor's text-encoder config with the released encoder's sizes."""
    import importlib

    entry = json.loads((tiny_folder / "model_index.json").read_text())["text_encoder"]
    cls = getattr(importlib.import_module(entry[0]), entry[1])
    data = cls.config_class.from_pretrained(tiny_folder / "text_encoder").to_dict()
    text = data.get("text_config", data)
    text.update(RELEASED[family])
    text.pop("layer_types", None)  # one entry per layer: derived again for the released depth
    if text is not data:  # Qwen2.5-VL: its rotary sections follow the head dim; the vision tower's output width
        text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": QWEN25_VL_MROPE}
        data["vision_config"]["out_hidden_size"] = text["hidden_size"]
    cfg = cls.config_class(**data)
    return cls, cfg


def add_text_encoder(family: str, folder: Path, init) -> None:
    """Writes text_encoder/ (random weights, bf16) and tokenizer/ into `folder` and lists them in its
    model_index.json, taking the tokenizer and the encoder class from the family's tiny flavor."""
    import torch

    from tuneline.stages.families.registry import get_family

    with tempfile.TemporaryDirectory() as tmp:
        tiny = Path(tmp)
        get_family(family).build_tiny(tiny)
        cls, cfg = released_config(family, tiny)
        shutil.copytree(tiny / "tokenizer", folder / "tokenizer")
        tiny_index = json.loads((tiny / "model_index.json").read_text())
    from gpu_setup import bfloat16_default

    with init, bfloat16_default():
        model = cls(cfg)
    model.to(torch.bfloat16).save_pretrained(folder / "text_encoder")
    del model
    index = json.loads((folder / "model_index.json").read_text())
    index.update({name: tiny_index[name] for name in ("text_encoder", "tokenizer")})
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))
