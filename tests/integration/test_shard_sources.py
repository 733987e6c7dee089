"""WebDataset shards and parquet tables as dataset sources: written by the libraries' own writers (webdataset's
TarWriter, pyarrow as Hugging Face `datasets` lays it out), scanned by their headers, rescanned incrementally, and
read back by byte range exactly as the same images in a folder are."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds
from PIL import Image

from tests.integration.test_scan_stage import config, noise, scan
from tuneline.schemas.config import parse_config
from tuneline.schemas.demo import DEMO_CONFIG
from tuneline.schemas.scan import ImageRecord, ScanManifest
from tuneline.stages.common.hashing import canonical_json, digest
from tuneline.stages.common.jsonl import read_jsonl
from tuneline.stages.common.stage import StageContext, StageFailed, content_version, run_stage, status as stage_status
from tuneline.stages.latents.encode import prepare, to_pixels
from tuneline.stages.latents.masks import mask_file
from tuneline.stages.pipeline import PIPELINE, stage
from tuneline.stages.scan import STAGE
from tuneline.stages.scan.controls import consumed
from tuneline.stages.scan.core import content
from tuneline.stages.scan.images import load_rgb


def png(size=(48, 32), seed=0) -> bytes:
    buf = io.BytesIO()
    noise(size, seed=seed).save(buf, format="PNG")
    return buf.getvalue()


def write_shard(path: Path, first: int, n: int, *, json_captions: bool = False) -> dict[str, bytes]:
    """A shard of n samples (keys first..first+n-1), captioned by .txt or a .json field; the image bytes by key."""
    out = {}
    with wds.TarWriter(str(path)) as sink:
        for k in range(first, first + n):
            key = f"s{k:04d}"
            sample = {"__key__": key, "png": png(seed=k)}
            sample |= {"json": {"caption": f"json {k}"}} if json_captions else {"txt": f"a photo {k}"}
            sink.write(sample)
            out[key] = sample["png"]
    return out


def write_parquet(path: Path, n: int, *, row_group: int = 2) -> list[bytes]:
    """The layout `datasets` writes for an Image feature: a struct {bytes, path}, plus a caption column."""
    images = [png(size=(40, 40), seed=100 + i) for i in range(n)]
    struct = pa.array(
        [{"bytes": b, "path": f"img{i}.png"} for i, b in enumerate(images)],
        type=pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
    )
    table = pa.table({"image": struct, "caption": [f"row {i}" for i in range(n)]})
    pq.write_table(table, path, row_group_size=row_group)
    return images


def test_webdataset_shards_scan_by_header_and_rescan_only_the_new_shard(tmp_path):
    data = tmp_path / "shards"
    data.mkdir()
    write_shard(data / "000000.tar", 0, 3)
    write_shard(data / "000001.tar", 3, 3, json_captions=True)
    cfg = config(tmp_path, data)
    _, _, records, rejected, manifest = scan(cfg)
    assert not rejected and len(records) == 6
    rec = records["000000.tar/s0001.png"]
    assert rec["shard"] == "000000.tar" and rec["caption"] == "a photo 1" and (rec["width"], rec["height"]) == (48, 32)
    assert records["000001.tar/s0004.png"]["caption"] == "json 4"
    assert records["000001.tar/s0004.png"]["caption_source"] == "metadata"
    assert sorted(manifest["shards_read"]) == ["000000.tar", "000001.tar"]
    # The record's byte range is the member's bytes: read straight from the shard.
    with open(data / "000000.tar", "rb") as f:
        f.seek(rec["offset"])
        assert f.read(rec["size_bytes"]) == png(seed=1)

    write_shard(data / "000002.tar", 6, 2)  # the weekly shard lands
    _, _, records2, _, manifest2 = scan(cfg)
    assert manifest2["shards_read"] == ["000002.tar"] and manifest2["reopened"] == 2
    assert len(records2) == 8 and records2["000000.tar/s0001.png"] == rec


def test_a_truncated_shard_is_named_with_the_member_where_it_breaks(tmp_path):
    data = tmp_path / "shards"
    data.mkdir()
    write_shard(data / "000000.tar", 0, 3)
    raw = (data / "000000.tar").read_bytes()
    (data / "000000.tar").write_bytes(raw[: len(raw) // 2])
    (data / "000001.tar").write_bytes(b"")
    write_shard(data / "000002.tar", 3, 2)
    _, _, records, rejected, _ = scan(config(tmp_path, data))
    assert "000002.tar/s0003.png" in records
    reason = rejected["000000.tar"]["reason"]
    assert "breaks after member s0001" in reason and "re-copy the shard" in reason, reason


def test_parquet_table_as_datasets_writes_it(tmp_path):
    table = tmp_path / "train.parquet"
    images = write_parquet(table, 5)
    cfg = config(tmp_path, table)
    path, _, records, rejected, manifest = scan(cfg)
    assert not rejected and len(records) == 5
    rec = records["2/0"]  # row group 2, row 0: the fifth row
    assert (rec["row_group"], rec["row"], rec["caption"], rec["shard"]) == (2, 0, "row 4", "")
    # The latents stage's reader gets exactly the bytes the scan hashed, and decodes the same image.
    roots = ScanManifest.model_validate(manifest).roots()
    pixels = prepare(roots[None], ImageRecord(**rec))
    expected = to_pixels(load_rgb(io.BytesIO(images[4]), ImageRecord(**rec)), ImageRecord(**rec))
    assert not isinstance(pixels, str) and np.array_equal(pixels.numpy(), expected.numpy())


def test_a_parquet_table_without_the_image_column_names_the_column_and_the_fix(tmp_path):
    table = tmp_path / "t.parquet"
    pq.write_table(pa.table({"picture": [png()], "caption": ["x"]}), table)
    with pytest.raises(StageFailed) as err:
        scan(config(tmp_path, table))
    assert "t.parquet" in str(err.value)
    _, _, records, _, _ = scan(config(tmp_path, table, dataset={"image_column": "picture"}))
    assert len(records) == 1


def test_mixed_folder_asks_for_a_format(tmp_path):
    data = tmp_path / "mixed"
    data.mkdir()
    write_shard(data / "000000.tar", 0, 1)
    noise((32, 32)).save(data / "loose.png")
    with pytest.raises(StageFailed, match=r"several kinds of data .* set its `format`"):
        scan(config(tmp_path, data))
    _, _, records, _, _ = scan(config(tmp_path, data, dataset={"format": "folder"}))
    assert list(records) == ["loose.png"]
    assert json.dumps(records)  # records stay plain JSON


def test_an_incremental_scan_publishes_what_a_cold_scan_of_the_same_shards_does(tmp_path):
    """Unchanged shards' finished records are reused whole (stages/scan/shardparts.py): the rescan after a shard
    landed publishes the cold scan's images.jsonl byte for byte and its version, at two resolutions, with a
    rejected member and identical content across shards."""
    data = tmp_path / "shards"
    data.mkdir()
    write_shard(data / "000000.tar", 0, 3)
    with wds.TarWriter(str(data / "000001.tar")) as sink:
        sink.write({"__key__": "big", "png": png(size=(64, 40), seed=7), "txt": "wide"})
        sink.write({"__key__": "same", "png": png(seed=1), "txt": "a copy of s0001"})
        sink.write({"__key__": "bad", "png": b"not an image", "txt": "broken"})
    sections = {"buckets": {"resolutions": [32, 48]}}
    incremental = config(tmp_path / "incremental", data, **sections)
    scan(incremental)
    write_shard(data / "000002.tar", 3, 2, json_captions=True)  # the weekly shard lands
    version, _, records, rejected, manifest = scan(incremental)
    assert manifest["shards_read"] == ["000002.tar"] and manifest["reopened"] == 2
    cold, _, _, rejected_cold, manifest_cold = scan(config(tmp_path / "cold", data, **sections))
    assert sorted(manifest_cold["shards_read"]) == ["000000.tar", "000001.tar", "000002.tar"]
    assert (version / "images.jsonl").read_bytes() == (cold / "images.jsonl").read_bytes()
    assert len(list(version.parent.glob(".parts-*/*.json"))) == 3  # published from the shards' kept parts
    assert version.name == cold.name
    assert rejected == rejected_cold and list(rejected) == ["000001.tar/bad.png"]
    assert manifest["duplicates"] == [["000000.tar/s0001.png", "000001.tar/same.png"]]
    # The version is the published records' own: per shard, the digest of what later stages consume of them.
    lines = (version / "images.jsonl").read_text().splitlines()
    assert len(lines) == 2 * len(records) == 14
    by_shard: dict[str, list[str]] = {}
    for r in map(ImageRecord.model_validate_json, lines):
        by_shard.setdefault(r.shard, []).append(canonical_json(consumed(r)))
    parts = [hashlib.sha256(",".join(c).encode()).hexdigest() for _, c in sorted(by_shard.items())]
    assert version.name == content_version(STAGE, manifest["code_version"], digest({"parts": parts}))


def test_a_status_check_reads_a_new_shard_once_and_the_next_scan_not_again(tmp_path):
    """`tuneline status` asks the scan what it would publish (a dry scan, stages/scan/core.py content()): the new
    shard's index and records are kept from the first check, so later checks and the build read it no more."""
    data = tmp_path / "shards"
    data.mkdir()
    write_shard(data / "000000.tar", 0, 2)
    cfg = config(tmp_path, data)
    assert content(StageContext(cfg)) is None  # before any scan: no version to reuse, nothing read
    assert not (cfg.workdir_path() / "artifacts").exists()
    scan(cfg)
    write_shard(data / "000001.tar", 2, 2)
    predicted = content(StageContext(cfg))
    kept = {p: p.stat().st_mtime_ns for p in (cfg.workdir_path() / "artifacts" / "scan").glob(".*/*.json")}
    assert len(kept) == 4  # both shards' index and part
    assert content(StageContext(cfg)) == predicted
    assert {p: p.stat().st_mtime_ns for p in kept} == kept  # the second check rewrote nothing
    version, _, records, _, manifest = scan(cfg)
    assert manifest["shards_read"] == [] and len(records) == 4
    assert version.name == content_version(STAGE, manifest["code_version"], predicted)


def test_rebuild_rows_a_shard_reuploaded_added_replaced_and_removed(tmp_path):
    """docs/artifacts.md's rows for shards: the scan's version (what later stages are built from) moves only with
    the records, and only new or changed shards are read."""
    data = tmp_path / "shards"
    data.mkdir()
    write_shard(data / "000000.tar", 0, 2)
    write_shard(data / "000001.tar", 2, 2)
    cfg = config(tmp_path, data)
    first, _, _, _, _ = scan(cfg)

    raw = (data / "000001.tar").read_bytes()
    (data / "000001.tar").unlink()
    (data / "000001.tar").write_bytes(raw)  # re-uploaded: same bytes, a new mtime
    same, _, _, _, manifest = scan(cfg)
    assert same.name == first.name and manifest["shards_read"] == ["000001.tar"]

    write_shard(data / "000002.tar", 4, 1)
    added, _, records, _, manifest = scan(cfg)
    assert added.name != first.name and manifest["shards_read"] == ["000002.tar"] and len(records) == 5

    write_shard(data / "000001.tar", 20, 2)  # replaced: other samples under the same name
    replaced, _, records, _, manifest = scan(cfg)
    assert replaced.name != added.name and manifest["shards_read"] == ["000001.tar"]
    assert "000001.tar/s0020.png" in records and "000001.tar/s0002.png" not in records

    (data / "000002.tar").unlink()
    removed, _, records, _, manifest = scan(cfg)
    assert removed.name != replaced.name and manifest["shards_read"] == [] and len(records) == 4


def test_status_names_the_shards_added_replaced_and_removed(tmp_path):
    """`tuneline status` (stage_status with reuse, as the command asks it) says which shards changed since the
    published scan, by name; a shard re-uploaded with the same bytes changes nothing it reports."""
    data = tmp_path / "shards"
    data.mkdir()
    for i in range(3):
        write_shard(data / f"00000{i}.tar", 2 * i, 2)
    cfg = config(tmp_path, data)
    scan(cfg)
    raw = (data / "000000.tar").read_bytes()
    (data / "000000.tar").unlink()
    (data / "000000.tar").write_bytes(raw)  # re-uploaded: same bytes, a new mtime
    assert stage_status(StageContext(cfg), [STAGE], reuse=True)[0].state == "fresh"

    write_shard(data / "000003.tar", 6, 1)
    row = stage_status(StageContext(cfg), [STAGE], reuse=True)[0]
    assert (row.state, row.reason) == ("stale", f"shards added in {data}: 000003.tar")
    write_shard(data / "000001.tar", 20, 2)  # other samples under the same name
    (data / "000002.tar").unlink()
    row = stage_status(StageContext(cfg), [STAGE], reuse=True)[0]
    assert row.reason == "; ".join(
        f"shards {kind} in {data}: {name}"
        for kind, name in (("added", "000003.tar"), ("replaced", "000001.tar"), ("removed", "000002.tar"))
    )


def test_sources_of_three_formats_in_one_dataset(tmp_path):
    """dataset.sources mixing a folder, a shard folder and a parquet table, each with its format set or detected;
    records name their source and read back through the scan manifest's roots."""
    folder, shards, table = tmp_path / "photos", tmp_path / "shards", tmp_path / "rows.parquet"
    folder.mkdir()
    shards.mkdir()
    noise((40, 40), seed=9).save(folder / "cat.png")
    write_shard(shards / "000000.tar", 0, 2)
    write_parquet(table, 3)
    sources = [{"path": str(folder)}, {"path": str(shards), "format": "webdataset"}, {"path": str(table)}]
    cfg = config(tmp_path, tmp_path, dataset={"path": None, "sources": sources})
    _, _, records, rejected, manifest = scan(cfg)
    assert not rejected
    by_source = {i: sorted(p for p, r in records.items() if r["source"] == i) for i in range(3)}
    assert by_source == {0: ["cat.png"], 1: ["000000.tar/s0000.png", "000000.tar/s0001.png"], 2: ["0/0", "0/1", "1/0"]}
    roots = ScanManifest.model_validate(manifest).roots()
    for path, rec in records.items():
        assert not isinstance(prepare(roots[rec["source"]], ImageRecord(**rec)), str), path


def test_masks_and_controls_with_a_shard_source_are_refused_naming_both_fields(tmp_path):
    data = tmp_path / "shards"
    data.mkdir()
    write_shard(data / "000000.tar", 0, 1)
    masks = tmp_path / "masks"
    masks.mkdir()
    with pytest.raises(StageFailed, match=r"webdataset source, and dataset.masks apply only to folders .* set dataset"):
        scan(config(tmp_path, data, dataset={"masks": str(masks)}))


def test_alpha_masks_of_shard_members_are_cached_from_their_byte_ranges(tmp_path):
    """dataset.masks alpha with a webdataset source: a member's own alpha channel is its loss mask, read back by
    byte range at caching time; a member without alpha weighs fully."""
    alpha = np.zeros((64, 64), np.uint8)
    alpha[:, 32:] = 255  # the right half is kept
    rgba = np.dstack([np.asarray(noise((64, 64), seed=3)), alpha])
    buf = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(buf, format="PNG")
    data = tmp_path / "shards"
    data.mkdir()
    with wds.TarWriter(str(data / "000000.tar")) as sink:
        sink.write({"__key__": "cut", "png": buf.getvalue(), "txt": "a cut-out"})
        sink.write({"__key__": "full", "png": png(size=(64, 64), seed=4), "txt": "a photo"})
    raw = json.loads(json.dumps(DEMO_CONFIG))
    raw |= {"workdir": str(tmp_path / "work"), "dataset": {"path": str(data), "demo": False, "masks": "alpha"}}
    cfg = parse_config(raw, "<test>")
    ctx = StageContext(cfg)
    scan_dir, _ = run_stage(ctx, stage("scan"), PIPELINE)
    kinds = {r["path"]: r["mask_kind"] for r in read_jsonl(scan_dir / "images.jsonl")}
    assert kinds == {"000000.tar/cut.png": "alpha", "000000.tar/full.png": None}
    lat, _ = run_stage(ctx, stage("latents"), PIPELINE)
    manifest = json.loads((lat / "manifest.json").read_text())
    assert manifest["masked"] == 1
    rows = {r["path"]: r for r in read_jsonl(lat / "index.jsonl")}
    planes = np.load(mask_file(lat, rows["000000.tar/cut.png"]["bucket"]))
    cut, full = planes[rows["000000.tar/cut.png"]["row"]], planes[rows["000000.tar/full.png"]["row"]]
    half = cut.shape[1] // 2
    assert (cut[:, :half] == 0).all() and (cut[:, half:] == 1).all() and (full == 1).all()
