"""Qwen-Image: Qwen2.5-VL's last hidden states of a chat-templated prompt (the template's tokens dropped; variable
length, with an attention mask), QwenImageTransformer2DModel (MMDiT) on 16-channel latents packed 2x2 into tokens,
flow matching with the scheduler's dynamic (resolution-dependent) shift, and a video VAE (one frame) whose latents
are normalised per channel (latents_mean / latents_std in its config). Validation uses true CFG with negatives."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch

from tuneline.schemas.families import FAMILY_FACTS, FamilyFacts
from tuneline.stages.families.base import MicroCond, TextEncoders
from tuneline.stages.families.common import DiffusersFamily, module_device
from tuneline.stages.families.qwen_image.vocab import DROP, TEMPLATE, build_qwen_tokenizer
from tuneline.stages.families.tiny.adapter import demo_pictures


def pack_latents(x: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, 4C), as QwenImagePipeline._pack_latents."""
    b, c, h, w = x.shape
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    b, _, d = tokens.shape
    return tokens.view(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, d // 4, h, w)


class _FrameEncoder(torch.nn.Module):
    """The video VAE's encoder for still images: (B, 3, H, W) in, a posterior over (B, C, h, w) out."""

    def __init__(self, vae: torch.nn.Module):
        super().__init__()
        self.vae = vae
        self.config = vae.config
        self.dtype = vae.dtype

    def encode(self, x: torch.Tensor):
        out = self.vae.encode(x.unsqueeze(2))
        dist = out.latent_dist
        dist.mean, dist.std = dist.mean.squeeze(2), dist.std.squeeze(2)
        dist.var, dist.logvar = dist.var.squeeze(2), dist.logvar.squeeze(2)
        dist.parameters = dist.parameters.squeeze(2)
        return out


def tiny_qwen25vl(tok, width: int, max_positions: int, token_ids: dict[str, int] | None = None):
    """The tiny flavors' Qwen2.5-VL: 2 text layers `width` wide with `tok`'s special ids, a one-block vision tower;
    `token_ids` (image_token_id, vision_start_token_id, ...) where the tokenizer has vision tokens (the edit
    families')."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tok),
            hidden_size=width,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=max_positions,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
            bos_token_id=None,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        ),
        vision_config=dict(
            depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=width, fullatt_block_indexes=[0]
        ),
        **(token_ids or {}),
    )
    return Qwen2_5_VLForConditionalGeneration(config)


class QwenImageFamily(DiffusersFamily):
    facts: ClassVar[FamilyFacts] = FAMILY_FACTS["qwen_image"]
    prompt_keys: ClassVar[tuple[str, ...]] = ("prompt_embeds", "prompt_embeds_mask")
    # ComfyUI's qwen_image_vae.safetensors is in Wan's original VAE layout (ComfyUI runs it as its Wan VAE), and
    # AutoencoderKLQwenImage has AutoencoderKLWan's module names: diffusers' Wan converter reads it
    # (stages/families/split_files.py).
    single_file_layouts: ClassVar[dict[str, str]] = {"vae": "AutoencoderKLWan"}
    lora_target_modules: tuple[str, ...] = (
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "add_q_proj",
        "add_k_proj",
        "add_v_proj",
        "to_add_out",
    )
    # The last block's text stream: the transformer keeps only the image tokens after it (norm_out, proj_out), so
    # its text queries (they only make the text outputs), the text outputs' projection and the text feed-forward
    # never reach the loss (a backward leaves them without gradient: tests/integration/test_families_pipeline.py).
    # Its add_k/add_v_proj do: the image queries attend to those keys and values.
    LAST_BLOCK_UNUSED: ClassVar[tuple[str, ...]] = (
        "attn.add_q_proj",
        "attn.norm_added_q",
        "attn.to_add_out",
        "txt_mlp",
    )
    # QwenImagePipeline applies a negative prompt only through true CFG; a negative given means the user wants it.
    true_cfg_scale: float = 4.0

    # ---- tiny flavor -------------------------------------------------------------------------
    def build_tiny(self, out_dir: Path) -> None:
        from diffusers import FlowMatchEulerDiscreteScheduler

        tok = build_qwen_tokenizer(out_dir / "tokenizer", self.facts.max_length_limit + DROP)
        width = 32
        text_encoder = tiny_qwen25vl(tok, width, max_positions=2048)
        transformer, vae = self.tiny_denoiser_and_vae(width)
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(SCHEDULER)
        pipe = self.pipeline_class(
            scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tok, transformer=transformer
        )
        pipe.save_pretrained(out_dir, safe_serialization=True)

    def tiny_denoiser_and_vae(self, width: int) -> tuple[torch.nn.Module, torch.nn.Module]:
        """The tiny flavor's transformer (text width `width`) and VAE, shared with the edit families built on it."""
        from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel

        # attention_head_dim = sum(axes_dims_rope), as in the released (128 = 16 + 56 + 56).
        transformer = QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=4 * self.facts.latent_channels,
            out_channels=self.facts.latent_channels,
            num_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=width,
            axes_dims_rope=(4, 6, 6),
        )
        vae = AutoencoderKLQwenImage(
            base_dim=8,
            z_dim=self.facts.latent_channels,
            dim_mult=[1, 2, 2, 2],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
        )
        # The released latents_mean / latents_std were measured on the released VAE; on random weights they leave
        # the demo's colors about a hundredth of the noise apart, and the edit demo learns nothing. Measured the same
        # way on pictures of the demo's domain, the colors are a third of the noise apart or more.
        with torch.no_grad():
            latents = vae.encode(demo_pictures().unsqueeze(2)).latent_dist.mean
        vae.register_to_config(
            latents_mean=latents.mean(dim=(0, 2, 3, 4)).tolist(), latents_std=latents.std(dim=(0, 2, 3, 4)).tolist()
        )
        return transformer, vae

    # ---- latents -----------------------------------------------------------------------------
    def load_vae(self, model_dir: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
        from diffusers import AutoencoderKLQwenImage

        vae = AutoencoderKLQwenImage.from_pretrained(model_dir, subfolder="vae", dtype=dtype).to(device)
        return vae.eval().requires_grad_(False)

    def load_vae_encoder(self, model_dir: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
        # The decoder stays: this VAE's encode clears a cache sized by counting the decoder's convolutions.
        return _FrameEncoder(self.load_vae(model_dir, dtype, device))

    def latent_stats(self, vae: torch.nn.Module) -> tuple[list[float], list[float]]:
        """Per-channel (mean, std) the pipeline normalises latents with: z_model = (z - mean) / std."""
        return list(vae.config.latents_mean), list(vae.config.latents_std)

    # ---- text --------------------------------------------------------------------------------
    def encode_text(self, enc: TextEncoders, captions: list[str]) -> dict[str, torch.Tensor]:
        """As QwenImagePipeline._get_qwen_prompt_embeds: the template around each caption, the encoder's last hidden
        states, the template's first 34 tokens dropped; then zero-padded to max_length with a 0/1 mask."""
        tok, te = enc.tokenizers[0], enc.encoders[0]
        dev = module_device(te)
        batch = tok(
            [TEMPLATE.format(c) for c in captions],
            max_length=enc.max_length + DROP,
            padding="max_length",
            truncation=True,
            return_tensors="pt",
        ).to(dev)
        with torch.no_grad():
            hidden = te(
                input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True
            ).hidden_states[-1]
        length = enc.max_length
        embeds = hidden.new_zeros(len(captions), length, hidden.shape[-1])
        mask = torch.zeros(len(captions), length, dtype=torch.long, device=dev)
        for i, m in enumerate(batch.attention_mask.bool()):
            kept = hidden[i][m][DROP : DROP + length]
            embeds[i, : len(kept)], mask[i, : len(kept)] = kept, 1
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}

    def check_max_length(self, tokenizers: list[Any], max_length: int) -> None:
        if max_length > self.facts.max_length_limit:
            raise ValueError(
                f"text.max_length {max_length} exceeds QwenImagePipeline's limit "
                f"{self.facts.max_length_limit} for family {self.facts.name!r}"
            )

    # ---- training ----------------------------------------------------------------------------
    def denoise(
        self,
        denoiser: torch.nn.Module,
        noisy: torch.Tensor,
        timesteps: torch.Tensor,
        text: dict[str, torch.Tensor],
        micro: list[MicroCond] | None = None,
    ) -> torch.Tensor:
        """Velocity for normalised latents (B, 16, H, W). The transformer takes sigma (timesteps / 1000) as
        QwenImagePipeline passes it; latents are packed 2x2 into tokens and unpacked on the way out."""
        b, _, h, w = noisy.shape
        dt, dev = noisy.dtype, noisy.device
        out = denoiser(
            hidden_states=pack_latents(noisy),
            timestep=timesteps.to(dev, dt) / 1000,
            encoder_hidden_states=text["prompt_embeds"].to(device=dev, dtype=dt),
            encoder_hidden_states_mask=text["prompt_embeds_mask"].to(dev),
            img_shapes=[[(1, h // 2, w // 2)]] * b,
            return_dict=False,
        )[0]
        return unpack_latents(out, h, w)

    def unused_modules(self, model: torch.nn.Module, component: str) -> tuple[str, ...]:
        if component != self.denoiser_component:
            return ()
        last = f"transformer_blocks.{len(model.transformer_blocks) - 1}"
        return tuple(f"{last}.{m}" for m in self.LAST_BLOCK_UNUSED)

    # ---- validation --------------------------------------------------------------------------
    def prompt_kwargs(self, text: dict[str, torch.Tensor], negative: dict[str, torch.Tensor] | None) -> dict[str, Any]:
        kwargs = super().prompt_kwargs(text, negative)
        kwargs["max_sequence_length"] = text["prompt_embeds"].shape[1]
        if negative:
            kwargs["true_cfg_scale"] = self.true_cfg_scale
        return kwargs


# Qwen/Qwen-Image scheduler/scheduler_config.json: dynamic (resolution-dependent, exponential) shift.
SCHEDULER = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "invert_sigmas": False,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_beta_sigmas": False,
    "use_dynamic_shifting": True,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}
