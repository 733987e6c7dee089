"""Qwen-Image-Edit Plus (2509) with its tiny flavor on CPU: conditioning as QwenImageEditPlusPipeline builds it (a
"Picture i" vision block per input image, each image's tokens after the target's), and one shared scan -> validate
run (LoRA, 2 steps) on targets with two references each (controls/<stem>/*.png): text rows per (instruction,
control images), an edited reference re-encoding its own rows, the LoRA in the stock Plus pipeline rendering as
trained. The stock pipeline VAE-encodes every input image at about a megapixel: the tests render one edit each."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.integration.stock_edit import assert_qwen_edit_renders_as_validated, grid_pictures, stock_qwen_edit_forward
from tests.integration.test_qwen_edit_family import _config, _shape
from tuneline.schemas.config import parse_config
from tuneline.schemas.text import TextManifest
from tuneline.schemas.validate import ValidateManifest
from tuneline.stages.common.stage import StageContext, run_stage
from tuneline.stages.families.registry import get_family
from tuneline.stages.pipeline import PIPELINE, stage, stages_for

pytestmark = pytest.mark.slow
FAMILY = "qwen_image_edit_plus"
CPU = torch.device("cpu")
# (reference colors, target color, shape): the caption is the instruction "make it <target color>".
PAIRS = [(("red", "green"), "blue", "square"), (("yellow", "blue"), "red", "circle")]


def _write_pairs(workdir: Path) -> None:
    (workdir / "pairs").mkdir(parents=True)
    for i, (refs, dst, shape) in enumerate(PAIRS):
        _shape(dst, shape).save(workdir / "pairs" / f"{i}.png")
        (workdir / "pairs" / f"{i}.txt").write_text(f"make it {dst}")
        (workdir / "pairs-controls" / str(i)).mkdir(parents=True)
        for j, color in enumerate(refs):
            _shape(color, shape).save(workdir / "pairs-controls" / str(i) / f"{j}.png")


def _plus_config(workdir: Path):
    data = _config(workdir, family=FAMILY).model_dump(by_alias=True)
    data["text"]["max_length"] = 128  # two images' 16 vision tokens each, their "Picture i" blocks, the instruction
    return parse_config(data)


@pytest.fixture(scope="session")
def plus_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("qwen-edit-plus") / "w"
    _write_pairs(workdir)
    ctx = StageContext(_plus_config(workdir))
    paths = {sd.name: run_stage(ctx, sd, PIPELINE)[0] for sd in stages_for(ctx.cfg)}
    return ctx, paths


def _refs(ctx, i: int, size: int | None = None) -> list[Image.Image]:
    folder = ctx.cfg.resolve(ctx.cfg.dataset.control) / str(i)
    images = [Image.open(p).convert("RGB") for p in sorted(folder.iterdir())]
    return [im.resize((size, size), Image.Resampling.BICUBIC) for im in images] if size else images


def test_conditioning_matches_the_stock_plus_pipeline(plus_run):
    """encode_text of (instruction, images) is QwenImageEditPlusPipeline.encode_prompt's for one and for several
    images (also inside a batch of captions, as the text cache encodes them); the references are packed as its
    prepare_latents packs them and the transformer sees them with its img_shapes, one entry per image."""
    from tuneline.stages.families.qwen_image.adapter import pack_latents, unpack_latents
    from tuneline.stages.families.qwen_image_edit_plus.adapter import PLUS_TEMPLATE, condition_image

    ctx, _ = plus_run
    fam = get_family(FAMILY)
    pipe = fam.load_pipeline(fam.ensure_model(None, ctx.workdir / "models"), torch.float32, CPU)
    enc = fam.text_encoders_of(pipe, 192)
    assert pipe.prompt_template_encode == PLUS_TEMPLATE and pipe.prompt_template_encode_start_idx == 64
    wide = Image.new("RGB", (80, 48), (10, 20, 200))
    refs = [*_refs(ctx, 0), wide]
    mine = fam.encode_text(enc, ["make it blue", "make it red"], [refs, wide])
    for row, (prompt, images) in enumerate((("make it blue", refs), ("make it red", wide))):
        conds = [condition_image(im) for im in images] if isinstance(images, list) else condition_image(images)
        ref, _ = pipe.encode_prompt(prompt, image=conds, device=CPU)
        n = ref.shape[1]
        torch.testing.assert_close(mine["prompt_embeds"][row : row + 1, :n], ref, atol=1e-5, rtol=1e-5)
        assert mine["prompt_embeds_mask"][row].sum() == n and not mine["prompt_embeds"][row, n:].any()

    shown = [pipe.image_processor.preprocess(im, 48, 80).unsqueeze(2) for im in (wide, _refs(ctx, 1)[0])]
    latents, image_latents = pipe.prepare_latents(shown, 1, 16, 64, 32, torch.float32, CPU, torch.manual_seed(0))
    mean, std = (torch.tensor(s).view(1, 16, 1, 1) for s in fam.latent_stats(pipe.vae))
    with torch.no_grad():
        control = torch.stack([(pipe.vae.encode(x).latent_dist.mode()[:, :, 0] - mean) / std for x in shown], 1)
    torch.testing.assert_close(image_latents, torch.cat([pack_latents(c) for c in control.unbind(1)], 1))
    text, t = fam.encode_text(enc, ["make it red"], [[wide, wide]]), torch.tensor([700.0])
    shapes = [(1, 64 // 16, 32 // 16), (1, 48 // 16, 80 // 16), (1, 48 // 16, 80 // 16)]
    ref = stock_qwen_edit_forward(pipe, latents, image_latents, text, t, shapes)
    with torch.no_grad():
        noisy = unpack_latents(latents, 8, 4)
        got = fam.denoise(pipe.transformer, noisy, t, text | {"control_latents": control})
        first = fam.denoise(pipe.transformer, noisy, t, text | {"control_latents": control[:, 0]})
    torch.testing.assert_close(pack_latents(got), ref)
    assert not torch.allclose(got, first), "the second reference must matter"


def test_text_rows_per_instruction_and_control_images(plus_run, tmp_path):
    """One row per (instruction, the target's references) and the empty instruction per control folder, each what
    the family encodes with those images; replacing one reference re-encodes that target's two rows only."""
    from tuneline.stages.text.store import TextCache, pair_key

    ctx, paths = plus_run
    text = ctx.store.read(paths["text"], TextManifest)
    assert (text.count, text.encoded) == (1 + 2 * len(PAIRS), 1 + 2 * len(PAIRS))
    cache = TextCache(paths["text"], list(text.fields))
    records = [json.loads(line) for line in (paths["scan"] / "images.jsonl").read_text().splitlines()]
    sha = {Path(r["path"]).stem: r["control_sha256"] for r in records}
    assert all(len(r["control_references"]) == 2 for r in records)
    fam = get_family(FAMILY)
    enc = fam.load_text_encoders(fam.ensure_model(None, ctx.workdir / "models"), torch.float32, CPU, max_length=128)
    want = fam.encode_text(enc, ["make it blue", ""], [_refs(ctx, 0), _refs(ctx, 1)])
    got = cache.get([pair_key("make it blue", sha["0"]), pair_key("", sha["1"])])
    for key in ("prompt_embeds", "prompt_embeds_mask"):
        torch.testing.assert_close(got[key].to(want[key].dtype), want[key], atol=2e-2, rtol=2e-2, msg=key)

    w = tmp_path / "w"
    shutil.copytree(ctx.workdir, w, symlinks=True)
    _shape("green", "circle").save(w / "pairs-controls" / "1" / "1.png")
    ctx2 = StageContext(_plus_config(w))
    run_stage(ctx2, stage("scan"), PIPELINE)
    path, built = run_stage(ctx2, stage("text"), PIPELINE)
    text2 = ctx2.store.read(path, TextManifest)
    assert built and (text2.encoded, text2.reused) == (2, 2 * len(PAIRS) - 1)


def test_lora_in_stock_plus_pipeline_renders_as_trained(plus_run):
    """Validation rendered the first pair's references through the stock pipeline (grid: references | result); the
    exported LoRA loads in QwenImageEditPlusPipeline (load_lora_weights), and the stock pipeline given both
    references renders that edit as the validate stage did."""
    from diffusers import QwenImageEditPlusPipeline

    ctx, paths = plus_run
    val = ctx.store.read(paths["validate"], ValidateManifest)
    [image] = val.images
    assert image.prompt == "make it blue" and val.controls == ["000-control.png"]
    grid_pictures(paths["validate"] / "grid.png", 1)
    # the references as validation hands them: each resized to the render size
    assert_qwen_edit_renders_as_validated(ctx, paths, FAMILY, QwenImageEditPlusPipeline, _refs(ctx, 0, 64))
