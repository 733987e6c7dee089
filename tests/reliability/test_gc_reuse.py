"""`tuneline gc --keep 0` keeps what the next run reuses: a touched image, a Thumbs.db or a moved dataset folder
change the scan's listing but not what a rescan publishes, so status calls every stage fresh ("listing changed;
the next run rescans and reuses ..."), gc deletes none of them, and the next run builds nothing new. A real
content change still lets gc collect the old versions."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from PIL import Image

from tests.reliability import faultlib as fl

pytestmark = pytest.mark.timeout(1800)


def _dataset_copy(small_config: Path, src: Path, dst: Path) -> Path:
    """The dataset copied to `dst` (copy2 keeps mtimes, as `mv` does) and a config naming it."""
    cfg = yaml.safe_load(small_config.read_text(encoding="utf-8"))
    shutil.copytree(src, dst, symlinks=True)
    cfg["dataset"]["path"] = str(dst)
    return fl.write_config(dst.with_suffix(".yaml"), cfg)


def _own_dataset(small_config: Path, workdir: Path, tmp_path: Path, env: dict) -> tuple[Path, Path]:
    """The prepared workdir with its scan republished from a private copy of the dataset, for the test to touch
    (the scan republishes the same version: the records hold relative paths)."""
    shared = Path(yaml.safe_load(small_config.read_text(encoding="utf-8"))["dataset"]["path"])
    config = _dataset_copy(small_config, shared, tmp_path / "data")
    out = fl.tuneline("stage", "scan", str(config), "--workdir", str(workdir), env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return config, tmp_path / "data"


def _status(config: Path, workdir: Path, env: dict) -> list[dict]:
    out = fl.tuneline("status", str(config), "--workdir", str(workdir), "--json", env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def _gc(config: Path, workdir: Path, env: dict) -> str:
    out = fl.tuneline("gc", str(config), "--workdir", str(workdir), "--keep", "0", env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def _survives(workdir: Path, fresh: dict[str, str]) -> list[str]:
    """The fresh versions gc deleted."""
    return [f"{s} {v}" for s, v in fresh.items() if v not in fl.published(workdir, s)]


@pytest.mark.parametrize("case", ["touched", "Thumbs.db", "moved"])
def test_gc_keeps_every_version_a_rerun_reuses(case, workcopy, small_config, prefect_env, tmp_path):
    config, data = _own_dataset(small_config, workcopy, tmp_path, prefect_env)
    fresh = {r["stage"]: r["version"] for r in _status(config, workcopy, prefect_env)}
    if case == "touched":
        os.utime(sorted(data.rglob("*.png"))[0])
    elif case == "Thumbs.db":
        (data / "Thumbs.db").write_bytes(b"\x00" * 512)
    else:
        config = _dataset_copy(small_config, data, tmp_path / "moved")
        shutil.rmtree(data)
    rows = _status(config, workcopy, prefect_env)
    assert {r["state"] for r in rows} == {"fresh"}, rows
    reused = ", ".join(f"{s} {v}" for s, v in fresh.items())
    assert rows[0]["reason"] == f"listing changed; the next run rescans and reuses {reused}"
    _gc(config, workcopy, prefect_env)
    assert _survives(workcopy, fresh) == []
    kept = {s: fl.published(workcopy, s) for s in fresh}
    out = fl.tuneline("run", str(config), "--workdir", str(workcopy), env=prefect_env, timeout=1500)
    assert out.returncode == 0, out.stderr[-3000:]
    assert {s: fl.published(workcopy, s) for s in fresh} == kept, "the rerun reused every version gc kept"
    assert [(r["state"], r["reason"]) for r in _status(config, workcopy, prefect_env)] == [
        ("fresh", "up to date")
    ] * len(fresh)


def test_gc_collects_the_old_versions_after_a_content_change(workcopy, small_config, prefect_env, tmp_path):
    config, data = _own_dataset(small_config, workcopy, tmp_path, prefect_env)
    fresh = {r["stage"]: r["version"] for r in _status(config, workcopy, prefect_env)}
    image = sorted(data.rglob("*.png"))[0]
    with Image.open(image) as im:
        edited = im.convert("RGB")
    edited.putpixel((0, 0), tuple(255 - c for c in edited.getpixel((0, 0))))
    edited.save(image)
    rows = _status(config, workcopy, prefect_env)
    assert rows[0]["state"] == "stale" and {r["state"] for r in rows[1:]} <= {"stale", "missing"}, rows
    _gc(config, workcopy, prefect_env)
    assert sorted(_survives(workcopy, fresh)) == sorted(f"{s} {v}" for s, v in fresh.items())
