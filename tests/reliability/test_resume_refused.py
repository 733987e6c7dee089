"""An explicit train.resume of a checkpoint made with another optimizer is refused before any training process
starts (it once "resumed" and published a model whose optimizer state was AdamW's), naming both and the fix."""

from __future__ import annotations

import pytest
import yaml

from tests.reliability import faultlib as fl

pytestmark = pytest.mark.timeout(1200)


def test_resuming_an_adamw_checkpoint_with_another_optimizer_is_refused(workcopy, small_config, prefect_env, tmp_path):
    [trained] = fl.published(workcopy, "train")
    checkpoint = sorted((workcopy / "artifacts" / "train" / trained / "checkpoints").glob("step-*"))[-1]
    cfg = yaml.safe_load(small_config.read_text(encoding="utf-8"))
    assert cfg["train"]["optimizer"] == "adamw"
    cfg["train"] |= {"optimizer": "adafactor", "resume": str(checkpoint)}
    config = fl.write_config(tmp_path / "other-optimizer.yaml", cfg)
    out = fl.tuneline("stage", "train", str(config), "--workdir", str(workcopy), env=prefect_env)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert "train.optimizer adamw (the config says adafactor): set train.optimizer: adamw to continue it" in out.stderr
    assert "resumed from" not in out.stdout + out.stderr, "no training process started"
    assert fl.published(workcopy, "train") == {trained}
