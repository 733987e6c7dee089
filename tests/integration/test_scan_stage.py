"""The scan stage end to end through the generic runner (no Prefect): a messy folder, incremental rescans,
content addressing, small buckets, symlinks, the demo dataset."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tuneline.schemas.config import ConfigError, parse_config
from tuneline.schemas.scan import ImageRecord
from tuneline.stages.common.jsonl import read_jsonl
from tuneline.stages.common.report import Reporter
from tuneline.stages.common.stage import StageContext, StageFailed, run_stage, status
from tuneline.stages.scan import STAGE, demo as demo_mod, images as images_mod


class Recorder(Reporter):
    def __init__(self):
        self.tables: dict[str, list[dict]] = {}
        self.progress_calls = 0
        self.markdowns: dict[str, str] = {}

    def markdown(self, key, text, description=""):
        self.markdowns[key] = text

    def table(self, key, rows, description=""):
        self.tables[key] = rows

    def progress(self, key, fraction, description=""):
        self.progress_calls += 1


def config(tmp_path: Path, data: Path, **sections):
    raw = {"workdir": str(tmp_path / "work"), "dataset": {"path": str(data)}, "buckets": {"resolution": 32}}
    for k, v in sections.items():
        raw[k] = {**raw.get(k, {}), **v}
    return parse_config(raw, "<test>")


def scan(cfg, reporter=None):
    ctx = StageContext(cfg, reporter=reporter or Recorder())
    path, built = run_stage(ctx, STAGE, [STAGE])
    records = {r["path"]: r for r in read_jsonl(path / "images.jsonl")}
    rejected = {r["path"]: r for r in read_jsonl(path / "rejected.jsonl")}
    manifest = json.loads((path / "manifest.json").read_text())
    return path, built, records, rejected, manifest


def noise(size, mode="RGB", seed=0) -> Image.Image:
    arr = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(arr).convert(mode)


def messy_folder(root: Path, outside: Path) -> dict[str, str]:
    """A real-photo-like folder: mixed formats/modes, captions, and one file per broken kind.

    Returns path -> expected rejection kind.
    """
    root.mkdir(parents=True)
    (root / "sub").mkdir()
    exif = Image.Exif()
    exif[0x0112] = 6
    noise((60, 40)).save(root / "rotated.jpg", exif=exif)
    noise((48, 48), "RGBA", 1).save(root / "alpha.png")
    noise((40, 40), "L", 2).save(root / "gray.PNG")
    noise((40, 56), "CMYK", 3).save(root / "sub" / "cmyk.jpeg")
    noise((40, 40), seed=4).save(root / "sub" / "pic.webp")
    noise((40, 40), seed=5).save(root / "pic.bmp")
    noise((40, 40), seed=6).save(root / "pic.tif")
    noise((40, 40), seed=7).convert("P").save(root / "pic.gif")
    noise((40, 40), seed=8).save(root / "dup_a.png")
    (root / "sub" / "dup_b.png").write_bytes((root / "dup_a.png").read_bytes())
    noise((10, 12), seed=9).save(root / "tiny.png")
    (root / "rotated.txt").write_text("a rotated photo", encoding="utf-8")
    (root / "pic.txt").write_bytes("caf\u00e9".encode("latin-1"))  # shared by pic.bmp/.tif/.gif: all rejected
    (root / "metadata.jsonl").write_text('{"file_name": "alpha.png", "text": "a see-through square"}\n{oops\n')
    # broken inputs
    (root / "empty.jpg").write_bytes(b"")
    (root / "notes.jpg").write_text("not an image at all")
    full = (root / "dup_a.png").read_bytes()
    (root / "cut.png").write_bytes(full[: len(full) // 2])
    (root / "photo.heic").write_bytes(b"\x00" * 100)
    (root / ".hidden.png").write_bytes(b"ignored")
    outside.mkdir(parents=True, exist_ok=True)
    noise((40, 40), seed=10).save(outside / "secret.png")
    os.symlink(outside / "secret.png", root / "escape.png")
    os.symlink(root / "nowhere.png", root / "broken.png")
    os.symlink(root / "sub" / "pic.webp", root / "inside_link.webp")  # inside the root: allowed
    os.mkfifo(root / "pipe.png")  # opening it would block forever
    with open(os.fsencode(root) + b"/bad\xffname.png", "wb") as f:  # a name that is not UTF-8
        f.write((root / "dup_a.png").read_bytes())
    return {
        "pipe.png": "special",
        "bad\ufffdname.png": "name",
        "empty.jpg": "empty-file",
        "notes.jpg": "not-image",
        "cut.png": "truncated",
        "photo.heic": "unsupported",
        "escape.png": "symlink",
        "broken.png": "symlink",
        "tiny.png": "too-small",
        "pic.bmp": "caption",
        "pic.tif": "caption",
        "pic.gif": "caption",
        "metadata.jsonl": "metadata",
    }


def test_messy_folder_scans_cleanly_naming_every_broken_file(tmp_path):
    data = tmp_path / "data"
    expected = messy_folder(data, tmp_path / "elsewhere")
    rec = Recorder()
    path, built, records, rejected, manifest = scan(config(tmp_path, data, buckets={"min_edge": 16}), rec)
    assert built
    assert {p: r["kind"] for p, r in rejected.items()} == expected
    assert all(r["reason"] for r in rejected.values())
    assert "escape.png" in rec.markdowns["scan-rejected"]
    assert "outside dataset.path" in rejected["escape.png"]["reason"]
    assert set(records) == {
        "rotated.jpg",
        "alpha.png",
        "gray.PNG",
        "sub/cmyk.jpeg",
        "sub/pic.webp",
        "dup_a.png",
        "sub/dup_b.png",
        "inside_link.webp",
    }
    rot = records["rotated.jpg"]
    assert (rot["width"], rot["height"], rot["orientation"]) == (40, 60, 6)  # size after EXIF rotation
    assert (rot["bucket_width"], rot["bucket_height"]) == (32, 48) and rot["caption"] == "a rotated photo"
    assert records["alpha.png"]["background"] == [255, 255, 255]
    assert records["alpha.png"]["caption_source"] == "metadata"
    assert records["sub/cmyk.jpeg"]["conversion"].startswith("CMYK") and records["gray.PNG"]["conversion"] == "L->RGB"
    assert manifest["accepted"] == 8 and manifest["rejected"] == len(expected)
    assert manifest["duplicates"] == [["dup_a.png", "sub/dup_b.png"], ["inside_link.webp", "sub/pic.webp"]]
    assert manifest["rejected_by_kind"]["caption"] == 3
    assert manifest["alignment"] == 8 and manifest["dataset_root"] == str(data)
    assert sum(b["count"] for b in manifest["buckets"]) == 8
    assert {r["bucket"] for r in rec.tables["scan-buckets"]} == {
        f"{b['width']}x{b['height']}" for b in manifest["buckets"]
    }
    assert rec.progress_calls >= 1
    assert status(StageContext(config(tmp_path, data, buckets={"min_edge": 16})), [STAGE])[0].state == "fresh"


def test_loaded_images_match_the_records(tmp_path):
    data = tmp_path / "data"
    messy_folder(data, tmp_path / "elsewhere")
    path, _, records, _, _ = scan(config(tmp_path, data))
    for r in records.values():
        img = images_mod.load_rgb(data / r["path"], ImageRecord.model_validate(r))
        assert img.mode == "RGB" and img.size == (r["width"], r["height"])


def make_plain(root: Path, n: int, size=(40, 40)) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        noise(size, seed=100 + i).save(root / f"img{i}.png")
        (root / f"img{i}.txt").write_text(f"image {i}", encoding="utf-8")


@pytest.fixture
def count_probes(monkeypatch):
    calls: list[str] = []
    real = images_mod.probe_file

    def counting(path, rel, size, mtime):
        calls.append(rel)
        return real(path, rel, size, mtime)

    monkeypatch.setattr(images_mod, "probe_file", counting)
    return calls


def test_incremental_rescan_reopens_only_changed_files(tmp_path, count_probes):
    data = tmp_path / "data"
    make_plain(data, 6)
    first, _, recs1, _, m1 = scan(config(tmp_path, data))
    assert len(count_probes) == 6 and m1["reopened"] == 6
    count_probes.clear()
    # A config change rebuilds the records, but no image is reopened.
    _, built, recs2, _, m2 = scan(config(tmp_path, data, buckets={"crop": "random", "resolution": 24}))
    assert built and count_probes == [] and m2["reopened"] == 0
    assert recs2["img0.png"]["bucket_width"] == 24
    # Touching a file: it is re-read (mtime changed), its hash is the same, so the version is unchanged.
    st = (data / "img1.png").stat()
    os.utime(data / "img1.png", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    again, built, recs3, _, _ = scan(config(tmp_path, data))
    assert count_probes == ["img1.png"] and again == first
    # Changing the content: re-read, new hash, new version.
    count_probes.clear()
    noise((40, 40), seed=999).save(data / "img2.png")
    changed, built, recs4, _, _ = scan(config(tmp_path, data))
    assert count_probes == ["img2.png"] and built and changed != first
    assert recs4["img2.png"]["sha256"] != recs1["img2.png"]["sha256"]
    assert recs4["img0.png"]["sha256"] == recs1["img0.png"]["sha256"]


def test_fingerprint_stable_under_touch_and_caption_edits_count(tmp_path):
    data = tmp_path / "data"
    make_plain(data, 3)
    cfg = config(tmp_path, data)
    first, _, _, _, _ = scan(cfg)
    for p in data.iterdir():  # touch everything, images and captions
        st = p.stat()
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 5 * 10**9))
    ctx = StageContext(cfg)
    assert status(ctx, [STAGE])[0].state == "stale"  # the listing changed: the scan must look again ...
    again, built, _, _, _ = scan(cfg)
    assert again == first  # ... and finds the same content: the version downstream stages see is unchanged
    assert status(ctx, [STAGE])[0].state == "fresh"
    (data / "img0.txt").write_text("a new caption", encoding="utf-8")
    edited, _, recs, _, _ = scan(cfg)
    assert edited != first and recs["img0.png"]["caption"] == "a new caption"


def test_random_crop_recorded_and_reproduced(tmp_path):
    data = tmp_path / "data"
    make_plain(data, 4, size=(80, 40))
    cfg = config(tmp_path, data, buckets={"crop": "random", "seed": 7, "max_aspect": 1.0})
    _, _, recs, _, _ = scan(cfg)
    crops = {tuple(r["crop"]) for r in recs.values()}
    assert all(c[3] - c[1] == 40 and c[2] - c[0] == 40 for c in crops) and len(crops) > 1
    _, _, recs_again, _, _ = scan(
        config(tmp_path, data, buckets={"crop": "random", "seed": 7, "max_aspect": 1.0, "min_edge": 1})
    )
    assert {p: r["crop"] for p, r in recs_again.items()} == {p: r["crop"] for p, r in recs.items()}


def test_small_bucket_policies(tmp_path):
    data = tmp_path / "data"
    make_plain(data, 5)
    make_plain(data / "wide", 1, size=(80, 40))
    train = {"batch_size": 2, "processes": 2}
    _, _, recs, rejected, m = scan(config(tmp_path, data, train=train, buckets={"small_bucket": "drop"}))
    assert len(recs) == 5 and rejected["wide/img0.png"]["kind"] == "small-bucket"
    assert [b["dropped"] for b in m["buckets"]] == [False, True] and m["config"]["global_batch"] == 4
    _, _, recs, rejected, _ = scan(config(tmp_path, data, train=train))  # repeat (default) keeps it
    assert len(recs) == 6 and not rejected
    with pytest.raises(StageFailed, match=r"largest, 32x32, has 5 images.*small_bucket: repeat"):
        scan(config(tmp_path, data, train={"batch_size": 8, "processes": 2}, buckets={"small_bucket": "drop"}))


def test_pixel_limit_and_moved_dataset(tmp_path):
    data = tmp_path / "data"
    make_plain(data, 2)
    noise((60, 60)).save(data / "big.png")
    _, _, recs, rejected, _ = scan(config(tmp_path, data, dataset={"max_image_pixels": 2000}))
    assert set(recs) == {"img0.png", "img1.png"} and rejected["big.png"]["kind"] == "bomb"
    assert "3600 pixels exceeds dataset.max_image_pixels (2000)" in rejected["big.png"]["reason"]
    first, _, _, _, m1 = scan(config(tmp_path, data))
    data.rename(tmp_path / "moved")
    moved, _, _, _, m2 = scan(config(tmp_path, tmp_path / "moved"))
    # The same records: the same version, republished so its manifest names where the images now are.
    assert moved == first and m2["dataset_root"] == str(tmp_path / "moved")
    assert json.loads((moved / "manifest.json").read_text())["dataset_root"] == str(tmp_path / "moved")


def test_nothing_usable_is_an_error_naming_the_reasons(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jpg").write_bytes(b"")
    with pytest.raises(StageFailed, match=r"no image was accepted.*empty-file 1.*a\.jpg: zero-byte"):
        scan(config(tmp_path, data))
    with pytest.raises(StageFailed, match=r"dataset.path .*missing.* is not a folder"):
        scan(config(tmp_path, tmp_path / "missing"))


def test_demo_dataset_is_idempotent_atomic_and_scans(tmp_path, monkeypatch):
    root = tmp_path / "work" / "demo-data"
    calls = []
    real = demo_mod._draw

    def failing(*a):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt  # a kill mid-way
        return real(*a)

    monkeypatch.setattr(demo_mod, "_draw", failing)
    with pytest.raises(KeyboardInterrupt):
        demo_mod.write_demo_dataset(root)
    assert not root.exists() and list(root.parent.iterdir()) == []  # no half dataset, no temp left
    monkeypatch.setattr(demo_mod, "_draw", real)
    demo_mod.write_demo_dataset(root)
    before = {p.name: p.stat().st_mtime_ns for p in root.iterdir()}
    demo_mod.write_demo_dataset(root)  # complete: untouched
    assert {p.name: p.stat().st_mtime_ns for p in root.iterdir()} == before
    _, _, recs, rejected, m = scan(config(tmp_path, root, buckets={"resolution": 64}))
    assert len(recs) == 72 and not rejected
    assert {(b["width"], b["height"]): b["count"] for b in m["buckets"]} == {(64, 64): 24, (64, 96): 24, (96, 64): 24}
    colors = {r["caption"].split()[1] for r in recs.values()}
    assert colors == {"red", "green", "blue", "yellow"}
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "mine.png").write_bytes(b"x")
    with pytest.raises(ConfigError, match="dataset.demo"):
        demo_mod.write_demo_dataset(tmp_path / "foreign")
