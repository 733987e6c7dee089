"""Session fixtures of the reliability suite: the session's Prefect server for every CLI run, the kill walk, and one
prepared workdir (every stage published) that destructive tests copy with shutil.copytree."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.helpers import report
from tests.reliability import faultlib as fl

KILLS_PER_STAGE = int(os.environ.get("TUNELINE_CI_KILLS_PER_STAGE", "2"))


@pytest.fixture(scope="session")
def rel_tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("reliability")


@pytest.fixture(scope="session")
def prefect_env(prefect_server):
    """Environment for `tuneline` subprocesses: the session's Prefect server instead of one temporary server per
    run (tests/conftest.py)."""
    return prefect_server


@pytest.fixture(scope="session")
def small_config(rel_tmp) -> Path:
    # Two latents shards: the walk also kills a sharded stage (the stage and its shard processes, as one group).
    return fl.write_config(rel_tmp / "config.yaml", fl.small_config(rel_tmp / "data", **{"latents.shards": 2}))


@pytest.fixture(scope="session")
def kill_walk(request, rel_tmp, small_config, prefect_env):
    """The CI kill walk (tests/reliability/killwalk.py); its final workdir becomes the prepared workdir."""
    from tests.reliability import killwalk

    workdir = rel_tmp / "walk"
    result = killwalk.walk(workdir, small_config, prefect_env, KILLS_PER_STAGE, seed=8, log=rel_tmp / "walk.log")
    request.config._tuneline_walk = workdir
    lines = result.summary().split("; ") + [
        f"  aimed {k.target:8s} +{k.delay:6.2f}s -> {k.landed:8s} {k.phase:7s} "
        f"workers {k.workers} progress {k.progress} "
        f"{'OK' if not k.problems else 'PROBLEMS: ' + '; '.join(k.problems)}"
        for k in result.kills
    ]
    report(request.config, "fault injection (kill walk)", lines)
    return result


@pytest.fixture(scope="session")
def prepared(request, rel_tmp, small_config, prefect_env) -> Path:
    """A workdir with every stage published for the small config: the kill walk's, when it ran first and left
    every stage fresh, else one `tuneline run`."""
    walked = getattr(request.config, "_tuneline_walk", None)
    if walked is not None and _all_fresh(walked, small_config, prefect_env):
        return walked
    workdir = rel_tmp / "prepared"
    shutil.rmtree(workdir, ignore_errors=True)
    out = fl.tuneline("run", str(small_config), "--workdir", str(workdir), env=prefect_env, timeout=1800)
    assert out.returncode == 0, f"preparing the workdir failed:\n{out.stderr[-3000:]}"
    return workdir


def _all_fresh(workdir: Path, config: Path, env: dict) -> bool:
    import json

    out = fl.tuneline("status", str(config), "--workdir", str(workdir), "--json", env=env)
    return out.returncode == 0 and all(row["state"] == "fresh" for row in json.loads(out.stdout))


@pytest.fixture
def workcopy(prepared, tmp_path) -> Path:
    """A private copy of the prepared workdir (mtimes kept: the scan's fingerprint includes them)."""
    dst = tmp_path / "work"
    shutil.copytree(prepared, dst, symlinks=True)
    return dst
