"""FLUX.2 [klein]: FLUX.2's VAE, latent space and transformer call (the [dev] folder's Flux2Family), captions through Qwen3
(hidden states of layers 9, 18, 27 side by side, chat template with thinking off), true CFG against "" or a
negative prompt."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch

from tuneline.schemas.families import FAMILY_FACTS, FamilyFacts
from tuneline.stages.families.base import TextEncoders
from tuneline.stages.families.flux2 import latents as lat
from tuneline.stages.families.flux2.adapter import Flux2Family
from tuneline.stages.families.qwen import chat_prompts, qwen_hidden, tiny_qwen3

KLEIN_LAYERS = (9, 18, 27)  # Flux2KleinPipeline's text_encoder_out_layers


class Flux2KleinFamily(Flux2Family):
    facts: ClassVar[FamilyFacts] = FAMILY_FACTS["flux2_klein"]

    def build_tiny(self, out_dir: Path) -> None:
        from tuneline.stages.families.qwen import build_qwen_tokenizer

        tok = build_qwen_tokenizer(out_dir / "tokenizer", self.facts.max_length_limit)
        # 28 Qwen3 layers (as the released 4B) so the pipeline's hidden-state layers 9, 18, 27 exist; 32 wide.
        te = tiny_qwen3(tok, layers=28, causal_lm=True)
        self.save_tiny(out_dir, tok, lambda: te, len(KLEIN_LAYERS), guidance=False, is_distilled=False)

    def encode_text(self, enc: TextEncoders, captions: list[str]) -> dict[str, torch.Tensor]:
        """As Flux2KleinPipeline._get_qwen3_prompt_embeds: chat template (thinking off), hidden states 9/18/27 side
        by side at max_length tokens. The transformer sees every position (padding too), as in the pipeline; the
        mask is kept for trainers that mask padding."""
        hidden, mask = qwen_hidden(enc, chat_prompts(enc.tokenizers[0], captions, enable_thinking=False), KLEIN_LAYERS)
        return {"prompt_embeds": hidden, "prompt_attention_mask": mask}

    def rendered_latents(self, latents: torch.Tensor, width: int, height: int, vae: Any) -> torch.Tensor:
        """Flux2KleinPipeline's output_type="latent" result is (B, 32, H, W) already taken back to the VAE's raw
        scale (unlike Flux2Pipeline's normalised tokens); the cache holds the normalised latents, so the
        normalisation is redone with the VAE's batch-norm statistics (as lat.NormalisedEncoder)."""
        m, s = (t.to(latents) for t in lat.bn_stats(vae))
        return lat.unpatchify((lat.patchify(latents) - m) / s)
