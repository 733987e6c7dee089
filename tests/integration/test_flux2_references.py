"""FLUX.2 reference images from a paired folder (dataset.control) with the flux2 tiny flavor on CPU, in one shared
scan -> validate run: the reference tokens and ids as Flux2Pipeline builds them from `image=`, the validation grid
of reference | result rows, and the exported LoRA read by the stock Flux2Pipeline rendering as trained."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers import prefect_api
from tests.integration.stock_edit import StockEdit, trained_edit, validated_edit_grid
from tuneline.schemas.config import parse_config
from tuneline.schemas.demo import DEMO_CONFIG
from tuneline.schemas.latents import LatentsManifest
from tuneline.schemas.validate import ValidateManifest
from tuneline.stages.common.stage import StageContext, run_stage
from tuneline.stages.families.registry import get_family
from tuneline.stages.pipeline import PIPELINE, stage, stages_for

pytestmark = pytest.mark.slow
FAMILY = "flux2"
CPU = torch.device("cpu")
COLORS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}


def paired_folder(root: Path, refs: int = 1) -> tuple[Path, Path]:
    """Six 64 px targets "make it <color>", each with a control of another color: one file per target, or with
    `refs` > 1 a folder of that many references (the first of the other color, then lighter variants)."""
    data, controls = root / "data", root / "controls"
    data.mkdir(parents=True)
    controls.mkdir()
    names = list(COLORS)
    for i in range(6):
        want, given = names[i % 3], names[(i + 1) % 3]
        stem = f"{i:02d}-{given}-to-{want}"
        img = Image.new("RGB", (64, 64), (245, 245, 245))
        img.paste(COLORS[want], (16, 16, 48, 48))
        img.save(data / f"{stem}.png")
        (data / f"{stem}.txt").write_text(f"make it {want}")
        for j in range(refs):
            ctl = Image.new("RGB", (64, 64), (245 - 60 * j, 245, 245))
            ctl.paste(COLORS[given], (16 + 4 * j, 16, 48, 48))
            if refs == 1:
                ctl.save(controls / f"{stem}.png")
            else:
                (controls / stem).mkdir(exist_ok=True)
                ctl.save(controls / stem / f"ref{j}.png")
    return data, controls


def config(workdir: Path, data: Path, controls: Path | None, family: str = FAMILY):
    d = copy.deepcopy(DEMO_CONFIG)
    d["workdir"] = str(workdir)
    d["dataset"] = {"path": str(data), "control": None if controls is None else str(controls)}
    d["model"] = {"family": family, "path": None, "device": "cpu"}
    d["train"] |= {"steps": 2, "batch_size": 2, "processes": 1, "mode": "lora", "learning_rate": 1e-2}
    d["train"] |= {"checkpoint_every": 2, "validate_every": 0}
    d["validate"] |= {"steps": 2, "learning_check": False}
    d["validate"]["prompts"] = d["validate"]["prompts"][:2]
    return parse_config(d)


@pytest.fixture(scope="session")
def flux2_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux2-refs")
    data, controls = paired_folder(root)
    ctx = StageContext(config(root / "w", data, controls))
    paths = {sd.name: run_stage(ctx, sd, PIPELINE)[0] for sd in stages_for(ctx.cfg)}
    return ctx, paths


def test_references_are_cached_trained_and_validated(flux2_run):
    ctx, paths = flux2_run
    # The first two training pairs' references with their instructions, each beside its result.
    left = validated_edit_grid(ctx, paths, 6, ["make it red", "make it green"])[64:, :64]
    with Image.open(ctx.cfg.resolve(ctx.cfg.dataset.control) / "01-blue-to-green.png") as c:
        assert np.array_equal(left, np.asarray(c.convert("RGB")))


@pytest.mark.parametrize("name", [FAMILY, "flux2_klein"])
def test_denoise_builds_the_pipeline_reference_tokens(flux2_run, name):
    """Reference tokens and ids equal the stock pipeline's prepare_image_latents' (Flux2Pipeline,
    Flux2KleinPipeline) from the same images (one and two references); the prediction is the transformer's as the
    pipeline's loop calls it, cut to the target tokens, and changes with the reference."""
    from tuneline.stages.families.flux2 import latents as lat
    from tuneline.stages.families.flux2.references import reference_tokens

    ctx, _ = flux2_run
    fam = get_family(name)
    model_dir = fam.ensure_model(None, ctx.workdir / "models")
    pipe = fam.load_pipeline(model_dir, torch.float32, CPU)
    encoder = fam.load_vae_encoder(model_dir, torch.float32, CPU)
    images = [
        pipe.image_processor.preprocess(Image.new("RGB", (64, 64), c), 64, 64, resize_mode="crop")
        for c in ((200, 30, 30), (20, 90, 210))
    ]
    with torch.no_grad():
        cached = [encoder.encode(x).latent_dist.mean for x in images]  # what the latents stage caches
    like = torch.zeros(1, 32, 8, 8)
    for n in (1, 2):
        want_tokens, want_ids = pipe.prepare_image_latents(images[:n], 1, torch.Generator(), CPU, torch.float32)
        control = cached[0] if n == 1 else torch.stack(cached, dim=1)
        tokens, ids = reference_tokens(control, like)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(tokens, want_tokens, atol=1e-5, rtol=1e-5)

    gen = torch.Generator().manual_seed(1)
    noisy = torch.randn(1, 32, 8, 8, generator=gen)
    text = {"prompt_embeds": torch.randn(1, 7, pipe.transformer.config.joint_attention_dim, generator=gen)}
    t = torch.tensor([700.0])
    with torch.no_grad():
        plain = fam.denoise(pipe.transformer, noisy, t, text)
        edited = fam.denoise(pipe.transformer, noisy, t, text | {"control_latents": cached[0]})
        # The transformer called as the pipeline's loop calls it, its prediction cut to the target tokens.
        tokens, ids = pipe.prepare_image_latents(images[:1], 1, torch.Generator(), CPU, torch.float32)
        target = lat.pack(lat.patchify(noisy))
        full = pipe.transformer(
            hidden_states=torch.cat([target, tokens], dim=1),
            timestep=t / 1000,
            guidance=torch.full((1,), fam.train_guidance) if pipe.transformer.config.guidance_embeds else None,
            encoder_hidden_states=text["prompt_embeds"],
            txt_ids=lat.text_ids(1, 7, CPU),
            img_ids=torch.cat([lat.latent_ids(1, 4, 4, CPU), ids], dim=1),
            return_dict=False,
        )[0]
    torch.testing.assert_close(edited, lat.unpatchify(lat.unpack(full[:, : target.shape[1]], 4, 4)))
    assert edited.shape == noisy.shape and not torch.allclose(edited, plain)


def test_lora_in_stock_flux2_pipeline_renders_as_trained(flux2_run):
    """The exported LoRA loads in diffusers' Flux2Pipeline (load_lora_weights) and, given the reference as
    `image=`, renders as the trained model does in validation (the same latents), unlike the base model; the
    reference changes the render."""
    from diffusers import Flux2Pipeline

    ctx, paths = flux2_run
    control = Image.open(ctx.cfg.resolve(ctx.cfg.dataset.control) / "00-green-to-red.png").convert("RGB")
    want = trained_edit(ctx, FAMILY, paths["train"] / "final", control)
    stock = StockEdit(ctx, FAMILY, Flux2Pipeline, paths["train"] / "final")
    pipe = stock.load()
    torch.testing.assert_close(stock.render(pipe, [control]), want, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(stock.render(stock.load(lora=False), [control]), want, atol=1e-4), (
        "the LoRA must change the edit"
    )
    assert not torch.allclose(stock.render(pipe, None), want, atol=1e-4), "the reference must change the edit"


@pytest.fixture(scope="session")
def flux2_refs_run(tmp_path_factory):
    """The same run with two reference images per target (<control>/<stem>/ref0.png, ref1.png)."""
    root = tmp_path_factory.mktemp("flux2-two-refs")
    data, controls = paired_folder(root, refs=2)
    ctx = StageContext(config(root / "w", data, controls))
    paths = {sd.name: run_stage(ctx, sd, PIPELINE)[0] for sd in stages_for(ctx.cfg)}
    return root, ctx, paths


def test_several_references_are_recorded_cached_and_validated(flux2_refs_run):
    from tuneline.stages.common.hashing import file_sha256
    from tuneline.stages.common.jsonl import read_jsonl

    _, ctx, paths = flux2_refs_run
    controls = ctx.cfg.resolve(ctx.cfg.dataset.control)
    records = list(read_jsonl(paths["scan"] / "images.jsonl"))
    assert len(records) == 6
    for r in records:
        stem = Path(r["path"]).stem
        assert r["control_path"] == stem and [f["path"] for f in r["control_references"]] == [
            f"{stem}/ref0.png",
            f"{stem}/ref1.png",
        ]
        for f in r["control_references"]:
            assert f["sha256"] == file_sha256(controls / f["path"]) and (f["width"], f["height"]) == (64, 64)
            assert f["size_bytes"] == (controls / f["path"]).stat().st_size
    lat = ctx.store.read(paths["latents"], LatentsManifest)
    assert lat.controls == 6 and lat.controls_encoded == 12
    [array] = [p for p in (paths["latents"] / "controls").glob("*.npy") if not p.name.endswith(".flip.npy")]
    assert np.load(array).shape == (6, 2, 32, 8, 8)
    val = ctx.store.read(paths["validate"], ValidateManifest)
    assert [i.prompt for i in val.images] == ["make it red", "make it green"]
    # Each row's control file shows its two references side by side.
    with Image.open(paths["validate"] / "000-control.png") as c:
        strip = np.asarray(c.convert("RGB"))
    assert strip.shape == (64, 128, 3)
    for j in range(2):
        with Image.open(controls / "00-green-to-red" / f"ref{j}.png") as ref:
            assert np.array_equal(strip[:, 64 * j : 64 * (j + 1)], np.asarray(ref.convert("RGB")))


def test_lora_renders_with_several_references_in_the_stock_pipeline(flux2_refs_run):
    """Flux2Pipeline given both references as `image=[...]` with the exported LoRA renders as validation does; the
    second reference changes the render."""
    from diffusers import Flux2Pipeline

    _, ctx, paths = flux2_refs_run
    folder = ctx.cfg.resolve(ctx.cfg.dataset.control) / "00-green-to-red"
    refs = [Image.open(folder / f"ref{j}.png").convert("RGB") for j in range(2)]
    want = trained_edit(ctx, FAMILY, paths["train"] / "final", refs)
    stock = StockEdit(ctx, FAMILY, Flux2Pipeline, paths["train"] / "final")
    pipe = stock.load()
    torch.testing.assert_close(stock.render(pipe, refs), want, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(stock.render(pipe, refs[:1]), want, atol=1e-4), (
        "the second reference must change the edit"
    )


def test_an_edited_reference_is_the_one_encoded_again(flux2_refs_run, tmp_path):
    """Replacing one reference of one image makes a new scan version whose latents encode that reference again and
    copy the other eleven."""
    import shutil

    root, _, _ = flux2_refs_run
    for name in ("data", "controls", "w"):
        shutil.copytree(root / name, tmp_path / name, symlinks=True)
    Image.new("RGB", (64, 64), (9, 99, 199)).save(tmp_path / "controls" / "03-green-to-red" / "ref1.png")
    ctx = StageContext(config(tmp_path / "w", tmp_path / "data", tmp_path / "controls"))
    run_stage(ctx, stage("scan"), PIPELINE)
    path, built = run_stage(ctx, stage("latents"), PIPELINE)
    lat = ctx.store.read(path, LatentsManifest)
    assert built and (lat.controls_encoded, lat.controls_reused) == (1, 11)


def test_validate_artifact_shows_the_edit_grid_inline_in_prefect(flux2_refs_run, prefect_server):
    """The validate flow's Prefect markdown artifact, read back from Prefect, holds the grid (control | result per
    row) as an inline PNG equal to grid.png, and names each row's control file."""
    import asyncio
    import base64
    import io
    import re

    from tests.integration.test_ui_images import _markdown_of
    from tuneline.flows.stage_flows import validate_flow

    _, ctx, paths = flux2_refs_run
    with prefect_api(prefect_server):
        assert Path(validate_flow(config=ctx.cfg)) == paths["validate"]  # fresh: reported, not rebuilt
        text = asyncio.run(_markdown_of("validate-grid", paths["validate"].name))
    [b64] = re.findall(r"!\[grid\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", text)
    inline = np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))
    with Image.open(paths["validate"] / "grid.png") as g:
        assert np.array_equal(inline, np.asarray(g.convert("RGB")))
    # labelled rows, each tile inline; no link to a relative path (a browser opens it as a blank page)
    assert "| control | result | instruction | seed |" in text and "![000-control.png](data:image/png;base64," in text
    assert "](000-" not in text


def test_validate_controls_may_name_a_folder_of_references(flux2_refs_run):
    """A validate.controls image that is a folder: its images in name order, each at the render size."""
    from tuneline.stages.validate.edits import edit_samples

    _, ctx, _ = flux2_refs_run
    refs = ctx.workdir / "refs"
    refs.mkdir()
    Image.new("RGB", (32, 48), (200, 0, 0)).save(refs / "b.png")
    Image.new("RGB", (80, 64), (0, 0, 200)).save(refs / "a.png")
    data = ctx.cfg.model_dump(by_alias=True)
    data["validate"]["controls"] = [{"image": "refs", "prompt": "make it red", "seed": 7}]
    [s] = edit_samples(StageContext(parse_config(data)), {}, (64, 64))
    assert [(i.size, i.getpixel((5, 5))) for i in s.image] == [((64, 64), (0, 0, 200)), ((64, 64), (200, 0, 0))]
    # A family taking one control refuses such a folder, naming it.
    data["model"]["family"] = "flux_kontext"
    with pytest.raises(ValueError, match=r"refs is a folder of 2 reference images, but family 'flux_kontext'"):
        edit_samples(StageContext(parse_config(data)), {}, (64, 64))


def test_rendered_latents_are_laid_out_as_the_cache(flux2_run):
    """The edit learning check (dataset.demo: edit) compares renders with the cache: the pipeline's packed
    output_type="latent" tokens laid out as the pipeline's own unpack and unpatchify do."""
    ctx, _ = flux2_run
    fam = get_family(FAMILY)
    pipe = fam.load_pipeline(fam.ensure_model(None, ctx.workdir / "models"), torch.float32, CPU)
    tokens = torch.randn(2, 16, 128, generator=torch.Generator().manual_seed(0))
    _, ids = pipe.prepare_latents(2, 32, 64, 64, torch.float32, CPU, None, latents=torch.zeros(2, 128, 4, 4))
    want = pipe._unpatchify_latents(pipe._unpack_latents_with_ids(tokens, ids))
    assert torch.equal(fam.rendered_latents(tokens, 64, 64, pipe.vae), want)
