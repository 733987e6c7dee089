"""Stable Diffusion 1.x/2.x: one CLIP text encoder, UNet2DConditionModel, 4-channel latents, epsilon target."""

from __future__ import annotations

from importlib import import_module
from pathlib import Path
from typing import Any, ClassVar

import torch

from tuneline.schemas.families import FAMILY_FACTS, FamilyFacts
from tuneline.stages.families.base import MicroCond, TextEncoders
from tuneline.stages.families.common import DiffusersFamily, module_device, tokenize
from tuneline.stages.families.vocab import build_clip_tokenizer


def tiny_clip_config(tokenizer: Any, max_positions: int, projection_dim: int | None = None) -> dict[str, Any]:
    """A 2-layer, 32-wide CLIP text config matching a locally built tokenizer (ids of its specials)."""
    cfg = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=max_positions,
        hidden_act="quick_gelu",
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if projection_dim is not None:
        cfg["projection_dim"] = projection_dim
    return cfg


def tiny_vae(latent_channels: int, facts: FamilyFacts, **extra: Any):
    """Four levels (vae_factor 8, like every real family) but 16-32 channels wide."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(16, 32, 32, 32),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=8,
        sample_size=64,
        scaling_factor=facts.scaling_factor,
        **extra,
    )


def tiny_unet(**extra: Any):
    """Two levels (32, 64) at sample size 8 (64 px). Cross-attention at both levels so text steers even this small
    model (the demo's learning check depends on it)."""
    from diffusers import UNet2DConditionModel

    cfg: dict[str, Any] = dict(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        attention_head_dim=4,
        norm_num_groups=16,
    )
    return UNet2DConditionModel(**{**cfg, **extra})


def unet_block_stacks(unet: torch.nn.Module) -> tuple[str, ...]:
    """The UNet's lists of transformer blocks (inside each attention's Transformer2DModel) in the order its forward
    runs them: down, mid, up (module registration puts up before mid, so the parts are walked explicitly)."""
    from diffusers.models.attention import BasicTransformerBlock

    out = []
    for part in ("down_blocks", "mid_block", "up_blocks"):
        for name, m in unet.get_submodule(part).named_modules(prefix=part):
            if isinstance(m, torch.nn.ModuleList) and m and all(isinstance(b, BasicTransformerBlock) for b in m):
                out.append(name)
    return tuple(out)


# train.text_encoder_lora: CLIP's attention projections, as diffusers' SD/SDXL LoRA scripts train them; the files
# carry them in the layout ComfyUI maps onto CLIP (lora_te_text_model_encoder_layers_0_self_attn_q_proj).
CLIP_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")


class LdmUNetFamily(DiffusersFamily):
    """What SD1.x and SDXL share: a UNet of repeated transformer stacks, CLIP text encoders, and an original
    (LDM) single-file layout written by `single_file_module`'s `ldm_state_dict`."""

    text_encoder_lora_targets: ClassVar[tuple[str, ...]] = CLIP_LORA_TARGETS
    single_file_module: ClassVar[str] = "tuneline.stages.families.sd15.single_file"

    def block_stacks(self, model: torch.nn.Module) -> tuple[str, ...]:
        return unet_block_stacks(model)

    def single_file_state(self, pipe: Any) -> dict[str, torch.Tensor]:
        return import_module(self.single_file_module).ldm_state_dict(pipe)


class SD15Family(LdmUNetFamily):
    facts: ClassVar[FamilyFacts] = FAMILY_FACTS["sd15"]
    # The tiny flavor's CLIP context: SD1.5's 77, so the sd15 flavor behaves like the real model.
    tiny_text_length: ClassVar[int] = 77

    def pipeline_load_kwargs(self) -> dict[str, Any]:
        # Validation renders of a fine-tune must not be blacked out, and no checker can be downloaded here.
        return {"safety_checker": None, "requires_safety_checker": False}

    # ---- tiny flavor -------------------------------------------------------------------------
    def tiny_vae(self):
        return tiny_vae(4, self.facts)

    def tiny_unet(self):
        return tiny_unet(cross_attention_dim=32)

    def tiny_scheduler(self):
        from diffusers import DDPMScheduler

        return DDPMScheduler(
            num_train_timesteps=1000,
            beta_start=0.00085,
            beta_end=0.012,
            beta_schedule="scaled_linear",
            prediction_type="epsilon",
            clip_sample=False,
            steps_offset=1,
        )

    def build_tiny(self, out_dir: Path) -> None:
        from transformers import CLIPTextConfig, CLIPTextModel

        tok = build_clip_tokenizer(out_dir / "tokenizer", self.tiny_text_length)
        text_encoder = CLIPTextModel(CLIPTextConfig(**tiny_clip_config(tok, self.tiny_text_length)))
        pipe = self.pipeline_class(
            vae=self.tiny_vae(),
            text_encoder=text_encoder,
            tokenizer=tok,
            unet=self.tiny_unet(),
            scheduler=self.tiny_scheduler(),
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
        pipe.save_pretrained(out_dir, safe_serialization=True)

    # ---- text --------------------------------------------------------------------------------
    def encode_text(self, enc: TextEncoders, captions: list[str]) -> dict[str, torch.Tensor]:
        tok, te = enc.tokenizers[0], enc.encoders[0]
        ids, mask = tokenize(tok, captions, enc.max_length, module_device(te))
        # SD1.x encoders were trained without masking; diffusers passes a mask only when the config asks.
        attn = mask if getattr(te.config, "use_attention_mask", False) else None
        # No no_grad here: a text-encoder LoRA (train.text_encoder_lora) trains through this call; the cache
        # writer and renderer encode under no_grad (families/encode.py), and frozen encoders track no gradients.
        embeds = te(ids, attention_mask=attn)[0]
        return {"prompt_embeds": embeds}

    # ---- training ----------------------------------------------------------------------------
    def denoise(
        self,
        denoiser: torch.nn.Module,
        noisy: torch.Tensor,
        timesteps: torch.Tensor,
        text: dict[str, torch.Tensor],
        micro: list[MicroCond] | None = None,
    ) -> torch.Tensor:
        """UNet prediction (facts.prediction: epsilon or v) for scaled latents; `timesteps` are the DDPM
        schedule's integer steps in [0, num_train_timesteps). `micro` is unused by SD1.x."""
        embeds = text["prompt_embeds"].to(device=noisy.device, dtype=noisy.dtype)
        return denoiser(noisy, timesteps, encoder_hidden_states=embeds, return_dict=False)[0]
