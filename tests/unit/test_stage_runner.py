"""The generic runner: versions, atomic publish, freshness and staleness, upstream refusal, failure records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tuneline.schemas.base import Manifest
from tuneline.schemas.config import parse_config
from tuneline.stages.common.artifacts import ArtifactError, ArtifactStore
from tuneline.stages.common.stage import StageContext, StageDef, run_stage, status


class NumManifest(Manifest):
    total: int = 0


def _make_stages(calls: list[str], fail: dict) -> list[StageDef]:
    """Two real stages over the runner: `a` writes the sum of a config value, `b` doubles a's result."""

    def build_a(ctx, work: Path, up):
        calls.append("a")
        (work / "a.txt").write_text(str(ctx.cfg.train.steps))
        return {"total": ctx.cfg.train.steps}

    def build_b(ctx, work: Path, up):
        calls.append("b")
        if fail.get("b"):
            raise RuntimeError("boom")
        (work / "b.txt").write_text(str(2 * up["a"].total))
        return {"total": 2 * up["a"].total}

    a = StageDef("a", (), "a-1", NumManifest, lambda c: {"steps": c.train.steps}, lambda ctx, up: {}, build_a)
    b = StageDef("b", ("a",), "b-1", NumManifest, lambda c: {"lr": c.train.learning_rate}, lambda ctx, up: {}, build_b)
    return [a, b]


@pytest.fixture
def env(tmp_path):
    calls: list[str] = []
    fail: dict = {}
    stages = _make_stages(calls, fail)

    def ctx(**train):
        return StageContext(parse_config({"train": {"steps": 5, **train}}, workdir=str(tmp_path)))

    return ctx, stages, calls, fail, tmp_path


def _states(ctx, stages):
    return {r.stage: r.state for r in status(ctx, stages)}


def test_publish_skip_and_staleness(env):
    ctx, (a, b), calls, _, tmp = env
    c = ctx()
    assert _states(c, [a, b]) == {"a": "missing", "b": "missing"}
    pa, built = run_stage(c, a, [a, b])
    pb, _ = run_stage(c, b, [a, b])
    assert built and calls == ["a", "b"]
    assert (pb / "b.txt").read_text() == "10"
    m = json.loads((pb / "manifest.json").read_text())
    assert m["upstream"] == {"a": pa.name} and m["stage"] == "b" and m["fingerprint"] == pb.name
    assert {f["path"] for f in m["files"]} == {"b.txt"}
    assert _states(c, [a, b]) == {"a": "fresh", "b": "fresh"}
    # nothing changed: both skipped
    assert run_stage(c, a, [a, b])[1] is False and run_stage(c, b, [a, b])[1] is False
    assert calls == ["a", "b"]
    # a downstream-only change leaves upstream fresh
    rows = {r.stage: r for r in status(ctx(learning_rate=0.05), [a, b])}
    assert rows["a"].state == "fresh" and rows["b"].state == "stale"
    assert "lr" in rows["b"].reason
    # an upstream change makes everything downstream stale
    assert _states(ctx(steps=7), [a, b]) == {"a": "stale", "b": "stale"}


def test_no_partial_version_visible_and_failure_recorded(env):
    ctx, (a, b), calls, fail, tmp = env
    c = ctx()
    run_stage(c, a, [a, b])
    fail["b"] = True
    with pytest.raises(RuntimeError, match="boom"):
        run_stage(c, b, [a, b])
    store = ArtifactStore(tmp)
    assert store.versions("b") == []
    row = {r.stage: r for r in status(c, [a, b])}["b"]
    assert row.state == "failed" and "boom" in row.reason
    fail["b"] = False
    run_stage(c, b, [a, b])
    assert _states(c, [a, b])["b"] == "fresh"


def test_refuses_missing_and_tampered_upstream(env):
    ctx, (a, b), calls, _, tmp = env
    c = ctx()
    with pytest.raises(ArtifactError, match=r"needs the a artifact, which is missing.*tuneline stage a"):
        run_stage(c, b, [a, b])
    pa, _ = run_stage(c, a, [a, b])
    (pa / "a.txt").write_text("7")  # same size, different content
    with pytest.raises(ArtifactError, match=r"a\.txt does not match its checksum"):
        run_stage(c, b, [a, b])
    (pa / "a.txt").write_text("5")
    mpath = pa / "manifest.json"
    m = json.loads(mpath.read_text())
    m["schema_version"] = 99
    mpath.write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="schema_version 99"):
        ArtifactStore(tmp).read(pa, NumManifest)


def test_status_json_contract_fields(env):
    ctx, (a, b), *_ = env
    c = ctx()
    run_stage(c, a, [a, b])
    rows = [r.as_json() for r in status(c, [a, b])]
    assert [set(r) for r in rows] == [{"stage", "state", "version", "path", "reason"}] * 2
    assert Path(rows[0]["path"]).is_absolute() and rows[1]["path"] is None
