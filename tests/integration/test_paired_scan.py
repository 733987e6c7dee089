"""Paired (editing) datasets in the scan: each image's control recorded with its hash and size, an image without
its control rejected with a reason, unmatched controls reported, an edited control a new scan version."""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from tuneline.schemas.config import parse_config
from tuneline.stages.common.jsonl import read_jsonl
from tuneline.stages.common.stage import StageContext, run_stage
from tuneline.stages.scan import STAGE


def _folder(tmp_path: Path) -> tuple[Path, Path]:
    data, controls = tmp_path / "data", tmp_path / "controls"
    data.mkdir()
    controls.mkdir()
    for i, name in enumerate(("cat", "dog", "owl")):
        Image.new("RGB", (64, 64), (40 * i, 90, 200)).save(data / f"{name}.png")
        (data / f"{name}.txt").write_text(f"make the {name} red")
    Image.new("RGB", (48, 32), (1, 2, 3)).save(controls / "cat.jpg")  # any extension, any size
    Image.new("RGB", (64, 64), (4, 5, 6)).save(controls / "dog.png")
    Image.new("RGB", (64, 64), (7, 8, 9)).save(controls / "stray.png")  # no image pairs with it
    return data, controls


def _scan(tmp_path: Path, data: Path, controls: Path | None):
    cfg = parse_config(
        {
            "workdir": str(tmp_path / "work"),
            "dataset": {"path": str(data), "control": None if controls is None else str(controls)},
            "buckets": {"resolution": 32},
        },
        "<test>",
    )
    path, built = run_stage(StageContext(cfg), STAGE, [STAGE])
    manifest = json.loads((path / "manifest.json").read_text())
    return (
        manifest,
        {r["path"]: r for r in read_jsonl(path / "images.jsonl")},
        list(read_jsonl(path / "rejected.jsonl")),
    )


def test_pairs_are_recorded_and_an_image_without_its_control_is_rejected(tmp_path):
    data, controls = _folder(tmp_path)
    manifest, records, rejected = _scan(tmp_path, data, controls)
    assert set(records) == {"cat.png", "dog.png"}
    cat = records["cat.png"]
    assert cat["control_path"] == "cat.jpg" and (cat["control_width"], cat["control_height"]) == (48, 32)
    assert len(cat["control_sha256"]) == 64 and cat["control_size_bytes"] == (controls / "cat.jpg").stat().st_size
    # The pair is bucketed by the image, whatever the control's size.
    assert (cat["bucket_width"], cat["bucket_height"]) == (32, 32)
    [owl] = rejected
    assert owl["path"] == "owl.png" and owl["kind"] == "control" and "owl" in owl["reason"]
    assert manifest["unmatched_controls"] == ["stray.png"]
    assert manifest["control_root"] == str(controls)

    # An edited control: a new scan version whose record holds the new content hash.
    Image.new("RGB", (48, 32), (200, 0, 0)).save(controls / "cat.jpg")
    manifest2, records2, _ = _scan(tmp_path, data, controls)
    assert manifest2["fingerprint"] != manifest["fingerprint"]
    assert records2["cat.png"]["control_sha256"] != cat["control_sha256"]
    assert records2["dog.png"] == records["dog.png"] | {"mtime_ns": records2["dog.png"]["mtime_ns"]}


def test_without_control_the_records_hold_no_pair(tmp_path):
    data, _ = _folder(tmp_path)
    manifest, records, rejected = _scan(tmp_path, data, None)
    assert len(records) == 3 and not rejected and manifest["unmatched_controls"] == []
    assert all(r["control_path"] is None for r in records.values())


def test_control_latents_are_cached_beside_the_targets_and_reused(tmp_path):
    """The latents stage (tiny family) caches each control at its image's bucket; an edited control is the one
    row encoded again."""
    import numpy as np

    from tuneline.schemas.latents import LatentsManifest
    from tuneline.stages.latents import controls as control_latents
    from tuneline.stages.latents.reader import LatentReader
    from tuneline.stages.pipeline import PIPELINE, stage

    data, controls = _folder(tmp_path)
    Image.new("RGB", (64, 64), (0, 200, 0)).save(controls / "owl.png")
    Image.open(data / "dog.png").save(controls / "dog.png")  # the dog's control is the image itself
    cfg = parse_config(
        {
            "workdir": str(tmp_path / "work"),
            "dataset": {"path": str(data), "control": str(controls)},
            "buckets": {"resolution": 32},
            "model": {"device": "cpu"},
        },
        "<test>",
    )

    def latents():
        ctx = StageContext(cfg)
        run_stage(ctx, stage("scan"), PIPELINE)
        path, _ = run_stage(ctx, stage("latents"), PIPELINE)
        return path, json.loads((path / "manifest.json").read_text())

    path, manifest = latents()
    assert (manifest["controls"], manifest["controls_encoded"], manifest["controls_reused"]) == (3, 3, 0)
    [bucket] = manifest["buckets"]
    ctrl = np.load(control_latents.control_file(path, bucket["array"]))
    assert ctrl.shape == (3, *bucket["shape"])
    rows = {r["path"]: r["row"] for r in read_jsonl(path / "index.jsonl")}
    reader = LatentReader(path, LatentsManifest.model_validate(manifest))
    batch = reader.batch(bucket["array"], np.arange(3))
    target = reader.gather(batch)[0].float().numpy()
    assert np.array_equal(control_latents.read(reader, batch).numpy(), ctrl.astype(np.float32))
    assert np.allclose(ctrl[rows["dog.png"]], target[rows["dog.png"]], atol=1e-2)
    assert not np.allclose(ctrl[rows["cat.png"]], target[rows["cat.png"]], atol=1e-2)

    Image.new("RGB", (48, 32), (200, 0, 0)).save(controls / "cat.jpg")
    path2, manifest2 = latents()
    assert (manifest2["controls_encoded"], manifest2["controls_reused"]) == (1, 2)
    ctrl2 = np.load(control_latents.control_file(path2, bucket["array"]))
    assert not np.allclose(ctrl2[rows["cat.png"]], ctrl[rows["cat.png"]])
    assert np.array_equal(ctrl2[rows["owl.png"]], ctrl[rows["owl.png"]])
