"""A killed scan of shard sources resumes: after the webdataset shards it finished, inside a long shard where it
stopped, and after the row groups of a large parquet table it had read. Each scan is killed in its own process
(SIGKILL to its process group), as a preempted worker is."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tests.integration.test_scan_stage import config, scan
from tests.integration.test_shard_sources import write_parquet, write_shard

KILLED_SCAN = """
import sys
from tuneline.schemas.config import load_config
from tuneline.stages.common.stage import StageContext, run_stage
from tuneline.stages.scan import STAGE, shardindex
shardindex.CHECKPOINT_S = float(sys.argv[2])  # how often a long shard's progress is kept (5 s), shorter for a test
run_stage(StageContext(load_config(sys.argv[1])), STAGE, [STAGE])
"""


def _killed_when(cfg, tmp_path: Path, kept: str, checkpoint_s: float = 5.0) -> Path:
    """Start a scan of `cfg` in its own process and SIGKILL it once a file matching `kept` appears in the scan's
    kept indexes (.shards-*); the scan's stage folder."""
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg.dump()))
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_SCAN, str(cfg_file), str(checkpoint_s)], start_new_session=True
    )
    scan_dir = cfg.workdir_path() / "artifacts" / "scan"
    deadline = time.monotonic() + 240
    while not any(scan_dir.glob(f".shards-*/{kept}")):
        assert proc.poll() is None and time.monotonic() < deadline, f"the scan ended before {kept} was kept"
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not [p for p in scan_dir.iterdir() if not p.name.startswith(".")]  # killed: nothing published
    return scan_dir


def test_a_killed_scan_resumes_after_the_shards_it_finished(tmp_path):
    data = tmp_path / "shards"
    data.mkdir()
    for i in range(8):
        write_shard(data / f"{i:06d}.tar", i * 600, 600)
    cfg = config(tmp_path, data)
    scan_dir = _killed_when(cfg, tmp_path, "[0-9a-f]*[0-9a-f].json")  # each shard's index, kept once it is read
    finished = {json.loads(p.read_bytes())["rel"] for p in scan_dir.glob(".shards-*/*[0-9a-f].json")}
    assert 1 <= len(finished) < 8
    _, _, records, _, manifest = scan(cfg)
    assert sorted(manifest["shards_read"]) == sorted({f"{i:06d}.tar" for i in range(8)} - finished)
    assert len(records) == 4800


def test_a_scan_killed_inside_a_long_shard_resumes_where_it_stopped(tmp_path):
    """A shard's progress (its members so far, the next header's offset) is kept while it is read: the rerun
    reads only the rest of it and publishes what an uninterrupted scan does."""
    data = tmp_path / "shards"
    data.mkdir()
    write_shard(data / "000000.tar", 0, 3000)
    cfg = config(tmp_path / "killed", data)
    scan_dir = _killed_when(cfg, tmp_path, "*.progress.json", checkpoint_s=0.05)
    resumed, _, records, _, manifest = scan(cfg)
    assert len(records) == 3000 and 0 < manifest["reopened"] < 3000  # the members before the kill: not read again
    assert not list(scan_dir.glob(".shards-*/*.progress.json"))
    whole, _, _, _, _ = scan(config(tmp_path / "whole", data))
    assert (whole / "images.jsonl").read_bytes() == (resumed / "images.jsonl").read_bytes()


def test_a_scan_killed_inside_a_parquet_table_resumes_after_the_row_groups_it_read(tmp_path):
    """The table's progress (its rows so far, the next row group) is kept while it is read: the rerun reads only
    the row groups after it and publishes what an uninterrupted scan does."""
    table = tmp_path / "rows.parquet"
    write_parquet(table, 2000, row_group=20)
    cfg = config(tmp_path / "killed", table)
    scan_dir = _killed_when(cfg, tmp_path, "*.progress.json", checkpoint_s=0.05)
    [progress] = scan_dir.glob(".shards-*/*.progress.json")
    done = json.loads(progress.read_bytes())["at"]
    assert 0 < done < 100  # row groups read before the kill
    resumed, _, records, _, manifest = scan(cfg)
    assert len(records) == 2000 and manifest["reopened"] == 2000 - 20 * done  # only the row groups after it
    assert not list(scan_dir.glob(".shards-*/*.progress.json"))
    whole, _, _, _, _ = scan(config(tmp_path / "whole", table))
    assert (whole / "images.jsonl").read_bytes() == (resumed / "images.jsonl").read_bytes()
