"""Config checks of the families with timestep experts (Wan 2.2 A14B, FamilyFacts.experts): rules of
schemas/checks.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tuneline.schemas.families import FamilyFacts, family_list

if TYPE_CHECKING:  # annotations only: config.py imports schemas/checks.py, which imports this module
    from tuneline.schemas.config import PipelineConfig


def experts(cfg: PipelineConfig, fam: FamilyFacts) -> list[str]:
    expert, out = cfg.model.expert, []
    if expert is not None and not fam.experts:
        out.append(
            f"model.expert {expert}: model.family {fam.name} has one denoiser, no timestep experts (families with "
            f"experts: {family_list(lambda f: bool(f.experts)) or 'none'}); remove model.expert"
        )
    return out


def expert_eval(cfg: PipelineConfig, fam: FamilyFacts) -> list[str]:
    """A one-expert run evaluates only at the timesteps its expert denoises (stages/train/evaluation.py): some
    of train.eval.timesteps must fall in its share of the shipped folder's schedule."""
    expert, ev = cfg.model.expert, cfg.train.eval
    if ev is None or expert not in ("high", "low") or fam.expert_boundary is None:
        return []
    edge = fam.expert_boundary * 1000
    if any((t >= edge) == (expert == "high") for t in ev.timesteps):
        return []
    share, fix = (f">= {edge:g}", "[900, 950, 990]") if expert == "high" else (f"< {edge:g}", "[200, 500, 800]")
    return [
        f"train.eval.timesteps {ev.timesteps}: none is in model.expert {expert}'s share of the schedule (t {share}, "
        f"model_index.json boundary_ratio {fam.expert_boundary}), so its eval loss would measure nothing it "
        f"trains; set train.eval.timesteps {fix}"
    ]
