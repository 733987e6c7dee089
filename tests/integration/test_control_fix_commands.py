"""The command a control-related refusal prints works as printed: a control edited while a run was between its scan
and its latents stops that run's latents stage naming `tuneline run --until latents`, and that command, run from the
same directory with the CONFIG and --workdir the CLI adds, leaves the scan and the latents fresh."""

from __future__ import annotations

import re
import shlex

import pytest
import yaml
from PIL import Image

from tests.helpers import tuneline
from tuneline.flows.cli_common import with_invocation
from tuneline.schemas.config import load_config
from tuneline.stages.common.artifacts import ArtifactError
from tuneline.stages.common.lock import run_lease
from tuneline.stages.common.stage import StageContext, run_stage, status
from tuneline.stages.pipeline import PIPELINE, stage

FIX = re.compile(r"`(tuneline [^`]+)`")


def test_a_control_edited_during_a_run_names_a_fix_that_works(tmp_path, prefect_server):
    data, controls = tmp_path / "data", tmp_path / "controls"
    data.mkdir()
    controls.mkdir()
    for i, name in enumerate(("cat", "dog")):
        Image.new("RGB", (64, 64), (40 * i, 90, 200)).save(data / f"{name}.png")
        (data / f"{name}.txt").write_text(f"make the {name} red")
        Image.new("RGB", (64, 64), (i, 2, 3)).save(controls / f"{name}.png")
    config = tmp_path / "paired.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "dataset": {"path": str(data), "control": str(controls)},
                "buckets": {"resolution": 32},
                "model": {"device": "cpu"},
            }
        )
    )
    workdir = str(tmp_path / "work")
    cfg = load_config(config, workdir)
    with run_lease(cfg.workdir_path(), timeout=5):
        ctx = StageContext(cfg)
        run_stage(ctx, stage("scan"), PIPELINE)
        Image.new("RGB", (64, 64), (200, 0, 0)).save(controls / "cat.png")  # edited meanwhile
        with pytest.raises(ArtifactError, match="changed since the scan") as err:
            run_stage(ctx, stage("latents"), PIPELINE)
    printed = with_invocation(str(err.value), str(config), workdir)  # as the CLI prints it (flows/cli_common.py)
    [command] = FIX.findall(printed)
    assert command == f"tuneline run {config} --until latents --workdir {workdir}"
    out = tuneline(*shlex.split(command)[1:], cwd=tmp_path, env=prefect_server)
    assert out.returncode == 0, out.stderr[-3000:]
    states = {r.stage: r.state for r in status(StageContext(cfg), [stage("scan"), stage("latents")])}
    assert states == {"scan": "fresh", "latents": "fresh"}
