"""Writes the shipped weightless diffusers pipeline folders (sd15/, sdxl/) next to this file, deterministically.

    python stages/families/configs/derive.py PATH/TO/bpe_simple_vocab_16e6.txt.gz

The JSON configs are the published architecture values of Stable Diffusion 1.5 and SDXL base 1.0 (the same values
diffusers' single_file_utils infers for those checkpoints). The CLIP BPE tokenizer files (vocab.json, merges.txt, as
transformers' CLIPTokenizer reads them) are derived from openai/CLIP's clip/bpe_simple_vocab_16e6.txt.gz (MIT) the
way openai's clip/simple_tokenizer.py builds its vocabulary; see README.md here for source and license.
"""
from __future__ import annotations

import gzip
import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))  # run as a script from anywhere

from stages.families.vocab import bytes_to_unicode  # noqa: E402  (openai's byte-level alphabet, shared)
N_MERGES = 49152 - 256 - 2  # openai's simple_tokenizer: the merges the released CLIP models use


def clip_bpe(gz: Path) -> tuple[dict[str, int], list[str]]:
    lines = gzip.open(gz).read().decode("utf-8").split("\n")[1:N_MERGES + 1]
    merges = [tuple(line.split()) for line in lines]
    assert all(len(m) == 2 for m in merges), "unexpected merges file"
    vocab = list(bytes_to_unicode().values())
    vocab = vocab + [v + "</w>" for v in vocab] + ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    return {tok: i for i, tok in enumerate(vocab)}, [" ".join(m) for m in merges]


def dump(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def tokenizer(folder: Path, vocab: dict[str, int], merges: list[str], pad: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False, separators=(",", ":")) + "\n",
                                       encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    dump(folder / "tokenizer_config.json", {
        "tokenizer_class": "CLIPTokenizer", "model_max_length": 77, "bos_token": "<|startoftext|>",
        "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "pad_token": pad,
        "do_lower_case": True, "errors": "replace", "add_prefix_space": False})
    dump(folder / "special_tokens_map.json", {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>",
                                              "unk_token": "<|endoftext|>", "pad_token": pad})


def clip_text(cls: str, hidden: int, layers: int, heads: int, act: str, projection: int) -> dict:
    return {"architectures": [cls], "model_type": "clip_text_model", "vocab_size": 49408,
            "hidden_size": hidden, "intermediate_size": hidden * 4, "num_hidden_layers": layers,
            "num_attention_heads": heads, "max_position_embeddings": 77, "hidden_act": act,
            "projection_dim": projection, "layer_norm_eps": 1e-05, "attention_dropout": 0.0, "dropout": 0.0,
            "initializer_factor": 1.0, "initializer_range": 0.02, "bos_token_id": 0, "eos_token_id": 2,
            "pad_token_id": 1, "torch_dtype": "float32"}


def vae(sample_size: int, scaling: float, force_upcast: bool) -> dict:
    return {"_class_name": "AutoencoderKL", "act_fn": "silu", "block_out_channels": [128, 256, 512, 512],
            "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
            "in_channels": 3, "out_channels": 3, "latent_channels": 4, "layers_per_block": 2,
            "norm_num_groups": 32, "sample_size": sample_size, "scaling_factor": scaling,
            "force_upcast": force_upcast}


SCHEDULER = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "num_train_timesteps": 1000,
             "clip_sample": False, "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1,
             "prediction_type": "epsilon", "trained_betas": None}

UNET_COMMON = {"_class_name": "UNet2DConditionModel", "act_fn": "silu", "center_input_sample": False,
               "downsample_padding": 1, "flip_sin_to_cos": True, "freq_shift": 0, "in_channels": 4,
               "out_channels": 4, "layers_per_block": 2, "mid_block_scale_factor": 1, "norm_eps": 1e-05,
               "norm_num_groups": 32}


def sd15(root: Path, vocab: dict[str, int], merges: list[str]) -> None:
    dump(root / "model_index.json", {
        "_class_name": "StableDiffusionPipeline", "feature_extractor": [None, None], "image_encoder": [None, None],
        "requires_safety_checker": False, "safety_checker": [None, None],
        "scheduler": ["diffusers", "PNDMScheduler"], "text_encoder": ["transformers", "CLIPTextModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"], "unet": ["diffusers", "UNet2DConditionModel"],
        "vae": ["diffusers", "AutoencoderKL"]})
    dump(root / "unet" / "config.json", {
        **UNET_COMMON, "attention_head_dim": 8, "block_out_channels": [320, 640, 1280, 1280],
        "cross_attention_dim": 768, "sample_size": 64,
        "down_block_types": ["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
        "up_block_types": ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3})
    dump(root / "vae" / "config.json", vae(512, 0.18215, True))
    dump(root / "text_encoder" / "config.json", clip_text("CLIPTextModel", 768, 12, 12, "quick_gelu", 768))
    dump(root / "scheduler" / "scheduler_config.json", {"_class_name": "PNDMScheduler", **SCHEDULER})
    tokenizer(root / "tokenizer", vocab, merges, "<|endoftext|>")


def sdxl(root: Path, vocab: dict[str, int], merges: list[str]) -> None:
    dump(root / "model_index.json", {
        "_class_name": "StableDiffusionXLPipeline", "feature_extractor": [None, None],
        "image_encoder": [None, None], "force_zeros_for_empty_prompt": True,
        "scheduler": ["diffusers", "EulerDiscreteScheduler"], "text_encoder": ["transformers", "CLIPTextModel"],
        "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
        "tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "CLIPTokenizer"],
        "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"]})
    dump(root / "unet" / "config.json", {
        **UNET_COMMON, "addition_embed_type": "text_time", "addition_embed_type_num_heads": 64,
        "addition_time_embed_dim": 256, "attention_head_dim": [5, 10, 20], "block_out_channels": [320, 640, 1280],
        "cross_attention_dim": 2048, "projection_class_embeddings_input_dim": 2816, "sample_size": 128,
        "transformer_layers_per_block": [1, 2, 10], "use_linear_projection": True,
        "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
        "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"]})
    dump(root / "vae" / "config.json", vae(1024, 0.13025, True))
    dump(root / "text_encoder" / "config.json", clip_text("CLIPTextModel", 768, 12, 12, "quick_gelu", 768))
    dump(root / "text_encoder_2" / "config.json",
         clip_text("CLIPTextModelWithProjection", 1280, 32, 20, "gelu", 1280))
    dump(root / "scheduler" / "scheduler_config.json", {
        "_class_name": "EulerDiscreteScheduler", **SCHEDULER, "interpolation_type": "linear",
        "sample_max_value": 1.0, "timestep_spacing": "leading", "use_karras_sigmas": False})
    tokenizer(root / "tokenizer", vocab, merges, "<|endoftext|>")
    tokenizer(root / "tokenizer_2", vocab, merges, "!")  # OpenCLIP bigG pads with "!" (id 0)


def main(gz: str) -> None:
    vocab, merges = clip_bpe(Path(gz))
    assert len(vocab) == 49408, len(vocab)
    for name, build in (("sd15", sd15), ("sdxl", sdxl)):
        shutil.rmtree(HERE / name, ignore_errors=True)
        build(HERE / name, vocab, merges)


if __name__ == "__main__":
    main(sys.argv[1])
