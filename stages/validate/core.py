"""Render validation images from the trained result with one renderer for every family."""
from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image

from schemas.families import facts as family_facts
from schemas.validate import RenderedImage
from stages.common import models
from stages.common.sizing import render_size
from stages.validate.learning import learning_check


class Renderer:
    """A loaded pipeline + live text encoders; prompts are encoded through the family adapter."""

    def __init__(self, fam, model_dir: Path, device: torch.device, dtype: torch.dtype):
        self.fam, self.device = fam, device
        self.pipe = fam.load_pipeline(model_dir, dtype, device)
        self.pipe.set_progress_bar_config(disable=True)
        self.enc = fam.load_text_encoders(model_dir, dtype, device)

    def __call__(self, prompt: str, negative: str, seed: int, width: int, height: int, steps: int,
                 guidance: float, output_type: str = "pil"):
        with torch.no_grad():
            text = self.fam.encode_text(self.enc, [prompt])
            neg = self.fam.encode_text(self.enc, [negative])
            # The generator lives on the device of the latents it feeds, seeded per prompt.
            gen = torch.Generator(device=self.device).manual_seed(seed)
            out = self.pipe(**self.fam.prompt_kwargs(text, neg), width=width, height=height,
                            num_inference_steps=steps, guidance_scale=guidance, generator=gen,
                            output_type=output_type)
        return out.images


def grid(images: list[Image.Image], cols: int = 4) -> Image.Image:
    cols = max(1, min(cols, len(images)))
    rows = (len(images) + cols - 1) // cols
    w = max(i.width for i in images)
    h = max(i.height for i in images)
    canvas = Image.new("RGB", (cols * w, rows * h), (0, 0, 0))
    for n, img in enumerate(images):
        canvas.paste(img, ((n % cols) * w, (n // cols) * h))
    return canvas


def render_size_for(cfg, aspect: float | None = None) -> tuple[int, int]:
    """Pixel or area units, converted and aligned by the same function the scan uses."""
    v, b = cfg.validate_, cfg.buckets
    align = b.alignment or family_facts(cfg.model.family).alignment
    return render_size(v.resolution or b.resolution, v.resolution_type or b.resolution_type, align,
                       v.aspect if aspect is None else aspect)


def build(ctx, work: Path, upstream: dict) -> dict:
    cfg, v = ctx.cfg, ctx.cfg.validate_
    fam = models.family(cfg)
    dev = models.device(cfg)
    dt = models.dtype(cfg, dev)
    final = models.artifact_dir(ctx, upstream["train"]) / "final"
    renderer = Renderer(fam, final, dev, dt)
    width, height = render_size_for(cfg)
    rendered, pictures = [], []
    for i, p in enumerate(v.prompts):
        img = renderer(p.prompt, p.negative_prompt, p.seed, width, height, v.steps, v.guidance_scale)[0]
        name = f"{i:03d}-seed{p.seed}.png"
        img.save(work / name)
        pictures.append(img)
        rendered.append(RenderedImage(file=name, prompt=p.prompt, negative_prompt=p.negative_prompt, seed=p.seed,
                                      width=img.width, height=img.height))
        ctx.reporter.progress("validate-progress", (i + 1) / len(v.prompts), f"{i + 1} prompts rendered")
    grid(pictures).save(work / "grid.png")
    facts = {"images": [r.model_dump() for r in rendered], "grid": "grid.png"}
    if v.learning_check:
        base = Renderer(fam, models.model_dir(ctx), dev, dt)
        latents_dir = models.artifact_dir(ctx, upstream["latents"])
        square = render_size_for(cfg, aspect=1.0)
        facts["class_separation_accuracy"] = learning_check(renderer, latents_dir, upstream["latents"], cfg, square)
        facts["untrained_class_separation_accuracy"] = learning_check(base, latents_dir, upstream["latents"], cfg, square)
        ctx.log.info("learning check: trained %.2f, untrained %.2f", facts["class_separation_accuracy"],
                     facts["untrained_class_separation_accuracy"])
    rows = "\n".join(f"| {r.file} | {r.prompt} | {r.negative_prompt} | {r.seed} |" for r in rendered)
    ctx.reporter.markdown("validate-images", f"Rendered into `{work.name}`\n\n| file | prompt | negative | seed |\n"
                          f"|---|---|---|---|\n{rows}", "validation images")
    return facts
