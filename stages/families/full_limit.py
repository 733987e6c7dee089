"""Whether a full fine-tune of a denoiser can run under DDP at all, decided from its config before any weight loads.

DDP keeps a whole copy of the model on every GPU: float32 master weights, float32 gradients and AdamW's two float32
moments, 16 bytes per parameter before a single activation. The largest GPU this runs on holds 141 GB (H200), so a
denoiser above ~8.8B parameters cannot be fully fine-tuned that way (FLUX.2 [dev]'s 32B would need 516 GB per GPU):
it is refused at load, naming the limit, instead of failing out of memory after the model was read.
"""

from __future__ import annotations

import json
from pathlib import Path

BYTES_PER_PARAM = 16  # fp32 weights + fp32 grads + AdamW exp_avg + exp_avg_sq
GPU_BYTES = 141 * 10**9  # the largest single GPU memory (NVIDIA H200)
PARAM_LIMIT = GPU_BYTES // BYTES_PER_PARAM


def param_count(cls: type, config: dict) -> int:
    """Parameters of `cls` built from `config` on the meta device (no memory, no weights)."""
    import torch

    with torch.device("meta"):
        model = cls.from_config(config)
    return sum(p.numel() for p in model.parameters())


def check_full_fits(family: str, cls: type, model_dir: Path, component: str, shards: int = 1) -> None:
    """ValueError when `component` of `model_dir` is too large for a full fine-tune whose training state is split
    `shards` ways (DDP: 1, every GPU holds all of it)."""
    config = json.loads((Path(model_dir) / component / "config.json").read_text(encoding="utf-8"))
    n = param_count(cls, config)
    if n > PARAM_LIMIT * shards:
        per_gpu = n * BYTES_PER_PARAM / shards
        split = f"split {shards} ways " if shards > 1 else ""
        raise ValueError(
            f"train.mode full: the {family} {component} has {n / 1e9:.1f}B parameters; a full fine-tune {split}"
            f"holds {BYTES_PER_PARAM} bytes per parameter ({per_gpu / 1e9:.0f} GB per GPU), above the "
            f"{GPU_BYTES / 1e9:.0f} GB of the largest GPU (limit {PARAM_LIMIT * shards / 1e9:.1f}B parameters); "
            f"set train.mode lora"
        )
