"""When to checkpoint outside the step schedule, agreed by every rank: on SIGTERM (a cancelled Prefect run, `kill`,
a cluster preempting the job) and every `train.checkpoint_minutes`.

torchrun forwards SIGTERM to every worker, but not at the same instant, and clocks differ: each rank reports what
it saw in its row of the step's loss all-reduce (tuneline.stages.train.collectives.exchange: no collective of its
own), and every rank acts on any rank's flag at the same step, so all of them reach the checkpoint's collective
work together and none waits for a rank that already left."""

from __future__ import annotations

import signal
import time

import torch


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

    def flags(self) -> list[float]:
        """This rank's (stopped, checkpoint due) as 0.0/1.0, for its row of the step's all-reduce."""
        due = self.seconds is not None and time.monotonic() - self.since >= self.seconds
        return [float(self.term), float(due)]

    @staticmethod
    def decide(every: torch.Tensor) -> tuple[bool, bool]:
        """(stop now, checkpoint now) from every rank's flags (world, 2): the same on every rank."""
        stop, due = (bool(col.any()) for col in (every[:, 0] > 0, every[:, 1] > 0))
        return stop, stop or due

    def checkpointed(self) -> None:
        self.since = time.monotonic()
