"""Image editing from paired datasets with the flux_kontext tiny flavor on CPU: the edit demo (dataset.demo: edit)
through every stage in one shared run; control latents beside the targets; conditioning as FluxKontextPipeline
builds it; the LoRA read by the stock FluxKontextPipeline rendering as trained; the validation grid of control |
result rows; an edited control image rebuilding what depends on it (a rebuild-table row)."""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.integration.stock_edit import StockEdit, trained_edit, validated_edit_grid
from tuneline.schemas.config import parse_config
from tuneline.schemas.demo import DEMO_CONFIG
from tuneline.schemas.latents import LatentsManifest
from tuneline.schemas.validate import ValidateManifest
from tuneline.stages.common.stage import StageContext, run_stage, status
from tuneline.stages.families.registry import get_family
from tuneline.stages.pipeline import PIPELINE, stage, stages_for
from tuneline.stages.scan.demo import write_demo_for
from tuneline.stages.scan.edit_demo import showcase

pytestmark = pytest.mark.slow
FAMILY = "flux_kontext"
CPU = torch.device("cpu")
STEPS = 2


def _config(workdir: Path, **train):
    data = copy.deepcopy(DEMO_CONFIG)
    data["workdir"] = str(workdir)
    data["dataset"] = {"path": "demo-data", "demo": "edit"}
    data["model"] = {"family": FAMILY, "path": None, "device": "cpu"}
    data["train"] |= {"steps": STEPS, "processes": 1, "mode": "lora", "checkpoint_every": STEPS, "validate_every": 0}
    data["train"] |= train
    data["validate"] |= {"steps": 2, "check_seeds": 2, "check_steps": 2}
    data["validate"]["prompts"] = data["validate"]["prompts"][:2]
    return parse_config(data)


@pytest.fixture(scope="session")
def edit_run(tmp_path_factory):
    cfg = _config(tmp_path_factory.mktemp("edit") / "w")
    write_demo_for(cfg)
    ctx = StageContext(cfg)
    paths = {sd.name: run_stage(ctx, sd, PIPELINE)[0] for sd in stages_for(cfg)}
    return ctx, paths


def test_pairs_are_cached_and_validated_as_edits(edit_run):
    ctx, paths = edit_run
    scan = json.loads((paths["scan"] / "manifest.json").read_text())
    assert scan["accepted"] == 48 and scan["unmatched_controls"] == [] and scan["rejected"] == 0
    # The edit demo's showcase: an instruction color per row, on controls of other colors and shapes, each beside
    # its result under its instruction.
    pictures = validated_edit_grid(ctx, paths, 48, ["make it red", "make it green"])
    for row, (text, control) in enumerate(showcase(2)):
        left = pictures[row * 64 : (row + 1) * 64, :64]
        assert np.array_equal(left, np.asarray(control.convert("RGB"))), text
        with Image.open(paths["validate"] / f"{row:03d}-control.png") as c:
            assert np.array_equal(left, np.asarray(c.convert("RGB")))
    val = ctx.store.read(paths["validate"], ValidateManifest)
    assert val.edit_color_accuracy is not None and val.untrained_edit_color_accuracy is not None


def test_lora_in_stock_kontext_pipeline_renders_as_trained(edit_run, tmp_path):
    """The exported LoRA loads in diffusers' FluxKontextPipeline (load_lora_weights) and edits as the trained model
    renders it in validation (the same latents), unlike the base model."""
    from diffusers import FluxKontextPipeline

    ctx, paths = edit_run
    control = Image.open(ctx.cfg.resolve(ctx.cfg.dataset.control) / "blue_to_red_square_0.png").convert("RGB")
    want = trained_edit(ctx, FAMILY, paths["train"] / "final", control)
    stock = StockEdit(ctx, FAMILY, FluxKontextPipeline, paths["train"] / "final", max_area=64 * 64, _auto_resize=False)
    got, base = stock.render(stock.load(), control), stock.render(stock.load(lora=False), control)
    assert not torch.allclose(base, want, atol=1e-4), "the LoRA must change the edit"
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_an_edited_control_image_rebuilds_what_depends_on_it(edit_run, tmp_path):
    """Rebuild-table row: an edited control image makes a new scan version, so latents (which re-encode that one
    control and copy the rest), text, train and validate rebuild; touching a control (same bytes) rebuilds nothing."""
    ctx, _ = edit_run
    w = tmp_path / "w"
    shutil.copytree(ctx.workdir, w, symlinks=True)
    cfg = _config(w)
    controls = cfg.resolve(cfg.dataset.control)
    first = sorted(controls.glob("*.png"))[0]
    os.utime(first, ns=(1, 10**18))
    run_stage(StageContext(cfg), stage("scan"), PIPELINE)
    assert {r.stage for r in status(StageContext(cfg), stages_for(cfg)) if r.state != "fresh"} == set()

    Image.new("RGB", (64, 64), (12, 200, 90)).save(first)
    ctx2 = StageContext(cfg)
    run_stage(ctx2, stage("scan"), PIPELINE)
    stale = {r.stage for r in status(ctx2, stages_for(cfg)) if r.state != "fresh"}
    assert stale == {"latents", "text", "train", "validate"}
    path, built = run_stage(ctx2, stage("latents"), PIPELINE)
    lat = ctx2.store.read(path, LatentsManifest)
    assert built and (lat.controls_encoded, lat.controls_reused) == (1, 47)


def test_denoise_builds_the_pipeline_conditioning_and_falls_back_to_text_to_image(edit_run):
    """Control tokens appended with ids (1, row, column) as FluxKontextPipeline.prepare_latents builds them; the
    prediction covers the target tokens only; without control latents it is FLUX.1's text-to-image denoise."""
    from tuneline.stages.families.flux.adapter import FluxFamily, pack_latents
    from tuneline.stages.families.flux_kontext.adapter import control_ids

    ctx, _ = edit_run
    fam = get_family(FAMILY)
    model_dir = fam.ensure_model(None, ctx.workdir / "models")
    pipe = fam.load_pipeline(model_dir, torch.float32, CPU)
    image = pipe.image_processor.preprocess(Image.new("RGB", (64, 64), (200, 30, 30)), 64, 64)
    _, image_latents, latent_ids, image_ids = pipe.prepare_latents(
        image, 1, 16, 64, 64, torch.float32, CPU, torch.Generator().manual_seed(0)
    )
    assert torch.equal(image_ids, control_ids(8, 8, CPU, torch.float32))
    with torch.no_grad():
        raw = pipe.vae.encode(image).latent_dist.mean
    scale, shift = fam.vae_factors(pipe.vae)
    torch.testing.assert_close(image_latents, pack_latents((raw - shift) * scale))
    den = pipe.transformer
    gen = torch.Generator().manual_seed(1)
    noisy = torch.randn(2, 16, 8, 8, generator=gen)
    text = {
        "prompt_embeds": torch.randn(2, 7, 32, generator=gen),
        "pooled_prompt_embeds": torch.randn(2, 32, generator=gen),
    }
    t = torch.tensor([500.0, 900.0])
    with torch.no_grad():
        plain = fam.denoise(den, noisy, t, text)
        assert torch.equal(plain, FluxFamily().denoise(den, noisy, t, text))
        edited = fam.denoise(den, noisy, t, text | {"control_latents": torch.randn(2, 16, 8, 8, generator=gen)})
    assert edited.shape == noisy.shape and not torch.allclose(edited, plain)


def test_validate_controls_name_the_edits_rendered(edit_run, tmp_path):
    """validate.controls replaces the training pairs: each image (relative to the workdir) at the render size with
    its instruction and seed; an unreadable one is refused naming it."""
    from tuneline.stages.validate.edits import edit_samples

    ctx, _ = edit_run
    Image.new("RGB", (32, 48), (10, 20, 200)).save(ctx.workdir / "input.png")
    data = ctx.cfg.model_dump(by_alias=True)
    data["validate"]["controls"] = [{"image": "input.png", "prompt": "make it red", "seed": 7}]
    cfg = parse_config(data)
    [s] = edit_samples(StageContext(cfg), {}, (64, 64))
    assert (s.prompt, s.seed, s.image.size) == ("make it red", 7, (64, 64))
    assert s.image.getpixel((32, 32)) == (10, 20, 200)
    data["validate"]["controls"] = [{"image": "missing.png", "prompt": "make it red"}]
    with pytest.raises(ValueError, match="missing.png"):
        edit_samples(StageContext(parse_config(data)), {}, (64, 64))
