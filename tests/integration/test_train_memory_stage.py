"""The train stage with the memory options on: 2-process gloo DDP LoRA with block swap, offloaded checkpointing
and 8-bit AdamW trains the same losses as without swap, and the manifest records the memory plan."""

from __future__ import annotations

import pytest

from tests.integration.test_train_support import small_config
from tuneline.schemas.train_manifest import TrainManifest
from tuneline.stages.common.stage import StageContext, run_stage
from tuneline.stages.pipeline import PIPELINE, stage

pytestmark = pytest.mark.ddp(reason="block swap and offloaded checkpointing under DDP's gradient hooks")

OPTIONS = {
    "mode": "lora",
    "lora_rank": 4,
    "steps": 3,
    "processes": 2,
    "batch_size": 2,
    "checkpoint_every": 3,
    "gradient_checkpointing": "offload",
    "optimizer": "adamw8bit",
    "learning_rate": 1e-2,
}


def test_ddp_lora_with_swap_offload_and_adamw8bit(tmp_path, upstream_store, demo_data):
    swapped = small_config(tmp_path, {**OPTIONS, "blocks_to_swap": 3}, dataset={"path": str(demo_data)})
    ctx = upstream_store.upstream(swapped)
    path, _ = run_stage(ctx, stage("train"), PIPELINE)
    with_swap = ctx.store.read(path, TrainManifest)
    assert with_swap.memory_plan["device"] == "cpu" and with_swap.memory_plan["fits"]
    assert with_swap.memory_plan["blocks"] == 7 and with_swap.peak_memory is None
    # blocks_to_swap changes no number, so it is not fingerprinted: the same version is rebuilt without it
    plain = small_config(tmp_path, {**OPTIONS, "blocks_to_swap": 0}, dataset={"path": str(demo_data)})
    path2, built = run_stage(StageContext(plain, force=True), stage("train"), PIPELINE)
    assert built and path2 == path
    assert ctx.store.read(path2, TrainManifest).losses == with_swap.losses
