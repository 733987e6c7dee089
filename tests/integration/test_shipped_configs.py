"""The shipped weightless pipeline folders (stages/families/configs/) describe the released SD1.5 and SDXL: every
component builds from them (on the meta device: no weights allocated) with the published parameter counts, the
derived CLIP tokenizer gives the real CLIP ids, the original-layout shapes the single-file check compares are the
ones these configs produce, `model.config: sd15` names the shipped folder, and a file whose shapes do not fit is
refused naming model.config."""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKL, UNet2DConditionModel
from safetensors.torch import save_file
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from tuneline.schemas.config import parse_config
from tuneline.stages.families.registry import get_family
from tuneline.stages.families.sd15.single_file import _clip, _upsampler, unet_name, vae_name
from tuneline.stages.families.sdxl.single_file import _open_clip
from tuneline.stages.families.shipped import SIGNATURES, misfits, resolve_config, shipped_dir

# Published sizes: SD1.5 UNet 859,520,964; SDXL UNet 2,567,463,684; the KL VAE 83,653,863; CLIP ViT-L/14 text
# 123,060,480; OpenCLIP ViT-bigG/14 text with projection 694,659,840.
COUNTS = {
    "sd15": {"unet": 859_520_964, "vae": 83_653_863, "text_encoder": 123_060_480},
    "sdxl": {"unet": 2_567_463_684, "vae": 83_653_863, "text_encoder": 123_060_480, "text_encoder_2": 694_659_840},
}


def _meta_parts(name: str) -> dict[str, torch.nn.Module]:
    root = shipped_dir(name)
    with torch.device("meta"):
        parts = {
            "unet": UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(root / "unet")),
            "vae": AutoencoderKL.from_config(AutoencoderKL.load_config(root / "vae")),
            "text_encoder": CLIPTextModel(CLIPTextConfig.from_pretrained(root / "text_encoder")),
        }
        if (root / "text_encoder_2").is_dir():
            parts["text_encoder_2"] = CLIPTextModelWithProjection(
                CLIPTextConfig.from_pretrained(root / "text_encoder_2")
            )
    return parts


def _ldm_shapes(parts: dict[str, torch.nn.Module]) -> dict[str, tuple[int, ...]]:
    """Original-layout name -> shape, with the export's own name mapping (meta tensors: nothing allocated)."""
    unet, vae = parts["unet"], parts["vae"]
    per = unet.config.layers_per_block
    attn = {i for i, t in enumerate(unet.config.up_block_types) if "CrossAttn" in t}
    out = {
        f"model.diffusion_model.{unet_name(k, per) or _upsampler(k, per, attn)}": v.shape
        for k, v in unet.state_dict().items()
    }
    out.update(
        {
            f"first_stage_model.{vae_name(k, len(vae.config.block_out_channels))}": v.shape
            for k, v in vae.state_dict().items()
        }
    )
    if "text_encoder_2" in parts:
        out.update(_clip(parts["text_encoder"], "conditioner.embedders.0.transformer."))
        out.update(_open_clip(parts["text_encoder_2"], "conditioner.embedders.1.model.")[0])
    else:
        out.update(_clip(parts["text_encoder"], "cond_stage_model.transformer."))
    return {k: tuple(v.shape if hasattr(v, "shape") else v) for k, v in out.items()}


@pytest.mark.parametrize("name", ["sd15", "sdxl"])
def test_shipped_configs_build_the_published_models(name):
    parts = _meta_parts(name)
    counts = {c: sum(p.numel() for p in m.parameters()) for c, m in parts.items()}
    assert counts == COUNTS[name]
    shapes = _ldm_shapes(parts)
    assert {k: shapes.get(k) for k in SIGNATURES[name]} == SIGNATURES[name], (
        "the single-file check compares shapes these configs do not produce"
    )
    assert get_family(name).pipeline_class.__name__ in (shipped_dir(name) / "model_index.json").read_text()


@pytest.mark.parametrize(
    "name,sub,pad", [("sd15", "tokenizer", 49407), ("sdxl", "tokenizer", 49407), ("sdxl", "tokenizer_2", 0)]
)
def test_derived_tokenizer_gives_the_clip_ids(name, sub, pad):
    tok = CLIPTokenizer.from_pretrained(shipped_dir(name) / sub)
    assert len(tok) == 49408 and tok.model_max_length == 77
    assert tok("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]
    # "!" alone is "!</w>" (256); SDXL's second tokenizer pads with "!" (id 0, OpenCLIP's padding), which
    # transformers then treats as a special token, as with the released SDXL tokenizer_2 config
    bang = 0 if pad == 0 else 256
    assert tok("Hello, World!").input_ids == [49406, 3306, 267, 1002, bang, 49407]
    assert tok("x", padding="max_length", max_length=5).input_ids == [49406, 343, 49407, pad, pad]


def test_shipped_files_are_small():
    total = sum(p.stat().st_size for p in shipped_dir("sd15").parent.rglob("*") if p.is_file())
    assert 1_000_000 < total < 14_000_000


def test_package_data_carries_every_shipped_file():
    """A normal (non-editable) install carries only what pyproject's package-data patterns match."""
    import fnmatch
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    families = root / "stages" / "families"
    files = [
        p.relative_to(families).as_posix()
        for p in (families / "configs").rglob("*")
        if p.is_file() and p.suffix != ".py" and "__pycache__" not in p.parts
    ]
    missed = [
        f
        for f in files
        if not any(
            fnmatch.fnmatch(f, pat) and f.count("/") == pat.count("/") for pat in patterns["tuneline.stages.families"]
        )
    ]
    assert len(files) > 20 and missed == []


def test_model_config_by_name_is_the_shipped_folder(tmp_path):
    cfg = parse_config({"model": {"family": "sd15", "path": "m.safetensors", "config": "sd15"}}, workdir=str(tmp_path))
    assert cfg.model.config == "sd15" and cfg.model.path == str(tmp_path / "m.safetensors")
    dotted = parse_config(
        {"model": {"family": "sd15", "path": "m.safetensors", "config": "./sd15"}}, workdir=str(tmp_path)
    )
    assert dotted.model.config == str(tmp_path / "sd15"), "./sd15 is a folder, not the shipped name"
    with pytest.raises(Exception, match="model.config: sdxl is the shipped sdxl config but model.family is sd15"):
        parse_config({"model": {"family": "sd15", "path": "m.safetensors", "config": "sdxl"}}, workdir=str(tmp_path))


def _write(path, shapes: dict[str, tuple[int, ...]]):
    save_file({k: torch.zeros(s, dtype=torch.float16) for k, s in shapes.items()}, str(path))
    return path


def test_file_that_fits_resolves_to_the_shipped_folder(tmp_path):
    f = _write(tmp_path / "sd15.safetensors", SIGNATURES["sd15"])
    assert misfits(f, "sd15") == []
    assert resolve_config("sd15", f, None) == (str(shipped_dir("sd15")), True)
    assert resolve_config("sd15", f, "sd15") == (str(shipped_dir("sd15")), True)
    assert resolve_config("sd15", f, str(tmp_path)) == (str(tmp_path), False)
    assert resolve_config("tiny", f, None) == (None, False), "no shipped tiny config: diffusers' own lookup"


@pytest.mark.parametrize("config", [None, "sd15"])
def test_file_that_does_not_fit_is_refused_naming_model_config(tmp_path, config):
    sd2 = dict(SIGNATURES["sd15"])  # an SD2-like file: 1024-wide cross-attention
    sd2["model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight"] = (320, 1024)
    f = _write(tmp_path / "sd2.safetensors", sd2)
    with pytest.raises(ValueError) as err:
        get_family("sd15").ensure_model(str(f), tmp_path / "cache", config)
    msg = str(err.value)
    assert msg.startswith("model.config: ") and str(f) in msg and "[320, 1024]" in msg and "[320, 768]" in msg
    assert "Set model.config to a local diffusers folder" in msg
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())


@pytest.mark.slow
def test_real_size_sd15_file_converts_offline_with_the_shipped_config(tmp_path):
    """A released-size SD1.5 file (random weights, fp16, ~2 GB) with model.config null converts through the shipped
    folder and keeps the file's weights (about 30 s on 2 cores)."""
    import types

    from tuneline.stages.families.sd15.single_file import ldm_state_dict

    parts = _meta_parts("sd15")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in parts.values():
            m.to_empty(device="cpu")
            for p in m.parameters():
                p.normal_(0, 0.02, generator=gen)
            for n, b in m.named_buffers():  # only CLIP's position ids: 0..76
                b.copy_(torch.arange(b.shape[-1]).expand_as(b) if "position_ids" in n else torch.zeros_like(b))
            m.half()
    file = tmp_path / "sd15-released-size.safetensors"
    save_file(ldm_state_dict(types.SimpleNamespace(**parts)), str(file))
    keys = ("conv_in.weight", "down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k.weight")
    want = {k: parts["unet"].state_dict()[k].float() for k in keys}
    del parts
    fam = get_family("sd15")
    folder = fam.ensure_model(str(file), tmp_path / "cache", None)
    tok = CLIPTokenizer.from_pretrained(folder / "tokenizer")
    assert tok("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]
    got = fam.load_denoiser(folder, torch.float32, torch.device("cpu")).state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items()), "the converted UNet is not the file's"
