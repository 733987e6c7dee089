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

import base64
import gzip
import json
import shutil
import struct
import sys
from pathlib import Path

from tuneline.stages.families.vocab import bytes_to_unicode  # (openai's byte-level alphabet, shared)

HERE = Path(__file__).resolve().parent
N_MERGES = 49152 - 256 - 2  # openai's simple_tokenizer: the merges the released CLIP models use


def clip_bpe(gz: Path) -> tuple[dict[str, int], list[str]]:
    lines = gzip.open(gz).read().decode("utf-8").split("\n")[1 : N_MERGES + 1]
    merges = [tuple(line.split()) for line in lines]
    assert all(len(m) == 2 for m in merges), "unexpected merges file"
    vocab = list(bytes_to_unicode().values())
    vocab = vocab + [v + "</w>" for v in vocab] + ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    return {tok: i for i, tok in enumerate(vocab)}, [" ".join(m) for m in merges]


def _fields(buf: bytes):
    """(field number, value) of one protobuf message: the few wire types a SentencePiece model uses."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        wire = key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 1:
            value, i = buf[i : i + 8], i + 8
        elif wire == 5:
            value, i = buf[i : i + 4], i + 4
        elif wire == 2:
            n, i = _varint(buf, i)
            value, i = buf[i : i + n], i + n
        else:
            raise ValueError(f"unexpected protobuf wire type {wire}")
        yield key >> 3, value


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    out = shift = 0
    while True:
        byte = buf[i]
        i += 1
        out |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return out, i


def spm_model(path: Path) -> tuple[list[tuple[str, float, int]], bytes]:
    """(pieces as (text, score, type), the normalizer's precompiled charsmap) of a SentencePiece ModelProto: field 1
    is a repeated SentencePiece {1: piece, 2: score, 3: type}, field 3 the NormalizerSpec {2: precompiled_charsmap}.
    Read without sentencepiece/protobuf so the derivation needs nothing beyond Python."""
    pieces, charsmap = [], b""
    for num, value in _fields(path.read_bytes()):
        if num == 1:
            f = dict(_fields(value))
            pieces.append((f[1].decode("utf-8"), struct.unpack("<f", f.get(2, b"\0" * 4))[0], f.get(3, 1)))
        elif num == 3:
            charsmap = dict(_fields(value)).get(2, b"")
    return pieces, charsmap


T5_EXTRA_IDS = 100  # <extra_id_0..99>: T5's sentinels, ids 32099..32000 (the vocabulary is 32100 = 32000 + 100)


def t5_tokenizer_json(model: Path) -> dict:
    """tokenizer.json of T5's Unigram tokenizer as transformers' T5 converter writes it: the pieces with their
    scores, the SentencePiece normalizer (NFKC charsmap, trailing-space strip, runs of spaces to one), Metaspace
    word marker, `</s>` appended, then the sentinels <extra_id_99> .. <extra_id_0>."""
    pieces, charsmap = spm_model(model)
    assert len(pieces) == 32000 and [p[0] for p in pieces[:3]] == ["<pad>", "</s>", "<unk>"], "not T5's spiece.model"
    extra = [f"<extra_id_{i}>" for i in reversed(range(T5_EXTRA_IDS))]

    def added(i: int, text: str, strip: bool) -> dict:
        return {
            "id": i,
            "content": text,
            "single_word": False,
            "lstrip": strip,
            "rstrip": strip,
            "normalized": False,
            "special": True,
        }

    meta = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True}
    eos = [{"SpecialToken": {"id": "</s>", "type_id": 0}}]
    seq = [{"Sequence": {"id": "A", "type_id": 0}}]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [added(i, p[0], False) for i, p in enumerate(pieces[:3])]
        + [added(len(pieces) + i, t, True) for i, t in enumerate(extra)],
        "normalizer": {
            "type": "Sequence",
            "normalizers": [
                {"type": "Precompiled", "precompiled_charsmap": base64.b64encode(charsmap).decode("ascii")},
                {"type": "Strip", "strip_left": False, "strip_right": True},
                {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": "\u2581"},
            ],
        },
        "pre_tokenizer": meta,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": seq + eos,
            "pair": seq + eos + [{"Sequence": {"id": "B", "type_id": 0}}] + eos,
            "special_tokens": {"</s>": {"id": "</s>", "ids": [1], "tokens": ["</s>"]}},
        },
        "decoder": meta,
        "model": {
            "type": "Unigram",
            "unk_id": 2,
            "byte_fallback": False,
            "vocab": [[p[0], p[1]] for p in pieces] + [[t, 0.0] for t in extra],
        },
    }


def t5_tokenizer(folder: Path, tok_json: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(
        json.dumps(tok_json, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8"
    )
    specials = {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    dump(
        folder / "tokenizer_config.json",
        {
            "tokenizer_class": "T5Tokenizer",
            "model_max_length": 512,
            "extra_ids": T5_EXTRA_IDS,
            "legacy": True,
            **specials,
        },
    )
    dump(folder / "special_tokens_map.json", specials)


def dump(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def tokenizer(folder: Path, vocab: dict[str, int], merges: list[str], pad: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(
        json.dumps(vocab, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8"
    )
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    dump(
        folder / "tokenizer_config.json",
        {
            "tokenizer_class": "CLIPTokenizer",
            "model_max_length": 77,
            "bos_token": "<|startoftext|>",
            "eos_token": "<|endoftext|>",
            "unk_token": "<|endoftext|>",
            "pad_token": pad,
            "do_lower_case": True,
            "errors": "replace",
            "add_prefix_space": False,
        },
    )
    dump(
        folder / "special_tokens_map.json",
        {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "pad_token": pad},
    )


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
