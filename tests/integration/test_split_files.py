"""The files ComfyUI distributes for the transformer families: a transformer-only `diffusion_models/` file (original
key names under `model.diffusion_model.`, scaled fp8) as model.path, with the text encoder and VAE as separate files
(model.text_encoder_path, model.vae_path) over a weightless model.config folder. Each loads dequantized (the weights
within fp8 rounding of those they came from, exactly the file's fp8 values times their scales), a stage runs on the
assembled model, and a transformer of another family is refused naming the family it looks like."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from tests.integration import comfy_layout
from tuneline.schemas.config import parse_config
from tuneline.schemas.latents import LatentsManifest
from tuneline.stages.common.stage import StageContext, run_stage
from tuneline.stages.families.fp8 import upcast
from tuneline.stages.families.registry import get_family
from tuneline.stages.pipeline import PIPELINE, stages_for

CPU = torch.device("cpu")
LAYOUTS = {
    "qwen_image": comfy_layout.qwen_image,
    "z_image": comfy_layout.z_image,
    "flux2": comfy_layout.flux2,
    "flux2_klein": comfy_layout.flux2,
}


def _weightless(model_dir: Path, out: Path) -> Path:
    """A copy of a diffusers folder without any weights (configs, tokenizers, scheduler only)."""
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    return out


def _denoiser_state(fam, model_dir: Path) -> dict[str, torch.Tensor]:
    den = fam.load_denoiser(model_dir, torch.float32, CPU)
    return {k: v.detach().clone() for k, v in den.state_dict().items()}


def _assert_fp8_close(loaded: dict[str, torch.Tensor], orig: dict[str, torch.Tensor]) -> None:
    assert set(loaded) == set(orig)
    rounded = 0
    for k, want in orig.items():
        got = loaded[k].float()
        # e4m3 keeps 3 mantissa bits (relative error <= 2^-4); values near zero round to the scale's subnormals
        bound = 2**-4 * want.abs() + want.abs().max() * 2**-12 + 1e-8
        assert ((got - want).abs() <= bound).all(), k
        rounded += not torch.equal(got, want)
    assert rounded > len(orig) // 4, "the 2-D weights went through fp8"


@pytest.mark.parametrize("family", list(LAYOUTS))
def test_scaled_fp8_transformer_file_loads_dequantized(family, tmp_path):
    fam = get_family(family)
    tiny = fam.ensure_model(None, tmp_path / "models")
    orig = _denoiser_state(fam, tiny)
    file_sd = comfy_layout.scaled_fp8(LAYOUTS[family](orig))
    file = tmp_path / f"{family}_fp8_scaled.safetensors"
    save_file(file_sd, str(file))
    config = _weightless(tiny, tmp_path / "config")
    # only the transformer's weights are missing there: keep the others
    for comp in ("vae", *fam.text_components):
        shutil.rmtree(config / comp)
        shutil.copytree(tiny / comp, config / comp)
    out = fam.ensure_model(str(file), tmp_path / "cache", str(config))
    loaded = _denoiser_state(fam, out)
    _assert_fp8_close(loaded, orig)
    # exactly the file's fp8 values times their scales (diffusers' converter only renames and splits)
    again = fam.ensure_model(str(file), tmp_path / "cache", str(config))
    assert again == out, "converted once, then reused"
    exact = comfy_layout.dequantized(file_sd)
    layout_of_loaded = LAYOUTS[family](loaded)
    assert all(torch.equal(layout_of_loaded[k].float(), v.float()) for k, v in exact.items())


def test_fp8_formats_dequantize_with_their_scales():
    w = torch.randn(6, 4)
    q = (w / 0.01).to(torch.float8_e4m3fn)
    row = torch.full((6,), 0.01)
    new = {"a.weight": q, "a.weight_scale": row, "a.input_scale": torch.ones(()), "b.weight": q}
    got = upcast(new, {"_quantization_metadata": '{"layers": {"a": {"format": "float8_e4m3fn"}}}'}, "f")
    assert torch.equal(got["a.weight"], q.float() * 0.01) and set(got) == {"a.weight", "b.weight"}
    assert torch.equal(got["b.weight"], q.float()), "plain fp8: upcast only"
    with pytest.raises(ValueError, match="nvfp4"):
        upcast(new, {"_quantization_metadata": '{"layers": {"a": {"format": "nvfp4"}}}'}, "f")


def test_transformer_of_another_family_is_refused(tmp_path):
    flux2 = get_family("flux2_klein")
    sd = comfy_layout.flux2(_denoiser_state(flux2, flux2.ensure_model(None, tmp_path / "models")))
    file = tmp_path / "flux2_transformer.safetensors"
    save_file({comfy_layout.PREFIX + k: v for k, v in sd.items()}, str(file))
    qwen = get_family("qwen_image")
    config = _weightless(qwen.ensure_model(None, tmp_path / "models"), tmp_path / "config")
    with pytest.raises(ValueError, match="is a flux2 transformer file.*model.family is qwen_image"):
        qwen.ensure_model(str(file), tmp_path / "cache", str(config))


def _vae_file(fam, vae) -> dict[str, torch.Tensor]:
    """The VAE's file: Qwen-Image's in diffusers names; Z-Image's is FLUX.1's `ae.safetensors` (original layout)."""
    sd = vae.state_dict()
    if fam.facts.name == "qwen_image":
        return {k: v.to(torch.bfloat16) for k, v in sd.items()}
    from tuneline.stages.families.sd15.single_file import vae_name

    levels = len(vae.config.block_out_channels)
    out = {vae_name(k, levels): v.to(torch.bfloat16) for k, v in sd.items()}
    assert None not in out
    return {k: v[:, :, None, None] if ".mid.attn_1." in k and v.ndim == 2 else v for k, v in out.items()}


@pytest.mark.parametrize("family", ["qwen_image", "z_image"])
def test_split_files_run_a_stage(family, tmp_path):
    """Transformer (scaled fp8, ComfyUI's layout), text encoder (plain fp8; Z-Image's as ComfyUI's
    `qwen_3_4b.safetensors`: a causal LM's `model.` names) and VAE (bf16) as three files over a weightless config:
    scan, latents and text run on the assembled model."""
    fam = get_family(family)
    tiny = fam.ensure_model(None, tmp_path / "models")
    files = tmp_path / "comfy"
    files.mkdir()
    dm = comfy_layout.scaled_fp8(LAYOUTS[family](_denoiser_state(fam, tiny)))
    save_file(dm, str(files / "diffusion_model_fp8.safetensors"))
    te = fam.load_text_encoders(tiny, torch.float32, CPU).encoders[0]
    te_sd = {k: v.to(torch.float8_e4m3fn) if v.dim() == 2 else v for k, v in te.state_dict().items()}
    prefix = "model." if family == "z_image" else ""
    save_file({prefix + k: v.contiguous() for k, v in te_sd.items()}, str(files / "text_encoder_fp8.safetensors"))
    vae = fam.load_vae(tiny, torch.float32, CPU)
    save_file(_vae_file(fam, vae), str(files / "vae.safetensors"))
    config = _weightless(tiny, tmp_path / "config")

    (tmp_path / "data").mkdir()
    for i in range(2):
        Image.new("RGB", (64, 64), (90 * i, 140, 200)).save(tmp_path / "data" / f"{i}.png")
        (tmp_path / "data" / f"{i}.txt").write_text(f"a square {i}", encoding="utf-8")
    cfg = parse_config(
        {
            "dataset": {"path": str(tmp_path / "data")},
            "model": {
                "family": family,
                "path": str(files / "diffusion_model_fp8.safetensors"),
                "text_encoder_path": str(files / "text_encoder_fp8.safetensors"),
                "vae_path": str(files / "vae.safetensors"),
                "config": str(config),
                "device": "cpu",
            },
            "buckets": {"resolution": 64},
            "text": {"max_length": 16},
        },
        workdir=str(tmp_path / "work"),
    )
    ctx = StageContext(cfg)
    paths = {}
    for sd in stages_for(cfg):
        if sd.name in ("scan", "latents", "text"):
            paths[sd.name] = run_stage(ctx, sd, PIPELINE)[0]
    assert ctx.store.read(paths["latents"], LatentsManifest).count == 2
    from tuneline.stages.families import resolve

    assembled = resolve.model_dir(ctx)
    got_te = fam.load_text_encoders(assembled, torch.float32, CPU).encoders[0].state_dict()
    assert got_te.keys() == te.state_dict().keys()
    assert all(torch.equal(got_te[k].float(), v.float()) for k, v in te_sd.items())
    got_vae = fam.load_vae(assembled, torch.float32, CPU).state_dict()
    assert all(torch.equal(got_vae[k], v.to(torch.bfloat16).float()) for k, v in vae.state_dict().items())
    got_den = _denoiser_state(fam, assembled)
    assert all(torch.equal(LAYOUTS[family](got_den)[k].float(), v) for k, v in comfy_layout.dequantized(dm).items())


@pytest.mark.parametrize("name", ["qwen_image", "z_image", "flux2", "flux2_klein"])
def test_shipped_config_checks_a_transformer_files_shapes(name, tmp_path):
    from tuneline.stages.families.shipped import SIGNATURES, resolve_config, shipped_dir

    fits = tmp_path / "fits.safetensors"
    save_file(
        {comfy_layout.PREFIX + k: torch.zeros(s, dtype=torch.float8_e4m3fn) for k, s in SIGNATURES[name].items()},
        str(fits),
    )
    assert resolve_config(name, fits, None) == (str(shipped_dir(name)), True)
    fam = get_family(name)
    tiny = tmp_path / "tiny.safetensors"
    save_file(LAYOUTS[name](_denoiser_state(fam, fam.ensure_model(None, tmp_path / "models"))), str(tiny))
    with pytest.raises(ValueError, match=f"model.config: null uses the shipped {name} config.*does not fit"):
        fam.ensure_model(str(tiny), tmp_path / "cache", None)


def test_qwen_image_vae_in_wans_original_layout(tmp_path):
    """ComfyUI's Qwen-Image VAE file is in Wan's original layout: read through diffusers' Wan converter (the
    released structure, 2 resnets per level, at a narrow width) into AutoencoderKLQwenImage, weights exact."""
    from diffusers import AutoencoderKLQwenImage

    fam = get_family("qwen_image")
    tiny = fam.ensure_model(None, tmp_path / "models")
    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2)
    config = _weightless(tiny, tmp_path / "config")
    vae.save_config(config / "vae")
    shutil.rmtree(config / fam.text_components[0])
    shutil.copytree(tiny / fam.text_components[0], config / fam.text_components[0])
    save_file(comfy_layout.wan_vae(vae.state_dict()), str(tmp_path / "qwen_image_vae.safetensors"))
    save_file(_denoiser_state(fam, tiny), str(tmp_path / "transformer.safetensors"))
    out = fam.ensure_model(
        str(tmp_path / "transformer.safetensors"), tmp_path / "cache", str(config),
        vae_path=str(tmp_path / "qwen_image_vae.safetensors"),
    )  # fmt: skip
    got = fam.load_vae(out, torch.float32, CPU).state_dict()
    assert got.keys() == vae.state_dict().keys()
    assert all(torch.equal(got[k], v) for k, v in vae.state_dict().items())
