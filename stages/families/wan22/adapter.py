"""Wan 2.2 text-to-video, the A14B layout: Wan 2.1's text encoder, VAE, latents and denoiser call
(the Wan 2.1 family's adapter, imported below) with two timestep experts, WanPipeline's `transformer` (high noise) and
`transformer_2` (low noise), split at the folder's `boundary_ratio` (model_index.json). model.expert picks which
train (stages/families/wan22/experts.py): one expert on its share of the timesteps, or both as one run, each
sample's timestep picking its expert; each expert gets its own LoRA files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import torch

from tuneline.schemas.families import FAMILY_FACTS, FamilyFacts
from tuneline.stages.families.wan.adapter import WanFamily
from tuneline.stages.families.wan22.experts import HIGH, LOW, Experts

# Wan2.2-T2V-A14B's boundary_ratio: the high-noise expert denoises t >= 875 of 1000.
TINY_BOUNDARY = 0.875


def folder_experts(model_dir: Path) -> tuple[tuple[str, ...], float | None]:
    """(the expert components a pipeline folder has, high-noise first; its boundary_ratio)."""
    index = json.loads((Path(model_dir) / "model_index.json").read_text(encoding="utf-8"))
    present = tuple(c for c in (HIGH, LOW) if (index.get(c) or [None])[0] is not None)
    return present, index.get("boundary_ratio")


def chosen_experts(model_dir: Path, expert: str | None) -> tuple[tuple[str, ...], float | None]:
    """The components model.expert trains (null: both) and the boundary; ValueError naming the fix where the
    folder has no such expert."""
    present, boundary = folder_experts(model_dir)
    if expert in (None, "both"):
        return present, boundary
    if boundary is None or len(present) < 2:
        raise ValueError(
            f"model.expert {expert}: {model_dir}/model_index.json has one transformer and no boundary_ratio (a "
            f"TI2V 5B folder?), so there is no {expert}-noise expert to pick; remove model.expert"
        )
    return ((HIGH,) if expert == "high" else (LOW,)), boundary


class Wan22Family(WanFamily):
    facts: ClassVar[FamilyFacts] = FAMILY_FACTS["wan22"]

    def build_tiny(self, out_dir: Path) -> None:
        """Two tiny experts split as the A14B's."""
        parts = self.tiny_components(out_dir) | {"transformer_2": self.tiny_transformer()}
        pipe = self.pipeline_class(**parts, boundary_ratio=TINY_BOUNDARY)
        pipe.save_pretrained(out_dir, safe_serialization=True)

    def load_denoiser(
        self, model_dir: Path, dtype: torch.dtype, device: torch.device, expert: str | None = None
    ) -> torch.nn.Module:
        comps, boundary = chosen_experts(model_dir, expert)
        load = self.denoiser_class.from_pretrained
        return Experts({c: load(model_dir, subfolder=c, dtype=dtype).to(device) for c in comps}, boundary)

    def denoiser_parts(self, denoiser: torch.nn.Module) -> dict[str, torch.nn.Module]:
        return dict(denoiser.experts) if isinstance(denoiser, Experts) else super().denoiser_parts(denoiser)

    def sigma_range(self, denoiser: torch.nn.Module) -> tuple[float, float]:
        return denoiser.sigma_range() if isinstance(denoiser, Experts) else (0.0, 1.0)

    def block_stacks(self, model: torch.nn.Module) -> tuple[str, ...]:
        if isinstance(model, Experts):
            return tuple(f"experts.{c}.blocks" for c in model.experts)
        return super().block_stacks(model)

    def lora_load_kwargs(self, component: str) -> dict[str, Any]:
        """diffusers' Wan LoRA loader puts a file's `transformer.` weights into transformer_2 when told to."""
        return {"load_into_transformer_2": True} if component == LOW else {}
