"""A no-op `tuneline run` decides whether a Prefect server is configured without importing Prefect where nothing
can configure one, and agrees with Prefect's own settings wherever something might."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

CHECK = (
    "import sys\n"
    "from tuneline.flows.server import server_configured\n"
    "ours = server_configured()\n"
    "imported = 'prefect' in sys.modules\n"
    "from prefect.settings import get_current_settings\n"
    "print(ours, bool(get_current_settings().api.url), imported)\n"
)


def _ask(tmp_path, env: dict) -> tuple[str, str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    out = subprocess.run(
        [sys.executable, "-c", CHECK],
        cwd=tmp_path,
        env=clean | {"PREFECT_HOME": str(tmp_path / "home"), "PYTHONPATH": str(ROOT)} | env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    return tuple(out.stdout.split())


@pytest.mark.parametrize(
    ("profiles", "env", "expect"),
    [
        (None, {}, False),
        (None, {"PREFECT_API_URL": "http://127.0.0.1:4300/api"}, True),
        (None, {"PREFECT_PROFILE": "local"}, None),  # Prefect's own `local` profile may name one: Prefect decides
        ('active = "mine"\n[profiles.mine]\nPREFECT_API_URL = "http://h:4200/api"\n', {}, True),
        ('active = "mine"\n[profiles.mine]\nPREFECT_LOGGING_LEVEL = "DEBUG"\n', {}, False),
    ],
)
def test_agrees_with_prefect_and_skips_its_import_when_nothing_names_a_server(tmp_path, profiles, env, expect):
    (tmp_path / "home").mkdir()
    if profiles:
        (tmp_path / "home" / "profiles.toml").write_text(profiles)
    ours, prefects, imported = _ask(tmp_path, env)
    assert ours == prefects and (expect is None or ours == str(expect))
    if expect is False:
        assert imported == "False", "Prefect was imported although nothing could name a server"


def test_a_settings_file_here_is_left_to_prefect(tmp_path):
    (tmp_path / "home").mkdir()
    (tmp_path / "prefect.toml").write_text('[api]\nurl = "http://h:4200/api"\n')
    ours, prefects, _ = _ask(tmp_path, {})
    assert ours == prefects == "True"
