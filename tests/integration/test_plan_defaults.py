"""`tuneline plan` plans what a user would run: --model-config alone is LoRA, bf16, batch 1 at the model's usual
resolution, said on its first line; a config asking for CUDA on a machine without one plans a card instead of
failing."""

from __future__ import annotations

import pytest
import torch
import yaml

from tests.helpers import tuneline


def test_model_config_alone_plans_a_lora_at_the_models_resolution_and_names_fixes(tmp_path):
    out = tuneline("plan", "--model-config", "sd15", "--gpu-memory", "24", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    first = out.stdout.splitlines()[0]
    assert first == (
        "planned: sd15, LoRA (rank 8), bfloat16, 512 px edge (pixel), batch 1 per process, 1 process, "
        "on a 24 GiB CUDA GPU"
    )
    assert "weights (bfloat16)" in out.stdout and "512x512" in out.stdout
    assert "float32" not in out.stderr and "Traceback" not in out.stderr  # no cast warning
    small = tuneline("plan", "--model-config", "sd15", "--gpu-memory", "3", cwd=tmp_path)
    assert small.returncode == 2 and "settings that would make it fit:" in small.stdout, small.stdout
    fixes = small.stdout.split("settings that would make it fit:")[1].strip().splitlines()
    assert fixes and all("planned peak" in f for f in fixes), small.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="plans the case of a machine without a GPU")
def test_a_cuda_config_without_a_gpu_plans_a_card(tmp_path):
    cfg = yaml.safe_load(tuneline("config", "example").stdout)
    cfg["model"]["device"] = "cuda"
    cfg["train"]["processes"] = 1
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    out = tuneline("plan", "c.yaml", cwd=tmp_path)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stdout + out.stderr
    first = out.stdout.splitlines()[0]
    assert first.startswith("planned: tiny, full fine-tune, float32, 64 px edge (pixel), batch 8 per process")
    assert "a 24 GiB CUDA GPU (model.device is cuda and no GPU is visible here" in first
