"""What `--help` and `status` show a newcomer: flags without a value placeholder, the path column status promises."""

from __future__ import annotations

import re

import pytest

from tests.helpers import tuneline


@pytest.mark.parametrize("command", [["run"], ["stage"], ["status"], ["gc"], ["lineage"]])
def test_boolean_flags_show_no_value(command):
    out = tuneline(*command, "--help", env={"COLUMNS": "120"})
    assert out.returncode == 0, out.stderr
    flags = re.findall(r"^\s+(--(?:force|json|dry-run|partial|help))(.*)$", out.stdout, re.M)
    assert flags, out.stdout
    for flag, rest in flags:
        assert not rest.strip().startswith(("<", "BOOL", "[")), f"{flag} shows a value: {flag}{rest}"
    assert "<bool>" not in out.stdout and "BOOLEAN" not in out.stdout, out.stdout


def test_status_prints_the_path_column_its_help_promises(tmp_path):
    assert "path" in tuneline("status", "--help").stdout
    out = tuneline("status", "--workdir", str(tmp_path / "w"), env={"COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    header = next(line for line in out.stdout.splitlines() if "stage" in line and "state" in line)
    assert re.search(r"\bpath\b", header), out.stdout
