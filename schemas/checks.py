"""Cross-field config checks that need family facts. Each error names every field involved."""
from __future__ import annotations

from typing import TYPE_CHECKING

from schemas.families import facts

if TYPE_CHECKING:
    from schemas.config import PipelineConfig


def check_config(cfg: "PipelineConfig", source: str) -> None:
    from schemas.config import ConfigError

    fam = facts(cfg.model.family)
    problems: list[str] = []
    align = cfg.buckets.alignment
    if align is not None and align % fam.alignment:
        problems.append(f"buckets.alignment: {align} is not a multiple of {fam.alignment}, the requirement of "
                        f"model.family {fam.name} (VAE factor {fam.vae_factor} x patch {fam.patch_size}); "
                        f"use a multiple of {fam.alignment} or null for automatic")
    if problems:
        raise ConfigError(f"invalid config {source}:\n" + "\n".join(f"  - {p}" for p in problems))
