"""train.parallelism fsdp loads the denoiser as a skeleton filled from the model folder (stages/train/fsdpload.py):
every parameter must come out as diffusers' from_pretrained gives it, in value and dtype, and a folder it cannot
read that way is refused before any training process starts, naming the folder and the command that fixes it.
One process: the load path is the sharded one with every row on this rank."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest
import torch

from tests.integration.test_train_support import small_config
from tuneline.stages.common.stage import StageContext
from tuneline.stages.families.registry import get_family
from tuneline.stages.train import fsdpload, launch

CPU = torch.device("cpu")
FAMILY = get_family("wan")  # its model class keeps modules in float32 whatever the dtype asked


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    return FAMILY.ensure_model(None, tmp_path_factory.mktemp("models"))


def test_skeleton_keeps_wan_float32_modules_as_from_pretrained(wan):
    want = dict(FAMILY.load_denoiser(wan, torch.bfloat16, CPU).named_parameters())  # a LoRA's frozen base
    den = fsdpload.skeleton(FAMILY)(wan, torch.bfloat16, CPU)
    fsdpload.materialize(den, wan / FAMILY.denoiser_component, fsdpload.unload(den), CPU)
    got = dict(den.named_parameters())
    assert got.keys() == want.keys()
    kept = {n for n, p in want.items() if p.dtype == torch.float32}
    # the modules WanTransformer3DModel declares, at the root and in each block
    assert {"scale_shift_table", "blocks.1.scale_shift_table", "blocks.0.norm2.weight"} <= kept
    assert any(n.startswith("condition_embedder.time_embedder.") for n in kept)
    assert any(p.dtype == torch.bfloat16 for p in want.values())
    for name, p in want.items():
        assert got[name].dtype == p.dtype, name
        assert torch.equal(got[name], p), name


def test_a_folder_without_safetensors_is_refused_before_launch_and_the_named_command_fixes_it(wan, tmp_path):
    user = tmp_path / "wan-bin"
    shutil.copytree(wan, user)
    sub = user / FAMILY.denoiser_component
    (sub / fsdpload.WEIGHTS).unlink()
    FAMILY.load_denoiser(wan, torch.float32, CPU).save_pretrained(sub, safe_serialization=False)
    cfg = small_config(
        tmp_path / "work",
        {"parallelism": "fsdp", "processes": 2, "validate_every": 0},
        model={"family": "wan", "path": str(user)},
    )
    work = tmp_path / "work" / "train" / ".v.partial"
    work.mkdir(parents=True)
    with pytest.raises(ValueError) as err:
        launch.build(StageContext(cfg), work, {})
    msg = str(err.value)
    assert f"{sub} has no {fsdpload.WEIGHTS}" in msg and "diffusion_pytorch_model.bin" in msg
    assert "set train.parallelism: ddp" in msg
    assert not list(work.parent.glob("*.spec-*.json"))  # refused before the worker's spec, so before torchrun
    command = re.search(r'python -c "(.+?)"', msg).group(1)
    subprocess.run([sys.executable, "-c", command], check=True, capture_output=True)
    fsdpload.check_weights(sub, FAMILY.denoiser_class.__name__)
    den = fsdpload.skeleton(FAMILY)(user, torch.float32, CPU)
    fsdpload.materialize(den, sub, fsdpload.unload(den), CPU)
    want = FAMILY.load_denoiser(wan, torch.float32, CPU).state_dict()
    assert all(torch.equal(p, want[n]) for n, p in den.named_parameters())
