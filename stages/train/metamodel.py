"""Helpers of the memory plan (tuneline.stages.train.memplan) that keep `tuneline plan` quick: the denoiser's class
without its pipeline's imports, a quiet cast, and the resolution search by bisection."""

from __future__ import annotations

from pathlib import Path

import torch


def denoiser_class(fam, model_dir: Path):
    """The denoiser's class as the folder's model_index.json names it, imported alone: the pipeline's module would
    import every text encoder's too (seconds of `tuneline plan`). The family's pipeline says it where the folder
    does not (Family.denoiser_class)."""
    import json

    import diffusers

    try:
        entry = json.loads((model_dir / "model_index.json").read_text(encoding="utf-8"))[fam.denoiser_component]
        return getattr(diffusers, entry[1])
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return fam.denoiser_class


def quiet_cast(den, dtype: torch.dtype):
    """`den.to(dtype)` without diffusers' warning about modules to keep in float32 (it names none for these models,
    and on a plan the cast only sizes the weights)."""
    from diffusers.utils import logging as diffusers_logging

    level = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    try:
        return den.to(dtype)
    finally:
        diffusers_logging.set_verbosity(level)


def largest_fitting(edges: list[int], fits) -> int | None:
    """The first of `edges` (largest first) that fits, by bisection: the peak grows with the edge, and each edge
    tried costs a traced forward (a second for a large transformer)."""
    lo, hi, found = 0, len(edges) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(edges[mid]):
            found, hi = edges[mid], mid - 1
        else:
            lo = mid + 1
    return found
