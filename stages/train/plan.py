"""Which rows each rank trains on at each step: the reader's epoch plan, walked from a resumable position.

The reader's plan is a pure function of (bucket counts, batch size, world size, seed, epoch), so every rank
computes it without talking, and a checkpoint only has to record where in it training stopped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class Position:
    """The next global micro-batch: index `index` of epoch `epoch`'s plan."""

    epoch: int = 0
    index: int = 0

    def as_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class MicroBatch:
    bucket: str
    rows: np.ndarray  # this rank's rows
    global_rows: np.ndarray  # every rank's rows (to name another rank's images in an error)
    after: Position  # where the plan continues once this micro-batch is consumed


def shard(rows: np.ndarray, rank: int, batch_size: int) -> np.ndarray:
    """Rank r's slice of a global micro-batch (disjoint across ranks by construction)."""
    return rows[rank * batch_size : (rank + 1) * batch_size]


EpochPlan = Callable[[int], list[tuple[str, np.ndarray]]]  # epoch -> global micro-batches (bucket, rows)


def micro_batches(plan_of: EpochPlan, batch_size: int, rank: int, start: Position = Position()) -> Iterator[MicroBatch]:
    """This rank's micro-batches from `start` on, epoch after epoch, forever."""
    epoch, index = start.epoch, start.index
    while True:
        plan = plan_of(epoch)
        if not plan:
            raise ValueError(f"the latent cache forms no global batch in epoch {epoch}")
        for i in range(index, len(plan)):
            bucket, rows = plan[i]
            nxt = Position(epoch, i + 1) if i + 1 < len(plan) else Position(epoch + 1, 0)
            yield MicroBatch(bucket, shard(rows, rank, batch_size), rows, nxt)
        epoch, index = epoch + 1, 0


def step_seed(seed: int, rank: int, micro_index: int) -> int:
    """The RNG seed of one micro-batch on one rank (noise, timesteps, caption dropout, dropout layers).

    Deriving it from (seed, rank, micro-batch index) rather than carrying one stream along makes the random state
    at any step reproducible from the step alone: a resumed run draws exactly what the uninterrupted one drew.
    """
    return int(np.random.SeedSequence([seed, rank, micro_index]).generate_state(1, dtype=np.uint64)[0] >> 1)


def device_seed(seed: int, rank: int, micro_index: int) -> int:
    """The seed of the same micro-batch's generator on the training device (latent eps, diffusion noise): a
    stream of its own, so the tensor-sized draws happen where they are used and never cross to the device."""
    return int(np.random.SeedSequence([seed, rank, micro_index, 1]).generate_state(1, dtype=np.uint64)[0] >> 1)
