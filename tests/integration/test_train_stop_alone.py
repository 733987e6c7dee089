"""One training process on one node runs without torchrun (stages/train/workers.py: the worker alone). SIGTERM to
`tuneline stage train`'s process group, as a cancelled run or a preemption sends it, still reaches that worker
once: it finishes its step, checkpoints and stops; nothing is published, no process is left, and the stop reads as
one in the console's last line, the exit code (3) and `tuneline status`. The 2-process case, with the rerun that
continues from the stop's checkpoint, is tests/integration/test_ddp_train.py's."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import yaml

from tests.helpers import spawn
from tests.integration.test_ddp_train import _await_checkpoint, _workers_of, assert_stopped
from tests.integration.test_train_support import ROOT, small_config

# Enough steps (~0.1 s each here) that the stop lands mid-run, not after the last one.
TRAIN = {"steps": 300, "checkpoint_every": 4, "batch_size": 2, "processes": 1}


def test_a_stop_reaches_the_worker_alone_which_checkpoints_and_stops(
    tmp_path, upstream_store, demo_data, prefect_server
):
    cfg = small_config(tmp_path, TRAIN, dataset={"path": str(demo_data)})
    upstream_store.upstream(cfg)
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg.dump()))
    env = prefect_server | {"PYTHONPATH": str(ROOT)}
    with open(tmp_path / "cli.log", "w") as log:
        cli = spawn([sys.executable, "-m", "tuneline.flows.cli", "stage", "train", str(cfg_file)], log, env)
        _await_checkpoint(tmp_path, cli, tmp_path / "cli.log", 4, 300)
        partial = next(tmp_path.glob("artifacts/train/.*.partial"))
        running = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in _workers_of(partial)]
        assert running and not [c for c in running if b"procwatch" in c], "one process ran under torchrun's agent"
        os.killpg(cli.pid, signal.SIGTERM)
        rc = cli.wait(timeout=300)
    assert_stopped(tmp_path, cfg_file, env, rc, TRAIN["steps"])
