"""What the family tests share: the captioned dataset, a run of every stage in a fresh workdir, each family's tiny
model folder built once, and a LoRA whose up weights training has moved off zero."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch
from PIL import Image

from tuneline.stages.common.stage import StageContext, run_stage
from tuneline.stages.families.registry import get_family
from tuneline.stages.pipeline import PIPELINE, stages_for
from tuneline.stages.train.export import ExportInfo

CAPTIONS = ["red, square, bright", "blue, circle", "red, square, bright", "green, circle, small"]


def write_dataset(folder: Path) -> None:
    """Four 64 px images with their captions (two alike, so caption statistics have a repeat)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, caption in enumerate(CAPTIONS):
        Image.new("RGB", (64, 64), (60 * i, 140, 220 - 50 * i)).save(folder / f"{i}.png")
        (folder / f"{i}.txt").write_text(caption, encoding="utf-8")


def run_all(ctx: StageContext) -> dict[str, Path]:
    """Every stage of the config through the runner the flows use; each must build (a fresh workdir)."""
    out = {}
    for sd in stages_for(ctx.cfg):
        path, built = run_stage(ctx, sd, PIPELINE)
        assert built, f"{sd.name} should build in a fresh workdir"
        out[sd.name] = path
    return out


def tiny_models(cache: Path) -> Callable[[str], Path]:
    """family name -> its tiny model folder under `cache`, built on first use."""
    return functools.cache(lambda name: get_family(name).ensure_model(None, cache))


def lift_lora_up(trainable: dict[str, torch.nn.Parameter], scale: float) -> None:
    """Random up (lora_B) weights, seeded: a LoRA as training leaves it (peft starts them at zero, a no-op)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in trainable.items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)


def render_latents(pipe) -> torch.Tensor:
    """The stock pipeline's latents for one fixed prompt and seed (2 steps at 64 px): equal before and after a
    change only if the change did not reach the model."""
    return pipe(
        "a red square",
        num_inference_steps=2,
        height=64,
        width=64,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
    ).images


def export_info(**changes) -> ExportInfo:
    """A run's export facts for the files' headers: a 64 px run started at a fixed time, with `changes`."""
    facts = dict(
        train_version="v", base_identity="sha256:base", steps=1, num_train_images=1, resolution=64, started_at=1.7e9
    )
    return ExportInfo(**(facts | changes))
