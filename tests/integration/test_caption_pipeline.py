"""A folder of uncaptioned images trains end to end with caption.model set: `tuneline run` as a user runs it, the
stage in `status`, text/train/validate built from its captions, `captions show|export`, the Prefect markdown
artifact with inline thumbnails, and which stages a change rebuilds with the stage on (rebuild-table rows)."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import yaml
from PIL import Image

from tests.helpers import tuneline
from tests.integration.test_train_support import small_config
from tuneline.schemas.config import load_config
from tuneline.stages.common.jsonl import read_jsonl
from tuneline.stages.common.stage import StageContext, run_stage, status
from tuneline.stages.pipeline import PIPELINE, stage

pytestmark = pytest.mark.slow
COLORS = [(220, 30, 30), (30, 200, 60), (40, 60, 220), (230, 220, 40), (200, 40, 200), (20, 200, 200)]


def write_config(path: Path, workdir: Path, **caption) -> Path:
    data = small_config(
        workdir,
        {"steps": 2, "processes": 1, "checkpoint_every": 2, "validate_every": 0},
        validate={"steps": 2},
        caption={"model": "tiny", "max_new_tokens": 6, **caption},
    ).dump()
    data["dataset"] |= {"demo": False, "path": "photos"}
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory, prefect_server):
    root = tmp_path_factory.mktemp("captioned")
    wd = root / "w"
    (wd / "photos").mkdir(parents=True)
    for i, rgb in enumerate(COLORS):  # no caption files at all
        Image.new("RGB", (64, 64), rgb).save(wd / "photos" / f"img{i}.png")
    cfg = write_config(root / "config.yaml", wd, trigger="sks")
    out = tuneline("run", str(cfg), cwd=root, env=prefect_server)
    assert out.returncode == 0, out.stderr[-4000:]
    return {"root": root, "workdir": wd, "config": cfg, "stdout": out.stdout}


def _manifest(wd: Path, name: str) -> tuple[Path, dict]:
    rows = {r.stage: r for r in status(StageContext(load_config(wd.parent / "config.yaml")), PIPELINE)}
    path = Path(rows[name].path)
    return path, json.loads((path / "manifest.json").read_text())


def test_trains_end_to_end_on_stage_captions(run):
    wd = run["workdir"]
    out = tuneline("status", "--json", str(run["config"]), cwd=run["root"])
    rows = json.loads(out.stdout)
    assert [r["stage"] for r in rows] == ["scan", "caption", "latents", "text", "train", "validate"]
    assert all(r["state"] == "fresh" for r in rows), rows
    cap_dir, cap = _manifest(wd, "caption")
    assert cap["captioned"] == len(COLORS) and cap["reused"] == 0
    captions = {r["caption"] for r in read_jsonl(cap_dir / "captions.jsonl")}
    assert all(c.startswith("sks, ") and len(c) > len("sks, ") for c in captions)
    for name in ("text", "train", "validate"):
        assert _manifest(wd, name)[1]["upstream"]["caption"] == cap["fingerprint"], name
    text_dir, _ = _manifest(wd, "text")
    assert {r["caption"] for r in read_jsonl(text_dir / "captions.jsonl")} - {""} == captions
    assert sorted(p.name for p in (wd / "photos").iterdir()) == [f"img{i}.png" for i in range(len(COLORS))]


def test_captions_show_and_export(run, tmp_path):
    cfg, root = str(run["config"]), run["root"]
    shown = tuneline("captions", "show", cfg, cwd=root)
    assert shown.returncode == 0 and "6 images: 6 model captions" in shown.stdout and "[model] img" in shown.stdout
    out = tuneline("captions", "export", cfg, "--to", str(tmp_path / "review"), cwd=root)
    assert out.returncode == 0, out.stderr
    files = sorted((tmp_path / "review").glob("*.txt"))
    assert [f.stem for f in files] == [f"img{i}" for i in range(len(COLORS))]
    assert all(f.read_text().strip() and not f.read_text().startswith("sks") for f in files)
    refused = tuneline("captions", "export", cfg, "--to", str(run["workdir"] / "photos"), cwd=root)
    assert refused.returncode != 0 and "never written into the dataset" in refused.stderr
    assert "Traceback" not in refused.stderr and not list((run["workdir"] / "photos").glob("*.txt"))


def test_prefect_shows_sample_images_and_captions(run, prefect_server):
    from tests.helpers import prefect_api
    from tests.integration.test_ui_images import _images, _markdown_of

    cap_dir, _ = _manifest(run["workdir"], "caption")
    with prefect_api(prefect_server):  # the server the run used
        samples = asyncio.run(_markdown_of("caption-samples", cap_dir.name))
    assert len(_images(samples)) == len(COLORS) and "sks, " in samples


def _edit_sidecar(w: Path) -> dict:
    (w / "photos" / "img0.txt").write_text("a red photo")
    return {}


def _prompt(w: Path) -> dict:
    return {"prompt": "Name the color."}


def _trigger(w: Path) -> dict:
    return {"trigger": "ohwx"}


def _batch_size(w: Path) -> dict:
    return {"batch_size": 2}


AFTER_CAPTION = {"caption", "text", "train", "validate"}
# A new sidecar changes the scan's records, so latents is rebuilt too, copying every row (as without the stage).
TABLE = [
    (_edit_sidecar, AFTER_CAPTION | {"latents"}),
    (_prompt, AFTER_CAPTION),
    (_trigger, AFTER_CAPTION),
    (_batch_size, set()),
]


@pytest.mark.parametrize("change,rebuilt", TABLE, ids=[c.__name__.strip("_") for c, _ in TABLE])
def test_what_a_change_rebuilds_with_captions(run, tmp_path, change, rebuilt):
    w = tmp_path / "w"
    shutil.copytree(run["workdir"], w, symlinks=True)
    edits = {"trigger": "sks", **change(w)}
    cfg = load_config(write_config(tmp_path / "config.yaml", w, **edits))
    run_stage(StageContext(cfg), stage("scan"), PIPELINE)  # a scheduled run rescans first
    rows = {r.stage: r for r in status(StageContext(cfg), PIPELINE)}
    stale = {name for name, r in rows.items() if r.state != "fresh"}
    assert stale == rebuilt, {n: rows[n].reason for n in stale ^ rebuilt}
    if change is _edit_sidecar:  # exactly that image's caption changes, and nothing is generated again
        before = (
            {r["ref"]: r["caption"] for r in read_jsonl(Path(rows["caption"].path or "") / "captions.jsonl")}
            if rows["caption"].path
            else None
        )
        path, _ = run_stage(StageContext(cfg), stage("caption"), PIPELINE)
        after = {r["ref"]: r for r in read_jsonl(path / "captions.jsonl")}
        assert after["img0.png"]["caption"] == "sks, a red photo" and after["img0.png"]["source"] == "user"
        if before is not None:
            assert {k for k in after if after[k]["caption"] != before[k]} == {"img0.png"}
        m = json.loads((path / "manifest.json").read_text())
        assert (m["captioned"], m["reused"]) == (0, len(COLORS) - 1)


def test_stage_caption_refused_when_off(tmp_path):
    out = tuneline("stage", "caption", "--workdir", str(tmp_path / "w"), cwd=tmp_path)
    assert out.returncode == 1 and "stage caption is off in this config: set caption.model" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "w" / "artifacts" / "caption").exists()
