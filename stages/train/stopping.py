"""When to checkpoint outside the step schedule, agreed by every rank: on SIGTERM (a cancelled Prefect run, `kill`,
a cluster preempting the job) and every `train.checkpoint_minutes`.

torchrun forwards SIGTERM to every worker, but not at the same instant, and clocks differ: each rank reports what
it saw and an all-reduce (max) makes every rank act on the same step, so all of them reach the checkpoint's
collective work together and none waits for a rank that already left."""
from __future__ import annotations

import signal
import time

import torch
import torch.distributed as dist


class Interrupted(RuntimeError):
    """Training stopped on request after writing a checkpoint; the next run continues from it."""


class StopSignals:
    def __init__(self, minutes: float | None):
        self.seconds = minutes * 60 if minutes else None
        self.since = time.monotonic()
        self.term = False
        signal.signal(signal.SIGTERM, self._on_term)

    def _on_term(self, signum, frame) -> None:  # finish the step, checkpoint, then stop
        self.term = True

    def poll(self) -> tuple[bool, bool]:
        """(stop now, checkpoint now), the same on every rank."""
        due = self.seconds is not None and time.monotonic() - self.since >= self.seconds
        flags = torch.tensor([float(self.term), float(due)])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop, due = bool(flags[0]), bool(flags[1])
        return stop, stop or due

    def checkpointed(self) -> None:
        self.since = time.monotonic()
