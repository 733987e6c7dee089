"""Training stage: the manifest of a train version (what was trained, from what, and the files it wrote)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tuneline.schemas.base import Manifest


class Export(BaseModel):
    model_config = ConfigDict(extra="forbid")
    file: str = Field(description="path relative to the train artifact directory ('final' for a pipeline folder)")
    format: Literal["diffusers", "kohya", "single-file"]
    bytes: int = Field(ge=0, description="file size, or a folder's total")
    sha256: str | None = Field(description="the file's SHA-256; null for a folder (its files are in `files`)")


class TrainManifest(Manifest):
    stage: Literal["train"] = "train"
    family: str
    mode: str
    step: int
    world_size: int
    global_batch: int = Field(description="samples per optimizer step: batch_size x processes x accumulation")
    final: str = Field("final", description="diffusers pipeline folder (full) or LoRA weights folder")
    ema: bool = False
    checkpoint: str = Field(description="the last checkpoint directory")
    checkpoints: list[str] = Field(default_factory=list, description="checkpoint directories kept")
    samples: list[str] = Field(default_factory=list, description="in-training validation grids")
    loss_curve: str = "loss.png"
    resumed_from: str | None = None
    initialized_from: str | None = Field(None, description="train version whose weights this run started from")
    losses: list[float] = Field(default_factory=list, description="loss per step (at most 500 points, averaged)")
    eval_losses: list[dict] = Field(
        default_factory=list, description="held-out loss: {step, loss, per_timestep} per evaluation (train.eval)"
    )
    seen_per_source: list[dict] = Field(
        default_factory=list,
        description="samples trained per dataset folder: "
        "{source, root, role, samples} (repeats and regularization share)",
    )
    exports: list[Export] = Field(default_factory=list, description="the model files in final/ and their format")
    adapter: str | None = Field(
        None, description="train.adapter of a LoRA-mode run (lora, lokr, loha, dora); null for a full fine-tune"
    )
    text_encoder_lora: bool = Field(
        False, description="train.text_encoder_lora: the LoRA files also hold the text encoders' LoRA (lora_te keys)"
    )
    text_cache_read: bool = Field(
        True,
        description="whether training read the text artifact's cache; false: captions were encoded live "
        "(text.enabled false, or by the trained text encoders with train.text_encoder_lora)",
    )
    not_exported: list[dict] = Field(
        default_factory=list,
        description="files train.lora_format asked for that "
        "the adapter cannot have: {format, reason} (e.g. no diffusers loader for lokr)",
    )
    memory_plan: dict | None = Field(
        None,
        description="the planned peak device memory per process and its terms "
        "(bytes), the device's free memory, the fixes when it did not fit",
    )
    peak_memory: int | None = Field(
        None, description="measured peak CUDA memory of rank 0 (torch.cuda.max_memory_allocated, bytes); null on CPU"
    )
    step_seconds: float | None = Field(
        None,
        description="measured wall seconds of one optimizer step on rank 0: the median after the first (warm-up) "
        "step, checkpoints, renders and eval excluded; null when the run made fewer than two steps",
    )

    @model_validator(mode="after")
    def _exports_listed(self) -> TrainManifest:
        """Once published (`files` set), each export agrees with the file list the store verifies against the
        disk, so a consumer that checks `files` has checked the exports too."""
        if not self.files:
            return self
        listed = {f.path: f for f in self.files}
        for e in self.exports:
            if e.sha256 is None:
                inside = [f for p, f in listed.items() if p.startswith(e.file.rstrip("/") + "/")]
                if not inside or sum(f.bytes for f in inside) != e.bytes:
                    raise ValueError(
                        f"exports: folder {e.file} ({e.bytes} bytes) does not match the files listed "
                        f"under it; rebuild with `tuneline stage train --force`"
                    )
            elif e.file not in listed or (listed[e.file].bytes, listed[e.file].sha256) != (e.bytes, e.sha256):
                raise ValueError(
                    f"exports: {e.file} ({e.bytes} bytes, sha256 {e.sha256}) is not the file listed in "
                    f"the manifest; rebuild with `tuneline stage train --force`"
                )
        return self
