"""A training worker that dies of an exception it did not record: the stage's error names that exception (and
what to change for out of memory and a full disk) and carries the exit code of its kind, not torchrun's closing
summary. Real torchrun, real worker processes, and a worker started alone (one process on one node, no torchrun);
the worker script raises what a full disk or an exhausted allocator raises."""

from __future__ import annotations

import sys

import pytest

from tuneline.schemas.config import load_config
from tuneline.stages.common.stage import StageContext
from tuneline.stages.train.failures import TrainingFailed
from tuneline.stages.train.workers import run_workers

SCRIPT = """
import errno, os, sys
if sys.argv[1] == "disk":
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "checkpoint-000003/model.safetensors")
if sys.argv[1] == "oom":
    raise MemoryError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8589934592 bytes")
if sys.argv[1] == "killed":  # what the kernel's out-of-memory killer does
    os.kill(os.getpid(), 9)
raise OverflowError("Python int too large to convert to C long")
"""


@pytest.mark.parametrize(
    "kind,expect,exit_code",
    [
        ("disk", ["No space left on device", "tuneline gc"], 1),
        ("oom", ["MemoryError", "train.batch_size", "`tuneline plan`"], 4),
        ("overflow", ["OverflowError", "too large"], 1),
        ("killed", ["rank 0 was killed by SIGKILL", "out-of-memory killer"], 5),
    ],
)
@pytest.mark.parametrize("alone", [False, True], ids=["torchrun", "alone"])
def test_the_final_error_names_the_workers_exception(tmp_path, kind, expect, exit_code, alone):
    (tmp_path / "w.py").write_text(SCRIPT, encoding="utf-8")
    ctx = StageContext(load_config(None, str(tmp_path / "work")))
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    cmd = [sys.executable, *([] if alone else torchrun), str(tmp_path / "w.py"), kind]
    with pytest.raises(TrainingFailed) as err:
        run_workers(ctx, cmd, cwd=tmp_path, alone=alone)
    msg = str(err.value)
    for text in expect:
        assert text in msg, msg
    assert "error_file" not in msg and "<N/A>" not in msg, msg
    assert err.value.exit_code == exit_code  # the `tuneline` command's (docs/stopping.md)
