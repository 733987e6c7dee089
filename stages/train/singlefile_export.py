"""A full fine-tune as ONE .safetensors in the family's original layout (SD1.x/SDXL: the LDM layout A1111, Forge and
ComfyUI's checkpoint loaders read; Family.single_file_state names the tensors, in the family's folder)."""

from __future__ import annotations

from pathlib import Path

import torch

# Families it writes: schemas/checks.py (SINGLE_FILE_FAMILIES) refuses train.export_single_file for the others.
SINGLE_FILE = "model.safetensors"


def save_single_file(fam, final: Path, meta: dict[str, str]) -> Path:
    """Write `final/model.safetensors` from the pipeline folder `final/` (weights as saved, e.g. float32)."""
    from safetensors.torch import save_file

    pipe = fam.load_pipeline(final, torch.float32, torch.device("cpu"))
    state = {k: v.detach().to("cpu").contiguous() for k, v in fam.single_file_state(pipe).items()}
    path = final / SINGLE_FILE
    save_file(state, str(path), metadata={"format": "pt", **meta})
    return path
