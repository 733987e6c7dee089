"""Sharded latent and text caches (latents.shards / text.shards): each shard its own process, one version that is
byte for byte the 1-shard cache, shards listed in the manifest; a killed shard resumes, a failed one names itself."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.integration.test_latents_stage import corrupt_png, tiny_model_dir, write_images
from tuneline.schemas.config import parse_config
from tuneline.schemas.latents import LatentsManifest
from tuneline.schemas.scan import ScanManifest
from tuneline.schemas.text import TextManifest
from tuneline.stages.common.shards import ShardFailed, shard_folder, split
from tuneline.stages.common.stage import StageContext, expected_versions, run_stage
from tuneline.stages.latents import store
from tuneline.stages.latents.shard import make_plan, owners
from tuneline.stages.pipeline import PIPELINE, stage

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("sharded")
    write_images(root / "data", range(40))
    # Sorted first in its bucket: every later block of that bucket moves by one row, which the parent redoes.
    (root / "data" / "broken.png").write_bytes(corrupt_png())
    return root, tiny_model_dir(tmp_path_factory.getbasetemp())


def context(root: Path, models: Path, name: str, shards: int, force: bool = False) -> StageContext:
    work = root / name
    work.mkdir(exist_ok=True)
    if not (work / "models").exists():
        os.symlink(models, work / "models")
    cfg = parse_config(
        {
            "dataset": {"path": str(root / "data")},
            "model": {"family": "tiny", "device": "cpu"},
            "latents": {"block_rows": 4, "batch_size": 3, "workers": 1, "shards": shards},
            "text": {"batch_size": 4, "shards": shards},
        },
        workdir=str(work),
    )
    return StageContext(cfg, force=force)


def build(ctx: StageContext, *names: str) -> dict[str, Path]:
    return {n: run_stage(ctx, stage(n), PIPELINE)[0] for n in names}


def files(path: Path) -> dict[str, bytes]:
    """Every file of a published version but its manifest, by relative path."""
    return {
        p.relative_to(path).as_posix(): p.read_bytes()
        for p in sorted(path.rglob("*"))
        if p.is_file() and p.name != "manifest.json"
    }


@pytest.fixture(scope="module")
def single(data) -> dict[str, Path]:
    root, models = data
    return build(context(root, models, "single", 1), "scan", "latents", "text")


def test_sharded_caches_are_the_single_process_caches(data, single):
    root, models = data
    ctx = context(root, models, "two", 2)
    got = build(ctx, "scan", "latents", "text")
    for name, cls in (("latents", LatentsManifest), ("text", TextManifest)):
        assert got[name].name == single[name].name  # shards are not part of the version
        assert files(got[name]) == files(single[name]), name
        m = ctx.store.read(got[name], cls)
        assert [s.index for s in m.shards] == [0, 1]
        assert all(s.blocks > 0 and s.encoded > 0 and s.seconds > 0 and s.peak_rss > 0 for s in m.shards)
        assert not any(p.name.startswith("shard-") for p in got[name].rglob("*"))  # logs stay outside
    m = ctx.store.read(got["latents"], LatentsManifest)
    assert (m.count, m.rejected) == (40, 1)
    assert sum(s.encoded for s in m.shards) >= 40
    assert ctx.store.read(single["latents"], LatentsManifest).shards is None


def test_blocks_split_into_disjoint_parts_covering_the_plan(data, single):
    root, models = data
    ctx = context(root, models, "single", 1, force=True)  # force: no previous version, every block encodes
    scan = ctx.store.read(ctx.store.latest("scan"), ScanManifest)
    p = make_plan(ctx, root / "plan-only", scan)
    for count in (1, 2, 3, 7):
        parts = owners(p, count)
        flat = [b for part in parts for b in part]
        assert all(sorted(part) == part for part in parts)  # each shard's blocks in plan order
        assert len(set(flat)) == len(flat) == sum(-(-len(j.records) // 4) for j in p.jobs)  # disjoint, covering
        rows = [sum(len(p.jobs[k].records[b * 4 : (b + 1) * 4]) for k, b in part) for part in parts]
        assert max(rows) - min(rows) <= 4  # about as many rows to encode each (nothing reused here)
    assert [len(split(10, 3, i)) for i in range(3)] == [3, 3, 4]


def _work(ctx: StageContext) -> Path:
    version = expected_versions(ctx, [stage("scan"), stage("latents")])["latents"][0]
    return ctx.store.partial_dir("latents", version)


def _shard_process(index: int) -> psutil.Process | None:
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = p.cmdline()
        except psutil.Error:
            continue
        if "tuneline.stages.common.shards" in cmd and cmd[cmd.index("tuneline.stages.common.shards") + 2] == str(index):
            return p
    return None


def _scanned(data, name: str):
    """A 2-shard latents context of its own after its scan: the context, its work folder and the shards' plan."""
    root, models = data
    ctx = context(root, models, name, 2)
    build(ctx, "scan")
    work = _work(ctx)
    return ctx, work, make_plan(ctx, work, ctx.store.read(ctx.store.latest("scan"), ScanManifest))


def test_killed_shard_resumes_its_finished_blocks(data, single):
    ctx, work, p = _scanned(data, "killed")
    theirs = [(p.jobs[k].key, b) for k, b in owners(p, 2)[1]]
    seen: dict[str, int] = {}

    def kill_after_first_block() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            proc = _shard_process(1)
            done = [kb for kb in theirs if (work / store.BLOCKS / kb[0] / f"{kb[1]:06d}.json").is_file()]
            if proc is not None and done:
                proc.send_signal(signal.SIGKILL)
                seen["done"] = len(done)
                return
            time.sleep(0.002)

    killer = threading.Thread(target=kill_after_first_block)
    killer.start()
    with pytest.raises(ShardFailed) as err:
        build(ctx, "latents")
    killer.join()
    assert "shard 1 of 2 failed: killed by signal 9" in str(err.value)
    assert str(shard_folder(work) / "shard-1.log") in str(err.value)
    assert ctx.store.latest("latents") is None  # nothing published
    assert 0 < seen["done"] < len(theirs), "the shard finished before it could be killed"
    path = build(ctx, "latents")["latents"]
    assert files(path) == files(single["latents"])
    report = json.loads((shard_folder(work) / "shard-1.json").read_text())
    assert report["resumed"] > 0 and report["encoded"] < 4 * len(theirs)


def test_failed_shard_names_itself_and_publishes_nothing(data):
    ctx, work, p = _scanned(data, "failed")
    k, b = owners(p, 2)[0][-1]
    blocker = work / store.BLOCKS / p.jobs[k].key / f"{b:06d}.json"
    blocker.mkdir(parents=True)  # shard 0 cannot write this block's record
    with pytest.raises(ShardFailed) as err:
        build(ctx, "latents")
    msg = str(err.value)
    assert "shard 0 of 2 failed: exit code 1" in msg and "shard 1" not in msg
    log = shard_folder(work) / "shard-0.log"
    assert str(log) in msg and "IsADirectoryError" in log.read_text()
    assert ctx.store.latest("latents") is None
    blocker.rmdir()
    assert build(ctx, "latents")["latents"].is_dir()


def test_text_shard_failure_then_rerun_resumes_the_other_shards_windows(data, single):
    from tuneline.stages.text.shard import staging, to_encode

    root, models = data
    ctx = context(root, models, "text-failed", 2)
    build(ctx, "scan")
    work = ctx.store.partial_dir("text", expected_versions(ctx, [PIPELINE[0], stage("text")])["text"][0])
    scan = ctx.store.read(ctx.store.latest("scan"), ScanManifest)
    from tuneline.stages.text.core import wanted_strings

    todo = to_encode(wanted_strings(ctx, scan), None, 4)
    blocker = staging(work) / f"{todo[split(len(todo), 2, 0)[-1]][0]:08d}.pt"
    blocker.mkdir(parents=True)  # shard 0 cannot store its last window
    with pytest.raises(ShardFailed) as err:
        build(ctx, "text")
    assert "shard 0 of 2 failed" in str(err.value) and "shard 1" not in str(err.value)
    assert ctx.store.latest("text") is None
    blocker.rmdir()
    path = build(ctx, "text")["text"]
    assert files(path) == files(single["text"])
    reports = [json.loads((shard_folder(work) / f"shard-{i}.json").read_text()) for i in (0, 1)]
    assert reports[1]["encoded"] == 0 and reports[1]["resumed"] > 0  # shard 1 finished in the failed run
    assert 0 < reports[0]["encoded"] < reports[0]["resumed"] + reports[0]["encoded"]  # shard 0 kept its windows
