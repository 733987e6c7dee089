"""The paths a new user walks first: the README's quick start verbatim, relative paths everywhere, the installed
console script."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import ROOT, STAGES, readme_commands, run_readme_command, tuneline

pytestmark = pytest.mark.slow


def test_readme_quick_start_works_verbatim_from_a_fresh_clone(demo_run):
    """The demo command ran as written (conftest's demo_run); `tuneline status` from the same folder, with no
    arguments, finds every stage fresh in the default ./tuneline-work."""
    clone = demo_run["clone"]
    out = run_readme_command(". .venv/bin/activate && tuneline status --json", clone)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout)
    assert [r["stage"] for r in rows] == STAGES
    assert all(r["state"] == "fresh" for r in rows), rows
    assert all(Path(r["path"]).is_relative_to(clone / "tuneline-work") for r in rows), rows
    assert "validation images:" in demo_run["stdout"]


def test_readme_test_command_is_what_ci_runs():
    _, tests = readme_commands()
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert tests.split("&&")[-1].strip() in ci.splitlines(), "CI must run the README's test command"
    assert 'pip install -e ".[test]"' in tests and "torch==2.13.0" in tests


def test_console_script_is_installed():
    script = Path(sys.prefix) / "bin" / "tuneline"
    assert script.is_file(), f"no `tuneline` console script in {script.parent}: pip install -e . installs it"
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and "status" in out.stdout, out.stderr


def test_relative_workdir_dataset_model_and_resume(demo_run, tmp_path, prefect_server):
    """A relative --workdir resolves against where the command runs; dataset.path, model.path and train.resume
    against the workdir, in every process of the run (torchrun workers run in the partial train directory)."""
    here = tmp_path / "project"
    work = here / "runs" / "w"
    shutil.copytree(demo_run["workdir"] / "demo-data", work / "photos")
    model = next((demo_run["workdir"] / "models").iterdir())
    shutil.copytree(model, work / "base")
    cfg = yaml.safe_load(tuneline("config", "example").stdout)
    cfg["dataset"].update(path="photos", demo=False)
    cfg["model"]["path"] = "base"
    cfg["train"].update(steps=4, checkpoint_every=2, validate_every=0, processes=1)
    cfg["validate"].update(learning_check=False, steps=2)
    (here / "c.yaml").write_text(yaml.safe_dump(cfg))
    first = tuneline("run", "c.yaml", "--workdir", "runs/w", cwd=here, env=prefect_server)
    assert first.returncode == 0, first.stderr[-3000:]
    rows = {
        r["stage"]: r
        for r in json.loads(tuneline("status", "c.yaml", "--workdir", "runs/w", "--json", cwd=here).stdout)
    }
    assert all(r["state"] == "fresh" for r in rows.values()), rows
    train = Path(rows["train"]["path"])
    assert train.parent == work / "artifacts" / "train"

    # Continue from that run's checkpoint, named relative to the workdir, for 2 more steps.
    checkpoint = sorted((train / "checkpoints").iterdir())[-1]
    assert checkpoint.name.endswith("4")
    cfg["train"].update(steps=6, resume=f"artifacts/train/{train.name}/checkpoints/{checkpoint.name}")
    (here / "c.yaml").write_text(yaml.safe_dump(cfg))
    second = tuneline("stage", "train", "c.yaml", "--workdir", "runs/w", cwd=here, env=prefect_server)
    assert second.returncode == 0, second.stderr[-3000:]
    manifest = json.loads((Path(second.stdout.strip().splitlines()[-1]) / "manifest.json").read_text())
    assert manifest["resumed_from"] == str(checkpoint)
    assert manifest["step"] == 6
