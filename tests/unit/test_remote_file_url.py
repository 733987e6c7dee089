"""`ops.remote: file:///…` pushes into folders that do not exist yet, and pulls back what it pushed."""

from __future__ import annotations

from tuneline.schemas.scan import ScanManifest
from tuneline.stages.common.artifacts import ArtifactStore
from tuneline.stages.common.remote import Remote


def test_push_to_a_file_url_creates_its_folders(tmp_path):
    store = ArtifactStore(tmp_path / "work")
    work = store.start("scan", "v1")
    (work / "deep" / "er").mkdir(parents=True)
    (work / "deep" / "er" / "rows.jsonl").write_text("{}\n", encoding="utf-8")
    (work / "images.jsonl").write_text("", encoding="utf-8")
    m = ScanManifest.model_construct(
        stage="scan", fingerprint="v1", upstream={}, tool_version="0", code_version="0", config={}, inputs={}
    )
    store.publish(work, m)
    remote = Remote((tmp_path / "remote" / "not" / "yet").as_uri())
    assert remote.push(store, "scan", "v1")
    assert remote.versions("scan") == ["v1"]
    assert (tmp_path / "remote" / "not" / "yet" / "scan" / "v1" / "deep" / "er" / "rows.jsonl").is_file()
