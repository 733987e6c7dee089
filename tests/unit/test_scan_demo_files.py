"""`dataset.demo: true` deletes only files the demo wrote; build folders of killed demo generations go."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tuneline.schemas.config import ConfigError
from tuneline.stages.scan import demo


def test_a_stale_demo_folder_with_other_files_is_never_deleted(tmp_path):
    root = tmp_path / "data"
    demo.write_demo_dataset(root)
    (root / demo.MARKER).write_text("0", encoding="utf-8")  # an older demo version: to be regenerated
    (root / "holiday.jpg").write_bytes(b"the user's photo")
    with pytest.raises(ConfigError, match="holiday.jpg"):
        demo.write_demo_dataset(root)
    assert (root / "holiday.jpg").read_bytes() == b"the user's photo"
    assert (root / "red_circle_64x64_0.png").is_file()  # nothing of the folder was deleted


def test_a_stale_demo_folder_of_its_own_files_is_regenerated(tmp_path):
    root = tmp_path / "data"
    demo.write_demo_dataset(root)
    (root / demo.FILES).unlink()  # a folder from before the manifest: the demo's own names are known
    (root / demo.MARKER).write_text("0", encoding="utf-8")
    demo.write_demo_dataset(root)
    assert demo.is_complete(root) and (root / demo.FILES).is_file()


def test_leftover_build_folders_of_dead_processes_are_removed(tmp_path):
    root = tmp_path / "data"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".data.tmp-{int(dead.stdout)}"
    stale.mkdir()
    (stale / "red_circle_64x64_0.png").write_bytes(b"half")
    live = tmp_path / ".data.tmp-1"  # pid 1 is alive: another run's build in progress
    live.mkdir()
    demo.write_demo_dataset(root)
    assert not stale.exists() and live.exists() and demo.is_complete(root)
