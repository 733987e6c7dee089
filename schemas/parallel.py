"""Which training settings can go together with train.parallelism and train.compile: each refusal names both fields
and the setting that fixes it (schemas/train.py's TrainConfig calls `combination_problem`)."""

from __future__ import annotations

# Optimizers whose every state tensor is elementwise over its parameter: they step a shard as they step the whole
# (tests/integration/test_fsdp_train.py trains them under FSDP and steps every optimizer on sharded parameters).
FSDP_OPTIMIZERS = ("adamw", "lion", "adamw_schedulefree")
# Why each other optimizer cannot step FSDP's shards, as measured there.
NOT_SHARDED = {
    "adamw8bit": "its 8-bit moments are quantized in blocks of each process's flattened shard, not of the whole "
    "tensor, so its steps are not DDP's",
    "prodigy": "its step size d sums over each process's shard only, so the processes' step sizes disagree",
    "adafactor": "its factored second moments mix plain tensors with sharded ones and fail at the first step",
}


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
        f"train.optimizer {t.optimizer}": (
            t.optimizer not in FSDP_OPTIMIZERS,
            f"{NOT_SHARDED.get(t.optimizer, 'it is not verified on sharded parameters')}; use one of "
            f"{', '.join(FSDP_OPTIMIZERS)}, or set train.parallelism: ddp",
        ),
        "train.adapter dora": (
            t.mode == "lora" and t.adapter == "dora",
            "DoRA's magnitudes are computed from the whole base weights when the adapter is added, and each "
            "process loads only its shard of them; set train.adapter lora (or lokr, loha) or train.parallelism: ddp",
        ),
    }
    return next((f"{field} with train.parallelism fsdp: {why}" for field, (bad, why) in refused.items() if bad), None)
