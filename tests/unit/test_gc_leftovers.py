"""Files killed runs leave behind (a training launch's `.spec-*.json`, a demo generation's `.demo-data.tmp-PID`)
are removed by `gc --partial`; the spec files also by the next training."""

from __future__ import annotations

import subprocess
import sys

from tuneline.schemas.config import load_config
from tuneline.stages.common.artifacts import ArtifactStore
from tuneline.stages.common.gc import collect, plan, stale_launch_files
from tuneline.stages.common.lock import in_use


def _dead_pid() -> int:
    return int(
        subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout
    )


def test_gc_partial_removes_launch_and_demo_leftovers(tmp_path):
    from tuneline.flows.ops import gc

    cfg = load_config(None, str(tmp_path / "work"))
    store = ArtifactStore(cfg.workdir_path())
    stage_dir = store.stage_dir("train")
    stage_dir.mkdir(parents=True)
    spec = stage_dir / ".abc.partial.spec-0123abcd.json"
    seen = stage_dir / ".abc.partial.seen-0123abcd.json"
    for f in (spec, seen):
        f.write_text("{}", encoding="utf-8")
    demo_tmp = cfg.resolve(cfg.dataset.path).parent / f".demo-data.tmp-{_dead_pid()}"
    demo_tmp.mkdir()
    (demo_tmp / "red_circle_64x64_0.png").write_bytes(b"half")
    gc(cfg, 3, partial=True)
    assert not spec.exists() and not seen.exists() and not demo_tmp.exists()


def test_launch_files_of_a_training_in_progress_are_kept(tmp_path):
    stage_dir = tmp_path / "train"
    work = stage_dir / ".abc.partial"
    work.mkdir(parents=True)
    spec = stage_dir / ".abc.partial.spec-0123abcd.json"
    spec.write_text("{}", encoding="utf-8")
    with in_use(work):
        assert stale_launch_files(stage_dir) == []
    assert stale_launch_files(stage_dir) == [spec]
    p = plan(ArtifactStore(tmp_path / "w"), [], {}, 1)
    p.partial = [spec]
    collect(p, partial=True)
    assert not spec.exists()
