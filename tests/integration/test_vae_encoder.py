"""The latents stage's VAE encoder (tuneline.stages.families.vae_encoder, built without importing diffusers) against
diffusers' own AutoencoderKL.encode: the same mean and std for every family's VAE and for layouts no tiny family
has; folders it does not reproduce are loaded through diffusers; a caching process never imports diffusers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tuneline.stages.families.registry import family_names, get_family
from tuneline.stages.families.vae_encoder import VAEEncoder, load

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]


def diffusers_posterior(vae_dir: Path, x: torch.Tensor):
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(vae_dir).eval()
    with torch.no_grad():
        return vae.encode(x).latent_dist


def ours_posterior(vae_dir: Path, x: torch.Tensor):
    enc = load(vae_dir, torch.float32, CPU)
    assert isinstance(enc, VAEEncoder), f"{vae_dir} was not loaded by the lean encoder"
    with torch.no_grad():
        return enc.encode(x).latent_dist


def assert_same(vae_dir: Path, x: torch.Tensor) -> None:
    want, got = diffusers_posterior(vae_dir, x), ours_posterior(vae_dir, x)
    assert got.mean.shape == want.mean.shape and got.std.shape == want.std.shape
    torch.testing.assert_close(got.mean, want.mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.std, want.std, rtol=1e-5, atol=1e-7)


@pytest.fixture(scope="module")
def pixels() -> torch.Tensor:
    return torch.rand(2, 3, 48, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1


@pytest.mark.parametrize("name", family_names())
def test_every_family_vae_encodes_as_diffusers_does(name, tmp_path, pixels):
    folder = get_family(name).ensure_model(None, tmp_path)
    if json.loads((folder / "vae" / "config.json").read_text())["_class_name"] != "AutoencoderKL":
        assert load(folder / "vae", torch.float32, CPU) is None  # another VAE class: diffusers encodes it
        return
    assert_same(folder / "vae", pixels)


@pytest.mark.parametrize(
    "extra",
    [
        dict(layers_per_block=2, block_out_channels=(32, 64), mid_block_add_attention=False),
        dict(layers_per_block=2, block_out_channels=(32, 32, 64), latent_channels=16, use_quant_conv=False),
    ],
)
def test_layouts_beyond_the_tiny_families(extra, tmp_path, pixels):
    from diffusers import AutoencoderKL

    torch.manual_seed(1)
    n = len(extra["block_out_channels"])
    vae = AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
        norm_num_groups=16,
        **extra,
    )
    with torch.no_grad():  # random-init norms are the identity: give them weights, so a swapped one shows
        for m in vae.modules():
            if isinstance(m, torch.nn.GroupNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    vae.save_pretrained(tmp_path / "vae")
    assert_same(tmp_path / "vae", pixels)


def test_folders_it_does_not_reproduce_go_through_diffusers(tmp_path, pixels):
    from diffusers import AutoencoderKL

    folder = get_family("tiny").ensure_model(None, tmp_path / "models")
    fam = get_family("tiny")
    unsupported = tmp_path / "unsupported"
    (unsupported / "vae").mkdir(parents=True)
    vae = AutoencoderKL.from_pretrained(folder / "vae")
    vae.save_pretrained(unsupported / "vae", safe_serialization=False)  # a .bin weights file
    assert load(unsupported / "vae", torch.float32, CPU) is None
    enc = fam.load_vae_encoder(unsupported, torch.float32, CPU)
    assert isinstance(enc, AutoencoderKL) and enc.decoder is None
    with torch.no_grad():
        got = enc.encode(pixels).latent_dist
    want = diffusers_posterior(folder / "vae", pixels)
    torch.testing.assert_close(got.mean, want.mean)

    config = json.loads((folder / "vae" / "config.json").read_text())
    odd = tmp_path / "odd-vae"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({**config, "act_fn": "gelu"}))
    (odd / "diffusion_pytorch_model.safetensors").write_bytes(
        (folder / "vae" / "diffusion_pytorch_model.safetensors").read_bytes()
    )
    assert load(odd, torch.float32, CPU) is None


def test_a_caching_process_does_not_import_diffusers(tmp_path):
    """The point of the lean encoder: a latents run that encodes pays no diffusers import."""
    folder = get_family("tiny").ensure_model(None, tmp_path)
    code = (
        "import sys, torch; from tuneline.stages.families.registry import get_family; "
        f"enc = get_family('tiny').load_vae_encoder({str(folder)!r}, torch.float32, torch.device('cpu')); "
        "enc.encode(torch.zeros(1, 3, 64, 64)); "
        "print(type(enc).__name__, sorted(m for m in sys.modules if m.split('.')[0] in ('diffusers', 'peft')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "VAEEncoder []"
