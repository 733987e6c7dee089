"""FLUX.2 [klein]: FLUX.2's VAE, latent space and transformer call (the [dev] folder's Flux2Family), captions through Qwen3
(hidden states of layers 9, 18, 27 side by side, chat template with thinking off), true CFG against "" or a
negative prompt."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch

from tuneline.schemas.families import FAMILY_FACTS, FamilyFacts
from tuneline.stages.families.base import TextEncoders
from tuneline.stages.families.flux2.adapter import Flux2Family, tiny_vae
from tuneline.stages.families.qwen import TINY_TEXT_WIDTH, chat_prompts, qwen_hidden, tiny_qwen3

KLEIN_LAYERS = (9, 18, 27)  # Flux2KleinPipeline's text_encoder_out_layers


class Flux2KleinFamily(Flux2Family):
    facts: ClassVar[FamilyFacts] = FAMILY_FACTS["flux2_klein"]

    def build_tiny(self, out_dir: Path) -> None:
        from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

        from tuneline.stages.families.qwen import build_qwen_tokenizer

        tok = build_qwen_tokenizer(out_dir / "tokenizer", self.facts.max_length_limit)
        # 28 Qwen3 layers (as the released 4B) so the pipeline's hidden-state layers 9, 18, 27 exist; 32 wide.
        te = tiny_qwen3(tok, layers=28, causal_lm=True)
        # in_channels = 4 x 32 latent channels (patchified); head dim 16 = sum(axes_dims_rope); no guidance
        # embedding ([klein] samples with true CFG).
        transformer = Flux2Transformer2DModel(
            patch_size=1,
            in_channels=4 * self.facts.latent_channels,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=len(KLEIN_LAYERS) * TINY_TEXT_WIDTH,
            timestep_guidance_channels=32,
            axes_dims_rope=(4, 4, 4, 4),
            guidance_embeds=False,
        )
        # FLUX.2's published scheduler: dynamic (resolution-dependent) shift.
        scheduler = FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000,
            shift=3.0,
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=1.15,
            base_image_seq_len=256,
            max_image_seq_len=4096,
        )
        pipe = self.pipeline_class(
            scheduler=scheduler,
            vae=tiny_vae(self.facts),
            text_encoder=te,
            tokenizer=tok,
            transformer=transformer,
            is_distilled=False,
        )
        pipe.save_pretrained(out_dir, safe_serialization=True)

    def check_max_length(self, tokenizers: list[Any], max_length: int) -> None:
        if max_length > self.facts.max_length_limit:
            raise ValueError(
                f"text.max_length {max_length} exceeds the {self.facts.max_length_limit} tokens family "
                f"{self.facts.name!r}'s pipeline encodes; lower it or leave it automatic"
            )

    def encode_text(self, enc: TextEncoders, captions: list[str]) -> dict[str, torch.Tensor]:
        """As Flux2KleinPipeline._get_qwen3_prompt_embeds: chat template (thinking off), hidden states 9/18/27 side
        by side at max_length tokens. The transformer sees every position (padding too), as in the pipeline; the
        mask is kept for trainers that mask padding."""
        hidden, mask = qwen_hidden(enc, chat_prompts(enc.tokenizers[0], captions, enable_thinking=False), KLEIN_LAYERS)
        return {"prompt_embeds": hidden, "prompt_attention_mask": mask}
