"""Captions: sidecars, metadata.jsonl, file-name fallback, undecodable text, the empty-caption policy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tuneline.schemas.scan import DatasetConfig
from tuneline.stages.scan.captions import CaptionError, Captions, filename_caption
from tuneline.stages.scan.listing import walk


def captions(root: Path, **cfg) -> Captions:
    dcfg = DatasetConfig(path=str(root), **cfg)
    return Captions(walk(root, dcfg), dcfg)


def touch_images(root: Path, *names: str) -> None:
    for n in names:
        (root / n).parent.mkdir(parents=True, exist_ok=True)
        (root / n).write_bytes(b"")


def test_sidecar_beats_metadata_and_is_normalized(tmp_path):
    touch_images(tmp_path, "a.png", "b.jpg", "sub/c.png", "d.JPG")
    (tmp_path / "d.TXT").write_text("upper-case extensions", encoding="utf-8")
    (tmp_path / "a.txt").write_text("\ufeff  a red\n square  \n", encoding="utf-8")  # BOM + stray whitespace
    (tmp_path / "metadata.jsonl").write_text(
        json.dumps({"file_name": "a.png", "text": "from metadata"})
        + "\n"
        + json.dumps({"file_name": "b.jpg", "text": "a blue circle"})
        + "\n",
        encoding="utf-8",
    )
    (tmp_path / "sub" / "metadata.jsonl").write_text(json.dumps({"file_name": "c.png", "caption": "nested"}) + "\n")
    c = captions(tmp_path)
    assert c.caption_for("a.png") == ("a red square", "sidecar")
    assert c.caption_for("b.jpg") == ("a blue circle", "metadata")
    assert c.caption_for("sub/c.png") == ("nested", "metadata")  # file_name relative to its metadata file
    assert c.caption_for("d.JPG") == ("upper-case extensions", "sidecar")
    assert c.problems == []


def test_metadata_problems_are_reported_per_line(tmp_path):
    touch_images(tmp_path, "a.png")
    lines = [
        '{"file_name": "a.png", "text": "ok"}',
        "{not json",
        '{"file_name": "x.png"}',
        '{"file_name": "../outside.png", "text": "no"}',
        "",
    ]
    (tmp_path / "metadata.jsonl").write_text("\n".join(lines), encoding="utf-8")
    c = captions(tmp_path)
    assert c.caption_for("a.png") == ("ok", "metadata")
    reasons = [p.reason for p in c.problems]
    assert [r.split(":")[0] for r in reasons] == ["line 2", "line 3", "line 4"]
    assert all(p.path == "metadata.jsonl" and p.kind == "metadata" for p in c.problems)
    assert "dataset.metadata_caption_field" in reasons[1] and "outside" in reasons[2]


def test_configured_metadata_field(tmp_path):
    touch_images(tmp_path, "a.png")
    (tmp_path / "metadata.jsonl").write_text('{"file_name": "a.png", "text": "t", "tags": "x, y"}\n')
    assert captions(tmp_path, metadata_caption_field="tags").caption_for("a.png") == ("x, y", "metadata")


def test_undecodable_text_is_reported(tmp_path):
    touch_images(tmp_path, "a.png", "b.png")
    (tmp_path / "a.txt").write_bytes("caf\u00e9 au lait".encode("latin-1"))
    (tmp_path / "metadata.jsonl").write_bytes(b'{"file_name": "b.png", "text": "\xff"}\n')
    c = captions(tmp_path)
    with pytest.raises(CaptionError, match=r"caption file a\.txt is not UTF-8.*re-save it as UTF-8"):
        c.caption_for("a.png")
    assert len(c.problems) == 1 and "metadata.jsonl is not UTF-8" in c.problems[0].reason


@pytest.mark.parametrize("policy,expected", [("keep", ("", "none")), ("filename", ("red square 3", "filename"))])
def test_empty_caption_policy(tmp_path, policy, expected):
    touch_images(tmp_path, "red_square-3.png", "blank.png")
    (tmp_path / "blank.txt").write_text("   \n", encoding="utf-8")
    c = captions(tmp_path, empty_caption=policy)
    assert c.caption_for("red_square-3.png") == expected
    assert c.caption_for("blank.png")[1] == expected[1]  # an empty sidecar counts as missing


def test_empty_caption_reject_names_the_fix(tmp_path):
    touch_images(tmp_path, "a.png")
    with pytest.raises(CaptionError, match=r"a\.txt.*dataset\.empty_caption"):
        captions(tmp_path, empty_caption="reject").caption_for("a.png")


def test_filename_caption():
    assert filename_caption("dir/A_photo--of_a-cat.JPG") == "A photo of a cat"


def test_each_sidecar_is_read_once_and_errors_repeat(tmp_path):
    """With several buckets.resolutions the scan asks once per resolution: one read, the same answer each time."""
    touch_images(tmp_path, "a.png", "b.png")
    (tmp_path / "a.txt").write_text("first", encoding="utf-8")
    (tmp_path / "b.txt").write_bytes(b"caf\xe9")  # Latin-1, not UTF-8
    c = captions(tmp_path)
    assert c.caption_for("a.png") == ("first", "sidecar")
    (tmp_path / "a.txt").unlink()  # a second read would now fail
    assert c.caption_for("a.png") == ("first", "sidecar")
    for _ in range(2):
        with pytest.raises(CaptionError, match=r"b\.txt is not UTF-8"):
            c.caption_for("b.png")
