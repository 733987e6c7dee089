"""Values no run can want are refused at load, naming the field: a learning rate past its optimizer's bound,
validation settings that would render for years; `tuneline plan --gpu-memory nan|inf` refuses in one line."""

from __future__ import annotations

import pytest

from tests.helpers import tuneline
from tuneline.schemas.config import ConfigError, parse_config


def _load(train: dict | None = None, validate: dict | None = None):
    return parse_config({"train": train or {}, "validate": validate or {}}, "<test>", workdir="/tmp/unused")


@pytest.mark.parametrize(
    ("train", "field"),
    [
        ({"learning_rate": 1e10}, "train.learning_rate 10000000000.0 with train.optimizer adamw"),
        ({"learning_rate": 0.5, "optimizer": "adafactor"}, "train.learning_rate 0.5 with train.optimizer adafactor"),
        (
            {"mode": "lora", "text_encoder_lora": True, "text_encoder_lr": 2.0},
            "train.text_encoder_lr 2.0 with train.optimizer adamw",
        ),
    ],
)
def test_a_learning_rate_past_its_optimizers_bound_is_refused(train, field):
    with pytest.raises(ConfigError, match="training diverges") as err:
        _load(train)
    assert field in str(err.value) and "set train." in str(err.value)


def test_learning_rates_users_train_with_load():
    for lr in (1e-6, 1e-4, 1e-3, 5e-2, 0.1):
        assert _load({"learning_rate": lr}).train.learning_rate == lr


@pytest.mark.parametrize(
    ("validate", "field"),
    [
        ({"steps": 10**9}, "validate.steps"),
        ({"check_steps": 10**9}, "validate.check_steps"),
        ({"check_seeds": 10**6}, "validate.check_seeds"),
        ({"guidance_scale": 1e6}, "validate.guidance_scale"),
        ({"resolution": 1e9}, "validate.resolution"),
    ],
)
def test_validation_settings_that_would_render_for_years_are_refused(validate, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        _load(validate=validate)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_plan_refuses_a_gpu_memory_that_is_no_number_in_one_line(value):
    out = tuneline("plan", "--gpu-memory", value, timeout=300)
    assert out.returncode == 1
    assert out.stderr.strip() == (
        f"error: --gpu-memory {float(value)}: give the card's memory in GiB, e.g. --gpu-memory 24"
    ), out.stderr
