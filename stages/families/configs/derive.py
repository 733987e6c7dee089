"""Writes the shipped weightless diffusers pipeline folders (sd15/, sdxl/, sd3/, flux/) next to this file,
deterministically.

    python stages/families/configs/derive.py PATH/TO/bpe_simple_vocab_16e6.txt.gz PATH/TO/spiece.model

The JSON configs are the published architecture values of Stable Diffusion 1.5, SDXL base 1.0, Stable Diffusion 3
medium and FLUX.1-dev (the same values diffusers' single_file_utils infers for those checkpoints). The CLIP BPE
tokenizer files (vocab.json, merges.txt, as transformers' CLIPTokenizer reads them) are derived from openai/CLIP's
clip/bpe_simple_vocab_16e6.txt.gz (MIT) the way openai's clip/simple_tokenizer.py builds its vocabulary. The T5
tokenizer (tokenizer.json, a fast Unigram tokenizer, so neither sentencepiece nor protobuf is needed to load it) is
derived from Google's T5 v1.1 SentencePiece model spiece.model (Apache-2.0) the way transformers' T5 converter builds
it; see README.md here for sources, checksums and licenses.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from derive_tokenizers import clip_bpe, dump, t5_tokenizer, t5_tokenizer_json, tokenizer  # (beside this script)

HERE = Path(__file__).resolve().parent


def clip_text(cls: str, hidden: int, layers: int, heads: int, act: str, projection: int) -> dict:
    return {
        "architectures": [cls],
        "model_type": "clip_text_model",
        "vocab_size": 49408,
        "hidden_size": hidden,
        "intermediate_size": hidden * 4,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "max_position_embeddings": 77,
        "hidden_act": act,
        "projection_dim": projection,
        "layer_norm_eps": 1e-05,
        "attention_dropout": 0.0,
        "dropout": 0.0,
        "initializer_factor": 1.0,
        "initializer_range": 0.02,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "pad_token_id": 1,
        "torch_dtype": "float32",
    }


def vae(sample_size: int, scaling: float, force_upcast: bool) -> dict:
    return {
        "_class_name": "AutoencoderKL",
        "act_fn": "silu",
        "block_out_channels": [128, 256, 512, 512],
        "down_block_types": ["DownEncoderBlock2D"] * 4,
        "up_block_types": ["UpDecoderBlock2D"] * 4,
        "in_channels": 3,
        "out_channels": 3,
        "latent_channels": 4,
        "layers_per_block": 2,
        "norm_num_groups": 32,
        "sample_size": sample_size,
        "scaling_factor": scaling,
        "force_upcast": force_upcast,
    }


SCHEDULER = {
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "num_train_timesteps": 1000,
    "clip_sample": False,
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "prediction_type": "epsilon",
    "trained_betas": None,
}

UNET_COMMON = {
    "_class_name": "UNet2DConditionModel",
    "act_fn": "silu",
    "center_input_sample": False,
    "downsample_padding": 1,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "in_channels": 4,
    "out_channels": 4,
    "layers_per_block": 2,
    "mid_block_scale_factor": 1,
    "norm_eps": 1e-05,
    "norm_num_groups": 32,
}


def sd15(root: Path, vocab: dict[str, int], merges: list[str]) -> None:
    dump(
        root / "model_index.json",
        {
            "_class_name": "StableDiffusionPipeline",
            "feature_extractor": [None, None],
            "image_encoder": [None, None],
            "requires_safety_checker": False,
            "safety_checker": [None, None],
            "scheduler": ["diffusers", "PNDMScheduler"],
            "text_encoder": ["transformers", "CLIPTextModel"],
            "tokenizer": ["transformers", "CLIPTokenizer"],
            "unet": ["diffusers", "UNet2DConditionModel"],
            "vae": ["diffusers", "AutoencoderKL"],
        },
    )
    dump(
        root / "unet" / "config.json",
        {
            **UNET_COMMON,
            "attention_head_dim": 8,
            "block_out_channels": [320, 640, 1280, 1280],
            "cross_attention_dim": 768,
            "sample_size": 64,
            "down_block_types": ["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
            "up_block_types": ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3,
        },
    )
    dump(root / "vae" / "config.json", vae(512, 0.18215, True))
    dump(root / "text_encoder" / "config.json", clip_text("CLIPTextModel", 768, 12, 12, "quick_gelu", 768))
    dump(root / "scheduler" / "scheduler_config.json", {"_class_name": "PNDMScheduler", **SCHEDULER})
    tokenizer(root / "tokenizer", vocab, merges, "<|endoftext|>")


def sdxl(root: Path, vocab: dict[str, int], merges: list[str]) -> None:
    dump(
        root / "model_index.json",
        {
            "_class_name": "StableDiffusionXLPipeline",
            "feature_extractor": [None, None],
            "image_encoder": [None, None],
            "force_zeros_for_empty_prompt": True,
            "scheduler": ["diffusers", "EulerDiscreteScheduler"],
            "text_encoder": ["transformers", "CLIPTextModel"],
            "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
            "tokenizer": ["transformers", "CLIPTokenizer"],
            "tokenizer_2": ["transformers", "CLIPTokenizer"],
            "unet": ["diffusers", "UNet2DConditionModel"],
            "vae": ["diffusers", "AutoencoderKL"],
        },
    )
    dump(
        root / "unet" / "config.json",
        {
            **UNET_COMMON,
            "addition_embed_type": "text_time",
            "addition_embed_type_num_heads": 64,
            "addition_time_embed_dim": 256,
            "attention_head_dim": [5, 10, 20],
            "block_out_channels": [320, 640, 1280],
            "cross_attention_dim": 2048,
            "projection_class_embeddings_input_dim": 2816,
            "sample_size": 128,
            "transformer_layers_per_block": [1, 2, 10],
            "use_linear_projection": True,
            "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
            "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
        },
    )
    dump(root / "vae" / "config.json", vae(1024, 0.13025, True))
    dump(root / "text_encoder" / "config.json", clip_text("CLIPTextModel", 768, 12, 12, "quick_gelu", 768))
    dump(root / "text_encoder_2" / "config.json", clip_text("CLIPTextModelWithProjection", 1280, 32, 20, "gelu", 1280))
    dump(
        root / "scheduler" / "scheduler_config.json",
        {
            "_class_name": "EulerDiscreteScheduler",
            **SCHEDULER,
            "interpolation_type": "linear",
            "sample_max_value": 1.0,
            "timestep_spacing": "leading",
            "use_karras_sigmas": False,
        },
    )
    tokenizer(root / "tokenizer", vocab, merges, "<|endoftext|>")
    tokenizer(root / "tokenizer_2", vocab, merges, "!")  # OpenCLIP bigG pads with "!" (id 0)


def flow_vae(scaling: float, shift: float) -> dict:
    """SD3's and Flux's VAE: 16 latent channels, a shift as well as a scale, no quant convolutions."""
    return {
        **vae(1024, scaling, True),
        "latent_channels": 16,
        "shift_factor": shift,
        "use_quant_conv": False,
        "use_post_quant_conv": False,
        "mid_block_add_attention": True,
    }


# T5 v1.1 XXL's encoder (google/t5-v1_1-xxl), the third text encoder of SD3 and the second of Flux.
T5_XXL = {
    "architectures": ["T5EncoderModel"],
    "model_type": "t5",
    "vocab_size": 32128,
    "d_model": 4096,
    "d_kv": 64,
    "d_ff": 10240,
    "num_layers": 24,
    "num_decoder_layers": 24,
    "num_heads": 64,
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "feed_forward_proj": "gated-gelu",
    "dense_act_fn": "gelu_new",
    "is_gated_act": True,
    "layer_norm_epsilon": 1e-06,
    "dropout_rate": 0.1,
    "initializer_factor": 1.0,
    "is_encoder_decoder": True,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "decoder_start_token_id": 0,
    "torch_dtype": "float32",
}
FLOW_SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0}
NO_IMAGE_ENCODER = {"feature_extractor": [None, None], "image_encoder": [None, None]}


def sd3(root: Path, vocab: dict[str, int], merges: list[str], t5: dict) -> None:
    """Stable Diffusion 3 medium: the 2B MMDiT (24 joint blocks, 1536 wide), CLIP-L and OpenCLIP bigG (both with
    projection), T5-XXL."""
    dump(
        root / "model_index.json",
        {
            "_class_name": "StableDiffusion3Pipeline",
            **NO_IMAGE_ENCODER,
            "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
            "text_encoder": ["transformers", "CLIPTextModelWithProjection"],
            "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
            "text_encoder_3": ["transformers", "T5EncoderModel"],
            "tokenizer": ["transformers", "CLIPTokenizer"],
            "tokenizer_2": ["transformers", "CLIPTokenizer"],
            "tokenizer_3": ["transformers", "T5Tokenizer"],
            "transformer": ["diffusers", "SD3Transformer2DModel"],
            "vae": ["diffusers", "AutoencoderKL"],
        },
    )
    dump(
        root / "transformer" / "config.json",
        {
            "_class_name": "SD3Transformer2DModel",
            "attention_head_dim": 64,
            "caption_projection_dim": 1536,
            "in_channels": 16,
            "joint_attention_dim": 4096,
            "num_attention_heads": 24,
            "num_layers": 24,
            "out_channels": 16,
            "patch_size": 2,
            "pooled_projection_dim": 2048,
            "pos_embed_max_size": 192,
            "sample_size": 128,
            "dual_attention_layers": [],
            "qk_norm": None,
        },
    )
    dump(root / "vae" / "config.json", flow_vae(1.5305, 0.0609))
    dump(
        root / "text_encoder" / "config.json", clip_text("CLIPTextModelWithProjection", 768, 12, 12, "quick_gelu", 768)
    )
    dump(root / "text_encoder_2" / "config.json", clip_text("CLIPTextModelWithProjection", 1280, 32, 20, "gelu", 1280))
    dump(root / "text_encoder_3" / "config.json", T5_XXL)
    dump(root / "scheduler" / "scheduler_config.json", FLOW_SCHEDULER)
    tokenizer(root / "tokenizer", vocab, merges, "<|endoftext|>")
    tokenizer(root / "tokenizer_2", vocab, merges, "!")  # as SDXL's: OpenCLIP bigG pads with "!" (id 0)
    t5_tokenizer(root / "tokenizer_3", t5)


def flux(root: Path, vocab: dict[str, int], merges: list[str], t5: dict) -> None:
    """FLUX.1-dev: the 12B transformer (19 double + 38 single blocks, 3072 wide, guidance embedding), CLIP-L's pooled
    output, T5-XXL."""
    dump(
        root / "model_index.json",
        {
            "_class_name": "FluxPipeline",
            **NO_IMAGE_ENCODER,
            "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
            "text_encoder": ["transformers", "CLIPTextModel"],
            "text_encoder_2": ["transformers", "T5EncoderModel"],
            "tokenizer": ["transformers", "CLIPTokenizer"],
            "tokenizer_2": ["transformers", "T5Tokenizer"],
            "transformer": ["diffusers", "FluxTransformer2DModel"],
            "vae": ["diffusers", "AutoencoderKL"],
        },
    )
    dump(
        root / "transformer" / "config.json",
        {
            "_class_name": "FluxTransformer2DModel",
            "attention_head_dim": 128,
            "axes_dims_rope": [16, 56, 56],
            "guidance_embeds": True,
            "in_channels": 64,
            "joint_attention_dim": 4096,
            "num_attention_heads": 24,
            "num_layers": 19,
            "num_single_layers": 38,
            "patch_size": 1,
            "pooled_projection_dim": 768,
        },
    )
    dump(root / "vae" / "config.json", flow_vae(0.3611, 0.1159))
    dump(root / "text_encoder" / "config.json", clip_text("CLIPTextModel", 768, 12, 12, "quick_gelu", 768))
    dump(root / "text_encoder_2" / "config.json", T5_XXL)
    dump(
        root / "scheduler" / "scheduler_config.json",
        {
            **FLOW_SCHEDULER,
            "use_dynamic_shifting": True,
            "base_shift": 0.5,
            "max_shift": 1.15,
            "base_image_seq_len": 256,
            "max_image_seq_len": 4096,
        },
    )
    tokenizer(root / "tokenizer", vocab, merges, "<|endoftext|>")
    t5_tokenizer(root / "tokenizer_2", t5)


def main(gz: str, spm: str) -> None:
    vocab, merges = clip_bpe(Path(gz))
    assert len(vocab) == 49408, len(vocab)
    for name, build in (("sd15", sd15), ("sdxl", sdxl)):
        shutil.rmtree(HERE / name, ignore_errors=True)
        build(HERE / name, vocab, merges)
    t5 = t5_tokenizer_json(Path(spm))
    for name, build in (("sd3", sd3), ("flux", flux)):
        shutil.rmtree(HERE / name, ignore_errors=True)
        build(HERE / name, vocab, merges, t5)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
