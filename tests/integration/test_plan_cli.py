"""`tuneline plan`: a released model planned from its shipped config, no weights, no Prefect; exit 0 / 2."""

import pytest

from tests.helpers import tuneline


def test_plan_exit_codes_and_the_fix(tmp_path):
    cfg = tmp_path / "sdxl.yaml"
    cfg.write_text(
        "model: {family: sdxl, dtype: bfloat16}\ntrain: {mode: lora, batch_size: 1, processes: 1}\n"
        "buckets: {resolution: 1024}\n"
    )
    small = tuneline("plan", str(cfg), "--gpu-memory", "10", "--model-config", "sdxl", cwd=tmp_path)
    assert small.returncode == 2, small.stdout + small.stderr
    assert "does NOT fit" in small.stdout and "settings that would make it fit:" in small.stdout
    assert "train.gradient_checkpointing: true" in small.stdout  # 1024² activations are the excess here
    assert "planned peak" in small.stdout and "weights (bfloat16)" in small.stdout
    big = tuneline("plan", str(cfg), "--gpu-memory", "80", "--model-config", "sdxl", cwd=tmp_path)
    assert big.returncode == 0, big.stdout + big.stderr
    assert "-> fits" in big.stdout
    for config in ([str(cfg)], []):  # without CONFIG, the released model's user config is built from the name
        bad = tuneline("plan", *config, "--model-config", "Z-Image-Turbo", cwd=tmp_path)
        assert bad.returncode == 1 and "--model-config Z-Image-Turbo: not a shipped config" in bad.stderr, bad.stderr
        assert "z_image" in bad.stderr and "Traceback" not in bad.stderr


# (shipped config, transformer blocks, planned LoRA weights in GiB at bfloat16 within 1 %: the released sizes)
NEWER = [("qwen_image", 60, 38.05), ("z_image", 34, 11.46), ("flux2", 56, 60.02), ("flux2_klein", 25, 7.22)]


@pytest.mark.parametrize(("name", "blocks", "weights_gib"), NEWER)
def test_plan_newer_families_from_their_shipped_configs(name, blocks, weights_gib, tmp_path):
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(
        f"model: {{family: {name}, dtype: bfloat16}}\ntrain: {{mode: lora, batch_size: 1, processes: 1}}\n"
        "buckets: {resolution: 256}\n"
    )
    out = tuneline("plan", str(cfg), "--gpu-memory", "80", "--model-config", name, cwd=tmp_path)
    assert out.returncode in (0, 2), out.stdout + out.stderr
    assert f"transformer blocks: {blocks}" in out.stdout
    line = next(x for x in out.stdout.splitlines() if "weights (bfloat16)" in x)
    assert abs(float(line.split()[-2]) - weights_gib) / weights_gib < 0.01, line
