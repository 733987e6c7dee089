"""TI2V 5B's transformer is a Wan 2.1 transformer of another size: its kohya LoRA file (ComfyUI) has the Wan 2.1
family's layout."""

from tuneline.stages.families.wan.lora import KOHYA_LAYOUT as KOHYA_LAYOUT, kohya_target as kohya_target
