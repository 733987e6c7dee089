"""The small things a newcomer meets first: --version, help that is not cut short, a typo'd key answered with the
key meant, a relative path refused with the rule that resolved it, `config example` commented and `--minimal`."""

from __future__ import annotations

import os
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

from tests.helpers import tuneline
from tuneline.flows import preflight
from tuneline.schemas.config import ConfigError, example_yaml, load_config, parse_config
from tuneline.stages.pipeline import STAGE_NAMES


def test_version():
    out = tuneline("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"tuneline {version('tuneline')}", out


def _cut(help_text: str) -> bool:
    """Whether a help text has a description cut short ("..." outside the usage line's own `[ARGS]...`)."""
    body = [line for line in help_text.splitlines() if not line.startswith("Usage:")]
    return any("..." in line or "…" in line for line in body)


def test_help_is_whole_and_lists_every_stage():
    main = tuneline("--help")
    assert main.returncode == 0 and not _cut(main.stdout), main.stdout
    # each command's first sentence, whole (wrapped lines joined)
    flat = " ".join(main.stdout.split())
    assert "Run the whole pipeline (or up to --until); stages already fresh are skipped." in flat
    assert (
        "Planned peak GPU memory per training process; exit 0 when it fits, 2 when not (with the settings that fit)."
        in flat
    )
    for command in ("stage", "run", "status", "plan", "config example", "captions show", "remote push"):
        out = tuneline(*command.split(), "--help")
        assert out.returncode == 0 and "[[" not in out.stdout and not _cut(out.stdout), out.stdout
    stage = " ".join(tuneline("stage", "--help").stdout.split())
    assert all(name in stage for name in STAGE_NAMES) and "caption" in STAGE_NAMES


@pytest.mark.parametrize(
    ("section", "typo", "meant"),
    [("train", "stpes", "train.steps"), ("buckets", "resolutoin", "buckets.resolution"), (None, "trian", "train")],
)
def test_a_near_miss_key_names_the_key_meant(section, typo, meant):
    data = {section: {typo: 3}} if section else {typo: {}}
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert f"{meant if section is None else section + '.' + typo}: unknown key: did you mean {meant}?" in str(
        err.value
    ) or f"{typo}: unknown key: did you mean {meant}?" in str(err.value)


def test_a_far_key_gets_no_guess():
    with pytest.raises(ConfigError) as err:
        parse_config({"train": {"zzzzzz": 1}})
    assert "train.zzzzzz: unknown key" in str(err.value) and "did you mean" not in str(err.value)


def test_a_relative_path_refusal_says_it_was_resolved_against_the_workdir(tmp_path, monkeypatch):
    """The images beside the command, `dataset.path: photos`: looked for in the workdir. The message says so, why,
    and names the folder that exists; the path it suggests passes."""
    (tmp_path / "photos").mkdir()
    monkeypatch.chdir(tmp_path)
    cfg = parse_config({"dataset": {"path": "photos", "demo": False}})
    with pytest.raises(preflight.Refused) as err:
        preflight.check_paths(cfg)
    msg = str(err.value)
    work = tmp_path / "tuneline-work"
    assert f"dataset.path: {work / 'photos'}" in msg
    assert f"resolved against the workdir ({work})" in msg and "not the directory tuneline runs in" in msg
    assert f"{tmp_path / 'photos'} exists: write dataset.path: {tmp_path / 'photos'} (or ../photos)" in msg
    preflight.check_paths(parse_config({"dataset": {"path": "../photos", "demo": False}}))


def test_config_example_is_commented_from_the_schema_and_equal_to_the_demo():
    out = tuneline("config", "example")
    assert out.returncode == 0
    comments = [line.strip() for line in out.stdout.splitlines() if line.strip().startswith("#")]
    assert len(comments) > 100
    assert "# where artifacts go" in comments  # workdir's description in the schema
    assert yaml.safe_load(out.stdout) == yaml.safe_load(example_yaml())


def test_config_example_minimal_is_a_few_lines_that_load_and_pass_the_checks(tmp_path):
    out = tuneline("config", "example", "--minimal", cwd=tmp_path)
    assert out.returncode == 0
    lines = [line for line in out.stdout.splitlines() if line.strip() and not line.strip().startswith("#")]
    assert len(lines) <= 15, out.stdout
    (tmp_path / "my.yaml").write_text(out.stdout)
    (tmp_path / "my-images").mkdir()
    cwd = Path.cwd()
    os.chdir(tmp_path)
    try:
        cfg = load_config(tmp_path / "my.yaml")
        preflight.check_paths(cfg)  # ../my-images from the workdir is the folder beside the command
    finally:
        os.chdir(cwd)
    assert cfg.train.mode == "lora" and os.path.normpath(cfg.dataset.path) == str(tmp_path / "my-images")
    status = tuneline("status", "my.yaml", "--json", cwd=tmp_path)
    assert status.returncode == 0, status.stderr
