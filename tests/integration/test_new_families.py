"""The newer families' tiny flavors (z_image, flux2 [dev], flux2_klein) through every stage on CPU, their LoRA files read by stock
diffusers and laid out as ComfyUI maps them. One LoRA pipeline run per family is shared by the tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from tests.integration import comfy_lora_keys
from tests.integration.family_runs import lift_lora_up, run_all, tiny_models, write_dataset
from tuneline.schemas.config import parse_config
from tuneline.schemas.train import TrainConfig
from tuneline.schemas.train_manifest import TrainManifest
from tuneline.schemas.validate import ValidateManifest
from tuneline.stages.common.stage import StageContext, run_stage
from tuneline.stages.families.common import unwrap
from tuneline.stages.families.registry import get_family
from tuneline.stages.pipeline import PIPELINE, stages_for
from tuneline.stages.train.export import DIFFUSERS_FILE, KOHYA_FILE
from tuneline.stages.train.model import prepare_denoiser, save_final

CPU = torch.device("cpu")
FAMILIES = ["z_image", "flux2_klein", "flux2"]
# Caption tokens: FLUX.2 [dev] prefixes its system message (138 tokens with the tiny vocabulary).
LENGTH = {"z_image": 48, "flux2_klein": 48, "flux2": 64}
RANK, ALPHA = 4, 2.0


def _context(root: Path, family: str, mode: str) -> StageContext:
    """64 px, 2 steps, 1 process, 2 sampler steps, a negative prompt and one without (the pipeline's own "")."""
    data = root / "data"
    if not data.is_dir():  # a second run reads the same files
        write_dataset(data)
    cfg = parse_config(
        {
            "dataset": {"path": str(data)},
            "model": {"family": family, "path": None, "device": "cpu"},
            "buckets": {"resolution": 64},
            "text": {"max_length": LENGTH[family]},
            "train": {"steps": 2, "batch_size": 2, "processes": 1, "caption_dropout": 0.5, "mode": mode},
            "validate": {
                "steps": 2,
                "prompts": [
                    {"prompt": "red, square", "negative_prompt": "blue", "seed": 1},
                    {"prompt": "blue, circle", "seed": 2},
                ],
            },
        },
        workdir=str(root / "work"),
    )
    return StageContext(cfg)


@pytest.fixture(scope="module", params=FAMILIES)
def lora_run(request, tmp_path_factory):
    ctx = _context(tmp_path_factory.mktemp(f"{request.param}-lora"), request.param, "lora")
    return request.param, ctx, run_all(ctx)


def _check_chain(ctx: StageContext, paths: dict[str, Path], mode: str) -> None:
    train = ctx.store.read(paths["train"], TrainManifest)
    assert (train.family, train.step, train.mode) == (ctx.cfg.model.family, 2, mode)
    val = ctx.store.read(paths["validate"], ValidateManifest)
    assert [(i.prompt, i.negative_prompt) for i in val.images] == [("red, square", "blue"), ("blue, circle", "")]
    for item in val.images:
        with Image.open(paths["validate"] / item.file) as img:
            assert img.size == (64, 64)


def test_lora_chain_scan_to_validate(lora_run):
    family, ctx, paths = lora_run
    _check_chain(ctx, paths, "lora")
    final = paths["train"] / "final"
    assert {p.name for p in final.iterdir()} >= {DIFFUSERS_FILE, KOHYA_FILE}
    assert all(run_stage(ctx, sd, PIPELINE)[1] is False for sd in stages_for(ctx.cfg)), (
        "a second run must skip every stage"
    )


def test_full_fine_tune_chain(lora_run):
    """train.mode full in the LoRA run's workdir: scan, latents and text are reused, train and validate rebuild."""
    family, lora_ctx, _ = lora_run
    ctx = _context(lora_ctx.workdir.parent, family, "full")
    built = {sd.name: run_stage(ctx, sd, PIPELINE)[1] for sd in stages_for(ctx.cfg)}
    assert built == {"scan": False, "latents": False, "text": False, "train": True, "validate": True}
    paths = {sd.name: run_stage(ctx, sd, PIPELINE)[0] for sd in stages_for(ctx.cfg)}
    _check_chain(ctx, paths, "full")
    index = json.loads((paths["train"] / "final" / "model_index.json").read_text())
    assert index["_class_name"] == get_family(family).facts.pipeline


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """One tiny model folder per family for the LoRA file tests."""
    return tiny_models(tmp_path_factory.mktemp("new-family-models"))


def _trained_lora(family: str, model_dir: Path, out: Path):
    """A peft LoRA on the tiny denoiser with random nonzero up weights (what training reaches), saved as the train
    stage saves it; alpha != rank so a lost alpha shows."""
    fam = get_family(family)
    t = TrainConfig(mode="lora", lora_rank=RANK, lora_alpha=ALPHA)
    den, trainable = prepare_denoiser(fam, model_dir, t, torch.float32, CPU)
    lift_lora_up(trainable, 0.2)
    save_final(fam, model_dir, den, t, out)
    return fam, den


def _render(fam, pipe, enc) -> torch.Tensor:
    from tuneline.stages.families.encode import encode_strings

    text = encode_strings(fam, enc, ["red, square"])
    neg = encode_strings(fam, enc, ["blue"])
    return pipe(
        **fam.prompt_kwargs(text, neg),
        width=64,
        height=64,
        num_inference_steps=2,
        guidance_scale=3.0,
        generator=torch.Generator().manual_seed(0),
        output_type="latent",
    ).images


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_file_in_stock_pipeline_renders_as_trained(family, models, tmp_path):
    model_dir = models(family)
    fam, den = _trained_lora(family, model_dir, tmp_path / "final")
    with torch.no_grad():
        trained = fam.load_pipeline(model_dir, torch.float32, CPU, denoiser=unwrap(den).eval())
        want = _render(fam, trained, fam.text_encoders_of(trained, LENGTH[family]))
        stock = fam.load_pipeline(model_dir, torch.float32, CPU)
        base = _render(fam, stock, fam.text_encoders_of(stock, LENGTH[family]))
        stock.load_lora_weights(tmp_path / "final", weight_name=DIFFUSERS_FILE)
        got = _render(fam, stock, fam.text_encoders_of(stock, LENGTH[family]))
    assert not torch.allclose(base, want, atol=1e-4), "the LoRA must change the render"
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


# The stem form each family's file uses (of those ComfyUI maps: tests/integration/comfy_lora_keys.py).
COMFY_PREFIX = {"z_image": "diffusion_model.", "flux2_klein": "transformer.", "flux2": "transformer."}


@pytest.mark.parametrize("family", FAMILIES)
def test_comfy_file_uses_only_mapped_keys(family, models, tmp_path):
    """Every key is `<prefix><diffusers path>.{lora_down,lora_up}.weight|alpha` for a path ComfyUI maps for the
    model (ComfyUI's key map for the model: tests/integration/comfy_lora_keys.py), every trained module is there,
    and each pair's alpha/rank * up @ down is the trained update."""
    model_dir = models(family)
    fam, den = _trained_lora(family, model_dir, tmp_path / "final")
    mapped, prefix = comfy_lora_keys.unet_stems(unwrap(den)), COMFY_PREFIX[family]
    state = load_file(tmp_path / "final" / KOHYA_FILE)
    stems = comfy_lora_keys.stems(state)
    assert stems and stems <= mapped, sorted(stems - mapped)
    modules = dict(unwrap(den).named_modules())
    trained = {p for p, m in modules.items() if hasattr(m, "lora_A")}
    assert {s.removeprefix(prefix) for s in stems} == trained
    for stem in stems:
        mod = modules[stem.removeprefix(prefix)]
        delta = state[f"{stem}.alpha"] / RANK * state[f"{stem}.lora_up.weight"] @ state[f"{stem}.lora_down.weight"]
        want = (ALPHA / RANK) * mod.lora_B["default"].weight @ mod.lora_A["default"].weight
        torch.testing.assert_close(delta, want.detach())
