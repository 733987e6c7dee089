"""Training stage: config and manifest."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from schemas.base import Manifest, Strict


class TrainConfig(Strict):
    steps: int = Field(300, ge=1, description="optimizer steps for this run")
    batch_size: int = Field(8, ge=1, description="samples per process per step")
    learning_rate: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    mode: Literal["full", "lora"] = "full"
    lora_rank: int = Field(8, ge=1)
    processes: int = Field(2, ge=1, description="DDP processes per node (torchrun --nproc_per_node)")
    seed: int = 0
    caption_dropout: float = Field(0.1, ge=0, lt=1, description="probability of training on the empty caption")
    checkpoint_every: int = Field(100, ge=1, description="steps between checkpoints (shrinks to fit `steps`)")
    threads_per_process: int = Field(1, ge=1, description="OMP_NUM_THREADS for each training process")
    nodes: int = Field(1, ge=1, description="torchrun --nnodes; >1 needs rdzv_endpoint")
    node_rank: int = Field(0, ge=0)
    rdzv_endpoint: str = Field("", description="host:port of the c10d rendezvous for multi-node runs")
    rdzv_id: str = "tuneline"

    @model_validator(mode="after")
    def _multi_node(self) -> "TrainConfig":
        if self.nodes > 1 and not self.rdzv_endpoint:
            raise ValueError("train.nodes > 1 needs train.rdzv_endpoint (host:port reachable from every node)")
        if self.node_rank >= self.nodes:
            raise ValueError(f"train.node_rank {self.node_rank} must be < train.nodes {self.nodes}")
        return self

    def effective_checkpoint_every(self) -> int:
        """Intervals shrink to fit a small `steps` (CONTRACT.md: derived values stay valid under edits)."""
        return min(self.checkpoint_every, self.steps)


class TrainManifest(Manifest):
    stage: Literal["train"] = "train"
    family: str
    mode: str
    step: int
    world_size: int
    final: str = Field("final", description="diffusers pipeline folder (full) or LoRA weights folder")
    checkpoint: str
    losses: list[float] = Field(default_factory=list, description="mean loss per logged step")
