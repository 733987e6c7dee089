"""Validation of an edit family (one that takes a control image): render edits through the stock pipeline, and the
edit demo's learning check.

The edits are validate.controls ({image, prompt}) or, without them, the first N training pairs' controls with their
captions (N = the number of validation prompts, each lending its seed); the edit demo's are its showcase (every
instruction color on several shapes and source colors, stages/scan/edit_demo.py). Each control is resized to the render size,
as training saw it at its image's size. The grid shows control | result per row.

The edit learning check (dataset.demo: edit): new controls of one color with "make it <color>" for every demo color;
the share of results whose latent is nearest the instructed color's mean cached target latent (as the shapes demo's
class separation, stages/validate/learning.py), for the trained and the untrained model.
"""

from __future__ import annotations

import io
import time
from pathlib import Path

import torch
from PIL import Image

from tuneline.schemas.scan import IMAGE_EXTENSIONS, ScanManifest
from tuneline.schemas.validate import RenderedImage
from tuneline.stages.caption import upstream_captions
from tuneline.stages.common.jsonl import read_jsonl
from tuneline.stages.families import resolve as models
from tuneline.stages.render.renderer import Renderer, Sample, grid, render_size_for
from tuneline.stages.scan.images import load_rgb
from tuneline.stages.scan.members import ControlMember, control_file
from tuneline.stages.validate.learning import log_image, separation, square_class_means, trained_and_untrained


def takes_control(cfg) -> bool:
    return models.family(cfg).takes_control


def _training_pairs(ctx, upstream: dict, n: int) -> list[tuple[Path, str]]:
    """(control file, caption) of the first `n` training pairs, in record order."""
    scan_dir = ctx.store.version_dir("scan", upstream["latents"].upstream["scan"])
    roots = ScanManifest.model_validate_json((scan_dir / "manifest.json").read_text()).control_sources()
    captions = upstream_captions(ctx, upstream) or {}
    seen, out = set(), []
    for r in read_jsonl(scan_dir / "images.jsonl"):
        ref = r["path"] if r.get("source") is None else f"{r['source']}//{r['path']}"
        if len(out) == n:
            break
        if r.get("control_path") and ref not in seen:
            seen.add(ref)
            out.append((control_file(roots, r), captions.get(ref, r["caption"])))
    return out


def load_control(path: Path | ControlMember, size: tuple[int, int]) -> Image.Image | list[Image.Image]:
    """The control image at `size`, or a folder's reference images (name order) each at `size`."""
    if isinstance(path, ControlMember):  # a sample's control member, read by its byte range
        return load_rgb(io.BytesIO(path.read_bytes())).resize(size, Image.Resampling.BICUBIC)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)
        if not files:
            raise ValueError("the folder holds no image")
        return [load_rgb(p).resize(size, Image.Resampling.BICUBIC) for p in files]
    return load_rgb(path).resize(size, Image.Resampling.BICUBIC)


def control_strip(image: Image.Image | list[Image.Image]) -> Image.Image:
    """One picture of a sample's control: the image, or its references side by side."""
    if not isinstance(image, list):
        return image
    strip = Image.new("RGB", (sum(i.width for i in image), max(i.height for i in image)))
    x = 0
    for i in image:
        strip.paste(i, (x, 0))
        x += i.width
    return strip


def edit_samples(ctx, upstream: dict, size: tuple[int, int]) -> list[Sample]:
    """The edits to render, each control at the render size; empty when there is nothing to edit."""
    v = ctx.cfg.validate_
    if not takes_control(ctx.cfg):
        return []
    if not v.controls and ctx.cfg.dataset.demo == "edit":  # every instruction color, on several shapes and colors
        from tuneline.stages.scan.edit_demo import showcase

        return [
            Sample(text, "", p.seed, img.resize(size)) for (text, img), p in zip(showcase(len(v.prompts)), v.prompts)
        ]
    if v.controls:
        wanted = [(Path(c.image), c.prompt, c.seed) for c in v.controls]
    else:
        pairs = _training_pairs(ctx, upstream, len(v.prompts))
        wanted = [(path, caption, p.seed) for (path, caption), p in zip(pairs, v.prompts)]
    out = []
    for path, prompt, seed in wanted:
        try:
            image = load_control(path, size)
        except (OSError, ValueError) as err:
            raise ValueError(
                f"validate.controls image {path} cannot be read ({err}): fix the path or the file"
            ) from None
        several = isinstance(image, list) and len(image) > 1
        if several and not models.family(ctx.cfg).multiple_references:
            raise ValueError(
                f"validate.controls image {path} is a folder of {len(image)} reference images, but family "
                f"{ctx.cfg.model.family!r} takes one control image: name one image"
            )
        out.append(Sample(prompt, "", seed, image[0] if isinstance(image, list) and len(image) == 1 else image))
    return out


def render_edits(ctx, renderer: Renderer, work: Path, samples: list[Sample]) -> tuple[list[RenderedImage], list[str]]:
    """Render the edits; (rendered images, their control files). grid.png: control | result per row."""
    v = ctx.cfg.validate_
    width, height = render_size_for(ctx.cfg)
    ctx.log.info("validate: rendering %d edits at %dx%d, %d steps", len(samples), width, height, v.steps)
    started = time.monotonic()
    images = renderer.render(samples, width, height, v.steps, v.guidance_scale)
    rendered, controls, cells = [], [], []
    for i, (s, img) in enumerate(zip(samples, images)):
        name, control = f"{i:03d}-seed{s.seed}.png", f"{i:03d}-control.png"
        img.save(work / name)
        log_image(ctx, i, len(samples), name, s, started)
        strip = control_strip(s.image)  # several references: side by side, squeezed into the grid's cell
        strip.save(work / control)
        cells += [strip if strip.size == img.size else strip.resize(img.size, Image.Resampling.BICUBIC), img]
        controls.append(control)
        rendered.append(
            RenderedImage(
                file=name, prompt=s.prompt, negative_prompt="", seed=s.seed, width=img.width, height=img.height
            )
        )
    labelled_grid(cells, [s.prompt for s in samples]).save(work / "grid.png")
    return rendered, controls


LABEL_HEIGHT = 14  # pixels of the band above each row: one line of Pillow's default font


def labelled_grid(cells: list[Image.Image], labels: list[str]) -> Image.Image:
    """control | result per row, each row under a band naming its instruction: the grid alone says what each
    edit was asked to do, so a person checks it by eye."""
    from PIL import ImageDraw

    rows = grid(cells, cols=2)
    h = rows.height // len(labels)
    out = Image.new("RGB", (rows.width, rows.height + LABEL_HEIGHT * len(labels)), (255, 255, 255))
    draw = ImageDraw.Draw(out)
    for i, label in enumerate(labels):
        top = i * (h + LABEL_HEIGHT)
        draw.text((2, top + 1), label, fill=(0, 0, 0))
        out.paste(rows.crop((0, i * h, rows.width, (i + 1) * h)), (0, top + LABEL_HEIGHT))
    return out


def instructed_accuracy(renderer: Renderer, cfg, size: tuple[int, int], means: dict) -> float | None:
    """Share of the check's edits (new controls, each "make it <color>") whose result's latent is nearest the
    instructed color's mean cached target latent; None when the rendered latents are not laid out like the cache."""
    from tuneline.stages.scan.edit_demo import check_controls, instruction

    v, (width, height) = cfg.validate_, size
    pairs = check_controls(v.check_seeds)
    samples = [
        Sample(instruction(c), "", 1000 + i, img.resize((width, height), Image.Resampling.BICUBIC))
        for i, (c, img) in enumerate(pairs)
    ]
    out = renderer.render(samples, width, height, v.check_steps, v.guidance_scale, output_type="latent")
    latents = torch.stack([torch.as_tensor(t) for t in out]).float().cpu()
    # the family lays its pipeline's output out as the cache (packed tokens, raw VAE scale)
    latents = models.family(cfg).rendered_latents(latents, width, height, renderer.pipe.vae)
    return separation(latents, [c for c, _ in pairs], means)


def check_edits(ctx, trained: Renderer, upstream: dict, load_untrained) -> dict:
    """edit_color_accuracy and untrained_edit_color_accuracy of the edit demo (module docstring)."""
    if (got := square_class_means(ctx, upstream, "edit learning check")) is None:
        return {}
    width, height, means = got

    def measure(renderer: Renderer) -> float | None:
        return instructed_accuracy(renderer, ctx.cfg, (width, height), means)

    return trained_and_untrained(ctx, "edit_color_accuracy", "edit learning check", trained, load_untrained, measure)
