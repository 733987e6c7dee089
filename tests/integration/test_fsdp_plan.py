"""`tuneline plan --processes N` under train.parallelism fsdp: Qwen-Image's full fine-tune does not fit one 80 GB
GPU per process under DDP, the plan suggests FSDP on 8 processes, and that suggestion, run as printed, fits."""

import re

from tests.helpers import tuneline

QWEN_FULL = (
    "model: {family: qwen_image, dtype: bfloat16}\n"
    "train: {mode: full, batch_size: 1, gradient_checkpointing: true, validate_every: 0, parallelism: %s}\n"
    "buckets: {resolution: 1.0, resolution_type: area}\n"
)


def _plan(tmp_path, parallelism: str, processes: int):
    cfg = tmp_path / f"qwen-{parallelism}.yaml"
    cfg.write_text(QWEN_FULL % parallelism)
    args = ("plan", str(cfg), "--gpu-memory", "80", "--model-config", "qwen_image", "--processes", str(processes))
    return tuneline(*args, cwd=tmp_path)


def _gib(out: str, term: str) -> float:
    return float(re.search(rf"^  {re.escape(term)}.*?\s([\d.]+) GiB$", out, re.M).group(1))


def test_qwen_image_full_fine_tune_fits_8_by_80gb_under_fsdp(tmp_path):
    ddp = _plan(tmp_path, "ddp", 8)
    assert ddp.returncode == 2, ddp.stdout + ddp.stderr
    assert "train.parallelism: fsdp on 8 processes" in ddp.stdout, ddp.stdout
    fsdp = _plan(tmp_path, "fsdp", 8)
    assert fsdp.returncode == 0, fsdp.stdout + fsdp.stderr
    assert "-> fits" in fsdp.stdout and "FSDP gathered blocks" in fsdp.stdout
    # Weights, gradients and AdamW's state divide by the 8 shards; activations stay whole.
    assert abs(8 * _gib(fsdp.stdout, "optimizer state (adamw), sharded") - _gib(ddp.stdout, "optimizer state")) < 0.1
    assert _gib(fsdp.stdout, "activations") == _gib(ddp.stdout, "activations")
