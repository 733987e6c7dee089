"""Refusals decided before any Prefect server starts: one message, once, no traceback, nothing written, every
upstream at fault named with one fix that works as printed; the same check inside a flow run started from a
deployment."""

from __future__ import annotations

import os
import re
import shlex
import stat
from pathlib import Path

import pytest
import yaml

from tests.helpers import prefect_api, tuneline

FIX = re.compile(r"`(tuneline [^`]+)`")


@pytest.fixture
def user_config(tmp_path) -> Path:
    """The example config on a copy of the demo's dataset as a user's folder (`dataset.demo: false`)."""
    from tuneline.stages.scan.demo import write_demo_dataset

    write_demo_dataset(tmp_path / "photos")
    return _config(tmp_path / "c.yaml", dataset={"path": str(tmp_path / "photos"), "demo": False})


def _config(path: Path, **edits: dict) -> Path:
    cfg = yaml.safe_load(tuneline("config", "example").stdout)
    for section, values in edits.items():
        cfg[section].update(values)
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def _refused(out, home: Path | None = None) -> str:
    """The one line a refusal prints; Prefect was never started (its home stays empty)."""
    assert out.returncode == 1, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), f"not one message:\n{out.stderr[-3000:]}"
    if home is not None:
        assert not any(home.iterdir()), f"Prefect started for a refusal: {list(home.iterdir())}"
    return lines[0]


def test_stage_names_every_upstream_at_fault_at_once_before_prefect(user_config, tmp_path):
    home = tmp_path / "prefect-home"
    home.mkdir()
    work = tmp_path / "w"
    msg = _refused(
        tuneline("stage", "validate", str(user_config), "--workdir", str(work), env={"PREFECT_HOME": str(home)}), home
    )
    for upstream in ("scan", "latents", "text", "train"):
        assert f"the {upstream} artifact is missing" in msg, msg
    assert f"`tuneline run {user_config} --until validate --workdir {work}`" in msg, msg
    assert not work.exists(), "a refused command wrote its workdir"


def test_one_stage_at_fault_is_fixed_by_that_stage(user_config, tmp_path):
    work = tmp_path / "w"
    msg = _refused(tuneline("stage", "latents", str(user_config), "--workdir", str(work)))
    assert "the scan artifact is missing" in msg and "text" not in msg.split("run `")[0], msg
    assert f"`tuneline stage scan {user_config} --workdir {work}`" in msg, msg


@pytest.mark.slow
def test_until_builds_up_to_the_stage_and_the_printed_fix_works(user_config, tmp_path, prefect_server):
    work = tmp_path / "w"
    msg = _refused(tuneline("stage", "train", str(user_config), "--workdir", str(work)))
    assert all(f"the {s} artifact is missing" in msg for s in ("scan", "latents", "text")), msg
    fix = shlex.split(FIX.findall(msg)[-1])
    assert fix[:2] == ["tuneline", "run"] and "--until" in fix, fix
    # the same shape, one stage earlier, so the test stays short: everything up to text, nothing after it
    fix[fix.index("--until") + 1] = "text"
    out = tuneline(*fix[1:], env=prefect_server)
    assert out.returncode == 0, out.stderr[-3000:]
    states = {r: s for r, s in _states(user_config, work).items()}
    assert states == {
        "scan": "fresh",
        "latents": "fresh",
        "text": "fresh",
        "train": "missing",
        "validate": "missing",
    }, states
    assert "validation images" not in out.stdout
    msg = _refused(tuneline("stage", "validate", str(user_config), "--workdir", str(work)))
    assert (
        "the train artifact is missing" in msg and "scan artifact is" not in msg and "`tuneline stage train " in msg
    ), msg


def _states(config: Path, work: Path) -> dict[str, str]:
    import json

    out = tuneline("status", str(config), "--workdir", str(work), "--json")
    assert out.returncode == 0, out.stderr
    return {r["stage"]: r["state"] for r in json.loads(out.stdout)}


@pytest.mark.parametrize("command", [["run"], ["stage", "scan"]])
def test_missing_input_paths_refused_before_anything(tmp_path, command):
    cfg = _config(
        tmp_path / "c.yaml",
        dataset={"path": str(tmp_path / "nope"), "demo": False},
        model={"path": str(tmp_path / "base.safetensors")},
    )
    home = tmp_path / "prefect-home"
    home.mkdir()
    msg = _refused(
        tuneline(*command, str(cfg), "--workdir", str(tmp_path / "w"), env={"PREFECT_HOME": str(home)}), home
    )
    assert f"dataset.path: {tmp_path / 'nope'}" in msg and f"model.path: {tmp_path / 'base.safetensors'}" in msg
    assert not (tmp_path / "w").exists()


def test_status_does_not_require_the_paths(tmp_path):
    cfg = _config(tmp_path / "c.yaml", dataset={"path": str(tmp_path / "on-the-worker"), "demo": False})
    out = tuneline("status", str(cfg), "--workdir", str(tmp_path / "w"))
    assert "dataset.path" not in out.stderr


@pytest.mark.parametrize("command", [["run"], ["stage", "train"], ["status"], ["lineage"], ["gc"]])
def test_workdir_that_is_a_file_is_refused_in_one_line(tmp_path, command):
    (tmp_path / "w").write_text("not a folder")
    msg = _refused(tuneline(*command, "--workdir", str(tmp_path / "w")))
    assert "is a file" in msg and str(tmp_path / "w") in msg


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through read-only permissions")
def test_read_only_workdir_is_refused_in_one_line(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        msg = _refused(tuneline("run", "--workdir", str(ro / "w")))
    finally:
        ro.chmod(stat.S_IRWXU)
    assert "not writable" in msg


def test_a_deployment_run_makes_the_same_check_and_fails_once(user_config, tmp_path, prefect_server):
    """A flow run started from a deployment (here: the flow called as a worker calls it) refuses with the CLI's
    message as its failed state, not with a traceback."""
    from tuneline.flows import preflight
    from tuneline.flows.stage_flows import latents_flow
    from tuneline.schemas.config import load_config

    cfg = load_config(user_config, str(tmp_path / "w"))
    expected = preflight.upstream_refusal(cfg, "latents")
    assert expected and "the scan artifact is missing" in expected
    with prefect_api(prefect_server):
        state = latents_flow(config=cfg, return_state=True)
    assert state.is_failed() and state.message == expected, (state, state.message)
    assert not (tmp_path / "w" / "artifacts" / "latents").exists()


@pytest.mark.parametrize("command", [["run"], ["stage", "train"]])
def test_a_refusal_imports_neither_prefect_nor_torch(tmp_path, command):
    """Each costs seconds on this machine: the refusal path answers without them."""
    import subprocess
    import sys

    cfg = _config(tmp_path / "c.yaml", dataset={"path": str(tmp_path / "nope"), "demo": False})
    code = (
        "import sys\nfrom tuneline.flows.cli import app\n"
        "try:\n    app(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "print('IMPORTED', *[m for m in ('torch', 'prefect', 'diffusers') if m in sys.modules])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *command, str(cfg), "--workdir", str(tmp_path / "w")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "dataset.path" in out.stderr, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "IMPORTED", out.stdout
