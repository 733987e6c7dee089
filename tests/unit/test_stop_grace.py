"""The stop grace: one figure from the planned step and checkpoint (never under STOP_GRACE_S) sets torchrun's
--shutdown-timeout, and the shipped Kubernetes template and Slurm example give a stopped job at least the least
grace plus a margin; a large model's plan asks for more."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from tests.integration.test_train_support import small_config
from tuneline.stages.train.memplan import plan
from tuneline.stages.train.stopping import (
    CHECKPOINT_BYTES_PER_S,
    CPU_FLOPS,
    GPU_FLOPS,
    STOP_GRACE_S,
    grace_seconds,
)
from tuneline.stages.train.workers import worker_command

INFRA = Path(__file__).resolve().parents[2] / "infra"
MARGIN_S = 30  # the launcher's own wait beyond torchrun's, and the process start-up around it


def test_the_grace_is_twice_the_step_plus_the_checkpoint_and_never_under_the_least(tmp_path):
    cfg = small_config(tmp_path, {"batch_size": 4, "grad_accumulation": 2})
    assert grace_seconds(None, cfg) == STOP_GRACE_S
    assert grace_seconds({"step_flops": 1, "checkpoint_bytes": 1, "free": None}, cfg) == STOP_GRACE_S
    big = {"step_flops": 3e14, "checkpoint_bytes": 40e9, "free": 80 * 2**30}
    want = math.ceil(2 * 3e14 * 8 / GPU_FLOPS + 40e9 / CHECKPOINT_BYTES_PER_S)
    assert grace_seconds(big, cfg) == want > STOP_GRACE_S
    on_cpu = {**big, "free": None}
    assert grace_seconds(on_cpu, cfg) == math.ceil(2 * 3e14 * 8 / CPU_FLOPS + 40e9 / CHECKPOINT_BYTES_PER_S)


def test_a_released_models_plan_and_torchrun_get_the_same_grace(tmp_path):
    from tuneline.stages.families.shipped import shipped_dir

    cfg = small_config(tmp_path, {"mode": "full", "batch_size": 4, "processes": 2}, model={"family": "sdxl"})
    p = plan(cfg, shipped_dir("sdxl"), torch.device("cpu"), gpu_memory_gib=80, family="sdxl")
    assert p.grace > STOP_GRACE_S, "a full SDXL fine-tune's checkpoint alone takes longer than the least grace"
    assert f"a stop may take up to {p.grace} s" in p.text()
    assert f"--shutdown-timeout={p.grace}" in worker_command(cfg, tmp_path / "spec.json", p.grace)
    # One process runs without torchrun: the launcher itself waits the grace after its stop (workers.stop).
    one = small_config(tmp_path, {"mode": "full", "batch_size": 4}, model={"family": "sdxl"})
    cmd = worker_command(one, tmp_path / "spec.json", p.grace)
    assert cmd[1:] == ["-u", "-m", "tuneline.stages.train.worker", str(tmp_path / "spec.json")]


def test_the_kubernetes_template_and_the_slurm_example_give_a_stop_its_grace():
    t = json.loads((INFRA / "k8s-gpu-job-template.json").read_text())
    pod = t["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == "{{ termination_grace_period_seconds }}"
    var = t["variables"]["properties"]["termination_grace_period_seconds"]
    assert var["default"] >= var["minimum"] >= STOP_GRACE_S + MARGIN_S
    slurm = (INFRA / "slurm-train.sbatch").read_text()
    m = re.search(r"^#SBATCH --signal=B:TERM@(\d+)$", slurm, re.M)
    assert m and int(m.group(1)) >= STOP_GRACE_S + MARGIN_S


@pytest.mark.parametrize("name", ["docs/stopping.md"])
def test_the_docs_list_the_exit_codes(name):
    text = (INFRA.parent / name).read_text()
    for code in ("| 3 |", "| 4 |", "| 5 |", "| 1 |", "| 2 |"):
        assert code in text
    assert "30 s" in text and "terminationGracePeriodSeconds" in text and "--signal" in text


def test_a_torchrun_without_the_flag_gets_the_same_wait_through_its_process_context(monkeypatch):
    """torch before 2.12: torchrun refuses --shutdown-timeout (exit 2 before any worker starts); the agent takes it
    off and gives the wait to the process context's close instead."""
    from torch.distributed.elastic.multiprocessing import api

    from tuneline.stages.train.procwatch import grace_compat

    seen = []
    monkeypatch.setattr(api.PContext, "close", lambda self, death_sig=None, timeout=30: seen.append(timeout))
    argv = ["procwatch", "--nproc_per_node=2", "--shutdown-timeout=240", "--standalone", "-m", "w", "spec"]
    assert grace_compat(argv, supported=True) == argv
    api.PContext.close(object())
    assert grace_compat(argv, supported=False) == [a for a in argv if not a.startswith("--shutdown")]
    api.PContext.close(object())
    assert seen == [30, 240]
