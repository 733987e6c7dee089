"""The demo's pretrained VAE: shipped in the package, its scaling factor agreeing with the tiny facts, and good
enough that decoded demo images keep their shape's color; the pixel check's dominant-color rule."""

from __future__ import annotations

import random
import tomllib
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

from tuneline.schemas.demo import DEMO_COLORS, DEMO_SHAPES
from tuneline.schemas.families import FAMILY_FACTS
from tuneline.stages.families.registry import get_family
from tuneline.stages.families.tiny.adapter import DEMO_VAE_FILE, POSTERIOR_LOGVAR, demo_vae_weights
from tuneline.stages.scan.demo import RGB, _draw
from tuneline.stages.validate.colors import color_accuracy, dominant_color

ROOT = Path(__file__).resolve().parents[2]


def test_weights_ship_in_the_package_and_are_small():
    assert DEMO_VAE_FILE.is_file() and DEMO_VAE_FILE.stat().st_size <= 2 * 1024 * 1024
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    rel = DEMO_VAE_FILE.relative_to(ROOT / "stages" / "families" / "tiny")
    patterns = package_data.get("tuneline.stages.families.tiny", []) + package_data["*"]
    assert any(rel.match(p) for p in patterns), package_data


def test_scaling_factor_agrees_between_file_vae_config_and_facts():
    _, meta = demo_vae_weights()
    vae = get_family("tiny").tiny_vae()
    assert float(meta["scaling_factor"]) == vae.config.scaling_factor == FAMILY_FACTS["tiny"].scaling_factor
    c = vae.config.latent_channels
    assert torch.all(vae.quant_conv.bias[c:] == POSTERIOR_LOGVAR)


def test_pretrained_vae_reconstructs_the_demo_colors():
    vae = get_family("tiny").tiny_vae().eval()
    rng = random.Random(7)
    drawn = [(c, _draw(c, s, (64, 64), rng)) for c in DEMO_COLORS for s in DEMO_SHAPES]
    x = torch.from_numpy(np.stack([np.asarray(img, np.float32) for _, img in drawn]) / 127.5 - 1).permute(0, 3, 1, 2)
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mean
        y = vae.decode(z).sample.clamp(-1, 1)
    assert torch.nn.functional.mse_loss(y, x).item() < 0.02
    # The scaling factor gives the demo's scaled latents about unit std, as the denoiser's noise expects.
    assert 0.7 < (z * vae.config.scaling_factor).std().item() < 1.4
    images = [Image.fromarray(((t.permute(1, 2, 0).numpy() + 1) * 127.5).round().astype(np.uint8)) for t in y]
    assert color_accuracy(images, [c for c, _ in drawn]) == 1.0
    random_vae = get_family("sd15").tiny_vae().eval()
    with torch.no_grad():
        noise = random_vae.decode(random_vae.encode(x).latent_dist.mean).sample
    assert torch.nn.functional.mse_loss(noise, x).item() > 0.1  # the bar above is not met by any VAE


def _shape_on_grey(rgb: tuple[int, int, int], grey: int = 220) -> Image.Image:
    img = Image.new("RGB", (64, 64), (grey, grey, grey))
    ImageDraw.Draw(img).ellipse((10, 10, 50, 50), fill=rgb)
    return img


def test_dominant_color_is_the_shapes_palette_color():
    for color in DEMO_COLORS:
        assert dominant_color(_shape_on_grey(RGB[color])) == color
    assert dominant_color(_shape_on_grey((200, 40, 60))) == "red"  # a shade off the palette: still nearest red
    assert dominant_color(Image.new("RGB", (64, 64), (128, 128, 128))) is None  # no color at all: a miss
    # A faintly tinted background does not count; a small saturated shape on it does.
    img = Image.new("RGB", (64, 64), (175, 215, 175))
    ImageDraw.Draw(img).rectangle((0, 0, 5, 5), fill=RGB["blue"])
    assert dominant_color(img) == "blue"


def test_color_accuracy_counts_prompted_colors():
    images = [_shape_on_grey(RGB["red"]), _shape_on_grey(RGB["blue"]), Image.new("RGB", (8, 8), (90, 90, 90))]
    assert color_accuracy(images, ["red", "red", "green"]) == 1 / 3


def test_pretraining_script_is_byte_reproducible(tmp_path):
    """Two short runs of the script give identical files (what makes the shipped weights reproducible)."""
    import subprocess
    import sys

    outs = [tmp_path / f"vae{i}.safetensors" for i in range(2)]
    for out in outs:
        done = subprocess.run(
            [sys.executable, str(ROOT / "infra" / "demo_vae" / "train_demo_vae.py"), "--steps", "3", "--out", str(out)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-3000:]
    assert outs[0].read_bytes() == outs[1].read_bytes()
    _, info = demo_vae_weights()
    assert info["steps"] >= 1000 and info["demo_mse"] < 0.02  # the shipped file is a full run, not a short one
