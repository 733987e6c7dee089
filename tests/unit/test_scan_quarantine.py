"""Bad entries in a dataset are quarantined, not crashes: a symlink loop, a caption that is a symlink out of the
dataset (its image is rejected, not trained without a caption); a hash cache of the wrong shape is discarded."""

from __future__ import annotations

import json
import os

from PIL import Image

from tuneline.schemas.config import load_config
from tuneline.stages.common.hashing import HashCache, file_sha256
from tuneline.stages.common.sizing import size_policy
from tuneline.stages.scan.captions import Captions
from tuneline.stages.scan.core import alignment
from tuneline.stages.scan.images import probe_file
from tuneline.stages.scan.listing import walk
from tuneline.stages.scan.records import make_record


def _cfg(tmp_path, data):
    cfg = load_config(None, str(tmp_path / "work"))
    return cfg.model_copy(update={"dataset": cfg.dataset.model_copy(update={"path": str(data), "demo": False})})


def _records(cfg, data):
    listing = walk(data, cfg.dataset)
    captions = Captions(listing, cfg.dataset)
    policy = size_policy(cfg.buckets, alignment(cfg))
    out = {}
    for e in listing.images:
        out[e.rel] = make_record(probe_file(e.path, e.rel, e.size, e.mtime_ns), captions, policy, cfg)
    return listing, out


def test_a_symlink_loop_is_rejected_with_a_reason(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    Image.new("RGB", (256, 256), (200, 10, 10)).save(data / "good.png")
    os.symlink("b.png", data / "a.png")
    os.symlink("a.png", data / "b.png")
    os.symlink("loop", data / "loop")  # a folder link to itself
    cfg = _cfg(tmp_path, data)
    listing, records = _records(cfg, data)
    kinds = {p.path: (p.kind, p.reason) for p in listing.problems}
    for name in ("a.png", "b.png", "loop"):
        assert kinds[name][0] == "symlink" and "loop" in kinds[name][1], kinds
    assert list(records) == ["good.png"]
    listing.fingerprint()  # what `tuneline status` computes


def test_a_caption_symlinked_out_of_the_dataset_rejects_its_image(tmp_path):
    data, outside = tmp_path / "data", tmp_path / "secret.txt"
    data.mkdir()
    outside.write_text("a caption from elsewhere", encoding="utf-8")
    for name in ("linked", "plain"):
        Image.new("RGB", (256, 256), (10, 200, 10)).save(data / f"{name}.png")
    os.symlink(outside, data / "linked.txt")
    (data / "plain.txt").write_text("a green square", encoding="utf-8")
    _, records = _records(_cfg(tmp_path, data), data)
    assert records["plain.png"].caption == "a green square"
    bad = records["linked.png"]
    assert getattr(bad, "kind", None) == "caption" and "linked.txt" in bad.reason, bad


def test_a_hash_cache_of_the_wrong_shape_is_discarded(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"weights")
    for junk in ([], "text", 3, {str(f.resolve()): "not a list"}, {str(f.resolve()): [1, 2]}):
        (tmp_path / "cache.json").write_text(json.dumps(junk), encoding="utf-8")
        cache = HashCache(tmp_path / "cache.json")
        assert cache.sha256(f) == file_sha256(f)
        cache.save()
        assert isinstance(json.loads((tmp_path / "cache.json").read_text(encoding="utf-8")), dict)
