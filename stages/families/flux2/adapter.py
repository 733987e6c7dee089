"""FLUX.2: Flux2Transformer2DModel on the 32-channel AutoencoderKLFlux2 latents, patchified 2x2 into 128 channels,
normalised by the VAE's batch-norm statistics and packed into tokens (stages/families/flux2/latents.py); flow
matching (the transformer takes sigma). [klein] captions through Qwen3 (hidden states of layers 9, 18, 27 side by
side, chat template with thinking off) with true CFG against "" or a negative; [dev] through Mistral Small 3 with
distilled guidance (dev.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch

from tuneline.schemas.families import FAMILY_FACTS, FamilyFacts
from tuneline.stages.families.base import MicroCond, TextEncoders
from tuneline.stages.families.common import DiffusersFamily, unwrap
from tuneline.stages.families.flux2 import latents as lat
from tuneline.stages.families.qwen import TINY_TEXT_WIDTH, chat_prompts, qwen_hidden, tiny_qwen3

KLEIN_LAYERS = (9, 18, 27)  # Flux2KleinPipeline's text_encoder_out_layers


def tiny_vae(facts: FamilyFacts):
    """AutoencoderKLFlux2 16-32 channels wide, with batch-norm statistics away from (0, 1) so the tiny flavor
    exercises the normalisation the pipeline applies."""
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(block_out_channels=(16, 32, 32, 32), layers_per_block=1,
                             latent_channels=facts.latent_channels, norm_num_groups=8, sample_size=64)
    n = vae.bn.running_mean.numel()
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.linspace(-0.2, 0.2, n))
        vae.bn.running_var.copy_(torch.linspace(0.5, 2.0, n))
    return vae


class Flux2Family(DiffusersFamily):
    """What [dev] and [klein] share: VAE, latent space, transformer call."""

    facts: ClassVar[FamilyFacts]
    prompt_keys: ClassVar[tuple[str, ...]] = ("prompt_embeds",)
    # Flux2's double blocks name their attention to_q/k/v/to_out.0; single blocks fuse qkv+mlp (to_qkv_mlp_proj).
    lora_target_modules: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")

    # ---- latents -----------------------------------------------------------------------------
    def load_vae(self, model_dir: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
        from diffusers import AutoencoderKLFlux2

        vae = AutoencoderKLFlux2.from_pretrained(model_dir, subfolder="vae", dtype=dtype).to(device)
        return vae.eval().requires_grad_(False)

    def load_vae_encoder(self, model_dir: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
        vae = self.load_vae(model_dir, dtype, device)
        vae.decoder = None  # caching only encodes
        return lat.NormalisedEncoder(vae)

    def vae_factors(self, vae: torch.nn.Module) -> tuple[float, float]:
        """The cache already holds the pipeline's normalised space (latents.py): no further scale or shift."""
        return 1.0, 0.0

    def check_full_finetune(self, model_dir: Path) -> None:
        """Refuse a full fine-tune whose denoiser cannot fit DDP (stages/families/full_limit.py)."""
        from tuneline.stages.families.full_limit import check_full_fits

        cls = self.pipeline_class._get_signature_types()[self.denoiser_component][0]
        check_full_fits(self.facts.name, cls, model_dir, self.denoiser_component)

    # ---- training ----------------------------------------------------------------------------
    def denoise(self, denoiser: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                text: dict[str, torch.Tensor], micro: list[MicroCond] | None = None) -> torch.Tensor:
        """Velocity (noise - x0) for normalised latents (B, 32, H, W): patchified, packed, the transformer called
        as Flux2Pipeline calls it (timestep = sigma, all caption tokens, 4-axis position ids), and unpacked."""
        b, _, h, w = noisy.shape
        dt, dev = noisy.dtype, noisy.device
        embeds = text["prompt_embeds"].to(device=dev, dtype=dt)
        guidance = None
        if getattr(unwrap(denoiser).config, "guidance_embeds", False):
            guidance = torch.full((b,), self.train_guidance, device=dev, dtype=dt)
        out = denoiser(hidden_states=lat.pack(lat.patchify(noisy)), timestep=timesteps.to(dev, dt) / 1000,
                       guidance=guidance, encoder_hidden_states=embeds, txt_ids=lat.text_ids(b, embeds.shape[1], dev),
                       img_ids=lat.latent_ids(b, h // 2, w // 2, dev), return_dict=False)[0]
        return lat.unpatchify(lat.unpack(out, h // 2, w // 2))

    train_guidance: float = 1.0  # distilled guidance fed to guidance-embedding ([dev]) models while training

    def comfy_lora_state(self, denoiser: torch.nn.Module, peft_state: dict[str, torch.Tensor],
                         alpha: float) -> dict[str, torch.Tensor]:
        from tuneline.stages.families.flux2.lora_layout import flux2_comfy_state

        return flux2_comfy_state(peft_state, alpha)

    def prompt_kwargs(self, text: dict[str, torch.Tensor], negative: dict[str, torch.Tensor] | None
                      ) -> dict[str, Any]:
        """Embeds at the cached length, so a "" negative the pipeline encodes itself has the same length."""
        kwargs = super().prompt_kwargs(text, negative)
        kwargs["max_sequence_length"] = text["prompt_embeds"].shape[1]
        return kwargs


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
            patch_size=1, in_channels=4 * self.facts.latent_channels, num_layers=1, num_single_layers=1,
            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=len(KLEIN_LAYERS) * TINY_TEXT_WIDTH,
            timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False)
        # FLUX.2's published scheduler: dynamic (resolution-dependent) shift.
        scheduler = FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
            base_image_seq_len=256, max_image_seq_len=4096)
        pipe = self.pipeline_class(scheduler=scheduler, vae=tiny_vae(self.facts), text_encoder=te, tokenizer=tok,
                                   transformer=transformer, is_distilled=False)
        pipe.save_pretrained(out_dir, safe_serialization=True)

    def check_max_length(self, tokenizers: list[Any], max_length: int) -> None:
        if max_length > self.facts.max_length_limit:
            raise ValueError(f"text.max_length {max_length} exceeds the {self.facts.max_length_limit} tokens family "
                             f"{self.facts.name!r}'s pipeline encodes; lower it or leave it automatic")

    def encode_text(self, enc: TextEncoders, captions: list[str]) -> dict[str, torch.Tensor]:
        """As Flux2KleinPipeline._get_qwen3_prompt_embeds: chat template (thinking off), hidden states 9/18/27 side
        by side at max_length tokens. The transformer sees every position (padding too), as in the pipeline; the
        mask is kept for trainers that mask padding."""
        hidden, mask = qwen_hidden(enc, chat_prompts(enc.tokenizers[0], captions, enable_thinking=False),
                                   KLEIN_LAYERS)
        return {"prompt_embeds": hidden, "prompt_attention_mask": mask}
