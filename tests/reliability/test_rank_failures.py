"""A failure on one rank of a 2-process (gloo) training ends the run on every rank at once and names that rank
and what happened to it: not a peer's "Connection closed by peer", not torchrun's SIGTERM to the survivors, and
not after the stop grace or the collective timeout. The rerun (what a Prefect retry of the train flow run does)
continues from the last checkpoint."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.integration.test_train_support import small_config, train
from tests.tracing import tuneline_trace
from tuneline.stages.train.failures import RankLost, TrainingFailed
from tuneline.stages.train.stopping import STOP_GRACE_S

TRAIN = {
    "steps": 30,
    "checkpoint_every": 2,
    "batch_size": 2,
    "grad_accumulation": 1,
    "processes": 2,
    "mode": "lora",
    "ema": False,
}


def _rank_pid(work: Path, rank: int) -> int | None:
    """The training worker of `rank` whose command line names a spec of this workdir."""
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().decode(errors="replace")
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if "tuneline.stages.train.worker" in cmd and str(work) in cmd and f"RANK={rank}".encode() in env:
            return int(proc.name)
    return None


def _in_thread(cfg) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run():
        try:
            box["path"] = train(cfg)
        except BaseException as err:  # noqa: BLE001 - handed to the test
            box["err"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def test_a_rank_killed_mid_step_ends_the_run_in_seconds_naming_it_and_the_rerun_resumes(
    tmp_path, upstream_store, demo_data
):
    cfg = small_config(tmp_path, TRAIN, dataset={"path": str(demo_data)})
    upstream_store.upstream(cfg)
    thread, box = _in_thread(cfg)
    deadline = time.monotonic() + 300
    while not list(tmp_path.glob("artifacts/train/.*.partial/checkpoints/step-0000004")):
        assert thread.is_alive(), box
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    pid = _rank_pid(tmp_path, 1)
    assert pid is not None, "rank 1's worker not found"
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    thread.join(timeout=STOP_GRACE_S)
    took = time.monotonic() - killed
    assert not thread.is_alive(), f"the run outlived the stop grace ({STOP_GRACE_S} s) after rank 1 was killed"
    print(f"the run ended {took:.1f} s after rank 1 was killed")
    err = box.get("err")
    assert isinstance(err, RankLost) and err.exit_code == 5, repr(err)
    msg = str(err)
    assert "rank 1 was killed by SIGKILL" in msg, msg
    assert "closed by peer" not in msg and "SIGTERM" not in msg, msg
    assert not _rank_pid(tmp_path, 0), "rank 0 outlived the run"

    partial = next(tmp_path.glob("artifacts/train/.*.partial"))
    last = max(int(p.name.removeprefix("step-")) for p in (partial / "checkpoints").glob("step-*"))
    resumed = train(cfg)  # train.resume: auto, as a Prefect retry of the train flow run reruns it
    manifest = json.loads((resumed / "manifest.json").read_text())
    assert Path(manifest["resumed_from"]).name == f"step-{last:07d}" and manifest["step"] == TRAIN["steps"]


def test_an_error_on_rank_1_alone_is_reported_as_rank_1s(tmp_path, monkeypatch, upstream_store, demo_data):
    """Rank 1 raises at step 3 (the tracing hook's test-only FAIL_RANK_ENV, standing in for a rank-local error):
    the message is rank 1's exception, not rank 0's lost connection nor the SIGTERM torchrun then sent it."""
    cfg = small_config(tmp_path, TRAIN, dataset={"path": str(demo_data)})
    upstream_store.upstream(cfg)
    tuneline_trace.enable(monkeypatch, tmp_path / "trace")
    (tmp_path / "trace").mkdir()
    monkeypatch.setenv(tuneline_trace.FAIL_RANK_ENV, "1:3")
    with pytest.raises(TrainingFailed) as err:
        train(cfg)
    msg = str(err.value)
    assert type(err.value) is TrainingFailed and err.value.exit_code == 1, repr(err.value)
    assert "rank 1 failed first: RuntimeError: injected failure on rank 1 at step 3" in msg, msg
    assert "closed by peer" not in msg and "SIGTERM" not in msg and "rank 0" not in msg, msg
