"""Image editing with the qwen_image_edit tiny flavor on CPU: a paired folder through every stage in one shared run
(LoRA, 2 steps); conditioning as QwenImageEditPipeline builds it (the control's tokens beside the target's, the text
encoder seeing the control image); text rows per (instruction, control image), rebuilt for an edited control only;
the LoRA read by the stock QwenImageEditPipeline rendering as trained; text to image without controls.

QwenImageEditPipeline resizes every input image to about 1024 x 1024 pixels, so each edit render VAE-encodes a
megapixel image: the tests render few."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from tests.integration.stock_edit import assert_qwen_edit_renders_as_validated, grid_pictures, stock_qwen_edit_forward
from tuneline.schemas.config import parse_config
from tuneline.schemas.demo import DEMO_CONFIG, RGB
from tuneline.schemas.latents import LatentsManifest
from tuneline.schemas.text import TextManifest
from tuneline.schemas.validate import ValidateManifest
from tuneline.stages.common.stage import StageContext, run_stage
from tuneline.stages.families.registry import get_family
from tuneline.stages.pipeline import PIPELINE, stage, stages_for

pytestmark = pytest.mark.slow
FAMILY = "qwen_image_edit"
CPU = torch.device("cpu")
STEPS = 2
# (control color, target color, shape): the caption is the instruction "make it <target color>".
PAIRS = [
    ("red", "blue", "square"),
    ("green", "yellow", "circle"),
    ("blue", "red", "circle"),
    ("yellow", "green", "square"),
]


def _shape(color: str, shape: str) -> Image.Image:
    img = Image.new("RGB", (64, 64), (245, 245, 245))
    draw = ImageDraw.Draw(img)
    (draw.rectangle if shape == "square" else draw.ellipse)((14, 14, 50, 50), fill=RGB[color])
    return img


def _write_pairs(workdir: Path) -> None:
    (workdir / "pairs").mkdir(parents=True)
    (workdir / "pairs-controls").mkdir()
    for i, (src, dst, shape) in enumerate(PAIRS):
        _shape(dst, shape).save(workdir / "pairs" / f"{i}.png")
        (workdir / "pairs" / f"{i}.txt").write_text(f"make it {dst}")
        _shape(src, shape).save(workdir / "pairs-controls" / f"{i}.png")


def _config(workdir: Path, control: str | None = "pairs-controls", family: str = FAMILY):
    data = copy.deepcopy(DEMO_CONFIG)
    data["workdir"] = str(workdir)
    data["dataset"] = {"path": "pairs", "control": control}
    # The tiny flavor as a model folder: the run encodes input images at the pipeline's own 1 MP, as released sizes
    # do (with model.path null, at the tiny flavor's 64 x 64: tests/unit/test_edit_input_area.py).
    tiny = get_family(family).ensure_model(None, workdir / "models")
    data["model"] = {"family": family, "path": str(tiny), "device": "cpu"}
    data["text"] = {"max_length": 64}  # the tiny processor's 16 vision tokens and a short instruction
    data["train"] |= {"steps": STEPS, "processes": 1, "mode": "lora", "batch_size": 2}
    data["train"] |= {"checkpoint_every": STEPS, "validate_every": 0, "learning_rate": 5e-2}
    data["validate"] |= {"steps": 2, "learning_check": False}
    data["validate"]["prompts"] = data["validate"]["prompts"][:1]  # one edit: each VAE-encodes a megapixel
    return parse_config(data)


@pytest.fixture(scope="session")
def qwen_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("qwen-edit") / "w"
    _write_pairs(workdir)
    cfg = _config(workdir)
    ctx = StageContext(cfg)
    paths = {sd.name: run_stage(ctx, sd, PIPELINE)[0] for sd in stages_for(cfg)}
    return ctx, paths


def _control(ctx, i: int) -> Image.Image:
    return Image.open(ctx.cfg.resolve(ctx.cfg.dataset.control) / f"{i}.png").convert("RGB")


def test_text_rows_are_per_instruction_and_control_image(qwen_run):
    """One row per (instruction, control image), and the empty instruction per control image for caption dropout,
    each what the family encodes for that instruction with that image (plus the plain empty row 0)."""
    from tuneline.stages.text.store import TextCache, pair_key

    ctx, paths = qwen_run
    text = ctx.store.read(paths["text"], TextManifest)
    assert (text.count, text.encoded) == (1 + 2 * len(PAIRS), 1 + 2 * len(PAIRS))
    cache = TextCache(paths["text"], list(text.fields))
    assert cache.paired
    records = [json.loads(line) for line in (paths["scan"] / "images.jsonl").read_text().splitlines()]
    sha = {Path(r["path"]).stem: r["control_sha256"] for r in records}
    fam = get_family(FAMILY)
    enc = fam.load_text_encoders(fam.ensure_model(None, ctx.workdir / "models"), torch.float32, CPU, max_length=64)
    want = fam.encode_text(enc, ["make it blue", "", ""], [_control(ctx, 0), _control(ctx, 0), _control(ctx, 1)])
    got = cache.get([pair_key("make it blue", sha["0"]), pair_key("", sha["0"]), pair_key("", sha["1"])])
    for key in ("prompt_embeds", "prompt_embeds_mask"):
        torch.testing.assert_close(got[key].to(want[key].dtype), want[key], atol=2e-2, rtol=2e-2, msg=key)
    assert not torch.allclose(got["prompt_embeds"][1], got["prompt_embeds"][2]), "the control image must matter"
    assert not torch.allclose(got["prompt_embeds"][0], got["prompt_embeds"][1]), "the instruction must matter"


def test_validation_renders_edits_through_the_stock_pipeline(qwen_run):
    ctx, paths = qwen_run
    val = ctx.store.read(paths["validate"], ValidateManifest)
    assert [i.prompt for i in val.images] == ["make it blue"]
    assert val.controls == ["000-control.png"]
    left = grid_pictures(paths["validate"] / "grid.png", 1)[:64, :64]
    assert np.array_equal(left, np.asarray(_control(ctx, 0)))


def test_lora_in_stock_edit_pipeline_renders_as_trained(qwen_run):
    """The exported LoRA loads in diffusers' QwenImageEditPipeline (load_lora_weights), changes its transformer, and
    the stock pipeline renders the validation edit as the trained model rendered it (the same pixels)."""
    from diffusers import QwenImageEditPipeline

    ctx, paths = qwen_run
    assert_qwen_edit_renders_as_validated(ctx, paths, FAMILY, QwenImageEditPipeline, _control(ctx, 0))


def test_controls_are_cached_at_the_pipelines_input_size(qwen_run):
    """QwenImageEditPipeline VAE-encodes its input at about 1 MP whatever the output size: the 64-pixel targets'
    controls are cached as the 1024 x 1024 images it encodes (the manifest's control_shapes, checked by the reader
    the training batch reads through), near the pipeline's own image_latents of that control (it resizes with
    another filter)."""
    from tuneline.stages.families.qwen_image.adapter import pack_latents
    from tuneline.stages.latents import controls
    from tuneline.stages.latents.reader import LatentReader

    ctx, paths = qwen_run
    lat = ctx.store.read(paths["latents"], LatentsManifest)
    assert [tuple(b.shape) for b in lat.buckets] == [(16, 8, 8)]
    assert lat.control_shapes == {b.array: [16, 128, 128] for b in lat.buckets}
    reader = LatentReader(paths["latents"], lat)
    [bucket] = reader.shapes
    row = [Path(p).stem for p in reader.paths[bucket]].index("0")
    got = controls.read(reader, reader.batch(bucket, np.array([row])))
    assert tuple(got.shape) == (1, 16, 128, 128)
    fam = get_family(FAMILY)
    pipe = fam.load_pipeline(fam.ensure_model(None, ctx.workdir / "models"), torch.float32, CPU)
    image = pipe.image_processor.preprocess(_control(ctx, 0), 1024, 1024).unsqueeze(2)
    _, want = pipe.prepare_latents(image, 1, 16, 64, 64, torch.float32, CPU, torch.manual_seed(0))
    mean, std = (torch.tensor(s).view(1, 16, 1, 1) for s in fam.latent_stats(pipe.vae))
    got = pack_latents((got - mean) / std)
    assert got.shape == want.shape
    assert torch.corrcoef(torch.stack([got.flatten(), want.flatten()]))[0, 1] > 0.98


def test_eval_loss_feeds_the_controls(qwen_run):
    """The held-out eval loss of a paired dataset denoises with each row's control latents, as training does: the
    same rows evaluated without them give another loss."""
    from tests.trainer import trainer_for
    from tuneline.stages.train.evaluation import Evaluator

    ctx, _ = qwen_run
    trainer = trainer_for(ctx.cfg, ctx)
    held = {bucket: [0, 1] for bucket in trainer.data.reader.shapes}
    evaluator = Evaluator(trainer, held, [500])
    paired = evaluator.evaluate()["loss"]
    reader = trainer.data.reader
    reader.manifest = reader.manifest.model_copy(update={"controls": 0})
    assert evaluator.evaluate()["loss"] != paired


def test_an_edited_control_image_re_encodes_only_its_text_rows(qwen_run, tmp_path):
    """The text version covers the control images' content: replacing one control rebuilds the text stage, which
    encodes that control's two rows (its instruction, its empty instruction) and copies the others."""
    ctx, _ = qwen_run
    w = tmp_path / "w"
    shutil.copytree(ctx.workdir, w, symlinks=True)
    cfg = _config(w)
    _shape("blue", "square").save(w / "pairs-controls" / "0.png")
    ctx2 = StageContext(cfg)
    run_stage(ctx2, stage("scan"), PIPELINE)
    path, built = run_stage(ctx2, stage("text"), PIPELINE)
    text = ctx2.store.read(path, TextManifest)
    assert built and (text.encoded, text.reused) == (2, 2 * len(PAIRS) - 1)
    lat_path, _ = run_stage(ctx2, stage("latents"), PIPELINE)
    lat = ctx2.store.read(lat_path, LatentsManifest)
    assert (lat.controls_encoded, lat.controls_reused) == (1, len(PAIRS) - 1)
    # Live encoding takes strings alone: refused for pairs whose text encoder sees the control image.
    data = cfg.model_dump(by_alias=True)
    data["text"]["enabled"] = False
    with pytest.raises(ValueError, match="text.enabled: false.*set text.enabled true"):
        run_stage(StageContext(parse_config(data)), stage("text"), PIPELINE)


def test_conditioning_matches_the_stock_pipeline(qwen_run):
    """Prompt embeddings of (instruction, image) are QwenImageEditPipeline.encode_prompt's; the control latents are
    packed as its prepare_latents packs them and the transformer sees them with its two-entry img_shapes; without
    control latents the denoise is Qwen-Image's."""
    from tuneline.stages.families.qwen_image.adapter import QwenImageFamily, pack_latents, unpack_latents
    from tuneline.stages.families.qwen_image_edit.adapter import prompt_image

    ctx, _ = qwen_run
    fam = get_family(FAMILY)
    pipe = fam.load_pipeline(fam.ensure_model(None, ctx.workdir / "models"), torch.float32, CPU)
    enc = fam.text_encoders_of(pipe, 64)
    images = [_control(ctx, 0), Image.new("RGB", (48, 80), (10, 20, 200))]
    prompts = ["make it blue", "make it a much larger red circle"]
    mine = fam.encode_text(enc, prompts[:1], images[:1])
    ref, _ = pipe.encode_prompt(prompts[:1], image=[prompt_image(images[0])], device=CPU)
    n = ref.shape[1]
    torch.testing.assert_close(mine["prompt_embeds"][:, :n], ref)
    assert mine["prompt_embeds_mask"][0].sum() == n and not mine["prompt_embeds"][:, n:].any()

    image = pipe.image_processor.preprocess(images[1], 80, 48).unsqueeze(2)
    gen = torch.Generator().manual_seed(0)
    latents, image_latents = pipe.prepare_latents(image, 1, 16, 64, 32, torch.float32, CPU, gen)
    stats = [torch.tensor(s).view(1, 16, 1, 1) for s in fam.latent_stats(pipe.vae)]
    with torch.no_grad():
        raw = pipe.vae.encode(image).latent_dist.mode()[:, :, 0]
    control = (raw - stats[0]) / stats[1]  # the cached VAE mean, scaled as the training loop scales it
    torch.testing.assert_close(image_latents, pack_latents(control))
    text = fam.encode_text(enc, prompts[1:], images[1:])
    t = torch.tensor([700.0])
    ref = stock_qwen_edit_forward(
        pipe, latents, image_latents, text, t, [(1, 64 // 16, 32 // 16), (1, 80 // 16, 48 // 16)]
    )
    with torch.no_grad():
        noisy = unpack_latents(latents, 8, 4)
        got = fam.denoise(pipe.transformer, noisy, t, text | {"control_latents": control})
        plain = fam.denoise(pipe.transformer, noisy, t, text)
        assert torch.equal(plain, QwenImageFamily().denoise(pipe.transformer, noisy, t, text))
    torch.testing.assert_close(pack_latents(got), ref)
    assert not torch.allclose(got, plain)


def test_without_controls_it_caches_and_renders_as_text_to_image(qwen_run, tmp_path):
    """dataset.control null: the plain text cache (Qwen-Image's text-only prompts), no control latents, and renders
    through QwenImagePipeline on the same components, as a Qwen-Image model renders (QwenImageEditPipeline needs an
    input image). Training then denoises as Qwen-Image (test_conditioning_matches_the_stock_pipeline)."""
    from tuneline.stages.render.renderer import Renderer, Sample

    ctx, _ = qwen_run
    w = tmp_path / "w"
    shutil.copytree(ctx.workdir / "pairs", w / "pairs")
    shutil.copytree(ctx.workdir / "models", w / "models", symlinks=True)
    cfg = _config(w, control=None)
    ctx2 = StageContext(cfg)
    paths = {name: run_stage(ctx2, stage(name), PIPELINE)[0] for name in ("scan", "latents", "text")}
    text = ctx2.store.read(paths["text"], TextManifest)
    assert text.count == 1 + len(PAIRS) and not (paths["text"] / "controls.jsonl").exists()
    assert not ctx2.store.read(paths["latents"], LatentsManifest).controls
    fam = get_family(FAMILY)
    renderer = Renderer.load(fam, fam.ensure_model(None, w / "models"), CPU, torch.float32, max_length=64)
    [img] = renderer.render([Sample("a red square", "", 0)], 64, 64, 2, 1.0)
    assert img.size == (64, 64)
    assert type(renderer.pipe._tuneline_text_to_image).__name__ == "QwenImagePipeline"


def test_text_to_image_prompts_past_the_pipeline_limit_lose_only_padding():
    """The default max_length (room for vision tokens) exceeds QwenImagePipeline's 1024: text-only prompts are cut
    to 1024 where the rest is masked padding, and refused where it is not."""
    from tuneline.stages.families.qwen_image_edit.adapter import trim_padding

    mask = torch.zeros(1, 1536, dtype=torch.long)
    mask[:, :10] = 1
    embeds = torch.randn(1, 1536, 4)
    kwargs = {"prompt_embeds": embeds, "prompt_embeds_mask": mask, "max_sequence_length": 1536}
    out = trim_padding(kwargs)
    assert out["max_sequence_length"] == 1024 and out["prompt_embeds_mask"].shape == (1, 1024)
    assert torch.equal(out["prompt_embeds"], embeds[:, :1024])
    mask[:, 1100] = 1
    with pytest.raises(ValueError, match="more than 1024 tokens"):
        trim_padding(kwargs)
