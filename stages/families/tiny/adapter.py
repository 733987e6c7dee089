"""The demo's family: SD1.5's architecture at a size that trains in seconds on a CPU.

Only the facts (16-token captions, the VAE's scaling factor), the tiny configs and a pretrained VAE differ from
SD1.5; every behaviour is SD15Family's. The VAE's weights ship in the package (assets/demo_vae.safetensors, made by
infra/demo_vae/train_demo_vae.py on the demo's shape domain), so demo renders show the prompted colors and shapes;
the text encoder and UNet stay random-init.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import torch

from tuneline.schemas.demo import DEMO_COLORS, RGB
from tuneline.schemas.families import FAMILY_FACTS, FamilyFacts
from tuneline.stages.families.sd15.adapter import SD15Family, tiny_vae

# log-variance of the posterior: std e^-6, so sampled latents carry the image, not the VAE's noise (a trained SD
# VAE's posterior is as narrow). The pretraining script pins it too; set again here so the rule lives in one place.
POSTERIOR_LOGVAR = -12.0
DEMO_VAE_FILE = Path(__file__).resolve().parent / "assets" / "demo_vae.safetensors"


def demo_vae_weights() -> tuple[dict[str, torch.Tensor], dict]:
    """(state dict, facts the pretraining script recorded: scaling_factor, steps, ...) of the shipped demo VAE."""
    from safetensors import safe_open

    if not DEMO_VAE_FILE.is_file():
        raise FileNotFoundError(
            f"{DEMO_VAE_FILE}: the demo VAE's weights are missing from the installed package; "
            f"reinstall tuneline, or regenerate them with "
            f"`python infra/demo_vae/train_demo_vae.py` from a checkout"
        )
    with safe_open(str(DEMO_VAE_FILE), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, json.loads((f.metadata() or {}).get("demo_vae", "{}"))


def demo_pictures() -> torch.Tensor:
    """A shape in each demo color on a grey ground, (colors, 3, 64, 64) in [-1, 1]: what a tiny flavor measures its
    latent statistics on, the way released scales and shifts were measured on the images the model is for."""
    pictures = torch.full((len(DEMO_COLORS), 3, 64, 64), 220 / 127.5 - 1)
    for i, color in enumerate(DEMO_COLORS):
        pictures[i, :, 12:52, 12:52] = torch.tensor(RGB[color]).view(3, 1, 1) / 127.5 - 1
    return pictures


def demo_vae_widened_state(latent_channels: int) -> dict[str, torch.Tensor]:
    """The demo VAE's weights for `latent_channels` latents (a multiple of 4) without quant convolutions: they are
    folded into the encoder's last and the decoder's first convolution, each of the 4 latent channels is repeated,
    and the decoder averages the copies. It decodes the demo's shapes as the 4-channel VAE does (the folded decoder
    bias differs only in the zero-padded border)."""
    state, _ = demo_vae_weights()
    k, c = divmod(latent_channels, 4)
    if c:
        raise ValueError(f"the demo VAE widens to a multiple of 4 latent channels, not {latent_channels}")
    quant, quant_bias = state.pop("quant_conv.weight")[:4, :, 0, 0], state.pop("quant_conv.bias")[:4]
    post, post_bias = state.pop("post_quant_conv.weight")[:, :, 0, 0], state.pop("post_quant_conv.bias")
    enc_w = torch.einsum("oc,cikl->oikl", quant, state["encoder.conv_out.weight"])
    enc_b = quant @ state["encoder.conv_out.bias"] + quant_bias
    dec_w = state["decoder.conv_in.weight"]
    state["decoder.conv_in.bias"] = state["decoder.conv_in.bias"] + torch.einsum("ockl,c->o", dec_w, post_bias)
    state["decoder.conv_in.weight"] = torch.einsum("ockl,ci->oikl", dec_w, post).repeat(1, k, 1, 1) / k
    state["encoder.conv_out.weight"] = torch.cat([enc_w.repeat(k, 1, 1, 1), torch.zeros_like(enc_w).repeat(k, 1, 1, 1)])
    state["encoder.conv_out.bias"] = torch.cat([enc_b.repeat(k), torch.full((k * 4,), POSTERIOR_LOGVAR)])
    return state


def demo_vae_widened(facts: FamilyFacts):
    """The demo VAE (demo_vae_widened_state) as an AutoencoderKL of the SD3 / Flux layout (no quant convolutions)."""
    vae = tiny_vae(
        facts.latent_channels, facts, shift_factor=facts.shift_factor, use_quant_conv=False, use_post_quant_conv=False
    )
    vae.load_state_dict(demo_vae_widened_state(facts.latent_channels), strict=True)
    return vae


class TinyFamily(SD15Family):
    facts: ClassVar[FamilyFacts] = FAMILY_FACTS["tiny"]
    # Demo captions are a handful of words; 16 positions keep text caches and cross-attention small.
    tiny_text_length: ClassVar[int] = FAMILY_FACTS["tiny"].max_length
    # An adapter here trains on a random-init UNet, not a pretrained one, so it must reach every layer (convolutions,
    # feed-forwards, time embedding: LyCORIS's "full" preset), or the demo cannot learn at all: measured on the
    # demo with attention projections only, LoRA reached color_accuracy 0.31 and LoKr 0.375 (untrained 0.28);
    # with every layer, LoKr 0.84 at the same settings. (Real families keep the attention projections that
    # pretrained models are tuned through.)
    lora_target_modules: ClassVar[tuple[str, ...]] = (
        *("to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2"),
        *("conv1", "conv2", "conv_shortcut", "time_emb_proj", "conv_in", "conv_out", "linear_1", "linear_2", "conv"),
    )

    def tiny_vae(self):
        """The pretrained demo VAE. Its scaling factor (1 / std of the demo's latent means, measured by the
        pretraining script) goes into the VAE config, which wins at run time; the facts carry the same number
        (tests/unit/test_demo_vae.py checks they agree)."""
        state, meta = demo_vae_weights()
        vae = tiny_vae(4, self.facts)
        vae.load_state_dict(state, strict=True)
        vae.register_to_config(scaling_factor=float(meta.get("scaling_factor", self.facts.scaling_factor)))
        c = vae.config.latent_channels
        with torch.no_grad():
            vae.quant_conv.weight[c:] = 0
            vae.quant_conv.bias[c:] = POSTERIOR_LOGVAR
        return vae
