"""Render the validation prompts from the trained result with the one renderer every family uses."""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

from tuneline.schemas.demo import DEMO_COLORS
from tuneline.schemas.validate import RenderedImage
from tuneline.stages.common import markdown as md
from tuneline.stages.families import resolve as models
from tuneline.stages.render.renderer import Renderer, Sample, grid, render_size_for
from tuneline.stages.text import effective_max_length
from tuneline.stages.train.export import lora_loader
from tuneline.stages.validate import edits as edits_mod
from tuneline.stages.validate.clips import clip_frames, render_clips
from tuneline.stages.validate.colors import color_accuracy
from tuneline.stages.validate.learning import log_image, render_check, separation, square_class_means
from tuneline.stages.validate.motion import check_motion


def load_renderer(ctx, model_dir: Path, *, lora: Path | None = None, trained_text: bool = False) -> Renderer:
    """Prompts encoded at training's max length; encodings kept in the workdir across validate runs, keyed by
    the text encoders' identity, the length and the dtype, unless the text encoders were trained too
    (`trained_text`, train.text_encoder_lora: the LoRA file's encoders encode every prompt live)."""
    cfg = ctx.cfg
    dev = models.device(cfg)
    dtype = models.dtype(cfg, dev)
    length = effective_max_length(cfg)
    cache = (
        ctx.workdir / ".cache" / "validation-prompts.safetensors",
        f"{models.identity(ctx, 'text')}:{length}:{dtype}",
    )
    return Renderer.load(
        models.family(cfg),
        model_dir,
        dev,
        dtype,
        adapt=None if lora is None else lora_loader(cfg.model.family, lora),
        max_length=length,
        prompt_cache=None if trained_text else cache,
        input_area=models.input_area(cfg),
    )


def trained_renderer(ctx, upstream: dict) -> Renderer:
    """full: the published pipeline folder; lora: the base pipeline with the LoRA weights loaded, as a user would."""
    final = models.artifact_dir(ctx, upstream["train"]) / upstream["train"].final
    if upstream["train"].mode == "lora":
        return load_renderer(ctx, models.model_dir(ctx), lora=final, trained_text=upstream["train"].text_encoder_lora)
    return load_renderer(ctx, final)


def render_prompts(ctx, renderer: Renderer, work: Path) -> list[RenderedImage]:
    v = ctx.cfg.validate_
    width, height = render_size_for(ctx.cfg)
    samples = [Sample(p.prompt, p.negative_prompt, p.seed) for p in v.prompts]
    if ctx.cfg.dataset.demo == "video":  # the video demo's showcase: every direction of motion, the seeds in turn
        from tuneline.stages.scan.video_demo import DIRECTIONS, showcase

        texts = showcase(max(len(v.prompts), len(DIRECTIONS)))
        samples = [Sample(text, "", v.prompts[i % len(v.prompts)].seed) for i, text in enumerate(texts)]
    if clip_frames(ctx.cfg) > 1:  # a video family: clips, and a contact sheet for the grid
        return render_clips(ctx, renderer, work, samples, (width, height))
    ctx.log.info("validate: rendering %d prompts at %dx%d, %d steps", len(samples), width, height, v.steps)
    started = time.monotonic()
    images = renderer.render(samples, width, height, v.steps, v.guidance_scale)
    rendered = []
    for i, (s, img) in enumerate(zip(samples, images)):
        name = f"{i:03d}-seed{s.seed}.png"
        img.save(work / name)
        log_image(ctx, i, len(samples), name, s, started)
        rendered.append(
            RenderedImage(
                file=name,
                prompt=s.prompt,
                negative_prompt=s.negative_prompt,
                seed=s.seed,
                width=img.width,
                height=img.height,
            )
        )
    grid(images).save(work / "grid.png")
    return rendered


def check_learning(ctx, trained: Renderer, upstream: dict) -> dict:
    """The demo's learning checks for the trained and the untrained model, same seeds and settings: class
    separation of the sampled latents, and the prompted color's share of the decoded images (colors.py)."""
    cfg = ctx.cfg
    if (got := square_class_means(ctx, upstream, "learning check")) is None:
        return {}
    width, height, means = got
    facts = {}
    for prefix, renderer in (("", trained), ("untrained_", None)):
        ctx.log.info(
            "learning check: rendering %d samples with the %s model",
            len(DEMO_COLORS) * cfg.validate_.check_seeds,
            "untrained" if prefix else "trained",
        )
        renderer = renderer or load_renderer(ctx, models.model_dir(ctx))
        colors, latents = render_check(renderer, cfg, (width, height))
        acc = separation(latents, colors, means)
        if acc is None:
            ctx.log.warning(
                "learning check skipped: the %s pipeline's latents are not (C, H, W) like the cache", cfg.model.family
            )
            return {}
        facts[f"{prefix}class_separation_accuracy"] = acc
        facts[f"{prefix}color_accuracy"] = color_accuracy(renderer.decode(latents), colors)
        ctx.reporter.progress(
            "validate-progress",
            0.75 if not prefix else 0.95,
            f"learning check: {'trained' if not prefix else 'untrained'} model done",
        )
    ctx.log.info(
        "learning check: class separation trained %.2f, untrained %.2f; color accuracy trained %.2f, untrained %.2f",
        facts["class_separation_accuracy"],
        facts["untrained_class_separation_accuracy"],
        facts["color_accuracy"],
        facts["untrained_color_accuracy"],
    )
    return facts


def build(ctx, work: Path, upstream: dict) -> dict:
    v = ctx.cfg.validate_
    ctx.log.info("validate: loading the trained %s pipeline", upstream["train"].mode)
    renderer = trained_renderer(ctx, upstream)
    ctx.reporter.progress("validate-progress", 0.1, "pipeline loaded")
    edits = edits_mod.edit_samples(ctx, upstream, render_size_for(ctx.cfg))
    if edits:  # an edit family with controls: control | result per row
        rendered, controls = edits_mod.render_edits(ctx, renderer, work, edits)
    else:
        rendered, controls = render_prompts(ctx, renderer, work), []
    ctx.reporter.progress("validate-progress", 0.5, f"{len(rendered)} prompts rendered")
    facts = {"images": [r.model_dump() for r in rendered], "grid": "grid.png"} | (
        {"controls": controls} if controls else {}
    )
    if upstream["train"].text_encoder_lora:  # prompts encoded live by the LoRA file's text encoders
        facts["prompts_encoded_by"] = "trained text encoders"
    untrained = partial(load_renderer, ctx, models.model_dir(ctx))
    if v.learning_check and ctx.cfg.dataset.demo == "edit":
        facts |= edits_mod.check_edits(ctx, renderer, upstream, untrained)
    elif v.learning_check and ctx.cfg.dataset.demo == "video":
        facts |= check_motion(ctx, renderer, upstream, untrained)
    elif v.learning_check:
        facts |= check_learning(ctx, renderer, upstream)
    ctx.reporter.progress("validate-progress", 1.0, "done")
    report(ctx, work, rendered, facts, upstream["train"])
    return facts


def report(ctx, work: Path, rendered: list[RenderedImage], facts: dict, train) -> None:
    """Markdown table of every file with its prompt and seed, under the path the artifact is about to be published
    under. File names, not links: a browser opens neither a relative link nor a file:// one from the UI (the flows
    add the pictures themselves inline)."""
    published = work.parent / work.name.removeprefix(".").removesuffix(".partial")
    rows = "\n".join(
        f"| {md.text(r.file)} | {md.text(r.prompt)} | {md.text(r.negative_prompt)} | {r.seed} | {r.width}x{r.height} |"
        for r in rendered
    )
    text = (
        f"| file | prompt | negative | seed | size |\n|---|---|---|---|---|\n{rows}\n\n"
        f"Files in {md.text(published)}; grid: {md.text(facts['grid'])}; training loss curve: "
        f"{md.text(models.artifact_dir(ctx, train) / train.loss_curve)}"
    )
    if "class_separation_accuracy" in facts:
        text += (
            f"\n\nLearning check: class separation accuracy {facts['class_separation_accuracy']:.2f} trained, "
            f"{facts['untrained_class_separation_accuracy']:.2f} untrained (chance {1 / len(DEMO_COLORS):.2f}); "
            f"prompted color rendered {facts['color_accuracy']:.2f} trained, "
            f"{facts['untrained_color_accuracy']:.2f} untrained"
        )
    if "edit_color_accuracy" in facts:
        text += (
            f"\n\nEdit learning check: instructed color {facts['edit_color_accuracy']:.2f} trained, "
            f"{facts['untrained_edit_color_accuracy']:.2f} untrained (chance {1 / len(DEMO_COLORS):.2f})"
        )
    if "motion_accuracy" in facts:
        text += (
            f"\n\nMotion learning check: prompted direction {facts['motion_accuracy']:.2f} trained, "
            f"{facts['untrained_motion_accuracy']:.2f} untrained (chance 0.25)"
        )
    ctx.reporter.markdown("validate-images", text, "validation images")
