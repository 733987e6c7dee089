"""A run in progress keeps using the scan it started from: a stray file appearing in the dataset meanwhile
(Thumbs.db) does not make its later stages find the scan stale; the next run decides freshness."""

from __future__ import annotations

from tuneline.schemas.config import load_config
from tuneline.stages.common.hashing import digest
from tuneline.stages.common.lock import run_lease
from tuneline.stages.common.stage import StageContext, expected_versions
from tuneline.stages.scan import STAGE as SCAN
from tuneline.stages.scan.demo import write_demo_dataset


def _scan_key(cfg) -> str:
    return digest(expected_versions(StageContext(cfg), [SCAN])["scan"][1])


def test_a_stray_file_during_a_run_changes_nothing_until_the_next_run(tmp_path):
    cfg = load_config(None, str(tmp_path / "work"))
    data = cfg.resolve(cfg.dataset.path)
    write_demo_dataset(data)
    with run_lease(cfg.workdir_path(), timeout=5):
        started = _scan_key(cfg)  # the scan stage of the run
        (data / "Thumbs.db").write_bytes(b"\x00" * 512)
        assert _scan_key(cfg) == started  # validate, later in the same run
    assert _scan_key(cfg) != started  # the next run sees the new file (and rescans; its records are unchanged)
