"""Each Wan 2.2 expert is a Wan transformer: its kohya LoRA file (ComfyUI) has wan's layout (stages/families/wan/lora.py)."""

from tuneline.stages.families.wan.lora import KOHYA_LAYOUT as KOHYA_LAYOUT, kohya_target as kohya_target
