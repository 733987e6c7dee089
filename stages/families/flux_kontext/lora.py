"""FLUX.1 Kontext's kohya LoRA layout is FLUX.1's (same transformer; ComfyUI loads Kontext LoRAs that way)."""

from __future__ import annotations

from tuneline.stages.families.flux.lora import KOHYA_LAYOUT, kohya_target

__all__ = ["KOHYA_LAYOUT", "kohya_target"]
