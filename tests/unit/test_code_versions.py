"""A stage's output-relevant source cannot change without a decision: a new version (its artifacts become stale)
or a recorded "output unchanged" (stages/code_versions.json)."""

from __future__ import annotations

import pytest

from tuneline.stages.common import codeident
from tuneline.stages.pipeline import PIPELINE


@pytest.mark.parametrize("stage", list(codeident.SOURCES))
def test_source_change_is_versioned_or_recorded(stage):
    assert codeident.source_hash(stage) == codeident.recorded()[stage]["source"], (
        f"the source of stage {stage} changed since its version was recorded. If its output can change, run "
        f"`python -m tuneline.stages.common.codeident --bump {stage}` (published {stage} versions become stale); if not "
        f"(a refactor, a comment), run `python -m tuneline.stages.common.codeident --record {stage}`"
    )


def test_every_stage_takes_its_version_from_the_record():
    assert {sd.name: sd.code_version for sd in PIPELINE} == {s: r["version"] for s, r in codeident.recorded().items()}


def test_library_versions_are_major_minor_and_keyed(monkeypatch, tmp_path):
    from importlib import metadata

    real = metadata.version
    assert all(v.count(".") == 1 for v in codeident.library_versions("latents").values())
    monkeypatch.setattr(metadata, "version", lambda n: "99.1.7" if n == "diffusers" else real(n))
    assert codeident.library_versions("latents")["diffusers"] == "99.1"
    assert "diffusers" not in codeident.library_versions("text")
