"""Wan 2.1 as ComfyUI distributes it: the `diffusion_models/` transformer in Wan's original layout (under
`model.diffusion_model.`, float32 or scaled fp8), the UMT5 encoder file (transformers' names, scaled fp8, with the
SentencePiece tokenizer as a `spiece_model` tensor) and the VAE in Wan's original layout, given as model.path,
model.text_encoder_path and model.vae_path over a weightless model.config folder. The assembled transformer and VAE
compute exactly what the modules they were written from compute; the fp8 transformer holds exactly the file's fp8
values times their scales. A Wan file given to another family, or another family's file given to wan, is refused."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from tests.integration import comfy_layout
from tests.integration.test_split_files import _assert_fp8_close, _weightless
from tests.trainer import steps, trainer_for
from tuneline.schemas.config import parse_config
from tuneline.stages.common.stage import StageContext, run_stage
from tuneline.stages.families import resolve
from tuneline.stages.families.registry import get_family
from tuneline.stages.families.split_files import check_fits, checkpoint_family
from tuneline.stages.pipeline import PIPELINE, stages_for

CPU = torch.device("cpu")
F32 = torch.float32


def _released_structure_vae() -> torch.nn.Module:
    """A VAE of the released model's structure (2 resnets per level, widths 1-2-4-4 times the base) at the tiny
    flavor's base width: diffusers' Wan VAE converter (convert_wan_vae_to_diffusers) groups the decoder's blocks by
    that structure, which every released Wan 2.1 VAE file has."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(1)
    return AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2).eval()


def _comfy_files(fam, tiny: Path, out: Path, vae: torch.nn.Module) -> dict[str, Path]:
    out.mkdir()
    den = fam.load_denoiser(tiny, F32, CPU).state_dict()
    original = {comfy_layout.PREFIX + k: v.contiguous() for k, v in comfy_layout.wan_transformer(den).items()}
    files = {n: out / f"{n}.safetensors" for n in ("transformer", "transformer_fp8", "umt5", "vae")}
    save_file(original, str(files["transformer"]))
    save_file(comfy_layout.scaled_fp8(comfy_layout.wan_transformer(den)), str(files["transformer_fp8"]))
    te = fam.load_text_encoders(tiny, F32, CPU).encoders[0].state_dict()
    te.pop("encoder.embed_tokens.weight")  # ComfyUI's T5 keeps the embedding once, as `shared.weight`
    umt5 = comfy_layout.scaled_fp8(te, prefix="") | {
        "spiece_model": torch.tensor(list(b"\n\x05hello"), dtype=torch.uint8)
    }
    save_file(umt5, str(files["umt5"]))
    save_file({k: v.contiguous() for k, v in comfy_layout.wan_vae(vae.state_dict()).items()}, str(files["vae"]))
    return files


def _config(tmp_path: Path, config: Path, files: dict[str, Path], family: str = "wan", **model_keys):
    """Two captioned stills (one-frame clips) and the split files over the weightless `config`, LoRA, one step;
    `model_keys`: further model.* keys."""
    (tmp_path / "data").mkdir()
    for i in range(2):
        Image.new("RGB", (32, 32), (200 * i, 60, 120)).save(tmp_path / "data" / f"{i}.png")
        (tmp_path / "data" / f"{i}.txt").write_text(f"a square {i}", encoding="utf-8")
    model = {"family": family, "config": str(config), "device": "cpu", "path": str(files["transformer"])}
    model |= {"text_encoder_path": str(files["umt5"]), "vae_path": str(files["vae"])} | model_keys
    train = {"steps": 1, "batch_size": 1, "processes": 1, "mode": "lora", "lora_rank": 4}
    return parse_config(
        {"dataset": {"path": str(tmp_path / "data")}, "model": model, "buckets": {"resolution": 32},
         "text": {"max_length": 16}, "train": train},
        workdir=str(tmp_path / "work"),
    )  # fmt: skip


def _one_step(cfg, ctx: StageContext):
    """The stages before training run on the assembled model, and the real training loop takes a step on them
    (caches built here, not by upstream_store: the model is the test's own split files); the trainer."""
    for sd in stages_for(cfg):
        if sd.name in ("scan", "latents", "text"):
            run_stage(ctx, sd, PIPELINE)
    trainer = trainer_for(cfg, ctx)
    steps(trainer, 1)
    assert len(trainer.losses) == 1 and all(math.isfinite(x) for x in trainer.losses)
    return trainer


def test_wan_split_files_assemble_and_compute_as_before(tmp_path):
    fam = get_family("wan")
    tiny = fam.ensure_model(None, tmp_path / "models")
    vae = _released_structure_vae()
    files = _comfy_files(fam, tiny, tmp_path / "comfy", vae)
    config = _weightless(tiny, tmp_path / "config")
    vae.save_config(config / "vae")
    cfg = _config(tmp_path, config, files)
    ctx = StageContext(cfg)
    assembled = resolve.model_dir(ctx)
    _one_step(cfg, ctx)

    torch.manual_seed(0)
    x, t, text = torch.randn(1, 16, 2, 4, 4), torch.tensor([500]), torch.randn(1, 8, 32)
    want = fam.load_denoiser(tiny, F32, CPU)(x, t, text, return_dict=False)[0]
    got = fam.load_denoiser(assembled, F32, CPU)(x, t, text, return_dict=False)[0]
    assert torch.equal(got, want)
    clip = torch.rand(1, 3, 5, 16, 16) * 2 - 1
    with torch.no_grad():
        want = vae.encode(clip).latent_dist.mean
        got = fam.load_vae(assembled, F32, CPU).encode(clip).latent_dist.mean
    assert torch.equal(got, want) and got.shape == (1, 16, 2, 2, 2)
    te = fam.load_text_encoders(assembled, F32, CPU).encoders[0].state_dict()
    exact = comfy_layout.dequantized(comfy_layout.scaled_fp8(_te_state(fam, tiny), prefix=""), prefix="")
    assert all(torch.equal(te[k], v) for k, v in exact.items())
    _assert_fp8_close({k: te[k] for k in exact}, _te_state(fam, tiny))

    # the scaled fp8 transformer: exactly its fp8 values times their scales, in the same assembled layout
    fp8 = fam.ensure_model(str(files["transformer_fp8"]), tmp_path / "cache", str(config), str(files["umt5"]),
                           str(files["vae"]))  # fmt: skip
    loaded = comfy_layout.wan_transformer(fam.load_denoiser(fp8, F32, CPU).state_dict())
    file_sd = comfy_layout.scaled_fp8(comfy_layout.wan_transformer(fam.load_denoiser(tiny, F32, CPU).state_dict()))
    assert all(torch.equal(loaded[k], v.float()) for k, v in comfy_layout.dequantized(file_sd).items())


def _te_state(fam, model_dir: Path) -> dict[str, torch.Tensor]:
    te = fam.load_text_encoders(model_dir, F32, CPU).encoders[0].state_dict()
    te.pop("encoder.embed_tokens.weight")
    return te


def test_wan_transformer_files_are_told_from_other_families():
    wan_keys = [comfy_layout.PREFIX + k for k in ("head.modulation", "blocks.0.self_attn.q.weight")]
    assert checkpoint_family(wan_keys) == "wan"
    with pytest.raises(ValueError, match="is a wan transformer file.*model.family is qwen_image.*set model.family wan"):
        check_fits(get_family("qwen_image"), Path("wan.safetensors"), checkpoint_family(wan_keys), "transformer file")
    flux2 = checkpoint_family(["double_stream_modulation_img.lin.weight", "double_blocks.0.img_attn.qkv.weight"])
    with pytest.raises(ValueError, match=f"is a {flux2} transformer file.*model.family is wan"):
        check_fits(get_family("wan"), Path("flux2.safetensors"), flux2, "transformer file")


def test_shipped_config_without_a_text_encoder_is_refused_before_reading_weights(tmp_path):
    """A released Wan 2.1 1.3B transformer file (its shapes) with model.config null is matched to the shipped
    wan_1_3b config, which holds no text encoder: a UMT5 file is refused up front, naming model.config."""
    from tuneline.stages.families.shipped import SIGNATURES

    shapes = SIGNATURES["wan_1_3b"]
    file = tmp_path / "wan2.1_t2v_1.3B_fp8_e4m3fn.safetensors"
    save_file(
        {comfy_layout.PREFIX + k: torch.zeros(s, dtype=torch.float8_e4m3fn) for k, s in shapes.items()}, str(file)
    )
    umt5 = tmp_path / "umt5_xxl_fp8_e4m3fn_scaled.safetensors"
    save_file({"shared.weight": torch.zeros(4, 4)}, str(umt5))
    with pytest.raises(ValueError, match="model.text_encoder_path: model.config .*wan_1_3b has no text_encoder/config"):
        get_family("wan").ensure_model(str(file), tmp_path / "cache", None, str(umt5))
