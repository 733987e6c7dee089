"""Helpers shared by the train/validate integration tests (this module holds no tests): small demo-based configs,
the upstream caches, a calibrated copy of the tiny model, one stage at a time through the real stage runner."""
from __future__ import annotations

import copy
import shutil
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from schemas.config import PipelineConfig, parse_config
from schemas.demo import DEMO_CONFIG
from stages.common.stage import StageContext, run_stage
from stages.common.report import Reporter
from stages.families.registry import get_family
from stages.pipeline import PIPELINE, stage
from stages.scan.demo import write_demo_dataset

ROOT = Path(__file__).resolve().parents[2]


class RecordingReporter(Reporter):
    """Keeps what a stage reported, as the Prefect reporter would publish it."""

    def __init__(self) -> None:
        self.progress_calls: list[tuple[str, float]] = []
        self.markdowns: dict[str, str] = {}

    def progress(self, key: str, fraction: float, description: str = "") -> None:
        self.progress_calls.append((key, fraction))

    def markdown(self, key: str, text: str, description: str = "") -> None:
        self.markdowns[key] = text


def small_config(workdir: Path, train: dict, **sections: dict) -> PipelineConfig:
    """The demo config in `workdir` with `train` keys overridden and the learning check off (unless asked)."""
    data = copy.deepcopy(DEMO_CONFIG)
    data["workdir"] = str(workdir)
    data["train"] = {**data["train"], **train}
    data["validate"] = {**data["validate"], "learning_check": False}
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    return parse_config(data)


def build_upstream(cfg: PipelineConfig, reporter: Reporter | None = None) -> StageContext:
    write_demo_dataset(cfg.resolve(cfg.dataset.path))
    ctx = StageContext(cfg, reporter=reporter or Reporter())
    for name in ("scan", "latents", "text"):
        run_stage(ctx, stage(name), PIPELINE)
    return ctx


def train(cfg: PipelineConfig, reporter: Reporter | None = None) -> Path:
    return run_stage(StageContext(cfg, reporter=reporter or Reporter()), stage("train"), PIPELINE)[0]


def calibrated_tiny(out: Path, images: list[Path]) -> Path:
    """A copy of the tiny flavor whose random-init VAE is calibrated the way a trained VAE is: a near-deterministic
    posterior (log-variance bias -12) and the scaling factor that gives the latent means of `images` unit std.

    The shipped tiny VAE keeps SD's 0.18215, which leaves its latents at std ~0.03 with posterior noise 5x the
    image signal, and diffusion training on that barely learns in a demo's budget (see the report on issue 6)."""
    from diffusers import AutoencoderKL

    base = get_family("tiny").ensure_model(None, out.parent / "models")
    shutil.copytree(base, out)
    vae = AutoencoderKL.from_pretrained(out, subfolder="vae")
    c = vae.config.latent_channels
    with torch.no_grad():
        vae.quant_conv.weight[c:] = 0
        vae.quant_conv.bias[c:] = -12.0
        pixels = torch.stack([_pixels(p) for p in images])
        means = vae.encode(pixels).latent_dist.mean
    vae.register_to_config(scaling_factor=float(1.0 / means.std()))
    shutil.rmtree(out / "vae")
    vae.save_pretrained(out / "vae", safe_serialization=True)
    return out


def _pixels(path: Path) -> torch.Tensor:
    img = Image.open(path).convert("RGB").resize((64, 64))
    return torch.from_numpy(np.asarray(img, dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1)
