"""Control folders (dataset.control) are held to the dataset's rules: a control symlinked out of the folder, or a
symlink loop, is rejected by the scan with kind `symlink` (its target image with it) and nothing outside is opened;
a file appearing in (or leaving) the control folder during a run changes nothing for that run."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from PIL import Image

from tuneline.schemas.config import parse_config
from tuneline.stages.common.hashing import digest
from tuneline.stages.common.jsonl import read_jsonl
from tuneline.stages.common.lock import run_lease
from tuneline.stages.common.stage import StageContext, expected_versions, run_stage
from tuneline.stages.scan import STAGE

_opened: list[str] = []


def _audit(event: str, args: tuple) -> None:
    if event == "open" and isinstance(args[0], str | bytes | os.PathLike):
        _opened.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # every open() in the process, PIL's and the scan threads' included


def _paired(tmp_path: Path) -> tuple[Path, Path, Path]:
    data, controls, outside = tmp_path / "data", tmp_path / "controls", tmp_path / "elsewhere"
    for d in (data, controls, outside):
        d.mkdir()
    for i, name in enumerate(("cat", "dog", "owl", "emu")):
        Image.new("RGB", (64, 64), (40 * i, 90, 200)).save(data / f"{name}.png")
        (data / f"{name}.txt").write_text(f"make the {name} red")
    Image.new("RGB", (64, 64), (1, 2, 3)).save(controls / "cat.png")
    Image.new("RGB", (64, 64), (4, 5, 6)).save(controls / "stray.png")  # no image pairs with it
    Image.new("RGB", (64, 64), (9, 9, 9)).save(outside / "secret.png")
    (controls / "dog.png").symlink_to(outside / "secret.png")  # out of the folder
    (controls / "owl.png").symlink_to(controls / "emu.png")  # a loop: owl -> emu -> owl
    (controls / "emu.png").symlink_to(controls / "owl.png")
    return data, controls, outside


def _config(tmp_path: Path, data: Path, controls: Path):
    return parse_config(
        {
            "workdir": str(tmp_path / "work"),
            "dataset": {"path": str(data), "control": str(controls)},
            "buckets": {"resolution": 32},
        },
        "<test>",
    )


def test_a_control_out_of_its_folder_or_a_loop_is_rejected_with_its_image_unread(tmp_path):
    data, controls, outside = _paired(tmp_path)
    _opened.clear()
    path, _ = run_stage(StageContext(_config(tmp_path, data, controls)), STAGE, [STAGE])
    records = {r["path"]: r for r in read_jsonl(path / "images.jsonl")}
    rejected = {r["path"]: r for r in read_jsonl(path / "rejected.jsonl")}
    assert set(records) == {"cat.png"}
    assert rejected["dog.png"]["kind"] == "symlink"
    assert (
        f"its control {controls / 'dog.png'}: symlink to {outside / 'secret.png'}, outside dataset.control"
        in (rejected["dog.png"]["reason"])
    )
    assert {rejected[n]["kind"] for n in ("owl.png", "emu.png")} == {"symlink"}
    assert "symlink loop" in rejected["owl.png"]["reason"]
    assert not [p for p in _opened if Path(p).resolve() == (outside / "secret.png").resolve()], "read the outside file"


def _scan_key(cfg) -> str:
    return digest(expected_versions(StageContext(cfg), [STAGE])["scan"][1])


def test_a_file_appearing_or_leaving_in_the_control_folder_during_a_run_changes_nothing(tmp_path):
    data, controls, _ = _paired(tmp_path)
    cfg = _config(tmp_path, data, controls)
    with run_lease(cfg.workdir_path(), timeout=5):
        started = _scan_key(cfg)  # the scan stage of the run
        (controls / "Thumbs.db").write_bytes(b"\x00" * 512)
        (controls / "stray.png").unlink()
        assert _scan_key(cfg) == started  # latents, text, validate later in the same run
    assert _scan_key(cfg) != started  # the next run sees the change
