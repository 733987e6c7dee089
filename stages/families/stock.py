"""The stock diffusers classes families build on: a pipeline class by name, and the FLUX families' scheduler."""

from __future__ import annotations

from typing import Any


def diffusers_pipeline(name: str) -> type:
    """A diffusers pipeline class by name.

    transformers 5 names `<Model>ImageProcessor` its torchvision backend; without torchvision (there is no CPU
    build of it for this torch) the first access falls back to the PIL class and logs a warning, which every
    process importing diffusers' pipelines repeats. The pipelines only need the class to exist: binding the PIL
    classes under those names first, as transformers' fallback itself does, keeps the logs clean."""
    import sys

    from transformers.utils import is_torchvision_available

    if not is_torchvision_available():
        for proc in ("CLIPImageProcessor", "SiglipImageProcessor"):
            pil = getattr(sys.modules["transformers"], f"{proc}Pil")
            # Read the module again: transformers' lazy module replaces itself in sys.modules on first use.
            setattr(sys.modules["transformers"], proc, pil)
    import diffusers

    return getattr(diffusers, name)


def dynamic_shift_scheduler() -> Any:
    """FLUX.1's and FLUX.2's published scheduler: flow matching whose shift the pipeline computes from the image's
    token count (base 0.5 at 256 tokens to 1.15 at 4096)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
