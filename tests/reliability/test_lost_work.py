"""Lost work: `tuneline gc` while a `tuneline run` is in progress in the same workdir collects nothing the run
published or uses (the run's lease on the workdir, stages/common/lock.py)."""

from __future__ import annotations

import time

import psutil
import pytest
import yaml

from tests.helpers import spawn
from tests.reliability import faultlib as fl

pytestmark = pytest.mark.timeout(2400)


def _has_open(pid: int, path) -> bool:
    try:
        return any(f.path == str(path) for f in psutil.Process(pid).open_files())
    except psutil.Error:
        return False


def test_gc_never_collects_what_a_run_in_progress_uses(workcopy, small_config, prefect_env, tmp_path):
    from tuneline.flows.ops import gc
    from tuneline.schemas.config import load_config
    from tuneline.stages.common.lock import StoreLocked, store_lock

    fl.drop_stage(workcopy, "validate")  # the run Y still has a stage to build after those it reuses
    trained = fl.published(workcopy, "train")
    other = yaml.safe_load(small_config.read_text(encoding="utf-8"))
    other["train"]["steps"] += 1  # config X: another training, so Y's train version is not fresh for X
    other["ops"]["lock_timeout"] = 2
    x_cfg = load_config(fl.write_config(tmp_path / "x.yaml", other), str(workcopy))
    log = open(tmp_path / "y.log", "w")
    # The test holds the store lock, so Y is in progress but between stages (waiting), as it is each time one
    # stage hands over to the next; gc then runs in this process (the lock is re-entrant within a thread).
    y = None
    try:
        with store_lock(workcopy, timeout=5, purpose="test"):
            y = spawn(fl.cli_args("run", str(small_config), "--workdir", str(workcopy)), log, prefect_env, group=False)
            deadline = time.monotonic() + 300
            while not _has_open(y.pid, workcopy / ".tuneline.lock") and y.poll() is None:
                assert time.monotonic() < deadline, "the run never reached the store lock"
                time.sleep(0.2)
            with pytest.raises(StoreLocked, match="in progress"):
                gc(x_cfg, 0)
            assert fl.published(workcopy, "train") == trained
        assert y.wait(timeout=1500) == 0, (tmp_path / "y.log").read_text()[-3000:]
    finally:
        if y is not None and y.poll() is None:  # a failed check must not leave the run behind
            y.kill()
            y.wait()
    assert fl.published(workcopy, "train") == trained  # not collected, so not trained again
    # With the run finished, gc proceeds (and keeps what X uses).
    p, _ = gc(x_cfg, 0)
    assert any(path.parent.name == "train" for path in p.remove)
    log.close()
