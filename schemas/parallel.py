"""Which training settings can go together with train.parallelism and train.compile: each refusal names both fields
and the setting that fixes it (schemas/train.py's TrainConfig calls `combination_problem`)."""

from __future__ import annotations

# Optimizers whose every state tensor is elementwise over its parameter: they step a shard as they step the whole
# (tests/integration/test_fsdp_train.py trains them under FSDP).
FSDP_OPTIMIZERS = ("adamw", "lion")


def combination_problem(t) -> str | None:
    """Why the TrainConfig `t` combines settings that cannot train together, or None."""
    # Swap's hooks on each block free and refill its weights' storage and wait on CUDA streams: a compiled block's
    # graph would capture them.
    if t.compile and t.blocks_to_swap:
        return (
            f"train.compile with train.blocks_to_swap {t.blocks_to_swap}: swapped blocks run eager; set "
            f"train.compile: false or train.blocks_to_swap: 0"
        )
    if t.fsdp_cpu_offload and t.parallelism != "fsdp":
        return (
            f"train.fsdp_cpu_offload offloads FSDP's shards; with train.parallelism {t.parallelism} set "
            f"train.parallelism: fsdp or train.fsdp_cpu_offload: false"
        )
    if t.parallelism != "fsdp":
        return None
    refused = {
        "train.blocks_to_swap": (
            t.blocks_to_swap > 0,
            "FSDP already frees each block's gathered weights after use; set train.blocks_to_swap: 0 "
            "(train.fsdp_cpu_offload keeps the shards in CPU memory)",
        ),
        "train.text_encoder_lora": (
            t.text_encoder_lora,
            "the text encoders are not sharded; set train.text_encoder_lora: false or train.parallelism: ddp",
        ),
        "train.validate_every": (
            t.validate_every > 0,
            "in-training renders are not verified on sharded weights; set train.validate_every: 0 (the validate "
            "stage renders final/)",
        ),
        "train.eval": (
            t.eval is not None,
            "held-out evaluation is not verified on sharded weights; set train.eval: null",
        ),
        f"train.optimizer {t.optimizer}": (
            t.optimizer not in FSDP_OPTIMIZERS,
            f"its state is not verified on sharded (DTensor) parameters; use one of "
            f"{', '.join(FSDP_OPTIMIZERS)}, or train.parallelism: ddp",
        ),
    }
    return next((f"{field} with train.parallelism fsdp: {why}" for field, (bad, why) in refused.items() if bad), None)
