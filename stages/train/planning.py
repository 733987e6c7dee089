"""What `tuneline plan` plans: the config's training, or, for a released model named by `--model-config` alone, the
training a user of that model would run (LoRA, bf16, batch 1, the model's usual resolution); on this machine's
training device, on a CUDA card of the size given, or, where a plan asks for CUDA and none is visible here, on a
card of DEFAULT_GPU_GIB. The memory terms themselves are tuneline.stages.train.memplan's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from tuneline.stages.train.memplan import MemoryPlan, planned_frames

# The card planned for when the plan is for CUDA and none is visible: a common size of a single training GPU.
DEFAULT_GPU_GIB = 24.0
FALLBACK_RESOLUTION = 1024  # released models whose VAE config names no sample size were trained at about 1 MP


@dataclass
class PlanAnswer:
    headline: str  # what was planned, on what
    plan: MemoryPlan
    pace: str = ""  # the measured time per step, or where it will be measured (tuneline.stages.train.pace)

    def text(self) -> str:
        return "\n".join(filter(None, [self.headline, self.pace, self.plan.text()]))  # the fixes stay last


def usual_resolution(model_dir: Path, family: str) -> int:
    """The model's usual training edge: its VAE's sample_size (512 for SD1.5, 1024 for SDXL, SD3, Flux…), else the
    family's (Wan: 480, for 832x480 clips)."""
    from tuneline.schemas.families import FAMILY_FACTS

    try:
        size = json.loads((model_dir / "vae" / "config.json").read_text(encoding="utf-8")).get("sample_size")
    except (OSError, ValueError):
        size = None
    if isinstance(size, int) and size > 0:
        return size
    return FAMILY_FACTS[family].usual_resolution or FALLBACK_RESOLUTION


def shipped_family(model_config: str) -> str:
    """The family of the shipped config `model_config` names; a name that ships nothing is refused with the names."""
    from tuneline.schemas.model import SHIPPED_CONFIGS

    if model_config not in SHIPPED_CONFIGS:
        raise ValueError(
            f"--model-config {model_config}: not a shipped config; use one of {', '.join(sorted(SHIPPED_CONFIGS))}"
        )
    return SHIPPED_CONFIGS[model_config]


def model_user_config(model_config: str, workdir: str | None):
    """The training a user of the released model would run: the example's config with LoRA, bf16 weights on a
    CUDA device, batch 1 in one process, at the model's usual resolution."""
    from tuneline.schemas.config import parse_config
    from tuneline.schemas.demo import DEMO_CONFIG
    from tuneline.stages.families.shipped import shipped_dir

    data = json.loads(json.dumps(DEMO_CONFIG))
    family = shipped_family(model_config)
    data["model"].update(family=family, dtype="bfloat16", device="cuda")
    data["buckets"] = {"resolution": usual_resolution(shipped_dir(model_config), family), "resolution_type": "pixel"}
    data["train"].update(mode="lora", batch_size=1, processes=1)
    return parse_config(data, f"<plan for --model-config {model_config}>", workdir)


def tiny_user_config(family: str, mode: str, workdir: str | None):
    """A newcomer's first run of `family`: the example's config on its tiny flavor (model.path null) on the CPU,
    in train.mode `mode`."""
    from tuneline.schemas.config import parse_config
    from tuneline.schemas.demo import DEMO_CONFIG

    data = json.loads(json.dumps(DEMO_CONFIG))
    data["model"].update(family=family)
    data["train"].update(mode=mode)
    return parse_config(data, f"<tiny {family} flavor>", workdir)


def headline(cfg, family: str, where: str) -> str:
    t, b = cfg.train, cfg.buckets
    what = f"LoRA (rank {t.lora_rank})" if t.mode == "lora" else "full fine-tune"
    size = f"{b.resolution:g} px edge" if b.resolution_type != "area" else f"{b.resolution:g} MP"
    from tuneline.stages.families.registry import get_family

    frames = planned_frames(cfg, get_family(family))
    size += f", clips of {frames} frames" if frames > 1 else ""
    dtype = cfg.model.dtype if "CUDA" in where or "cuda" in where.lower() else "float32 (CPU)"
    return (
        f"planned: {family}, {what}, {dtype}, {size} ({b.resolution_type}), batch {t.batch_size} per process, "
        f"{t.processes} process{'es' if t.processes > 1 else ''}, on {where}"
    )


def plan_command(
    cfg, gpu_memory_gib: float | None, model_config: str | None, processes: int | None = None
) -> PlanAnswer:
    """`tuneline plan`: the config's model (built or converted as the stages do), or a released model's shipped
    weightless config, planned on the machine's training device or a CUDA card of the given size; `processes`:
    as if trained by that many processes in all (train.processes, one node)."""
    import torch

    from tuneline.stages.families import resolve as models
    from tuneline.stages.families.shipped import shipped_dir
    from tuneline.stages.train.memplan import plan

    if gpu_memory_gib is not None and not 0 < gpu_memory_gib < math.inf:  # nan compares false: refused too
        raise ValueError(f"--gpu-memory {gpu_memory_gib}: give the card's memory in GiB, e.g. --gpu-memory 24")
    if processes is not None:
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"processes": processes, "nodes": 1})})
    if model_config is not None:
        family = shipped_family(model_config)
        model_dir = shipped_dir(model_config)
    else:
        model_dir, family = models._model_dir(cfg, cfg.workdir_path() / "models"), cfg.model.family
    note = ""
    if gpu_memory_gib is None and cfg.model.device == "cuda" and not torch.cuda.is_available():
        gpu_memory_gib = DEFAULT_GPU_GIB
        note = " (model.device is cuda and no GPU is visible here: --gpu-memory GIB plans another size)"
    device = torch.device("cpu") if gpu_memory_gib is not None else models.device(cfg)
    p = plan(cfg, model_dir, device, gpu_memory_gib, family)
    from tuneline.stages.train import STAGE
    from tuneline.stages.train.pace import measured_line

    return PlanAnswer(headline(cfg, family, p.where + note), p, measured_line(cfg, STAGE.config(cfg)))
