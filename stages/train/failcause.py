"""Why training failed, naming the rank that failed first and what happened to it, not what followed on the
others (a peer's "Connection closed by peer", torchrun's SIGTERM to the survivors).

Each worker that catches an exception records it (`record`: `error-rank<N>.json` in the work folder, with its
kind and time). A rank that is killed records nothing; torchrun's closing summary gives its exit code and signal
per rank, and `Causes` reads those and each worker's last exception line from the streamed output (torch
prefixes a worker's lines with `[rankN]:` once the process group exists). `first_failure` then picks the cause:
the earliest own error of any rank, else a rank killed by a signal, else the lost connection itself.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

# The last line of a Python traceback: `SomeError: message` (dotted names allowed), optionally rank-prefixed.
EXC_LINE = re.compile(
    r"^(?:\[(?:default)?rank(\d+)\]:\s*)?((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*"
    r"(?:Error|Exception|Exit|Interrupt)\b)(?::\s*(.*))?$"
)
# The files a training run leaves beside its checkpoints for the launcher: its result, or rank 0's stop (the step and
# checkpoint a rerun continues from); and with the result, every step's loss, which the launcher draws into LOSS_PNG
# once the workers are done (launch.draw_loss_curve).
RESULT = "result.json"
ERROR = "error.json"
LOSSES = "losses.jsonl"
LOSS_PNG = "loss.png"
TRACEBACK = re.compile(r"^(?:\[(?:default)?rank\d+\]:\s*)?Traceback \(most recent call last\):")
SIGNAL = re.compile(r"Signal (\d+) \((SIG\w+)\) received by PID (\d+)|exitcode\s*:\s*-(\d+)")
SUMMARY_RANK = re.compile(r"^\s*rank\s*:\s*(\d+) \(local_rank")
SUMMARY_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)(?: \(pid: \d+\))?\s*(?:\((SIG\w+)\))?")
OOM = (
    "OutOfMemoryError",
    "MemoryError",
    "out of memory",
    "Cannot allocate memory",
    "can't allocate memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
)
CUDA = ("CUDA error", "AcceleratorError", "cudaError", "CUDNN_STATUS", "CUBLAS_STATUS", "device-side assert")
# A collective whose peer is gone: a consequence of another rank's failure, never the cause.
PEER = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote process exited",
    "DistNetworkError",
    "DistBackendError",
)
DISK_FULL = ("No space left on device", "[Errno 28]", "ENOSPC", "Disk quota exceeded", "[Errno 122]")
# torchrun's own errors re-raised at its end name the worker failure, not its cause.
NOT_A_CAUSE = ("ChildFailedError", "torch.distributed.elastic", "SystemExit")
NOT_A_STOP_EXITS = (-15, 143)  # SIGTERM to a survivor after a peer died (tuneline.stages.train.stopping)
OOM_FIX = (
    "out of memory: `tuneline plan` with this config (add --gpu-memory GIB for another card) prints the planned "
    "peak and the settings that fit; the knobs: lower train.batch_size (raise train.grad_accumulation to keep the "
    "global batch), train.gradient_checkpointing: true, train.blocks_to_swap, model.quantize, lower "
    "buckets.resolution, or fewer train.processes per node"
)
CUDA_FIX = (
    "a CUDA error: check that GPU with nvidia-smi (Xid errors in the kernel log mean the card or its driver); "
    "rerun to continue from the last checkpoint, on other GPUs if it repeats"
)
LOST_FIX = (
    "a rank was lost: the kernel's out-of-memory killer (host memory: lower train.processes or "
    "train.threads_per_process), a node that went away, or a kill from outside; rerun to continue from the last "
    "checkpoint"
)
DISK_FIX = (
    "the disk is full: free space where the workdir lives (`tuneline gc` removes old versions), lower "
    "train.keep_checkpoints, or point the workdir at a larger disk"
)


def kind_of(err: BaseException) -> str:
    """oom | cuda | peer | error, from the exception a worker caught."""
    text = f"{type(err).__name__}: {err}"
    if isinstance(err, MemoryError) or any(n in text for n in OOM):
        return "oom"
    if any(n in text for n in PEER):
        return "peer"
    if any(n in text for n in CUDA):
        return "cuda"
    return "error"


def record(out: Path, rank: int, err: BaseException, message: str | None = None) -> None:
    """This rank's failure, for the launcher (`first_failure`): written before the process exits."""
    text = message or f"{type(err).__name__}: {err}"
    data = {"rank": rank, "kind": kind_of(err), "error": text, "at": time.time()}
    (out / f"error-rank{rank}.json").write_text(json.dumps(data), encoding="utf-8")


def records(out: Path) -> list[dict]:
    found = []
    for f in sorted(out.glob("error-rank*.json")):
        try:
            found.append(json.loads(f.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    return found


@dataclass
class Failure:
    kind: str  # oom | cuda | lost | error
    message: str


class Causes:
    def __init__(self) -> None:
        self.exceptions: dict[str, str] = {}  # rank (or "?") -> its last exception line
        self.in_traceback = False
        self.signal = ""
        self.hints: set[str] = set()
        self.summary_rank: int | None = None
        self.exits: dict[int, tuple[int, str]] = {}  # rank -> (exit code, signal name) from torchrun's summary

    def feed(self, line: str) -> None:
        if TRACEBACK.match(line):
            self.in_traceback = True
        m = EXC_LINE.match(line.strip())
        if m and self.in_traceback and not any(n in line for n in NOT_A_CAUSE):
            self.exceptions[m.group(1) or "?"] = f"{m.group(2)}: {m.group(3) or ''}".rstrip(": ")
            self.in_traceback = False
        s = SIGNAL.search(line)
        if s and (s.group(2) or not self.signal):  # the signal's name, once torchrun's summary gives it
            self.signal = s.group(2) or f"signal {s.group(4)}"
        self._summary(line)
        for needle, hint in ((OOM, OOM_FIX), (DISK_FULL, DISK_FIX)):
            if any(n in line for n in needle):
                self.hints.add(hint)

    def _summary(self, line: str) -> None:
        r = SUMMARY_RANK.match(line)
        if r:
            self.summary_rank = int(r.group(1))
        e = SUMMARY_EXIT.match(line)
        if e and self.summary_rank is not None:
            self.exits[self.summary_rank] = (int(e.group(1)), e.group(2) or "")

    def killed(self) -> list[tuple[int, str]]:
        """(rank, signal) of the ranks a signal ended that was not torchrun stopping the survivors."""
        return [
            (rank, name or f"signal {-code}")
            for rank, (code, name) in sorted(self.exits.items())
            if code < 0 and code not in NOT_A_STOP_EXITS
        ]

    def explain(self) -> str | None:
        """One sentence naming the cause, or None when the output shows none."""
        if self.exceptions:
            rank, exc = next(iter(sorted(self.exceptions.items())))
            who = f"worker rank {rank}" if rank != "?" else "a training worker"
            msg = f"{who} died of {exc}"
        elif self.signal:
            msg = f"a training worker was killed by {self.signal}"
            if self.signal in ("SIGKILL", "signal 9"):
                self.hints.add(OOM_FIX.replace("out of memory:", "this is usually the kernel's out-of-memory killer:"))
        else:
            return None
        return msg + hint_text(self.hints)


def hint_text(hints: set[str]) -> str:
    return "".join(f". {h[0].upper()}{h[1:]}" for h in sorted(hints))


FIXES = {"oom": OOM_FIX, "cuda": CUDA_FIX, "lost": LOST_FIX}


def first_failure(work: Path, causes: Causes) -> Failure | None:
    """The rank that failed first and what happened to it, or None when neither the workers' records nor
    torchrun's summary says (the caller falls back to the output)."""
    every = records(work)
    own = sorted((r for r in every if r["kind"] != "peer"), key=lambda r: r["at"])
    if own:
        r = own[0]
        kind = r["kind"]
        hints = {FIXES[kind]} if kind in FIXES else set()
        hints |= {h for h in causes.hints if h == DISK_FIX and any(n in r["error"] for n in DISK_FULL)}
        return Failure(kind, f"rank {r['rank']} failed first: {r['error']}" + hint_text(hints))
    killed = causes.killed()
    if killed:
        rank, name = killed[0]
        return Failure("lost", f"rank {rank} was killed by {name} mid-run" + hint_text({LOST_FIX}))
    if every:
        r = min(every, key=lambda r: r["at"])
        return Failure(
            "lost",
            f"rank {r['rank']} lost its connection to another rank ({r['error']}), and no rank recorded why"
            + hint_text({LOST_FIX}),
        )
    return None
