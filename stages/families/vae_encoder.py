"""The encoder half of a diffusers AutoencoderKL folder, loaded without importing diffusers.

Why: importing diffusers costs a fresh process 3-4 s on a 2-core machine (it pulls torch._dynamo, transformers, peft
and torchao), more than encoding the 1 % of new images a scheduled run finds in a 2,000-image folder
(bench/incremental.py). The latents stage only encodes, so it builds the encoder from the folder's config with the
modules below, which carry diffusers' parameter names: the folder's weights load with a strict key check, and
tests/integration/test_vae_encoder.py holds the output equal to diffusers' `AutoencoderKL.encode` for every family's
VAE. A folder of any other layout (another class or block type, activation, or weight format) gets None from `load`
and is loaded through diffusers (DiffusersFamily.load_vae_encoder).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

WEIGHTS = "diffusion_pytorch_model.safetensors"
EPS = 1e-6  # diffusers' Encoder builds every norm with this eps


class Resnet(nn.Module):
    """diffusers' ResnetBlock2D without a time embedding (dropout is the identity at inference)."""

    def __init__(self, cin: int, cout: int, groups: int):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, cin, eps=EPS)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, cout, eps=EPS)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.conv_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv2(F.silu(self.norm2(self.conv1(F.silu(self.norm1(x))))))
        return (x if self.conv_shortcut is None else self.conv_shortcut(x)) + h


class Downsample(nn.Module):
    """diffusers' Downsample2D with padding 0: pad right and bottom by one, 3x3 convolution of stride 2."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class DownBlock(nn.Module):
    def __init__(self, cin: int, cout: int, layers: int, groups: int, downsample: bool):
        super().__init__()
        self.resnets = nn.ModuleList(Resnet(cin if i == 0 else cout, cout, groups) for i in range(layers))
        self.downsamplers = nn.ModuleList([Downsample(cout)]) if downsample else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        return self.downsamplers[0](x) if self.downsamplers is not None else x


class Attention(nn.Module):
    """The VAE's single-head spatial self-attention (diffusers' Attention with group norm and a residual)."""

    def __init__(self, channels: int, groups: int):
        super().__init__()
        self.group_norm = nn.GroupNorm(groups, channels, eps=EPS)
        self.to_q, self.to_k, self.to_v = (nn.Linear(channels, channels) for _ in range(3))
        self.to_out = nn.ModuleList([nn.Linear(channels, channels)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        t = self.group_norm(x.view(b, c, h * w)).transpose(1, 2)
        q, k, v = (proj(t).view(b, 1, h * w, c) for proj in (self.to_q, self.to_k, self.to_v))
        out = self.to_out[0](F.scaled_dot_product_attention(q, k, v).reshape(b, h * w, c))
        return out.transpose(1, 2).reshape(b, c, h, w) + x


class MidBlock(nn.Module):
    def __init__(self, channels: int, groups: int, attention: bool):
        super().__init__()
        self.resnets = nn.ModuleList(Resnet(channels, channels, groups) for _ in range(2))
        self.attentions = nn.ModuleList([Attention(channels, groups)]) if attention else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.resnets[0](x)
        if self.attentions is not None:
            x = self.attentions[0](x)
        return self.resnets[1](x)


class Encoder(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        widths, groups, layers = cfg["block_out_channels"], cfg["norm_num_groups"], cfg["layers_per_block"]
        self.conv_in = nn.Conv2d(cfg["in_channels"], widths[0], 3, padding=1)
        self.down_blocks = nn.ModuleList(
            DownBlock(widths[max(i - 1, 0)], w, layers, groups, downsample=i < len(widths) - 1)
            for i, w in enumerate(widths)
        )
        self.mid_block = MidBlock(widths[-1], groups, cfg.get("mid_block_add_attention", True))
        self.conv_norm_out = nn.GroupNorm(groups, widths[-1], eps=EPS)
        self.conv_out = nn.Conv2d(widths[-1], 2 * cfg["latent_channels"], 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        return self.conv_out(F.silu(self.conv_norm_out(self.mid_block(x))))


@dataclass
class Posterior:
    """The diagonal Gaussian q(z|x), as diffusers' DiagonalGaussianDistribution computes mean and std."""

    mean: torch.Tensor
    std: torch.Tensor


@dataclass
class Encoded:
    latent_dist: Posterior  # the attribute diffusers' encode output carries


class VAEEncoder(nn.Module):
    """AutoencoderKL's encode path: `encode(x).latent_dist.mean / .std`, `config`, `dtype`, as diffusers has them."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.config = SimpleNamespace(**cfg)
        self.encoder = Encoder(cfg)
        c = 2 * cfg["latent_channels"]
        self.quant_conv = nn.Conv2d(c, c, 1) if cfg.get("use_quant_conv", True) else None

    @property
    def dtype(self) -> torch.dtype:
        return self.encoder.conv_in.weight.dtype

    def encode(self, x: torch.Tensor) -> Encoded:
        moments = self.encoder(x)
        if self.quant_conv is not None:
            moments = self.quant_conv(moments)
        mean, logvar = torch.chunk(moments, 2, dim=1)
        return Encoded(Posterior(mean, torch.exp(0.5 * torch.clamp(logvar, -30.0, 20.0))))


def supported(cfg: dict) -> bool:
    """The AutoencoderKL layout these modules reproduce (every shipped and tiny family VAE has it)."""
    widths = cfg.get("block_out_channels", ())
    return (
        cfg.get("_class_name") == "AutoencoderKL"
        and cfg.get("act_fn", "silu") == "silu"
        and cfg.get("double_z", True)
        and len(widths) > 0
        and list(cfg.get("down_block_types", ())) == ["DownEncoderBlock2D"] * len(widths)
        and all(w % cfg.get("norm_num_groups", 32) == 0 for w in widths)
    )


def load(vae_dir: Path, dtype: torch.dtype, device: torch.device) -> VAEEncoder | None:
    """The folder's encoder in eval mode without gradients, or None when its layout or weights are not the plain
    AutoencoderKL safetensors layout (the caller then loads it through diffusers)."""
    from safetensors import safe_open

    cfg_file, weights = vae_dir / "config.json", vae_dir / WEIGHTS
    if not (cfg_file.is_file() and weights.is_file()):
        return None
    cfg = {
        "in_channels": 3,
        "latent_channels": 4,
        "layers_per_block": 1,
        "norm_num_groups": 32,
        **json.loads(cfg_file.read_text()),
    }
    if not supported(cfg):
        return None
    with torch.device("meta"):
        model = VAEEncoder(cfg)
    wanted = set(model.state_dict())
    with safe_open(str(weights), framework="pt", device="cpu") as f:
        present = {k for k in f.keys() if k.startswith(("encoder.", "quant_conv."))}
        if present != wanted:  # e.g. the attention's pre-0.14 names, which diffusers renames on load
            return None
        state = {k: f.get_tensor(k).to(dtype) for k in wanted}
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device).eval().requires_grad_(False)
