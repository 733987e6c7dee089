"""`tuneline lineage` and `tuneline gc` on a real store (three scan versions), and gc under a held store lock."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from tuneline.flows.cli import app

ROOT = Path(__file__).resolve().parents[2]
RESOLUTIONS = (64, 48, 32)  # built in this order: 64 is the oldest version, 32 the newest


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Three scan versions (one per resolution) of the demo dataset, built in-process; configs per resolution."""
    from tuneline.schemas.config import parse_config
    from tuneline.schemas.demo import DEMO_CONFIG
    from tuneline.stages.common.stage import StageContext, run_stage
    from tuneline.stages.pipeline import PIPELINE, stage
    from tuneline.stages.scan.demo import write_demo_dataset

    root = tmp_path_factory.mktemp("ops")
    configs, versions = {}, {}
    for res in RESOLUTIONS:
        cfg = parse_config(
            {**DEMO_CONFIG, "buckets": {**DEMO_CONFIG["buckets"], "resolution": res}}, workdir=str(root / "work")
        )
        write_demo_dataset(cfg.resolve(cfg.dataset.path))
        versions[res] = run_stage(StageContext(cfg), stage("scan"), PIPELINE)[0].name
        path = root / f"res{res}.yaml"
        path.write_text(yaml.safe_dump(cfg.dump() | {"ops": {"lock_timeout": 0}}))
        configs[res] = path
    assert len(set(versions.values())) == 3
    return {"root": root, "workdir": root / "work", "configs": configs, "versions": versions}


def _cli(*args: str):
    return CliRunner().invoke(app, list(args))


def test_lineage_lists_every_version_and_marks_the_fresh_one(store):
    out = _cli("lineage", str(store["configs"][64]), "--json")
    assert out.exit_code == 0, out.output
    rows = [r for r in json.loads(out.stdout) if r["stage"] == "scan"]
    assert [r["version"] for r in rows] == [store["versions"][r] for r in RESOLUTIONS]  # oldest first
    assert [r["fresh"] for r in rows] == [True, False, False]
    assert all(r["upstream"] == {} and r["created_at"].startswith("20") for r in rows)
    table = _cli("lineage", str(store["configs"][64]))
    assert table.exit_code == 0 and store["versions"][64] in table.stdout


def test_gc_keeps_newest_and_fresh_removes_the_rest(store):
    v = store["versions"]
    dry = _cli("gc", str(store["configs"][64]), "--keep", "1", "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert f"would remove {store['workdir'] / 'artifacts' / 'scan' / v[48]}" in dry.stdout
    assert (store["workdir"] / "artifacts" / "scan" / v[48]).is_dir(), "a dry run deletes nothing"
    out = _cli("gc", str(store["configs"][64]), "--keep", "1")
    assert out.exit_code == 0, out.output
    left = sorted(p.name for p in (store["workdir"] / "artifacts" / "scan").iterdir() if not p.name.startswith("."))
    assert left == sorted([v[64], v[32]])  # 64: fresh for this config; 32: the newest
    assert "(fresh)" in out.stdout and "among the newest kept" in out.stdout
    status = _cli("status", str(store["configs"][64]), "--json")
    assert json.loads(status.stdout)[0]["state"] == "fresh"


def test_gc_refuses_while_another_process_holds_the_store(store):
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from tuneline.stages.common.lock import store_lock
        with store_lock({str(store["workdir"])!r}, timeout=0, purpose="stage train, flow run busy-otter"):
            print("locked", flush=True)
            time.sleep(60)
    """)
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        out = _cli("gc", str(store["configs"][64]), "--keep", "0")
        assert out.exit_code == 1
        assert f"pid {holder.pid}" in out.output and "busy-otter" in out.output
    finally:
        holder.kill()
        holder.wait()
    assert (store["workdir"] / "artifacts" / "scan" / store["versions"][32]).is_dir(), "refused gc removed nothing"
