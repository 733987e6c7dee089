"""The memory plan under train.parallelism fsdp: a DDP plan's terms turned into one FSDP process's.

Sharded over N processes, each holds 1/N of the weights, the trainable parameters, their gradients, the optimizer
state and the EMA (train.fsdp_cpu_offload: none of them on the device). On top, FSDP's gathered copies: the root's
own parameters (embeddings, norms, a UNet's convolutions), gathered through the whole step, and two transformer
blocks at a time (the one computing and the one prefetched), in the dtype they are gathered in, with the largest
block's unsharded gradients before they are reduce-scattered. Activations are unchanged: every process still
runs its own batch.
"""

from __future__ import annotations

SHARDED = ("weights", "trainable parameters", "gradients", "optimizer state", "EMA")
# Settings train.parallelism fsdp refuses (schemas/train.py, schemas/checks.py): never suggested beside it.
REFUSED = ("model.quantize", "train.optimizer: adamw8bit", "train.blocks_to_swap")
# Past this many processes the gathered blocks dominate and more shards stop helping; the largest count suggested.
MAX_SHARDS = 64


def sharded_terms(
    terms: list[tuple[str, int]],
    shards: int,
    blocks: list[dict],
    root_params: int,
    gathered_bytes: int,
    offload: bool,
) -> list[tuple[str, int]]:
    """`terms` (DDP's, per process) under FSDP over `shards` processes for a denoiser whose transformer blocks
    (Family.block_stacks) have `blocks` ({params, trainable} each) and whose root holds `root_params`;
    `gathered_bytes`: bytes per gathered parameter (2 under 16-bit mixed precision, else as held)."""
    where = "in CPU memory" if offload else f"1/{shards} each"
    out = []
    for name, size in terms:
        if name.startswith(SHARDED):
            out.append((f"{name}, sharded ({where})", 0 if offload else -(-size // shards)))
        else:
            out.append((name, size))
    largest = max(blocks, key=lambda b: b["params"], default={"params": 0, "trainable": 0})
    out.append(("FSDP gathered root parameters", root_params * gathered_bytes))
    out.append(("FSDP gathered blocks (computing + prefetched)", 2 * largest["params"] * gathered_bytes))
    out.append(("FSDP unsharded gradients of one block", 4 * largest["trainable"]))
    return out


def shards_that_fit(total_at, current: int, free: int) -> int | None:
    """The smallest process count above `current` (doubling) whose FSDP plan `total_at(n)` fits `free`."""
    n = max(2, current * 2)
    while n <= MAX_SHARDS:
        if total_at(n) <= free:
            return n
        n *= 2
    return None


def allowed(fixes: list[str], shards: int | None) -> list[str]:
    """The suggested fixes a run sharded over `shards` processes (None: DDP) can take."""
    return fixes if shards is None else [f for f in fixes if not any(r in f for r in REFUSED)]
