"""Fault injection in CI: the kill walk (tests/reliability/killwalk.py) SIGKILLs `tuneline run` as a whole process
group at seeded random points, at least twice in every stage, then runs it to completion. `bench/faults.py`
does the same with >= 10 kills per stage. Counts are printed at the end of the session."""

from __future__ import annotations

import pytest

from tests.reliability import faultlib as fl
from tests.reliability.conftest import KILLS_PER_STAGE

pytestmark = [
    pytest.mark.timeout(2400),  # the session fixtures (kill walk, prepared workdir) run inside the first test
    pytest.mark.ddp(reason="killed 2-rank trainings: every worker dies with the run, the rerun resumes"),
]


@pytest.mark.parametrize("stage", fl.STAGES)
def test_every_stage_is_killed(kill_walk, stage):
    assert kill_walk.aimed(stage) >= KILLS_PER_STAGE, kill_walk.summary()


def test_killed_runs_leave_no_partial_version_no_process_no_lock(kill_walk):
    per_kill = [f"{k.target}->{k.landed} after {k.delay}s: {p}" for k in kill_walk.kills for p in k.problems]
    assert per_kill == [], "\n".join(per_kill)


def test_reruns_complete_and_publish_versions_that_verify(kill_walk):
    assert kill_walk.final == [], "\n".join(kill_walk.final)


def test_reruns_keep_finished_work(kill_walk):
    """Latents: every row in a finished block at the kill is resumed, not re-encoded. Train: the rerun continues
    from the last checkpoint the killed run wrote (train.resume: latest). Checked in the walk; here we make sure
    the walk did kill both after they had recorded finished work, so the check ran."""
    assert any(k.landed == "latents" and k.progress.get("rows") for k in kill_walk.kills), kill_walk.summary()
    assert any(k.landed == "train" and k.progress.get("checkpoints") for k in kill_walk.kills), kill_walk.summary()
    assert not [p for p in kill_walk.problems if "work lost" in p or "still there" in p]


def test_training_workers_were_alive_at_a_kill_and_died_with_it(kill_walk):
    """torchrun starts workers in their own sessions, out of reach of the group kill: they must notice."""
    killed = [k for k in kill_walk.kills if k.workers]
    assert killed, "no kill landed while training workers ran: the process check proved nothing"
    assert not [p for k in killed for p in k.problems if "still running" in p]


def test_killed_training_releases_its_concurrency_slot(kill_walk, prefect_env):
    assert any(k.landed == "train" for k in kill_walk.kills)
    assert fl.train_slots(prefect_env) == 0


def test_the_checks_catch_what_they_look_for(tmp_path):
    """The post-kill checks are not vacuous: a held flock, a live process naming the workdir, a directory
    without a manifest under artifacts/<stage>/ are all reported."""
    import subprocess
    import sys

    (tmp_path / ".tuneline.lock").write_text("{}")
    (tmp_path / "artifacts" / "scan" / "0123456789abcdef").mkdir(parents=True)
    (tmp_path / "artifacts" / "scan" / ".0123.partial").mkdir()
    code = (
        f"import fcntl, time; f = open({str(tmp_path / '.tuneline.lock')!r}); fcntl.flock(f, fcntl.LOCK_EX); "
        f"print('ok', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ok"
        assert fl.held_locks(tmp_path) and fl.survivors({}, tmp_path, grace=0.5)
        assert [p for p in fl.visible_partials(tmp_path) if "0123456789abcdef" in p]
        assert not [p for p in fl.visible_partials(tmp_path) if ".0123.partial" in p]
    finally:
        proc.kill()
        proc.wait()
    assert fl.held_locks(tmp_path) == [] and fl.survivors({}, tmp_path, grace=5) == []
