"""The launcher's refusal of more DDP processes than a node has GPUs (NCCL holds one rank per GPU), and the demo's
CPU walkthrough that runs the same on a GPU machine."""

from __future__ import annotations

from tuneline.schemas.config import parse_config
from tuneline.schemas.demo import DEMO_CONFIG
from tuneline.stages.train.launch import gpu_problem


def test_more_processes_than_gpus_is_refused_naming_the_field_and_the_fix():
    problem = gpu_problem(2, "cuda", 1)
    assert problem is not None
    assert "train.processes is 2" in problem and "1 visible GPU" in problem
    assert "set train.processes: 1" in problem and "model.device: cpu" in problem


def test_one_process_per_gpu_and_cpu_processes_pass():
    assert gpu_problem(1, "cuda", 1) is None
    assert gpu_problem(8, "cuda", 8) is None
    assert gpu_problem(2, "cpu", 0) is None  # gloo processes share the CPU


def test_the_demo_trains_on_the_cpu_with_two_processes_on_any_machine():
    cfg = parse_config(DEMO_CONFIG, "<demo>")
    assert cfg.model.device == "cpu" and cfg.train.processes == 2
    assert gpu_problem(cfg.train.processes, cfg.model.device, 1) is None


def test_ranks_share_a_gpu_only_under_the_gloo_test_switch(monkeypatch):
    from tuneline.stages.train.collectives import CUDA_BACKEND_ENV

    monkeypatch.setenv(CUDA_BACKEND_ENV, "gloo")
    assert gpu_problem(2, "cuda", 1) is None  # gloo serves two ranks on one GPU (bench/gpu.py's DDP figure)
    assert gpu_problem(2, "cuda", 0) is not None
    monkeypatch.setenv(CUDA_BACKEND_ENV, "nccl")
    assert gpu_problem(2, "cuda", 1) is not None
