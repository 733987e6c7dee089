"""The session's upstream store: copied caches are fresh and verify in the test's workdir like built ones, one
build serves every config with the same stage keys, and a tampered copy is refused (the store's stays intact)."""

from __future__ import annotations

import pytest

from tests.integration.test_train_support import small_config
from tuneline.schemas.text import TextManifest
from tuneline.stages.common.artifacts import ArtifactError
from tuneline.stages.common.stage import run_stage, status
from tuneline.stages.pipeline import PIPELINE, stage
from tuneline.stages.scan.demo import write_demo_dataset

UPSTREAM = ("scan", "latents", "text")


def _cfg(store, workdir, **train):
    return small_config(
        workdir, {"steps": 2, **train}, dataset={"path": str(store.dataset("demo", write_demo_dataset))}
    )


def test_copies_are_fresh_and_verify_as_built(upstream_store, tmp_path):
    ctx = upstream_store.upstream(_cfg(upstream_store, tmp_path / "a"))
    built = upstream_store.builds
    rows = {r.stage: r.state for r in status(ctx, PIPELINE)}
    assert [rows[s] for s in UPSTREAM] == ["fresh"] * 3, rows
    for name in UPSTREAM:  # the stage runner reads and verifies each as it would a version it built
        path, rebuilt = run_stage(ctx, stage(name), PIPELINE)
        assert not rebuilt and path.parent.parent == ctx.workdir / "artifacts"
    # Another workdir, a config that differs only downstream (train): nothing is built again.
    other = upstream_store.upstream(_cfg(upstream_store, tmp_path / "b", learning_rate=0.01))
    assert upstream_store.builds == built
    assert {r.stage: r.state for r in status(other, PIPELINE)}["text"] == "fresh"


def test_a_tampered_copy_is_refused(upstream_store, tmp_path):
    ctx = upstream_store.upstream(_cfg(upstream_store, tmp_path))
    text = ctx.store.latest("text")
    captions = text / "captions.jsonl"
    captions.write_text(captions.read_text(encoding="utf-8").replace("red", "blue"), encoding="utf-8")
    with pytest.raises(ArtifactError, match="captions.jsonl"):
        ctx.store.read(text, TextManifest)
    shared = upstream_store.work / "artifacts" / "text" / text.name
    ctx.store.read(shared, TextManifest)  # the store's own stays intact
