"""DDP training with 2 gloo processes under torchrun: disjoint deterministic sharding, and a run whose process
tree is SIGKILLed mid-run resuming to the same weights as an uninterrupted run."""

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
import torch
import yaml
from safetensors.torch import load_file

from tests.helpers import spawn
from tests.integration.test_train_support import ROOT, small_config, train
from tests.reliability.test_cli_server import _flow_run_states
from tests.tracing import tuneline_trace
from tuneline.schemas.latents import LatentsManifest
from tuneline.stages.common.artifacts import ArtifactStore
from tuneline.stages.latents.reader import LatentReader

pytestmark = pytest.mark.ddp(reason="sharding across ranks, and a 2-rank run killed or stopped by SIGTERM resuming")

# 2 processes x batch 4 x accumulation 2: a global step takes 16 of a bucket's 24 images.
TRAIN = {
    "steps": 12,
    "checkpoint_every": 4,
    "batch_size": 4,
    "grad_accumulation": 2,
    "processes": 2,
    "keep_checkpoints": 2,
    "lr_schedule": "cosine",
    "warmup_steps": 2,
    "noise_offset": 0.05,
}

DRIVER = """
import json, sys
from tuneline.schemas.config import parse_config
from tuneline.stages.common.stage import StageContext, run_stage
from tuneline.stages.pipeline import PIPELINE, stage
run_stage(StageContext(parse_config(json.loads(sys.argv[1]))), stage("train"), PIPELINE)
"""


def _cfg(workdir: Path, data: Path):
    """The test config, on the run's shared demo dataset: its scan, latents and text come from the store."""
    return small_config(workdir, TRAIN, dataset={"path": str(data)})


def _weights(train_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(train_dir / "final" / "unet" / "diffusion_pytorch_model.safetensors"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, upstream_store, demo_data):
    """An uninterrupted run, tracing which images each rank trains on."""
    wd = tmp_path_factory.mktemp("ddp-reference")
    upstream_store.upstream(_cfg(wd, demo_data))
    trace = wd / "trace"
    trace.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        tuneline_trace.enable(mp, trace)
        path = train(_cfg(wd, demo_data))
    return wd, path, trace


def test_ranks_train_disjoint_shards_of_the_plan(reference):
    wd, _, trace = reference
    ranks = [[json.loads(line) for line in (trace / f"trace-rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    assert [len(r) for r in ranks] == [TRAIN["steps"] * TRAIN["grad_accumulation"]] * 2
    store = ArtifactStore(wd)
    lat_dir = store.latest("latents")
    reader = LatentReader(lat_dir, store.read(lat_dir, LatentsManifest))
    plan = [b for epoch in range(4) for b in reader.plan(TRAIN["batch_size"], 2, 0, epoch)]
    for i, (a, b) in enumerate(zip(*ranks)):
        assert (a["step"], a["micro"], a["bucket"]) == (b["step"], b["micro"], b["bucket"])
        assert not set(a["paths"]) & set(b["paths"]), f"ranks share images at step {a['step']}"
        bucket, rows = plan[i]
        assert a["bucket"] == bucket
        assert sorted(a["paths"] + b["paths"]) == sorted(reader.paths[bucket][r] for r in rows)


def _workers_of(spec_dir: Path) -> list[int]:
    """Pids of processes whose command line names this run's training spec."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if proc.name.isdigit() and str(spec_dir) in cmd and "tuneline.stages.train" in cmd:
            found.append(int(proc.name))
    return found


def _await_checkpoint(wd: Path, proc: subprocess.Popen, log: Path, step: int, seconds: float) -> None:
    """Until the training in `wd` has written checkpoint `step` (its process still running, its log's tail if not)."""
    deadline = time.monotonic() + seconds
    while not list(wd.glob(f"artifacts/train/.*.partial/checkpoints/step-{step:07d}")):
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.05)


def _kill_after_checkpoint(wd: Path, cfg_json: str, step: int) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(wd / "driver.log", "w") as log:
        driver = spawn([sys.executable, "-c", DRIVER, cfg_json], log, env)
        _await_checkpoint(wd, driver, wd / "driver.log", step, 240)
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()
    partial = next(wd.glob("artifacts/train/.*.partial"))
    assert not (partial / "final").exists(), "the run finished before it could be killed"
    deadline = time.monotonic() + 15
    while _workers_of(partial) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _workers_of(partial), "training workers outlived their killed parent"


def assert_stopped(wd: Path, cfg_file: Path, env: dict, rc: int, steps: int) -> int:
    """A `tuneline stage train` in `wd` stopped by SIGTERM after checkpoint 4 (its console in wd/cli.log, its exit code
    `rc`): nothing published, no training process left, a stop checkpoint, and the stop read as one in the exit
    code (3), the console's last line and `tuneline status`. Returns the stop's step."""
    text = (wd / "cli.log").read_text()
    assert not [p for p in (wd / "artifacts" / "train").iterdir() if not p.name.startswith(".")], (
        f"a stopped training published a version:\n{text[-3000:]}"
    )
    partial = next(wd.glob("artifacts/train/.*.partial"))
    assert not _workers_of(partial), "training workers outlived the stopped stage"
    stopped_at = max(int(p.name.removeprefix("step-")) for p in (partial / "checkpoints").glob("step-*"))
    assert 4 < stopped_at < steps, f"no checkpoint on stop (newest: step {stopped_at}):\n{text[-3000:]}"
    reason = f"stopped at step {stopped_at} of {steps} (checkpoint step-{stopped_at:07d}); rerun to continue"
    assert rc == 3, text[-3000:]
    assert text.strip().splitlines()[-1] == f"error: {reason}", text[-3000:]
    status = subprocess.run(
        [sys.executable, "-m", "tuneline.flows.cli", "status", str(cfg_file), "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    row = next(r for r in json.loads(status.stdout) if r["stage"] == "train")
    assert (row["state"], row["reason"]) == ("stopped", reason)
    return stopped_at


def test_killed_run_resumes_to_the_same_weights(reference, tmp_path, upstream_store, demo_data):
    _, ref_path, _ = reference
    upstream_store.upstream(_cfg(tmp_path, demo_data))
    _kill_after_checkpoint(tmp_path, json.dumps(_cfg(tmp_path, demo_data).dump()), step=4)
    cfg = _cfg(tmp_path, demo_data)
    assert cfg.train.resume == "auto", "this test checks the default"
    resumed = train(cfg)  # train.resume: auto finds the killed attempt's checkpoint
    manifest = json.loads((resumed / "manifest.json").read_text())
    assert manifest["resumed_from"] and Path(manifest["resumed_from"]).name.startswith("step-")
    assert manifest["step"] == TRAIN["steps"]
    want, got = _weights(ref_path), _weights(resumed)
    assert want.keys() == got.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
    ref_losses = json.loads((ref_path / "manifest.json").read_text())["losses"]
    assert np.allclose(manifest["losses"], ref_losses, atol=1e-5)
    assert [p.name for p in sorted((resumed / "checkpoints").iterdir())] == ["step-0000008", "step-0000012"]


def test_a_stop_longer_than_torchruns_grace_checkpoints_reads_as_a_stop_and_resumes(
    reference, tmp_path, upstream_store, demo_data, prefect_server
):
    """SIGTERM to `tuneline stage train`'s process group (what a cancelled run, `kill` or a preemption sends) while
    the step plus its checkpoint takes longer than torchrun's default 30 s grace (a large checkpoint on a slow disk,
    stood in for by the tracing hook's SLOW_STOP_ENV): the workers finish their step, agree on it, checkpoint and
    stop; nothing is published; the stop reads as one in the console's last line, the exit code (3), `tuneline
    status` and the Prefect state; the rerun (train.resume: auto) continues from that checkpoint to the
    uninterrupted run's weights."""
    _, ref_path, _ = reference
    cfg = _cfg(tmp_path, demo_data)
    upstream_store.upstream(cfg)
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg.dump()))
    env = prefect_server | {"TUNELINE_TEST_TRACE": str(tmp_path), "TUNELINE_TEST_SLOW_STOP_S": "35"}
    env["PYTHONPATH"] = os.pathsep.join([str(tuneline_trace.HERE), str(ROOT)])
    with open(tmp_path / "cli.log", "w") as log:
        cli = spawn([sys.executable, "-m", "tuneline.flows.cli", "stage", "train", str(cfg_file)], log, env)
        _await_checkpoint(tmp_path, cli, tmp_path / "cli.log", 4, 300)
        os.killpg(cli.pid, signal.SIGTERM)
        rc = cli.wait(timeout=300)
    stopped_at = assert_stopped(tmp_path, cfg_file, env, rc, TRAIN["steps"])
    assert _flow_run_states(env, tmp_path) == ["CANCELLED"]

    resumed = train(_cfg(tmp_path, demo_data))
    manifest = json.loads((resumed / "manifest.json").read_text())
    assert Path(manifest["resumed_from"]).name == f"step-{stopped_at:07d}"
    want, got = _weights(ref_path), _weights(resumed)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
