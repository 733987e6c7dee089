"""The tiny family's kohya LoRA layout is SD1.5's (the same UNet architecture)."""

from __future__ import annotations

from tuneline.stages.families.sd15.lora import KOHYA_LAYOUT, TEXT_ENCODER_KOHYA, kohya_target  # noqa: F401
