"""Wan 2.2 text-to-video, the A14B layout: Wan 2.1's text encoder, VAE, latents and denoiser call
(the Wan 2.1 family's adapter, imported below) with two timestep experts, WanPipeline's `transformer` (high noise) and
`transformer_2` (low noise), split at the folder's `boundary_ratio` (model_index.json). model.expert picks which
train (stages/families/wan22/experts.py): one expert on its share of the timesteps, or both as one run, each
step's timesteps picking one expert on every rank; each expert gets its own LoRA files."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch

from tuneline.schemas.families import FAMILY_FACTS, FamilyFacts
from tuneline.stages.families.base import Place
from tuneline.stages.families.wan.adapter import WanFamily
from tuneline.stages.families.wan22.experts import HIGH, LOW, Experts
from tuneline.stages.families.wan22.split import expert_files

# Split as Wan2.2-T2V-A14B's (its boundary_ratio): the high-noise expert denoises t >= 875 of 1000.
TINY_BOUNDARY = FAMILY_FACTS["wan22"].expert_boundary
# The row of the TI2V 5B layout (FamilyFacts.variant_of), which the refusal of its folders names.
TI2V_ROW = next(n for n, f in FAMILY_FACTS.items() if f.variant_of == "wan22")


def folder_experts(model_dir: Path) -> tuple[tuple[str, ...], float | None]:
    """(the expert components a pipeline folder has, high-noise first; its boundary_ratio). ValueError naming
    the fix for a folder this layout cannot train: TI2V 5B's (expand_timesteps: the config picks its own row for
    it, schemas/model.py), or two experts without the boundary that splits the schedule between them."""
    index_file = Path(model_dir) / "model_index.json"
    index = json.loads(index_file.read_text(encoding="utf-8"))
    present = tuple(c for c in (HIGH, LOW) if (index.get(c) or [None])[0] is not None)
    if index.get("expand_timesteps"):
        raise ValueError(
            f"{index_file}: expand_timesteps is true, the Wan 2.2 TI2V 5B layout, which the A14B layout's code does "
            f"not train (transformer and transformer_2); set model.config {TI2V_ROW} to train it as that layout (or, "
            f"if model.path named this folder when the config was loaded, check it was readable then: the config "
            f"picks that layout from this file), or use a Wan2.2-T2V-A14B folder"
        )
    boundary = index.get("boundary_ratio")
    if len(present) == 2 and boundary is None:
        raise ValueError(
            f"{index_file}: two transformers (transformer, transformer_2) but boundary_ratio is "
            f"{'null' if 'boundary_ratio' in index else 'missing'}, so nothing says which timesteps each one "
            f'denoises; add the A14B\'s "boundary_ratio": {TINY_BOUNDARY} to model_index.json'
        )
    return present, boundary


def chosen_experts(model_dir: Path, expert: str | None) -> tuple[tuple[str, ...], float | None]:
    """The components model.expert trains (null: both) and the boundary; ValueError naming the fix where the
    folder has no such expert."""
    present, boundary = folder_experts(model_dir)
    if len(present) < 2:  # one transformer denoises every timestep, whatever boundary the folder names
        if expert in (None, "both"):
            return present, None
        raise ValueError(
            f"model.expert {expert}: {model_dir}/model_index.json has one transformer, so there is no "
            f"{expert}-noise expert to pick; remove model.expert"
        )
    if expert in (None, "both"):
        return present, boundary
    return ((HIGH,) if expert == "high" else (LOW,)), boundary


class Wan22Family(WanFamily):
    facts: ClassVar[FamilyFacts] = FAMILY_FACTS["wan22"]

    def build_tiny(self, out_dir: Path) -> None:
        """Two tiny experts split as the A14B's."""
        parts = self.tiny_components(out_dir) | {"transformer_2": self.tiny_transformer()}
        pipe = self.pipeline_class(**parts, boundary_ratio=TINY_BOUNDARY)
        pipe.save_pretrained(out_dir, safe_serialization=True)

    def load_denoiser(
        self, model_dir: Path, dtype: torch.dtype, device: torch.device, expert: str | None = None, place: Place = None
    ) -> torch.nn.Module:
        load, put = self.denoiser_class.from_pretrained, place or (lambda m: m.to(device))
        return self.build_denoiser(model_dir, expert, lambda c: put(load(model_dir, subfolder=c, dtype=dtype)))

    def build_denoiser(
        self, model_dir: Path, expert: str | None, build: Callable[[str], torch.nn.Module]
    ) -> torch.nn.Module:
        comps, boundary = chosen_experts(model_dir, expert)
        return Experts({c: build(c) for c in comps}, boundary)

    def denoiser_parts(self, denoiser: torch.nn.Module) -> dict[str, torch.nn.Module]:
        return dict(denoiser.experts) if isinstance(denoiser, Experts) else super().denoiser_parts(denoiser)

    def sigma_range(self, denoiser: torch.nn.Module) -> tuple[float, float]:
        return denoiser.sigma_range() if isinstance(denoiser, Experts) else (0.0, 1.0)

    def sigma_splits(self, denoiser: torch.nn.Module) -> tuple[float, ...]:
        """Both experts held: the boundary, so each step trains one of them on every rank."""
        if isinstance(denoiser, Experts) and len(denoiser.experts) > 1 and denoiser.boundary is not None:
            return (denoiser.boundary,)
        return ()

    def block_stacks(self, model: torch.nn.Module) -> tuple[str, ...]:
        if isinstance(model, Experts):
            return tuple(f"experts.{c}.blocks" for c in model.experts)
        return super().block_stacks(model)

    def expert_split(self, model_dir: Path, expert: str | None) -> tuple[int, tuple[str, ...]]:
        held = chosen_experts(model_dir, expert)[0]
        return len(held), tuple(c for c in folder_experts(model_dir)[0] if c not in held)

    def lora_suffixes(self, denoiser: torch.nn.Module) -> dict[str, str]:
        """Only a folder of two experts (a boundary) names its files by expert: one transformer's LoRA is the
        whole model's."""
        if isinstance(denoiser, Experts) and denoiser.boundary is not None:
            return dict(self.facts.experts)
        return {}

    def denoiser_files(self, file: Path, config: Path, expert: str | None) -> dict[str, Path]:
        """ComfyUI's one file per expert, the other found beside model.path by its name (wan22/split.py)."""
        return expert_files(file, config, expert)

    def lora_load_kwargs(self, component: str) -> dict[str, Any]:
        """diffusers' Wan LoRA loader puts a file's `transformer.` weights into transformer_2 when told to."""
        return {"load_into_transformer_2": True} if component == LOW else {}
