"""Wan 2.2 TI2V 5B under model.family wan22: picked by model.config (its shipped config; with model.path null, its
tiny flavor) or by a folder's model_index.json (expand_timesteps); the released sizes from the shipped config; the
plan counting its 48-channel, 16x spatial latents; its tiny flavor scan -> validate; per-token timesteps as the stock
WanPipeline passes them; its LoRA loading in the stock WanPipeline and rendering as trained, its ComfyUI file with
only keys ComfyUI maps for Wan."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import AutoencoderKLWan, WanTransformer3DModel
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
from PIL import Image
from safetensors.torch import load_file

from tests.integration import comfy_lora_keys
from tests.integration.family_runs import lift_lora_up, tiny_models
from tests.integration.test_wan22_stages import write_clips
from tuneline.schemas.config import parse_config
from tuneline.schemas.latents import LatentsManifest
from tuneline.schemas.train import TrainConfig
from tuneline.schemas.validate import ValidateManifest
from tuneline.stages.common.stage import run_stage
from tuneline.stages.families.base import MicroCond
from tuneline.stages.families.registry import get_family
from tuneline.stages.families.shipped import SIGNATURES, shipped_dir
from tuneline.stages.families.wan.adapter import fold
from tuneline.stages.pipeline import PIPELINE, stage
from tuneline.stages.render.renderer import Renderer, Sample
from tuneline.stages.train.export import DIFFUSERS_FILE, KOHYA_FILE
from tuneline.stages.train.model import prepare_denoiser, save_final
from tuneline.stages.train.planning import model_user_config, plan_command

CPU = torch.device("cpu")
TI2V = "wan22_ti2v"
# Built on the meta device from the shipped config: the transformer (published as 5B) and the Wan 2.2 VAE.
TRANSFORMER, VAE = 4_999_787_712, 704_688_668


def _model(**model):
    return parse_config({"model": {"family": "wan22"} | model}, workdir="/tmp/ti2v-unused").model


def test_model_config_or_the_folder_picks_ti2v(tmp_path):
    assert _model(path=None).family == "wan22"  # the A14B experts stay wan22's tiny flavor
    tiny = _model(path=None, config=TI2V)
    assert (tiny.family, tiny.config) == (TI2V, None)
    single = _model(path=str(tmp_path / "t.safetensors"), config=TI2V)
    assert (single.family, single.config) == (TI2V, TI2V)
    for flag, family in ((True, TI2V), (False, "wan22")):
        folder = tmp_path / f"folder-{flag}"
        folder.mkdir()
        (folder / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline", "expand_timesteps": flag}))
        assert _model(path=str(folder)).family == family
        # split files: the transformer file beside a local diffusers folder of the model as model.config
        assert _model(path=str(tmp_path / "t.safetensors"), config=str(folder)).family == family
    assert _model(family=TI2V, path=None, config=TI2V).config is None  # the row named directly: its tiny flavor too
    with pytest.raises(ValueError, match="model.config: wan22_ti2v is the shipped wan22_ti2v config but model.family"):
        parse_config({"model": {"family": "wan", "path": "x.safetensors", "config": TI2V}}, workdir=str(tmp_path))


def _meta(cls, component: str):
    with torch.device("meta"):
        return cls.from_config(cls.load_config(shipped_dir(TI2V) / component))


def test_the_shipped_config_builds_the_released_5b_and_its_vae():
    den = _meta(WanTransformer3DModel, "transformer")
    assert sum(p.numel() for p in den.parameters()) == TRANSFORMER
    vae = _meta(AutoencoderKLWan, "vae")
    assert sum(p.numel() for p in vae.parameters()) == VAE
    assert (vae.config.z_dim, vae.config.patch_size, vae.config.scale_factor_spatial) == (48, 2, 16)
    assert vae.config.is_residual and len(vae.config.latents_mean) == len(vae.config.latents_std) == 48
    index = json.loads((shipped_dir(TI2V) / "model_index.json").read_text())
    assert index["expand_timesteps"] is True and index["boundary_ratio"] is None
    original = {"model.diffusion_model." + k: torch.empty(v, device="meta") for k, v in SIGNATURES[TI2V].items()}
    converted = convert_wan_transformer_to_diffusers(original)
    state = den.state_dict()
    assert len(converted) == len(SIGNATURES[TI2V])
    assert {k: tuple(v.shape) for k, v in converted.items()} == {k: tuple(state[k].shape) for k in converted}


def test_the_plan_counts_48_channel_latents_at_16x():
    cfg = model_user_config(TI2V, None)
    answer = plan_command(cfg, 80.0, TI2V)
    assert "704 px edge, clips of 121 frames" in answer.headline and answer.plan.blocks == 30, answer.headline


def test_the_tiny_flavor_goes_scan_to_validate(tmp_path, upstream_store):
    data = upstream_store.dataset("wan22-ti2v-clips", lambda root: write_clips(root, 64))
    cfg = parse_config(
        {
            "dataset": {"path": str(data)},
            "model": {"family": "wan22", "config": TI2V, "path": None, "device": "cpu"},
            "buckets": {"resolution": 64, "fps": 8, "frames": [5]},
            "text": {"max_length": 16},
            "train": {"steps": 2, "batch_size": 1, "processes": 1, "mode": "lora", "lora_rank": 4},
            "validate": {"frames": 5, "steps": 2, "learning_check": False},
        },
        workdir=str(tmp_path / "work"),
    )
    ctx = upstream_store.upstream(cfg)
    latents = ctx.store.read(run_stage(ctx, stage("latents"), PIPELINE)[0], LatentsManifest)
    # 64 px at 16x: 4 x 4 latents of 48 channels; 5 frames are 2 latent frames stacked along the height
    assert {tuple(b.shape) for b in latents.buckets} == {(48, 8, 4), (48, 4, 4)}, latents.buckets
    paths = {name: run_stage(ctx, stage(name), PIPELINE)[0] for name in ("train", "validate")}
    manifest = json.loads((paths["train"] / "manifest.json").read_text(encoding="utf-8"))
    assert sorted(e["format"] for e in manifest["exports"]) == ["diffusers", "kohya"]
    val = ctx.store.read(paths["validate"], ValidateManifest)
    assert [i.frames for i in val.images] == [5]
    with Image.open(paths["validate"] / val.images[0].file) as im:
        assert im.n_frames == 5


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The tiny TI2V flavor with a LoRA of random nonzero up weights, saved as the train stage saves it."""
    root = tmp_path_factory.mktemp("ti2v")
    fam, model_dir = get_family(TI2V), tiny_models(root)(TI2V)
    t = TrainConfig(mode="lora", lora_rank=4, lora_alpha=2.0, lora_format="both")
    den, trainable = prepare_denoiser(fam, model_dir, t, torch.float32, CPU)
    lift_lora_up(trainable, 0.2)
    save_final(fam, model_dir, den, t, root / "final")
    return fam, model_dir, den.eval(), root / "final"


def test_training_passes_every_token_the_timestep_as_the_stock_pipeline_does(trained):
    """WanPipeline with expand_timesteps, text-to-video: a (B, tokens) timestep, the step's t in every token."""
    fam, _, den, _ = trained
    gen = torch.Generator().manual_seed(0)
    x, text = torch.randn(2, 48, 2, 4, 4, generator=gen), torch.randn(2, 8, 32, generator=gen)
    t = torch.tensor([900.0, 100.0])
    with torch.no_grad():
        micro = [MicroCond((64, 64), (0, 0), (64, 64))] * 2  # 64 px frames: 4 latent rows each
        got = fam.denoise(den, fold(x), t, {"prompt_embeds": text}, micro=micro)
        mask = torch.ones(x.shape)
        per_token = torch.stack([(mask[0][0][:, ::2, ::2] * s).flatten() for s in t])  # WanPipeline's, per sample
        want = den(x, per_token, text, return_dict=False)[0]
        other = den(x, t.flip(0), text, return_dict=False)[0]
    torch.testing.assert_close(got, fold(want))
    assert not torch.allclose(got, fold(other), atol=1e-4), "the timestep must matter for the check to show"


def _render(fam, pipe) -> torch.Tensor:
    renderer = Renderer(fam, pipe, fam.text_encoders_of(pipe, 16), CPU)
    return renderer.render([Sample("a square moves left", "blue", 0)], 64, 64, 3, 3.0, output_type="latent", frames=5)[
        0
    ]


def test_the_lora_loads_in_the_stock_pipeline_and_renders_as_trained(trained):
    fam, model_dir, den, final = trained
    with torch.no_grad():
        want = _render(fam, fam.load_pipeline(model_dir, torch.float32, CPU, denoiser=den))
        stock = fam.load_pipeline(model_dir, torch.float32, CPU)
        assert stock.config.expand_timesteps and stock.transformer_2 is None
        base = _render(fam, stock)
        stock.load_lora_weights(final, weight_name=DIFFUSERS_FILE)
        got = _render(fam, stock)
    assert not torch.allclose(base, got, atol=1e-4), "the LoRA must change the render"
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_the_comfy_file_uses_only_keys_comfyui_maps_for_wan(trained):
    _, _, den, final = trained
    stems = comfy_lora_keys.stems(load_file(final / KOHYA_FILE))
    assert stems and stems <= comfy_lora_keys.unet_stems(den), sorted(stems - comfy_lora_keys.unet_stems(den))
