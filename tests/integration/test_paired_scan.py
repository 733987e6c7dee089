"""Paired (editing) datasets in the scan: each image's control recorded with its hash and size, an image without
its control rejected with a reason, unmatched controls reported, an edited control a new scan version."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from tuneline.schemas.config import parse_config
from tuneline.stages.common.jsonl import read_jsonl
from tuneline.stages.common.stage import StageContext, StageFailed, run_stage
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


def _scan_family(tmp_path: Path, dataset: dict, family: str):
    cfg = parse_config(
        {
            "workdir": str(tmp_path / "work"),
            "dataset": dataset,
            "buckets": {"resolution": 32, "alignment": 16},
            "model": {"family": family},
        },
        "<test>",
    )
    path, _ = run_stage(StageContext(cfg), STAGE, [STAGE])
    manifest = json.loads((path / "manifest.json").read_text())
    records = {
        r["path"] if r["source"] is None else f"{r['source']}//{r['path']}": r
        for r in read_jsonl(path / "images.jsonl")
    }
    return manifest, records, list(read_jsonl(path / "rejected.jsonl"))


def _references(controls: Path, stem: str, n: int) -> None:
    (controls / stem).mkdir()
    for j in reversed(range(n)):  # written out of name order: the order is by name
        Image.new("RGB", (64, 32 + 8 * j), (10 * j, 0, 0)).save(controls / stem / f"{j}.png")


def test_several_references_per_image_for_a_family_that_takes_them(tmp_path):
    """controls/<stem>/*.png: each reference recorded in name order with its hash and size; an empty folder
    rejects its image; control files no image pairs with are reported, those of a used folder are not."""
    from tuneline.stages.common.hashing import file_sha256

    data, controls = _folder(tmp_path)
    Image.new("RGB", (64, 64)).save(data / "emu.png")
    (controls / "cat.jpg").unlink()
    (controls / "dog.png").unlink()
    for stem in ("cat", "dog", "owl", "extra"):
        _references(controls, stem, 2)
    (controls / "emu").mkdir()
    manifest, records, rejected = _scan_family(tmp_path, {"path": str(data), "control": str(controls)}, "flux2")
    assert set(records) == {"cat.png", "dog.png", "owl.png"}
    dog = records["dog.png"]
    assert dog["control_path"] == "dog" and [f["path"] for f in dog["control_references"]] == ["dog/0.png", "dog/1.png"]
    refs = [controls / "dog" / f"{j}.png" for j in (0, 1)]
    assert [f["sha256"] for f in dog["control_references"]] == [file_sha256(p) for p in refs]
    assert [f["size_bytes"] for f in dog["control_references"]] == [p.stat().st_size for p in refs]
    assert [(f["width"], f["height"]) for f in dog["control_references"]] == [(64, 32), (64, 40)]
    [emu] = rejected
    assert emu["path"] == "emu.png" and "holds no image" in emu["reason"]
    assert manifest["unmatched_controls"] == ["extra/0.png", "extra/1.png", "stray.png"]

    # A reference edited: the record's content (and so the scan version) changes.
    Image.new("RGB", (64, 40), (0, 0, 250)).save(refs[1])
    _, records2, _ = _scan_family(tmp_path, {"path": str(data), "control": str(controls)}, "flux2")
    assert records2["dog.png"]["control_sha256"] != dog["control_sha256"]
    assert records2["dog.png"]["control_references"][0] == dog["control_references"][0]

    # Every image needs the same number of references (a batch stacks them).
    Image.new("RGB", (64, 64)).save(controls / "emu" / "0.png")
    with pytest.raises(StageFailed, match=r"different numbers of reference images \(cat.png: 2, emu.png: 1\)"):
        _scan_family(tmp_path, {"path": str(data), "control": str(controls)}, "flux2")


def test_a_family_taking_one_control_refuses_a_folder_of_several(tmp_path):
    """flux_kontext: a single file wins over a folder of the same stem (whose files are then unmatched); a folder
    of several is refused naming the image and the family."""
    data, controls = _folder(tmp_path)
    _references(controls, "cat", 2)  # beside cat.jpg
    manifest, records, _ = _scan_family(tmp_path, {"path": str(data), "control": str(controls)}, "flux_kontext")
    assert records["cat.png"]["control_path"] == "cat.jpg" and records["cat.png"]["control_references"] is None
    assert manifest["unmatched_controls"] == ["cat/0.png", "cat/1.png", "stray.png"]
    (controls / "dog.png").unlink()
    _references(controls, "dog", 2)
    with pytest.raises(StageFailed, match=r"dog.png has 2 reference images .* family 'flux_kontext' takes one"):
        _scan_family(tmp_path, {"path": str(data), "control": str(controls)}, "flux_kontext")


def _tiny_latents(tmp_path: Path, dataset: dict) -> StageContext:
    """The tiny family's latents of `dataset` at 32 px (the scan of `_scan_family` before it)."""
    cfg = parse_config(
        {
            "workdir": str(tmp_path / "work"),
            "dataset": dataset,
            "buckets": {"resolution": 32, "alignment": 16},
            "model": {"family": "tiny", "device": "cpu"},
        },
        "<test>",
    )
    return StageContext(cfg)


def test_latents_refuse_several_references_for_a_family_taking_one(tmp_path):
    """A scan made for flux2 (several references per image) reused by a family that takes one control: the latents
    stage refuses it, naming the family."""
    from tuneline.stages.pipeline import PIPELINE, stage

    data, controls = _folder(tmp_path)
    (controls / "cat.jpg").unlink()
    (controls / "dog.png").unlink()
    Image.new("RGB", (64, 64)).save(data / "owl.png")
    for stem in ("cat", "dog", "owl"):
        _references(controls, stem, 2)
    dataset = {"path": str(data), "control": str(controls)}
    _scan_family(tmp_path, dataset, "flux2")
    with pytest.raises(Exception, match=r"2 reference images, but family 'tiny' takes one"):
        run_stage(_tiny_latents(tmp_path, dataset), stage("latents"), PIPELINE)


def test_each_source_pairs_with_its_own_control_folder(tmp_path):
    """dataset.sources[i].control: each folder's images pair with their own controls (the same name in two
    sources, two controls), a source without one takes dataset.control; the latents cache each from its folder;
    an edited control of one source is new scan content."""
    import numpy as np

    from tuneline.schemas.scan import ScanManifest
    from tuneline.stages.common.hashing import file_sha256
    from tuneline.stages.latents import controls as control_latents
    from tuneline.stages.pipeline import PIPELINE, stage

    folders = {}
    for name, color in (("a", (200, 20, 20)), ("b", (20, 20, 200)), ("c", (20, 200, 20))):
        data, ctl = tmp_path / f"data-{name}", tmp_path / f"ctl-{name}"
        data.mkdir()
        ctl.mkdir()
        Image.new("RGB", (32, 32), color).save(data / "cat.png")
        (data / "cat.txt").write_text("make it red")
        folders[name] = (data, ctl)
    Image.open(folders["a"][0] / "cat.png").save(folders["a"][1] / "cat.png")  # a's control is its image
    Image.new("RGB", (32, 32), (0, 0, 0)).save(folders["b"][1] / "cat.png")
    Image.new("RGB", (32, 32), (9, 9, 9)).save(folders["c"][1] / "cat.png")
    dataset = {
        "path": None,
        "control": str(folders["c"][1]),
        "sources": [
            {"path": str(folders["a"][0]), "control": str(folders["a"][1])},
            {"path": str(folders["b"][0]), "control": str(folders["b"][1]), "role": "regularization"},
            {"path": str(folders["c"][0])},
        ],
    }
    manifest, records, rejected = _scan_family(tmp_path, dataset, "tiny")
    assert not rejected and manifest["unmatched_controls"] == []
    assert [s["control"] for s in manifest["sources"]] == [str(folders[n][1]) for n in "abc"]
    assert ScanManifest.model_validate(manifest).control_roots() == {
        None: folders["c"][1],
        **{i: folders[n][1] for i, n in enumerate("abc")},
    }
    for i, n in enumerate("abc"):
        assert records[f"{i}//cat.png"]["control_sha256"] == file_sha256(folders[n][1] / "cat.png")
    # A family whose text encoder sees the control: the text rows take each source's own control file.
    from tuneline.stages.text.controls import paired_captions

    qwen = parse_config({"workdir": str(tmp_path / "work"), "dataset": dataset, "model": {"family": "qwen_image_edit"}})
    qctx = StageContext(qwen)
    scan = qctx.store.read(qctx.store.latest("scan"), ScanManifest)
    pairs, files = paired_captions(qctx, scan, {})
    assert files == {file_sha256(folders[n][1] / "cat.png"): folders[n][1] / "cat.png" for n in "abc"}
    assert sorted(sha for _, sha in pairs) == sorted(files)

    path, _ = run_stage(_tiny_latents(tmp_path, dataset), stage("latents"), PIPELINE)
    manifest = json.loads((path / "manifest.json").read_text())
    assert (manifest["controls"], manifest["controls_encoded"]) == (3, 3)
    [bucket] = manifest["buckets"]
    rows = {r["path"]: r["row"] for r in read_jsonl(path / "index.jsonl")}
    ctrl = np.load(control_latents.control_file(path, bucket["array"]))
    a, b = ctrl[rows["0//cat.png"]], ctrl[rows["1//cat.png"]]
    assert not np.allclose(a, b, atol=1e-2)  # the same name, each source's own control

    # One source's control edited: new scan content for that record only.
    Image.new("RGB", (32, 32), (90, 0, 90)).save(folders["b"][1] / "cat.png")
    _, records2, _ = _scan_family(tmp_path, dataset, "tiny")
    assert records2["1//cat.png"]["control_sha256"] != records["1//cat.png"]["control_sha256"]
    assert records2["0//cat.png"] == records["0//cat.png"] | {"mtime_ns": records2["0//cat.png"]["mtime_ns"]}


def test_a_source_without_control_is_rejected_when_others_are_paired(tmp_path):
    data, ctl = _folder(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    Image.new("RGB", (32, 32)).save(other / "x.png")
    dataset = {"path": None, "sources": [{"path": str(data), "control": str(ctl)}, {"path": str(other)}]}
    _, records, rejected = _scan_family(tmp_path, dataset, "tiny")
    assert set(records) == {"0//cat.png", "0//dog.png"}
    reasons = {r["path"]: r["reason"] for r in rejected}
    assert "dataset.sources[1].control" in reasons["1//x.png"]
