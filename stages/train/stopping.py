"""When to checkpoint outside the step schedule, agreed by every rank: on a stop (a cancelled Prefect run, `kill`,
a cluster preempting the job) and every `train.checkpoint_minutes`; and how long a stop may take (`grace_seconds`).

Which SIGTERM is a stop: the launcher marks a stop (a file beside the work folder) before it forwards SIGTERM to
torchrun. torchrun also sends SIGTERM to the surviving workers when a peer has died; that one carries no mark, and
the worker exits at once instead of finishing a step whose collective may never return. The signal is taken by a
thread reading Python's wakeup fd, so a main thread blocked inside a C call (an NCCL wait on a dead peer) does not
delay it.

torchrun forwards a stop to every worker, but not at the same instant, and clocks differ: each rank reports what
it saw in its row of the step's loss all-reduce (tuneline.stages.train.collectives.exchange: no collective of its
own), and every rank acts on any rank's flag at the same step, so all of them reach the checkpoint's collective
work together and none waits for a rank that already left."""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from pathlib import Path

import torch

STOP_GRACE_S = 120  # the least time a stopped training gets to finish its step and write its checkpoint
# A scheduler that signals every process of a job at once (Slurm's scancel) reaches the workers and the launcher
# together; the launcher's mark follows within this.
MARK_WAIT_S = 3.0
NOT_A_STOP_EXIT = 143  # what a SIGTERM would have made the exit code
# For the grace figure: a checkpoint written to a network filesystem, and a step at a fraction of a GPU's peak.
CHECKPOINT_BYTES_PER_S = 200e6
GPU_FLOPS = 100e12
CPU_FLOPS = 0.2e12


class Interrupted(RuntimeError):
    """Training stopped on request after writing a checkpoint; the next run continues from it."""


class StopSignals:
    def __init__(self, minutes: float | None, mark: Path | None):
        self.seconds = minutes * 60 if minutes else None
        self.since = time.monotonic()
        self.term = False
        self.mark = mark
        read, write = os.pipe()
        os.set_blocking(write, False)
        signal.signal(signal.SIGTERM, lambda signum, frame: None)  # the watcher thread decides (_on_term)
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read,), name="tuneline-stop-watch", daemon=True).start()

    def _watch(self, fd: int) -> None:
        while True:
            if signal.SIGTERM in os.read(fd, 64):
                self._on_term()

    def _on_term(self) -> None:
        """A marked SIGTERM: finish the step, checkpoint, then stop. Unmarked: exit now (a peer failed)."""
        deadline = time.monotonic() + MARK_WAIT_S
        while self.mark is None or not self.mark.exists():
            if time.monotonic() > deadline:
                print("SIGTERM without a stop request (a peer failed): exiting now", flush=True)
                os._exit(NOT_A_STOP_EXIT)
            time.sleep(0.05)
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


def stop_reason(step: int, steps: int, checkpoint: str) -> str:
    """What a stopped training says everywhere a user looks (console, status, Prefect, summary)."""
    return f"stopped at step {step} of {steps} (checkpoint {checkpoint}); rerun to continue"


def grace_seconds(plan: dict | None, cfg) -> int:
    """How long a stopped training may take: twice the planned step (a stop lands anywhere in one, and the next
    waits for every rank) plus writing the checkpoint, and never less than STOP_GRACE_S. The planned step is the
    denoiser's forward and backward (6 FLOPs per parameter and latent position) over the step's samples at a
    conservative share of the device's peak; the checkpoint is the trainable weights with their optimizer state
    and EMA. Without a plan: STOP_GRACE_S."""
    if not plan or "step_flops" not in plan:
        return STOP_GRACE_S
    t = cfg.train
    flops = plan["step_flops"] * t.batch_size * t.grad_accumulation
    step_s = flops / (GPU_FLOPS if plan.get("free") is not None else CPU_FLOPS)
    write_s = plan["checkpoint_bytes"] / CHECKPOINT_BYTES_PER_S
    return max(STOP_GRACE_S, math.ceil(2 * step_s + write_s))
