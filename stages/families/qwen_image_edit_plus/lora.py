"""Qwen-Image-Edit Plus's kohya LoRA layout is Qwen-Image's (the same transformer; ComfyUI loads edit LoRAs so)."""

from __future__ import annotations

from tuneline.stages.families.qwen_image.lora import KOHYA_LAYOUT, kohya_target

__all__ = ["KOHYA_LAYOUT", "kohya_target"]
