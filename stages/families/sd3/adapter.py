"""Stable Diffusion 3: CLIP-L + CLIP-G + T5, SD3Transformer2DModel on 16-channel latents with 2x2 patches,
rectified-flow (flow matching) target."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from tuneline.schemas.families import FAMILY_FACTS, FamilyFacts
from tuneline.stages.families.base import MicroCond, TextEncoders
from tuneline.stages.families.common import DiffusersFamily, module_device, tokenize
from tuneline.stages.families.sd15.adapter import tiny_clip_config, tiny_vae
from tuneline.stages.families.vocab import build_clip_tokenizer, build_t5_tokenizer

CLIP_LENGTH = 77  # SD3 and Flux always run CLIP at its full context; only the T5 length is a choice
T5_LIMIT = 512  # T5 has relative positions; 512 is what SD3/Flux tokenizers declare and pipelines accept


def tiny_t5(tokenizer: Any, d_model: int):
    """A 2-layer gated-GELU T5 encoder (the v1.1 layout SD3 and Flux use), `d_model` wide."""
    from transformers import T5Config, T5EncoderModel

    cfg = T5Config(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=16,
        d_ff=2 * d_model,
        num_layers=2,
        num_heads=d_model // 16,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
        is_encoder_decoder=False,
    )
    return T5EncoderModel(cfg)


def flow_vae(facts: FamilyFacts):
    """16-channel latents with the family's scale and shift; SD3/Flux VAEs have no quant convolutions."""
    return tiny_vae(
        facts.latent_channels, facts, shift_factor=facts.shift_factor, use_quant_conv=False, use_post_quant_conv=False
    )


def t5_embeds(enc: TextEncoders, captions: list[str]) -> torch.Tensor:
    """Last hidden state of the T5 encoder (the last one in `enc`) at enc.max_length tokens."""
    tok, te = enc.tokenizers[-1], enc.encoders[-1]
    ids, _ = tokenize(tok, captions, enc.max_length, module_device(te))
    with torch.no_grad():
        return te(ids)[0]


class SD3Family(DiffusersFamily):
    facts: ClassVar[FamilyFacts] = FAMILY_FACTS["sd3"]
    prompt_keys: ClassVar[tuple[str, ...]] = ("prompt_embeds", "pooled_prompt_embeds")

    def unused_modules(self, model: torch.nn.Module, component: str) -> tuple[str, ...]:
        """The last block is context_pre_only: its text outputs are dropped, so its text queries (add_q_proj and
        their norm, which only make the text outputs) get a zero gradient; its text keys and values feed the image
        tokens' attention."""
        if component != self.denoiser_component:
            return ()
        last = len(model.transformer_blocks) - 1
        attn = model.transformer_blocks[last].attn
        names = ("add_q_proj",) + (("norm_added_q",) if attn.norm_added_q is not None else ())
        return tuple(f"transformer_blocks.{last}.attn.{n}" for n in names)

    # ---- tiny flavor -------------------------------------------------------------------------
    def build_tiny(self, out_dir: Path) -> None:
        from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
        from transformers import CLIPTextConfig, CLIPTextModelWithProjection

        toks = [build_clip_tokenizer(out_dir / n, CLIP_LENGTH) for n in ("tokenizer", "tokenizer_2")]
        clips = [
            CLIPTextModelWithProjection(CLIPTextConfig(**tiny_clip_config(t, CLIP_LENGTH, projection_dim=32)))
            for t in toks
        ]
        tok_3 = build_t5_tokenizer(out_dir / "tokenizer_3", T5_LIMIT)
        # joint_attention_dim = T5 width >= both CLIP widths side by side (the pipeline pads CLIP up to it);
        # pooled_projection_dim = both CLIP projections side by side.
        transformer = SD3Transformer2DModel(
            sample_size=8,
            patch_size=self.facts.patch_size,
            in_channels=self.facts.latent_channels,
            out_channels=self.facts.latent_channels,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=64,
            caption_projection_dim=32,
            pooled_projection_dim=64,
            pos_embed_max_size=64,
        )
        pipe = self.pipeline_class(
            transformer=transformer,
            scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
            vae=flow_vae(self.facts),
            text_encoder=clips[0],
            tokenizer=toks[0],
            text_encoder_2=clips[1],
            tokenizer_2=toks[1],
            text_encoder_3=tiny_t5(tok_3, 64),
            tokenizer_3=tok_3,
        )
        pipe.save_pretrained(out_dir, safe_serialization=True)

    # ---- text --------------------------------------------------------------------------------
    def encode_text(self, enc: TextEncoders, captions: list[str]) -> dict[str, torch.Tensor]:
        """As StableDiffusion3Pipeline.encode_prompt: CLIP-L and CLIG-G penultimate states side by side, zero-padded
        to T5's width, followed by T5's tokens along the sequence; pooled = both CLIP projections side by side."""
        hidden, pooled = [], []
        for tok, te in zip(enc.tokenizers[:2], enc.encoders[:2]):
            ids, _ = tokenize(tok, captions, min(CLIP_LENGTH, tok.model_max_length), module_device(te))
            with torch.no_grad():
                out = te(ids, output_hidden_states=True)
            hidden.append(out.hidden_states[-2])
            pooled.append(out[0])
        t5 = t5_embeds(enc, captions)
        clip = torch.cat(hidden, dim=-1)
        clip = F.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return {
            "prompt_embeds": torch.cat([clip.to(t5.dtype), t5], dim=-2),
            "pooled_prompt_embeds": torch.cat(pooled, dim=-1),
        }

    def check_max_length(self, tokenizers: list[Any], max_length: int) -> None:
        if max_length > T5_LIMIT:
            raise ValueError(
                f"text.max_length {max_length} exceeds the T5 limit {T5_LIMIT} of family {self.facts.name!r}"
            )

    # ---- validation --------------------------------------------------------------------------
    def prompt_kwargs(self, text: dict[str, torch.Tensor], negative: dict[str, torch.Tensor] | None) -> dict[str, Any]:
        """Embeds for StableDiffusion3Pipeline, plus the T5 length actually used, so a negative the pipeline
        encodes itself (when none is given) has the same sequence length as the prompt."""
        kwargs = super().prompt_kwargs(text, negative)
        kwargs["max_sequence_length"] = text["prompt_embeds"].shape[1] - CLIP_LENGTH
        return kwargs

    # ---- training ----------------------------------------------------------------------------
    def denoise(
        self,
        denoiser: torch.nn.Module,
        noisy: torch.Tensor,
        timesteps: torch.Tensor,
        text: dict[str, torch.Tensor],
        micro: list[MicroCond] | None = None,
    ) -> torch.Tensor:
        """Velocity prediction for scaled latents (B, 16, H, W); patching happens inside the transformer. Timesteps
        as base.Family.denoise says for flow families: SD3's transformer takes them as they are (the pipeline passes
        sigma * 1000)."""
        embeds = text["prompt_embeds"].to(device=noisy.device, dtype=noisy.dtype)
        pooled = text["pooled_prompt_embeds"].to(device=noisy.device, dtype=noisy.dtype)
        return denoiser(
            hidden_states=noisy,
            timestep=timesteps.to(noisy.device),
            encoder_hidden_states=embeds,
            pooled_projections=pooled,
            return_dict=False,
        )[0]
