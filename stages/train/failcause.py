"""Why a training worker died, from its own output, when it left no error.json: torchrun's closing summary
(`error_file: <N/A> … exitcode : 1`) names no cause, the worker's traceback above it does.

`Causes` reads the streamed output line by line and keeps each worker's last exception line (torch prefixes a
worker's lines with `[rankN]:` once the process group exists) and any signal torchrun reports. `explain()` names
the exception and, for the causes a user fixes with a setting or a disk, what to change.
"""

from __future__ import annotations

import re

# The last line of a Python traceback: `SomeError: message` (dotted names allowed), optionally rank-prefixed.
EXC_LINE = re.compile(
    r"^(?:\[(?:default)?rank(\d+)\]:\s*)?((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*"
    r"(?:Error|Exception|Exit|Interrupt)\b)(?::\s*(.*))?$"
)
TRACEBACK = re.compile(r"^(?:\[(?:default)?rank\d+\]:\s*)?Traceback \(most recent call last\):")
SIGNAL = re.compile(r"Signal (\d+) \((SIG\w+)\) received by PID (\d+)|exitcode\s*:\s*-(\d+)")
OOM = (
    "OutOfMemoryError",
    "MemoryError",
    "out of memory",
    "Cannot allocate memory",
    "can't allocate memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
)
DISK_FULL = ("No space left on device", "[Errno 28]", "ENOSPC", "Disk quota exceeded", "[Errno 122]")
# torchrun's own errors re-raised at its end name the worker failure, not its cause.
NOT_A_CAUSE = ("ChildFailedError", "torch.distributed.elastic", "SystemExit")
OOM_FIX = (
    "out of memory: lower train.batch_size (raise train.grad_accumulation to keep the global batch), set "
    "train.gradient_checkpointing: true, lower buckets.resolution, or run fewer train.processes per node"
)
DISK_FIX = (
    "the disk is full: free space where the workdir lives (`tuneline gc` removes old versions), lower "
    "train.keep_checkpoints, or point the workdir at a larger disk"
)


class Causes:
    def __init__(self) -> None:
        self.exceptions: dict[str, str] = {}  # rank (or "?") -> its last exception line
        self.in_traceback = False
        self.signal = ""
        self.hints: set[str] = set()

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
        for needle, hint in ((OOM, OOM_FIX), (DISK_FULL, DISK_FIX)):
            if any(n in line for n in needle):
                self.hints.add(hint)

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
        return msg + "".join(f". {h[0].upper()}{h[1:]}" for h in sorted(self.hints))
