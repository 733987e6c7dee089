"""Masks and controls as WebDataset members of their own (`key.mask.png`, `key.control.png`; dataset.masks and
dataset.control `members`), in a shard written by webdataset's TarWriter and kept in object storage (the suite's
moto server): the scan pairs them by key as folders pair files by stem, and the latents stage reads them by byte
range (a shard's masks in a few sequential reads) into the same mask planes and control latents as the same files
in a mask folder and a control folder give."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from tests.integration.test_s3_remote import BUCKET, CREDS, s3  # noqa: F401  (s3: the moto server fixture)
from tests.integration.test_scan_stage import noise
from tuneline.schemas.config import parse_config
from tuneline.schemas.scan import ScanManifest
from tuneline.stages.common.jsonl import read_jsonl
from tuneline.stages.common.remote import OPTIONS_ENV, Remote
from tuneline.stages.common.stage import StageContext, StageFailed, run_stage
from tuneline.stages.latents import controls
from tuneline.stages.latents.masks import mask_file
from tuneline.stages.pipeline import PIPELINE, stage
from tuneline.stages.scan.images import load_rgb
from tuneline.stages.scan.members import control_file
from tuneline.stages.text.controls import load_control as text_control
from tuneline.stages.validate.edits import load_control as validate_control

KEYS = ("a", "b", "c")  # a: mask and control; b: control only; c: neither (rejected: no control)


def _png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def member_samples() -> dict[str, dict[str, bytes]]:
    mask = np.zeros((64, 64), np.uint8)
    mask[:, 32:] = 255  # the right half is trained
    out = {k: {"png": _png(noise((64, 64), seed=i)), "txt": f"make {k} red".encode()} for i, k in enumerate(KEYS)}
    out["a"]["mask.png"] = _png(Image.fromarray(mask, "L"))
    out["a"]["control.png"] = _png(noise((48, 32), seed=10))  # any size: resized to its image's
    out["b"]["control.png"] = _png(noise((64, 64), seed=11))
    return out


def write_member_shard(root: Path, samples: dict) -> Path:
    root.mkdir(exist_ok=True)
    with wds.TarWriter(str(root / "000000.tar")) as sink:
        for key, sample in samples.items():
            sink.write({"__key__": key, **sample})
    return root


def _as_folders(root: Path, samples: dict) -> tuple[Path, Path, Path]:
    """The same samples as an image folder, a mask folder and a control folder."""
    data, masks, ctl = (root / n for n in ("data", "masks", "controls"))
    for d in (data, masks, ctl):
        d.mkdir(parents=True)
    for key, sample in samples.items():
        (data / f"{key}.png").write_bytes(sample["png"])
        (data / f"{key}.txt").write_bytes(sample["txt"])
        for ext, folder in (("mask.png", masks), ("control.png", ctl)):
            if ext in sample:
                (folder / f"{key}.png").write_bytes(sample[ext])
    return data, masks, ctl


@pytest.fixture(autouse=True)
def _credentials(monkeypatch):
    monkeypatch.setenv(OPTIONS_ENV, json.dumps(CREDS))


def _config(workdir: Path, path: Path | str, masks: str | Path, control: str | Path | None, options=None):
    dataset = {"path": str(path), "masks": str(masks), "control": control and str(control)}
    dataset |= {"storage_options": options} if options else {}
    raw = {"workdir": str(workdir), "dataset": dataset, "buckets": {"resolution": 32}, "model": {"device": "cpu"}}
    return parse_config(raw, "<test>")


def _build(cfg) -> tuple[dict, dict, Path, dict, dict]:
    """(scan records by path, rejections by path, the latents artifact, its index rows by image name, where each
    source's controls are read)."""
    ctx = StageContext(cfg)
    scan, _ = run_stage(ctx, stage("scan"), PIPELINE)
    latents, _ = run_stage(ctx, stage("latents"), PIPELINE)
    rows = {Path(r["path"]).stem: r for r in read_jsonl(latents / "index.jsonl")}
    records = {r["path"]: r for r in read_jsonl(scan / "images.jsonl")}
    roots = ScanManifest.model_validate_json((scan / "manifest.json").read_text()).control_sources()
    return records, {r["path"]: r for r in read_jsonl(scan / "rejected.jsonl")}, latents, rows, roots


def _upload(shards: Path, endpoint: str) -> str:
    Remote(f"s3://{BUCKET}/members", {"endpoint_url": endpoint}).fs.put_file(
        str(shards / "000000.tar"), f"{BUCKET}/members/000000.tar"
    )
    return f"s3://{BUCKET}/members"


def test_mask_and_control_members_cache_what_mask_and_control_folders_do(tmp_path, s3):  # noqa: F811
    samples = member_samples()
    shards = write_member_shard(tmp_path / "shards", samples)
    cfg = _config(tmp_path / "w1", _upload(shards, s3), "members", "members", {"endpoint_url": s3})
    records, rejected, latents, rows, roots = _build(cfg)
    a, b = records["000000.tar/a.png"], records["000000.tar/b.png"]
    assert (a["mask_kind"], a["mask_path"], a["control_path"]) == (
        "member",
        "000000.tar/a.mask.png",
        "000000.tar/a.control.png",
    )
    assert b["mask_kind"] is None and (b["control_width"], b["control_height"]) == (64, 64)
    with open(shards / "000000.tar", "rb") as f:  # the recorded ranges are the members' bytes
        f.seek(a["mask_offset"])
        assert f.read(a["mask_size_bytes"]) == samples["a"]["mask.png"]
        f.seek(a["control_offset"])
        assert f.read(a["control_size_bytes"]) == samples["a"]["control.png"]
    # The text and validate stages read a record's control member as the latents stage does (by its range).
    control = load_rgb(io.BytesIO(samples["a"]["control.png"]))
    assert text_control(control_file(roots, a), a["control_sha256"]).tobytes() == control.tobytes()
    shown = control.resize((64, 64), Image.Resampling.BICUBIC)
    assert validate_control(control_file(roots, a), (64, 64)).tobytes() == shown.tobytes()
    assert list(rejected) == ["000000.tar/c.png"] and "c.control.<ext>" in rejected["000000.tar/c.png"]["reason"]

    data, masks, ctl = _as_folders(tmp_path / "folders", samples)
    _, folder_rejected, folder_latents, folder_rows, _ = _build(_config(tmp_path / "w2", data, masks, ctl))
    assert list(folder_rejected) == ["c.png"]  # the same rule: an image without its control
    manifest = json.loads((latents / "manifest.json").read_text())
    assert (manifest["masked"], manifest["controls"]) == (1, 2)
    for key in ("a", "b"):
        mine, theirs = rows[key], folder_rows[key]
        got = np.load(mask_file(latents, mine["bucket"]))[mine["row"]]
        want = np.load(mask_file(folder_latents, theirs["bucket"]))[theirs["row"]]
        assert np.array_equal(got, want), key
        got = np.load(controls.control_file(latents, mine["bucket"]))[mine["row"]]
        want = np.load(controls.control_file(folder_latents, theirs["bucket"]))[theirs["row"]]
        assert np.array_equal(got, want), key
    half = got.shape[-1] // 2
    plane = np.load(mask_file(latents, rows["a"]["bucket"]))[rows["a"]["row"]]
    assert (plane[:, :half] == 0).all() and (plane[:, half:] == 1).all()

    # docs/artifacts.md's row: an edited mask member is new scan content (a new version, the mask's new hash).
    samples["a"]["mask.png"] = _png(Image.new("L", (64, 64), 255))
    (shards / "000000.tar").unlink()
    write_member_shard(shards, samples)
    _upload(shards, s3)
    edited, _ = run_stage(StageContext(cfg), stage("scan"), PIPELINE)
    again = {r["path"]: r for r in read_jsonl(edited / "images.jsonl")}
    assert edited.name != manifest["upstream"]["scan"]
    assert again["000000.tar/a.png"]["mask_sha256"] != a["mask_sha256"]


def test_members_are_refused_for_a_folder_naming_the_field(tmp_path):
    data, _, _ = _as_folders(tmp_path, member_samples())
    with pytest.raises(StageFailed, match=r"dataset.masks is `members` .* is a folder source: point dataset.masks"):
        run_stage(StageContext(_config(tmp_path / "w", data, "members", None)), stage("scan"), PIPELINE)
