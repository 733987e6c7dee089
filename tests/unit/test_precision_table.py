"""Every model.dtype x train.mixed_precision x device kind x train.mode the config allows: it trains (with the
autocast dtype it gets) or it is refused naming both fields and the fix. CPU cells run the trainer's own
autocast choice; CUDA cells are config-check cells (a config naming model.device cuda is refused at load) plus
the trainer's choice for the device type, which needs no GPU to compute."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from tuneline.schemas.config import ConfigError, parse_config
from tuneline.schemas.demo import DEMO_CONFIG
from tuneline.stages.train.memplan import amp_dtype
from tuneline.stages.train.model import attention_for_training, autocast_dtype, gpu_autocast

DTYPES = ("float32", "float16", "bfloat16")
MIXED = ("auto", "no", "bf16", "fp16")
MODES = ("lora", "full")


def expected(dtype: str, mixed: str, mode: str, device: str):
    """What the cell does: the autocast dtype it trains under (None: float32), "refused", or "any half" where
    auto picks by the GPU (bf16 where supported)."""
    if device == "cpu":
        if mixed in ("bf16", "fp16") or dtype == "float16":  # float16 on a CPU: refused at load (no kernels)
            return "refused"
        return None
    half = {"float16": torch.float16, "bfloat16": torch.bfloat16}
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}
    if mode == "lora" and dtype in half:  # the frozen base holds model.dtype: autocast must compute in it
        if mixed == "no" or autocast.get(mixed, half[dtype]) != half[dtype]:
            return "refused"
        return half[dtype]
    return {"no": None, "auto": "any half", **autocast}[mixed]


def config(dtype: str, mixed: str, mode: str, device: str) -> dict:
    data = copy.deepcopy(DEMO_CONFIG)
    data["model"] = {**data["model"], "dtype": dtype, "device": device}
    data["train"] = {**data["train"], "mixed_precision": mixed, "mode": mode}
    return data


@pytest.mark.parametrize("dtype,mixed,mode,device", list(itertools.product(DTYPES, MIXED, MODES, ("cpu", "cuda"))))
def test_every_precision_combination_trains_or_is_refused_naming_both_fields(dtype, mixed, mode, device):
    want = expected(dtype, mixed, mode, device)
    if want == "refused":
        with pytest.raises(ConfigError) as err:
            parse_config(config(dtype, mixed, mode, device), "<table>")
        msg = str(err.value)
        assert "model.dtype" in msg or "model.device" in msg, msg
        assert "train.mixed_precision" in msg or dtype == "float16", msg
        if device == "cuda" or mixed in ("bf16", "fp16"):
            with pytest.raises(ValueError, match="train.mixed_precision"):  # the trainer's own check agrees
                autocast_dtype(mixed, torch.device(device), dtype, mode)
        return
    cfg = parse_config(config(dtype, mixed, mode, device), "<table>")
    if device == "cuda":  # the memory planner assumes the trainer's choice on a bf16-capable GPU
        planned = amp_dtype(cfg, autocast=mixed != "no")
        assert planned == (gpu_autocast(mixed, dtype, bf16_supported=True) if want == "any half" else want)
    if want == "any half":
        return  # auto with float32 weights asks the GPU whether it has bfloat16: the GPU run's cell
    assert autocast_dtype(mixed, torch.device(device), dtype, mode) == want


def test_a_cuda_training_device_leaves_cudnn_out_of_attention_and_a_cpu_one_changes_nothing():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        attention_for_training(torch.device("cpu"))
        assert torch.backends.cuda.cudnn_sdp_enabled()
        attention_for_training(torch.device("cuda"))
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
