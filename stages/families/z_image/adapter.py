"""Z-Image: a Qwen3 language model's second-to-last hidden states (variable length: only the caption's real
tokens), ZImageTransformer2DModel (single-stream DiT, 2x2 patches inside the model) on Flux.1's 16-channel VAE,
flow matching with the scheduler config's shift (Z-Image-Turbo: fixed 3.0)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch

from tuneline.schemas.families import FAMILY_FACTS, FamilyFacts
from tuneline.stages.families.base import MicroCond, TextEncoders
from tuneline.stages.families.common import DiffusersFamily
from tuneline.stages.families.qwen import TINY_TEXT_WIDTH, chat_prompts, qwen_hidden, tiny_qwen3
from tuneline.stages.families.sd3.adapter import flow_vae


def trim(embeds: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """Per-sample embeddings of the real tokens only (Z-Image's transformer takes a list of variable lengths)."""
    return [e[m.bool()] for e, m in zip(embeds, mask.to(embeds.device))]


class ZImageFamily(DiffusersFamily):
    facts: ClassVar[FamilyFacts] = FAMILY_FACTS["z_image"]
    prompt_keys: ClassVar[tuple[str, ...]] = ("prompt_embeds",)
    # Z-Image's blocks, in the main layers and both refiners: attention to_q/k/v/to_out.0 and the SwiGLU
    # feed-forward w1-w3, every linear layer ai-toolkit trains there but the modulation (each maps in ComfyUI).
    lora_target_modules: tuple[str, ...] = (
        *("to_q", "to_k", "to_v", "to_out.0"),
        *("feed_forward.w1", "feed_forward.w2", "feed_forward.w3"),
    )
    # ZImagePipeline with guidance but pre-encoded prompts needs negative embeds: the renderer encodes "" then,
    # which is what the pipeline itself encodes for a missing negative.
    negative_required: ClassVar[bool] = True
    # Its forward runs the refiner stacks, then the main one (a stack its variant lacks is skipped).
    BLOCK_STACKS: ClassVar[tuple[str, ...]] = ("noise_refiner", "context_refiner", "siglip_refiner", "layers")
    text_layers: ClassVar[tuple[int, ...]] = (-2,)

    # ---- tiny flavor -------------------------------------------------------------------------
    def build_tiny(self, out_dir: Path) -> None:
        from diffusers import FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel

        from tuneline.stages.families.qwen import build_qwen_tokenizer

        tok = build_qwen_tokenizer(out_dir / "tokenizer", self.facts.max_length_limit)
        # head dim 32 = sum(axes_dims); one main layer and one refiner layer each, as the released model's shape
        # in miniature (30 main layers, 2 + 2 refiners).
        transformer = ZImageTransformer2DModel(
            all_patch_size=(self.facts.patch_size,),
            all_f_patch_size=(1,),
            in_channels=self.facts.latent_channels,
            dim=64,
            n_layers=1,
            n_refiner_layers=1,
            n_heads=2,
            n_kv_heads=2,
            cap_feat_dim=TINY_TEXT_WIDTH,
            axes_dims=[8, 12, 12],
            axes_lens=[256, 64, 64],
        )
        # Z-Image-Turbo's published scheduler: a fixed shift of 3.0.
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
        pipe = self.pipeline_class(
            scheduler=scheduler,
            vae=flow_vae(self.facts),  # Flux.1's VAE layout, as SD3's
            text_encoder=tiny_qwen3(tok),
            tokenizer=tok,
            transformer=transformer,
        )
        pipe.save_pretrained(out_dir, safe_serialization=True)

    # ---- text --------------------------------------------------------------------------------
    def load_text_encoders(
        self, model_dir: Path, dtype: torch.dtype, device: torch.device, max_length: int | None = None
    ) -> TextEncoders:
        """The pipeline annotates its text encoder as a bare PreTrainedModel: AutoModel reads the folder's class."""
        from transformers import AutoModel, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir, subfolder="tokenizer")
        te = AutoModel.from_pretrained(model_dir, subfolder="text_encoder", dtype=dtype)
        length = max_length or self.facts.max_length
        self.check_max_length([tok], length)
        return TextEncoders(tokenizers=[tok], encoders=[te.to(device).eval().requires_grad_(False)], max_length=length)

    def check_max_length(self, tokenizers: list[Any], max_length: int) -> None:
        self.check_pipeline_length(max_length)

    def encode_text(self, enc: TextEncoders, captions: list[str]) -> dict[str, torch.Tensor]:
        """As ZImagePipeline._encode_prompt: chat template (thinking on), hidden_states[-2] at max_length tokens,
        with the attention mask that marks the real tokens (the pipeline keeps only those)."""
        hidden, mask = qwen_hidden(enc, chat_prompts(enc.tokenizers[0], captions), self.text_layers)
        return {"prompt_embeds": hidden, "prompt_attention_mask": mask}

    # ---- training ----------------------------------------------------------------------------
    def denoise(
        self,
        denoiser: torch.nn.Module,
        noisy: torch.Tensor,
        timesteps: torch.Tensor,
        text: dict[str, torch.Tensor],
        micro: list[MicroCond] | None = None,
    ) -> torch.Tensor:
        """Velocity (noise - x0) for scaled latents (B, 16, H, W).

        Z-Image's transformer takes a list of (C, 1, H, W) latents, the timestep as 1 - sigma (ZImagePipeline passes
        (1000 - t) / 1000) and the captions' real tokens; it predicts x0 - noise, which the pipeline negates."""
        dt, dev = noisy.dtype, noisy.device
        embeds = text["prompt_embeds"].to(device=dev, dtype=dt)
        mask = text.get("prompt_attention_mask")
        caps = trim(embeds, mask) if mask is not None else list(embeds)
        t = 1 - timesteps.to(dev, torch.float32) / 1000
        out = denoiser(list(noisy.unsqueeze(2).unbind(0)), t.to(dt), caps, return_dict=False)[0]
        return -torch.stack(out).squeeze(2)

    def comfy_lora_state(
        self, denoiser: torch.nn.Module, peft_state: dict[str, torch.Tensor], alpha: float
    ) -> dict[str, torch.Tensor]:
        from tuneline.stages.families.z_image.lora_layout import z_image_comfy_state

        return z_image_comfy_state(peft_state, alpha)

    # ---- validation --------------------------------------------------------------------------
    def prompt_kwargs(self, text: dict[str, torch.Tensor], negative: dict[str, torch.Tensor] | None) -> dict[str, Any]:
        """ZImagePipeline takes lists of per-prompt embeddings of the real tokens only."""
        kwargs: dict[str, Any] = {"prompt_embeds": trim(text["prompt_embeds"], text["prompt_attention_mask"])}
        if negative:
            kwargs["negative_prompt_embeds"] = trim(negative["prompt_embeds"], negative["prompt_attention_mask"])
        return kwargs
