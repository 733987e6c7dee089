"""kill -9 during caching, then rerun: finished blocks are kept, nothing partial is ever published, and the
result equals an uninterrupted build bit for bit. (Resuming a resumed build and blocks lost between a chunk
write and its record are covered with a stand-in encoder in tests/unit/test_latents_store.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.integration.test_latents_stage import context, rows_by_path, tiny_model_dir, write_images
from tuneline.schemas.latents import LatentsManifest
from tuneline.stages.common.hashing import digest
from tuneline.stages.common.stage import key_parts, run_stage
from tuneline.stages.latents import store
from tuneline.stages.pipeline import PIPELINE, stage

ROOT = Path(__file__).resolve().parents[2]
RUN_LATENTS = """
import json, sys
from tuneline.schemas.config import parse_config
from tuneline.stages.common.stage import StageContext, run_stage
from tuneline.stages.pipeline import PIPELINE, stage
run_stage(StageContext(parse_config(json.loads(sys.argv[1]), workdir=sys.argv[2])), stage("latents"), PIPELINE)
"""


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.getbasetemp())


def finished_rows(partial: Path) -> int:
    total = 0
    for f in partial.glob(f"{store.BLOCKS}/*/*.json"):
        try:
            total += len(json.loads(f.read_text())["paths"])
        except (json.JSONDecodeError, FileNotFoundError):  # a record being renamed into place
            pass
    return total


def kill_after(ctx, partial: Path, rows: int, timeout: float = 240) -> int:
    """Run the stage in its own process group and SIGKILL it once `rows` more rows sit in finished blocks."""
    before = finished_rows(partial)
    proc = subprocess.Popen(
        [sys.executable, "-c", RUN_LATENTS, json.dumps(ctx.cfg.dump()), str(ctx.workdir)],
        cwd=ROOT,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
    )  # same threads: same floats
    deadline = time.monotonic() + timeout
    while finished_rows(partial) < before + rows:
        assert proc.poll() is None, f"the stage ended before it could be killed: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline, "no progress to kill"
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    return finished_rows(partial)


def test_sigkill_then_rerun_resumes_from_finished_blocks(tiny_models, tmp_path):
    write_images(tmp_path / "data", range(60))
    ctx = context(tmp_path / "work", tmp_path / "data", tiny_models, batch_size=2)
    run_stage(ctx, stage("scan"), PIPELINE)
    key = digest(key_parts(ctx, stage("latents"), {"scan": ctx.store.latest("scan").name}))
    partial = ctx.store.partial_dir("latents", key)

    kept = kill_after(ctx, partial, rows=8)
    assert ctx.store.latest("latents") is None and partial.is_dir()  # killed: nothing published

    path, _ = run_stage(ctx, stage("latents"), PIPELINE)
    m = ctx.store.read(path, LatentsManifest)
    assert m.resumed == kept and m.encoded == m.count - kept and m.count == 60  # only the block in flight lost
    assert not partial.exists()

    clean = context(tmp_path / "clean", tmp_path / "data", tiny_models, batch_size=2)
    run_stage(clean, stage("scan"), PIPELINE)
    ref_path, _ = run_stage(clean, stage("latents"), PIPELINE)
    ref = clean.store.read(ref_path, LatentsManifest)
    assert ref_path.name == path.name
    assert (path / store.INDEX).read_text() == (ref_path / store.INDEX).read_text()
    for name in store.DIST:
        got, want = rows_by_path(path, m, name), rows_by_path(ref_path, ref, name)
        assert all(np.array_equal(got[p], want[p]) for p in want)
