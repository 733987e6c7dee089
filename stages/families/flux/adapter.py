"""Flux.1: CLIP pooled output + T5 token embeddings, FluxTransformer2DModel on 16-channel latents packed 2x2 into
tokens, rectified-flow (flow matching) target, optional guidance embedding (dev-style distilled guidance)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch

from tuneline.schemas.families import FAMILY_FACTS, FamilyFacts
from tuneline.stages.families.base import MicroCond, TextEncoders
from tuneline.stages.families.common import DiffusersFamily, module_device, tokenize, unwrap
from tuneline.stages.families.sd3.adapter import CLIP_LENGTH, T5_LIMIT, flow_vae, t5_embeds, tiny_t5
from tuneline.stages.families.sd15.adapter import tiny_clip_config
from tuneline.stages.families.stock import dynamic_shift_scheduler
from tuneline.stages.families.vocab import build_clip_tokenizer, build_t5_tokenizer


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) → (B, H/2 * W/2, C*4): each 2x2 latent patch becomes one token, as FluxPipeline packs."""
    b, c, h, w = latents.shape
    if h % 2 or w % 2:
        raise ValueError(f"flux latents need even height and width, got {h}x{w} (bucket alignment must be 16 px)")
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Inverse of pack_latents for latents of (height, width)."""
    b, _, d = tokens.shape
    x = tokens.view(b, height // 2, width // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // 4, height, width)


def image_ids(height: int, width: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(H/2 * W/2, 3) rotary position ids (0, row, column) of the packed tokens."""
    ids = torch.zeros(height // 2, width // 2, 3)
    ids[..., 1] += torch.arange(height // 2)[:, None]
    ids[..., 2] += torch.arange(width // 2)[None, :]
    return ids.reshape(-1, 3).to(device=device, dtype=dtype)


class FluxFamily(DiffusersFamily):
    facts: ClassVar[FamilyFacts] = FAMILY_FACTS["flux"]
    # The double blocks' attention of both streams and both feed-forwards, as diffusers' FLUX LoRA script trains
    # them, and the single blocks' whole input layer (BFL's linear1 = q, k, v and the mlp input): each maps to the
    # original layout's names (lora.py). Not "proj_out": the suffix would also take the model's final projection.
    lora_target_modules: tuple[str, ...] = (
        *("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"),
        *("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp"),
    )
    prompt_keys: ClassVar[tuple[str, ...]] = ("prompt_embeds", "pooled_prompt_embeds")
    # Distilled guidance fed to guidance-embedding models while training (1.0 is the usual fine-tuning choice).
    train_guidance: float = 1.0
    # FluxPipeline ignores a negative prompt unless true CFG is on; a negative given means the user wants it used.
    true_cfg_scale: float = 4.0

    def single_file_denoiser(self, file: Path, config: Path) -> Any:
        # diffusers' Flux converter has FLUX.1's width written in; this one reads it from the file
        from tuneline.stages.families.flux.layout import load_flux_transformer

        return load_flux_transformer(file, config)

    # ---- tiny flavor -------------------------------------------------------------------------
    # attention_head_dim = sum(axes_dims_rope); guidance_embeds on, as in Flux.1-dev.
    tiny_transformer: ClassVar[dict[str, Any]] = {
        "num_layers": 1,
        "num_single_layers": 1,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "joint_attention_dim": 32,
        "pooled_projection_dim": 32,
        "guidance_embeds": True,
        "axes_dims_rope": (4, 4, 8),
    }

    def tiny_vae(self) -> torch.nn.Module:
        return flow_vae(self.facts)

    def build_tiny(self, out_dir: Path) -> None:
        from diffusers import FluxTransformer2DModel
        from transformers import CLIPTextConfig, CLIPTextModel

        tok = build_clip_tokenizer(out_dir / "tokenizer", CLIP_LENGTH)
        tok_2 = build_t5_tokenizer(out_dir / "tokenizer_2", T5_LIMIT)
        # Packing happens outside the model, so in_channels = 4 * latent channels and patch_size 1, as in Flux.1.
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=4 * self.facts.latent_channels, **self.tiny_transformer
        )
        scheduler = dynamic_shift_scheduler()
        pipe = self.pipeline_class(
            scheduler=scheduler,
            vae=self.tiny_vae(),
            text_encoder=CLIPTextModel(CLIPTextConfig(**tiny_clip_config(tok, CLIP_LENGTH))),
            tokenizer=tok,
            text_encoder_2=tiny_t5(tok_2, 32),
            tokenizer_2=tok_2,
            transformer=transformer,
        )
        pipe.save_pretrained(out_dir, safe_serialization=True)

    # ---- text --------------------------------------------------------------------------------
    def encode_text(self, enc: TextEncoders, captions: list[str]) -> dict[str, torch.Tensor]:
        """As FluxPipeline.encode_prompt: CLIP's pooled output and T5's token embeddings; plus T5's attention mask
        (Flux.1 was trained without masking, so denoise ignores it; kept for trainers that mask padding)."""
        tok, te = enc.tokenizers[0], enc.encoders[0]
        ids, _ = tokenize(tok, captions, min(CLIP_LENGTH, tok.model_max_length), module_device(te))
        with torch.no_grad():
            pooled = te(ids, output_hidden_states=False).pooler_output
        _, mask = tokenize(enc.tokenizers[1], captions, enc.max_length, torch.device("cpu"))
        return {
            "prompt_embeds": t5_embeds(enc, captions),
            "pooled_prompt_embeds": pooled,
            "prompt_attention_mask": mask.to(pooled.device),
        }

    def check_max_length(self, tokenizers: list[Any], max_length: int) -> None:
        if max_length > T5_LIMIT:
            raise ValueError(
                f"text.max_length {max_length} exceeds the T5 limit {T5_LIMIT} of family {self.facts.name!r}"
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
        """Velocity prediction for scaled latents (B, 16, H, W), returned in the same shape (timesteps as
        base.Family.denoise says for flow families). Flux's transformer takes sigma itself (it scales by 1000
        inside), so this divides by 1000, as FluxPipeline does. Latents are packed 2x2 into tokens and unpacked."""
        b, _, h, w = noisy.shape
        dt, dev = noisy.dtype, noisy.device
        embeds = text["prompt_embeds"].to(device=dev, dtype=dt)
        guidance = None
        if getattr(unwrap(denoiser).config, "guidance_embeds", False):
            guidance = torch.full((b,), self.train_guidance, device=dev, dtype=torch.float32)
        out = denoiser(
            hidden_states=pack_latents(noisy),
            timestep=timesteps.to(dev, dt) / 1000,
            guidance=guidance,
            pooled_projections=text["pooled_prompt_embeds"].to(device=dev, dtype=dt),
            encoder_hidden_states=embeds,
            txt_ids=torch.zeros(embeds.shape[1], 3, device=dev, dtype=dt),
            img_ids=image_ids(h, w, dev, dt),
            return_dict=False,
        )[0]
        return unpack_latents(out, h, w)

    # ---- validation --------------------------------------------------------------------------
    def prompt_kwargs(self, text: dict[str, torch.Tensor], negative: dict[str, torch.Tensor] | None) -> dict[str, Any]:
        """Embeds for FluxPipeline; with a negative, true CFG at `true_cfg_scale` so it takes effect (the
        attention mask is not a pipeline argument). Without one, plain (distilled-guidance) sampling."""
        kwargs = super().prompt_kwargs(text, negative)
        kwargs["max_sequence_length"] = text["prompt_embeds"].shape[1]
        if negative:
            kwargs["true_cfg_scale"] = self.true_cfg_scale
        return kwargs
