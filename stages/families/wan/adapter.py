"""Wan 2.1 text-to-video (T2V 1.3B / 14B): UMT5's last hidden states (the caption's real tokens, zeros after them),
WanTransformer3DModel (1x2x2 patches, 3D rotary positions) on the 16-channel latents of AutoencoderKLWan (8x
spatial, 4x temporal: a clip of 4k+1 frames has k+1 latent frames), normalised per channel; flow matching with the
scheduler's fixed shift.

Cached latents keep the (C, H, W) rows every stage stores, reads and scales: a clip's T latent frames are stacked
along H, (C, T, h, w) -> (C, T*h, w) (`fold`), and `denoise` unstacks them with the bucket height it is given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch

from tuneline.schemas.demo import (
    DEMO_COLORS,
    RGB,
    VIDEO_BACKGROUND,
    VIDEO_DIRECTIONS,
    VIDEO_EDGE,
    VIDEO_FRAMES,
    VIDEO_SIZE,
    VIDEO_TRAVEL,
)
from tuneline.schemas.families import FAMILY_FACTS, FamilyFacts
from tuneline.stages.families.base import MicroCond, TextEncoders
from tuneline.stages.families.common import DiffusersFamily, module_device
from tuneline.stages.families.vocab import build_t5_tokenizer

Tensor = torch.Tensor
Micro = list[MicroCond] | None

TINY_TEXT_WIDTH = 32
# The released T2V checkpoints' scheduler (UniPC, flow_shift 3.0 at 480p): training draws flow-matching noise
# levels with the same shift.
DEFAULT_SHIFT = 3.0


def fold(x: torch.Tensor) -> torch.Tensor:
    """(B, C, T, h, w) -> (B, C, T*h, w): a clip's latent frames stacked along the height."""
    b, c, t, h, w = x.shape
    return x.reshape(b, c, t * h, w)


def unfold(x: torch.Tensor, h: int) -> torch.Tensor:
    """(B, C, T*h, w) -> (B, C, T, h, w), the inverse of `fold` for latent frames `h` high."""
    b, c, th, w = x.shape
    if th % h:
        raise ValueError(f"latents {th} high do not stack frames of {h} latent rows: the cache and the bucket disagree")
    return x.reshape(b, c, th // h, h, w)


class _ClipEncoder(torch.nn.Module):
    """The video VAE's encoder for clips (B, 3, F, H, W) and still images (B, 3, H, W, one frame): a posterior over
    folded latents (B, C, T*h, w)."""

    def __init__(self, vae: torch.nn.Module):
        super().__init__()
        self.vae = vae

    @property
    def config(self) -> Any:
        return self.vae.config

    @property
    def dtype(self) -> torch.dtype:
        return self.vae.dtype

    def encode(self, x: torch.Tensor):
        out = self.vae.encode(x.unsqueeze(2) if x.ndim == 4 else x)
        dist = out.latent_dist
        dist.mean, dist.std, dist.var, dist.logvar = (fold(t) for t in (dist.mean, dist.std, dist.var, dist.logvar))
        dist.parameters = fold(dist.parameters)
        return out


def tiny_umt5(tokenizer: Any, d_model: int):
    """The tiny T5 encoder's layout (SD3's) as UMT5, Wan's text encoder (umt5-xxl in the released models)."""
    from transformers import UMT5Config, UMT5EncoderModel

    from tuneline.stages.families.sd3.adapter import tiny_t5

    config = tiny_t5(tokenizer, d_model).config.to_dict()
    return UMT5EncoderModel(UMT5Config(**{k: v for k, v in config.items() if k != "model_type"}))


def demo_clips() -> torch.Tensor:
    """A square in each demo color crossing a dark ground, one clip per direction of the video demo
    (schemas/demo.py), (4, 3, frames, 64, 64) in [-1, 1]: what the tiny flavor measures its latent statistics on,
    the way released ones were measured on the videos the model is for."""
    size, edge, travel, frames = VIDEO_SIZE, VIDEO_EDGE, VIDEO_TRAVEL, VIDEO_FRAMES
    clips = torch.full((len(VIDEO_DIRECTIONS), 3, frames, size, size), sum(VIDEO_BACKGROUND) / 2)
    start = (size - edge - travel) // 2
    for i, (dx, dy) in enumerate(VIDEO_DIRECTIONS.values()):
        for f in range(frames):
            shift = round(travel * f / (frames - 1))
            x = (start + (travel if dx < 0 else 0) + dx * shift) if dx else (size - edge) // 2
            y = (start + (travel if dy < 0 else 0) + dy * shift) if dy else (size - edge) // 2
            clips[i, :, f, y : y + edge, x : x + edge] = torch.tensor(RGB[DEMO_COLORS[i]], dtype=torch.float32).view(
                3, 1, 1
            )
    return clips / 127.5 - 1


def demo_latent_stats(vae: torch.nn.Module) -> dict[str, list[float]]:
    """Per-channel latents_mean / latents_std of a random-init VAE, measured on the video demo's clips. The released
    ones were measured on the released VAE; on random weights they leave the demo's four directions of motion about
    a hundredth of the noise apart, and the video demo learns nothing. Measured the same way on clips of the demo's
    domain, they are about a tenth of it apart."""
    with torch.no_grad():
        latents = vae.encode(demo_clips()).latent_dist.mean
    return {
        "latents_mean": latents.mean(dim=(0, 2, 3, 4)).tolist(),
        "latents_std": latents.std(dim=(0, 2, 3, 4)).tolist(),
    }


class WanFamily(DiffusersFamily):
    facts: ClassVar[FamilyFacts] = FAMILY_FACTS["wan"]
    # Every linear layer of the blocks' self- and cross-attention and feed-forward: musubi-tuner's and
    # ai-toolkit's Wan LoRA (self_attn/cross_attn q, k, v, o and ffn.0, ffn.2 in ComfyUI's names).
    lora_target_modules: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2")
    BLOCK_STACKS: ClassVar[tuple[str, ...]] = ("blocks",)

    # ---- tiny flavor -------------------------------------------------------------------------
    def build_tiny(self, out_dir: Path) -> None:
        self.pipeline_class(**self.tiny_components(out_dir)).save_pretrained(out_dir, safe_serialization=True)

    def tiny_components(self, out_dir: Path) -> dict[str, Any]:
        """The tiny pipeline's components (its tokenizer built into out_dir/tokenizer)."""
        from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler

        tok = build_t5_tokenizer(out_dir / "tokenizer", self.facts.max_length_limit)
        # Built in this order (transformer, VAE, text encoder): the seeded weights stay the ones the flavor had.
        transformer = self.tiny_transformer()
        # Released Wan's layout (4x temporal downsampling in the last two levels), 8 channels wide.
        vae = AutoencoderKLWan(base_dim=8, z_dim=self.facts.latent_channels, dim_mult=[1, 2, 2, 2], num_res_blocks=1)
        vae.register_to_config(**demo_latent_stats(vae))
        return {
            "tokenizer": tok,
            "transformer": transformer,
            "vae": vae,
            "text_encoder": tiny_umt5(tok, TINY_TEXT_WIDTH),
            "scheduler": FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=DEFAULT_SHIFT),
        }

    def tiny_transformer(self) -> torch.nn.Module:
        from diffusers import WanTransformer3DModel

        # head dim 24: Wan's rotary embedding splits it into time (8), height (8) and width (8) parts.
        return WanTransformer3DModel(
            patch_size=(1, self.facts.patch_size, self.facts.patch_size),
            num_attention_heads=2,
            in_channels=self.facts.latent_channels,
            attention_head_dim=24,
            out_channels=self.facts.latent_channels,
            num_layers=2,
            text_dim=TINY_TEXT_WIDTH,
            freq_dim=32,
            ffn_dim=64,
            rope_max_seq_len=64,
        )

    # ---- latents -----------------------------------------------------------------------------
    def latent_stats(self, vae: torch.nn.Module) -> tuple[list[float], list[float]]:
        """Per-channel (mean, std) WanPipeline normalises latents with: z_model = (z - mean) / std."""
        return list(vae.config.latents_mean), list(vae.config.latents_std)

    def load_vae(self, model_dir: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
        from diffusers import AutoencoderKLWan

        return AutoencoderKLWan.from_pretrained(model_dir, subfolder="vae", dtype=dtype).to(device).eval()

    def load_vae_encoder(self, model_dir: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
        # The whole VAE: its encode clears a feature cache whose size it counts over the decoder's convolutions.
        return _ClipEncoder(self.load_vae(model_dir, dtype, device).requires_grad_(False))

    def load_noise_scheduler(self, model_dir: Path) -> Any:
        """Flow matching with the folder's shift: a released folder's UniPC scheduler names it `flow_shift`."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        config = FlowMatchEulerDiscreteScheduler.load_config(model_dir, subfolder="scheduler")
        shift = config.get("flow_shift") or config.get("shift") or DEFAULT_SHIFT
        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=float(shift))

    # ---- text --------------------------------------------------------------------------------
    def check_max_length(self, tokenizers: list[Any], max_length: int) -> None:
        self.check_pipeline_length(max_length)

    def encode_text(self, enc: TextEncoders, captions: list[str]) -> dict[str, torch.Tensor]:
        """As WanPipeline._get_t5_prompt_embeds: cleaned captions, the last hidden state of the real tokens, zeros
        after them up to max_length."""
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        tok, te = enc.tokenizers[0], enc.encoders[0]
        out = tok(
            [prompt_clean(c) for c in captions],
            padding="max_length",
            max_length=enc.max_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        dev = module_device(te)
        mask = out.attention_mask.to(dev)
        with torch.no_grad():
            hidden = te(out.input_ids.to(dev), mask).last_hidden_state
        return {"prompt_embeds": hidden * mask.unsqueeze(-1).to(hidden.dtype)}

    # ---- validation --------------------------------------------------------------------------
    # In-training renders and the learning check take one-frame clips (an image, compared as one); the validate
    # stage renders whole clips with num_frames (stages/validate/clips.py) and reads output.frames itself.
    render_kwargs: ClassVar[dict[str, Any]] = {"num_frames": 1}

    def rendered(self, output: Any) -> Any:
        """WanPipelineOutput.frames: (B, F, H, W, 3) pictures (numpy), or with output_type latent the (B, C, T, h, w)
        latents (a tensor, left to rendered_latents)."""
        frames = output.frames
        return frames if isinstance(frames, torch.Tensor) else frames[:, 0]

    def rendered_latents(self, latents: torch.Tensor, width: int, height: int, vae: Any) -> torch.Tensor:
        return fold(latents)

    # ---- training ----------------------------------------------------------------------------
    def denoise(
        self, denoiser: torch.nn.Module, noisy: Tensor, timesteps: Tensor, text: dict[str, Tensor], micro: Micro = None
    ) -> Tensor:
        """Velocity (noise - x0) for folded latents (B, 16, T*h, w); the bucket's pixel height (micro's target size,
        the same for a whole batch) gives h. Wan takes the timestep in [0, 1000) as the pipeline passes it."""
        h = micro[0].target_size[0] // self.facts.vae_factor if micro else noisy.shape[2]
        embeds = text["prompt_embeds"].to(noisy.device, noisy.dtype)
        out = denoiser(unfold(noisy, h), timesteps.to(noisy.device), embeds, return_dict=False)[0]
        return fold(out)
