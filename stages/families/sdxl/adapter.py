"""Stable Diffusion XL: two CLIP encoders (penultimate hidden states concatenated, pooled output of the second),
size micro-conditioning (add_time_ids), UNet2DConditionModel, 4-channel latents, epsilon target."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch

from tuneline.schemas.families import FAMILY_FACTS, FamilyFacts
from tuneline.stages.families.base import MicroCond, TextEncoders
from tuneline.stages.families.common import module_device, tokenize
from tuneline.stages.families.sd15.adapter import (
    LdmUNetFamily,
    tiny_clip_config,
    tiny_unet,
    tiny_vae,
)
from tuneline.stages.families.vocab import build_clip_tokenizer

TIME_EMBED_DIM = 8  # tiny flavor's addition_time_embed_dim (SDXL: 256)


class SDXLFamily(LdmUNetFamily):
    single_file_module: ClassVar[str] = "tuneline.stages.families.sdxl.single_file"
    facts: ClassVar[FamilyFacts] = FAMILY_FACTS["sdxl"]
    prompt_keys: ClassVar[tuple[str, ...]] = ("prompt_embeds", "pooled_prompt_embeds")

    def pipeline_load_kwargs(self) -> dict[str, Any]:
        # The invisible watermark package is optional and absent here; renders need no watermark.
        return {"add_watermarker": False}

    def unused_modules(self, model: torch.nn.Module, component: str) -> tuple[str, ...]:
        """Text encoder 1 is read at its penultimate hidden states and its pooled output is not used, so its last
        layer and final layer norm never reach the loss (text encoder 2's last layer makes the pooled embedding)."""
        if component != self.text_components[0]:
            return ()
        names = [n for n, _ in model.named_modules()]
        layers = next(n for n in names if n.endswith("encoder.layers"))
        norm = next(n for n in names if n.endswith("final_layer_norm"))
        return (f"{layers}.{len(model.get_submodule(layers)) - 1}", norm)

    # ---- tiny flavor -------------------------------------------------------------------------
    def build_tiny(self, out_dir: Path) -> None:
        from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

        n = self.facts.max_length
        tok = build_clip_tokenizer(out_dir / "tokenizer", n)
        tok_2 = build_clip_tokenizer(out_dir / "tokenizer_2", n)
        te = CLIPTextModel(CLIPTextConfig(**tiny_clip_config(tok, n)))
        te_2 = CLIPTextModelWithProjection(CLIPTextConfig(**tiny_clip_config(tok_2, n, projection_dim=32)))
        # cross_attention_dim = both encoders' widths; the added embedding takes 6 time ids + the pooled vector.
        unet = tiny_unet(
            cross_attention_dim=64,
            addition_embed_type="text_time",
            use_linear_projection=True,
            addition_time_embed_dim=TIME_EMBED_DIM,
            projection_class_embeddings_input_dim=6 * TIME_EMBED_DIM + 32,
        )
        pipe = self.pipeline_class(
            vae=tiny_vae(4, self.facts),
            text_encoder=te,
            text_encoder_2=te_2,
            tokenizer=tok,
            tokenizer_2=tok_2,
            unet=unet,
            scheduler=self._scheduler(),
            add_watermarker=False,
        )
        pipe.save_pretrained(out_dir, safe_serialization=True)

    @staticmethod
    def _scheduler():
        from diffusers import EulerDiscreteScheduler

        # SDXL's published schedule; Euler renders well in few steps, training reads it as DDPM.
        return EulerDiscreteScheduler(
            num_train_timesteps=1000,
            beta_start=0.00085,
            beta_end=0.012,
            beta_schedule="scaled_linear",
            prediction_type="epsilon",
            steps_offset=1,
            timestep_spacing="leading",
        )

    # ---- text --------------------------------------------------------------------------------
    def encode_text(self, enc: TextEncoders, captions: list[str]) -> dict[str, torch.Tensor]:
        """As StableDiffusionXLPipeline.encode_prompt: penultimate hidden states of both encoders side by side,
        the pooled (projected) output of the second."""
        hidden, pooled = [], None
        for tok, te in zip(enc.tokenizers, enc.encoders):
            ids, _ = tokenize(tok, captions, enc.max_length, module_device(te))
            out = te(ids, output_hidden_states=True)  # with gradients for train.text_encoder_lora
            hidden.append(out.hidden_states[-2])
            if out[0].ndim == 2:  # the model with projection returns text_embeds first
                pooled = out[0]
        assert pooled is not None, "SDXL's second text encoder must be a CLIPTextModelWithProjection"
        return {"prompt_embeds": torch.cat(hidden, dim=-1), "pooled_prompt_embeds": pooled}

    # ---- training ----------------------------------------------------------------------------
    def denoise(
        self,
        denoiser: torch.nn.Module,
        noisy: torch.Tensor,
        timesteps: torch.Tensor,
        text: dict[str, torch.Tensor],
        micro: list[MicroCond] | None = None,
    ) -> torch.Tensor:
        """UNet prediction for scaled latents at DDPM integer `timesteps`. `micro` gives each sample's original
        size, crop and target size (pixels, (h, w)); without it the latent size in pixels and no crop are used,
        which is what the pipeline uses at render time."""
        embeds = text["prompt_embeds"].to(device=noisy.device, dtype=noisy.dtype)
        added = {
            "text_embeds": text["pooled_prompt_embeds"].to(device=noisy.device, dtype=noisy.dtype),
            "time_ids": self.micro_time_ids(micro, noisy),
        }
        return denoiser(noisy, timesteps, encoder_hidden_states=embeds, added_cond_kwargs=added, return_dict=False)[0]
