"""Housekeeping on a hand-made store: keep the newest K, never a fresh version or what a fresh one uses."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tuneline.stages.common.artifacts import ArtifactStore
from tuneline.stages.common.gc import collect, plan, protected
from tuneline.stages.common.lineage import lineage

STAGES = ["scan", "latents", "train"]


def _publish(store: ArtifactStore, stage: str, version: str, order: int, upstream: dict | None = None) -> Path:
    d = store.version_dir(stage, version)
    d.mkdir(parents=True)
    (d / "data.bin").write_bytes(b"x" * 1000)
    m = d / "manifest.json"
    m.write_text(
        json.dumps(
            {
                "stage": stage,
                "fingerprint": version,
                "upstream": upstream or {},
                "created_at": f"2026-01-0{order}T00:00:00Z",
            }
        )
    )
    os.utime(m, ns=(order * 10**9, order * 10**9))  # versions() orders by manifest mtime
    return d


@pytest.fixture()
def store(tmp_path) -> ArtifactStore:
    """scan s1..s4, latents l1 (from s1, the oldest scan) .. l3, train t1 (from l1) and t2 (from l3)."""
    s = ArtifactStore(tmp_path)
    for i in range(1, 5):
        _publish(s, "scan", f"s{i}", i)
    _publish(s, "latents", "l1", 5, {"scan": "s1"})
    _publish(s, "latents", "l2", 6, {"scan": "s2"})
    _publish(s, "latents", "l3", 7, {"scan": "s4"})
    _publish(s, "train", "t1", 8, {"latents": "l1"})
    _publish(s, "train", "t2", 9, {"latents": "l3"})
    return s


def _names(paths) -> set[str]:
    return {p.name for p in paths}


def test_fresh_downstream_protects_its_whole_upstream_chain(store):
    guard = protected(store, {"scan": None, "latents": None, "train": "t1"})
    assert set(guard) == {("train", "t1"), ("latents", "l1"), ("scan", "s1")}
    assert guard[("scan", "s1")] == "used by fresh latents l1"


def test_keep_newest_plus_protected(store):
    p = plan(store, STAGES, {"train": "t1"}, keep=1)
    assert _names(p.remove) == {"s2", "s3", "l2"}
    assert _names(p.keep) == {"s1", "s4", "l1", "l3", "t1", "t2"}
    expected = sum(f.stat().st_size for d in p.remove for f in d.rglob("*") if f.is_file())
    assert collect(p) == expected
    assert _names(store.versions("scan")) == {"s1", "s4"}
    assert not any(d.name.startswith(".") for d in store.stage_dir("scan").iterdir()), "no trash left behind"


def test_a_file_a_kept_version_still_links_frees_nothing(store):
    shared = store.version_dir("latents", "l2") / "data.bin"
    os.unlink(shared)
    os.link(store.version_dir("latents", "l3") / "data.bin", shared)  # an incremental build's shared chunk
    p = plan(store, STAGES, {"train": "t1"}, keep=1)
    assert _names(p.remove) == {"s2", "s3", "l2"}
    expected = sum(f.stat().st_size for d in p.remove for f in d.rglob("*") if f.is_file() and f != shared)
    assert collect(p) == expected  # l2's manifest, not its data.bin: that stays l3's
    assert (store.version_dir("latents", "l3") / "data.bin").read_bytes() == b"x" * 1000


def test_keep_zero_removes_everything_unprotected(store):
    p = plan(store, STAGES, {"scan": "s3"}, keep=0)
    collect(p)
    assert [v.version for v in lineage(store, STAGES, {})] == ["s3"]


def test_partial_work_is_kept_unless_asked_and_gc_trash_always_goes(store):
    partial = store.partial_dir("latents", "abc")
    partial.mkdir()
    trash = store.stage_dir("scan") / ".s0.gc"  # left by a gc killed between rename and delete
    (trash / "sub").mkdir(parents=True)
    p = plan(store, STAGES, {}, keep=10)
    assert p.remove == [] and p.partial == [partial] and p.trash == [trash]
    collect(p)
    assert partial.is_dir() and not trash.exists()
    collect(plan(store, STAGES, {}, keep=10), partial=True)
    assert not partial.exists()


def test_lineage_lists_versions_with_upstream_and_fresh_flag(store):
    rows = lineage(store, STAGES, {"train": "t2"})
    assert [(r.stage, r.version) for r in rows][:2] == [("scan", "s1"), ("scan", "s2")]
    t2 = next(r for r in rows if r.version == "t2")
    assert t2.fresh and t2.upstream == {"latents": "l3"} and t2.created_at == "2026-01-09T00:00:00Z"
    assert t2.upstream_text() == "latents l3"
