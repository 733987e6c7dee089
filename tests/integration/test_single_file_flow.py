"""SD3 and Flux single files, offline: a transformer-only file in the original layout (SAI's
"model.diffusion_model." names for SD3, BFL's unprefixed names for Flux) with model.config a local diffusers folder
of the same model loads its transformer from the file and the VAE and text encoders from the folder (a VAE the
file holds comes from the file), and trains; a file of the other family is refused naming both families, and a tiny
file against the shipped (released-size) config naming model.config."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from tests.integration.original_layout import flux_original, sd3_original
from tests.integration.test_train_support import build_upstream, small_config, train
from tuneline.stages.families import resolve as models
from tuneline.stages.families.registry import get_family

CPU = torch.device("cpu")
WRITE = {"sd3": sd3_original, "flux": flux_original}


def _transformer_file(family: str, tmp_path, shift: float = 0.0, vae: bool = False):
    """(the tiny model's transformer, moved by `shift`, written in the original layout, alone or with its VAE
    moved by `shift` under "first_stage_model."; the tiny folder; the state dicts written)."""
    from diffusers import AutoencoderKL

    from tuneline.stages.families.sd15.single_file import vae_name

    fam = get_family(family)
    folder = fam.ensure_model(None, tmp_path / "models")
    state = {k: v + shift for k, v in fam.load_denoiser(folder, torch.float32, CPU).state_dict().items()}
    tensors = WRITE[family](state)
    vae_state = {}
    if vae:
        model = AutoencoderKL.from_pretrained(folder, subfolder="vae")
        vae_state = {k: v + shift for k, v in model.state_dict().items()}
        levels = len(model.config.block_out_channels)
        tensors.update({f"first_stage_model.{vae_name(k, levels)}": v for k, v in vae_state.items()})
    path = tmp_path / f"{family}-transformer.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path, folder, {"transformer": state, "vae": vae_state}


@pytest.mark.parametrize("family,vae", [("sd3", False), ("flux", False), ("sd3", True)])
def test_transformer_only_file_with_model_config_loads_offline_and_trains(tmp_path, family, vae):
    path, folder, written = _transformer_file(family, tmp_path, shift=0.01, vae=vae)
    want = written["transformer"]
    cfg = small_config(
        tmp_path / "work",
        {"mode": "lora", "lora_rank": 2, "steps": 2, "processes": 1, "batch_size": 2},
        model={"family": family, "path": str(path), "config": str(folder), "device": "cpu"},
    )
    ctx = build_upstream(cfg)  # not the shared store: the conversion of the file is what is tested
    converted = models.model_dir(ctx)
    assert converted != folder and converted.is_dir()
    got = get_family(family).load_denoiser(converted, torch.float32, CPU).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), (
        "the converted transformer is not the file's"
    )
    from safetensors.torch import load_file  # the VAE: the file's when it has one, else model.config's

    want_vae = written["vae"] or load_file(str(folder / "vae" / "diffusion_pytorch_model.safetensors"))
    got_vae = load_file(str(converted / "vae" / "diffusion_pytorch_model.safetensors"))
    assert got_vae.keys() == want_vae.keys() and all(torch.equal(got_vae[k], v) for k, v in want_vae.items())
    out = train(cfg)
    assert (out / "final" / "pytorch_lora_weights.safetensors").is_file()


@pytest.mark.parametrize("family,other", [("sd3", "flux"), ("flux", "sd3")])
def test_file_of_the_other_family_is_refused_naming_both(tmp_path, family, other):
    path, _, _ = _transformer_file(other, tmp_path)
    folder = get_family(family).ensure_model(None, tmp_path / "models")
    with pytest.raises(ValueError) as err:
        get_family(family).ensure_model(str(path), tmp_path / "cache", str(folder))
    msg = str(err.value)
    assert f"is a {other} checkpoint" in msg and f"model.family is {family}" in msg and str(path) in msg


def test_tiny_file_with_the_shipped_config_is_refused_naming_model_config(tmp_path):
    path, _, _ = _transformer_file("sd3", tmp_path)
    with pytest.raises(ValueError) as err:
        get_family("sd3").ensure_model(str(path), tmp_path / "cache", None)
    msg = str(err.value)
    assert msg.startswith("model.config: null uses the shipped sd3 config") and "x_embedder.proj.weight is [32," in msg
