"""A tampered captions.jsonl refuses the stages that read it with ONE fix (it once recommended `--force` and then
ended with another command), and that command, run as printed, makes the caption artifact fresh again."""

from __future__ import annotations

import re
import shlex

import pytest
import yaml

from tests.helpers import tuneline
from tests.integration.test_caption_stage import cfg_for, make_dataset
from tuneline.stages.common.stage import StageContext, run_stage, status
from tuneline.stages.pipeline import PIPELINE, stage

pytestmark = pytest.mark.slow
FIX = re.compile(r"`(tuneline [^`]+)`")


def test_a_tampered_caption_artifact_names_one_fix_that_works(tmp_path, prefect_server):
    workdir = tmp_path / "w"
    make_dataset(workdir / "data")
    cfg = cfg_for(workdir)
    ctx = StageContext(cfg)
    run_stage(ctx, stage("scan"), PIPELINE)
    captions, _ = run_stage(ctx, stage("caption"), PIPELINE)
    jsonl = captions / "captions.jsonl"
    jsonl.write_bytes(jsonl.read_bytes().replace(b"a", b"e", 1))  # same size, other bytes
    config = tmp_path / "captioned.yaml"
    config.write_text(yaml.safe_dump(cfg.dump()))
    out = tuneline("stage", "text", str(config), "--workdir", str(workdir), cwd=tmp_path, env=prefect_server)
    assert out.returncode == 1
    assert "captions.jsonl does not match its checksum" in out.stderr and "--force" not in out.stderr
    [fix] = FIX.findall(out.stderr)
    assert fix == f"tuneline stage caption {config} --workdir {workdir}"
    assert tuneline(*shlex.split(fix)[1:], cwd=tmp_path, env=prefect_server).returncode == 0
    row = next(r for r in status(StageContext(cfg), PIPELINE) if r.stage == "caption")
    assert (row.state, row.version) == ("fresh", captions.name)
